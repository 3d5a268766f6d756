"""Sharded membership under etcd faults and hand edits, on the real test etcd.

Each test runs :class:`ShardMembership` (one or two replicas in this process)
against the session's etcd and breaks something a real deployment can see: a
compaction that hides a delete, shard or member keys put by hand, a release
that fails. The invariant checked each time: every shard ends owned by its
rendezvous owner, with a key on that owner's lease.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio
import structlog

from controllerd.adapters.election import Leadership
from controllerd.adapters.membership import ShardMembership
from controllerd.adapters.store import (
    Compare,
    Delete,
    Put,
    Store,
    StoreUnavailable,
    TxnResult,
    open_store,
)
from controllerd.core.shards import assignment, shard_name
from tests.support.daemon import wait_until
from tests.support.etcd import EtcdServer, compact
from tests.support.harness import eventually
from tests.support.proxy import serve_proxy

TTL = 2


class Replica:
    """One membership, and what it was told: grants and revokes, in order."""

    def __init__(self, store: Store, root: str, name: str, shards: int, ttl: int = TTL) -> None:
        self.calls: list[tuple[str, int]] = []
        self.membership = ShardMembership(
            store,
            root,
            name,
            {"replica": name},
            shards,
            ttl=ttl,
            grant=self._grant,
            revoke=lambda shard: self.calls.append(("revoke", shard)),
        )

    def _grant(self, shard: int, leadership: Leadership) -> None:
        self.calls.append(("grant", shard))

    @property
    def owned(self) -> dict[int, Leadership]:
        return self.membership.owned


@asynccontextmanager
async def running(*replicas: Replica) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:
        for replica in replicas:
            tg.start_soon(replica.membership.run)
        yield
        tg.cancel_scope.cancel()


def shard_key(root: str, shard: int) -> str:
    return f"{root}/shards/{shard_name(shard)}"


def share(shards: int, members: Sequence[str], name: str) -> set[int]:
    return {s for s, owner in assignment(shards, members).items() if owner == name}


async def held_by(store: Store, root: str, replica: Replica, shard: int) -> bool:
    """The replica owns ``shard`` and etcd agrees: the key, its token, on its lease."""
    leadership = replica.owned.get(shard)
    kv = await store.get(shard_key(root, shard))
    return (
        leadership is not None
        and kv is not None
        and (kv.create_revision, kv.lease) == (leadership.token, leadership.lease_id)
    )


async def wait_held(store: Store, root: str, replica: Replica, shards: set[int]) -> None:
    async def held() -> bool:
        return all([await held_by(store, root, replica, s) for s in shards])

    await wait_until(held, within=10)


async def test_a_shard_key_deleted_during_a_compaction_gap_is_lost_and_claimed_again(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store
) -> None:
    """The watch cannot say what a compaction hid: the re-read must compare with ``owned``.

    The replica reaches etcd through a proxy that refuses it while its shard key is
    deleted and the history compacted; it kept "owning" the shard, with a token
    that fences every operation, and nobody claimed it again.
    """
    root = f"{etcd_prefix}c"
    async with (
        serve_proxy(etcd_server.endpoint) as proxy,
        open_store([proxy.endpoint], timeout=0.5, retry_for=1.0) as cut_off,
    ):
        replica = Replica(cut_off, root, "r1", 4, ttl=6)  # outlives the outage
        async with running(replica):
            await wait_held(store, root, replica, {0, 1, 2, 3})
            old = replica.owned[0].token
            await proxy.set_mode("refuse")  # resets the watches: the delete is not seen
            await store.delete(shard_key(root, 0))
            revision = await store.put(f"{etcd_prefix}bump", b"x")
            await compact(etcd_server.endpoint, revision)
            await proxy.set_mode("pass")
            await eventually(lambda: 0 in replica.owned and replica.owned[0].token != old)
            await wait_held(store, root, replica, {0, 1, 2, 3})
    revoked = replica.calls.index(("revoke", 0))  # it stopped acting, then acted again
    assert ("grant", 0) in replica.calls[revoked:]


async def test_a_shard_key_on_no_lease_is_cleared_by_its_owner_and_claimed(
    store: Store, etcd_prefix: str
) -> None:
    """A key put by hand (no lease, garbage) outlives every replica: its owner clears it."""
    root = f"{etcd_prefix}c"
    await store.put(shard_key(root, 1), b"\xffgarbage")
    replica = Replica(store, root, "r1", 4)
    async with running(replica):
        await wait_held(store, root, replica, {0, 1, 2, 3})


async def test_an_owned_key_moved_to_no_lease_is_a_loss_then_claimed_again(
    store: Store, etcd_prefix: str
) -> None:
    """A put keeps the create revision (the token) but drops the lease: not ours any more.

    The key no longer ends with our lease, so it would outlive us; the owner used
    to ignore the change and go on acting.
    """
    root = f"{etcd_prefix}c"
    replica = Replica(store, root, "r1", 4)
    async with running(replica):
        await wait_held(store, root, replica, {0, 1, 2, 3})
        old = replica.owned[2].token
        await store.put(shard_key(root, 2), b"\xffgarbage")  # same create revision, lease 0
        await eventually(lambda: ("revoke", 2) in replica.calls)
        await eventually(lambda: 2 in replica.owned and replica.owned[2].token != old)
        await wait_held(store, root, replica, {0, 1, 2, 3})


async def test_a_key_on_a_live_lease_that_does_not_own_the_shard_is_cleared_by_that_replica(
    store: Store, etcd_prefix: str
) -> None:
    """The rightful owner waits on a key on another live lease (a handover); that replica,
    not owning the shard, deletes it."""
    root = f"{etcd_prefix}c"
    shards = 8
    one, two = Replica(store, root, "r1", shards), Replica(store, root, "r2", shards)
    mine, theirs = share(shards, ["r1", "r2"], "r1"), share(shards, ["r1", "r2"], "r2")
    assert mine and theirs
    async with running(one, two):
        await wait_held(store, root, one, mine)
        await wait_held(store, root, two, theirs)
        victim = min(mine)
        member = await store.get(f"{root}/members/r2")
        assert member is not None
        # by hand, onto r2's lease (the create revision stays): r1 must let go, r2 clear it
        await store.put(shard_key(root, victim), b"junk", member.lease)
        await eventually(lambda: ("revoke", victim) in one.calls)
        await wait_held(store, root, one, mine)
        await wait_held(store, root, two, theirs)
    assert victim not in two.owned


async def test_a_member_key_put_by_hand_takes_no_shards(store: Store, etcd_prefix: str) -> None:
    """Only a key on a lease holding a JSON object is a member: a ghost would keep ~1/N."""
    root = f"{etcd_prefix}c"
    shards = 8
    lease, _ = await store.grant_lease(30)
    replica = Replica(store, root, "r1", shards)
    with structlog.testing.capture_logs() as logs:
        async with running(replica):
            await wait_held(store, root, replica, set(range(shards)))
            await store.put(f"{root}/members/ghost", b"not json")
            await store.put(f"{root}/members/leased-ghost", b"not json", lease)
            await store.put(f"{root}/members/ghost", b"still not json")  # said once
            await eventually(lambda: len(ignored(logs)) >= 2)
            before = replica.membership.rebalances  # one after the puts: the watch or a tick
            await eventually(lambda: replica.membership.rebalances > before)
            await wait_held(store, root, replica, set(range(shards)))
            assert replica.membership.members == {"r1"}
    await store.revoke_lease(lease)
    assert sorted(ignored(logs)) == [f"{root}/members/ghost", f"{root}/members/leased-ghost"]


def ignored(logs: Sequence[Mapping[str, Any]]) -> list[str]:
    return [e["key"] for e in logs if e["event"] == "membership.member_ignored"]


class FailingDeletes:
    """A :class:`Store` whose transactions that delete fail while ``failing`` is set.

    What one replica sees when its requests to etcd are lost while etcd's answers
    (the watch) still reach it: it learns of a new member, but cannot release.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self.failing = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure: Sequence[Put | Delete] = (),
    ) -> TxnResult:
        if self.failing and any(isinstance(op, Delete) for op in success):
            raise StoreUnavailable("KV.Txn: etcd unavailable (test)")
        return await self._store.txn(compares, success, failure)


async def test_a_failed_release_is_retried_until_the_new_owner_has_the_shard(
    store: Store, etcd_prefix: str
) -> None:
    """The released shard left ``owned`` but its key stayed on our live lease: retry it."""
    root = f"{etcd_prefix}c"
    shards = 8
    flaky = FailingDeletes(store)
    one = Replica(cast(Store, flaky), root, "r1", shards, ttl=10)  # no tick saves us
    two = Replica(store, root, "r2", shards, ttl=10)
    theirs = share(shards, ["r1", "r2"], "r2")
    assert theirs
    with structlog.testing.capture_logs() as logs:
        async with running(one):
            await wait_held(store, root, one, set(range(shards)))
            flaky.failing = True
            async with running(two):
                await eventually(lambda: any(e["event"] == "shard.release_failed" for e in logs))
                flaky.failing = False
                await wait_held(store, root, two, theirs)
                await wait_held(store, root, one, set(range(shards)) - theirs)
