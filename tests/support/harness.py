"""A leader's :class:`Controller` wired to real etcd and the test broker over real HTTP.

The test broker mirrors every layout it writes into etcd, as a Pulsar broker
does, so the controller sees its own operations arrive through the follower's
watch. Time is a :class:`ManualClock`: ticks, cooldowns and the GC interval
pass only when a test advances it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio

from controllerd import config as config_mod
from controllerd.adapters.audit import AuditSink
from controllerd.adapters.broker import BrokerClient
from controllerd.adapters.election import Leadership, lead
from controllerd.adapters.store import Store, open_store
from controllerd.core.model import Layout, TopicName
from controllerd.core.view import Keys, MetadataView
from controllerd.daemon.clock import ManualClock
from controllerd.daemon.controller import Controller
from controllerd.daemon.follower import feeding
from controllerd.daemon.metrics import Metrics
from tests.support.broker import (
    TestBrokerState,
    layout_json,
    load_json,
    mirror_into,
    serve_test_broker,
)

TOPIC = TopicName("acme", "ns", "orders")


def make_config(
    prefix: str,
    extra: str = "",
    *,
    settle: float = 0.0,
    interval: float = 60.0,
    profile: str = "reference",
) -> config_mod.Config:
    """A config rooted at ``prefix`` in etcd; ``extra`` is more TOML appended."""
    return config_mod.load(
        f"""
[etcd]
metadata_prefix = "{prefix}pulsar"
controller_prefix = "{prefix}controllerd"
[broker]
profile = "{profile}"
[autoscale]
consumer_settle_seconds = {settle}
interval_seconds = {interval}
{extra}
"""
    )


async def eventually(predicate: Callable[[], bool], within: float = 10.0) -> None:
    """Wait until ``predicate()`` holds: an outcome of real I/O, not a clock tick.

    Polls because the outcomes (a request at the broker, a key in etcd, a metric)
    come from other processes and libraries that expose no event to wait on.
    """
    with anyio.fail_after(within):
        while not predicate():  # noqa: ASYNC110 - see above
            await anyio.sleep(0.005)


@dataclass
class Harness:
    config: config_mod.Config
    keys: Keys
    store: Store
    broker_state: TestBrokerState
    broker: BrokerClient
    clock: ManualClock
    metrics: Metrics
    leadership: Leadership
    controller: Controller

    async def add_topic(self, topic: TopicName = TOPIC, segments: int = 1) -> Layout:
        layout = self.broker_state.add_topic(topic, segments)
        await self.store.put(self.keys.layout(topic), layout_json(layout))
        return layout

    async def add_subscription(
        self, sub: str, kind: str = "STREAM", topic: TopicName = TOPIC
    ) -> None:
        self.broker_state.subscriptions.setdefault(topic, {})[sub] = kind
        await self.store.put(
            self.keys.subscription(topic, sub), json.dumps({"type": kind}).encode()
        )

    async def register(self, sub: str, name: str, topic: TopicName = TOPIC) -> None:
        await self.store.put(self.keys.consumer(topic, sub, name), b"{}")

    async def put_load(
        self,
        segment_id: int,
        msg_in: float,
        *,
        topic: TopicName = TOPIC,
        changed_ms: int | None = None,
        sampled_ms: int | None = None,
    ) -> None:
        now = self.clock.now_ms()
        record = load_json(
            msg_in,
            now if changed_ms is None else changed_ms,
            now if sampled_ms is None else sampled_ms,
        )
        await self.store.put(self.keys.load(topic, segment_id), record)

    def set_config(self, config: config_mod.Config) -> None:
        """What a SIGHUP reload does: the controller reads the new one from now on."""
        self.config = config

    def layout(self, topic: TopicName = TOPIC) -> Layout:
        return self.broker_state.topics[topic]

    def view_layout(self, topic: TopicName = TOPIC) -> Layout | None:
        state = self.controller.view.topics.get(topic)
        return state.layout if state is not None else None

    def requests(self, fragment: str) -> int:
        return sum(1 for r in self.broker_state.requests if fragment in r.path)

    def count(self, metric: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(metric, labels or None)
        return value or 0.0


@contextlib.asynccontextmanager
async def open_harness(
    endpoint: str,
    prefix: str,
    *,
    extra_config: str = "",
    settle: float = 0.0,
    interval: float = 60.0,
    audit: AuditSink | None = None,
    profile: str = "reference",
    replica: str = "test-1",
    store: Store | None = None,
    controller_class: type[Controller] = Controller,
    leadership: Leadership | None = None,
    lead_while_loading: bool = False,
) -> AsyncIterator[Harness]:
    """A running leader; leaves by cancelling it (resigning the lease).

    It leads once the view is loaded, or with ``lead_while_loading`` at once
    (as a replica that found no leader does; the load may still run when the
    harness is yielded).
    """
    cfg = make_config(prefix, extra_config, settle=settle, interval=interval, profile=profile)
    keys = Keys(cfg.metadata_prefix, cfg.controller_root)
    state = TestBrokerState(profile="reference" if profile == "reference" else "pulsar")
    clock = ManualClock()
    state.clock_ms = clock.now_ms
    metrics = Metrics()
    async with contextlib.AsyncExitStack() as stack:
        if store is None:
            store = await stack.enter_async_context(
                open_store([endpoint], timeout=2.0, retry_for=5.0)
            )
        state.on_layout_change = mirror_into(store, keys)
        url = await stack.enter_async_context(serve_test_broker(state))
        broker = await stack.enter_async_context(
            BrokerClient(url, profile=state.profile, timeout=2.0, max_retries=0)
        )
        if leadership is None:
            leadership = await stack.enter_async_context(
                lead(store, keys.leader, {"replica": replica}, ttl=5)
            )
        box: list[Harness] = []
        view = MetadataView(keys)
        controller = controller_class(
            config=lambda: box[0].config,
            store=store,
            broker=broker,
            view=view,
            metrics=metrics,
            audit=audit or AuditSink(),
            clock=clock,
            replica=replica,
        )
        follower = feeding(store, controller, clock)  # wired as the daemon wires it
        harness = Harness(cfg, keys, store, state, broker, clock, metrics, leadership, controller)
        box.append(harness)
        async with anyio.create_task_group() as tg:
            tg.start_soon(follower.run)
            if not lead_while_loading:
                await follower.synced.wait()
            controller.grant(None, leadership)
            tg.start_soon(controller.run)
            await controller.ready.wait()
            yield harness
            tg.cancel_scope.cancel()
