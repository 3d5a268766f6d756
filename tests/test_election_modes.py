"""Replicas of both election modes at once (a rolling change of ``[election] mode``).

The modes fence with different keys (``<root>/leader``; ``<root>/shards/<n>``) and the
broker accepts either, so both acting would act twice on every topic. A replica looks
for the other mode's keys after writing its own and before acting, and waits while
they are held: not ready, saying why. Real ``controllerd run`` processes on real etcd.
"""

from __future__ import annotations

from pathlib import Path

from controllerd.adapters.store import Store
from controllerd.core.model import TopicName
from controllerd.core.shards import DEFAULT_SHARDS
from tests.support.cluster import Cluster, open_cluster
from tests.support.daemon import Replica, wait_until, write_config
from tests.support.etcd import EtcdServer
from tests.support.kafka import free_port

TTL = 2
TOPIC = TopicName("acme", "ns", "mixed")


def make_replica(
    name: str, shards: int | None, etcd: EtcdServer, prefix: str, cluster: Cluster
) -> Replica:
    """A replica (not started) of ``cluster``'s etcd and broker, in the mode ``shards`` says."""
    port = free_port()
    config = write_config(
        cluster.tmp.parent / f"{name}.toml",
        etcd=etcd.endpoint,
        prefix=prefix,
        broker_url=cluster.broker_url,
        port=port,
        lease_ttl=TTL,
        shards=shards,
    )
    return Replica(name, config, port, cluster.tmp.parent / f"{name}.log")


def said(replica: Replica, event: str) -> bool:
    return any(e.get("event") == event for e in replica.log_events())


async def owned(replica: Replica) -> int:
    status = await replica.status()
    return len(status["shards"]["owned"]) if status and "shards" in status else -1


async def held_back(replica: Replica) -> bool:
    """Not ready because of the other mode, by /status and by the metric."""
    status = await replica.status()
    reason = (status or {}).get("not_ready_reason") or ""
    gauge = await replica.metric("controllerd_not_ready_reason", reason="election-mode-mixed")
    return reason.startswith("election modes mixed: ") and gauge == 1.0


async def test_a_replica_of_the_other_election_mode_waits_and_never_acts_beside_it(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, tmp_path: Path
) -> None:
    async with open_cluster(
        store, etcd_server.endpoint, etcd_prefix, tmp_path / "single", count=1, lease_ttl=TTL
    ) as cluster:
        single = await cluster.leader()
        sharded = make_replica("sharded", DEFAULT_SHARDS, etcd_server, etcd_prefix, cluster)
        late = Replica("late", single.config, single.port, tmp_path / "late.log")
        sharded.start()
        try:
            # A sharded replica joins beside a single-mode leader: it claims no shard.
            await wait_until(lambda: held_back(sharded), within=30)
            assert said(sharded, "election.mode_mixed")
            assert await owned(sharded) == 0
            assert await single.is_leader()
            # The leader acts, alone: every accepted call carries the leader key's token.
            await cluster.add_topic(TOPIC, segments=1)
            await cluster.put_load(0, 30_000.0, TOPIC)

            async def split() -> bool:
                return len(cluster.broker.topics[TOPIC].active_segments()) > 1

            await wait_until(split, within=20)
            accepted = [c for c in cluster.broker.fenced_calls if c.accepted]
            assert accepted and all(
                c.key == f"{cluster.keys.controller_root}/leader" for c in accepted
            )
            assert await owned(sharded) == 0

            # The single-mode leader stops: the sharded replica takes every shard.
            await single.stop()

            async def owns_all() -> bool:
                return await owned(sharded) == DEFAULT_SHARDS and await sharded.ready()

            await wait_until(owns_all, within=30)
            assert said(sharded, "election.mode_mix_cleared")

            # A single-mode replica starting now wins the vacant leader key, and waits.
            late.start()
            await wait_until(lambda: held_back(late), within=30)
            status = await late.status()
            assert status is not None and status["leader"] is False
            assert await owned(sharded) == DEFAULT_SHARDS and await sharded.ready()
        finally:
            await late.stop()
            await sharded.stop()


async def test_replicas_of_both_modes_started_together_never_both_act(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, tmp_path: Path
) -> None:
    """Started at the same moment, at least one of the two sees the other's key (each
    writes its own, then reads): the broker never accepts calls fenced by both modes."""
    async with open_cluster(
        store, etcd_server.endpoint, etcd_prefix, tmp_path / "none", count=0, lease_ttl=TTL
    ) as cluster:
        replicas = [
            make_replica(name, shards, etcd_server, etcd_prefix, cluster)
            for name, shards in (("single", None), ("sharded", DEFAULT_SHARDS))
        ]
        topics = [TopicName("acme", "ns", f"t{i}") for i in range(8)]
        for topic in topics:  # work for whoever acts, spread over many shards
            await cluster.add_topic(topic, segments=1)
            await cluster.put_load(0, 30_000.0, topic)
        for replica in replicas:
            replica.start()
        try:

            def kinds() -> set[str]:
                """The fencing keys of the calls the broker accepted, by mode."""
                return {
                    "leader" if c.key.endswith("/leader") else "shard"
                    for c in cluster.broker.fenced_calls
                    if c.accepted
                }

            async def settled() -> bool:
                held = [await held_back(r) for r in replicas]
                return all(held) or (any(held) and bool(kinds())) or len(kinds()) > 1

            # Once held back, a replica acts only after the other mode's keys are gone;
            # the one that acts never looks again. So this state lasts.
            await wait_until(settled, within=30)
            assert len(kinds()) <= 1, kinds()
        finally:
            for replica in replicas:
                await replica.stop()
