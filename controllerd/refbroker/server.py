"""The reference broker's admin REST API (DESIGN §5) over etcd and Kafka.

Layouts, subscriptions and seal offsets live in etcd at the PIP-468 paths;
segment data lives in Kafka (``docs/reference-broker.md``). Every layout write
is one etcd transaction that compares the layout's ``mod_revision`` and, when
the request carries ``X-Fencing-Token``, the controller leader key's create
revision: a deposed controller can never change a layout (409 ``fenced``).

Extensions over Pulsar: k-way splits with ``?boundaries=b1,b2,...`` and a
DELETE of a segment that refuses (409 ``backlog``) while any subscription still
has backlog on it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from controllerd.adapters.store import Compare, Put, Store, StoreError
from controllerd.core import layout as layout_ops
from controllerd.core.model import Layout, ModelError, TopicName, layout_from_json, layout_to_json
from controllerd.core.view import Keys
from controllerd.daemon.clock import Clock
from controllerd.refbroker.kafka import KafkaBackend, KafkaBackendError
from controllerd.refbroker.naming import (
    check_name_part,
    seal_key,
    segment_topic,
    subscription_group,
)

log = structlog.get_logger("controllerd.refbroker")

_DESCRIPTOR = re.compile(r"([0-9a-f]{4})-([0-9a-f]{4})-(\d+)")
#: Layout writes that lose a race with another writer are retried this often.
CAS_ATTEMPTS = 5


class Refused(Exception):
    """An admin request the broker answers with ``status`` and a Pulsar-style body."""

    def __init__(self, status: int, reason: str, code: str | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.code = status, reason, code

    def response(self) -> Response:
        body: dict[str, Any] = {"reason": self.reason}
        if self.code:
            body["code"] = self.code
        return JSONResponse(body, status_code=self.status)


_LAYOUT_ERRORS = {
    "not-found": 404,
    "not-active": 412,
    "not-adjacent": 412,
    "bad-boundaries": 400,
    "parent-present": 412,
    "invalid": 412,
}


@dataclass
class RefBroker:
    """The admin operations; the HTTP layer is :func:`make_app`."""

    store: Store
    keys: Keys
    kafka: KafkaBackend
    clock: Clock
    leader_key: str | None = None

    # -- helpers -------------------------------------------------------------------------

    async def read_layout(self, topic: TopicName) -> tuple[Layout, int]:
        kv = await self.store.get(self.keys.layout(topic))
        if kv is None:
            raise Refused(404, f"topic {topic} does not exist")
        try:
            return layout_from_json(json.loads(kv.value)), kv.mod_revision
        except (ModelError, ValueError) as exc:
            raise Refused(500, f"stored layout of {topic} is unusable: {exc}") from exc

    async def _fenced(self, token: int | None) -> list[Compare]:
        """The compare that fences a layout write, or none without a token."""
        if token is None or self.leader_key is None:
            return []
        return [Compare.create_revision(self.leader_key, token)]

    async def _check_fence(self, token: int | None) -> None:
        if token is None or self.leader_key is None:
            return
        kv = await self.store.get(self.leader_key)
        if kv is None or kv.create_revision != token:
            current = kv.create_revision if kv is not None else None
            raise Refused(409, f"fencing token {token} is not the leader's ({current})", "fenced")

    async def _write_layout(
        self,
        topic: TopicName,
        change: Callable[[Layout], Layout],
        token: int | None,
        before_write: Callable[[Layout, Layout], Awaitable[None]] | None = None,
    ) -> tuple[Layout, Layout]:
        """Read-modify-CAS a layout; retried on races, refused when fenced."""
        for _ in range(CAS_ATTEMPTS):
            old, revision = await self.read_layout(topic)
            try:
                new = layout_ops.check(change(old))
            except layout_ops.LayoutError as exc:
                raise Refused(_LAYOUT_ERRORS.get(exc.code, 412), str(exc), exc.code) from exc
            if before_write is not None:
                await before_write(old, new)
            compares = [
                Compare.mod_revision(self.keys.layout(topic), revision),
                *await self._fenced(token),
            ]
            result = await self.store.txn(
                compares, [Put(self.keys.layout(topic), json.dumps(layout_to_json(new)).encode())]
            )
            if result.succeeded:
                return old, new
            await self._check_fence(token)
        raise Refused(409, f"layout of {topic} kept changing; try again", "conflict")

    async def _seal(self, topic: TopicName, old: Layout, new: Layout) -> None:
        """Record the end offset of every segment the change sealed (docs/reference-broker.md)."""
        for sid, seg in new.segments.items():
            before = old.segments.get(sid)
            if before is not None and before.active and not seg.active:
                end = await self.kafka.end_offset(segment_topic(topic, seg.descriptor))
                await self.store.put(
                    seal_key(self.keys, topic, sid), json.dumps({"endOffset": end}).encode()
                )

    async def _create_children(self, topic: TopicName, old: Layout, new: Layout) -> None:
        names = [
            segment_topic(topic, s.descriptor)
            for sid, s in new.segments.items()
            if sid not in old.segments
        ]
        await self.kafka.create_topics(names)

    async def seal_end(self, topic: TopicName, segment_id: int) -> int | None:
        kv = await self.store.get(seal_key(self.keys, topic, segment_id))
        return int(json.loads(kv.value)["endOffset"]) if kv is not None else None

    # -- topics --------------------------------------------------------------------------

    async def list_topics(self, tenant: str, namespace: str) -> list[str]:
        prefix = f"{self.keys.topics_prefix}{tenant}/{namespace}/"
        kvs, _ = await self.store.get_prefix(prefix)
        names = {kv.key[len(prefix) :] for kv in kvs if "/" not in kv.key[len(prefix) :]}
        return [f"topic://{tenant}/{namespace}/{n}" for n in sorted(names)]

    async def create_topic(self, topic: TopicName, segments: int) -> None:
        layout = layout_ops.initial_layout(segments, self.clock.now_ms())
        await self.kafka.create_topics(
            [segment_topic(topic, s.descriptor) for s in layout.segments.values()]
        )
        key = self.keys.layout(topic)
        result = await self.store.txn(
            [Compare.absent(key)], [Put(key, json.dumps(layout_to_json(layout)).encode())]
        )
        if not result.succeeded:
            raise Refused(409, f"topic {topic} already exists", "exists")
        log.info("refbroker.topic.created", topic=str(topic), segments=segments)

    async def delete_topic(self, topic: TopicName) -> None:
        layout, _ = await self.read_layout(topic)
        for seg in layout.segments.values():
            await self.kafka.delete_topic(segment_topic(topic, seg.descriptor))
        await self.store.delete_prefix(self.keys.layout(topic) + "/")
        await self.store.delete(self.keys.layout(topic))
        log.info("refbroker.topic.deleted", topic=str(topic))

    # -- subscriptions -------------------------------------------------------------------

    async def create_subscription(self, topic: TopicName, sub: str, kind: str) -> None:
        check_name_part(sub)
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
        self, topic: TopicName, segment_id: int, boundaries: list[int] | None, token: int | None
    ) -> Layout:
        now = self.clock.now_ms()

        def change(layout: Layout) -> Layout:
            return layout_ops.split(layout, segment_id, boundaries, now_ms=now)

        async def children(old: Layout, new: Layout) -> None:
            await self._create_children(topic, old, new)

        old, new = await self._write_layout(topic, change, token, children)
        await self._seal(topic, old, new)
        log.info(
            "refbroker.split",
            topic=str(topic),
            segment=segment_id,
            children=[s for s in new.segments if s not in old.segments],
            token=token,
        )
        return new

    async def merge(self, topic: TopicName, a: int, b: int, token: int | None) -> Layout:
        now = self.clock.now_ms()

        def change(layout: Layout) -> Layout:
            return layout_ops.merge(layout, a, b, now_ms=now)

        async def children(old: Layout, new: Layout) -> None:
            await self._create_children(topic, old, new)

        old, new = await self._write_layout(topic, change, token, children)
        await self._seal(topic, old, new)
        log.info("refbroker.merge", topic=str(topic), segments=[a, b], token=token)
        return new

    # -- segments ------------------------------------------------------------------------

    async def backlog(self, topic: TopicName, descriptor: str, sub: str) -> int:
        segment_id = _segment_id(descriptor)
        if await self.store.get(self.keys.subscription(topic, sub)) is None:
            raise Refused(404, f"subscription {sub} does not exist")
        name = segment_topic(topic, descriptor)
        if not await self.kafka.exists(name):
            raise Refused(404, f"segment {descriptor} does not exist")
        end = await self.seal_end(topic, segment_id)
        if end is None:
            end = await self.kafka.end_offset(name)
        committed = await self.kafka.committed(subscription_group(topic, sub), name) or 0
        return max(0, end - committed)

    async def delete_segment(self, topic: TopicName, descriptor: str, token: int | None) -> None:
        segment_id = _segment_id(descriptor)
        await self._check_fence(token)
        kv = await self.store.get(self.keys.layout(topic))
        if kv is not None:
            layout = layout_from_json(json.loads(kv.value))
            seg = layout.segments.get(segment_id)
            if seg is not None and seg.active:
                raise Refused(412, f"segment {descriptor} is active", "not-active")
        name = segment_topic(topic, descriptor)
        if not await self.kafka.exists(name):
            raise Refused(404, f"segment {descriptor} does not exist")
        lagging = {}
        for sub in await self.subscriptions(topic):
            backlog = await self.backlog(topic, descriptor, sub)
            if backlog > 0:
                lagging[sub] = backlog
        if lagging:
            raise Refused(409, f"segment {descriptor} has backlog {lagging}", "backlog")
        await self.kafka.delete_topic(name)
        await self.store.delete(seal_key(self.keys, topic, segment_id))
        log.info("refbroker.segment.deleted", topic=str(topic), descriptor=descriptor)


def _segment_id(descriptor: str) -> int:
    match = _DESCRIPTOR.fullmatch(descriptor)
    if match is None:
        raise Refused(404, f"{descriptor!r} is not a segment descriptor")
    return int(match.group(3))


def _topic(request: Request) -> TopicName:
    params = request.path_params
    try:
        for part in (params["tenant"], params["namespace"], params["topic"]):
            check_name_part(part)
        return TopicName(params["tenant"], params["namespace"], params["topic"])
    except (ValueError, ModelError) as exc:
        raise Refused(400, str(exc)) from exc


def _token(request: Request) -> int | None:
    raw = request.headers.get("x-fencing-token")
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise Refused(400, f"X-Fencing-Token {raw!r} is not an integer") from None


def _int_param(request: Request, name: str) -> int:
    try:
        return int(request.path_params[name])
    except ValueError:
        raise Refused(400, f"{name} must be an integer") from None


def make_app(broker: RefBroker) -> Starlette:
    """Routes of DESIGN §5 over :class:`RefBroker`."""
    base = "/admin/v2/scalable/{tenant}/{namespace}"
    seg = "/admin/v2/segments/{tenant}/{namespace}/{topic}/{descriptor}"

    def endpoint(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            try:
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
        return JSONResponse(layout_to_json(layout))

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
        await broker.split(_topic(request), _int_param(request, "segment"), bounds, _token(request))
        return Response(status_code=204)

    async def merge(request: Request) -> Response:
        await broker.merge(
            _topic(request), _int_param(request, "a"), _int_param(request, "b"), _token(request)
        )
        return Response(status_code=204)

    async def backlog(request: Request) -> Response:
        params = request.path_params
        value = await broker.backlog(_topic(request), params["descriptor"], params["sub"])
        return JSONResponse(value)

    async def delete_segment(request: Request) -> Response:
        await broker.delete_segment(
            _topic(request), request.path_params["descriptor"], _token(request)
        )
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
