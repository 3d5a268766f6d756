"""The leader's control loop against real etcd and the test broker over real HTTP."""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar, cast

import anyio
import pytest
import structlog
import structlog.testing

from controllerd.adapters import store as store_module
from controllerd.adapters.audit import AuditSink
from controllerd.adapters.broker import BrokerClient, BrokerError, BrokerUnavailable, Unauthorized
from controllerd.adapters.election import Leadership, current_leader, lead
from controllerd.adapters.store import Delete, KeyValue, Put, Store, open_store
from controllerd.core.layout import initial_layout, prune, split
from controllerd.core.model import Decision, Layout, PolicySettings, TopicName, layout_from_json
from controllerd.core.shards import shard_of
from controllerd.core.view import Change, Keys, LoadTable, MetadataView, TopicState
from controllerd.daemon import controller as controller_module
from controllerd.daemon.clock import ManualClock
from controllerd.daemon.controller import Controller
from controllerd.daemon.metrics import Metrics
from tests.support.broker import layout_json
from tests.support.etcd import EtcdServer
from tests.support.harness import TOPIC, Harness, eventually, make_config, open_harness
from tests.support.populate import load_record, populate, topic_names
from tests.support.proxy import TcpProxy, serve_proxy

HOT = 30_000.0  # 3x the default split threshold
COLD = 10.0


def active_count(h: Harness) -> int:
    return len(h.layout().active_segments())


async def split_a_hot_topic(h: Harness) -> int:
    """A one-segment topic goes hot and is split 3 ways; when (ms) the split was done."""
    await h.add_topic(segments=1)
    await h.put_load(0, HOT)
    await eventually(lambda: active_count(h) == 3)
    await eventually(lambda: not h.controller.status()["in_flight"])
    return h.clock.now_ms()


async def stored_json(store: Store, key: str) -> object:
    kv = await store.get(key)
    return json.loads(kv.value) if kv is not None else None


# --- events, not ticks ----------------------------------------------------------------------


async def test_consumer_registration_splits_without_waiting_for_a_tick(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
        await h.add_topic(segments=1)
        await h.add_subscription("s")
        await h.register("s", "c1")
        await h.register("s", "c2")
        await eventually(lambda: h.requests("/split/") == 1)
        assert h.clock.monotonic() == 0.0  # no tick, no cooldown passed: the event did it
        assert active_count(h) == 2
        assert h.count("controllerd_decisions_total", action="split", reason="consumer-count") == 1


async def test_a_consumer_burst_settles_into_one_split(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with open_harness(etcd_server.endpoint, etcd_prefix, settle=0.05) as h:
        await h.add_topic(segments=1)
        await h.add_subscription("s")
        for i in range(4):
            await h.register("s", f"c{i}")
        await eventually(
            lambda: (
                h.view_layout() is not None
                and len(h.controller.view.topics[TOPIC].consumers.get("s", ())) == 4
            )
        )
        assert h.requests("/split/") == 0  # still settling
        await h.clock.advance(0.05)
        await eventually(lambda: h.requests("/split/") == 1)
        assert active_count(h) == 4  # one decision, a segment per consumer


async def register_consumers(h: Harness, numbers: range) -> None:
    """Register consumers c<i> of subscription s, and wait until the view has them all."""
    for i in numbers:
        await h.register("s", f"c{i}")

    def registered() -> bool:
        state = h.controller.view.topics.get(TOPIC)
        return state is not None and len(state.consumers.get("s", ())) == numbers.stop

    await eventually(registered)


async def test_a_tick_inside_the_settle_window_waits_for_it(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """Registrations spread over the window are one decision, even with a tick inside
    it (the e2e test saw 3 children of 4 when a tick came between registrations)."""
    async with open_harness(etcd_server.endpoint, etcd_prefix, settle=2.0, interval=1.0) as h:
        await h.add_topic(segments=1)
        await h.add_subscription("s")
        await register_consumers(h, range(2))
        await eventually(lambda: h.view_layout() is not None)
        ticks = h.controller._ticks
        await h.clock.advance(1.0)  # a tick, inside the window
        await eventually(lambda: h.controller._ticks == ticks + 1)
        await eventually(lambda: not h.controller.status()["queued"])
        assert h.requests("/split/") == 0
        await register_consumers(h, range(2, 4))
        await h.clock.advance(1.0)  # the window closes
        await eventually(lambda: h.requests("/split/") == 1)
        assert active_count(h) == 4


async def test_an_evaluation_queued_before_the_settle_window_waits_for_it(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A CI run split 2 ways inside the window: an evaluation queued before the first
    registration ran during it. Held in flight here, so the race is not left to timing."""
    GatedController.gate = anyio.Event()
    async with open_harness(
        etcd_server.endpoint,
        etcd_prefix,
        settle=2.0,
        interval=3600.0,
        controller_class=GatedController,
    ) as h:
        controller = h.controller
        assert isinstance(controller, GatedController)
        await h.add_topic(segments=1)
        await eventually(lambda: getattr(controller, "calls", 0) == 1)  # held in flight
        await h.add_subscription("s")
        await register_consumers(h, range(2))
        GatedController.gate.set()  # the evaluation begun before the window now runs
        await eventually(lambda: not h.controller.status()["in_flight"])
        assert h.requests("/split/") == 0
        await register_consumers(h, range(2, 4))
        await h.clock.advance(2.0)  # the window closes
        await eventually(lambda: h.requests("/split/") == 1)
        assert active_count(h) == 4


async def test_hot_load_record_splits_k_ways_at_once(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
        await h.add_topic(segments=1)
        await h.put_load(0, HOT)
        await eventually(lambda: h.requests("/split/") == 1)
        assert active_count(h) == 3
        split = next(r for r in h.broker_state.requests if "/split/" in r.path)
        assert split.headers["x-fencing-token"] == str(h.leadership.token)
        # the new layout arrives on the watch; the cooldown is stamped in etcd
        await eventually(lambda: not h.controller.status()["in_flight"])
        stamp = await stored_json(h.store, h.keys.cooldown(TOPIC))
        assert stamp == {"lastSplitAtMs": h.clock.now_ms(), "lastMergeAtMs": -1}


class GatedController(Controller):
    """Counts evaluations and holds the first one until the test opens the gate."""

    gate: anyio.Event
    calls: int

    async def evaluate(self, topic: TopicName) -> Decision | None:
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 1:
            await self.gate.wait()
        return await super().evaluate(topic)


async def test_a_burst_of_triggers_during_an_evaluation_reruns_exactly_once(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    GatedController.gate = anyio.Event()
    async with open_harness(
        etcd_server.endpoint, etcd_prefix, controller_class=GatedController
    ) as h:
        controller = h.controller
        assert isinstance(controller, GatedController)
        await h.add_topic(segments=4)
        await eventually(lambda: getattr(controller, "calls", 0) == 1)  # held in flight
        for sid in range(4):
            for rate in (1.0, 2.0, 3.0):
                await h.put_load(sid, rate)
        await eventually(
            lambda: (
                TOPIC in h.controller.view.topics
                and len(h.controller.view.topics[TOPIC].loads) == 4
            )
        )
        assert controller.calls == 1
        GatedController.gate.set()
        await eventually(lambda: not h.controller.status()["in_flight"])
        assert controller.calls == 2


# --- failures -------------------------------------------------------------------------------


async def test_failed_split_releases_the_guard_burns_no_cooldown_and_retries(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
        await h.add_topic(segments=1)
        h.broker_state.fail_next = [503]
        await h.put_load(0, HOT)
        await eventually(
            lambda: h.count("controllerd_operations_total", op="split", outcome="unavailable") == 1
        )
        await eventually(lambda: not h.controller.status()["in_flight"])
        assert active_count(h) == 1
        assert await h.store.get(h.keys.cooldown(TOPIC)) is None
        assert h.controller.view.topics[TOPIC].cooldown is None
        # Another trigger during the backoff decides again, says so, acts on nothing.
        with structlog.testing.capture_logs() as logs:
            await h.put_load(0, HOT - 1)
            await eventually(lambda: any(e["event"] == "decision.deferred" for e in logs))
        (deferred,) = [e for e in logs if e["event"] == "decision.deferred"]
        assert (deferred["action"], deferred["topic"]) == ("split", str(TOPIC))
        assert h.count("controllerd_decisions_total", action="split", reason="msgRateIn") == 1
        assert h.requests("/split/") == 1
        await h.clock.advance(1.0)  # the retry backoff, not the 60 s tick
        await eventually(
            lambda: h.count("controllerd_operations_total", op="split", outcome="ok") == 1
        )
        assert active_count(h) == 3
        await _eventually_stored(h.store, h.keys.cooldown(TOPIC))


async def test_malformed_layout_and_load_records_are_skipped_and_counted(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
        await h.add_topic(segments=1)
        other = TopicName("acme", "ns", "broken")
        await h.store.put(h.keys.layout(other), b'{"segments": "nope"}')
        await h.store.put(h.keys.load(TOPIC, 0), b'{"msgRateIn": "very hot"}')
        await h.store.put(h.keys.load(TOPIC, 1), b"\xff not JSON")
        # the label says why, in a word (the log line says what exactly)
        await eventually(
            lambda: h.count("controllerd_load_records_rejected_total", reason="invalid") == 1
        )
        await eventually(
            lambda: h.count("controllerd_load_records_rejected_total", reason="unparsable") == 1
        )
        await eventually(
            lambda: h.count("controllerd_layouts_rejected_total", reason="invalid") == 1
        )
        assert h.controller.view.topics[other].layout is None
        await h.put_load(0, HOT)  # the controller carries on
        await eventually(lambda: h.requests("/split/") == 1)


# --- cooldowns and failover -----------------------------------------------------------------


async def test_cooldown_survives_failover_even_after_gc_pruned_the_parent(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with open_store([etcd_server.endpoint]) as store:
        async with open_harness(etcd_server.endpoint, etcd_prefix, store=store) as h1:
            split_at = await split_a_hot_topic(h1)
            layout = prune(h1.layout(), [0])  # GC forgot the parent: nothing to seed from
        async with open_harness(
            etcd_server.endpoint, etcd_prefix, store=store, replica="test-2"
        ) as h2:
            assert h2.leadership.token > h1.leadership.token
            h2.broker_state.topics[TOPIC] = layout
            await store.put(h2.keys.layout(TOPIC), layout_json(layout))
            h2.clock._start_ms = split_at + 10_000  # 10 s after the split, new leader
            await h2.put_load(1, HOT)
            await eventually(
                lambda: (
                    h2.count("controllerd_decisions_total", action="none", reason="split-cooldown")
                    >= 1
                )
            )
            assert h2.requests("/split/") == 0
            await h2.clock.advance(50.0)  # the 60 s cooldown ends: the follow-up tick
            await h2.put_load(1, HOT)
            await eventually(lambda: h2.requests("/split/") == 1)


# --- GC -------------------------------------------------------------------------------------

# GC rounds run when the tests call them; the ticker's own round is tested on its own.
RETENTION = "[gc]\ndefault_retention_seconds = 600\ninterval_seconds = 1e9\n"


async def _split_topic(h: Harness, *, subscription: bool = True) -> None:
    await h.add_topic(segments=1)
    if subscription:
        await h.add_subscription("s")
    await h.put_load(0, HOT)
    await eventually(lambda: active_count(h) == 3)
    await eventually(lambda: (h.view_layout() or h.layout()).epoch == 1)
    await eventually(lambda: not h.controller.status()["in_flight"])


async def test_gc_keeps_a_segment_within_retention_or_with_backlog(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=RETENTION) as h:
        await _split_topic(h)
        parent = h.layout().segments[0]
        await h.clock.advance(599.0)
        await h.controller.gc_round()
        assert 0 in h.layout().segments and h.requests(parent.descriptor) == 0
        h.broker_state.backlogs[(TOPIC, parent.descriptor, "s")] = 7
        await h.clock.advance(10.0)
        await h.controller.gc_round()
        assert h.broker_state.deleted_segments == set()
        stored = layout_from_json(await stored_json(h.store, h.keys.layout(TOPIC)))
        assert 0 in stored.segments
        assert await h.store.get(h.keys.pending_delete(TOPIC, parent.descriptor)) is None
        # drained: pruned from the layout, data deleted, load record and marker gone
        h.broker_state.backlogs[(TOPIC, parent.descriptor, "s")] = 0
        await h.controller.gc_round()
        stored = layout_from_json(await stored_json(h.store, h.keys.layout(TOPIC)))
        assert 0 not in stored.segments and stored.epoch == 2
        assert (TOPIC, parent.descriptor) in h.broker_state.deleted_segments
        assert await h.store.get(h.keys.load(TOPIC, 0)) is None
        assert await h.store.get(h.keys.pending_delete(TOPIC, parent.descriptor)) is None
        assert h.count("controllerd_gc_pruned_segments_total") == 1


async def test_gc_delete_failure_keeps_the_marker_and_retries_next_tick(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=RETENTION) as h:
        await _split_topic(h, subscription=False)  # no backlog calls: DELETE comes first
        parent = h.layout().segments[0]
        await h.clock.advance(700.0)
        h.broker_state.fail_next = [503]
        await h.controller.gc_round()
        stored = layout_from_json(await stored_json(h.store, h.keys.layout(TOPIC)))
        assert 0 not in stored.segments  # pruned: the point of no return ...
        marker = h.keys.pending_delete(TOPIC, parent.descriptor)
        assert await h.store.get(marker) is not None  # ... but never orphaned
        await h.controller.gc_round()
        assert await h.store.get(marker) is None
        assert (TOPIC, parent.descriptor) in h.broker_state.deleted_segments


@contextlib.asynccontextmanager
async def behind_a_proxy(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    store: Store,
    controller_class: type[Controller],
    extra_config: str = "",
) -> AsyncIterator[tuple[Harness, TcpProxy]]:
    """A leader that reaches etcd through a proxy the test can cut; its lease is kept on
    the test's own connection, so a cut fails its writes without deposing it."""
    cfg = make_config(etcd_prefix, extra_config)
    keys = Keys(cfg.metadata_prefix, cfg.controller_root)
    async with (
        serve_proxy(etcd_server.endpoint) as proxy,
        open_store([proxy.endpoint], timeout=0.5, retry_for=0.5) as through,
        lead(store, keys.leader, {"replica": "test-1"}, ttl=30) as leadership,
        open_harness(
            proxy.endpoint,
            etcd_prefix,
            extra_config=extra_config,
            store=through,
            leadership=leadership,
            controller_class=controller_class,
        ) as h,
    ):
        yield h, proxy


PROBE_KEY = "/controllerd-test-probe"  # read only to learn that etcd answers


async def _pass_again(proxy: TcpProxy, through: Store) -> None:
    """Heal the proxy and wait until the store behind it reads again: its channel
    reconnects on grpc's own backoff, which a loaded host stretches past one retry
    round (a GC round would then find the markers unreadable and end early)."""
    await proxy.set_mode("pass")
    with anyio.fail_after(30):
        while True:
            try:
                await through.get(PROBE_KEY)
                return
            except store_module.StoreError:
                continue


class RefusedMarkerClear(Controller):
    """Cuts etcd (its proxy) just before each write that clears a pending-delete marker,
    while ``armed``: the broker has deleted the data, etcd refuses the cleanup."""

    proxy: TcpProxy
    armed = True

    async def _fenced_write(self, leadership: Leadership, ops: list[Put | Delete]) -> bool:
        markers = self._keys.pending_deletes_prefix
        if self.armed and any(isinstance(op, Delete) and op.key.startswith(markers) for op in ops):
            await self.proxy.set_mode("refuse")
        return await super()._fenced_write(leadership, ops)


async def test_etcd_refusing_a_marker_cleanup_is_retried_and_never_stops_the_daemon(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store
) -> None:
    """A marker left by a delete whose cleanup etcd refused is retried at the start of
    every GC round; an etcd outage at that point is logged and retried, not raised (it
    reached the task group and exited the process)."""
    async with behind_a_proxy(etcd_server, etcd_prefix, store, RefusedMarkerClear, RETENTION) as (
        h,
        proxy,
    ):
        RefusedMarkerClear.proxy, RefusedMarkerClear.armed = proxy, True
        await _split_topic(h, subscription=False)
        parent = h.layout().segments[0]
        marker = h.keys.pending_delete(TOPIC, parent.descriptor)
        await h.clock.advance(700.0)
        with structlog.testing.capture_logs() as logs:
            await h.controller.gc_round()  # pruned and deleted; the cleanup is refused
            await _pass_again(proxy, h.store)
            await h.controller.gc_round()  # the marker is retried, refused again
            await _pass_again(proxy, h.store)
        assert (TOPIC, parent.descriptor) in h.broker_state.deleted_segments
        assert await store.get(marker) is not None
        assert [e["event"] for e in logs].count("gc.marker.clear_failed") == 2
        RefusedMarkerClear.armed = False
        await h.controller.gc_round()
        assert await store.get(marker) is None


async def test_gc_asks_for_the_backlog_of_a_subscription_whose_value_is_malformed(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A subscription key the view cannot read still names a subscription: GC keeps
    the segments it has not drained (without it the topic looked subscription-free,
    which counts as drained), and prunes them once the broker reports it drained."""
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=RETENTION) as h:
        await _split_topic(h, subscription=False)
        parent = h.layout().segments[0]
        h.broker_state.subscriptions.setdefault(TOPIC, {})["q"] = "STREAM"
        h.broker_state.backlogs[(TOPIC, parent.descriptor, "q")] = 5
        await h.store.put(h.keys.subscription(TOPIC, "q"), b'{"type": "KEY_SHARED"}')
        rejected = "controllerd_metadata_rejected_total"
        await eventually(lambda: h.count(rejected, kind="subscription") == 1)
        await h.clock.advance(700.0)
        await h.controller.gc_round()
        assert h.requests(f"{parent.descriptor}/subscription/q/backlog") >= 1
        assert 0 in h.layout().segments and h.broker_state.deleted_segments == set()
        h.broker_state.backlogs[(TOPIC, parent.descriptor, "q")] = 0
        await h.controller.gc_round()
        assert (TOPIC, parent.descriptor) in h.broker_state.deleted_segments


async def test_a_malformed_pending_delete_marker_is_refused_once_not_every_gc_round(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """GC reads its markers afresh every round; a bad one was parsed, counted and logged
    again each round (50,000 of them: 200,000 warnings in 40 s and stalls of ~5 s)."""
    async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
        await h.add_topic()
        for n in range(3):
            await h.store.put(h.keys.pending_delete(TOPIC, f"0000-ffff-{n}"), b"not json")
        rejected = "controllerd_metadata_rejected_total"
        await eventually(lambda: h.count(rejected, kind="pending_delete") == 3)  # the watch
        await h.controller.gc_round()
        assert h.count(rejected, kind="pending_delete") == 6  # GC's own reading, once
        await h.controller.gc_round()
        await h.controller.gc_round()
        assert h.count(rejected, kind="pending_delete") == 6
        # a new version of a marker is judged again
        await h.store.put(h.keys.pending_delete(TOPIC, "0000-ffff-0"), b"still not json")
        await eventually(lambda: h.count(rejected, kind="pending_delete") == 7)
        await h.controller.gc_round()
        assert h.count(rejected, kind="pending_delete") == 8


class SlowGC(Controller):
    """Each topic's GC round first waits ``wait`` s (as on a slow broker), on a loop that
    always counts as contended, so background work is paced."""

    wait = 0.2

    def _contended(self) -> bool:
        return True

    async def _gc_topic(self, state: TopicState, leadership: Leadership) -> None:
        await anyio.sleep(self.wait)
        await super()._gc_topic(state, leadership)


async def test_gc_waiting_on_the_broker_is_not_charged_to_the_pacer_as_loop_time(
    etcd_server: EtcdServer, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GC paces itself by what it costs the loop. Its waits for the broker and etcd held
    no loop; charged as loop time, 0.2 s of waiting parked GC (and the background feeder,
    which shares the bucket) for another ~0.2 s."""
    monkeypatch.setattr(controller_module, "SLICE", 2)  # a turn after every second topic
    async with open_harness(
        etcd_server.endpoint, etcd_prefix, extra_config=RETENTION, controller_class=SlowGC
    ) as h:
        other = TopicName("acme", "ns", "other")
        await h.add_topic()
        await h.add_topic(other)
        await eventually(lambda: {TOPIC, other} <= h.controller.view.topics.keys())
        paced = "controllerd_background_paced_seconds_total"
        before = h.count(paced)
        await h.controller.gc_round()
        assert h.count(paced) - before < SlowGC.wait / 4


# GC asks one topic's backlogs concurrently, at most GC_BACKLOG_CALLS at once. These run
# GC past retention at once (retention 0), so no clock advance and no tick intervenes.
AT_ONCE = "[gc]\ndefault_retention_seconds = 0\ninterval_seconds = 1e9\n"
#: Generous: a held call waits for the others, so sequential calls wait here forever.
GATE_SECONDS = 10.0


async def _sealed_roots(
    h: Harness, roots: int, subscriptions: int, topic: TopicName = TOPIC
) -> Layout:
    """``topic`` with ``roots`` segments, each split once, and ``subscriptions``
    subscriptions (``s0``, ``s1``, ...): ``roots`` sealed candidates, none a parent of
    another (each is pruned or kept on its own), ``roots * subscriptions`` backlog calls."""
    now = h.clock.now_ms()
    layout = initial_layout(roots, now)
    for sid in range(roots):
        layout = split(layout, sid, now_ms=now)
    h.broker_state.topics[topic] = layout
    for n in range(subscriptions):
        await h.add_subscription(f"s{n}", topic=topic)
    await h.store.put(h.keys.layout(topic), layout_json(layout))

    def seen() -> bool:
        state = h.controller.view.topics.get(topic)
        return (
            state is not None
            and state.layout == layout
            and len(state.subscriptions) == subscriptions
        )

    await eventually(seen)
    return layout


async def _stored_segments(h: Harness, topic: TopicName = TOPIC) -> set[int]:
    layout = layout_from_json(await stored_json(h.store, h.keys.layout(topic)))
    return set(layout.segments)


def _sealed_roots_pruned(layout: Layout, stored: set[int]) -> bool:
    """Every sealed segment of ``layout`` is gone from ``stored``, every active one is left."""
    return stored == {s.segment_id for s in layout.active_segments()}


class HeldBacklogs:
    """Stands in for the broker client's ``backlog`` on ``topic`` (other topics pass
    straight through): holds every call until ``hold`` are in flight at once, then
    asks the broker (or, with ``answer=False``, waits until cancelled). Raises
    ``fail[(descriptor, subscription)]`` instead of asking. Counts the calls in flight,
    the most at once and those cancelled."""

    def __init__(
        self,
        broker: BrokerClient,
        hold: int,
        *,
        topic: TopicName = TOPIC,
        fail: Mapping[tuple[str, str], Exception] | None = None,
        answer: bool = True,
    ) -> None:
        self._ask = broker.backlog
        self._hold = hold
        self._topic = topic
        self._fail = dict(fail or {})
        self._answer = answer
        self.full = anyio.Event()
        self.asked: list[tuple[str, str]] = []
        self.in_flight = 0
        self.most = 0
        self.cancelled = 0

    async def backlog(self, topic: TopicName, descriptor: str, subscription: str) -> int | None:
        if topic != self._topic:
            return await self._ask(topic, descriptor, subscription)
        self.asked.append((descriptor, subscription))
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        if self.in_flight >= self._hold:
            self.full.set()
        try:
            await self.full.wait()
            if not self._answer:
                await anyio.sleep_forever()
            failure = self._fail.get((descriptor, subscription))
            if failure is not None:
                raise failure
            return await self._ask(topic, descriptor, subscription)
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1


async def test_a_subscription_known_only_through_consumers_that_left_holds_no_gc_back(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A consumer registered under a subscription with no key of its own, then left:
    the view kept an empty set for the subscription, GC asked its backlog (the broker
    has no such subscription: 404, unknown), and the topic was never pruned again."""
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=AT_ONCE) as h:
        layout = await _sealed_roots(h, roots=1, subscriptions=1)
        key = h.keys.consumer(TOPIC, "keyless", "c1")
        await h.store.put(key, b"{}")
        state = h.controller.view.topics[TOPIC]
        await eventually(lambda: state.consumer_counts().get("keyless") == 1)
        await h.store.delete(key)
        await eventually(lambda: not state.consumer_counts().get("keyless"))
        await h.controller.gc_round()
        assert h.requests("subscription/keyless") == 0
        assert _sealed_roots_pruned(layout, await _stored_segments(h))


async def test_a_deleted_topic_leaves_no_scope_cached_in_sharded_mode(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """Forgetting a deleted topic asked its scope, which cached it again: in sharded
    mode one entry stayed for every topic ever deleted."""
    async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
        sharded = Controller(
            config=lambda: h.config,
            store=h.store,
            broker=h.broker,
            view=MetadataView(h.keys),
            metrics=Metrics(),
            audit=AuditSink(),
            clock=h.clock,
            replica="sharded",
            shards=16,
        )
        for n in range(100):
            sharded.note(Change("layout", TopicName("acme", "ns", f"gone-{n}"), False))
        assert sharded._scope_cache == {}


_C = TypeVar("_C", bound=Controller)


def offline(cls: type[_C], shards: int | None = None) -> _C:
    """A controller of class ``cls`` with no config, etcd or broker: for the parts that
    need none of them."""
    return cls(
        config=cast(Any, None),
        store=cast(Any, None),
        broker=cast(Any, None),
        view=MetadataView(Keys("/p", "/c")),
        metrics=Metrics(),
        audit=AuditSink(),
        clock=ManualClock(),
        replica="r",
        shards=shards,
    )


class CountingScopes(Controller):
    """Counts scope lookups: the work a revoke does per topic."""

    lookups = 0

    def scope_of(self, topic: TopicName) -> int | None:
        self.lookups += 1
        return super().scope_of(topic)


async def test_revoking_a_shard_walks_only_that_shards_first_pass() -> None:
    """Each revoke rebuilt the whole first pass, every topic of every shard, to drop one
    shard's: a replica losing 128 of its 256 shards with 100,000 topics left to evaluate
    held the event loop 14 s. A revoke now costs its own shard's topics only."""
    shards = 64
    c = offline(CountingScopes, shards=shards)
    for shard in range(shards):
        c.grant(shard, Leadership(token=1, lease_id=0, identity={}, lost=anyio.Event()))
    names = topic_names(5_000)
    c.start_partial()
    c.whole(names)  # every topic whole, queued for its first evaluation
    assert c._first_pass == set(names)
    c.lookups = 0
    for shard in range(0, shards, 2):
        c.revoke(shard)
    assert c.lookups == 0  # no walk over the topics (none is in flight)
    assert c._first_pass == {t for t in names if shard_of(t, shards) % 2 == 1}
    for shard in range(1, shards, 2):
        c.revoke(shard)
    assert c._first_pass == set() and c.lookups == 0


def _failed_call(message: str, kind: type[BrokerError] = BrokerUnavailable) -> BrokerError:
    return kind(message, method="GET", url="/admin/v2/segments/backlog")


async def test_gc_asks_a_topics_backlogs_concurrently(
    etcd_server: EtcdServer, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every backlog answer is held until all six calls of the topic are in flight at
    once: asked one after another (one HTTP round trip, up to a timeout with retries,
    each), the first would wait for the others forever."""
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=AT_ONCE) as h:
        layout = await _sealed_roots(h, roots=2, subscriptions=3)
        gate = HeldBacklogs(h.broker, hold=6)
        monkeypatch.setattr(h.broker, "backlog", gate.backlog)
        with anyio.fail_after(GATE_SECONDS):
            await h.controller.gc_round()
        assert gate.most == 6 and len(gate.asked) == len(set(gate.asked)) == 6
        assert h.requests("/backlog") == 6  # each asked of the broker, once
        assert _sealed_roots_pruned(layout, await _stored_segments(h))
        assert {(TOPIC, layout.segments[sid].descriptor) for sid in (0, 1)} <= (
            h.broker_state.deleted_segments
        )


async def test_gc_never_has_more_backlog_calls_in_flight_than_its_bound(
    etcd_server: EtcdServer, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A topic with more than twice as many backlog calls as the bound: the calls fill
    the bound (the answers are held until they do) and never exceed it, each is asked
    once, and the topic is collected."""
    bound = controller_module.GC_BACKLOG_CALLS
    roots, subscriptions = 4, bound // 2 + 1
    calls = roots * subscriptions
    assert calls > 2 * bound
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=AT_ONCE) as h:
        layout = await _sealed_roots(h, roots, subscriptions)
        gate = HeldBacklogs(h.broker, hold=bound)
        monkeypatch.setattr(h.broker, "backlog", gate.backlog)
        with anyio.fail_after(GATE_SECONDS):
            await h.controller.gc_round()
        assert gate.most == bound
        assert len(gate.asked) == len(set(gate.asked)) == calls
        assert h.requests("/backlog") == calls
        assert _sealed_roots_pruned(layout, await _stored_segments(h))


async def test_a_failed_backlog_call_among_many_keeps_only_its_segment(
    etcd_server: EtcdServer, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls in flight together, two of them failing: each failure makes that backlog
    unknown, so its segment is kept, and is logged; a refused credential is also an
    operator error. The other segments are decided on their own answers."""
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=AT_ONCE) as h:
        layout = await _sealed_roots(h, roots=4, subscriptions=3)
        unavailable, refused = layout.segments[1].descriptor, layout.segments[2].descriptor
        h.broker_state.backlogs[(TOPIC, layout.segments[3].descriptor, "s0")] = 5
        fail = {
            (unavailable, "s1"): _failed_call("gave up after 6 attempts"),
            (refused, "s2"): _failed_call("HTTP 403", Unauthorized),
        }
        gate = HeldBacklogs(h.broker, hold=12, fail=fail)
        monkeypatch.setattr(h.broker, "backlog", gate.backlog)
        with structlog.testing.capture_logs() as logs, anyio.fail_after(GATE_SECONDS):
            await h.controller.gc_round()
        assert gate.most == 12 and len(gate.asked) == 12
        stored = await _stored_segments(h)
        assert 0 not in stored and {1, 2, 3} <= stored  # 3 kept by its backlog
        assert h.broker_state.deleted_segments == {(TOPIC, layout.segments[0].descriptor)}
        failed = [
            (e["segment"], e["subscription"]) for e in logs if e["event"] == "gc.backlog.failed"
        ]
        assert sorted(failed) == [(1, "s1"), (2, "s2")]
        assert h.count("controllerd_operator_errors_total", kind="broker-auth") == 1
        verdicts = {e["segment"]: e["reason"] for e in logs if e["event"] == "gc.verdict"}
        assert verdicts == {0: "drained", 1: "not-drained", 2: "not-drained", 3: "backlog"}


@pytest.mark.parametrize("error", [ValueError("bad answer"), TypeError("bad type")])
async def test_another_error_from_a_backlog_call_fails_only_its_topic_as_before(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
) -> None:
    """An exception that is not a :class:`BrokerError` reaches ``gc_round`` as itself,
    not wrapped in an exception group: the topic is logged as failed and not pruned,
    its other calls in flight are cancelled, and the round goes on to the next topic."""
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=AT_ONCE) as h:
        layout = await _sealed_roots(h, roots=2, subscriptions=3)
        other = TopicName("acme", "ns", "other")  # after TOPIC in the round
        other_layout = await _sealed_roots(h, roots=1, subscriptions=1, topic=other)
        fail = {(layout.segments[0].descriptor, "s0"): error}
        gate = HeldBacklogs(h.broker, hold=6, fail=fail)
        monkeypatch.setattr(h.broker, "backlog", gate.backlog)
        with structlog.testing.capture_logs() as logs, anyio.fail_after(GATE_SECONDS):
            await h.controller.gc_round()
        failed = [e for e in logs if e["event"] == "gc.topic.failed"]
        assert [(e["topic"], e["error"]) for e in failed] == [(str(TOPIC), str(error))]
        assert gate.cancelled == 5 and gate.in_flight == 0
        assert await _stored_segments(h) == set(layout.segments)
        assert _sealed_roots_pruned(other_layout, await _stored_segments(h, other))


async def test_an_error_gc_round_does_not_handle_still_leaves_it_unwrapped(
    etcd_server: EtcdServer, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``gc_round`` does not handle leaves it as it did when the calls ran one after
    another: the exception itself, not an exception group."""
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=AT_ONCE) as h:
        layout = await _sealed_roots(h, roots=2, subscriptions=3)
        fail = {(layout.segments[1].descriptor, "s2"): RuntimeError("a bug")}
        gate = HeldBacklogs(h.broker, hold=6, fail=fail)
        monkeypatch.setattr(h.broker, "backlog", gate.backlog)
        with pytest.raises(RuntimeError, match=r"^a bug$"), anyio.fail_after(GATE_SECONDS):
            await h.controller.gc_round()
        assert gate.cancelled == 5 and gate.in_flight == 0


async def test_cancelling_gc_cancels_the_backlog_calls_in_flight(
    etcd_server: EtcdServer, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leadership lost or shutdown cancels the GC round: every backlog call in flight is
    cancelled with it, none is left running and nothing is pruned."""
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=AT_ONCE) as h:
        layout = await _sealed_roots(h, roots=2, subscriptions=3)
        gate = HeldBacklogs(h.broker, hold=6, answer=False)
        monkeypatch.setattr(h.broker, "backlog", gate.backlog)
        with anyio.fail_after(GATE_SECONDS):
            async with anyio.create_task_group() as tg:
                tg.start_soon(h.controller.gc_round)
                await gate.full.wait()
                tg.cancel_scope.cancel()
        assert gate.cancelled == 6 and gate.in_flight == 0
        assert await _stored_segments(h) == set(layout.segments)
        assert h.broker_state.deleted_segments == set()


async def test_a_deposed_leader_cannot_prune(etcd_server: EtcdServer, etcd_prefix: str) -> None:
    async with open_store([etcd_server.endpoint]) as store:
        cfg = make_config(etcd_prefix, RETENTION)
        leader_key = f"{cfg.controller_root}/leader"
        await store.put(leader_key, b'{"replica": "old"}')
        current = await current_leader(store, leader_key)
        assert current is not None
        old_token = current[1]
        # Another replica won since: the key was re-created with a newer create revision.
        await store.delete(leader_key)
        await store.put(leader_key, b'{"replica": "new"}')
        stale = Leadership(
            token=old_token,
            lease_id=0,
            identity={"replica": "old"},
            lost=anyio.Event(),
            key=leader_key,
        )
        async with open_harness(
            etcd_server.endpoint, etcd_prefix, extra_config=RETENTION, store=store, leadership=stale
        ) as h:
            await _split_topic(h)
            await h.clock.advance(700.0)
            await h.controller.gc_round()
            stored = layout_from_json(await stored_json(store, h.keys.layout(TOPIC)))
            assert 0 in stored.segments
            assert h.broker_state.deleted_segments == set()
            assert h.count("controllerd_operations_total", op="prune", outcome="conflict") == 1


@pytest.mark.parametrize("retention", [-1, 86400])
async def test_gc_never_touches_a_segment_kept_by_retention(
    etcd_server: EtcdServer, etcd_prefix: str, retention: int
) -> None:
    extra = f"[gc]\ndefault_retention_seconds = {retention}\ninterval_seconds = 1e9\n"
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=extra) as h:
        await _split_topic(h)
        await h.clock.advance(3600.0)
        await h.controller.gc_round()
        assert 0 in h.layout().segments and h.requests("/backlog") == 0


async def test_the_gc_tick_prunes_without_being_called(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    extra = "[gc]\ndefault_retention_seconds = 0\ninterval_seconds = 60\n"
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=extra) as h:
        await _split_topic(h)
        await h.clock.advance(60.0)
        await eventually(lambda: (TOPIC, "0000-ffff-0") in h.broker_state.deleted_segments)


async def _own_keys(h: Harness, topic: TopicName) -> list[str]:
    """The keys of ``topic`` under our root: cooldown, history, cold-since."""
    found = []
    for key in (h.keys.cooldown(topic), h.keys.history(topic)):
        if await h.store.get(key) is not None:
            found.append(key)
    kvs, _ = await h.store.get_prefix(h.keys.cold_since_prefix(topic))
    return found + [kv.key for kv in kvs]


async def _put_own_keys(h: Harness, topic: TopicName, cold_since_ms: int) -> None:
    """What a leader keeps for a topic: a cooldown stamp, a history, a cold-since."""
    await h.store.put(h.keys.cooldown(topic), b'{"lastSplitAtMs": 1, "lastMergeAtMs": -1}')
    await h.store.put(h.keys.history(topic), b"{}")
    await h.store.put(h.keys.cold_since(topic, 0), str(cold_since_ms).encode())


async def test_a_deleted_topics_own_keys_go_so_a_topic_created_again_starts_clean(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A topic created again under a deleted one's name starts its segment ids at 0: a
    cold-since left behind would date its new segment 0 from before it was cold (a
    merge too soon), a history would lengthen its merge windows. The leader deletes
    them."""
    async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
        await h.add_topic(segments=2)
        await _put_own_keys(h, TOPIC, h.clock.now_ms())
        await eventually(
            lambda: (
                TOPIC in h.controller.view.topics
                and bool(h.controller.view.topics[TOPIC].cold_since)
            )
        )
        await h.store.delete(h.keys.layout(TOPIC))
        await eventually(lambda: TOPIC not in h.controller.view.topics)
        await h.controller.flush_writes()
        assert await _own_keys(h, TOPIC) == []
        await h.add_topic(segments=2)
        await eventually(lambda: h.view_layout() is not None)
        assert h.controller.view.topics[TOPIC].cold_since == {}


async def test_own_keys_of_a_topic_deleted_while_no_one_led_go_once_a_leader_loads(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store
) -> None:
    """Keys of ours whose topic has no layout (deleted while no replica led): the first
    load finds them, and the leader deletes them."""
    gone = TopicName("acme", "ns", "gone")
    cfg = make_config(etcd_prefix)
    keys = Keys(cfg.metadata_prefix, cfg.controller_root)
    await store.put(keys.cooldown(gone), b'{"lastSplitAtMs": 1, "lastMergeAtMs": -1}')
    await store.put(keys.cold_since(gone, 0), b"1")
    async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
        assert gone not in h.controller.view.topics
        await h.controller.flush_writes()
        assert await _own_keys(h, gone) == []


async def test_own_keys_of_a_topic_without_a_layout_go_at_the_next_gc_round(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A key of ours written for a topic with no layout while we run (a predecessor's
    late write after the topic's deletion) holds a topic state of its own, counted in
    /status and the topics gauge. The GC round deletes it, and the state goes with it."""
    gone = TopicName("acme", "ns", "gone")
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=RETENTION) as h:
        await h.store.put(h.keys.cooldown(gone), b'{"lastSplitAtMs": 1, "lastMergeAtMs": -1}')
        await eventually(lambda: gone in h.controller.view.topics)
        await h.controller.gc_round()
        await h.controller.flush_writes()
        assert await _own_keys(h, gone) == []
        await eventually(lambda: gone not in h.controller.view.topics)
        assert h.count("controllerd_topics") == len(h.controller.view.topics)


# --- follow-up, cold-since, audit ---------------------------------------------------------


async def test_one_follow_up_evaluation_when_the_split_cooldown_expires(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with open_harness(etcd_server.endpoint, etcd_prefix, interval=1e9) as h:
        await h.add_topic(segments=1)
        await h.put_load(0, 1e6)  # 100x: an 8-way split, and still hot afterwards
        await eventually(lambda: active_count(h) == 8)
        await eventually(lambda: not h.controller.status()["in_flight"])
        for sid in range(1, 9):
            await h.put_load(sid, 20_000.0)  # each child is still 2x over
        await eventually(
            lambda: (
                h.count("controllerd_decisions_total", action="none", reason="split-cooldown") >= 1
            )
        )
        assert h.requests("/split/") == 1
        await h.clock.advance(60.0)  # no tick (interval 1e9): the follow-up timer fires
        await eventually(lambda: h.requests("/split/") == 2)


async def test_cold_since_survives_noisy_records_and_a_new_leader(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    with structlog.testing.capture_logs() as logs:
        await _cold_since_across_leaders(etcd_server, etcd_prefix)
    levels = [e["log_level"] for e in logs if e["event"] == "segment.cold"]
    # Seen going cold by the first leader: info. Found cold by the next one in its first
    # pass: debug, or a new leader of many idle topics logs a line per segment.
    assert levels == ["info", "info", "debug", "debug"]


async def _cold_since_across_leaders(etcd_server: EtcdServer, etcd_prefix: str) -> None:
    async with open_store([etcd_server.endpoint]) as store:
        window = "[policy]\nmerge_window_seconds = 300\n"  # Pulsar's, for a short test
        async with open_harness(
            etcd_server.endpoint, etcd_prefix, store=store, extra_config=window
        ) as h1:
            await h1.add_topic(segments=2)
            start = h1.clock.now_ms()
            await h1.put_load(0, COLD)
            await h1.put_load(1, COLD)
            await eventually(lambda: TOPIC in h1.controller.view.topics)
            loads = h1.controller.view.topics[TOPIC].loads
            await eventually(lambda: (loads.cold(0), loads.cold(1)) == (start, start))
            # Derivable from the records (changedAtMs): nothing written to etcd, which
            # would cost one write per cold segment on a cold start of many topics.
            assert await store.get(h1.keys.cold_since(TOPIC, 0)) is None
        async with open_harness(
            etcd_server.endpoint, etcd_prefix, store=store, replica="test-2", extra_config=window
        ) as h2:
            h2.broker_state.topics[TOPIC] = h1.layout()
            loads = h2.controller.view.topics[TOPIC].loads
            await eventually(lambda: (loads.cold(0), loads.cold(1)) == (start, start))
            await h2.clock.advance(200.0)
            # noisy but cold: 10 -> 50 msg/s is a 400% change, PIP-483 restarts its window
            await h2.put_load(0, 50.0)
            # No longer derivable from the record: now it is persisted, for the next leader.
            await eventually(lambda: h2.controller.view.topics[TOPIC].cold_since.get(0) == start)
            kv = await _eventually_stored(store, h2.keys.cold_since(TOPIC, 0))
            assert int(kv) == start
            await h2.clock.advance(100.0)  # 300 s since cold, only 100 s since the change
            await h2.put_load(1, 12.0)
            await eventually(lambda: h2.requests("/merge/") == 1)


async def _eventually_stored(store: Store, key: str) -> bytes:
    with anyio.fail_after(10):
        while (kv := await store.get(key)) is None:  # noqa: ASYNC110 - written behind
            await anyio.sleep(0.01)
    return kv.value


async def _stored_json_until(
    store: Store, key: str, done: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """The JSON object at ``key`` once ``done`` holds for it (written behind the evaluation,
    possibly after an earlier value)."""
    with anyio.fail_after(10):
        while not done(value := json.loads(await _eventually_stored(store, key))):  # noqa: ASYNC110
            await anyio.sleep(0.01)
    return cast(dict[str, Any], value)


class RecordingAudit(AuditSink):
    def __init__(self) -> None:
        self.records: list[Mapping[str, Any]] = []

    def publish(self, record: Mapping[str, Any]) -> None:
        self.records.append(record)


async def test_every_operation_is_audited_with_inputs_token_and_outcome(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    audit = RecordingAudit()
    async with open_harness(etcd_server.endpoint, etcd_prefix, audit=audit) as h:
        await h.add_topic(segments=1)
        await h.put_load(0, HOT)
        await eventually(lambda: len(audit.records) == 1)
        record = audit.records[0]
        assert record["decision"]["action"] == "split"
        assert record["decision"]["reason"] == "msgRateIn"
        assert record["fencing_token"] == h.leadership.token
        assert record["outcome"] == "ok" and record["topic"] == str(TOPIC)
        assert record["inputs"]["loads"]["0"]["msg_rate_in"] == HOT


async def test_a_new_leader_comes_back_when_an_inherited_cooldown_ends(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """#10 item 7: a cooldown stamped by the previous leader holds a split back, and the
    new leader evaluates again when it ends, with no tick and no new record."""
    async with open_store([etcd_server.endpoint]) as store:
        async with open_harness(etcd_server.endpoint, etcd_prefix, store=store) as h1:
            split_at = await split_a_hot_topic(h1)
            layout = h1.layout()
        async with open_harness(
            etcd_server.endpoint, etcd_prefix, store=store, replica="test-2", interval=1e9
        ) as h2:
            h2.broker_state.topics[TOPIC] = layout
            h2.clock._start_ms = split_at + 10_000  # 10 s into the old leader's cooldown
            await h2.put_load(1, HOT)
            await eventually(
                lambda: (
                    h2.count("controllerd_decisions_total", action="none", reason="split-cooldown")
                    == 1
                )
            )
            await h2.clock.advance(49.0)
            assert h2.requests("/split/") == 0
            await h2.clock.advance(1.1)  # the inherited cooldown ends: one follow-up
            await eventually(lambda: h2.requests("/split/") == 1)
            assert (
                h2.count("controllerd_decisions_total", action="none", reason="split-cooldown") == 1
            )


async def test_on_pulsar_our_gc_is_off_by_default_and_reads_pulsars_retention(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """#11: Pulsar's own GC runs whatever we do, so ours is off unless asked for; when
    asked for, retention comes from Pulsar's namespace policy, not from our keys."""
    retention = "[gc]\ndefault_retention_seconds = 0\ninterval_seconds = 1e9\n"
    async with open_harness(
        etcd_server.endpoint, etcd_prefix, extra_config=retention, profile="pulsar"
    ) as h:
        await h.add_topic(segments=1)
        await h.add_subscription("s")
        await h.put_load(0, 15_000.0)  # 1.5x: one midpoint split
        await eventually(lambda: (h.view_layout() or h.layout()).epoch == 1)
        await eventually(lambda: not h.controller.status()["in_flight"])
        await h.clock.advance(3600.0)
        await h.controller.gc_round()
        assert 0 in h.layout().segments and h.requests("/backlog") == 0  # off by default
        h.set_config(make_config(etcd_prefix, retention + "enabled = true\n", profile="pulsar"))
        policies = f"{h.keys.pulsar_policies_prefix}acme/ns"
        await h.store.put(policies, b'{"retention_policies": {"retentionTimeInMinutes": 120}}')
        await eventually(lambda: h.controller.view.pulsar_namespace(TOPIC) is not None)
        await h.controller.gc_round()  # 1 h old, 2 h of retention: kept
        assert h.broker_state.deleted_segments == set()
        stored = layout_from_json(await stored_json(h.store, h.keys.layout(TOPIC)))
        assert 0 in stored.segments
        await h.clock.advance(3600.0 + 1)
        await h.controller.gc_round()
        stored = layout_from_json(await stored_json(h.store, h.keys.layout(TOPIC)))
        assert 0 not in stored.segments


async def test_cold_since_of_a_record_without_time_stamps_is_persisted(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """Pulsar's load records carry no time: a successor could not re-derive when the
    segment became cold (it would restart the merge window at its own first sight)."""
    async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
        await h.add_topic(segments=2)
        start = h.clock.now_ms()
        record = b'{"msgRateIn": 5.0, "bytesRateIn": 1.0, "msgRateOut": 0.0, "bytesRateOut": 0.0}'
        await h.store.put(h.keys.load(TOPIC, 0), record)
        kv = await _eventually_stored(h.store, h.keys.cold_since(TOPIC, 0))
        assert int(kv) == start
        # Warm again before that write's echo arrives: the late echo must not bring the
        # old start back (the next cold spell would count its window from it).
        await h.clock.advance(60.0)
        await h.store.put(h.keys.load(TOPIC, 0), record.replace(b"5.0", b"5000.0"))
        state = h.controller.view.topics[TOPIC]
        await eventually(lambda: 0 not in state.cold_since)
        assert h.controller.view.writes_state(TOPIC)
        h.controller.view.apply_put(h.keys.cold_since(TOPIC, 0), kv, 1, h.clock.now_ms())
        assert 0 not in state.cold_since


class HeldWrites(Controller):
    """Holds its first write-behind batch until the test opens the gate."""

    gate: anyio.Event
    held: anyio.Event

    async def _fenced_write(self, leadership: Leadership, ops: list[Put | Delete]) -> bool:
        if not self.held.is_set():
            self.held.set()
            await self.gate.wait()
        return await super()._fenced_write(leadership, ops)


async def test_state_written_behind_is_written_again_after_etcd_refused_it(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store
) -> None:
    """A cold-since batch etcd does not take (an outage longer than the store's retries,
    shorter than the lease) is queued again, not dropped: a successor would otherwise
    start the segment's merge window afresh. The controller reaches etcd through a
    proxy the test cuts; its lease is kept on the test's own connection."""
    HeldWrites.gate, HeldWrites.held = anyio.Event(), anyio.Event()
    async with behind_a_proxy(etcd_server, etcd_prefix, store, HeldWrites) as (h, proxy):
        await h.add_topic(segments=2)
        start = h.clock.now_ms()
        record = b'{"msgRateIn": 5.0, "bytesRateIn": 1.0, "msgRateOut": 0.0, "bytesRateOut": 0.0}'
        await store.put(h.keys.load(TOPIC, 0), record)
        await HeldWrites.held.wait()
        await proxy.set_mode("refuse")
        HeldWrites.gate.set()
        failures = "controllerd_state_write_failures_total"
        await eventually(lambda: (h.metrics.registry.get_sample_value(failures) or 0) >= 1)
        assert await store.get(h.keys.cold_since(TOPIC, 0)) is None
        await proxy.set_mode("pass")
        kv = await _eventually_stored(store, h.keys.cold_since(TOPIC, 0))
        assert int(kv) == start


class RecordedWrites(Controller):
    """Takes its fenced writes of our own state in memory: etcd's answers are the test's."""

    written: list[list[Put | Delete]]
    refuse: Callable[[list[Put | Delete]], bool]

    async def _fenced_write(self, leadership: Leadership, ops: list[Put | Delete]) -> bool:
        await anyio.lowlevel.checkpoint()  # a round trip to etcd
        if self.refuse(ops):
            raise store_module.StoreUnavailable("etcd did not answer")
        self.written.append(ops)
        return True


def recorded_writes(queued: int) -> RecordedWrites:
    """A leader with ``queued`` cold-since values queued, written by none yet."""
    c = offline(RecordedWrites)
    c.written, c.refuse = [], lambda ops: False
    c.grant(None, Leadership(token=1, lease_id=0, identity={}, lost=anyio.Event()))
    for i in range(queued):
        c._writes[f"/c/cold-since/t/{i}"] = (str(i).encode(), None)
    return c


class BuiltOps:
    """Counts the puts the controller builds, and the most built between two turns of
    another task: the work flush_writes does without yielding."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.since_turn = self.most = 0
        self.total = 0
        monkeypatch.setattr(controller_module, "Put", self._put)

    def _put(self, key: str, value: bytes) -> Put:
        self.since_turn += 1
        self.total += 1
        return Put(key, value)

    async def watch(self, flush: Callable[[], Awaitable[None]]) -> None:
        """Run ``flush`` while another task takes a turn at every yield."""
        done = False

        async def other_task() -> None:
            while not done:
                self.most = max(self.most, self.since_turn)
                self.since_turn = 0
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(other_task)
            await flush()
            done = True
        self.most = max(self.most, self.since_turn)


async def test_flushing_a_long_write_queue_yields_after_every_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every queued write was built into an operation before the first was sent: 1.6
    million queued held the event loop 3 s. The queue is now taken a batch at a time."""
    batch = controller_module.WRITE_BATCH
    c = recorded_writes(20 * batch + 7)
    built = BuiltOps(monkeypatch)
    await built.watch(c.flush_writes)
    assert built.most <= batch
    assert [len(ops) for ops in c.written].count(batch) == 20
    assert sorted(op.key for ops in c.written for op in ops) == sorted(
        f"/c/cold-since/t/{i}" for i in range(20 * batch + 7)
    )
    assert c._writes == {}


async def test_a_refused_flush_queues_the_rest_again_and_newer_values_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """etcd refuses the third batch: the flush stops there; that batch and every value
    not yet written are queued again, without the work of building them, except that
    a value queued meanwhile for the same key is newer and wins. The next flush writes
    them all."""
    batch = controller_module.WRITE_BATCH
    c = recorded_writes(10 * batch)
    original = dict(c._writes)
    newer: dict[str, tuple[bytes | None, int | None]] = {}

    def refuse(ops: list[Put | Delete]) -> bool:
        if len(c.written) != 2:
            return False
        # meanwhile, newer values: one of the refused batch, one not yet taken
        written = {op.key for done in c.written for op in done}
        untaken = sorted(set(original) - written - {op.key for op in ops})
        for key in (ops[0].key, untaken[0]):
            newer[key] = c._writes[key] = (b"newer", None)
        return True

    c.refuse = refuse
    built = BuiltOps(monkeypatch)
    await built.watch(c.flush_writes)
    assert built.most <= batch
    assert built.total == 3 * batch  # the batches sent, never the queue
    assert len(c.written) == 2 and len(newer) == 2
    written = {op.key for ops in c.written for op in ops}
    assert c._writes == {k: v for k, v in original.items() if k not in written} | newer
    c.refuse = lambda ops: False
    await c.flush_writes()
    stored = {op.key: op.value for ops in c.written for op in ops if isinstance(op, Put)}
    assert stored == {k: v[0] for k, v in (original | newer).items()}
    assert c._writes == {}


async def test_a_flip_flop_is_remembered_in_etcd_for_the_next_leader(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """The merge backoff needs each range's flip-flops (a split of a merge child within
    its merge window); they are kept under <root>/history/ so a new leader has them."""
    window = "[policy]\nmerge_window_seconds = 300\nmerge_cooldown_seconds = 0\n"
    async with open_store([etcd_server.endpoint]) as store:
        async with open_harness(
            etcd_server.endpoint, etcd_prefix, store=store, extra_config=window
        ) as h1:
            await h1.add_topic(segments=2)
            await h1.put_load(0, COLD)
            await h1.put_load(1, COLD)
            # Both cold from now: the follower must have seen them before time moves on.
            await eventually(
                lambda: (
                    TOPIC in h1.controller.view.topics
                    and len(h1.controller.view.topics[TOPIC].loads) == 2
                )
            )
            await h1.clock.advance(301.0)
            await h1.put_load(1, COLD + 1)
            await eventually(lambda: h1.requests("/merge/") == 1)
            await eventually(lambda: 2 in (h1.view_layout() or h1.layout()).segments)
            await h1.put_load(2, HOT)  # the merge child is hot at once: a flip-flop
            await eventually(lambda: h1.requests("/split/") == 1)
            # (the merge stored its child's merged count first: wait for the split's write)
            ranges = await _stored_json_until(
                store,
                h1.keys.history(TOPIC),
                lambda got: bool(got) and all(r["flipflops"] == 1 for r in got.values()),
            )
        async with open_harness(
            etcd_server.endpoint, etcd_prefix, store=store, replica="test-2", extra_config=window
        ) as h2:
            history = h2.controller.view.topics[TOPIC].history
            assert history is not None and history.to_json() == ranges


async def test_a_recent_rise_holds_a_merge_back_until_it_decays(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """With merge_headroom_half_life_seconds the leader keeps each range's largest recent
    rise from the records it follows; a cold pair that would not keep room for it is
    held back (reason merge-headroom) and merges once the rise has decayed."""
    config = (
        "[policy]\nmerge_window_seconds = 300\nmerge_cooldown_seconds = 0\n"
        "merge_headroom_half_life_seconds = 3600\n"
    )
    with structlog.testing.capture_logs() as logs:
        async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=config) as h:
            await h.add_topic(segments=2)
            await h.put_load(0, 100.0)
            await h.put_load(1, 100.0)

            def loads() -> LoadTable:
                return h.controller.view.topics[TOPIC].loads

            await eventually(lambda: TOPIC in h.controller.view.topics and len(loads()) == 2)
            await h.clock.advance(1.0)
            await h.put_load(0, 9_100.0)  # 0.01 -> 0.91 split thresholds: a rise of 0.9
            await eventually(lambda: loads().cold(0) is None)
            await h.clock.advance(1.0)
            await h.put_load(0, 100.0)
            await eventually(lambda: loads().cold(0) is not None)
            await h.clock.advance(301.0)  # both past the window; 0.9 decayed to 0.85
            await h.put_load(1, 101.0)
            await eventually(lambda: any(e.get("reason") == "merge-headroom" for e in logs))
            assert h.requests("/merge/") == 0
            await h.clock.advance(500.0)  # 0.9 decayed to 0.77: 0.02 + 0.77 < 0.8
            await h.put_load(1, 102.0)
            await eventually(lambda: h.requests("/merge/") == 1)


async def merge_down(h: Harness, first: int) -> int:
    """Cold records for the four active segments ``first``..``first + 3`` (ids in
    layout order), 301 s, and the pairs merge, then their children: the id of the one
    segment left (merge children take the next ids, ``first + 4`` to ``first + 6``)."""
    before = h.requests("/merge/")
    for sid in range(first, first + 4):
        await h.put_load(sid, COLD)
    await eventually(
        lambda: (
            TOPIC in h.controller.view.topics
            and all(s in h.controller.view.topics[TOPIC].loads for s in range(first, first + 4))
        )
    )
    await h.clock.advance(301.0)
    await h.put_load(first, COLD + 1)
    await eventually(lambda: h.requests("/merge/") == before + 2)
    await eventually(lambda: (lay := h.view_layout()) is not None and first + 5 in lay.segments)
    await h.put_load(first + 4, COLD)
    await h.put_load(first + 5, COLD)
    await eventually(lambda: h.requests("/merge/") == before + 3)
    await eventually(lambda: (lay := h.view_layout()) is not None and first + 6 in lay.segments)
    await eventually(lambda: not h.controller.status()["in_flight"])
    # The count is history, kept in etcd for a new leader (not read from the layout,
    # whose sealed parents Pulsar's GC prunes within a minute).
    await _stored_json_until(
        h.store,
        h.keys.history(TOPIC),
        lambda got: got.get(str(first + 6), {}).get("merged") == 4,
    )
    return first + 6


async def test_a_merge_cascade_that_turns_hot_is_split_back_whole(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """merge_undo_seconds on the leader: four cold segments merge down to one, and when
    the load comes back at 1.2x the threshold the range splits into four children in
    one request, not two and then two more (it needs the sealed segments the leader
    follows in the layout). Past the setting's time a split is for the load alone."""
    config = "[policy]\nmerge_window_seconds = 300\nmerge_cooldown_seconds = 0\n"
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=config) as h:
        await h.add_topic(segments=4)
        merged = await merge_down(h, 0)
        await h.clock.advance(600.0)
        await h.put_load(merged, 12_000.0)
        await eventually(lambda: h.requests("/split/") == 1)
        await eventually(lambda: active_count(h) == 4)
        quarters = [s.hash_range.start for s in h.layout().active_segments()]
        assert sorted(quarters) == [0, 0x4000, 0x8000, 0xC000]
        # The children merge back; 1,801 s after that merge the load alone decides.
        await eventually(lambda: (lay := h.view_layout()) is not None and 10 in lay.segments)
        merged = await merge_down(h, 7)
        await h.clock.advance(1_801.0)
        await h.put_load(merged, 12_000.0)
        await eventually(lambda: h.requests("/split/") == 2)
        await eventually(lambda: active_count(h) == 2)


async def test_a_split_carries_the_flip_flops_its_range_answers_for_to_its_children(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """Our split can show in the layout (watch) before its request returns. The history of
    the range it sealed must survive until the evaluation carries it over: its children
    answer for its flip-flop (the backoff), here and for the next leader."""
    async with open_store([etcd_server.endpoint]) as store:
        async with open_harness(etcd_server.endpoint, etcd_prefix, store=store) as h:
            await h.add_topic(segments=1)
            await eventually(lambda: h.view_layout() is not None)
            now = h.clock.now_ms()
            history = {"0": {"flipflops": 1, "lastFlipflopMs": now}}
            await store.put(h.keys.history(TOPIC), json.dumps(history).encode())
            await eventually(lambda: h.controller.view.topics[TOPIC].history is not None)
            await h.put_load(0, HOT)
            await eventually(lambda: active_count(h) == 3)
            children = {str(s.segment_id) for s in h.layout().active_segments()}

            def carried() -> bool:
                kept = h.controller.view.topics[TOPIC].history
                ranges = kept.to_json() if kept is not None else {}
                return set(ranges) == children and all(
                    (r["flipflops"], r["lastFlipflopMs"]) == (1, now) for r in ranges.values()
                )

            await eventually(carried)
            stored = await _stored_json_until(
                store, h.keys.history(TOPIC), lambda got: set(got) == children
            )
            assert all(r["flipflops"] == 1 for r in stored.values())


async def test_a_merge_carries_the_flip_flops_of_its_parents_and_waits_for_them(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """The merge side of the same race: a pair whose ranges answer for 2 and 1 flip-flops
    waits 4 windows (backoff factor 2), and its merge child answers for the larger count."""
    config = "[policy]\nmerge_window_seconds = 300\nmerge_cooldown_seconds = 0\n"
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=config) as h:
        await h.add_topic(segments=2)
        await eventually(lambda: h.view_layout() is not None)
        now = h.clock.now_ms()
        history = {"0": {"flipflops": 2, "lastFlipflopMs": now}, "1": {"flipflops": 1}}
        await h.store.put(h.keys.history(TOPIC), json.dumps(history).encode())
        await eventually(lambda: h.controller.view.topics[TOPIC].history is not None)
        await h.put_load(0, COLD)
        await h.put_load(1, COLD)
        # Both records evaluated, not only in the view: a segment's cold time is set when
        # the controller evaluates its record, and one evaluated after the advance below
        # would turn cold 1,199 s late.
        await eventually(
            lambda: all(h.controller.view.topics[TOPIC].loads.cold(s) is not None for s in (0, 1))
        )
        await h.clock.advance(1_199.0)  # past range 1's 600 s, short of range 0's 1,200 s
        await h.put_load(1, COLD + 1)
        await eventually(lambda: not h.controller.status()["in_flight"])
        assert h.requests("/merge/") == 0
        await h.clock.advance(2.0)
        await h.put_load(0, COLD + 1)
        await eventually(lambda: h.requests("/merge/") == 1)
        await eventually(lambda: (lay := h.view_layout()) is not None and 2 in lay.segments)
        await eventually(lambda: not h.controller.status()["in_flight"])
        kept = h.controller.view.topics[TOPIC].history
        assert kept is not None
        assert kept.to_json()["2"]["flipflops"] == 2
        assert kept.to_json()["2"]["lastFlipflopMs"] == now


async def test_a_history_time_beyond_a_long_is_dropped_not_carried(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """Garbage in <root>/history/: a flip-flop stamped beyond a signed 64-bit long, carried
    to a split's children, failed the history's next write (orjson) and the evaluation
    with it. Such a range is dropped when read, like any malformed value."""
    with structlog.testing.capture_logs() as logs:
        async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
            await h.add_topic(segments=1)
            await eventually(lambda: h.view_layout() is not None)
            garbage = {"0": {"flipflops": 1, "lastFlipflopMs": 1e300}}
            await h.store.put(h.keys.history(TOPIC), json.dumps(garbage).encode())
            await eventually(lambda: h.controller.view.topics[TOPIC].history is not None)
            await h.put_load(0, HOT)
            await eventually(lambda: active_count(h) == 3)
            seen = h.view_layout
            await eventually(lambda: (lay := seen()) is not None and not lay.segments[0].active)
            await eventually(lambda: not h.controller.status()["in_flight"])
    assert not [e for e in logs if e["log_level"] in ("error", "critical")]


class OrderedController(Controller):
    """Records the order in which topics are evaluated."""

    order: list[TopicName]

    async def evaluate(self, topic: TopicName) -> Decision | None:
        self.order.append(topic)
        return await super().evaluate(topic)


async def test_a_new_leader_first_evaluates_what_changed_while_it_followed(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A takeover must not make a registration from the leaderless gap wait behind a
    pass over every topic (issue #12: 3.6 s at 10,000 topics)."""
    async with open_harness(
        etcd_server.endpoint, etcd_prefix, controller_class=OrderedController
    ) as h:
        controller = h.controller
        assert isinstance(controller, OrderedController)
        controller.order = []
        controller.revoke(None)  # a standby from here on: it follows, it does not act
        await populate(h.store, h.keys, topic_names(1_000))
        await h.add_topic(segments=1)  # the last topic in the view's order
        await h.add_subscription("s")
        await h.register("s", "c1")
        await h.register("s", "c2")

        def followed() -> bool:
            state = controller.view.topics.get(TOPIC)
            return len(controller.view.topics) == 1_001 and (
                state is not None and len(state.consumers.get("s", ())) == 2
            )

        await eventually(followed)
        assert h.requests("/split/") == 0
        controller.order.clear()
        controller.grant(None, h.leadership)
        await eventually(lambda: h.requests("/split/") == 1)
        assert controller.order[0] == TOPIC
        await eventually(lambda: len(set(controller.order)) == 1_001)  # and then every topic


class FastPathController(OrderedController):
    """Also records each load record the follower hands over with its state."""

    fast: list[tuple[TopicName, int]]

    def note_load(self, state: TopicState, segment: int) -> None:
        self.fast.append((state.name, segment))
        super().note_load(state, segment)


async def test_a_standby_remembers_a_hot_record_it_followed_on_the_fast_path(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A standby gates a followed load record given its state (``note_load``, no lookup
    by name); a record over a split threshold must still make its topic the first a
    new leader evaluates, and a warm one must not."""
    async with open_harness(
        etcd_server.endpoint, etcd_prefix, controller_class=FastPathController
    ) as h:
        controller = h.controller
        assert isinstance(controller, FastPathController)
        controller.order, controller.fast = [], []
        controller.revoke(None)
        await populate(h.store, h.keys, topic_names(300))
        warm = topic_names(1)[0]
        await h.add_topic(segments=1)  # the last topic in the view's order
        await h.put_load(0, 6_000.0)  # applied by the full path: the fast path learns the key
        await h.put_load(0, 6_000.0, topic=warm)

        def loaded(topic: TopicName) -> bool:  # populate's record for ``warm`` came first
            state = controller.view.topics.get(topic)
            record = state.loads.peek(0) if state is not None else None
            return record is not None and record[0][0] == 6_000.0

        await eventually(lambda: loaded(TOPIC) and loaded(warm))
        fast = controller.fast
        fast.clear()
        controller._missed.clear()  # the topics just created; only records from here on
        await h.put_load(0, 7_000.0, topic=warm)
        await eventually(lambda: fast == [(warm, 0)])
        assert not controller._missed  # warm: nothing a takeover must look at first
        await h.put_load(0, HOT)
        await eventually(lambda: fast[-1] == (TOPIC, 0))
        assert list(controller._missed) == [TOPIC]
        controller.order.clear()
        controller.grant(None, h.leadership)
        await eventually(lambda: h.requests("/split/") == 1)
        assert controller.order[0] == TOPIC


async def test_the_load_freezes_what_it_loaded_out_of_the_garbage_collectors_scans(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """At 1.9 million keys full collections during the load stalled the loop up to 0.9 s."""
    gc.unfreeze()
    async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
        assert h.controller.view is not None
        assert gc.isenabled()  # paused for the load only
        assert gc.get_freeze_count() > 0


async def test_ticks_skip_quiet_topics_until_their_inputs_change_or_a_full_pass(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A tick re-evaluates a balanced topic only when something it reads changed (a load
    record only if it crosses a threshold), and every topic every FULL_PASS_EVERY ticks
    (issue #12: 16 s of CPU a tick at 100k; under a storm of balanced records every
    topic was due at every tick)."""
    async with open_harness(
        etcd_server.endpoint, etcd_prefix, controller_class=OrderedController
    ) as h:
        controller = h.controller
        assert isinstance(controller, OrderedController)
        controller.order = []
        await h.add_topic(segments=2)
        await h.put_load(0, 4_000.0)
        await h.put_load(1, 4_000.0)

        def idle() -> bool:
            status = controller.status()
            return not status["in_flight"] and not status["queued"]

        async def tick() -> int:
            """One interval; how many evaluations it caused."""
            before, ticks = len(controller.order), controller._ticks
            await h.clock.advance(60.0)
            await eventually(lambda: controller._ticks == ticks + 1 and idle())
            return len(controller.order) - before

        await eventually(
            lambda: (
                h.count("controllerd_decisions_total", action="none", reason="balanced") >= 1
                and len(controller.view.topics[TOPIC].loads) == 2
                and idle()
            )
        )
        controller.order.clear()
        await h.put_load(1, 4_100.0)  # balanced still: no trigger, but an input changed
        await eventually(lambda: controller.view.topics[TOPIC].loads[1].rates.msg_rate_in > 4_000)
        assert controller.order == []
        assert await tick() == 1  # the first tick is a full pass
        assert await tick() == 0  # quiet, nothing changed
        mark = controller._quiet[TOPIC]
        await h.put_load(0, 4_200.0)  # balanced: a record that cannot change the answer
        await eventually(lambda: controller.view.topics[TOPIC].loads[0].rates.msg_rate_in > 4_100)
        assert await tick() == 0
        # moved in place: no new object per record for the collector's full scans to walk
        assert controller._quiet[TOPIC] is mark
        assert mark.version == controller.view.topics[TOPIC].version
        evaluated = len(controller.order)
        await h.put_load(0, 40.0)  # below the merge thresholds: triggers, no longer quiet
        await eventually(lambda: idle() and len(controller.order) == evaluated + 1)
        assert await tick() == 1
        await h.put_load(0, 4_300.0)  # balanced again: triggers (warm again), quiet again
        await eventually(lambda: idle() and len(controller.order) == evaluated + 3)
        assert await tick() == 0
        await h.store.put(h.keys.cooldown(TOPIC), b'{"lastSplitAtMs":0,"lastMergeAtMs":0}')
        await eventually(lambda: controller.view.topics[TOPIC].cooldown is not None)
        assert await tick() == 1  # another input changed
        assert [await tick() for _ in range(4)] == [0] * 4
        assert await tick() == 1  # the eleventh: a full pass (every tenth after the first)


async def test_a_reload_keeps_resolved_policies_unless_the_policy_changed(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """Resolving every topic again after each SIGHUP slowed reactions for seconds."""
    async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
        await h.add_topic(segments=2)
        await eventually(lambda: h.view_layout() is not None)
        state = h.controller.view.topics[TOPIC]
        before = h.controller.resolved_policy(state)
        h.set_config(make_config(etcd_prefix, settle=0.5, interval=30.0))  # no [policy] change
        assert h.controller.resolved_policy(state) is before
        h.set_config(make_config(etcd_prefix, "[policy]\nmerge_window_seconds = 60\n"))
        after = h.controller.resolved_policy(state)
        assert after is not before
        assert isinstance(after, PolicySettings) and after.merge_window_seconds == 60


class CountedGcRounds(Controller):
    """Counts the GC rounds done (the ticker measures its next interval from the end)."""

    rounds = 0

    async def gc_round(self) -> None:
        await super().gc_round()
        self.rounds += 1


@pytest.mark.parametrize("ticker", ["autoscale", "gc"])
async def test_a_reloaded_interval_counts_from_the_last_tick_not_the_old_interval(
    etcd_server: EtcdServer, etcd_prefix: str, ticker: str
) -> None:
    """The docs say a reloaded interval applies from the next tick; lowered from 600 s
    to 1 s by SIGHUP, the next tick still came 600 s after the last one. After a
    reload the next tick is due the new interval after the last (at once if that is
    past); a raised interval is waited for in full."""
    extra = "[gc]\ninterval_seconds = {gc}\n"
    async with open_harness(
        etcd_server.endpoint,
        etcd_prefix,
        interval=600.0,
        extra_config=extra.format(gc=600.0),
        controller_class=CountedGcRounds,
    ) as h:
        controller = h.controller
        assert isinstance(controller, CountedGcRounds)

        def ticks() -> int:
            return controller._ticks if ticker == "autoscale" else controller.rounds

        def reload(seconds: float) -> None:
            """What a SIGHUP does: the new config in force, the controller told."""
            autoscale, gc = (seconds, 600.0) if ticker == "autoscale" else (600.0, seconds)
            h.set_config(make_config(etcd_prefix, extra.format(gc=gc), interval=autoscale))
            controller.reconfigured()

        await h.clock.advance(100.0)
        assert ticks() == 0
        reload(300.0)  # due 300 s after the start
        await h.clock.advance(199.0)
        assert ticks() == 0
        await h.clock.advance(1.0)
        await eventually(lambda: ticks() == 1)
        await h.clock.advance(50.0)
        reload(20.0)  # due 20 s after the last tick: already past
        await eventually(lambda: ticks() == 2)
        assert h.clock.monotonic() == 350.0
        reload(600.0)  # raised: the next is due 600 s after this last tick, not 20 s
        await h.clock.advance(20.0)
        assert ticks() == 2
        await h.clock.advance(579.0)
        assert ticks() == 2
        await h.clock.advance(1.0)
        await eventually(lambda: ticks() == 3)


# --- acting while the first load runs (issue #12: 100k topics took 72 s to load) -------------


class GatedPages:
    """A store that hands out pages of ``prefix`` only as the test allows them."""

    def __init__(self, store: Store, prefix: str) -> None:
        self._store, self._prefix = store, prefix
        self._allowed = 0
        self._changed = anyio.Event()

    def allow(self, pages: int) -> None:
        self._allowed += pages
        self._changed.set()

    async def iter_prefix(self, prefix: str) -> AsyncIterator[tuple[list[KeyValue], int]]:
        sent = 0
        async for page in self._store.iter_prefix(prefix):
            while prefix == self._prefix and sent >= self._allowed:
                self._changed = anyio.Event()
                await self._changed.wait()
            yield page
            sent += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def decisions_made(h: Harness) -> float:
    return sum(
        sample.value
        for family in h.metrics.registry.collect()
        for sample in family.samples
        if sample.name == "controllerd_decisions_total"
    )


def splits_of(h: Harness, topic: TopicName) -> int:
    return sum(
        1 for r in h.broker_state.requests if "/split/" in r.path and f"/{topic.topic}/" in r.path
    )


async def test_a_leader_acts_on_whole_topics_while_the_rest_still_loads(
    etcd_server: EtcdServer, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "PAGE_SIZE", 20)  # 7 keys a topic: pages end inside one
    frozen: list[int | None] = []  # first_pass_remaining at each freeze
    running: list[Harness] = []
    monkeypatch.setattr(
        controller_module,
        "_freeze_survivors",
        lambda: frozen.append(running[0].controller.first_pass_remaining),
    )
    cfg = make_config(etcd_prefix, "")
    keys = Keys(cfg.metadata_prefix, cfg.controller_root)
    topics = sorted(topic_names(20, namespaces=20), key=keys.layout)
    first, last = topics[0], topics[-1]
    async with open_store([etcd_server.endpoint], timeout=2.0) as store:
        await populate(store, keys, topics, segments=4, now_ms=0)
        for hot in (first, last):
            await store.put(keys.load(hot, 0), load_record(HOT))
        gated = GatedPages(store, keys.topics_prefix)
        async with open_harness(
            etcd_server.endpoint,
            etcd_prefix,
            store=cast(Store, gated),
            lead_while_loading=True,
        ) as h:
            running.append(h)
            for topic in topics:
                h.broker_state.topics[topic] = initial_layout(4, 0)
            gated.allow(1)  # the first two topics whole, the third begun
            await eventually(lambda: splits_of(h, first) == 1)
            await eventually(lambda: not h.controller.status()["queued"])
            await eventually(lambda: not h.controller.status()["in_flight"])
            assert h.controller.partial
            assert h.controller.status()["first_pass_remaining"] is None  # not known yet
            assert not h.controller._missed  # loading is no change to take over first
            assert decisions_made(h) == 2  # the two whole topics, nothing else
            assert not frozen  # the first pass is not over
            await h.controller.gc_round()  # GC waits for the whole view
            assert not any("/backlog" in r.path for r in h.broker_state.requests)
            gated.allow(100)
            await eventually(lambda: splits_of(h, last) == 1)
            await eventually(lambda: h.controller.status()["first_pass_remaining"] == 0)
            assert decisions_made(h) >= len(topics)
            assert not h.controller.partial
            assert splits_of(h, first) == 1
            assert frozen == [0]  # what the first pass left is frozen once, when it ends


def test_what_a_first_pass_leaves_is_frozen_out_of_full_collections() -> None:
    kept = [(n, {"policy": n}) for n in range(1000)]  # like the per-topic caches
    before = gc.get_freeze_count()
    try:
        controller_module._freeze_survivors()
        assert gc.get_freeze_count() >= before + len(kept)
        scanned = {id(o) for o in gc.get_objects()}  # what a full collection walks
        assert not any(id(k) in scanned for k in kept)
    finally:
        gc.unfreeze()


async def test_topics_without_overrides_of_their_own_share_one_resolved_policy(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """Resolved once per namespace, not per topic; an override of its own, or a changed
    namespace override, is seen at once."""
    a, b, c = (TopicName("acme", ns, name) for ns, name in (("ns", "a"), ("ns", "b"), ("x", "c")))

    def resolved(topic: TopicName) -> PolicySettings:
        policy = h.controller.resolved_policy(h.controller.view.topics[topic])
        assert isinstance(policy, PolicySettings)
        return policy

    async def override(key: str, seconds: int) -> None:
        await h.store.put(key, json.dumps({"splitCooldownSeconds": seconds}).encode())
        wanted = {"splitCooldownSeconds": seconds}
        await eventually(lambda: h.controller.view.overrides.get(scope_of(key)) == wanted)

    def scope_of(key: str) -> tuple[str, str | None, str | None]:
        parts = key.split("/policies/")[1].split("/")
        return (parts[0], parts[1], parts[2] if len(parts) > 2 else None)

    async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
        for topic in (a, b, c):
            await h.add_topic(topic)
        await eventually(lambda: all(h.view_layout(t) is not None for t in (a, b, c)))
        await override(h.keys.policy("acme", "ns"), 5)
        assert resolved(a) is resolved(b)
        assert resolved(a).split_cooldown_seconds == 5
        assert resolved(c).split_cooldown_seconds != 5
        await override(h.keys.policy("acme", "ns", "b"), 7)
        assert (resolved(a).split_cooldown_seconds, resolved(b).split_cooldown_seconds) == (5, 7)
        await override(h.keys.policy("acme", "ns"), 9)
        assert (resolved(a).split_cooldown_seconds, resolved(b).split_cooldown_seconds) == (9, 7)


async def test_a_cold_record_stamped_before_1970_gets_a_cold_since_every_replica_reads(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A broker without time stamps of its own but with a changedAtMs before 1970: the
    cold-since the leader wrote for it was negative, which the key's parser refuses, so
    every replica counted it as rejected metadata and the next leader lost it."""
    async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
        await h.add_topic(segments=2)
        for sid in (0, 1):  # Pulsar's shape: no sampledAtMs
            await h.store.put(
                h.keys.load(TOPIC, sid),
                b'{"msgRateIn":1,"byteRateIn":1,"msgRateOut":1,"byteRateOut":1,"changedAtMs":-5}',
            )

        async def written() -> bool:  # the leader's writes are batched: wait for etcd's answer
            return all([await h.store.get(h.keys.cold_since(TOPIC, sid)) for sid in (0, 1)])

        with anyio.fail_after(10):
            while not await written():  # noqa: ASYNC110 - an outcome of real I/O, as eventually
                await anyio.sleep(0.005)
        for sid in (0, 1):
            kv = await h.store.get(h.keys.cold_since(TOPIC, sid))
            assert kv is not None and int(kv.value) >= 0
        assert h.count("controllerd_metadata_rejected_total", kind="cold_since") == 0
