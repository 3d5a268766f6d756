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
* **Keys, not beliefs.** A replica owns a shard only while its key exists with
  the create revision it claimed and on its lease: a delete, a replacement or a
  lease change seen on the watch, or found by the re-read after a compaction,
  is a loss. A key on our lease that we do not own (a release that failed, a
  hand edit) is deleted on every rebalance until it is gone; a key with no
  lease is garbage that the shard's rightful owner deletes before claiming. A
  key on another live lease is a handover in progress and is waited for.
* A member counts only if its key is on a lease and holds a JSON object (what
  :meth:`ShardMembership.run` writes): a key put by hand cannot take shards.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping
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
    mod_revision: int
    lease: int


class ShardMembership:
    """This replica's membership and the shards it owns, for as long as :meth:`run` runs.

    Args:
        root: the controller root (``<controller_prefix>/<cluster>``).
        grant: called with a shard and its :class:`Leadership` once we hold its key.
        revoke: called with a shard the moment we must stop acting on it.
        gate: awaited after our member key is written and before we claim a shard,
            each time we join; it returns once we may (the daemon waits there while a
            replica of the other election mode holds its key). It must not raise.
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
        gate: Callable[[], Awaitable[bool]] | None = None,
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
        self._gate = gate
        self.members: set[str] = set()
        self._ignored_members: set[str] = set()  # said once each, until they count again
        self.owned: dict[int, Leadership] = {}
        self._holders: dict[int, _Holder] = {}
        self._dirty = anyio.Event()
        self.rebalances = 0
        self._release_failures = 0  # in a row; until one rebalance releases all it tried

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
        self._read_members(members)
        self._holders = {}
        for kv in holders:
            self._note_holder(kv)
        failed: StoreError | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._follow, self._members_prefix, members_rev + 1, self._on_member)
            tg.start_soon(self._follow, self._shards_prefix, holders_rev + 1, self._on_shard)
            tg.start_soon(_cancel_on, lease.expired, tg.cancel_scope)
            if self._gate is not None:
                await self._gate()  # cancelled with the rest if the lease expires meanwhile
            while lease.alive():
                failed = await self._rebalance(lease)
                if failed is not None:
                    break
                wait: float = self._ttl  # a safety net beside the watches
                if self._release_failures:  # a new owner waits on the keys: retry sooner
                    wait = min(wait, backoff.ETCD.delay(self._release_failures))
                with anyio.move_on_after(wait):
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
            self._holders[shard] = _Holder(kv.create_revision, kv.mod_revision, kv.lease)

    def _counts(self, name: str, value: bytes, lease: int) -> bool:
        """Whether a member key is a live replica's: on a lease, with a JSON object.

        A key put by hand (no lease, or garbage) would otherwise take about 1/N of
        the shards for good: no replica holds it, so no lease ever ends it.
        """
        why = None
        if lease == 0:
            why = "no lease"
        else:
            try:
                if not isinstance(json.loads(value), dict):
                    why = "value not a JSON object"
            except ValueError:  # UnicodeDecodeError is one too
                why = "value not JSON"
        if why is None:
            self._ignored_members.discard(name)
            return True
        if name not in self._ignored_members:
            self._ignored_members.add(name)
            log.warning("membership.member_ignored", key=self._members_prefix + name, reason=why)
        return False

    def _read_members(self, kvs: list[KeyValue]) -> None:
        self.members = set()
        for kv in kvs:
            name = kv.key[len(self._members_prefix) :]
            if self._counts(name, kv.value, kv.lease):
                self.members.add(name)

    def _on_member(self, event: WatchEvent) -> None:
        name = event.key[len(self._members_prefix) :]
        if event.kind == "put" and self._counts(name, event.value, event.lease):
            self.members.add(name)
        else:
            self.members.discard(name)

    def _on_shard(self, event: WatchEvent) -> None:
        shard = parse_shard_name(event.key[len(self._shards_prefix) :])
        if shard is None:
            return
        known = self._holders.get(shard)
        if known is not None and event.mod_revision < known.mod_revision:
            return  # older than what a claim or a release of ours already noted
        if event.kind == "delete":
            self._holders.pop(shard, None)
        else:
            self._holders[shard] = _Holder(event.create_revision, event.mod_revision, event.lease)
        mine = self.owned.get(shard)
        if mine is None or event.mod_revision < mine.token:
            return
        if event.kind == "delete":
            self._lose(shard, "key-deleted")
        elif event.create_revision != mine.token:
            self._lose(shard, "key-replaced")
        elif event.lease != mine.lease_id:
            self._lose(shard, "key-lease-changed")

    def _reread_holders(self, kvs: list[KeyValue], revision: int) -> None:
        """Rebuild the holders from a read at ``revision``; lose what we no longer hold.

        After a compaction the watch missed whatever happened in the gap: our key
        may have been deleted or replaced, and no event will ever say so. Shards
        claimed after the read (token > revision) are kept as they are.
        """
        newer = {s: h for s, h in self._holders.items() if h.mod_revision > revision}
        self._holders = {}
        for kv in kvs:
            self._note_holder(kv)
        self._holders.update(newer)
        for shard, mine in sorted(self.owned.items()):
            holder = self._holders.get(shard)
            if holder is None or (holder.create_revision, holder.lease) != (
                mine.token,
                mine.lease_id,
            ):
                self._lose(shard, "key-lost-in-compaction")

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
                        self._read_members(kvs)
                    else:
                        self._reread_holders(kvs, rev)
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
        """Release what is no longer ours, clear garbage, then claim what is ours.

        Runs on every change and on the safety-net tick, so a release or a clear
        that failed is retried until its key is gone: a key left on our live lease
        would keep the shard's new owner waiting for as long as we live.

        Returns the first failed claim's error rather than raising it, for
        :meth:`_serve` to raise outside its task group.
        """
        self.rebalances += 1
        live = self.members | {self.replica}
        mine = {s for s, owner in assignment(self.shards, live).items() if owner == self.replica}
        leaving = {shard: self.owned[shard].token for shard in sorted(set(self.owned) - mine)}
        for shard in leaving:
            self._lose(shard, "moved")  # stop acting on every one first ...
        # ... then let the new owners in: what we just left, and any key still on our
        # lease for a shard we do not own (a failed release, a hand edit); and clear a
        # key on no lease for a shard that is ours (a hand edit: no replica holds it).
        # A key on another live lease is its owner's, released by it: we wait.
        clear = {
            shard: holder
            for shard, holder in sorted(self._holders.items())
            if shard not in self.owned
            and shard not in leaving
            and (
                (holder.lease == lease.id and shard not in mine)
                or (holder.lease == 0 and shard in mine)
            )
        }
        limiter = anyio.CapacityLimiter(MOVE_CONCURRENCY)
        failures = self._release_failures
        async with anyio.create_task_group() as tg:
            for shard, token in leaving.items():
                tg.start_soon(self._release, shard, token, None, limiter)
            for shard, seen in clear.items():
                tg.start_soon(self._release, shard, seen.create_revision, seen, limiter)
        if self._release_failures == failures:
            self._release_failures = 0
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

    async def _release(
        self, shard: int, token: int, seen: _Holder | None, limiter: anyio.CapacityLimiter
    ) -> None:
        """Delete the shard's key if it is still the one with create revision ``token``.

        ``seen``: the key as we last saw it, when it is not ours to hold (then it
        must not have changed since: mod revision too). A failure is logged; the
        next rebalance tries again, as long as the key is still there.
        """
        key = self._shard_key(shard)
        compares = [Compare.create_revision(key, token)]
        if seen is not None:
            compares.append(Compare.mod_revision(key, seen.mod_revision))
        async with limiter:
            try:
                await self._store.txn(compares, [Delete(key)])
            except StoreError as exc:
                self._release_failures += 1
                log.warning("shard.release_failed", shard=shard, error=str(exc))
                return
        if seen is not None:
            log.info("shard.cleared", shard=shard, token=token, lease=seen.lease)
        # Deleted, or already gone or replaced: either way not ours to delete again. The
        # watch tells what is there now; until it does, nothing holds the key for us.
        holder = self._holders.get(shard)
        if holder is not None and holder.create_revision == token:
            del self._holders[shard]

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
                    self._holders[shard] = _Holder(kv.create_revision, kv.mod_revision, kv.lease)
                return
            token, modified = kv.create_revision, kv.mod_revision
        else:
            modified = token
        self._holders[shard] = _Holder(token, modified, lease.id)
        leadership = Leadership(token, lease.id, self._identity, anyio.Event(), key, lease.alive)
        self.owned[shard] = leadership
        log.info("shard.claimed", shard=shard, token=token)
        self._grant(shard, leadership)


async def _cancel_on(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
