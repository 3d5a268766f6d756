"""Leader election on one etcd key, held on a lease (DESIGN §3).

The leader key holds the leader's identity JSON and is attached to the
leader's lease. Its **create revision is the fencing token**: it changes
whenever leadership changes hands, so a transaction guarded by
:func:`fenced` applies only while the replica that holds that token still leads.

Invariants:

* ``lost`` is set *before* etcd can expire our lease: the lease is certainly
  alive until (send time of the last successful keep-alive) + (TTL etcd
  granted), because etcd starts counting only when it receives the request.
  We stop ``margin`` seconds earlier, to absorb clock-rate differences and the
  time the caller needs to stop acting.
* The lease is renewed from a thread of its own, on a grpc channel of its own
  (:class:`~controllerd.adapters.store.LeaseKeepAliveClient`), so no work on
  the event loop (loading 100k topics, a long GC pass, even a blocked loop)
  can make us lose it. Its deadline is on ``time.monotonic``, which is also
  the asyncio loop's clock; :meth:`Leadership.is_leader` reads it directly,
  so a loop that wakes after a stall never acts on a lease that lapsed.
* ``lost`` is also set when the leader key is deleted or re-created (another
  create revision), when a keep-alive reports the lease gone, and when the
  ``lead`` context exits. It is never cleared: a new term is a new ``lead``.
* Exiting ``lead`` (normally, by exception or by cancellation) resigns: the key
  is deleted only if it is still ours (fenced), the lease is revoked, shielded
  and bounded by ``resign_timeout``, so a SIGTERM hands over at once. Resigning
  never raises.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import orjson
import structlog

from controllerd.adapters.store import (
    Compare,
    Delete,
    LeaseKeepAliveClient,
    LeaseNotFound,
    Put,
    Store,
    StoreError,
    StoreUnavailable,
    WatchCompacted,
)

__all__ = ["Leadership", "current_leader", "fenced", "lead", "wait_for_turn"]

log = structlog.get_logger(__name__)

#: Seconds the shielded resignation may take; short so a SIGTERM hands over at once.
RESIGN_TIMEOUT = 2.0
#: Seconds between keep-alive attempts after one failed (until the deadline).
KEEPALIVE_RETRY = 0.25
#: Seconds before campaigning again after etcd failed to answer.
CAMPAIGN_RETRY = 1.0


def fenced(key: str, token: int) -> Compare:
    """A compare that holds only while the leader of ``token`` still leads.

    Add it to a transaction so that a deposed leader's write fails.
    """
    return Compare.create_revision(key, token)


def _always_valid() -> bool:
    return True


@dataclass(frozen=True)
class Leadership:
    """One term of leadership, as yielded by :func:`lead`.

    Attributes:
        token: the leader key's create revision, the fencing token.
        lease_id: the lease the leader key is attached to.
        identity: what this replica wrote into the leader key.
        lost: set once this replica must stop acting as leader; never cleared.
        key: the leader key.
        lease_valid: False once the lease can no longer be trusted; checked
            by :meth:`is_leader` so it is exact even between keep-alive wake-ups.
    """

    token: int
    lease_id: int
    identity: dict[str, Any]
    lost: anyio.Event
    key: str = ""
    lease_valid: Callable[[], bool] = field(default=_always_valid, repr=False, compare=False)

    def is_leader(self) -> bool:
        return not self.lost.is_set() and self.lease_valid()

    def fenced(self) -> Compare:
        """:func:`fenced` for this term."""
        if not self.key:
            raise ValueError("this Leadership has no key")
        return fenced(self.key, self.token)


class _Lease:
    """Our lease, renewed from a thread of its own, and the instant until which it is alive.

    Invariant: ``deadline`` = send time of the last successful grant/keep-alive
    + TTL etcd reported - margin, on ``time.monotonic``. Once the clock passes
    it, or etcd says the lease is gone, :meth:`alive` is False for good and
    ``expired`` is set on the event loop.
    """

    def __init__(
        self, store: Store, lease_id: int, ttl: int, sent_at: float, margin: float
    ) -> None:
        self.id = lease_id
        self.ttl = ttl
        self.deadline = sent_at + ttl - margin
        self.expired = anyio.Event()
        self.reason = ""
        self._store = store
        self._sent_at = sent_at
        self._margin = margin
        self._dead = False
        self._stopping = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()  # built on the loop's thread
        self._thread: threading.Thread | None = None

    def alive(self) -> bool:
        return not self._dead and time.monotonic() < self.deadline

    def expire(self, reason: str) -> None:
        """Mark the lease dead (from any thread) and set ``expired`` on the loop."""
        if self._dead:
            return
        self.reason = reason
        self._dead = True
        if threading.get_ident() == self._loop_thread:
            self.expired.set()
            return
        with suppress(RuntimeError):  # the loop is closed: nobody is left to tell
            self._loop.call_soon_threadsafe(self.expired.set)

    def start(self) -> None:
        client = self._store.keepalive_client()
        self._thread = threading.Thread(
            target=self._renew, args=(client,), name=f"lease-{self.id}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing; the thread ends within one keep-alive timeout (it never blocks us)."""
        self._stopping.set()

    def _renew(self, client: LeaseKeepAliveClient) -> None:
        """Renew every ttl/3; on failure retry quickly until the deadline, then expire."""
        interval = self.ttl / 3
        next_at = self._sent_at + interval
        try:
            while not self._stopping.wait(max(0.0, min(next_at, self.deadline) - time.monotonic())):
                sent = time.monotonic()
                if sent >= self.deadline:
                    self.expire("keepalive-timeout")
                    return
                try:
                    remaining = client.keepalive_once(
                        self.id, timeout=min(interval, self.deadline - sent)
                    )
                except StoreError as exc:
                    log.warning(
                        "election.keepalive_failed",
                        lease=self.id,
                        error=str(exc),
                        safe_for=round(self.deadline - time.monotonic(), 3),
                    )
                    next_at = time.monotonic() + KEEPALIVE_RETRY
                    continue
                if remaining <= 0:
                    self.expire("lease-expired")
                    return
                self.deadline = max(self.deadline, sent + remaining - self._margin)
                next_at = sent + interval
        except Exception as exc:
            # Not etcd's answer (a bug, grpc misused): nothing renews any more, so say
            # so now rather than lead on, unrenewed, until the deadline.
            log.error("election.keepalive_crashed", lease=self.id, error=repr(exc))
            self.expire("keepalive-crashed")
        finally:
            client.close()


@dataclass
class _Campaign:
    """Campaign state: the lease we hold (standing by or leading) and how we got elected."""

    store: Store
    key: str
    value: bytes
    ttl: int
    margin: float
    lease: _Lease | None = None
    #: The leader token we last logged standing by for (logged once per leader).
    standing_by: int = 0

    async def _fresh_lease(self) -> _Lease:
        if self.lease is not None:
            self.lease.stop()
            with suppress(StoreError):  # it may still hold our key; best effort
                await self.store.revoke_lease(self.lease.id)
        sent = time.monotonic()
        lease_id, granted = await self.store.grant_lease(self.ttl)
        self.lease = _Lease(self.store, lease_id, granted, sent, self.margin)
        self.lease.start()
        return self.lease

    async def elect(self) -> tuple[_Lease, int, str]:
        """Block until we hold the key; returns (lease, token, what let us win)."""
        why = "first-attempt"
        while True:
            lease = self.lease
            try:
                if lease is None or not lease.alive():
                    lease = await self._fresh_lease()
                result = await self.store.txn(
                    [Compare.absent(self.key)], [Put(self.key, self.value, lease.id)]
                )
                # Read back even on failure: a retried txn whose first attempt
                # applied reports failure although the key is ours.
                holder = await self.store.get(self.key)
            except LeaseNotFound:
                if lease is not None:
                    lease.expire("lease-not-found")
                why = "lease-expired"
                continue
            except StoreUnavailable as exc:
                log.warning("election.campaign_failed", key=self.key, error=str(exc))
                why = "etcd-unavailable"
                await anyio.sleep(CAMPAIGN_RETRY)
                continue
            if holder is not None and holder.lease == lease.id and lease.alive():
                return lease, holder.create_revision, why
            if holder is None:
                why = "key-vanished"
                continue
            if holder.create_revision != self.standing_by:
                self.standing_by = holder.create_revision
                log.info(
                    "election.standby",
                    key=self.key,
                    leader=parse_identity(holder.value),
                    leader_token=holder.create_revision,
                    lease=lease.id,
                )
            why = await self._wait_for_vacancy(lease, result.revision + 1)

    async def _wait_for_vacancy(self, lease: _Lease, from_revision: int) -> str:
        """Wait for the key's deletion, our lease's expiry, or ``ttl`` seconds (safety net)."""
        with anyio.move_on_after(self.ttl):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_on, lease.expired, tg.cancel_scope)
                try:
                    async with aclosing(self.store.watch_key(self.key, from_revision)) as watch:
                        async for batch in watch:
                            if any(event.kind == "delete" for event in batch):
                                tg.cancel_scope.cancel()
                                return "key-deleted"
                except WatchCompacted:
                    tg.cancel_scope.cancel()
                    return "watch-compacted"
                except StoreError as exc:
                    log.warning("election.watch_failed", key=self.key, error=str(exc))
                    await anyio.sleep(CAMPAIGN_RETRY)
                    tg.cancel_scope.cancel()
                    return "watch-failed"
            return "lease-expired"
        return "safety-net"


async def _cancel_on(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


#: Characters of an identity's text field, or of the raw text shown for one that does
#: not parse, at most: ours are host names and numbers.
IDENTITY_TEXT_MAX: Final = 256


def parse_identity(value: bytes) -> dict[str, Any]:
    """A replica's identity as the election wrote it: a flat JSON object of short text,
    64-bit integers, finite numbers, booleans and nulls. Anything else is kept as
    ``{"unparsed": <its first IDENTITY_TEXT_MAX characters>}``.

    Strict JSON only (orjson): a lone surrogate escape (``"\\ud800"``), NaN or a
    number beyond a double would otherwise come through, and the first is a string
    no encoder can write (a STATUS= to systemd raised on it and ended the daemon).
    Flat, because what is shown of it is formatted: a value nested a thousand deep
    raised RecursionError there, and ended the daemon too.
    """
    try:
        decoded = orjson.loads(value)
    except orjson.JSONDecodeError:
        decoded = None
    if isinstance(decoded, dict) and all(_plain(v) for v in decoded.values()):
        return decoded
    return {"unparsed": value[: IDENTITY_TEXT_MAX * 4].decode(errors="replace")[:IDENTITY_TEXT_MAX]}


def identity_name(identity: Mapping[str, Any], fallback: str) -> str:
    """What to call the replica (or shard member) ``identity`` names: its name, else the
    text of an identity that did not parse, else ``fallback``."""
    for field_name in ("replica", "member", "unparsed"):
        value = identity.get(field_name)
        if isinstance(value, str) and value:
            return value
    return fallback


def _plain(value: object) -> bool:
    if isinstance(value, str):
        return len(value) <= IDENTITY_TEXT_MAX
    return value is None or isinstance(value, bool | int | float)  # orjson: 64-bit, finite


async def current_leader(store: Store, key: str) -> tuple[dict[str, Any], int] | None:
    """The current leader's identity and fencing token, or None if nobody leads."""
    kv = await store.get(key)
    return None if kv is None else (parse_identity(kv.value), kv.create_revision)


class _Term:
    """Watches one term for the events that end it, and ends it once."""

    def __init__(self, store: Store, key: str, token: int, lease: _Lease) -> None:
        self.store = store
        self.key = key
        self.token = token
        self.lease = lease
        self.lost = anyio.Event()

    def lose(self, reason: str) -> None:
        if not self.lost.is_set():
            log.warning(
                "election.lost", key=self.key, token=self.token, lease=self.lease.id, reason=reason
            )
            self.lost.set()

    async def watch_lease(self) -> None:
        await self.lease.expired.wait()
        self.lose(self.lease.reason)

    async def watch_key(self) -> None:
        """Lose when the key is deleted or re-created; a compaction is checked with a read."""
        start = self.token + 1
        while True:
            try:
                async with aclosing(self.store.watch_key(self.key, start)) as watch:
                    async for batch in watch:
                        for event in batch:
                            if event.kind == "delete":
                                self.lose("key-deleted")
                                return
                            if event.create_revision != self.token:
                                self.lose("key-replaced")
                                return
                            start = event.mod_revision + 1
            except WatchCompacted as exc:
                try:
                    kv = await self.store.get(self.key)
                except StoreError as read_exc:
                    log.warning("election.watch_failed", key=self.key, error=str(read_exc))
                    await anyio.sleep(CAMPAIGN_RETRY)
                    continue
                if kv is None or kv.create_revision != self.token:
                    self.lose("key-replaced")
                    return
                start = exc.revision
            except StoreError as exc:  # the lease deadline still protects us meanwhile
                log.warning("election.watch_failed", key=self.key, error=str(exc))
                await anyio.sleep(CAMPAIGN_RETRY)


async def _resign(
    store: Store, key: str, token: int | None, lease: _Lease | None, bound: float
) -> None:
    """Hand over at once: delete our key if still ours, revoke the lease. Never raises."""
    if lease is not None:
        lease.stop()
    with anyio.move_on_after(bound, shield=True) as scope:
        try:
            deleted = False
            if token is not None:
                deleted = (await store.txn([fenced(key, token)], [Delete(key)])).succeeded
            if lease is not None:
                await store.revoke_lease(lease.id)
        except StoreError as exc:
            log.warning("election.resign_failed", key=key, token=token, error=str(exc))
            return
    if scope.cancelled_caught:
        log.warning(
            "election.resign_failed",
            key=key,
            token=token,
            error=f"no answer within {bound}s; the lease will expire by itself",
        )
    elif token is not None:
        log.info("election.resigned", key=key, token=token, deleted_key=deleted)
    elif lease is not None:
        log.info("election.withdrawn", key=key, lease=lease.id)


async def wait_for_turn(
    store: Store, key: str, ready: anyio.Event, *, grace: float, poll: float
) -> None:
    """Return once ``ready`` is set, or once ``key`` has had no holder for ``grace`` s.

    For a replica whose view is still loading: a warm standby takes a vacancy
    within milliseconds of seeing it, so a loading replica defers to it; when
    every replica is loading (a cold start of the cluster, or a lone replica)
    the first to outwait the grace campaigns. An unreadable key counts as held.
    """
    vacant_since: float | None = None
    while not ready.is_set():
        try:
            vacant = await current_leader(store, key) is None
        except StoreError:
            vacant = False
        now = anyio.current_time()
        if not vacant:
            vacant_since = None
        elif vacant_since is None:
            vacant_since = now
        elif now - vacant_since >= grace:
            log.info(
                "election.campaign_while_loading", key=key, vacant_s=round(now - vacant_since, 3)
            )
            return
        with anyio.move_on_after(poll):
            await ready.wait()


@asynccontextmanager
async def lead(
    store: Store,
    key: str,
    identity: Mapping[str, Any],
    *,
    ttl: int = 10,
    margin: float | None = None,
    resign_timeout: float = RESIGN_TIMEOUT,
) -> AsyncIterator[Leadership]:
    """Campaign for ``key``; enter once elected; resign on exit.

    Blocks while another replica leads (standing by on a watch of the key,
    re-trying every ``ttl`` seconds as a safety net, keeping our own lease
    alive). The body must stop acting as leader as soon as ``lost`` is set,
    e.g. by running leader-only work in a scope that ``lost`` cancels.

    Args:
        ttl: lease TTL in seconds; a crashed leader is replaced within about this.
        margin: seconds before the lease could expire at which we consider it
            lost; default ``max(1, ttl / 4)``. Must leave room for the renewal
            every ttl/3.
        resign_timeout: bound on the shielded resignation at exit.
    """
    margin = max(1.0, ttl / 4) if margin is None else margin
    if ttl < 2 or not 0 < margin < ttl * 2 / 3:
        raise ValueError(f"need ttl >= 2 and 0 < margin < 2/3 ttl (ttl={ttl}, margin={margin})")
    ident = dict(identity)
    value = json.dumps(ident, sort_keys=True, separators=(",", ":")).encode()
    token: int | None = None
    campaign: _Campaign | None = None
    failure: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            # The body runs inside this task group, which would wrap its
            # exception in an ExceptionGroup; keep it aside and re-raise it as
            # is once our tasks are stopped (a cancellation included).
            try:
                campaign = _Campaign(store, key, value, ttl, margin)
                started = time.monotonic()
                lease, token, why = await campaign.elect()
                term = _Term(store, key, token, lease)
                tg.start_soon(term.watch_lease, name="election-lease-guard")
                tg.start_soon(term.watch_key, name="election-key-guard")
                log.info(
                    "election.won",
                    key=key,
                    token=token,
                    lease=lease.id,
                    identity=ident,
                    after=why,
                    waited_s=round(time.monotonic() - started, 3),
                )
                try:
                    yield Leadership(token, lease.id, ident, term.lost, key, lease.alive)
                finally:
                    term.lost.set()
            except BaseException as exc:
                failure = exc
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
    finally:
        await _resign(store, key, token, campaign.lease if campaign else None, resign_timeout)
