"""Sharded mode: live membership, and one fenced leader key per shard (issue #13).

Every replica registers ``<root>/members/<replica>`` on its lease and watches
the members; each computes the same owner for every shard by rendezvous
hashing (:mod:`controllerd.core.shards`), without a coordinator. A replica then
holds ``<root>/shards/<nnnn>`` for each shard it owns, on the same lease: the
key's create revision is that shard's fencing token.

Invariants:

* **No overlap.** A replica stops acting on a shard (``revoke``) *before* it
  deletes the shard's key, and a new owner acts (``grant``) only after it
  created the key, so at no instant do two replicas act on one shard; a call
  still in flight from the old owner carries a token the broker and the GC
  transaction now refuse.
* **No gap beyond a TTL.** A replica that dies loses its member key and every
  shard key with its lease; the others see the keys go and claim the shards.
  A paused replica's lease deadline passes on its own clock, so it stops
  acting as soon as it runs again, whatever etcd did meanwhile.
* **Minimal moves.** When a member joins or leaves, only the shards whose
  rendezvous winner changed move (about 1/N of them).
* The lease is renewed from a thread of its own (:mod:`election`), so a busy
  event loop never costs a replica its shards.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from contextlib import aclosing, suppress
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from controllerd.adapters import backoff
from controllerd.adapters.election import Leadership, _Lease
from controllerd.adapters.store import (
    Compare,
    Delete,
    KeyValue,
    Put,
    Store,
    StoreError,
    WatchCompacted,
    WatchEvent,
)
from controllerd.core.shards import assignment, parse_shard_name, shard_name

log = structlog.get_logger(__name__)

#: Seconds the shielded release of every shard may take when we stop.
RELEASE_TIMEOUT = 2.0
#: Shard keys released or claimed at once in one rebalance. Each is one etcd round
#: trip; one at a time, a move of 80 shards costs 80 round trips in a row.
MOVE_CONCURRENCY = 32


@dataclass(frozen=True, slots=True)
class _Holder:
    create_revision: int
    lease: int


class ShardMembership:
    """This replica's membership and the shards it owns, for as long as :meth:`run` runs.

    Args:
        root: the controller root (``<controller_prefix>/<cluster>``).
        grant: called with a shard and its :class:`Leadership` once we hold its key.
        revoke: called with a shard the moment we must stop acting on it.
    """

    def __init__(
        self,
        store: Store,
        root: str,
        replica: str,
        identity: Mapping[str, Any],
        shards: int,
        *,
        ttl: int,
        grant: Callable[[int, Leadership], None],
        revoke: Callable[[int], None],
        margin: float | None = None,
    ) -> None:
        self._store = store
        self._members_prefix = f"{root}/members/"
        self._shards_prefix = f"{root}/shards/"
        self.replica = replica
        self._identity = dict(identity)
        self._value = json.dumps(self._identity, sort_keys=True, separators=(",", ":")).encode()
        self.shards = shards
        self._ttl = ttl
        self._margin = max(1.0, ttl / 4) if margin is None else margin
        self._grant = grant
        self._revoke = revoke
        self.members: set[str] = set()
        self.owned: dict[int, Leadership] = {}
        self._holders: dict[int, _Holder] = {}
        self._dirty = anyio.Event()
        self.rebalances = 0

    def _member_key(self) -> str:
        return f"{self._members_prefix}{self.replica}"

    def _shard_key(self, shard: int) -> str:
        return f"{self._shards_prefix}{shard_name(shard)}"

    async def run(self) -> None:
        """Join, own our shards, follow membership; rejoin after losing the lease. Forever."""
        failures = 0
        while True:
            lease: _Lease | None = None
            why = "lease-lost"
            try:
                sent = time.monotonic()
                lease_id, granted = await self._store.grant_lease(self._ttl)
                lease = _Lease(self._store, lease_id, granted, sent, self._margin)
                lease.start()
                await self._serve(lease)
                failures = 0
            except StoreError as exc:
                delay = backoff.ELECTION.delay(failures)
                failures += 1
                log.warning("membership.failed", error=str(exc), retry_in_s=round(delay, 3))
                await anyio.sleep(delay)
            except anyio.get_cancelled_exc_class():
                why = "stopping"
                raise
            finally:
                self._release_all(why)
                if lease is not None:
                    lease.stop()
                    with anyio.move_on_after(RELEASE_TIMEOUT, shield=True), suppress(StoreError):
                        await self._store.revoke_lease(lease.id)

    def _release_all(self, why: str) -> None:
        for shard in sorted(self.owned):
            self._lose(shard, why)

    def _lose(self, shard: int, why: str) -> None:
        leadership = self.owned.pop(shard, None)
        if leadership is None:
            return
        self._revoke(shard)
        leadership.lost.set()
        log.info("shard.released", shard=shard, token=leadership.token, why=why)

    async def _serve(self, lease: _Lease) -> None:
        await self._store.put(self._member_key(), self._value, lease.id)
        log.info("membership.joined", replica=self.replica, lease=lease.id, shards=self.shards)
        members, members_rev = await self._store.get_prefix(self._members_prefix)
        holders, holders_rev = await self._store.get_prefix(self._shards_prefix)
        self.members = {kv.key[len(self._members_prefix) :] for kv in members}
        self._holders = {}
        for kv in holders:
            self._note_holder(kv)
        failed: StoreError | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._follow, self._members_prefix, members_rev + 1, self._on_member)
            tg.start_soon(self._follow, self._shards_prefix, holders_rev + 1, self._on_shard)
            tg.start_soon(_cancel_on, lease.expired, tg.cancel_scope)
            while lease.alive():
                failed = await self._rebalance(lease)
                if failed is not None:
                    break
                with anyio.move_on_after(self._ttl):  # a safety net beside the watches
                    await self._dirty.wait()
                self._dirty = anyio.Event()
            tg.cancel_scope.cancel()
        if failed is not None:
            # Raised here, not in the group's body: there it would leave as an
            # ExceptionGroup that run() does not catch, and end the process.
            raise failed
        log.warning("membership.lease_lost", replica=self.replica, reason=lease.reason)

    def _note_holder(self, kv: KeyValue) -> None:
        shard = parse_shard_name(kv.key[len(self._shards_prefix) :])
        if shard is not None:
            self._holders[shard] = _Holder(kv.create_revision, kv.lease)

    def _on_member(self, event: WatchEvent) -> None:
        name = event.key[len(self._members_prefix) :]
        if event.kind == "put":
            self.members.add(name)
        else:
            self.members.discard(name)

    def _on_shard(self, event: WatchEvent) -> None:
        shard = parse_shard_name(event.key[len(self._shards_prefix) :])
        if shard is None:
            return
        if event.kind == "delete":
            self._holders.pop(shard, None)
        else:
            self._holders[shard] = _Holder(event.create_revision, event.lease)
        mine = self.owned.get(shard)
        if mine is not None and (event.kind == "delete" or event.create_revision != mine.token):
            self._lose(shard, "key-deleted" if event.kind == "delete" else "key-replaced")

    async def _follow(self, prefix: str, start: int, apply: Callable[[WatchEvent], None]) -> None:
        """Apply every change under ``prefix``; a compaction re-reads it whole.

        Retries every :class:`StoreError`, the re-read's too: one escaping would end
        the task group of :meth:`_serve` as an ExceptionGroup, and the process.
        """
        revision = start
        compacted = False
        while True:
            try:
                if compacted:
                    kvs, rev = await self._store.get_prefix(prefix)
                    if prefix == self._members_prefix:
                        self.members = {kv.key[len(prefix) :] for kv in kvs}
                    else:
                        self._holders = {}
                        for kv in kvs:
                            self._note_holder(kv)
                    revision, compacted = rev + 1, False
                    self._dirty.set()
                async with aclosing(self._store.watch_prefix(prefix, revision)) as watch:
                    async for batch in watch:
                        for event in batch:
                            apply(event)
                        revision = batch[-1].mod_revision + 1
                        self._dirty.set()
            except WatchCompacted:
                compacted = True
            except StoreError as exc:
                log.debug("membership.watch_failed", prefix=prefix, error=str(exc))
                await anyio.sleep(backoff.ETCD.delay(3))

    async def _rebalance(self, lease: _Lease) -> StoreError | None:
        """Release what is no longer ours, then claim what is (once its key is free).

        Returns the first failed claim's error rather than raising it, for
        :meth:`_serve` to raise outside its task group.
        """
        self.rebalances += 1
        live = self.members | {self.replica}
        mine = {s for s, owner in assignment(self.shards, live).items() if owner == self.replica}
        leaving = {shard: self.owned[shard].token for shard in sorted(set(self.owned) - mine)}
        for shard in leaving:
            self._lose(shard, "moved")  # stop acting on every one first ...
        limiter = anyio.CapacityLimiter(MOVE_CONCURRENCY)
        async with anyio.create_task_group() as tg:  # ... then let the new owners in
            for shard, token in leaving.items():
                tg.start_soon(self._release, shard, token, limiter)
        claimable = [
            shard
            for shard in sorted(mine - set(self.owned))
            # a key the old owner still holds: its delete (or its lease's end) wakes us
            if (holder := self._holders.get(shard)) is None or holder.lease == lease.id
        ]
        failed: list[StoreError] = []
        async with anyio.create_task_group() as tg:
            for shard in claimable:
                tg.start_soon(self._claim_limited, shard, lease, limiter, failed)
        # as one claim at a time would: rejoin after a backoff
        return failed[0] if failed else None

    async def _release(self, shard: int, token: int, limiter: anyio.CapacityLimiter) -> None:
        async with limiter:
            try:
                await self._store.txn(
                    [Compare.create_revision(self._shard_key(shard), token)],
                    [Delete(self._shard_key(shard))],
                )
            except StoreError as exc:
                log.warning("shard.release_failed", shard=shard, error=str(exc))

    async def _claim_limited(
        self, shard: int, lease: _Lease, limiter: anyio.CapacityLimiter, failed: list[StoreError]
    ) -> None:
        async with limiter:
            if not lease.alive() or failed:
                return
            try:
                await self._claim(shard, lease)
            except StoreError as exc:
                failed.append(exc)

    async def _claim(self, shard: int, lease: _Lease) -> None:
        key = self._shard_key(shard)
        result = await self._store.txn([Compare.absent(key)], [Put(key, self._value, lease.id)])
        token = result.revision if result.succeeded else 0
        if not result.succeeded:
            # A retried claim whose first attempt applied, or someone else's key.
            kv = await self._store.get(key)
            if kv is None or kv.lease != lease.id:
                if kv is not None:
                    self._holders[shard] = _Holder(kv.create_revision, kv.lease)
                return
            token = kv.create_revision
        self._holders[shard] = _Holder(token, lease.id)
        leadership = Leadership(token, lease.id, self._identity, anyio.Event(), key, lease.alive)
        self.owned[shard] = leadership
        log.info("shard.claimed", shard=shard, token=token)
        self._grant(shard, leadership)


async def _cancel_on(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
