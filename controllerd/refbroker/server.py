"""The reference broker's admin REST API (DESIGN §5) over etcd and Kafka.

Layouts, subscriptions and seal offsets live in etcd at the PIP-468 paths;
segment data lives in Kafka (``docs/reference-broker.md``).

Security:

* With a bearer token configured (``--token-file``) every admin request needs
  ``Authorization: Bearer <token>``: 401 without one, 403 with another
  (compared in constant time).
* With fencing on (a leader key configured, the default) a split, merge or
  segment deletion without ``X-Fencing-Token`` is refused (428
  ``fencing-required``). ``X-Fencing-Key`` names the etcd key the token is the
  create revision of: the leader key (the default when absent) or, in sharded
  mode, ``<controller_root>/shards/<shard>`` of *this topic's* shard; any other
  key is 400 ``bad-fencing-key``. The compare of that key's create revision
  against the token is part of the same etcd transaction as the layout write,
  so a deposed controller can never change a layout (409 ``fenced``).

Sealing is atomic: the layout that seals segments and every sealed segment's
``seal`` key are one transaction. Their end offsets are read before it, after
a ``sealing`` intent (on a short lease) has told clients to treat the
segments as possibly sealed; see :meth:`RefBroker._seal_and_write`.

Stored values may be garbage (the metadata prefix is shared): a layout or seal
that is not strict JSON (orjson), or a layout this broker could not name in
Kafka or write back, is answered 500 with a reason naming it, never with a
traceback. A ``sealing`` intent no broker wrote (no lease, or not
``{"segments": [ids]}``) is deleted, not waited for (:meth:`RefBroker._live_intent`).
A subscription whose name Kafka cannot carry (Pulsar allows dots) has no cursor:
its backlog is unknown (404) and it drains nothing (:meth:`RefBroker.delete_segment`).

Kafka or etcd failing (down, paused, unreachable) is answered 503 with a JSON
reason, within the backend's request timeout.

Extensions over Pulsar: k-way splits with ``?boundaries=b1,b2,...`` and a
DELETE of a segment that refuses (409 ``backlog``) while any subscription still
has backlog on it.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

import anyio
import orjson
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from controllerd.adapters import backoff
from controllerd.adapters.store import Compare, Delete, Put, Store, StoreError
from controllerd.core import layout as layout_ops
from controllerd.core.model import (
    Layout,
    ModelError,
    Segment,
    TopicName,
    layout_from_json,
    layout_to_json,
)
from controllerd.core.shards import DEFAULT_SHARDS, shard_name, shard_of
from controllerd.core.view import Keys, parse_json
from controllerd.daemon.clock import Clock
from controllerd.refbroker.kafka import KafkaBackend, KafkaBackendError
from controllerd.refbroker.naming import (
    seal_key,
    sealing_key,
    segment_topic,
    segment_topic_prefix,
    subscription_group,
)

log = structlog.get_logger("controllerd.refbroker")

#: ASCII digits only: ``\d`` took "٣" as a segment id that no segment topic can have.
_DESCRIPTOR = re.compile(r"([0-9a-f]{4})-([0-9a-f]{4})-([0-9]+)")
#: Layout writes that lose a race with another writer are retried this often.
CAS_ATTEMPTS = 5
#: Seconds a ``sealing`` intent outlives a broker that died between reading the
#: end offsets and writing the seal; clients hold back those segments meanwhile.
SEALING_TTL = 30
FENCING_TOKEN_HEADER = "x-fencing-token"
FENCING_KEY_HEADER = "x-fencing-key"
#: Characters of a parse error a 500's reason keeps (a garbage value may be megabytes).
_REASON_CHARS: Final = 300
#: What reading a stored value raises on garbage: ValueError (orjson's JSONDecodeError,
#: ModelError, a name Kafka cannot have), RecursionError (the core's error message shows
#: the value, and orjson lets one nest 1024 deep, past Python's repr) and
#: orjson.JSONEncodeError (a TypeError: nested too deep to write back).
_UNUSABLE: Final = (ValueError, RecursionError, orjson.JSONEncodeError)


class Refused(Exception):
    """An admin request the broker answers with ``status`` and a Pulsar-style body."""

    def __init__(
        self,
        status: int,
        reason: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(reason)
        self.status, self.reason, self.code = status, reason, code
        self.headers = headers

    def response(self) -> Response:
        body: dict[str, Any] = {"reason": self.reason}
        if self.code:
            body["code"] = self.code
        return JSONResponse(body, status_code=self.status, headers=self.headers)


_LAYOUT_ERRORS = {
    "not-found": 404,
    "not-active": 412,
    "not-adjacent": 412,
    "bad-boundaries": 400,
    "parent-present": 412,
    "invalid": 412,
}


@dataclass(frozen=True, slots=True)
class Fence:
    """A fencing claim: ``token`` must be the create revision of etcd key ``key``."""

    key: str
    token: int

    def compare(self) -> Compare:
        return Compare.create_revision(self.key, self.token)


@dataclass
class RefBroker:
    """The admin operations; the HTTP layer is :func:`make_app`.

    ``leader_key`` None turns fencing off (tests of the unfenced protocol only).
    ``shards`` is ``[election] shards``: the shard of a topic decides which shard
    key may fence its mutations.
    """

    store: Store
    keys: Keys
    kafka: KafkaBackend
    clock: Clock
    leader_key: str | None = None
    shards: int = DEFAULT_SHARDS

    # -- helpers -------------------------------------------------------------------------

    async def read_layout(self, topic: TopicName) -> tuple[Layout, int]:
        """The stored layout and its mod revision.

        Invariant: a layout returned can be written back and rendered
        (:func:`_layout_bytes`) and every segment of it named in Kafka.

        Raises:
            Refused: 404 without a layout, 500 (with the reason) for an unusable one.
        """
        kv = await self.store.get(self.keys.layout(topic))
        if kv is None:
            raise Refused(404, f"topic {topic} does not exist")
        try:
            layout = layout_from_json(parse_json(kv.value))
            _layout_bytes(layout)
        except _UNUSABLE as exc:
            raise _unusable(f"stored layout of {topic}", exc) from exc
        _segment_topics(topic, layout.segments.values())
        return layout, kv.mod_revision

    def shard_key(self, topic: TopicName) -> str:
        """The fencing key of ``topic``'s shard in sharded mode."""
        return f"{self.keys.controller_root}/shards/{shard_name(shard_of(topic, self.shards))}"

    def fence(self, topic: TopicName, token: int | None, key: str | None) -> Fence | None:
        """The fencing claim a mutation of ``topic`` must hold; None when fencing is off.

        Raises:
            Refused: 428 without a token, 400 for a key that cannot fence this topic.
        """
        if self.leader_key is None:
            return None
        if token is None:
            raise Refused(
                428,
                "fencing is on: send X-Fencing-Token (and X-Fencing-Key in sharded mode)",
                "fencing-required",
            )
        key = self.leader_key if key is None else key
        if key not in (self.leader_key, self.shard_key(topic)):
            raise Refused(
                400,
                f"X-Fencing-Key {key!r} is neither the leader key nor the key of {topic}'s shard",
                "bad-fencing-key",
            )
        return Fence(key, token)

    async def _check_fence(self, fence: Fence | None) -> None:
        """Refuse with 409 ``fenced`` unless ``fence`` still holds."""
        if fence is None:
            return
        kv = await self.store.get(fence.key)
        if kv is None or kv.create_revision != fence.token:
            current = kv.create_revision if kv is not None else None
            raise Refused(
                409,
                f"fencing token {fence.token} is not the current one of {fence.key} ({current})",
                "fenced",
            )

    async def _write_layout(
        self, topic: TopicName, change: Callable[[Layout], Layout], fence: Fence | None
    ) -> tuple[Layout, Layout]:
        """Read-modify-CAS a layout (sealing atomically); retried on races, refused when fenced."""
        for attempt in range(CAS_ATTEMPTS):
            old, revision = await self.read_layout(topic)
            try:
                new = layout_ops.check(change(old))
            except layout_ops.LayoutError as exc:
                raise Refused(_LAYOUT_ERRORS.get(exc.code, 412), str(exc), exc.code) from exc
            try:
                body = _layout_bytes(new)
            except orjson.JSONEncodeError as exc:  # e.g. an epoch at the end of 64 bits
                raise _unusable(f"new layout of {topic}", exc) from exc
            # A fenced caller creates no Kafka topic (it would be in no layout, for good);
            # the transactions' compares still decide a race with a new leader.
            await self._check_fence(fence)
            await self._create_children(topic, old, new)
            compares = [Compare.mod_revision(self.keys.layout(topic), revision)]
            if fence is not None:
                compares.append(fence.compare())
            sealed = sorted(
                sid
                for sid, seg in new.segments.items()
                if not seg.active
                and (before := old.segments.get(sid)) is not None
                and before.active
            )
            if await self._seal_and_write(topic, new, body, sealed, compares):
                return old, new
            if await self._stored(self.keys.layout(topic), body):
                return old, new  # applied by an attempt whose answer etcd lost (store retry)
            await self._check_fence(fence)
            if await self._live_intent(topic):
                await anyio.sleep(backoff.ETCD.delay(attempt))  # another seal is under way
        raise Refused(409, f"layout of {topic} kept changing; try again", "conflict")

    async def _live_intent(self, topic: TopicName) -> bool:
        """Whether another seal is under way: a ``sealing`` intent a broker wrote.

        A broker writes its intent on a lease (:data:`SEALING_TTL`), as
        ``{"segments": [ids]}``. One without a lease, or that does not parse so, no
        broker wrote: it never expires, and it held every split and merge of the
        topic back for good (409 ``conflict``), and its clients too, which read an
        unreadable intent as naming every segment. It is deleted, guarded by its mod
        revision so that a broker's intent written in its place stays, and logged.
        Deleting it is safe: a seal's end offsets are valid because of the sealing
        broker's *own* intent, which it writes before reading them.
        """
        key = sealing_key(self.keys, topic)
        kv = await self.store.get(key)
        if kv is None:
            return False
        if kv.lease != 0 and _intent_segments(kv.value) is not None:
            return True
        removed = await self.store.txn([Compare.mod_revision(key, kv.mod_revision)], [Delete(key)])
        if removed.succeeded:
            log.warning(
                "refbroker.sealing.stale_deleted",
                topic=str(topic),
                key=key,
                lease=kv.lease,
                value=kv.value[:_REASON_CHARS].decode(errors="replace"),
                why="no lease" if kv.lease == 0 else 'not {"segments": [ids]}',
            )
        return False

    async def _seal_and_write(
        self,
        topic: TopicName,
        new: Layout,
        body: bytes,
        sealed: list[int],
        compares: list[Compare],
    ) -> bool:
        """Write ``new`` (as ``body``) and the seal of every segment in ``sealed`` in one txn.

        1. A transaction guarded by ``compares`` puts the ``sealing`` intent on a
           lease of :data:`SEALING_TTL` seconds. From then on clients neither
           deliver records of those segments nor forget what they sent to them
           (``docs/reference-broker.md``), so any end offset read *after* it is a
           valid seal.
        2. The end offsets are read from Kafka.
        3. One transaction, guarded by ``compares`` and the intent still being
           ours, puts the layout and every seal key and deletes the intent.

        A failure anywhere leaves the layout unsealed and no seal key; the intent
        is revoked (or expires with its lease). False: a compare failed.
        """
        layout_put = Put(self.keys.layout(topic), body)
        if not sealed:
            return (await self.store.txn(compares, [layout_put])).succeeded
        intent = sealing_key(self.keys, topic)
        lease, _ = await self.store.grant_lease(SEALING_TTL)
        try:
            claimed = await self.store.txn(
                [*compares, Compare.absent(intent)],
                [Put(intent, json.dumps({"segments": sealed}).encode(), lease=lease)],
            )
            if not claimed.succeeded:
                return False
            ends = {
                sid: await self.kafka.end_offset(segment_topic(topic, new.segments[sid].descriptor))
                for sid in sealed
            }
            seals = [
                Put(seal_key(self.keys, topic, sid), json.dumps({"endOffset": end}).encode())
                for sid, end in ends.items()
            ]
            result = await self.store.txn(
                [*compares, Compare.create_revision(intent, claimed.revision)],
                [layout_put, *seals, Delete(intent)],
            )
            return result.succeeded
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self.store.revoke_lease(lease)
                except StoreError as exc:  # the lease expires by itself
                    log.warning("refbroker.sealing.revoke_failed", topic=str(topic), error=str(exc))

    async def _stored(self, key: str, value: bytes) -> bool:
        """Whether ``key`` holds exactly ``value``: a write whose compare failed may have
        been applied by an earlier attempt of the same transaction, whose answer etcd
        lost (the store retries; a layout we wrote carries our time stamp and ids)."""
        kv = await self.store.get(key)
        return kv is not None and kv.value == value

    async def _create_children(self, topic: TopicName, old: Layout, new: Layout) -> None:
        children = [s for sid, s in new.segments.items() if sid not in old.segments]
        await self.kafka.create_topics(_segment_topics(topic, children))

    async def seal_end(self, topic: TopicName, segment_id: int) -> int | None:
        """A sealed segment's ``endOffset``; None if it has no seal.

        Only an integer >= 0 is one, as for the client (``"12"`` or ``1.5`` is not).

        Raises:
            Refused: 500 (with the reason) for an unusable seal.
        """
        kv = await self.store.get(seal_key(self.keys, topic, segment_id))
        if kv is None:
            return None
        what = f"stored seal of {topic} segment {segment_id}"
        try:
            raw = parse_json(kv.value)
        except ValueError as exc:  # JSONDecodeError: never RecursionError
            raise _unusable(what, exc) from exc
        end = raw.get("endOffset") if isinstance(raw, dict) else None
        if not isinstance(end, int) or isinstance(end, bool) or end < 0:
            raise Refused(500, f"{what} is unusable: no endOffset that is an integer >= 0")
        return end

    # -- topics --------------------------------------------------------------------------

    async def list_topics(self, tenant: str, namespace: str) -> list[str]:
        prefix = f"{self.keys.topics_prefix}{tenant}/{namespace}/"
        kvs, _ = await self.store.get_prefix(prefix)
        names = {kv.key[len(prefix) :] for kv in kvs if "/" not in kv.key[len(prefix) :]}
        return [f"topic://{tenant}/{namespace}/{n}" for n in sorted(names)]

    async def create_topic(self, topic: TopicName, segments: int) -> None:
        layout = layout_ops.initial_layout(segments, self.clock.now_ms())
        key = self.keys.layout(topic)
        if await self.store.get(key) is not None:
            # Before creating any Kafka topic: a segment GC deleted must not come back.
            raise Refused(409, f"topic {topic} already exists", "exists")
        await self.kafka.create_topics(
            [segment_topic(topic, s.descriptor) for s in layout.segments.values()]
        )
        body = _layout_bytes(layout)
        result = await self.store.txn([Compare.absent(key)], [Put(key, body)])
        if not result.succeeded and not await self._stored(key, body):
            raise Refused(409, f"topic {topic} already exists", "exists")
        log.info("refbroker.topic.created", topic=str(topic), segments=segments)

    async def delete_topic(self, topic: TopicName) -> None:
        """Delete every Kafka topic of ``topic``, then its etcd keys.

        Every one: a segment topic with the topic's prefix that no layout names
        (children of a split refused after they were created, segments GC pruned
        but could not delete) would otherwise stay for good.
        """
        await self.read_layout(topic)  # 404 without one; an unusable one is a 500
        for name in await self.kafka.topics(segment_topic_prefix(topic)):
            await self.kafka.delete_topic(name)
        await self.store.delete_prefix(self.keys.layout(topic) + "/")
        await self.store.delete(self.keys.layout(topic))
        log.info("refbroker.topic.deleted", topic=str(topic))

    # -- subscriptions -------------------------------------------------------------------

    async def create_subscription(self, topic: TopicName, sub: str, kind: str) -> None:
        try:
            subscription_group(topic, sub)
        except ValueError as exc:
            raise Refused(400, str(exc)) from exc
        await self.read_layout(topic)
        await self.store.put(
            self.keys.subscription(topic, sub), json.dumps({"type": kind}).encode()
        )

    async def delete_subscription(self, topic: TopicName, sub: str) -> None:
        key = self.keys.subscription(topic, sub)
        if await self.store.get(key) is None:
            raise Refused(404, f"subscription {sub} does not exist")
        await self.store.delete_prefix(key + "/")
        await self.store.delete(key)

    async def subscriptions(self, topic: TopicName) -> list[str]:
        prefix = f"{self.keys.layout(topic)}/subscriptions/"
        kvs, _ = await self.store.get_prefix(prefix)
        return sorted({kv.key[len(prefix) :] for kv in kvs if "/" not in kv.key[len(prefix) :]})

    # -- split / merge -------------------------------------------------------------------

    async def split(
        self, topic: TopicName, segment_id: int, boundaries: list[int] | None, fence: Fence | None
    ) -> Layout:
        now = self.clock.now_ms()

        def change(layout: Layout) -> Layout:
            return layout_ops.split(layout, segment_id, boundaries, now_ms=now)

        old, new = await self._write_layout(topic, change, fence)
        log.info(
            "refbroker.split",
            topic=str(topic),
            segment=segment_id,
            children=[s for s in new.segments if s not in old.segments],
            fencing_key=fence.key if fence else None,
            token=fence.token if fence else None,
        )
        return new

    async def merge(self, topic: TopicName, a: int, b: int, fence: Fence | None) -> Layout:
        now = self.clock.now_ms()

        def change(layout: Layout) -> Layout:
            return layout_ops.merge(layout, a, b, now_ms=now)

        _, new = await self._write_layout(topic, change, fence)
        log.info(
            "refbroker.merge",
            topic=str(topic),
            segments=[a, b],
            fencing_key=fence.key if fence else None,
            token=fence.token if fence else None,
        )
        return new

    # -- segments ------------------------------------------------------------------------

    async def backlog(self, topic: TopicName, descriptor: str, sub: str) -> int:
        """``end - committed`` of ``sub`` on the segment.

        Raises:
            Refused: 404 for an unknown subscription or segment, and for a
                subscription whose name Kafka cannot carry (Pulsar allows dots): it
                has no cursor here, so its backlog is unknown, which GC never takes
                for drained.
        """
        segment_id = _segment_id(descriptor)
        if await self.store.get(self.keys.subscription(topic, sub)) is None:
            raise Refused(404, f"subscription {sub} does not exist")
        try:
            group = subscription_group(topic, sub)
        except ValueError as exc:
            raise Refused(
                404,
                f"subscription {sub!r} has no cursor in Kafka ({exc}): its backlog is unknown",
                "no-cursor",
            ) from exc
        name = segment_topic(topic, descriptor)
        if not await self.kafka.exists(name):
            raise Refused(404, f"segment {descriptor} does not exist")
        end = await self._end(topic, segment_id, name)
        return max(0, end - (await self.kafka.committed(group, name) or 0))

    async def _end(self, topic: TopicName, segment_id: int, name: str) -> int:
        """Where a segment ends for its readers: its seal's ``endOffset``, else Kafka's end."""
        end = await self.seal_end(topic, segment_id)
        return end if end is not None else await self.kafka.end_offset(name)

    async def delete_segment(self, topic: TopicName, descriptor: str, fence: Fence | None) -> None:
        """Delete a sealed segment's Kafka topic and then its seal key, once drained.

        ``descriptor`` must be the segment's own: while the layout holds segment
        ``id``, a descriptor with that id and another range is refused (409
        ``descriptor-mismatch``) and nothing is touched. A segment GC pruned is in
        no layout; then the descriptor names the Kafka topic to delete, and any
        other topic of the same id (the children of a split that never applied
        share ids with those of the one that did) may be the segment's own.

        Drained: every subscription's committed offset reaches the segment's end. A
        subscription Kafka cannot name never had a cursor, so it counts from 0: it
        holds back any segment with data (409 ``backlog`` naming it) until the
        subscription is deleted. Nothing proves it drained, and GC, to which its
        backlog is unknown (404), keeps the segment too.

        The seal key goes once its segment's data is gone, also on a retry after
        etcd failed to delete it (404 then): when the topic of the layout's
        descriptor is gone, or, for a pruned segment, every topic of its id.

        Raises:
            Refused: 412 active, 409 ``descriptor-mismatch`` or ``backlog``, 404 gone.
        """
        segment_id = _segment_id(descriptor)
        await self._check_fence(fence)
        name = segment_topic(topic, descriptor)
        in_layout = False  # then ``descriptor`` is the layout's own
        try:
            layout, _ = await self.read_layout(topic)
        except Refused as exc:
            if exc.status != 404:
                raise
        else:
            seg = layout.segments.get(segment_id)
            if seg is not None:
                if seg.descriptor != descriptor:
                    raise Refused(
                        409,
                        f"segment {segment_id} of {topic} is {seg.descriptor}, not {descriptor}",
                        "descriptor-mismatch",
                    )
                if seg.active:
                    raise Refused(412, f"segment {descriptor} is active", "not-active")
                in_layout = True
        prefix = segment_topic_prefix(topic)
        same_id = [
            n
            for n in await self.kafka.topics(prefix)
            if _descriptor_id(n[len(prefix) :]) == segment_id
        ]
        if name not in same_id:
            if in_layout or not same_id:
                await self.store.delete(seal_key(self.keys, topic, segment_id))
            raise Refused(404, f"segment {descriptor} does not exist")
        end = await self._end(topic, segment_id, name)
        lagging: dict[str, int] = {}
        uncursored: list[str] = []
        for sub in await self.subscriptions(topic):
            try:
                group = subscription_group(topic, sub)
            except ValueError:  # no Kafka name, so no cursor: it consumed nothing
                uncursored.append(sub)
                committed = 0
            else:
                committed = await self.kafka.committed(group, name) or 0
            if end > committed:
                lagging[sub] = end - committed
        if lagging:
            reason = f"segment {descriptor} has backlog {lagging}"
            if held := [sub for sub in uncursored if sub in lagging]:
                reason += (
                    f"; {held} cannot be named in Kafka, so never consumed it:"
                    " delete them to release it"
                )
            raise Refused(409, reason, "backlog")
        await self.kafka.delete_topic(name)
        if in_layout or same_id == [name]:
            await self.store.delete(seal_key(self.keys, topic, segment_id))
        log.info("refbroker.segment.deleted", topic=str(topic), descriptor=descriptor)


def _layout_bytes(layout: Layout) -> bytes:
    """The layout as stored and as answered: strict JSON (orjson).

    Raises:
        orjson.JSONEncodeError: a value nested deeper than 254 or an int beyond 64 bits.
    """
    return orjson.dumps(layout_to_json(layout))


def _unusable(what: str, exc: Exception) -> Refused:
    """The 500 for a stored value that cannot be used, with a reason of bounded size."""
    reason = f"{what} is unusable: {exc}"
    if len(reason) > _REASON_CHARS:
        reason = reason[: _REASON_CHARS - 3] + "..."
    return Refused(500, reason)


def _segment_topics(topic: TopicName, segments: Iterable[Segment]) -> list[str]:
    """The Kafka topics of ``segments``.

    Raises:
        Refused: 500 when a stored segment has no Kafka name (a range beyond 16 bits,
            a negative id, a name longer than Kafka takes).
    """
    try:
        return [segment_topic(topic, seg.descriptor) for seg in segments]
    except ValueError as exc:
        raise _unusable(f"stored layout of {topic}", exc) from exc


def _intent_segments(value: bytes) -> list[int] | None:
    """The segment ids of a ``sealing`` intent as a broker writes it; None for any other value."""
    try:
        raw = parse_json(value)
    except (ValueError, RecursionError):
        return None
    ids = raw.get("segments") if isinstance(raw, dict) else None
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        return None
    return ids


def _descriptor_id(descriptor: str) -> int | None:
    """The segment id of a descriptor; None if it is not one."""
    match = _DESCRIPTOR.fullmatch(descriptor)
    return None if match is None else int(match.group(3))


def _segment_id(descriptor: str) -> int:
    segment_id = _descriptor_id(descriptor)
    if segment_id is None:
        raise Refused(404, f"{descriptor!r} is not a segment descriptor")
    return segment_id


def _topic(request: Request) -> TopicName:
    params = request.path_params
    try:
        topic = TopicName(params["tenant"], params["namespace"], params["topic"])
        segment_topic(topic, "0000-ffff-0")  # Kafka-safe, and short enough for Kafka
        return topic
    except (ValueError, ModelError) as exc:
        raise Refused(400, str(exc)) from exc


def _fence(request: Request, broker: RefBroker, topic: TopicName) -> Fence | None:
    """The fencing claim of a mutation, from ``X-Fencing-Token`` and ``X-Fencing-Key``."""
    raw = request.headers.get(FENCING_TOKEN_HEADER)
    token: int | None = None
    if raw is not None:
        try:
            token = int(raw)
        except ValueError:
            raise Refused(400, f"X-Fencing-Token {raw!r} is not an integer") from None
        if token < 1:
            raise Refused(400, f"X-Fencing-Token {token} is not an etcd create revision")
    return broker.fence(topic, token, request.headers.get(FENCING_KEY_HEADER))


def _authenticate(request: Request, token: bytes) -> None:
    """401 without a bearer token, 403 with a wrong one (constant-time comparison)."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Refused(
            401,
            "this broker requires Authorization: Bearer <token>",
            "unauthenticated",
            headers={"WWW-Authenticate": 'Bearer realm="controllerd-refbroker"'},
        )
    if not hmac.compare_digest(given.strip().encode(), token):
        raise Refused(403, "the bearer token is not accepted", "forbidden")


def _int_param(request: Request, name: str) -> int:
    try:
        return int(request.path_params[name])
    except ValueError:
        raise Refused(400, f"{name} must be an integer") from None


def make_app(broker: RefBroker, token: str | None = None) -> Starlette:
    """Routes of DESIGN §5 over :class:`RefBroker`; every one needs ``token`` if given."""
    expected = token.strip().encode() if token is not None else None
    base = "/admin/v2/scalable/{tenant}/{namespace}"
    seg = "/admin/v2/segments/{tenant}/{namespace}/{topic}/{descriptor}"

    def endpoint(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            try:
                if expected is not None:
                    _authenticate(request, expected)
                return await handler(request)
            except Refused as exc:
                return exc.response()
            except (StoreError, KafkaBackendError) as exc:
                log.warning("refbroker.unavailable", path=request.url.path, error=str(exc))
                return JSONResponse({"reason": str(exc)}, status_code=503)

        return wrapped

    async def list_topics(request: Request) -> Response:
        params = request.path_params
        return JSONResponse(await broker.list_topics(params["tenant"], params["namespace"]))

    async def create_topic(request: Request) -> Response:
        try:
            n = int(request.query_params.get("numInitialSegments", "1"))
        except ValueError:
            raise Refused(400, "numInitialSegments must be an integer") from None
        if not 1 <= n <= 1024:
            raise Refused(400, "numInitialSegments must be 1..1024")
        await broker.create_topic(_topic(request), n)
        return Response(status_code=204)

    async def get_layout(request: Request) -> Response:
        layout, _ = await broker.read_layout(_topic(request))
        # orjson, as it was stored: JSONResponse's encoder has a depth limit of its own
        return Response(_layout_bytes(layout), media_type="application/json")

    async def delete_topic(request: Request) -> Response:
        await broker.delete_topic(_topic(request))
        return Response(status_code=204)

    async def create_subscription(request: Request) -> Response:
        kind = request.query_params.get("type", "STREAM").upper()
        if kind not in ("STREAM", "QUEUE"):
            raise Refused(400, f"type must be STREAM or QUEUE, not {kind}")
        await broker.create_subscription(_topic(request), request.path_params["sub"], kind)
        return Response(status_code=204)

    async def delete_subscription(request: Request) -> Response:
        await broker.delete_subscription(_topic(request), request.path_params["sub"])
        return Response(status_code=204)

    async def split(request: Request) -> Response:
        raw = request.query_params.get("boundaries")
        try:
            bounds = [int(b) for b in raw.split(",")] if raw else None
        except ValueError:
            raise Refused(400, f"boundaries {raw!r} must be comma-separated integers") from None
        topic = _topic(request)
        fence = _fence(request, broker, topic)
        await broker.split(topic, _int_param(request, "segment"), bounds, fence)
        return Response(status_code=204)

    async def merge(request: Request) -> Response:
        topic = _topic(request)
        fence = _fence(request, broker, topic)
        await broker.merge(topic, _int_param(request, "a"), _int_param(request, "b"), fence)
        return Response(status_code=204)

    async def backlog(request: Request) -> Response:
        params = request.path_params
        value = await broker.backlog(_topic(request), params["descriptor"], params["sub"])
        return JSONResponse(value)

    async def delete_segment(request: Request) -> Response:
        topic = _topic(request)
        fence = _fence(request, broker, topic)
        await broker.delete_segment(topic, request.path_params["descriptor"], fence)
        return Response(status_code=204)

    return Starlette(
        routes=[
            Route(base, endpoint(list_topics), methods=["GET"]),
            Route(base + "/{topic}", endpoint(create_topic), methods=["PUT"]),
            Route(base + "/{topic}", endpoint(get_layout), methods=["GET"]),
            Route(base + "/{topic}", endpoint(delete_topic), methods=["DELETE"]),
            Route(
                base + "/{topic}/subscriptions/{sub}",
                endpoint(create_subscription),
                methods=["PUT"],
            ),
            Route(
                base + "/{topic}/subscriptions/{sub}",
                endpoint(delete_subscription),
                methods=["DELETE"],
            ),
            Route(base + "/{topic}/split/{segment}", endpoint(split), methods=["POST"]),
            Route(base + "/{topic}/merge/{a}/{b}", endpoint(merge), methods=["POST"]),
            Route(seg + "/subscription/{sub}/backlog", endpoint(backlog), methods=["GET"]),
            Route(seg, endpoint(delete_segment), methods=["DELETE"]),
        ]
    )
