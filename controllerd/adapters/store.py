"""Our small interface over etcd (etcd3aio): keys, transactions, leases, watches.

Callers see only the types defined here and two exceptions: :class:`StoreError`
(the request failed for good) and its subclass :class:`StoreUnavailable` (etcd
did not answer within ``retry_for`` seconds of retries). No grpc or etcd3aio
type leaks out.

Invariants:

* Unary calls retry transient failures (UNAVAILABLE, DEADLINE_EXCEEDED,
  connection refused, per-attempt timeout) with capped exponential backoff and
  jitter; just after an etcd restart they fail for about a second (DESIGN §7).
* A retried request may have been applied by an earlier attempt whose answer
  was lost. Puts and deletes are idempotent; transactions are only safe because
  every transaction must carry compares (``txn`` refuses an empty list), and
  callers must choose compares that the transaction's own success branch makes
  false (``Compare.absent``, ``Compare.mod_revision``): a retry of an applied
  transaction then fails its compares instead of applying twice. So
  ``succeeded=False`` means "not applied by this attempt"; re-read to learn
  whether an earlier one was.
* Watches deliver every event after ``start_revision`` exactly once, in
  revision order, across etcd restarts: they resume from the last *event*
  revision seen, never from a response header (etcd3aio's own watch does the
  latter and loses events; see ``Store._watch``).
* Nothing relies on a count of keys fitting the receive limit (values may be
  1.5 MiB, so 1,000 keys or revisions can exceed any limit we would set): a
  page that comes back too large is read again in halves, and watches ask
  etcd to fragment large responses. Only one key, and one fragment, must fit.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from ipaddress import IPv6Address, ip_address
from typing import Any, Final, Literal, NamedTuple, TypeVar

import anyio
import anyio.lowlevel
import grpc
import grpc.aio
import structlog
from etcd3aio import (
    EtcdConnectionError,
    EtcdError,
    EtcdPermissionDeniedError,
    EtcdTransientError,
    EtcdUnauthenticatedError,
    prefix_range_end,
)
from etcd3aio._protobuf import (  # generated messages; not re-exported publicly
    LeaseKeepAliveRequest,
    LeaseStub,
    WatchCreateRequest,
    WatchRequest,
    WatchResponse,
)
from etcd3aio.auth import AuthService
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService
from google.protobuf.message import DecodeError

from controllerd.adapters import backoff
from controllerd.core.view import RawEvent

__all__ = [
    "Compare",
    "Delete",
    "KeyValue",
    "LeaseNotFound",
    "Put",
    "SnapshotCompacted",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "TxnResult",
    "WatchCompacted",
    "WatchEvent",
    "open_store",
]

log = structlog.get_logger(__name__)

#: Keys per range request: bounds each response (a 100k-key prefix is 100 pages).
PAGE_SIZE = 1000
#: Keys per keys-only request that finds where pages end (about 5 MB of keys).
SCAN_KEYS = 64 * PAGE_SIZE
#: Largest response we accept by default (``open_store(max_receive_bytes=...)``).
#: grpc's 4 MiB default is too small for a page of layouts. Bigger pages are
#: read in halves (``Store._pages``) and watch responses come in fragments of
#: about etcd's --max-request-bytes + 512 KiB (2 MiB by default), so no size of
#: value or count of revisions needs more; only one key, and one fragment, must fit.
MAX_RECEIVE_BYTES = 256 * 1024 * 1024
#: Watch events converted and handed over at a time (more only to finish a revision).
WATCH_BATCH = 500
#: grpc's own reconnect backoff grows to 120 s by default, so after a long etcd
#: outage the channel would keep failing long after etcd is back (measured
#: 1.8 s after a 40 s outage). Capping it at 1 s keeps recovery near 1 s.
_CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.lb_policy_name", "round_robin"),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # Ping only while a call is open (a running daemon always has its watches and
    # its lease's keep-alive stream): etcd refuses pings on an idle connection and
    # closes it with GOAWAY "too_many_pings" (seen on the bench's idle client).
    ("grpc.keepalive_permit_without_calls", 0),
    # A frozen member (SIGSTOP, a hung host) keeps its TCP connections open, so only
    # an unanswered ping shows it. grpc otherwise stops pinging after 2 pings with no
    # data sent, and waits its own ping timeout (not keepalive_timeout_ms) for an ack:
    # a watch on a frozen member went silent for 68-130 s (measured on a 3-member
    # cluster); with these two it moved to a live member after ~10 s.
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
    # Own connections per Store: grpc otherwise shares them (and their reconnect
    # backoff) between channels to the same address, e.g. two replicas in a test.
    ("grpc.use_local_subchannel_pool", 1),
]
#: Sent with every watch, as etcd's Go client does (``WithRequireLeader``): a member
#: cut off from the quorum then ends the watch with UNAVAILABLE "no leader" (at once,
#: and when it loses its leader later), so it resumes on another member. Without it
#: such a member keeps the stream open and silent for as long as the partition lasts.
#: etcd may refuse the stream before the create request is sent; grpc then reports
#: INTERNAL and loses etcd's status (1 refused stream in 5, measured), so an INTERNAL
#: failure of that first write is retried like UNAVAILABLE: a later attempt whose
#: write gets through reads the real status.
_REQUIRE_LEADER: Final = (("hasleader", "true"),)
_TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
#: grpc's own words for a response over ``grpc.max_receive_message_length``
#: (status RESOURCE_EXHAUSTED, details "Stream removed (CLIENT: Received message
#: larger than max (10486019 vs. 4194304))" with grpcio 1.85). etcd's own
#: RESOURCE_EXHAUSTED errors ("too many requests", "database space exceeded")
#: say something else.
_TOO_LARGE_DETAILS = "message larger than max"
_COMPARE_OPS = {"==": 0, ">": 1, "<": 2, "!=": 3}  # etcdserverpb.Compare.CompareResult
_COMPARE_TARGETS = {"version": 0, "create": 1, "mod": 2, "value": 3}  # Compare.CompareTarget


class StoreError(Exception):
    """An etcd request failed and retrying will not help (or was not safe)."""


class StoreUnavailable(StoreError):
    """etcd did not answer (transport failure, timeout) for ``retry_for`` seconds."""


class LeaseNotFound(StoreError):
    """The lease does not exist (expired or revoked); keys cannot be attached to it."""


class WatchCompacted(StoreError):
    """The watch's start revision was compacted away: events are lost, reload the state.

    Attributes:
        revision: etcd's compact revision; a new watch may start at it or later.
    """

    def __init__(self, revision: int) -> None:
        super().__init__(f"watch start revision compacted (compact revision {revision})")
        self.revision = revision


class _ReadCompacted(StoreError):
    """A read at a fixed revision hit a compaction (``get_prefix`` restarts)."""


class _ResponseTooLarge(StoreError):
    """etcd's answer exceeded our receive limit; the same request will fail again.

    Paged reads catch it and ask for fewer keys; elsewhere it is a plain StoreError.
    """


class SnapshotCompacted(StoreError):
    """A paged read lost its revision to a compaction: what was read is stale, start over."""


class KeyValue(NamedTuple):
    """One key as etcd stores it. ``lease`` is 0 when the key has no lease.

    A NamedTuple rather than a dataclass: one is built per key of every page and
    watch event, and tuples are the cheapest immutable record Python has.
    """

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


class WatchEvent(NamedTuple):
    """One change. For deletes ``value`` is empty and ``create_revision`` is 0."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Compare:
    """A transaction guard on one key. A missing key has create/mod revision and version 0.

    Build with the helpers; ``operand`` is bytes for ``value``, an int otherwise.
    With ``prefix`` it guards every key starting with ``key`` (never the empty
    prefix): it holds when each key present holds it, so an empty range holds
    except on ``value`` (etcd's rule).
    """

    key: str
    target: Literal["value", "create", "mod", "version"]
    op: Literal["==", "!=", "<", ">"]
    operand: bytes | int
    prefix: bool = False

    def __post_init__(self) -> None:
        if self.target not in _COMPARE_TARGETS or self.op not in _COMPARE_OPS:
            raise ValueError(f"bad compare {self.target!r} {self.op!r}")
        if self.prefix and not self.key:
            raise ValueError("empty prefix would address every key in etcd")
        wants_bytes = self.target == "value"
        if isinstance(self.operand, bytes) != wants_bytes or isinstance(self.operand, bool):
            raise TypeError(f"compare on {self.target} needs {'bytes' if wants_bytes else 'int'}")

    @classmethod
    def create_revision(cls, key: str, revision: int) -> Compare:
        """True while ``key`` is the incarnation created at ``revision`` (a fencing check)."""
        return cls(key, "create", "==", revision)

    @classmethod
    def mod_revision(cls, key: str, revision: int) -> Compare:
        """True while ``key`` is unchanged since ``revision`` (compare-and-swap)."""
        return cls(key, "mod", "==", revision)

    @classmethod
    def unchanged_under(cls, prefix: str, revision: int) -> Compare:
        """True while no key under ``prefix`` was created or modified after ``revision``.

        A key deleted since does not count (it is no longer in the range).
        """
        return cls(prefix, "mod", "<", revision + 1, prefix=True)

    @classmethod
    def version(cls, key: str, version: int) -> Compare:
        return cls(key, "version", "==", version)

    @classmethod
    def value(cls, key: str, value: bytes) -> Compare:
        return cls(key, "value", "==", value)

    @classmethod
    def absent(cls, key: str) -> Compare:
        """True while ``key`` does not exist (create-if-absent)."""
        return cls(key, "create", "==", 0)


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    """Delete ``key``, or every key starting with it when ``prefix`` (never the empty prefix)."""

    key: str
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class TxnResult:
    """``revision`` is etcd's revision after the transaction (its own, if it wrote)."""

    succeeded: bool
    revision: int


def _kv(pb: Any) -> KeyValue:
    # Undecodable key bytes are replaced, not raised: a key another program wrote
    # must never stop a load (the view rejects what it cannot use).
    return KeyValue(
        pb.key.decode(errors="replace"),
        pb.value,
        pb.create_revision,
        pb.mod_revision,
        pb.version,
        pb.lease,
    )


def _event(pb: Any) -> WatchEvent:
    kv = pb.kv
    return WatchEvent(
        "put" if pb.type == 0 else "delete",
        kv.key.decode(errors="replace"),
        kv.value,
        kv.create_revision,
        kv.mod_revision,
        kv.lease,
    )


def _raw_events(part: Any) -> list[RawEvent]:
    # Plain tuples of the fields the view reads, keys left as bytes: a WatchEvent
    # (a named tuple, and a decoded key) cost 1.5 us an event more (issue #12).
    return [(pb.type == 0, (kv := pb.kv).key, kv.value, kv.mod_revision) for pb in part]


def _watch_events(part: Any) -> list[WatchEvent]:
    return [_event(pb) for pb in part]


def _revision(event: WatchEvent) -> int:
    return event.mod_revision


def _raw_revision(event: RawEvent) -> int:
    return event[3]


_E = TypeVar("_E", WatchEvent, RawEvent)


#: The tag byte of ``WatchResponse.events`` (field 11, length-delimited).
_EVENTS_TAG: Final = (11 << 3) | 2


def _skip_fields(raw: bytes, pos: int, count: int, *, until_events: bool = False) -> int:
    """The offset after ``count`` protobuf fields of ``raw`` from ``pos`` (or the end).

    With ``until_events`` it stops before the first ``events`` field instead.
    Only field boundaries are read (tag, then a varint, a length or a fixed
    width), so a response can be decoded a slice at a time: a run of whole
    fields of a message is itself a message of that type.

    Raises:
        IndexError: ``raw`` ends inside a field.
        ValueError: a wire type protobuf does not define.
    """
    end = len(raw)
    while count > 0 and pos < end:
        tag = raw[pos]
        if until_events and tag == _EVENTS_TAG:
            return pos
        pos += 1
        if tag & 0x80:  # a field number >= 16: the tag goes on
            while raw[pos] & 0x80:
                pos += 1
            pos += 1
        wire = tag & 7
        if wire == 2:
            length = shift = 0
            while True:
                byte = raw[pos]
                pos += 1
                length |= (byte & 0x7F) << shift
                if byte < 0x80:
                    break
                shift += 7
            pos += length
        elif wire == 0:
            while raw[pos] & 0x80:
                pos += 1
            pos += 1
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"wire type {wire}")
        count -= 1
    if pos > end:
        raise IndexError("field past the end")
    return pos


def _stray_cancellation() -> bool:
    """Whether a CancelledError in this task was *not* a cancellation of the task.

    grpc.aio raises CancelledError when a call ends by its own deadline, a
    transport reset or the channel closing, none of which cancelled us. Taken
    for a cancellation, it ends whatever task group it reaches as if on
    request: before this check, a 1 s etcd pause made every replica exit 0
    (issue #10). A real cancellation (an anyio cancel scope, shutdown) always
    has a pending request on the task (``Task.cancelling() > 0``).
    """
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


async def _redeliver_cancellation() -> None:
    """Re-raise a real cancellation as anyio's own, after grpc mangled it.

    When a cancel scope's deadline and a grpc call's own deadline meet, grpc
    re-raises a CancelledError without anyio's marker, and the scope that
    cancelled us no longer recognises it: it escapes a shielded
    ``move_on_after`` (seen 20 times in 20 against a paused etcd; issue #10's
    crash on resigning). The scope is still cancelled, so its next checkpoint
    raises a cancellation it recognises. Called from an ``except
    CancelledError`` block, which then re-raises the original if none came.
    """
    await anyio.lowlevel.checkpoint()


def _pb_compare(c: Compare) -> Any:
    pb = KVService.txn_compare_version(
        c.key, 0, result=_COMPARE_OPS[c.op], range_end=_range_end(c.key) if c.prefix else None
    )
    pb.target = _COMPARE_TARGETS[c.target]
    match c.target:
        case "value":
            pb.value = c.operand
        case "create":
            pb.create_revision = c.operand
        case "mod":
            pb.mod_revision = c.operand
        case "version":
            pb.version = c.operand
    return pb


def _pb_op(op: Put | Delete) -> Any:
    if isinstance(op, Put):
        return KVService.txn_op_put(op.key, op.value, lease=op.lease)
    return KVService.txn_op_delete(op.key, range_end=_range_end(op.key) if op.prefix else None)


def _range_end(prefix: str) -> bytes:
    if not prefix:
        raise ValueError("empty prefix would address every key in etcd")
    return prefix_range_end(prefix)


def _needs_reauth(exc: BaseException) -> bool:
    """Tokens die with an etcd restart (simple tokens) or an auth-store change."""
    if isinstance(exc, EtcdUnauthenticatedError):
        return True
    if isinstance(exc, grpc.aio.AioRpcError):
        details = exc.details() or ""
        return exc.code() == grpc.StatusCode.UNAUTHENTICATED or (
            exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "auth store is old" in details
        )
    return False


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, EtcdConnectionError | EtcdTransientError | TimeoutError):
        return True
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _TRANSIENT_CODES


def _fatal(op: str, exc: BaseException) -> StoreError:
    """Translate a non-retryable failure into our exception type."""
    if isinstance(exc, grpc.aio.AioRpcError):
        details = exc.details() or ""
        if exc.code() == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
            return LeaseNotFound(f"{op}: {details}")
        if exc.code() == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
            return _ReadCompacted(f"{op}: {details}")
        if (
            exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and _TOO_LARGE_DETAILS in details.lower()
        ):
            return _ResponseTooLarge(f"{op}: {exc.code().name}: {details}")
        return StoreError(f"{op}: {exc.code().name}: {details}")
    if isinstance(exc, EtcdPermissionDeniedError | EtcdUnauthenticatedError):
        return StoreError(f"{op}: {exc}")
    return StoreError(f"{op}: {type(exc).__name__}: {exc}")


def _halved(keys: int, what: str, exc: _ResponseTooLarge) -> int:
    """How many keys to ask for after ``keys`` came back too large: half, at least one.

    Never loops for ever: each refusal halves ``keys``, and one key fits unless
    etcd's --max-request-bytes was raised past the receive limit.

    Raises:
        StoreError: one key alone was too large.
    """
    if keys <= 1:
        raise StoreError(f"one key's {what} exceeds the receive limit: {exc}") from exc
    log.info("store.range.shrink", what=what, keys=keys // 2, error=str(exc))
    return keys // 2


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class Store:
    """etcd access for controllerd. Create with :func:`open_store`.

    Args (via ``open_store``):
        timeout: seconds per attempt of a request.
        retry_for: seconds during which transient failures are retried; a call
            gives up at most ``retry_for + timeout`` seconds after it started.
        clock: the clock that measures ``retry_for``; the event loop's by
            default, so it agrees with the sleeps of the backoff (and with
            looptime in tests).
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        credentials: tuple[str, str] | None,
        timeout: float,
        retry_for: float,
        clock: Callable[[], float],
        target: str = "",
        channel_credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self._channel = channel
        self._target = target
        self._channel_credentials = channel_credentials
        self._kv = KVService(channel, max_attempts=1)
        self._lease = LeaseService(channel, max_attempts=1)
        self._auth = AuthService(channel, max_attempts=1)
        # Responses come as bytes and are decoded a slice at a time (see _watch).
        self._watch_call = channel.stream_stream(
            "/etcdserverpb.Watch/Watch",
            request_serializer=WatchRequest.SerializeToString,
            response_deserializer=None,
        )
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._credentials = credentials
        self._timeout = timeout
        self._retry_for = retry_for
        self._clock = clock
        self._auth_lock = anyio.Lock()
        self._token_generation = 0
        #: called each time a watch is re-established (the daemon counts them)
        self.on_watch_reconnect: Callable[[], None] = lambda: None

    # -- plumbing -------------------------------------------------------------

    async def _authenticate(self, seen_generation: int) -> None:
        """Get a fresh token, once for all callers that saw the same stale one."""
        if self._credentials is None:
            raise StoreError("etcd requires authentication but no username was configured")
        async with self._auth_lock:
            if self._token_generation != seen_generation:
                return
            name, password = self._credentials
            resp = await self._auth.authenticate(name, password, timeout=self._timeout)
            token = str(resp.token)
            # Not on the auth service: Authenticate must go without the stale token,
            # which etcd would reject ("invalid auth token") after a restart.
            for svc in (self._kv, self._lease):
                svc.set_token(token)
            self._metadata = (("token", token),)
            self._token_generation += 1
            log.info("store.authenticated", user=name)

    async def _call(
        self,
        op: str,
        fn: Callable[..., Awaitable[Any]],
        *args: Any,
        reauth: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` with our retry policy and error mapping.

        A rejected token triggers one re-authentication (not for the
        authentication call itself, whose rejection means bad credentials).
        """
        deadline = self._clock() + self._retry_for
        attempt = 0
        while True:
            generation = self._token_generation
            try:
                try:
                    return await fn(*args, **kwargs)
                except asyncio.CancelledError:
                    if not _stray_cancellation():
                        await _redeliver_cancellation()
                        raise
                    raise EtcdTransientError(f"{op}: call cancelled by the transport") from None
            except (EtcdError, grpc.aio.AioRpcError, TimeoutError) as exc:
                if reauth and _needs_reauth(exc) and self._credentials is not None:
                    reauth = False
                    await self._reauthenticate(generation)
                    continue
                if not _is_transient(exc):
                    raise _fatal(op, exc) from exc
                delay = backoff.ETCD.delay(attempt)
                attempt += 1
                if self._clock() + delay > deadline:
                    raise StoreUnavailable(
                        f"{op}: etcd unavailable for {self._retry_for:g}s: {exc}"
                    ) from exc
                log.debug(
                    "store.retry",
                    op=op,
                    attempt=attempt,
                    delay=round(delay, 3),
                    error=_describe(exc),
                )
            await anyio.sleep(delay)

    async def _rpc(
        self, op: str, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
    ) -> Any:
        """One etcd3aio unary call: our timeout per attempt, our retries instead of its own."""
        return await self._call(op, fn, *args, timeout=self._timeout, max_attempts=1, **kwargs)

    async def _reauthenticate(self, seen_generation: int) -> None:
        await self._call("Auth.Authenticate", self._authenticate, seen_generation, reauth=False)

    # -- keys -----------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        resp = await self._rpc("KV.Range", self._kv.get, key)
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys under ``prefix`` as of one revision, and that revision.

        Reads pages of up to :data:`PAGE_SIZE` keys in key order (fewer when
        their values are too large for one response), all at the first page's
        revision, so the result is one consistent snapshot, the same as one
        unpaged read, and a watch started at ``revision + 1`` misses nothing.
        If that revision is compacted between pages the whole read starts over.
        """
        end = _range_end(prefix)
        for _ in range(3):
            try:
                return await self._read_pages(prefix.encode(), end)
            except _ReadCompacted:
                log.info("store.get_prefix.restart", prefix=prefix, why="compacted between pages")
        raise StoreError(f"get_prefix({prefix!r}): compacted between pages three times")

    async def _read_pages(self, start: bytes, end: bytes) -> tuple[list[KeyValue], int]:
        out: list[KeyValue] = []
        revision = 0
        async for page, page_revision in self._pages(start, end):
            out.extend(page)
            revision = page_revision
        return out, revision

    async def iter_prefix(self, prefix: str) -> AsyncIterator[tuple[list[KeyValue], int]]:
        """Pages of keys under ``prefix`` in key order, all at one revision, with it.

        For loading a large prefix without holding it all: the caller handles
        each page as it arrives (and should yield to the loop between pages).
        A watch from ``revision + 1`` after the last page misses nothing.

        Raises:
            SnapshotCompacted: the revision was compacted between pages; start
                over (the pages already handled are from a lost snapshot).
        """
        try:
            async for page in self._pages(prefix.encode(), _range_end(prefix)):
                yield page
        except _ReadCompacted as exc:
            raise SnapshotCompacted(str(exc)) from exc

    async def _pages(self, start: bytes, end: bytes) -> AsyncIterator[tuple[list[KeyValue], int]]:
        """Pages of at most :data:`PAGE_SIZE` keys, each read over a range that holds only it.

        etcd (3.4 and 3.5) walks its whole index from a range's start to its end
        on every request, whatever the limit, so paging a large prefix with
        ``limit`` costs the square of its size: 1.9 million keys took minutes.
        Instead one keys-only request per :data:`SCAN_KEYS` keys finds where
        each page ends, and each page is read over exactly its own keys. At a
        fixed revision those ranges hold exactly the keys listed.

        A page (or listing) whose response exceeds the receive limit is asked
        for again with half as many keys, down to one; the smaller count holds
        for the rest of this read, since every refused page cost etcd a full
        read and encoding of it. Nothing is yielded from a refused response,
        and the revision stays fixed, so the pages are the same keys as ever.
        """
        revision = 0
        scan_keys, page_keys = SCAN_KEYS, PAGE_SIZE
        while True:
            # sort_order NONE returns keys in key order and lets etcd stop at the
            # limit; asking for ASCEND makes etcd 3.4 read the whole range to sort it.
            try:
                listing = await self._rpc(
                    "KV.Range",
                    self._kv.get,
                    start,
                    end,
                    revision=revision,
                    limit=scan_keys,
                    keys_only=True,
                )
            except _ResponseTooLarge as exc:
                scan_keys = _halved(scan_keys, "listing", exc)
                continue
            revision = revision or int(listing.header.revision)
            # Only the page boundaries are read from the listing: copying all 64k keys
            # out of it held the event loop for ~20 ms.
            listed = listing.kvs
            count = len(listed)
            if not count:
                yield [], revision
                return
            last = listed[count - 1].key
            first = 0
            while first < count:
                after = min(first + page_keys, count)
                page_end = listed[after].key if after < count else last + b"\x00"
                try:
                    resp = await self._rpc(
                        "KV.Range", self._kv.get, listed[first].key, page_end, revision=revision
                    )
                except _ResponseTooLarge as exc:
                    page_keys = _halved(after - first, "page", exc)
                    continue
                yield [_kv(pb) for pb in resp.kvs], revision
                first = after
            if not listing.more:
                return
            start = last + b"\x00"

    async def probe(self, key: str, timeout: float) -> int:  # noqa: ASYNC109
        """One request, never retried, answered by etcd's raft leader; its revision.

        For readiness: a linearizable read proves that etcd has a leader and
        answers us now, which no cached connection state does.

        Raises:
            StoreUnavailable: no answer within ``timeout``.
            StoreError: etcd refused (e.g. our credentials).
        """
        try:
            try:
                resp = await self._kv.get(key, count_only=True, timeout=timeout, max_attempts=1)
            except asyncio.CancelledError:
                if not _stray_cancellation():
                    await _redeliver_cancellation()
                    raise
                raise StoreUnavailable("KV.Range: call cancelled by the transport") from None
        except (EtcdError, grpc.aio.AioRpcError, TimeoutError) as exc:
            if _needs_reauth(exc) and self._credentials is not None:
                await self._reauthenticate(self._token_generation)
                raise StoreUnavailable(f"KV.Range: re-authenticated: {_describe(exc)}") from exc
            if _is_transient(exc):
                raise StoreUnavailable(f"KV.Range: {_describe(exc)}") from exc
            raise _fatal("KV.Range", exc) from exc
        return int(resp.header.revision)

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write ``key``; returns the revision of the write."""
        resp = await self._rpc("KV.Put", self._kv.put, key, value, lease)
        return int(resp.header.revision)

    async def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed (a retry may report False for an applied delete)."""
        resp = await self._rpc("KV.DeleteRange", self._kv.delete, key)
        return int(resp.deleted) > 0

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix`` (which must not be empty); returns how many."""
        resp = await self._rpc("KV.DeleteRange", self._kv.delete, prefix, _range_end(prefix))
        return int(resp.deleted)

    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure: Sequence[Put | Delete] = (),
    ) -> TxnResult:
        """Apply ``success`` if every compare holds, else ``failure``, atomically.

        Retried like every call, hence the rule in the module docstring: the
        compares must be falsified by the success branch itself, so a retry
        of an applied transaction cannot apply it again. An empty ``compares``
        is refused.

        Raises:
            ValueError: no compares.
            LeaseNotFound: a Put names a lease that no longer exists.
        """
        if not compares:
            raise ValueError("txn needs compares: an unguarded txn is not safe to retry")
        resp = await self._rpc(
            "KV.Txn",
            self._kv.txn,
            [_pb_compare(c) for c in compares],
            [_pb_op(op) for op in success],
            [_pb_op(op) for op in failure],
        )
        return TxnResult(succeeded=bool(resp.succeeded), revision=int(resp.header.revision))

    # -- leases ---------------------------------------------------------------

    async def grant_lease(self, ttl_seconds: int) -> tuple[int, int]:
        """A new lease; returns (id, TTL granted, which etcd may round up to its minimum).

        A retried grant may leave an orphan lease behind; it has no keys and expires.
        """
        resp = await self._rpc("Lease.Grant", self._lease.grant, ttl_seconds)
        return int(resp.ID), int(resp.TTL)

    async def keepalive_once(self, lease_id: int, timeout: float) -> int:  # noqa: ASYNC109
        """Renew the lease once; returns its TTL from now (0 or less: it has expired).

        A single attempt bounded by ``timeout``, never retried: the caller counts
        the lease's life from when it sent this request, which a hidden retry
        would falsify.

        Raises:
            StoreUnavailable: no answer within ``timeout``.
        """
        generation = self._token_generation
        try:
            with anyio.fail_after(timeout):
                call = self._lease.keep_alive(lease_id)
                try:
                    resp = await call.read()
                except asyncio.CancelledError:
                    if _stray_cancellation():
                        raise StoreUnavailable("Lease.KeepAlive: cancelled in transport") from None
                    await _redeliver_cancellation()
                    raise
                finally:
                    call.cancel()
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            if _needs_reauth(exc) and self._credentials is not None:
                await self._reauthenticate(generation)
            if _is_transient(exc) or _needs_reauth(exc):
                raise StoreUnavailable(f"Lease.KeepAlive: {exc}") from exc
            raise _fatal("Lease.KeepAlive", exc) from exc
        if resp is grpc.aio.EOF:
            raise StoreUnavailable("Lease.KeepAlive: stream closed without an answer")
        return int(resp.TTL)

    def keepalive_client(self) -> LeaseKeepAliveClient:
        """A blocking keep-alive client on a channel of its own, for a dedicated thread.

        The caller owns it and must :meth:`LeaseKeepAliveClient.close` it.
        """
        if not self._target:
            raise StoreError("this Store was not opened by open_store: no target to connect")
        return LeaseKeepAliveClient(self._target, self._channel_credentials, self._auth_metadata)

    def _auth_metadata(self) -> tuple[tuple[str, str], ...] | None:
        return self._metadata

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease, deleting its keys at once. An unknown lease is fine."""
        with suppress(LeaseNotFound):
            await self._rpc("Lease.Revoke", self._lease.revoke, lease_id)

    # -- watches --------------------------------------------------------------

    def watch_prefix(
        self, prefix: str, start_revision: int
    ) -> AsyncGenerator[list[WatchEvent], None]:
        """Batches of events under ``prefix`` from ``start_revision`` on, for ever.

        Every event after ``start_revision`` arrives exactly once and in order,
        even across etcd restarts and dropped connections: a new stream resumes
        from the revision after the last *event* delivered. Events of one
        revision are never split across batches, even where etcd splits them
        across response fragments. Close the generator
        (``contextlib.aclosing``) to stop early.

        Raises:
            WatchCompacted: ``start_revision`` (or the revision a reconnect
                resumes from) is compacted; reload with ``get_prefix``.
            StoreError: etcd cancelled the watch for another reason, or sent a
                response over the receive limit (one event or fragment that
                big, or an etcd before 3.4, which does not fragment).
        """
        return self._watch(
            prefix.encode(), _range_end(prefix), start_revision, _watch_events, _revision
        )

    def watch_prefix_raw(
        self, prefix: str, start_revision: int
    ) -> AsyncGenerator[list[RawEvent], None]:
        """:meth:`watch_prefix` with each event as a :data:`RawEvent` tuple, for
        :meth:`MetadataView.apply_events`; the same batches, order and resumption."""
        return self._watch(
            prefix.encode(), _range_end(prefix), start_revision, _raw_events, _raw_revision
        )

    def watch_key(self, key: str, start_revision: int) -> AsyncGenerator[list[WatchEvent], None]:
        """Like :meth:`watch_prefix`, for exactly one key."""
        return self._watch(key.encode(), b"", start_revision, _watch_events, _revision)

    async def _watch(
        self,
        key: bytes,
        range_end: bytes,
        start_revision: int,
        convert: Callable[[Any], list[_E]],
        revision_of: Callable[[_E], int],
    ) -> AsyncGenerator[list[_E], None]:
        # Why not etcd3aio's WatchService.watch: it reconnects by itself from the
        # last response's *header* revision + 1, which loses events (a catching-up
        # watcher gets 1000 revisions per response stamped with the current
        # revision; measured: after a restart it resumed at 2502 having delivered
        # up to 1001), and its never-ending request generator leaves a pending
        # grpc task behind on every reconnect. We drive the stream ourselves
        # (write the create request, then read) and resume from our own revision.
        #
        # A catching-up response holds up to 1000 revisions of any size (300 MB of
        # 300 KiB values), over any receive limit, so we ask for ``fragment``:
        # etcd (3.4 on) then sends a response larger than its --max-request-bytes
        # + 512 KiB as consecutive fragments, all flagged but the last, cut between
        # *events*, not revisions. A revision's events may thus span fragments;
        # they are carried over like those of two slices of one fragment, and a
        # stream that breaks mid-revision resumes at that revision.
        if start_revision < 1:
            raise ValueError("start_revision must be >= 1 (0 would mean 'from now')")
        next_revision = start_revision
        failures = 0
        while True:
            generation = self._token_generation
            call = self._watch_call(metadata=_REQUIRE_LEADER + (self._metadata or ()))
            creating = True
            try:
                await call.write(
                    WatchRequest(
                        create_request=WatchCreateRequest(
                            key=key,
                            range_end=range_end,
                            start_revision=next_revision,
                            fragment=True,
                        )
                    )
                )
                creating = False
                # Events of the last revision seen, not yet complete. Never more than
                # one revision; etcd never sends an empty fragment, so the last one
                # of a response always completes (and delivers) them.
                carried: list[_E] = []
                while (raw := await call.read()) is not grpc.aio.EOF:
                    failures = 0
                    # A catching-up response holds up to 1000 revisions (128k events of
                    # 128-put transactions, 20 MB and more): decoding it in one piece
                    # held the loop for 46-48 ms in process, more on a busy host. Its
                    # other fields come first (etcd writes fields in number order); the
                    # events are decoded and handed over WATCH_BATCH at a time, in
                    # batches that end only between revisions, so resuming from the
                    # last one's revision + 1 never skips part of a transaction.
                    try:
                        pos = _skip_fields(raw, 0, len(raw), until_events=True)
                        head = WatchResponse.FromString(raw[:pos])
                    except (IndexError, ValueError, DecodeError) as exc:
                        raise StoreError(f"malformed watch response: {exc}") from exc
                    if head.compact_revision > 0:
                        raise WatchCompacted(int(head.compact_revision))
                    if head.canceled:
                        raise StoreError(f"watch cancelled by etcd: {head.cancel_reason}")
                    while pos < len(raw):
                        try:
                            end = _skip_fields(raw, pos, WATCH_BATCH)
                            part = WatchResponse.FromString(raw[pos:end]).events
                        except (IndexError, ValueError, DecodeError) as exc:
                            raise StoreError(f"malformed watch response: {exc}") from exc
                        pos = end
                        batch = carried + convert(part)
                        carried = []
                        # the last revision may go on in the next slice or fragment
                        if pos < len(raw) or head.fragment:
                            cut, last = len(batch), revision_of(batch[-1])
                            while cut > 0 and revision_of(batch[cut - 1]) == last:
                                cut -= 1
                            batch, carried = batch[:cut], batch[cut:]
                        if batch:
                            next_revision = revision_of(batch[-1]) + 1
                            yield batch
                error = "stream ended"
            except asyncio.CancelledError:
                if not _stray_cancellation():
                    await _redeliver_cancellation()
                    raise
                error = "stream cancelled by the transport"
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                if _needs_reauth(exc):
                    await self._reauthenticate(generation)
                elif not (
                    _is_transient(exc)
                    or isinstance(exc, asyncio.InvalidStateError)
                    or (creating and exc.code() == grpc.StatusCode.INTERNAL)
                ):
                    raise _fatal("Watch", exc) from exc
                error = _describe(exc)
            finally:
                call.cancel()
            delay = backoff.ETCD.delay(failures)
            failures += 1
            self.on_watch_reconnect()
            log.info(
                "store.watch.reconnect",
                key=key.decode(),
                revision=next_revision,
                delay=round(delay, 3),
                error=error,
            )
            await anyio.sleep(delay)

    async def aclose(self) -> None:
        """Close the channel; calls in flight fail. Safe to call twice."""
        with anyio.CancelScope(shield=True):
            await self._channel.close()


class LeaseKeepAliveClient:
    """Lease keep-alives as blocking calls on a grpc channel of its own.

    Why a second, synchronous channel: the lease must be renewed even while the
    event loop is busy (loading 100k topics, a long GC pass) or blocked, so the
    renewal runs in a thread of its own (issue #12), and grpc.aio channels belong
    to one event loop. Auth tokens are read from the owning :class:`Store` at
    every call; an expired token fails the call, and the store's next request
    re-authenticates.
    """

    def __init__(
        self,
        target: str,
        channel_credentials: grpc.ChannelCredentials | None,
        metadata: Callable[[], tuple[tuple[str, str], ...] | None],
    ) -> None:
        if channel_credentials is None:
            self._channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
        else:
            self._channel = grpc.secure_channel(target, channel_credentials, _CHANNEL_OPTIONS)
        self._stub = LeaseStub(self._channel)
        self._metadata = metadata

    def keepalive_once(self, lease_id: int, timeout: float) -> int:
        """Renew once; the lease's TTL from now (<= 0: it has expired). Blocks <= ``timeout``.

        Raises:
            StoreUnavailable: no answer within ``timeout`` (or a transient failure).
            StoreError: etcd refused the request for another reason.
        """
        responses = self._stub.LeaseKeepAlive(
            iter([LeaseKeepAliveRequest(ID=lease_id)]), timeout=timeout, metadata=self._metadata()
        )
        try:
            response = next(responses)
        except StopIteration:
            raise StoreUnavailable("Lease.KeepAlive: stream closed without an answer") from None
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            if code in _TRANSIENT_CODES or code == grpc.StatusCode.UNAUTHENTICATED:
                raise StoreUnavailable(f"Lease.KeepAlive: {code}: {details}") from None
            raise StoreError(f"Lease.KeepAlive: {code}: {details}") from None
        finally:
            responses.cancel()
        return int(response.TTL)

    def close(self) -> None:
        self._channel.close()


def endpoints_problem(endpoints: Sequence[str]) -> str | None:
    """Why these endpoint URLs cannot be used (the rules :func:`open_store` applies), or None."""
    try:
        _target(endpoints)
    except ValueError as exc:
        return str(exc)
    return None


def _target(endpoints: Sequence[str]) -> tuple[str, bool]:
    """grpc target for the endpoint URLs, and whether they use TLS.

    IP endpoints become one round-robin ``ipv4:``/``ipv6:`` target. A host
    name is resolved by grpc (``dns:``), so give one name that resolves to
    every member rather than several names.
    """
    if not endpoints:
        raise ValueError("no etcd endpoints")
    schemes: set[str] = set()
    families: set[str] = set()
    hosts: list[str] = []
    for url in endpoints:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
            raise ValueError(f"etcd endpoint must be http(s)://host:port, got {url!r}")
        schemes.add(parts.scheme)
        host = "127.0.0.1" if parts.hostname == "localhost" else parts.hostname
        try:
            address = ip_address(host)
        except ValueError:
            families.add("dns")
            hosts.append(f"{host}:{parts.port}")
            continue
        if isinstance(address, IPv6Address):
            families.add("ipv6")
            hosts.append(f"[{host}]:{parts.port}")
        else:
            families.add("ipv4")
            hosts.append(f"{host}:{parts.port}")
    if len(schemes) > 1 or len(families) > 1:
        raise ValueError("etcd endpoints must share one scheme and one address family")
    family = families.pop()
    if family == "dns":
        if len(hosts) > 1:
            raise ValueError("give IP endpoints, or one DNS name that resolves to every member")
        return f"dns:///{hosts[0]}", schemes == {"https"}
    return f"{family}:{','.join(hosts)}", schemes == {"https"}


@asynccontextmanager
async def open_store(
    endpoints: Sequence[str],
    *,
    username: str | None = None,
    password: str | None = None,
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    timeout: float = 5.0,  # noqa: ASYNC109 - per-request setting, not a call timeout
    retry_for: float = 5.0,
    clock: Callable[[], float] = anyio.current_time,
    max_receive_bytes: int = MAX_RECEIVE_BYTES,
) -> AsyncIterator[Store]:
    """Open a :class:`Store` on etcd's client URLs; close it on exit.

    Connecting is lazy (grpc connects on the first call), so this does not
    wait for etcd unless ``username`` is given: then it authenticates, retrying
    like any call. Certificate files are read without blocking the loop.

    Args:
        endpoints: ``http://host:port`` or ``https://host:port`` URLs.
        ca_file: PEM CA bundle for https; None = grpc's default roots.
        cert_file, key_file: client certificate and key for mutual TLS.
        max_receive_bytes: the largest response accepted; must exceed one key
            and one watch fragment (etcd's --max-request-bytes + 512 KiB).

    Raises:
        ValueError: malformed endpoints or half a certificate pair.
        StoreError: authentication refused.
    """
    target, tls = _target(endpoints)
    if (cert_file is None) != (key_file is None):
        raise ValueError("cert_file and key_file go together")
    if (username is None) != (password is None):
        raise ValueError("username and password go together")
    options = [
        (name, max_receive_bytes if name == "grpc.max_receive_message_length" else value)
        for name, value in _CHANNEL_OPTIONS
    ]
    if tls:
        ca, cert, key = [
            None if path is None else await anyio.Path(path).read_bytes()
            for path in (ca_file, cert_file, key_file)
        ]
        creds: grpc.ChannelCredentials | None = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )
        channel = grpc.aio.secure_channel(target, creds, options=options)
    else:
        creds = None
        channel = grpc.aio.insecure_channel(target, options=options)
    credentials = None if username is None or password is None else (username, password)
    store = Store(
        channel,
        credentials=credentials,
        timeout=timeout,
        retry_for=retry_for,
        clock=clock,
        target=target,
        channel_credentials=creds,
    )
    try:
        if credentials is not None:
            await store._reauthenticate(0)
        yield store
    finally:
        await store.aclose()
