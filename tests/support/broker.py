"""An in-memory broker that speaks the admin REST protocol (DESIGN §5) over real HTTP.

``make_test_broker_app(state)`` serves every path :mod:`controllerd.adapters.broker` calls,
applying the pure :mod:`controllerd.core.layout` operations to layouts held in
:class:`TestBrokerState`; ``serve_test_broker(state)`` runs it with uvicorn on a free
loopback port inside the current event loop.

Protocol choices (mirrored in ``docs/admin-api.yaml``):

* Error bodies are Pulsar's ``{"reason": "<text>"}`` plus our ``"code"``: the
  :class:`~controllerd.core.layout.LayoutError` code, or ``fenced``.
* Fencing: when ``state.min_fencing_token`` is set, split, merge and delete-segment
  need ``X-Fencing-Token >= min_fencing_token``; a missing or lower token is **409**
  with code ``fenced``. 409 rather than 412 because 412 already means "the layout
  changed, re-read it", which a deposed leader must never act on.
* ``profile == "pulsar"``: midpoint splits only (a ``boundaries`` parameter is 400),
  delete-segment ignores backlog. ``"reference"``: ``?boundaries=b1,b2`` k-way splits,
  delete-segment answers 409 while any subscription has backlog on the segment.
* Deleting an *active* segment is 412 on both profiles: a controller that tries it has
  a bug, and a test double should say so rather than lose data silently.
* Deleting a sealed segment also prunes it from the in-memory layout when
  :func:`controllerd.core.layout.prune` allows it, so the broker's layout agrees with one the
  controller pruned in etcd (otherwise the next split would resurrect the segment).

Fault injection runs before routing, in this order, on every request (all recorded):
``fail_next`` (answer those statuses), ``answer_next`` (answer those raw
(status, body) pairs: a broker's garbage), ``lose_next`` (apply the request, then drop the
response until the client gives up: "applied but the answer was lost"), ``hang_next``
(never answer; wait for the client to disconnect), ``redirect_to`` (307 for PUT, POST
and DELETE to the same path on another base URL).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar, Literal
from urllib.parse import parse_qsl

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controllerd.adapters.store import Store
from controllerd.core.layout import LayoutError, initial_layout, merge, prune, split
from controllerd.core.model import Layout, TopicName, layout_to_json
from controllerd.core.shards import DEFAULT_SHARDS, shard_name, shard_of
from controllerd.core.view import Keys

Endpoint = Callable[[Request], Awaitable[Response]]
LayoutHook = Callable[[TopicName, Layout | None], Awaitable[None] | None]
"""Called after every layout change; ``None`` when the topic was deleted."""

SUBSCRIPTION_TYPES = ("STREAM", "QUEUE")
HANG_LIMIT_SECONDS = 30.0
"""A hung request gives up after this long even if the client never disconnects."""


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One request as it arrived, before fault injection or routing."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    """Lower-cased names; the last value wins."""
    at: float
    """``time.monotonic()`` on arrival."""


@dataclass(frozen=True, slots=True)
class EtcdFence:
    """Where the fencing keys live: the leader key, or one key per shard."""

    store: Store
    controller_root: str
    shards: int = DEFAULT_SHARDS

    @property
    def leader_key(self) -> str:
        return f"{self.controller_root}/leader"

    def shard_key(self, topic: TopicName) -> str:
        return f"{self.controller_root}/shards/{shard_name(shard_of(topic, self.shards))}"


@dataclass(frozen=True, slots=True)
class FencedCall:
    """A mutation checked against etcd: which key and token, and whether it passed."""

    method: str
    topic: TopicName
    key: str
    token: int
    accepted: bool
    at: float


@dataclass
class TestBrokerState:
    """Everything the test broker knows; tests read and set these fields directly."""

    __test__: ClassVar[bool] = False  # not a pytest test class

    profile: Literal["pulsar", "reference"] = "pulsar"
    topics: dict[TopicName, Layout] = field(default_factory=dict)
    subscriptions: dict[TopicName, dict[str, str]] = field(default_factory=dict)
    """Topic -> subscription name -> type."""
    backlogs: dict[tuple[TopicName, str, str], int] = field(default_factory=dict)
    """(topic, segment descriptor, subscription) -> backlog; missing = 0."""
    deleted_segments: set[tuple[TopicName, str]] = field(default_factory=set)
    """(topic, descriptor) whose data was deleted."""
    min_fencing_token: int | None = None
    fence: EtcdFence | None = None
    """When set, mutations are fenced against etcd (the reference broker's rule) and
    every fenced call is recorded in ``fenced_calls``."""
    fenced_calls: list[FencedCall] = field(default_factory=list)
    fail_next: list[int] = field(default_factory=list)
    answer_next: list[tuple[int, bytes]] = field(default_factory=list)
    lose_next: int = 0
    hang_next: int = 0
    redirect_to: str | None = None
    on_layout_change: LayoutHook | None = None
    clock_ms: Callable[[], int] = field(default=lambda: int(time.time() * 1000))
    requests: list[RecordedRequest] = field(default_factory=list)

    def add_topic(self, topic: TopicName, num_segments: int = 1) -> Layout:
        """Create a topic directly (no request recorded, no hook called)."""
        layout = initial_layout(num_segments, self.clock_ms())
        self.topics[topic] = layout
        self.subscriptions.setdefault(topic, {})
        return layout


class _Refused(Exception):
    """Answer with ``status`` and a Pulsar-style error body."""

    def __init__(self, status: int, reason: str, code: str | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.code = code

    def response(self) -> Response:
        body: dict[str, str] = {"reason": self.reason}
        if self.code is not None:
            body["code"] = self.code
        return JSONResponse(body, status_code=self.status)


def _refused_from(exc: LayoutError) -> _Refused:
    return _Refused(404 if exc.code == "not-found" else 412, str(exc), exc.code)


class _Handlers:
    """Route handlers over one :class:`TestBrokerState`."""

    def __init__(self, state: TestBrokerState) -> None:
        self.state = state

    # --- helpers --------------------------------------------------------------------

    @staticmethod
    def _topic(request: Request) -> TopicName:
        p = request.path_params
        return TopicName(p["tenant"], p["namespace"], p["topic"])

    def _layout(self, topic: TopicName) -> Layout:
        layout = self.state.topics.get(topic)
        if layout is None:
            raise _Refused(404, f"Scalable topic not found: {topic}", "not-found")
        return layout

    async def _check_fencing(self, request: Request) -> None:
        if self.state.fence is not None:
            await self._check_etcd_fence(request)
        minimum = self.state.min_fencing_token
        if minimum is None:
            return
        raw = request.headers.get("x-fencing-token")
        try:
            token = int(raw) if raw is not None else None
        except ValueError:
            raise _Refused(400, f"X-Fencing-Token is not an integer: {raw!r}") from None
        if token is None or token < minimum:
            raise _Refused(409, f"fencing token {token} is older than {minimum}", "fenced")

    async def _check_etcd_fence(self, request: Request) -> None:
        """The reference broker's fencing: the named key (the leader key, or this topic's
        shard key) must exist with the token as its create revision."""
        fence = self.state.fence
        assert fence is not None
        topic = self._topic(request)
        raw = request.headers.get("x-fencing-token")
        if raw is None:
            raise _Refused(428, "X-Fencing-Token is required", "fencing-required")
        token = int(raw)
        key = request.headers.get("x-fencing-key") or fence.leader_key
        if key not in (fence.leader_key, fence.shard_key(topic)):
            raise _Refused(400, f"{key} is not a fencing key for {topic}", "bad-fencing-key")
        kv = await fence.store.get(key)
        accepted = kv is not None and kv.create_revision == token
        self.state.fenced_calls.append(
            FencedCall(request.method, topic, key, token, accepted, time.monotonic())
        )
        if not accepted:
            raise _Refused(409, f"fencing token {token} is not the holder's of {key}", "fenced")

    async def _set_layout(self, topic: TopicName, layout: Layout | None) -> None:
        if layout is None:
            self.state.topics.pop(topic, None)
        else:
            self.state.topics[topic] = layout
        hook = self.state.on_layout_change
        if hook is not None:
            result = hook(topic, layout)
            if inspect.isawaitable(result):
                await result

    def _segment_exists(self, topic: TopicName, descriptor: str) -> bool:
        layout = self.state.topics.get(topic)
        return (
            layout is not None
            and (topic, descriptor) not in self.state.deleted_segments
            and any(s.descriptor == descriptor for s in layout.segments.values())
        )

    # --- /admin/v2/scalable -------------------------------------------------------------

    async def list_topics(self, request: Request) -> Response:
        tenant, namespace = request.path_params["tenant"], request.path_params["namespace"]
        names = sorted(
            f"topic://{t}"
            for t in self.state.topics
            if (t.tenant, t.namespace) == (tenant, namespace)
        )
        return JSONResponse(names)

    async def create_topic(self, request: Request) -> Response:
        topic = self._topic(request)
        if topic in self.state.topics:
            raise _Refused(409, f"Scalable topic already exists: {topic}")
        raw = request.query_params.get("numInitialSegments", "1")
        try:
            count = int(raw)
        except ValueError:
            raise _Refused(400, f"numInitialSegments is not an integer: {raw!r}") from None
        if count < 1:
            raise _Refused(412, "numInitialSegments must be >= 1")
        try:
            layout = initial_layout(count, self.state.clock_ms())
        except LayoutError as exc:
            raise _Refused(412, str(exc), exc.code) from None
        self.state.subscriptions.setdefault(topic, {})
        await self._set_layout(topic, layout)
        return Response(status_code=204)

    async def get_layout(self, request: Request) -> Response:
        return JSONResponse(layout_to_json(self._layout(self._topic(request))))

    async def delete_topic(self, request: Request) -> Response:
        topic = self._topic(request)
        self._layout(topic)
        self.state.subscriptions.pop(topic, None)
        for key in [k for k in self.state.backlogs if k[0] == topic]:
            del self.state.backlogs[key]
        self.state.deleted_segments = {d for d in self.state.deleted_segments if d[0] != topic}
        await self._set_layout(topic, None)
        return Response(status_code=204)

    async def create_subscription(self, request: Request) -> Response:
        topic = self._topic(request)
        self._layout(topic)
        sub = request.path_params["subscription"]
        sub_type = request.query_params.get("type", "STREAM")
        if sub_type not in SUBSCRIPTION_TYPES:
            raise _Refused(400, f"unknown subscription type {sub_type!r}")
        subs = self.state.subscriptions.setdefault(topic, {})
        if sub in subs:
            raise _Refused(409, f"Subscription already exists: {sub}")
        subs[sub] = sub_type
        return Response(status_code=204)

    async def delete_subscription(self, request: Request) -> Response:
        topic = self._topic(request)
        self._layout(topic)
        sub = request.path_params["subscription"]
        if self.state.subscriptions.get(topic, {}).pop(sub, None) is None:
            raise _Refused(404, f"Subscription not found: {sub}", "not-found")
        return Response(status_code=204)

    async def split(self, request: Request) -> Response:
        topic = self._topic(request)
        layout = self._layout(topic)
        await self._check_fencing(request)
        raw = request.query_params.get("boundaries")
        boundaries: tuple[int, ...] | None = None
        if raw is not None:
            if self.state.profile != "reference":
                raise _Refused(400, "this broker only splits at the midpoint (no boundaries)")
            try:
                boundaries = tuple(int(b) for b in raw.split(","))
            except ValueError:
                raise _Refused(400, f"boundaries must be decimal integers: {raw!r}") from None
        try:
            new = split(
                layout,
                request.path_params["segment_id"],
                boundaries,
                now_ms=self.state.clock_ms(),
            )
        except LayoutError as exc:
            raise _refused_from(exc) from None
        await self._set_layout(topic, new)
        return Response(status_code=204)

    async def merge(self, request: Request) -> Response:
        topic = self._topic(request)
        layout = self._layout(topic)
        await self._check_fencing(request)
        p = request.path_params
        try:
            new = merge(layout, p["a"], p["b"], now_ms=self.state.clock_ms())
        except LayoutError as exc:
            raise _refused_from(exc) from None
        await self._set_layout(topic, new)
        return Response(status_code=204)

    # --- /admin/v2/segments -----------------------------------------------------------

    async def backlog(self, request: Request) -> Response:
        topic = self._topic(request)
        descriptor = request.path_params["descriptor"]
        sub = request.path_params["subscription"]
        if not self._segment_exists(topic, descriptor):
            raise _Refused(404, f"Segment topic not loaded: {topic}/{descriptor}", "not-found")
        if sub not in self.state.subscriptions.get(topic, {}):
            raise _Refused(404, f"Subscription not found: {sub}", "not-found")
        count = self.state.backlogs.get((topic, descriptor, sub), 0)
        return Response(str(count), media_type="application/json")

    async def delete_segment(self, request: Request) -> Response:
        topic = self._topic(request)
        descriptor = request.path_params["descriptor"]
        await self._check_fencing(request)
        if not self._segment_exists(topic, descriptor):
            raise _Refused(404, f"Segment topic not found: {topic}/{descriptor}", "not-found")
        layout = self.state.topics[topic]
        segment = next(s for s in layout.segments.values() if s.descriptor == descriptor)
        if segment.active:
            raise _Refused(412, f"segment {descriptor} is active", "not-active")
        if self.state.profile == "reference":
            subs = self.state.subscriptions.get(topic, {})
            pending = {
                sub: n
                for (t, d, sub), n in self.state.backlogs.items()
                if (t, d) == (topic, descriptor) and sub in subs and n > 0
            }
            if pending:
                raise _Refused(409, f"segment {descriptor} still has backlog {pending}", "backlog")
        self.state.deleted_segments.add((topic, descriptor))
        for key in [k for k in self.state.backlogs if k[:2] == (topic, descriptor)]:
            del self.state.backlogs[key]
        with contextlib.suppress(LayoutError):
            await self._set_layout(topic, prune(layout, [segment.segment_id]))
        return Response(status_code=204)


class _Faults:
    """ASGI middleware: records every request, then applies the fault-injection knobs."""

    def __init__(self, app: ASGIApp, state: TestBrokerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        query = scope.get("query_string", b"").decode()
        state.requests.append(
            RecordedRequest(
                method=scope["method"],
                path=scope["path"],
                query=dict(parse_qsl(query, keep_blank_values=True)),
                headers={k.decode().lower(): v.decode() for k, v in scope["headers"]},
                at=time.monotonic(),
            )
        )
        if state.fail_next:
            status = state.fail_next.pop(0)
            await _Refused(status, f"injected HTTP {status}", "injected").response()(
                scope, receive, send
            )
        elif state.answer_next:
            status, body = state.answer_next.pop(0)
            raw = Response(body, status_code=status, media_type="application/json")
            await raw(scope, receive, send)
        elif state.lose_next > 0:
            state.lose_next -= 1
            await self.app(scope, receive, _swallow)
            await _wait_for_disconnect(receive)
        elif state.hang_next > 0:
            state.hang_next -= 1
            await _wait_for_disconnect(receive)
        elif state.redirect_to is not None and scope["method"] in ("PUT", "POST", "DELETE"):
            location = (
                state.redirect_to.rstrip("/") + scope["path"] + (f"?{query}" if query else "")
            )
            await Response(status_code=307, headers={"Location": location})(scope, receive, send)
        else:
            await self.app(scope, receive, send)


async def _swallow(message: Message) -> None:
    """An ASGI ``send`` that drops the response (the "lost answer" fault)."""


async def _wait_for_disconnect(receive: Receive) -> None:
    """Wait until the client hangs up, so its timeout (not ours) ends the request."""
    with anyio.move_on_after(HANG_LIMIT_SECONDS):
        while (await receive())["type"] != "http.disconnect":
            pass


def make_test_broker_app(state: TestBrokerState) -> Starlette:
    """The admin REST app over ``state`` (see the module docstring for its behaviour)."""
    h = _Handlers(state)
    topic = "/admin/v2/scalable/{tenant}/{namespace}/{topic}"
    segment = "/admin/v2/segments/{tenant}/{namespace}/{topic}/{descriptor}"

    def guarded(handler: Endpoint) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except _Refused as exc:
                return exc.response()

        return endpoint

    routes = [
        Route("/admin/v2/scalable/{tenant}/{namespace}", guarded(h.list_topics), methods=["GET"]),
        Route(topic, guarded(h.create_topic), methods=["PUT"]),
        Route(topic, guarded(h.get_layout), methods=["GET"]),
        Route(topic, guarded(h.delete_topic), methods=["DELETE"]),
        Route(
            f"{topic}/subscriptions/{{subscription}}",
            guarded(h.create_subscription),
            methods=["PUT"],
        ),
        Route(
            f"{topic}/subscriptions/{{subscription}}",
            guarded(h.delete_subscription),
            methods=["DELETE"],
        ),
        Route(f"{topic}/split/{{segment_id:int}}", guarded(h.split), methods=["POST"]),
        Route(f"{topic}/merge/{{a:int}}/{{b:int}}", guarded(h.merge), methods=["POST"]),
        Route(
            f"{segment}/subscription/{{subscription}}/backlog", guarded(h.backlog), methods=["GET"]
        ),
        Route(segment, guarded(h.delete_segment), methods=["DELETE"]),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(_Faults, state=state)
    return app


class _InLoopServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_test_broker(state: TestBrokerState) -> AsyncIterator[str]:
    """Serve ``state`` on ``127.0.0.1:<free port>`` in this event loop; yield the base URL.

    The socket is bound and listening before the server task starts, so the URL is
    usable at once (connections wait in the backlog): no readiness polling.
    """
    # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets whose proto
    # says TCP; with proto 0 every response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        make_test_broker_app(state),
        log_level="warning",
        lifespan="off",
        http="h11",
        timeout_graceful_shutdown=2,
    )
    server = _InLoopServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"test-broker-{port}")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with anyio.CancelScope(shield=True):
            await task
        sock.close()


def layout_json(layout: Layout) -> bytes:
    """The layout as the broker writes it to the metadata store (for ``on_layout_change``)."""
    return json.dumps(layout_to_json(layout)).encode()


def load_json(msg_in: float, changed_ms: int | None = None, sampled_ms: int | None = None) -> bytes:
    """A load record with only ``msgRateIn`` set, as a reporter writes it (DESIGN §4).

    Both time stamps default to now (wall clock, as the daemon under test reads it).
    """
    now = int(time.time() * 1000)
    return json.dumps(
        {
            "msgRateIn": msg_in,
            "byteRateIn": 0.0,
            "msgRateOut": 0.0,
            "byteRateOut": 0.0,
            "changedAtMs": now if changed_ms is None else changed_ms,
            "sampledAtMs": now if sampled_ms is None else sampled_ms,
        }
    ).encode()


def mirror_into(store: Store, keys: Keys) -> LayoutHook:
    """A hook that writes every layout to etcd as a Pulsar broker would (deletes on delete)."""

    async def mirror(topic: TopicName, layout: Layout | None) -> None:
        if layout is None:
            await store.delete(keys.layout(topic))
        else:
            await store.put(keys.layout(topic), layout_json(layout))

    return mirror
