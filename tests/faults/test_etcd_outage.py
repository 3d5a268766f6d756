"""etcd outages under running replicas (issue #10): real etcd paused and restarted.

An outage of any length never ends a replica; the leader stops acting once it
cannot vouch for its lease, a replica leads again once etcd is back, and what
happened meanwhile is acted on.
"""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from controllerd.adapters.store import Store
from controllerd.core.model import TopicName
from tests.support.cluster import Cluster, open_cluster
from tests.support.daemon import wait_until
from tests.support.etcd import EtcdServer

TTL = 2


@pytest.fixture
async def cluster(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, tmp_path: Path
) -> AsyncIterator[Cluster]:
    async with open_cluster(
        store, etcd_server.endpoint, etcd_prefix, tmp_path, count=2, lease_ttl=TTL
    ) as running:
        yield running


async def _not_leading(cluster: Cluster) -> bool:
    return not any([await r.is_leader() for r in cluster.replicas])


@pytest.mark.parametrize("seconds", [1.0, 6.0])
async def test_etcd_paused_no_replica_exits_and_one_leads_again(
    cluster: Cluster, etcd_server: EtcdServer, seconds: float
) -> None:
    await cluster.leader()
    etcd_server.pause()
    try:
        if seconds > TTL:
            # The leader can no longer vouch for its lease: it stops acting.
            await wait_until(lambda: _not_leading(cluster), within=TTL + 2)
        await anyio.sleep(seconds)  # the outage itself, not a wait for a tick
        assert all(r.alive() for r in cluster.replicas), "a replica exited during the outage"
    finally:
        etcd_server.resume()
    leader = await cluster.leader(within=15)
    assert all(r.alive() for r in cluster.replicas)
    await cluster.add_topic(segments=1)
    await cluster.put_load(0, 30_000.0)
    await wait_until(lambda: _split_once(cluster), within=10)
    assert await leader.is_leader() or any([await r.is_leader() for r in cluster.replicas])


async def _split_once(cluster: Cluster) -> bool:
    return cluster.splits() == 1


async def test_resigning_against_a_paused_etcd_never_raises(
    store: Store, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """#10 item 2: the shielded, bounded resignation used to let grpc's CancelledError
    escape when its deadline met the call's own (a crash on every such shutdown)."""
    from controllerd.adapters.election import lead

    for bound in (0.3, 0.8, 1.4):
        async with lead(
            store, f"{etcd_prefix}leader", {"name": "a"}, ttl=2, resign_timeout=bound
        ) as leadership:
            assert leadership.is_leader()
            etcd_server.pause()
        # Reaching this line is the assertion: leaving resigned without raising.
        etcd_server.resume()
        assert not leadership.is_leader()


async def test_etcd_paused_then_killed_and_restarted_10_times(
    cluster: Cluster, etcd_server: EtcdServer
) -> None:
    """A long pause (five lease TTLs; bench/fault_bench.py goes to 30 s), then a crash
    loop: every replica survives all of it, the first write after etcd's return is
    acted on, and SIGTERM still ends every replica with status 0."""
    await cluster.leader()
    await cluster.add_topic(segments=1)
    etcd_server.pause()
    try:
        paused = time.monotonic()
        await wait_until(lambda: _not_leading(cluster), within=TTL + 2)
        await anyio.sleep(5 * TTL - (time.monotonic() - paused))  # the outage itself
        assert all(r.alive() for r in cluster.replicas), "a replica exited during the pause"
    finally:
        etcd_server.resume()
    returned = time.monotonic()
    await cluster.put_load(0, 30_000.0)
    await wait_until(lambda: _split_once(cluster), within=30)
    print(f"etcd paused {5 * TTL} s: first action {time.monotonic() - returned:.2f}s after")
    # Mostly quick restarts, two of them down past the lease TTL.
    for downtime in (0.2, 0.2, TTL + 1.0, 0.2, 0.2, 0.2, TTL + 1.0, 0.2, 0.2, 0.2):
        etcd_server.kill()
        await anyio.sleep(downtime)  # the outage itself
        etcd_server.start()
        assert all(r.alive() for r in cluster.replicas), "a replica exited on an etcd restart"
    await cluster.leader(within=15)
    other = TopicName("acme", "ns", "after-restarts")
    await cluster.add_topic(other, segments=1)
    returned = time.monotonic()
    await cluster.put_load(0, 30_000.0, topic=other)

    async def split_after_restarts() -> bool:
        return cluster.requests("/after-restarts/split/") == 1

    await wait_until(split_after_restarts, within=15)
    print(f"after 10 etcd restarts: first action {time.monotonic() - returned:.2f}s after a write")
    assert all(r.alive() for r in cluster.replicas)
    for replica in cluster.replicas:
        replica.signal(signal.SIGTERM)
    codes = [await anyio.to_thread.run_sync(r.wait, 15.0) for r in cluster.replicas]
    assert codes == [0, 0]
