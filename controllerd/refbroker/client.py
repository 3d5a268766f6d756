"""Client library of the reference broker: a producer and a STREAM consumer.

This is the client half of the contract in ``docs/reference-broker.md``. Both
follow one topic's etcd subtree (layout, ``…/segments/<id>/seal`` keys and, for
the consumer, its subscription's registrations) with one watch, and move the
data through Kafka with aiokafka. The broker is never on the data path.

Producer (:func:`open_producer`):

* Routes by :func:`~controllerd.refbroker.naming.key_hash` to the active segment
  whose range holds the hash (keyless messages: a random active segment), one
  aiokafka producer, ``enable_idempotence=False`` (tansu lacks it). aiokafka keeps
  at most one batch in flight per partition, so a segment receives a producer's
  messages in send order, retries included.
* Remembers what it sent to each segment. Once its layout shows a segment it sent
  to as sealed it sends nothing more to it, waits for every send to that segment
  to be acknowledged and for the seal key, then re-sends, in the original order
  and all routed by one layout (the newest when they begin), every message that
  landed at an offset ``>= endOffset``. New sends wait meanwhile, so re-sends go
  first.
* Memory is bounded without waiting for seals: a message acknowledged before two
  linearizable etcd reads, the first finding no ``sealing`` intent naming its
  segment and the second still showing the segment active, lies below any future
  seal (the broker reads end offsets only after its intent appeared), so it is
  forgotten. This check runs once ``retain_limit`` messages are remembered and in
  :meth:`Producer.flush`, which a clean exit runs.

Consumer (:func:`open_consumer`):

* Registers ``…/subscriptions/<sub>/consumers/<name>`` on its own lease and deals
  the readable segments (sorted by id) round-robin over the registered names
  (sorted). A segment is readable when it is not finished and every parent still
  in the layout is finished (group commit ``>= endOffset``).
* **Hand-over (an extension of the contract):** the registration value is
  ``{"host": …, "segments": [ids]}``, the segments the consumer claims. It reads
  a segment only after claiming it and then seeing, in a linearizable read, that
  no other registration claims it (of two concurrent claimers at least the later
  sees the earlier and backs off). It commits what it processed *before* it drops
  a claim; a new owner fetches the group's committed offset only after it sees the
  claim gone. So committed messages are never delivered twice, even while
  consumers disagree about the assignment.
* Never delivers a record of a segment at or beyond its ``endOffset``; for a
  record of a segment its layout shows active it first checks with linearizable
  etcd reads that no ``sealing`` intent names the segment and then that it is
  still active (then the record lies below any future seal). It reads nothing of
  a segment that an intent names until the intent is gone. A child becomes
  readable only after its parents are committed to their ends, which gives
  per-key order across splits and merges.
* Delivery is at least once beyond the last commit. A message counts as
  *processed* once the iteration asks for the next one. With ``auto_commit``
  (default) processed offsets are committed at the end of every fetched batch;
  :meth:`Consumer.commit` commits everything delivered so far. Processed offsets
  are always committed when a segment is handed over or reaches its end, and when
  the consumer closes cleanly.
* Claims are taken and released only while :meth:`Consumer.messages` is being
  iterated (or when the consumer closes): a consumer that stops iterating keeps
  its segments, as a Kafka consumer that stops polling would.

Limits:

* A producer waits (and blocks its sends) until the seal key of a sealed segment
  it sent to appears; a broker that never writes it stalls the producer.
* A message whose send failed (:class:`SendFailed`) is never re-sent: if Kafka
  wrote it nevertheless, beyond a seal, it is lost; below a seal, it is delivered.
  A re-send that Kafka refuses is logged and counted (``SegmentStats.failed``).
  A re-send aiokafka does not take (its ``send`` raises) stays pending and is
  retried on the Kafka backoff; a :meth:`Producer.send` that meets it fails
  with :class:`SendFailed` without sending.
  A producer that dies with re-sends pending loses the messages beyond the seal.
* Consumer names must be unique within a subscription. A consumer cut off from
  etcd stops when its lease would expire (:class:`ConsumerLost`); until then it may
  still deliver, and etcd's and our clocks must agree to within the lease margin.
* Both sides trust ``endOffset`` to be the true end of the log when the broker
  read it. (tansu 0.6 answers ListOffsets(latest) with the last *batch's* base
  offset + 1; a broker that uses that number seals too low, and the producer then
  re-sends messages that consumers may already have delivered.)

Values in etcd may be garbage. Every one is parsed as strict JSON (orjson: no
depth beyond 1024, NaN or lone surrogate, all ValueError); an unusable layout is
logged and ignored (the last usable one stays), an unreadable ``sealing`` intent
names every segment, an unreadable seal is ignored and an unreadable registration
claims nothing. None of them ends a background task.

All background work (``refclient-watch``, ``refclient-sealer``,
``refclient-keepalive``, ``refclient-offsets``) runs in a task group owned by the
context manager; if one fails the context exits with its exception (wrapped in an
ExceptionGroup by anyio).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import random
import socket
from bisect import bisect_right
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from controllerd.adapters import backoff
from controllerd.adapters.store import LeaseNotFound, Store, StoreError, WatchCompacted
from controllerd.core.layout import check
from controllerd.core.model import Layout, TopicName, layout_from_json
from controllerd.core.view import Keys, parse_json
from controllerd.refbroker.naming import (
    check_name_part,
    key_hash,
    sealing_key,
    segment_topic,
    subscription_group,
)

__all__ = [
    "Consumer",
    "ConsumerLost",
    "Message",
    "Producer",
    "RefClientError",
    "SegmentStats",
    "SendFailed",
    "SendResult",
    "TopicNotFound",
    "deal",
    "open_consumer",
    "open_producer",
    "readable_segments",
]

log = structlog.get_logger(__name__)

#: Seconds a clean exit may spend settling (producer) or committing (consumer).
CLOSE_TIMEOUT: Final = 10.0
#: Seconds granted to stopping a Kafka client.
_STOP_TIMEOUT: Final = 2.0
#: Longest wait of one Kafka fetch; a view change cuts it short anyway.
_FETCH_WAIT_MS: Final = 1000
#: Longest time the broker may hold a fetch with no data. Short, because a
#: reassignment waits for the fetch in flight.
_FETCH_MAX_WAIT_MS: Final = 100
#: Seconds between keep-alive attempts after one failed (until the lease runs out).
_KEEPALIVE_RETRY: Final = 0.25
#: Characters of a parse error a log line keeps (a garbage value may be megabytes).
_ERROR_CHARS: Final = 300


class RefClientError(Exception):
    """Base of the errors this module raises."""


class TopicNotFound(RefClientError):
    """The topic has no layout in etcd (never created, or deleted)."""


class SendFailed(RefClientError):
    """Kafka did not acknowledge a message; it may or may not have been written."""


class ConsumerLost(RefClientError):
    """The consumer's lease expired or could not be renewed in time: it stopped reading."""


# --- shared plumbing ----------------------------------------------------------------------


class _Signal:
    """Broadcast "something changed"; waiters re-check their own condition.

    Uses asyncio.Event because it is also notified from aiokafka's future callbacks,
    where anyio cannot detect the running library.
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.version = 0

    def notify(self) -> None:
        self.version += 1
        self._event.set()
        self._event = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._event.wait()

    async def wait_beyond(self, version: int) -> None:
        await self.wait_for(lambda: self.version > version)


#: What parsing a layout raises on garbage: ValueError (orjson's JSONDecodeError,
#: ModelError, LayoutError, a segment Kafka cannot name) or RecursionError (the core's
#: error message shows the value, and orjson lets one nest 1024 deep, past Python's repr).
_UNUSABLE_LAYOUT: Final = (ValueError, RecursionError)


def _parse_layout(topic: TopicName, value: bytes) -> Layout:
    """A usable layout of ``topic``: strict JSON, every invariant, a Kafka name for
    every segment (a negative id holds every invariant but has none).

    Raises:
        ValueError: or RecursionError (see :data:`_UNUSABLE_LAYOUT`) for any other.
    """
    layout = check(layout_from_json(parse_json(value)))
    for seg in layout.segments.values():
        segment_topic(topic, seg.descriptor)
    return layout


#: What an unreadable intent names: every segment (-1) is treated as possibly sealing.
_EVERY_SEGMENT: Final = -1


def _parse_sealing(value: bytes) -> frozenset[int]:
    """Segments a ``sealing`` intent names; an unreadable intent names every segment."""
    try:
        raw = parse_json(value)
        ids = raw.get("segments") if isinstance(raw, dict) else None
        if isinstance(ids, list) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            return frozenset(ids)
    except ValueError:
        pass
    return frozenset({_EVERY_SEGMENT})


def _sealing_names(sealing: frozenset[int], sid: int) -> bool:
    return sid in sealing or _EVERY_SEGMENT in sealing


async def _fresh_sealing(store: Store, key: str) -> tuple[frozenset[int], int]:
    """Segments a linearizable read of the intent names, and the intent's revision (0: none)."""
    kv = await store.get(key)
    if kv is None:
        return frozenset(), 0
    return _parse_sealing(kv.value), kv.mod_revision


def _parse_claims(value: bytes) -> frozenset[int]:
    """Segments a registration claims; a registration without claims (or unparsable) has none."""
    try:
        raw = parse_json(value)
        ids = raw.get("segments", []) if isinstance(raw, dict) else []
        return frozenset(int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool))
    except (ValueError, TypeError):
        return frozenset()


class _TopicFollower:
    """Mirror of one topic's etcd subtree, kept current by one watch.

    Invariants: ``revision`` is the etcd revision the mirror reflects. ``seals``
    holds the end offset of every segment whose seal key the mirror shows, and
    of a segment whose key was deleted (GC deleted its data; the end offset stays
    true) only while the layout still shows the segment or ``holds`` says the
    owner still needs it (a producer with messages sent to it not yet settled);
    then it goes, so ``seals`` is bounded by the subtree, not by its history. An
    invalid layout value is logged and ignored (the previous one stays).
    ``sealing`` is what the broker's ``sealing`` intent names (empty: none).
    """

    def __init__(
        self, store: Store, keys: Keys, topic: TopicName, signal: _Signal, subscription: str | None
    ) -> None:
        self._store = store
        self._signal = signal
        self.topic = topic
        self.root = keys.layout(topic)
        self.sealing_key = sealing_key(keys, topic)
        self._segments_prefix = f"{self.root}/segments/"
        self.consumers_prefix = (
            f"{keys.subscription(topic, subscription)}/consumers/" if subscription else None
        )
        self.layout: Layout | None = None
        self.seals: dict[int, int] = {}
        #: segments in ``seals`` whose seal key is gone: kept while needed, see the invariants
        self._unkeyed: set[int] = set()
        #: whether the owner still needs the end offset of a segment whose seal key is gone
        self.holds: Callable[[int], bool] = lambda sid: False
        self.sealing: frozenset[int] = frozenset()
        self.consumers: dict[str, frozenset[int]] = {}
        self.revision = 0

    def is_sealing(self, sid: int) -> bool:
        """Whether the intent, as far as the watch has seen, names ``sid``."""
        return _sealing_names(self.sealing, sid)

    async def load(self) -> None:
        """Read the subtree as of one revision (start, and after a compaction)."""
        kvs, revision = await self._store.get_prefix(self.root)
        self.layout = None
        self.sealing = frozenset()
        self.consumers = {}
        keyed: set[int] = set()
        for kv in kvs:
            self._put(kv.key, kv.value)
            sid = self._seal_id(kv.key)
            if sid is not None:
                keyed.add(sid)
        self._unkeyed.update(set(self.seals) - keyed)  # deleted while history was compacted
        self.drop_unneeded_seals()
        self.revision = revision
        self._signal.notify()

    def drop_unneeded_seals(self) -> None:
        """Forget the seals whose key is gone that neither the layout nor the owner needs."""
        shown = self.layout.segments if self.layout is not None else {}
        for sid in [s for s in self._unkeyed if s not in shown and not self.holds(s)]:
            self._unkeyed.discard(sid)
            del self.seals[sid]

    async def run(self) -> None:
        """Apply every change from ``revision + 1`` on; reload if history was compacted.

        Never ends on etcd: a watch that fails (cancelled by etcd, a reload that
        found etcd unreachable) is retried with backoff from ``revision + 1``, as
        the daemon's follower does; ending would end the producer or consumer.
        """
        failures = 0
        compacted = False
        while True:
            try:
                if compacted:
                    await self.load()
                    compacted = False
                watch = self._store.watch_prefix(self.root, self.revision + 1)
                async with aclosing(watch) as batches:
                    async for batch in batches:
                        failures = 0
                        relevant = False
                        for event in batch:
                            if event.kind == "put":
                                relevant |= self._put(event.key, event.value)
                            else:
                                relevant |= self._delete(event.key)
                        self.revision = batch[-1].mod_revision
                        if relevant:
                            self._signal.notify()
            except WatchCompacted as exc:
                log.warning("refclient.watch.compacted", root=self.root, revision=exc.revision)
                compacted = True
            except StoreError as exc:
                delay = backoff.ETCD.delay(failures)
                failures += 1
                log.warning(
                    "refclient.watch.failed",
                    root=self.root,
                    reload=compacted,
                    error=str(exc),
                    retry_in_s=round(delay, 3),
                )
                await anyio.sleep(delay)

    def _seal_id(self, key: str) -> int | None:
        """The segment id of a seal key (None: not one, or no usable id)."""
        if not key.startswith(self._segments_prefix) or not key.endswith("/seal"):
            return None
        sid = key[len(self._segments_prefix) : -len("/seal")]
        return int(sid) if sid.isdigit() else None

    def _put(self, key: str, value: bytes) -> bool:
        if key == self.root:
            try:
                self.layout = _parse_layout(self.topic, value)
            except _UNUSABLE_LAYOUT as exc:
                log.warning("refclient.layout.invalid", key=key, error=str(exc)[:_ERROR_CHARS])
                return False
            self.drop_unneeded_seals()
            return True
        if key == self.sealing_key:
            self.sealing = _parse_sealing(value)
            return True
        if key.startswith(self._segments_prefix) and key.endswith("/seal"):
            sid = self._seal_id(key)
            try:
                end = parse_json(value)["endOffset"]
            except (ValueError, TypeError, KeyError):
                end = None
            if sid is None or not isinstance(end, int) or isinstance(end, bool) or end < 0:
                log.warning("refclient.seal.invalid", key=key)
                return False
            self.seals[sid] = end
            self._unkeyed.discard(sid)
            return True
        name = self._consumer_name(key)
        if name is not None:
            self.consumers[name] = _parse_claims(value)
            return True
        return False

    def _delete(self, key: str) -> bool:
        if key == self.root:
            self.layout = None
            self.drop_unneeded_seals()
            return True
        if key == self.sealing_key:
            self.sealing = frozenset()
            return True
        sid = self._seal_id(key)
        if sid is not None:
            if sid in self.seals:
                self._unkeyed.add(sid)
                self.drop_unneeded_seals()
            return False  # forgetting a seal nobody needs unblocks no one
        name = self._consumer_name(key)
        if name is not None:
            return self.consumers.pop(name, None) is not None
        return False

    def _consumer_name(self, key: str) -> str | None:
        if self.consumers_prefix is None or not key.startswith(self.consumers_prefix):
            return None
        name = key[len(self.consumers_prefix) :]
        return name if name and "/" not in name else None


def _route(layout: Layout, key: bytes | None) -> int:
    """The active segment a key goes to (a random one for no key)."""
    active = layout.active_segments()
    if key is None:
        return random.choice(active).segment_id
    index = bisect_right(active, key_hash(key), key=lambda s: s.hash_range.start) - 1
    return active[index].segment_id


async def _stop_quietly(client: Any) -> None:
    with anyio.move_on_after(_STOP_TIMEOUT, shield=True):
        await client.stop()


# --- producer -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendResult:
    """Where a message landed. If that segment is later sealed below ``offset``, the
    producer re-sends the message elsewhere; this result then no longer describes it."""

    segment_id: int
    offset: int


@dataclass(slots=True)
class SegmentStats:
    """Per-segment counters of one producer (debugging aid; acknowledged sends only)."""

    messages: int = 0
    bytes: int = 0
    #: messages that landed beyond this segment's seal and were re-sent elsewhere.
    resent: int = 0
    #: sends Kafka did not acknowledge.
    failed: int = 0


@dataclass(slots=True, eq=False)
class _Sent:
    key: bytes | None
    value: bytes
    offset: int | None = None  # set on acknowledgement
    done: bool = False  # acknowledged or failed


@dataclass(slots=True, eq=False)
class _Track:
    """Messages sent to one segment, oldest first, not yet known to be below its seal.

    ``route_by`` is set once the segment's re-sends begin: the layout every one of
    them is routed by, kept if a re-send fails so the retry routes the rest alike.
    """

    entries: deque[_Sent] = field(default_factory=deque)
    inflight: int = 0
    route_by: Layout | None = None


class Producer:
    """Sends messages to a scalable topic. Create with :func:`open_producer`.

    Invariant: a message goes to Kafka only under ``_gate`` and right after
    ``_settle`` found no segment we sent to sealed in the current layout, so the
    re-sends of a sealed segment precede every message sent after we saw the seal.
    """

    def __init__(
        self,
        store: Store,
        topic: TopicName,
        follower: _TopicFollower,
        signal: _Signal,
        kafka: Any,
        retain_limit: int,
    ) -> None:
        self._store = store
        self._topic = topic
        self._follower = follower
        self._signal = signal
        self._kafka = kafka
        self._retain_limit = retain_limit
        self._trim_at = retain_limit
        self._gate = anyio.Lock()
        self._tracks: dict[int, _Track] = {}
        self._retained = 0
        #: counters of segments the layout shows or that are tracked (pruned on each settle)
        self._stats: dict[int, SegmentStats] = {}
        follower.holds = self._tracks.__contains__  # a settle needs the seal, even if GC ran

    @property
    def stats(self) -> dict[int, SegmentStats]:
        """A snapshot of the per-segment counters, by segment id.

        A segment's counters go once GC pruned it from the layout and the producer
        has nothing left to settle there (checked whenever a segment is settled).
        """
        return {sid: dataclasses.replace(s) for sid, s in self._stats.items()}

    @property
    def pending_seals(self) -> frozenset[int]:
        """Sealed segments this producer sent to and has not settled yet (re-sends pending)."""
        layout = self._follower.layout
        if layout is None:
            return frozenset(self._tracks)
        active = {s.segment_id for s in layout.active_segments()}
        return frozenset(sid for sid in self._tracks if sid not in active)

    @property
    def retained(self) -> int:
        """Messages remembered for a possible re-send."""
        return self._retained

    async def send(self, key: bytes | None, value: bytes) -> SendResult:
        """Send one message and wait for Kafka's acknowledgement.

        Messages of concurrent callers are ordered by who gets the gate first; a
        caller that awaits each send gets its order kept per key. Waits while a
        re-send is pending.

        Raises:
            TopicNotFound: the topic has no layout.
            SendFailed: Kafka did not acknowledge the message, or refused a pending
                re-send (the message was not sent; the re-sends stay pending).
        """
        async with self._gate:
            try:
                await self._settle()
            except KafkaError as exc:
                raise SendFailed(f"re-send before this message: {exc!r}") from exc
            layout = self._require_layout()
            sid = _route(layout, key)
            try:
                future = await self._enqueue(layout, sid, _Sent(key, value))
            except KafkaError as exc:
                raise SendFailed(f"segment {sid}: {exc!r}") from exc
            if self._retained >= self._trim_at:
                try:
                    await self._trim()
                except StoreError as exc:  # the message is on its way: never fail its send
                    log.warning("refclient.producer.trim_failed", error=str(exc))
                self._trim_at = self._retained + self._retain_limit
        try:
            metadata = await asyncio.shield(future)
        except KafkaError as exc:
            raise SendFailed(f"segment {sid}: {exc!r}") from exc
        return SendResult(sid, int(metadata.offset))

    async def flush(self) -> None:
        """Wait until nothing sent so far can still need a re-send.

        Afterwards every message is acknowledged below its segment's seal, or in a
        segment still active after the acknowledgement, so closing loses nothing.
        A re-send Kafka refuses is retried on the Kafka backoff meanwhile.

        Raises:
            TopicNotFound: the topic was deleted meanwhile.
            StoreError: etcd did not answer.
        """
        async with self._gate:
            while self._tracks:
                await self._signal.wait_for(
                    lambda: all(t.inflight == 0 for t in self._tracks.values())
                )
                revision = await self._trim()
                await self._settle_retrying()
                if self._tracks:
                    await self._signal.wait_for(functools.partial(self._caught_up, revision))

    def _require_layout(self) -> Layout:
        layout = self._follower.layout
        if layout is None:
            raise TopicNotFound(self._topic.path)
        return layout

    def _first_sealed(self, layout: Layout) -> int | None:
        active = {s.segment_id for s in layout.active_segments()}
        return min((sid for sid in self._tracks if sid not in active), default=None)

    def _needs_settle(self) -> bool:
        layout = self._follower.layout
        return layout is not None and self._first_sealed(layout) is not None

    def _caught_up(self, revision: int) -> bool:
        return self._follower.revision >= revision

    def _seal_known(self, sid: int) -> bool:
        """True once ``sid``'s sends are all answered and its seal known (or the topic gone)."""
        if self._follower.layout is None:
            return True
        return self._tracks[sid].inflight == 0 and sid in self._follower.seals

    async def _enqueue(self, layout: Layout, sid: int, entry: _Sent) -> asyncio.Future[Any]:
        """Hand one message to aiokafka (in call order) and track it under ``sid``."""
        name = segment_topic(self._topic, layout.segments[sid].descriptor)
        future: asyncio.Future[Any] = await self._kafka.send(
            name, entry.value, key=entry.key, partition=0
        )
        track = self._tracks.get(sid)
        if track is None:
            track = self._tracks[sid] = _Track()
        track.entries.append(entry)
        track.inflight += 1
        self._retained += 1
        future.add_done_callback(functools.partial(self._on_done, sid, track, entry))
        return future

    def _on_done(self, sid: int, track: _Track, entry: _Sent, future: asyncio.Future[Any]) -> None:
        track.inflight -= 1
        entry.done = True
        stats = self._stats.setdefault(sid, SegmentStats())
        if future.cancelled() or future.exception() is not None:
            stats.failed += 1
            error = "cancelled" if future.cancelled() else repr(future.exception())
            log.warning("refclient.send.failed", topic=self._topic.path, segment=sid, error=error)
        else:
            entry.offset = int(future.result().offset)
            stats.messages += 1
            stats.bytes += len(entry.value) + len(entry.key or b"")
        self._signal.notify()

    async def _settle(self) -> None:
        """Re-send what landed beyond the seal of every sealed segment we sent to.

        Caller holds the gate. Waits for the segment's sends to be acknowledged
        and for its seal key. All re-sends of one segment are routed by one layout,
        the newest when they begin: one taken per message could send a key's later
        message straight to a grandchild while an earlier one went to a child sealed
        meanwhile, and that one would be re-sent after it. A target sealed meanwhile
        is settled in a later round, in order.

        A message leaves the segment's track only once Kafka took its re-send, and
        the track goes only after the last one, so nothing is lost if Kafka refuses
        one: the rest stay pending, for the next call, by the same layout.

        Raises:
            TopicNotFound: the topic was deleted.
            KafkaError: aiokafka refused a re-send (its ``send`` raised).
        """
        while True:
            sid = self._first_sealed(self._require_layout())
            if sid is None:
                return
            await self._signal.wait_for(functools.partial(self._seal_known, sid))
            track = self._tracks[sid]
            end = self._follower.seals.get(sid)
            if end is None:
                raise TopicNotFound(self._topic.path)
            if track.route_by is None:
                track.route_by = self._require_layout()
            layout = track.route_by
            resent = 0
            while track.entries:
                entry = track.entries[0]
                if entry.offset is not None and entry.offset >= end:
                    await self._enqueue(
                        layout, _route(layout, entry.key), _Sent(entry.key, entry.value)
                    )
                    resent += 1
                    self._stats.setdefault(sid, SegmentStats()).resent += 1
                track.entries.popleft()
                self._retained -= 1
            del self._tracks[sid]
            self._untrack()
            self._forget_gone()
            log.info(
                "refclient.producer.settled",
                topic=self._topic.path,
                segment=sid,
                end_offset=end,
                resent=resent,
            )

    async def _settle_retrying(self) -> None:
        """:meth:`_settle`, retried on the Kafka backoff while Kafka refuses re-sends.

        Caller holds the gate: new sends wait rather than overtake the re-sends.

        Raises:
            TopicNotFound: the topic was deleted.
        """
        attempt = 0
        while True:
            try:
                await self._settle()
                return
            except KafkaError as exc:
                delay = backoff.KAFKA.delay(attempt)
                attempt += 1
                log.warning(
                    "refclient.producer.resend_failed",
                    topic=self._topic.path,
                    segments=sorted(self.pending_seals),
                    attempt=attempt,
                    delay=round(delay, 3),
                    error=repr(exc),
                )
                await anyio.sleep(delay)

    def _untrack(self) -> None:
        """Let aiokafka name only the segments we may still send to in its metadata refreshes.

        It names every topic it ever sent to in each refresh, and Kafka (tansu)
        re-creates a named topic: a sealed segment GC deleted would come back. The
        active segments stay named, and so does every segment still tracked (a
        sealed one not settled yet, e.g. the other parent of a merge): a topic left
        out has no leader in aiokafka's metadata, and its queued batches would sit
        until they expire.
        """
        layout = self._follower.layout
        if layout is not None:
            named = {segment_topic(self._topic, s.descriptor) for s in layout.active_segments()}
            named.update(
                segment_topic(self._topic, layout.segments[sid].descriptor)
                for sid in self._tracks
                if sid in layout.segments
            )
            self._kafka.client.set_topics(sorted(named))

    def _forget_gone(self) -> None:
        """Drop the counters and seals of segments neither the layout shows nor we track.

        Such a segment is gone for good (segment ids never repeat), so what is
        kept stays bounded by the layout however long the producer runs.
        """
        self._follower.drop_unneeded_seals()
        layout = self._follower.layout
        if layout is None:  # the topic is gone: nothing to tell a live segment by
            return
        for sid in [s for s in self._stats if s not in layout.segments and s not in self._tracks]:
            del self._stats[sid]

    async def _trim(self) -> int:
        """Forget acknowledged messages of segments etcd still shows active; caller holds the gate.

        A message acknowledged before a read that finds no intent naming its
        segment, followed by a read that still shows the segment active, lies
        below any seal after them. Returns the revision the watch must reach
        before another try can forget more: the layout's, or past the intent's.
        """
        marks: dict[int, int] = {}
        for sid, track in self._tracks.items():
            count = 0
            for entry in track.entries:
                if not entry.done:
                    break
                count += 1
            marks[sid] = count
        sealing, intent_revision = await _fresh_sealing(self._store, self._follower.sealing_key)
        kv = await self._store.get(self._follower.root)
        if kv is None:
            raise TopicNotFound(self._topic.path)
        try:
            fresh = _parse_layout(self._topic, kv.value)
        except _UNUSABLE_LAYOUT:
            return kv.mod_revision
        active = {s.segment_id for s in fresh.active_segments()}
        for sid, count in marks.items():
            kept = self._tracks.get(sid)
            if kept is None or sid not in active or _sealing_names(sealing, sid):
                continue
            for _ in range(count):
                kept.entries.popleft()
            self._retained -= count
            if not kept.entries and kept.inflight == 0:
                del self._tracks[sid]
        return max(kv.mod_revision, intent_revision + 1 if sealing else 0)

    async def _run_sealer(self) -> None:
        """Settle sealed segments as soon as the layout shows them, even if nobody sends.

        A re-send Kafka refuses is logged and retried on the Kafka backoff: the
        sealer never dies of it (it would take the producer down).
        """
        while True:
            await self._signal.wait_for(self._needs_settle)
            async with self._gate:
                try:
                    await self._settle_retrying()
                except TopicNotFound:
                    log.warning("refclient.producer.topic_gone", topic=self._topic.path)


@asynccontextmanager
async def open_producer(
    store: Store,
    keys: Keys,
    bootstrap: str,
    topic: TopicName,
    *,
    acks: int | str = "all",
    retain_limit: int = 10_000,
    close_timeout: float = CLOSE_TIMEOUT,
) -> AsyncIterator[Producer]:
    """A producer for ``topic``; a clean exit flushes for up to ``close_timeout`` seconds.

    Args:
        acks: Kafka acks, 1 or "all".
        retain_limit: remembered messages beyond which the producer asks etcd which
            it may forget (see the module docstring).

    Raises:
        TopicNotFound: the topic has no layout when opening.
        ValueError: a topic name part is not Kafka-safe.
    """
    for part in (topic.tenant, topic.namespace, topic.topic):
        check_name_part(part)
    signal = _Signal()
    follower = _TopicFollower(store, keys, topic, signal, None)
    await follower.load()
    if follower.layout is None:
        raise TopicNotFound(topic.path)
    kafka = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        client_id="controllerd-refclient",
        acks=acks,
        enable_idempotence=False,  # tansu lacks it; order comes from one batch in flight
        linger_ms=0,
    )
    await kafka.start()
    try:
        producer = Producer(store, topic, follower, signal, kafka, retain_limit)
        async with anyio.create_task_group() as tg:
            tg.start_soon(follower.run, name="refclient-watch")
            tg.start_soon(producer._run_sealer, name="refclient-sealer")
            yield producer
            with anyio.move_on_after(close_timeout, shield=True):
                try:
                    await producer.flush()
                except TopicNotFound:
                    log.warning("refclient.producer.topic_gone", topic=topic.path)
            if producer.retained:
                log.warning(
                    "refclient.producer.unsettled", topic=topic.path, messages=producer.retained
                )
            tg.cancel_scope.cancel()
    finally:
        await _stop_quietly(kafka)


# --- consumer -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Message:
    """One delivered message and where it was read from."""

    segment_id: int
    offset: int
    key: bytes | None
    value: bytes


def readable_segments(
    layout: Layout, seals: Mapping[int, int], committed: Mapping[int, int]
) -> list[int]:
    """Segments a subscription may read now, by id (docs/reference-broker.md).

    A sealed segment is finished once its seal is known and ``committed`` (missing
    = 0) reaches it; finished segments are not readable. Any other segment is
    readable once every parent still in the layout is finished.
    """

    def finished(sid: int) -> bool:
        end = seals.get(sid)
        return not layout.segments[sid].active and end is not None and committed.get(sid, 0) >= end

    return [
        sid
        for sid in sorted(layout.segments)
        if not finished(sid)
        and all(finished(p) for p in layout.segments[sid].parent_ids if p in layout.segments)
    ]


def deal(segments: Sequence[int], consumers: Iterable[str]) -> dict[str, list[int]]:
    """Deal segments (sorted by id) round-robin over consumer names (sorted)."""
    names = sorted(consumers)
    dealt: dict[str, list[int]] = {name: [] for name in names}
    if names:
        for i, sid in enumerate(sorted(segments)):
            dealt[names[i % len(names)]].append(sid)
    return dealt


@dataclass(slots=True)
class _Reading:
    """An owned segment. Invariant: ``committed <= processed <= position``."""

    tp: Any  # aiokafka TopicPartition
    position: int  # next offset to deliver
    processed: int  # offset after the last processed message
    committed: int  # what the group holds, as far as we know


class Consumer:
    """A named member of a STREAM subscription. Create with :func:`open_consumer`."""

    def __init__(
        self,
        *,
        store: Store,
        topic: TopicName,
        name: str,
        registration_key: str,
        host: str,
        lease_id: int,
        follower: _TopicFollower,
        signal: _Signal,
        kafka: Any,
        auto_commit: bool,
        max_records: int,
        poll_interval: float,
    ) -> None:
        self._store = store
        self._topic = topic
        self.name = name
        self._key = registration_key
        self._host = host
        self._lease_id = lease_id
        self._follower = follower
        self._signal = signal
        self._kafka = kafka
        self._auto_commit = auto_commit
        self._max_records = max_records
        self._poll_interval = poll_interval
        self._owned: dict[int, _Reading] = {}
        self._by_topic: dict[str, int] = {}
        #: the group's commit per segment, as far as we know; only segments the layout shows
        #: (pruned by each reconcile), the only ones whose finish anything asks about
        self._committed: dict[int, int] = {}
        self._claims: frozenset[int] = frozenset()
        self._assigned: frozenset[int] = frozenset()
        self._paused: frozenset[int] = frozenset()
        self._batch: deque[Message] = deque()
        self._current: Message | None = None
        self._seen = -1
        self._lock = anyio.Lock()  # Kafka assignment, seeks and commits
        self._iterating = False
        self.lost = False

    @property
    def assignment(self) -> frozenset[int]:
        """Segments this consumer owns (claimed and reading, or finished and not yet released)."""
        return frozenset(self._owned)

    def messages(self) -> AsyncIterator[Message]:
        """Messages of the owned segments, per segment in offset order; never ends.

        Iterate from one task at a time. Resuming the iteration marks the previous
        message processed.

        Raises (from ``__anext__``):
            TopicNotFound: the topic's layout was deleted.
            ConsumerLost: the lease is gone.
            StoreError: etcd did not answer (retried for the store's ``retry_for``).
            RefClientError: a commit failed.
            RuntimeError: another iteration is in progress.
        """
        return _Messages(self)

    async def commit(self) -> None:
        """Commit every message delivered so far (including the current one)."""
        async with self._lock:
            await self._commit({sid: r.position for sid, r in self._owned.items()})

    # -- delivery --------------------------------------------------------------------------

    async def _next_message(self) -> Message:
        if self._iterating:
            raise RuntimeError("messages() is already being iterated")
        self._iterating = True
        try:
            return await self._next()
        finally:
            self._iterating = False

    async def _next(self) -> Message:
        if self.lost:
            raise ConsumerLost(self.name)
        current, self._current = self._current, None
        if current is not None:
            reading = self._owned.get(current.segment_id)
            if reading is not None:
                reading.processed = max(reading.processed, current.offset + 1)
        while True:
            if self._batch and self._signal.version != self._seen:
                self._seen = self._signal.version
                if self._desired() != frozenset(self._owned):
                    await self._drop_batch()
            if self._batch:
                message = self._batch.popleft()
                self._owned[message.segment_id].position = message.offset + 1
                self._current = message
                return message
            await self._end_batch()
            self._batch = await self._fill()

    async def _drop_batch(self) -> None:
        """Forget undelivered records so a reassignment can happen now; Kafka re-fetches them."""
        async with self._lock:
            for sid in {m.segment_id for m in self._batch}:
                reading = self._owned.get(sid)
                if reading is not None and sid in self._assigned:
                    self._kafka.seek(reading.tp, reading.position)
            self._batch.clear()

    async def _end_batch(self) -> None:
        """Every delivered message is processed: commit (auto-commit, or segments at their end)."""
        layout = self._layout()
        offsets: dict[int, int] = {}
        for sid, reading in self._owned.items():
            end = self._end_of(layout, sid)
            if self._auto_commit or (end is not None and reading.processed >= end):
                offsets[sid] = reading.processed
        async with self._lock:
            await self._commit(offsets)

    async def _fill(self) -> deque[Message]:
        """Reconcile the assignment, then wait for records that may be delivered."""
        while True:
            async with self._lock:
                await self._reconcile()
            version = self._seen = self._signal.version
            fetchable = [self._owned[s].tp for s in sorted(frozenset(self._owned) - self._paused)]
            if not fetchable:
                await self._signal.wait_beyond(version)
                continue
            records = await self._fetch_or_change(fetchable, version)
            if records:
                try:
                    messages = await self._admit(records)
                except BaseException:  # incl. cancellation: Kafka must not skip these records
                    self._rewind(records)
                    raise
                if messages:
                    return deque(messages)

    def _rewind(self, records: dict[Any, list[Any]]) -> None:
        """Move Kafka back to our position on the partitions of undelivered records."""
        for tp in records:
            sid = self._by_topic.get(tp.topic)
            if sid is not None and sid in self._assigned:
                self._kafka.seek(tp, self._owned[sid].position)

    async def _fetch_or_change(self, tps: list[Any], version: int) -> dict[Any, list[Any]] | None:
        """Records of ``tps``, or None as soon as the view changes (the fetch is abandoned)."""
        result: dict[Any, list[Any]] | None = None
        async with anyio.create_task_group() as tg:

            async def fetch() -> None:
                nonlocal result
                result = await self._kafka.getmany(
                    *tps, timeout_ms=_FETCH_WAIT_MS, max_records=self._max_records
                )
                tg.cancel_scope.cancel()

            async def changed() -> None:
                await self._signal.wait_beyond(version)
                tg.cancel_scope.cancel()

            tg.start_soon(fetch)
            tg.start_soon(changed)
        return result

    async def _admit(self, records: dict[Any, list[Any]]) -> list[Message]:
        """The fetched records that may be delivered, in offset order per segment.

        Records at or beyond a seal are dropped. Records of a segment our layout
        shows active are kept only if a linearizable read finds no ``sealing``
        intent naming it and a later one still shows it active. The records of a
        segment whose end is not known (sealed or being sealed since the fetch)
        are given back: their partition is rewound, and the segment is read again
        once the watch has caught up (it stays paused while an intent names it).
        """
        layout = self._layout()
        by_segment: dict[int, list[Any]] = {}
        unknown_end: list[int] = []
        for tp, batch in records.items():
            sid = self._by_topic.get(tp.topic)
            if sid is None or not batch:
                continue
            seg = layout.segments.get(sid)
            end = self._end_of(layout, sid)
            if seg is not None and not seg.active and end is None:
                unknown_end.append(sid)
                continue
            position = self._owned[sid].position
            kept = [r for r in batch if r.offset >= position and (end is None or r.offset < end)]
            if kept and seg is not None:
                by_segment[sid] = kept
        wait_beyond: int | None = None
        unfenced = [sid for sid in by_segment if layout.segments[sid].active]
        if unfenced:
            sealing, intent_revision = await _fresh_sealing(self._store, self._follower.sealing_key)
            held = [sid for sid in unfenced if _sealing_names(sealing, sid)]
            if held:
                unknown_end += held
                unfenced = [sid for sid in unfenced if sid not in held]
                wait_beyond = intent_revision - 1  # until the watch shows the intent
        if unfenced:
            kv = await self._store.get(self._follower.root)
            if kv is None:
                raise TopicNotFound(self._topic.path)
            try:
                fresh = _parse_layout(self._topic, kv.value)
            except _UNUSABLE_LAYOUT:
                unknown_end += unfenced
                revision = kv.mod_revision  # wait for a newer, valid layout
                wait_beyond = revision if wait_beyond is None else max(wait_beyond, revision)
            else:
                stale = [
                    sid
                    for sid in unfenced
                    if sid not in fresh.segments or not fresh.segments[sid].active
                ]
                if stale:
                    unknown_end += stale
                    revision = kv.mod_revision - 1  # until the watch shows this layout
                    wait_beyond = revision if wait_beyond is None else max(wait_beyond, revision)
        if unknown_end:
            async with self._lock:
                for sid in unknown_end:
                    by_segment.pop(sid, None)
                    self._kafka.seek(self._owned[sid].tp, self._owned[sid].position)
            log.info("refclient.consumer.end_unknown", consumer=self.name, segments=unknown_end)
        if wait_beyond is not None:
            revision = wait_beyond
            await self._signal.wait_for(lambda: self._follower.revision > revision)
        return [
            Message(sid, r.offset, r.key, r.value)
            for sid in sorted(by_segment)
            for r in by_segment[sid]
        ]

    # -- assignment ------------------------------------------------------------------------

    def _layout(self) -> Layout:
        layout = self._follower.layout
        if layout is None:
            raise TopicNotFound(self._topic.path)
        return layout

    def _end_of(self, layout: Layout, sid: int) -> int | None:
        """The seal end offset of a sealed segment, None if active or not known yet."""
        seg = layout.segments.get(sid)
        if seg is None or seg.active:
            return None
        return self._follower.seals.get(sid)

    def _desired(self) -> frozenset[int]:
        layout = self._layout()
        readable = readable_segments(layout, self._follower.seals, self._committed)
        return frozenset(deal(readable, self._follower.consumers).get(self.name, []))

    async def _reconcile(self) -> None:
        """Release, finish and claim segments until the assignment is stable; holds the lock."""
        changed = True
        while changed:
            changed = await self._finish()
            desired = self._desired()
            release = [sid for sid in self._owned if sid not in desired]
            if release:
                await self._commit({sid: self._owned[sid].processed for sid in release})
                for sid in release:
                    del self._by_topic[self._owned.pop(sid).tp.topic]
            others: set[int] = set()
            for other, claims in self._follower.consumers.items():
                if other != self.name:
                    others |= claims
            claimable = desired - frozenset(self._owned) - others
            want = frozenset(self._owned) | claimable
            if want != self._claims:
                await self._publish(want)
            if claimable:
                changed |= await self._acquire(claimable)
            self._apply_assignment()
        # Released above if owned: a segment GC pruned never comes back (ids never repeat).
        shown = self._layout().segments
        for sid in [s for s in self._committed if s not in shown]:
            del self._committed[sid]

    async def _finish(self) -> bool:
        """Commit owned sealed segments processed up to their end; True if any was."""
        layout = self._layout()
        offsets = {}
        for sid, reading in self._owned.items():
            end = self._end_of(layout, sid)
            if end is not None and reading.processed >= end and reading.committed < end:
                offsets[sid] = end
        await self._commit(offsets)
        return bool(offsets)

    async def _acquire(self, claimable: frozenset[int]) -> bool:
        """Start reading claimed segments nobody else claims; True if one was already finished."""
        assert self._follower.consumers_prefix is not None
        kvs, _ = await self._store.get_prefix(self._follower.consumers_prefix)
        taken: set[int] = set()
        for kv in kvs:
            if kv.key != self._key:
                taken |= _parse_claims(kv.value)
        conflicts = claimable & taken
        if conflicts:
            log.info("refclient.consumer.claim_conflict", consumer=self.name, segments=conflicts)
            await self._publish(self._claims - conflicts)
        layout = self._layout()
        finished = False
        for sid in sorted(claimable - conflicts):
            name = segment_topic(self._topic, layout.segments[sid].descriptor)
            tp = TopicPartition(name, 0)
            committed = await self._kafka.committed(tp) or 0
            self._owned[sid] = _Reading(tp, committed, committed, committed)
            self._by_topic[name] = sid
            self._committed[sid] = max(self._committed.get(sid, 0), committed)
            end = self._end_of(layout, sid)
            finished |= end is not None and committed >= end
            log.info(
                "refclient.consumer.acquired", consumer=self.name, segment=sid, offset=committed
            )
        return finished

    def _apply_assignment(self) -> None:
        """Make Kafka's assignment and pauses match what we own; seek what was (re)assigned."""
        layout = self._layout()
        owned = frozenset(self._owned)
        if owned != self._assigned:
            if owned:
                self._kafka.assign([self._owned[sid].tp for sid in sorted(owned)])
                for reading in self._owned.values():
                    self._kafka.seek(reading.tp, reading.position)
            else:
                self._kafka.unsubscribe()
            self._assigned, self._paused = owned, frozenset()
        paused = frozenset(sid for sid in owned if not self._fetchable(layout, sid))
        if paused != self._paused:
            if paused - self._paused:
                self._kafka.pause(*(self._owned[s].tp for s in paused - self._paused))
            if self._paused - paused:
                self._kafka.resume(*(self._owned[s].tp for s in self._paused - paused))
            self._paused = paused

    def _fetchable(self, layout: Layout, sid: int) -> bool:
        seg = layout.segments.get(sid)
        if seg is None:
            return False
        if seg.active:
            return not self._follower.is_sealing(sid)
        end = self._follower.seals.get(sid)
        return end is not None and self._owned[sid].position < end

    async def _publish(self, claims: frozenset[int]) -> None:
        value = json.dumps({"host": self._host, "segments": sorted(claims)}).encode()
        try:
            await self._store.put(self._key, value, lease=self._lease_id)
        except LeaseNotFound as exc:
            self.lost = True
            raise ConsumerLost(f"{self.name}: lease gone") from exc
        self._claims = claims

    async def _commit(self, offsets: Mapping[int, int]) -> None:
        """Commit ``offsets`` (segment id -> next offset) that move forward; holds the lock.

        Only partitions assigned in Kafka can be committed; an owned segment not
        assigned yet (a reconcile was interrupted) has nothing processed anyway.
        """
        todo = {
            sid: offset
            for sid, offset in offsets.items()
            if sid in self._assigned and sid in self._owned and offset > self._owned[sid].committed
        }
        if not todo:
            return
        try:
            await self._kafka.commit(
                {self._owned[sid].tp: OffsetAndMetadata(offset, "") for sid, offset in todo.items()}
            )
        except KafkaError as exc:
            raise RefClientError(f"commit failed: {exc!r}") from exc
        for sid, offset in todo.items():
            self._owned[sid].committed = offset
            self._committed[sid] = max(self._committed.get(sid, 0), offset)
        self._signal.notify()

    async def _close(self) -> None:
        """Commit what was processed (auto-commit) or finished, unless the lease is lost."""
        if self.lost:
            return
        offsets = {}
        layout = self._follower.layout
        for sid, reading in self._owned.items():
            end = self._end_of(layout, sid) if layout is not None else None
            if self._auto_commit or (end is not None and reading.processed >= end):
                offsets[sid] = reading.processed
        async with self._lock:
            await self._commit(offsets)

    # -- background tasks ------------------------------------------------------------------

    def _poll_targets(self) -> list[int]:
        """Sealed parents owned by others whose finish would make a child readable."""
        layout = self._follower.layout
        if layout is None:
            return []
        targets = []
        for sid, seg in layout.segments.items():
            end = self._follower.seals.get(sid)
            if (
                not seg.active
                and end is not None
                and sid not in self._owned
                and self._committed.get(sid, 0) < end
                and any(c in layout.segments for c in seg.child_ids)
            ):
                targets.append(sid)
        return sorted(targets)

    async def _poll_offsets(self) -> None:
        """Learn other consumers' commits on sealed parents (Kafka cannot notify us of them)."""
        while True:
            await self._signal.wait_for(lambda: bool(self._poll_targets()))
            layout = self._follower.layout
            changed = False
            for sid in self._poll_targets():
                if layout is None or sid not in layout.segments:
                    continue
                tp = TopicPartition(segment_topic(self._topic, layout.segments[sid].descriptor), 0)
                try:
                    committed = await self._kafka.committed(tp)
                except KafkaError as exc:
                    log.warning("refclient.consumer.poll_failed", segment=sid, error=repr(exc))
                    continue
                if committed is not None and committed > self._committed.get(sid, 0):
                    self._committed[sid] = committed
                    changed = True
            if changed:
                self._signal.notify()
            await anyio.sleep(self._poll_interval)

    async def _keep_alive(self, ttl: int, granted_at: float) -> None:
        """Renew the lease; stop everything (ConsumerLost) before etcd could expire it."""
        interval = max(ttl / 3, 0.1)
        valid_until = granted_at + ttl
        next_at = granted_at + interval
        while True:
            await anyio.sleep_until(next_at)
            sent = anyio.current_time()
            if sent >= valid_until:
                break
            try:
                remaining = await self._store.keepalive_once(
                    self._lease_id, timeout=min(interval, valid_until - sent)
                )
            except LeaseNotFound:
                break
            except StoreError as exc:
                log.warning(
                    "refclient.consumer.keepalive_failed", consumer=self.name, error=str(exc)
                )
                next_at = anyio.current_time() + _KEEPALIVE_RETRY
                continue
            if remaining <= 0:
                break
            valid_until = sent + remaining
            next_at = sent + interval
        self.lost = True
        raise ConsumerLost(f"{self.name}: lease {self._lease_id} expired")


class _Messages:
    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer

    def __aiter__(self) -> _Messages:
        return self

    async def __anext__(self) -> Message:
        return await self._consumer._next_message()


@asynccontextmanager
async def open_consumer(
    store: Store,
    keys: Keys,
    bootstrap: str,
    topic: TopicName,
    subscription: str,
    name: str,
    *,
    lease_ttl: int = 5,
    auto_commit: bool = True,
    max_records: int = 500,
    poll_interval: float = 0.5,
    host: str | None = None,
) -> AsyncIterator[Consumer]:
    """Join ``subscription`` as consumer ``name``; leave (commit, revoke the lease) on exit.

    Args:
        lease_ttl: seconds the registration outlives a silent consumer.
        auto_commit: commit processed offsets at the end of every fetched batch.
        max_records: most records fetched (and held undelivered) at once.
        poll_interval: seconds between reads of other consumers' commits on sealed
            parents, while a child waits for them.
        host: registration's ``host`` field; the machine's host name by default.

    Raises:
        TopicNotFound: the topic has no layout when opening.
        ValueError: a name is not Kafka-safe.
    """
    for part in (topic.tenant, topic.namespace, topic.topic, subscription, name):
        check_name_part(part)
    signal = _Signal()
    follower = _TopicFollower(store, keys, topic, signal, subscription)
    registration_key = keys.consumer(topic, subscription, name)
    host = host if host is not None else socket.gethostname()
    granted_at = anyio.current_time()
    lease_id, ttl = await store.grant_lease(lease_ttl)
    try:
        registration = json.dumps({"host": host, "segments": []}).encode()
        await store.put(registration_key, registration, lease=lease_id)
        await follower.load()
        if follower.layout is None:
            raise TopicNotFound(topic.path)
        kafka = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            client_id=f"controllerd-refclient-{name}",
            group_id=subscription_group(topic, subscription),
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=_FETCH_MAX_WAIT_MS,
        )
        await kafka.start()
        try:
            consumer = Consumer(
                store=store,
                topic=topic,
                name=name,
                registration_key=registration_key,
                host=host,
                lease_id=lease_id,
                follower=follower,
                signal=signal,
                kafka=kafka,
                auto_commit=auto_commit,
                max_records=max_records,
                poll_interval=poll_interval,
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(follower.run, name="refclient-watch")
                tg.start_soon(consumer._keep_alive, ttl, granted_at, name="refclient-keepalive")
                tg.start_soon(consumer._poll_offsets, name="refclient-offsets")
                try:
                    yield consumer
                finally:
                    with anyio.move_on_after(CLOSE_TIMEOUT, shield=True):
                        await consumer._close()
                    tg.cancel_scope.cancel()
        finally:
            await _stop_quietly(kafka)
    finally:
        with anyio.move_on_after(_STOP_TIMEOUT, shield=True):
            await store.revoke_lease(lease_id)
