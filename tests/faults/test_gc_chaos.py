"""Garbage collection under chaos, on real ``controllerd run`` processes (issue #10, 11).

GC may delete a sealed segment's data only when it is past retention and
every subscription has drained it *as the broker says*. Here the broker's
backlog endpoint answers 500, 404, or never; one segment has real backlog;
one topic keeps its segments an hour. An *unsafe deletion* is a delete
request that reaches the broker for a segment whose backlog is > 0 or
unknown: there must be none, while a drained topic beside them is collected,
and everything is collected once the broker heals. A leader killed with
``kill -9`` between the prune transaction and the broker delete leaves a
pending-delete marker, which the next leader finishes.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from controllerd.adapters.store import Store
from controllerd.core.model import Layout, TopicName, layout_from_json
from tests.faults.chaos import SEGMENTS, Chaos, open_chaos, segments_prefix
from tests.support.daemon import wait_until
from tests.support.etcd import EtcdServer

GC = "[gc]\ninterval_seconds = 0.5\ndefault_retention_seconds = 1\n"


@pytest.fixture
async def chaos(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, tmp_path: Path
) -> AsyncIterator[Chaos]:
    async with open_chaos(
        store, etcd_server.endpoint, etcd_prefix, tmp_path, count=2, extra=GC
    ) as running:
        await running.leader()
        yield running


async def stored_layout(chaos: Chaos, topic: TopicName) -> Layout:
    kv = await chaos.store.get(chaos.keys.layout(topic))
    assert kv is not None
    return layout_from_json(orjson.loads(kv.value))


def deletes(chaos: Chaos, topic: TopicName) -> list[str]:
    """Delete-segment requests for ``topic`` as sent by controllerd (faulted or not)."""
    return [s.path for s in chaos.http.requests(segments_prefix(topic), method="DELETE")]


def backlog_calls(chaos: Chaos, topic: TopicName) -> int:
    return len(chaos.http.requests(segments_prefix(topic), method="GET"))


async def test_gc_never_deletes_with_backlog_unknown_backlog_or_inside_retention(
    chaos: Chaos,
) -> None:
    drained = TopicName("acme", "gc", "drained")
    backlog = TopicName("acme", "gc", "backlog")
    unknown = {
        TopicName("acme", "gc", "http-500"): 500,
        TopicName("acme", "gc", "http-404"): 404,
        TopicName("acme", "gc", "no-answer"): 0,
    }
    kept = TopicName("acme", "gc", "retention")
    parents = {drained: await chaos.split_with_subscription(drained)}
    for topic, status in unknown.items():
        parents[topic] = await chaos.split_with_unknown_backlog(topic, status)
    parents[backlog] = await chaos.split_with_subscription(backlog)
    chaos.broker.backlogs[(backlog, parents[backlog], "s")] = 5
    parents[kept] = await chaos.split_with_subscription(kept, retention=3_600)

    async def collected_and_asked() -> bool:  # GC works, and asked about every candidate
        chaos.assert_alive()
        return (drained, parents[drained]) in chaos.broker.deleted_segments and all(
            backlog_calls(chaos, t) >= 2 for t in (*unknown, backlog)
        )

    await wait_until(collected_and_asked, within=30)
    unsafe = {t: deletes(chaos, t) for t in (*unknown, backlog, kept) if deletes(chaos, t)}
    assert unsafe == {}, f"unsafe deletions: {unsafe}"
    for topic in (*unknown, backlog, kept):
        assert 0 in (await stored_layout(chaos, topic)).segments, f"{topic} was pruned"
        marker = chaos.keys.pending_delete(topic, parents[topic])
        assert await chaos.store.get(marker) is None, f"{topic} has a pending delete"
    assert backlog_calls(chaos, kept) == 0  # inside retention: not even a candidate

    # The broker heals and the subscription drains: everything past retention goes.
    chaos.http.heal()
    chaos.broker.backlogs[(backlog, parents[backlog], "s")] = 0

    async def all_collected() -> bool:
        chaos.assert_alive()
        return all((t, parents[t]) in chaos.broker.deleted_segments for t in (*unknown, backlog))

    await wait_until(all_collected, within=30)
    assert (kept, parents[kept]) not in chaos.broker.deleted_segments


async def test_a_leader_killed_between_prune_and_delete_leaves_a_marker_the_next_finishes(
    chaos: Chaos,
) -> None:
    topic = TopicName("acme", "gc", "crash")
    descriptor = await chaos.split_with_subscription(topic)
    leader = await chaos.leader()
    fault = chaos.http.hang(f"{SEGMENTS}acme/gc/crash/{descriptor}", method="DELETE")
    marker = chaos.keys.pending_delete(topic, descriptor)

    async def between_prune_and_delete() -> bool:
        chaos.assert_alive()
        return chaos.http.holding == 1

    await wait_until(between_prune_and_delete, within=20)
    assert await chaos.store.get(marker) is not None  # the prune transaction wrote it ...
    assert 0 not in (await stored_layout(chaos, topic)).segments  # ... with the pruned layout
    chaos.stopped.add(leader.name)
    leader.signal(signal.SIGKILL)
    chaos.http.heal(fault)
    await chaos.leader()  # the standby, once the dead leader's lease expired

    async def finished() -> bool:
        chaos.assert_alive()
        return await chaos.store.get(marker) is None

    await wait_until(finished, within=20)
    assert (topic, descriptor) in chaos.broker.deleted_segments
    assert await chaos.store.get(chaos.keys.load(topic, 0)) is None
    reached = [
        s
        for s in chaos.http.requests(f"{SEGMENTS}acme/gc/crash/", method="DELETE")
        if not s.injected
    ]
    assert len(reached) == 1, "the delete reached the broker more or less than once"
    assert chaos.active(topic) == 3
