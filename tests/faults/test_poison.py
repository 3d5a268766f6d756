"""Poison values through the real watch (issue #10, defect 3).

One malformed value used to kill every replica, on every election: ``{}`` at
a cold-since key, a cooldown with a non-integer, a 400-digit rate, 100k
nested ``[``, a pending-delete marker with ``segmentId`` 1e999. Here
hypothesis writes well over a thousand malformed values of every key kind
into real etcd under a running controller and its follower; each must be
refused at the parsing boundary and counted by kind, while a good topic
beside them keeps splitting, and a new leader that loads them all at once
survives and serves too. The issue's own examples then go to real
``controllerd run`` processes, one of which is killed with ``kill -9``.
"""

from __future__ import annotations

import collections
import signal
from pathlib import Path

import anyio
import anyio.from_thread
import anyio.to_thread
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from controllerd.adapters.store import Store
from controllerd.core.model import TopicName
from tests.faults.chaos import HOT, Chaos, open_chaos
from tests.faults.poison import (
    KINDS,
    NAMED,
    NEVER_REJECTED,
    Poison,
    held,
    poison_key,
    poison_values,
)
from tests.support.daemon import wait_until
from tests.support.etcd import EtcdServer
from tests.support.harness import Harness, eventually, open_harness

#: hypothesis examples; each writes a batch of 20 to 60 values.
EXAMPLES = 40
REJECTED = "controllerd_metadata_rejected_total"


def _rejected_kinds() -> list[str]:
    return [k for k in KINDS if k not in NEVER_REJECTED]


def _counts(h: Harness) -> dict[str, float]:
    return {kind: h.count(REJECTED, kind=kind) for kind in _rejected_kinds()}


class _Stream:
    """Writes hypothesis's batches into etcd and checks each one (on the event loop)."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.written: list[tuple[str, str]] = []
        self.tried: collections.Counter[str] = collections.Counter()
        self.good_splits = 0

    async def batch(self, poisons: list[Poison]) -> None:
        h = self.h
        before = _counts(h)
        keys: list[tuple[Poison, int]] = []
        for poison in poisons:
            n = len(self.written)
            key = poison_key(h.keys, poison.kind, n)
            self.written.append((poison.kind, key))
            keys.append((poison, n))
            await h.store.put(key, poison.value)
            self.tried[poison.kind] += 1
        # A good topic, created after the poison and served while it is there.
        good = TopicName("acme", "ns", f"good-{self.good_splits}")
        await h.add_topic(good)
        await h.put_load(0, HOT, topic=good)
        expected = collections.Counter(p.kind for p, _ in keys if p.kind not in NEVER_REJECTED)
        view = h.controller.view

        def counted() -> bool:
            return all(_counts(h)[k] - before[k] == expected[k] for k in _rejected_kinds())

        def registered() -> bool:
            return all(held(view, p.kind, n) for p, n in keys if p.kind in NEVER_REJECTED)

        await eventually(counted, within=15)
        await eventually(registered, within=15)
        for poison, n in keys:
            if poison.kind not in NEVER_REJECTED:
                assert not held(view, poison.kind, n), (
                    f"the view took a malformed {poison.kind} value: {poison.value[:80]!r}"
                )
        await eventually(lambda: h.requests(f"/{good.topic}/split/") == 1, within=15)
        self.good_splits += 1


async def test_a_thousand_malformed_values_are_refused_by_kind_and_good_topics_split(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with open_harness(etcd_server.endpoint, etcd_prefix) as h:
        stream = _Stream(h)

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            # A failure names its value in the message; shrinking would replay
            # batches into the same live process and muddle the counters.
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(st.lists(poison_values, min_size=20, max_size=60))
        def write(poisons: list[Poison]) -> None:
            anyio.from_thread.run(stream.batch, poisons)

        await anyio.to_thread.run_sync(write)
        print(f"malformed values tried: {sum(stream.tried.values())} {dict(stream.tried)}")
        assert sum(stream.tried.values()) >= 1_000
        assert set(stream.tried) == set(KINDS)
        assert stream.good_splits == EXAMPLES
        # A key written twice (the tenant-wide policy key) is loaded once.
        totals = collections.Counter(kind for kind, _ in set(stream.written))

    # A new leader loads every poison value at once, survives, counts and serves.
    async with open_harness(etcd_server.endpoint, etcd_prefix, replica="test-2") as h2:
        assert h2.leadership.token > h.leadership.token
        for kind in _rejected_kinds():
            assert h2.count(REJECTED, kind=kind) == totals[kind], kind
        good = TopicName("acme", "ns", "good-after-election")
        await h2.add_topic(good)
        await h2.put_load(0, HOT, topic=good)
        await eventually(lambda: h2.requests(f"/{good.topic}/split/") == 1, within=15)


async def _rejections(chaos: Chaos, index: int) -> dict[str, float]:
    replica = chaos.replicas[index]
    return {kind: await chaos.metric(replica, REJECTED, kind=kind) for kind in _rejected_kinds()}


async def test_the_issues_poison_under_real_processes_and_a_kill_9(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, tmp_path: Path
) -> None:
    async with open_chaos(store, etcd_server.endpoint, etcd_prefix, tmp_path, count=2) as chaos:
        leader = await chaos.leader()
        for n, poison in enumerate(NAMED):
            await store.put(poison_key(chaos.keys, poison.kind, n), poison.value)
        expected = collections.Counter(p.kind for p in NAMED if p.kind not in NEVER_REJECTED)
        want = {kind: float(expected[kind]) for kind in _rejected_kinds()}
        for index in (0, 1):  # the leader and the hot standby both follow the watch

            async def counted(index: int = index) -> bool:
                chaos.assert_alive()
                return await _rejections(chaos, index) == want

            await wait_until(counted, within=15)
        good = TopicName("acme", "ns", "good")
        await chaos.add_topic(good)
        await chaos.put_load(0, HOT, topic=good)
        await wait_until(lambda: _split(chaos, good), within=15)
        chaos.assert_alive()

        # A replica started now loads the poison at once; then it must take over.
        fresh = await chaos.start_replica()
        assert await _rejections(chaos, 2) == want
        standby = next(r for r in chaos.replicas[:2] if r is not leader)
        chaos.stopped.update({standby.name, leader.name})
        await standby.stop()
        leader.signal(signal.SIGKILL)
        await wait_until(fresh.is_leader, within=20)
        again = TopicName("acme", "ns", "good-after-kill")
        await chaos.add_topic(again)
        await chaos.put_load(0, HOT, topic=again)
        await wait_until(lambda: _split(chaos, again), within=15)
        chaos.assert_alive()
        assert fresh.alive()


async def _split(chaos: Chaos, topic: TopicName) -> bool:
    chaos.assert_alive()
    return chaos.active(topic) == 3
