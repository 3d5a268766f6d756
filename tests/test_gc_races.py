"""GC racing the world, against real etcd and a broker over real HTTP (a review, 11/2026).

Each test is a way GC deleted what it must not, or pruned what it could never delete:
a subscription created during the backlog calls; a pending-delete marker that
outlived its topic and, the name created again, named the new topic's segment (ids
restart at 0, so descriptors repeat); a Pulsar topic whose name no REST path carries.
GC rounds run when the tests call them, on a :class:`ManualClock`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import anyio
import orjson
import pytest
import structlog.testing

from controllerd.adapters.audit import AuditSink
from controllerd.adapters.broker import BrokerClient
from controllerd.adapters.election import lead
from controllerd.adapters.store import Store, open_store
from controllerd.core.model import Layout, Segment, TopicName, layout_from_json
from controllerd.core.view import Keys, MetadataView
from controllerd.daemon.clock import ManualClock
from controllerd.daemon.controller import Controller
from controllerd.daemon.follower import feeding
from controllerd.daemon.metrics import Metrics
from tests.support.etcd import EtcdServer
from tests.support.harness import TOPIC, Harness, eventually, make_config, open_harness
from tests.support.pulsar import PulsarModel

RETENTION = "[gc]\ndefault_retention_seconds = 600\ninterval_seconds = 1e9\n"
PULSAR_GC = "[gc]\nenabled = true\ndefault_retention_seconds = 600\ninterval_seconds = 1e9\n"
HOT = 30_000.0  # 3x the default split threshold


async def split_hot(h: Harness) -> Segment:
    """A one-segment topic goes hot and is split; its sealed segment 0."""
    await h.add_topic(segments=1)
    await h.put_load(0, HOT)
    await eventually(lambda: len(h.layout().active_segments()) == 3)
    await eventually(lambda: not h.controller.status()["in_flight"])
    return h.layout().segments[0]


async def stored_layout(store: Store, keys: Keys, topic: TopicName = TOPIC) -> Layout:
    kv = await store.get(keys.layout(topic))
    assert kv is not None
    return layout_from_json(json.loads(kv.value))


def deletes(h: Harness) -> list[str]:
    return [r.path for r in h.broker_state.requests if r.method == "DELETE"]


# --- a subscription created during the backlog calls -----------------------------------------


class LateSubscription(Controller):
    """While ``armed``: once GC has asked its backlogs, a client creates subscription
    ``late`` (its cursor at the earliest entry of every segment, as the reference
    broker places it), and this replica's view applies it, all before the prune."""

    harness: Harness
    armed = True

    async def _gc_backlogs(
        self, topic: TopicName, segments: list[Segment], subscriptions: list[str]
    ) -> dict[int, dict[str, int | None]]:
        backlogs = await super()._gc_backlogs(topic, segments, subscriptions)
        if self.armed:
            type(self).armed = False
            h = self.harness
            for seg in segments:
                h.broker_state.backlogs[(topic, seg.descriptor, "late")] = 100
            await h.add_subscription("late")
            await eventually(lambda: "late" in self.view.topics[topic].subscriptions)
        return backlogs


async def test_a_subscription_created_during_the_backlog_calls_holds_the_prune_back(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """The prune was fenced on the layout and the leadership only: a subscription created
    after GC read the subscriptions (here: none, so drained) was pruned past unread.
    The prune now also requires every subscription key unchanged since that read."""
    LateSubscription.armed = True
    async with open_harness(
        etcd_server.endpoint,
        etcd_prefix,
        extra_config=RETENTION,
        controller_class=LateSubscription,
    ) as h:
        LateSubscription.harness = h
        parent = await split_hot(h)
        marker = h.keys.pending_delete(TOPIC, parent.descriptor)
        await h.clock.advance(700.0)
        await h.controller.gc_round()
        assert not LateSubscription.armed  # the subscription came during the round
        assert 0 in (await stored_layout(h.store, h.keys)).segments
        assert await h.store.get(marker) is None
        assert deletes(h) == []
        assert h.count("controllerd_operations_total", op="prune", outcome="conflict") == 1
        # The next round asks the new subscription too, and keeps what it has not read.
        await h.controller.gc_round()
        assert h.requests(f"{parent.descriptor}/subscription/late/backlog") == 1
        assert 0 in (await stored_layout(h.store, h.keys)).segments and deletes(h) == []
        # Read, it goes.
        h.broker_state.backlogs[(TOPIC, parent.descriptor, "late")] = 0
        await h.controller.gc_round()
        assert 0 not in (await stored_layout(h.store, h.keys)).segments
        assert (TOPIC, parent.descriptor) in h.broker_state.deleted_segments
        assert await h.store.get(marker) is None


# --- a marker that outlived its topic --------------------------------------------------------


@pytest.mark.parametrize("revision", [True, False], ids=["with-revision", "older-marker"])
async def test_a_marker_of_an_earlier_topic_of_the_name_is_dropped_not_deleted(
    etcd_server: EtcdServer, etcd_prefix: str, revision: bool
) -> None:
    """A marker left by a topic deleted while no one led it (so no one deleted its
    markers) names ``0000-ffff-0``; the topic created again under the name has just
    sealed its own segment 0 with that descriptor, well inside retention. Retried, the
    marker deleted it: no retention, no backlog check. It is now told apart, by the
    layout revision it records (the new layout key was created after it) or, for a
    marker written before markers recorded it, because the layout holds the segment."""
    async with open_harness(etcd_server.endpoint, etcd_prefix, extra_config=RETENTION) as h:
        sealed = await split_hot(h)
        layout_kv = await h.store.get(h.keys.layout(TOPIC))
        assert layout_kv is not None
        old = {
            "topic": str(TOPIC),
            "descriptor": sealed.descriptor,
            "segmentId": sealed.segment_id,
            "prunedAtMs": 1,
        }
        if revision:
            old["layoutRevision"] = layout_kv.create_revision - 1  # the earlier topic's
        marker = h.keys.pending_delete(TOPIC, sealed.descriptor)
        await h.store.put(marker, orjson.dumps(old))
        with structlog.testing.capture_logs() as logs:
            await h.controller.gc_round()
        assert deletes(h) == [] and h.broker_state.deleted_segments == set()
        assert 0 in (await stored_layout(h.store, h.keys)).segments
        assert await h.store.get(marker) is None
        assert [e["event"] for e in logs].count("gc.marker.outlived") == 1


@contextlib.asynccontextmanager
async def pulsar_leader(
    etcd_server: EtcdServer, etcd_prefix: str
) -> AsyncIterator[tuple[Controller, PulsarModel, Store, Keys, ManualClock]]:
    """A leader with ``profile = "pulsar"`` and GC on, beside the Pulsar behaviour model."""
    cfg = make_config(etcd_prefix, PULSAR_GC, profile="pulsar")
    keys = Keys(cfg.metadata_prefix, cfg.controller_root)
    clock = ManualClock()
    async with contextlib.AsyncExitStack() as stack:
        store = await stack.enter_async_context(
            open_store([etcd_server.endpoint], timeout=2.0, retry_for=5.0)
        )
        model = PulsarModel(
            store, prefix=cfg.metadata_prefix, authentication_enabled=False, clock_ms=clock.now_ms
        )
        url = await stack.enter_async_context(model.serve())
        broker = await stack.enter_async_context(
            BrokerClient(url, profile="pulsar", timeout=2.0, max_retries=0)
        )
        leadership = await stack.enter_async_context(
            lead(store, keys.leader, {"replica": "r"}, ttl=5)
        )
        controller = Controller(
            config=lambda: cfg,
            store=store,
            broker=broker,
            view=MetadataView(keys),
            metrics=Metrics(),
            audit=AuditSink(),
            clock=clock,
            replica="r",
        )
        follower = feeding(store, controller, clock)
        async with anyio.create_task_group() as tg:
            tg.start_soon(follower.run)
            await follower.synced.wait()
            controller.grant(None, leadership)
            tg.start_soon(controller.run)
            await controller.ready.wait()
            yield controller, model, store, keys, clock
            tg.cancel_scope.cancel()
        await model.aclose()


async def split_in_pulsar(c: Controller, model: PulsarModel, topic: TopicName) -> str:
    """A Pulsar topic split once, seen by the leader; its sealed segment 0's descriptor."""
    await model.create_topic(topic, 1)
    await model.split(topic, 0)

    def seen() -> bool:
        state = c.view.topics.get(topic)
        return state is not None and state.layout is not None and state.layout.epoch == 1

    await eventually(seen)
    layout = await model.layout(topic)
    assert layout is not None
    return layout.segments[0].descriptor


async def test_a_deleted_topics_pending_delete_is_still_finished(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """Pulsar: a delete left behind (the broker answered 503) is retried after its topic
    is deleted: Pulsar's topic delete leaves the segments no longer in its layout. (A
    topic created again first: see the test above.)"""
    topic = TopicName("acme", "ns", "orders")
    async with pulsar_leader(etcd_server, etcd_prefix) as (c, model, store, keys, clock):
        sealed = await split_in_pulsar(c, model, topic)
        await clock.advance(700.0)
        model.fail_next = [503]
        await c.gc_round()
        marker = keys.pending_delete(topic, sealed)
        assert await store.get(marker) is not None

        await model.delete_topic(topic)
        await eventually(lambda: topic not in c.view.topics)
        await c.gc_round()
        assert await store.get(marker) is None  # retried: the delete was finished
        deletes = [
            r.status
            for r in model.requests
            if r.method == "DELETE" and r.path.endswith(f"/orders/{sealed}")
        ]
        assert len(deletes) == 2 and deletes[0] == 503


# --- a name Pulsar's REST paths cannot carry -------------------------------------------------


async def test_gc_leaves_a_topic_whose_name_no_rest_path_carries_unpruned(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """Pulsar: with no subscription to ask about, GC pruned the sealed segment of
    ``my orders`` (an etcd write), then every delete failed before it left the process:
    the marker was retried for ever and the data never deleted (Pulsar's own GC no
    longer sees the segment). Such a topic is now left alone, said once."""
    topic = TopicName("acme", "ns", "my orders")
    async with pulsar_leader(etcd_server, etcd_prefix) as (c, model, store, keys, clock):
        sealed = await split_in_pulsar(c, model, topic)
        await clock.advance(700.0)
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                await c.gc_round()
        pulsars = await model.layout(topic)
        assert pulsars is not None and 0 in pulsars.segments
        assert (topic, sealed) in model.segment_topics
        assert (await store.get_prefix(keys.pending_deletes_prefix))[0] == []
        assert [e["event"] for e in logs].count("topic.unaddressable") == 1
        assert [e for e in logs if e["event"] == "gc.pruned"] == []
