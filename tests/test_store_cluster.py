"""Store watches on a real three-member etcd when one member goes bad.

A daemon given all members' addresses must not stay on a member that still
answers but has lost the quorum, or one that froze: its watch there would stay
open and silent, and the view would stop while the cluster goes on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import pytest

from controllerd.adapters.store import Store, open_store
from tests.support.daemon import wait_until
from tests.support.etcd_cluster import EtcdCluster, etcd_cluster

PREFIX = "/cluster-test/"
WATCHES = 6


@pytest.fixture(name="cluster", scope="module")
def cluster_fixture() -> Iterator[EtcdCluster]:
    with etcd_cluster() as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def _healed(cluster: EtcdCluster) -> Iterator[None]:
    """Each test starts and ends with every member in the quorum."""
    yield
    cluster.heal()
    for member in range(cluster.size):
        cluster.resume(member)
    cluster.wait_healthy(range(cluster.size))


@pytest.fixture(name="everywhere")
async def everywhere_fixture(cluster: EtcdCluster) -> AsyncIterator[Store]:
    """A store given every member, as a daemon is configured."""
    async with open_store(cluster.endpoints, timeout=2.0, retry_for=10.0) as store:
        for _ in range(3 * cluster.size):  # round robin: connect to every member
            await store.get(PREFIX + "warm")
        yield store


class _Watches:
    """``WATCHES`` watches of ``PREFIX`` on one store: the highest value each saw."""

    def __init__(self, store: Store, start_revision: int) -> None:
        self.store = store
        self.start_revision = start_revision
        self.seen = [0] * WATCHES
        self.reconnects = 0
        store.on_watch_reconnect = self._reconnected

    def _reconnected(self) -> None:
        self.reconnects += 1

    async def run(self, index: int) -> None:
        async for batch in self.store.watch_prefix(PREFIX, self.start_revision):
            self.seen[index] = max(self.seen[index], *(int(e.value) for e in batch))

    async def all_saw(self, value: int) -> bool:
        return min(self.seen) >= value


async def _serving(cluster: EtcdCluster, watches: _Watches, value: int, writer: Store) -> int:
    """Once every watch is established and saw ``value``: a member serving one."""
    await writer.put(PREFIX + "x", str(value).encode())
    await wait_until(lambda: watches.all_saw(value), within=15)
    serving = [m for m in range(cluster.size) if cluster.watchers(m) > 0]
    assert serving, "no member reports a watcher"
    return serving[0]


async def _resumes_elsewhere(
    cluster: EtcdCluster, everywhere: Store, fault: Callable[[int], None], within: float
) -> None:
    """``fault`` one member serving a watch; every watch then sees what the others
    commit, within ``within`` seconds, after resuming on another member."""
    rev = await everywhere.put(PREFIX + "x", b"0")
    watches = _Watches(everywhere, rev + 1)
    async with anyio.create_task_group() as tg:
        for i in range(WATCHES):
            tg.start_soon(watches.run, i)
        bad = await _serving(cluster, watches, 1, everywhere)
        healthy = (bad + 1) % cluster.size
        async with open_store([cluster.endpoints[healthy]], timeout=2.0) as writer:
            fault(bad)
            for value in range(2, 12):
                await writer.put(PREFIX + "x", str(value).encode())
            await wait_until(lambda: watches.all_saw(11), within=within)
        tg.cancel_scope.cancel()
    assert watches.reconnects >= 1


async def test_a_watch_on_a_member_cut_off_from_the_quorum_resumes_on_another(
    cluster: EtcdCluster, everywhere: Store
) -> None:
    """The cut-off member's watches see nothing of what the quorum commits; without
    "hasleader" they never error, and wait for as long as the partition lasts."""
    await _resumes_elsewhere(cluster, everywhere, cluster.isolate, within=30)


async def test_a_watch_on_a_frozen_member_resumes_on_another(
    cluster: EtcdCluster, everywhere: Store
) -> None:
    """Only an unanswered keep-alive ping shows a frozen member (its TCP connections
    stay open): 10 s to the next ping, 5 s for the ack, then resume. Before the
    ping settings this took 68-130 s."""
    await _resumes_elsewhere(cluster, everywhere, cluster.pause, within=40)


async def test_a_watch_on_a_member_without_a_leader_waits_and_resumes_when_it_rejoins(
    cluster: EtcdCluster,
) -> None:
    """Given only a member that lost the quorum, watches retry (never fail) until it
    is back, and then miss nothing written meanwhile.

    etcd refuses each new stream there ("no leader"); in about 1 refusal in 5 the
    stream ends before grpc sends the create request, and grpc reports INTERNAL:
    40 refusals make that all but certain, and it must be retried too.
    """
    async with (
        open_store([cluster.endpoints[0]], timeout=2.0) as alone,
        open_store([cluster.endpoints[1]], timeout=2.0) as writer,
    ):
        rev = await writer.put(PREFIX + "x", b"0")
        watches = _Watches(alone, rev + 1)
        async with anyio.create_task_group() as tg:
            for i in range(WATCHES):
                tg.start_soon(watches.run, i)
            await writer.put(PREFIX + "x", b"1")
            await wait_until(lambda: watches.all_saw(1), within=15)
            cluster.isolate(0)
            for value in range(2, 6):
                await writer.put(PREFIX + "x", str(value).encode())

            async def refused_often() -> bool:
                return watches.reconnects >= 40

            await wait_until(refused_often, within=60)
            assert max(watches.seen) < 5  # nothing came through the cut
            cluster.heal()
            await wait_until(lambda: watches.all_saw(5), within=30)
            tg.cancel_scope.cancel()
