"""A fault-injecting HTTP server in front of the test broker, on the real admin paths.

A broker storm cannot be produced by a healthy broker, so this server stands
between controllerd and the test broker (:mod:`tests.support.broker`): every
request is matched against the active :class:`Fault` rules and either
answered with an injected status (503/500 storms, 409, 412, 404 ...), held
open without an answer (a socket that accepted and never answers: the
client's own timeout must end it), or forwarded unchanged to the broker
(method, path, query, headers and body) and the broker's answer returned.

Everything that arrives is recorded in :attr:`FaultyHttp.seen` with its
arrival time (``time.monotonic()``), the fencing headers and what it was
answered, so tests can check backoff schedules and count unsafe calls.

It is an ASGI app served by uvicorn on an event loop in a thread of its
own, so arrival times are taken when a request arrives, not when a busy
test loop gets round to it (the schedule checks compare gaps of a fraction
of a second); forwarding uses httpx. Hand-written only in the matching of
rules, which no proxy library offers per request and per path.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl

import anyio
import anyio.to_thread
import httpx
import orjson
import uvicorn
from starlette.types import Receive, Scope, Send

#: Longest a held request waits for the client to hang up.
HANG_LIMIT_SECONDS = 60.0

Action = Literal["status", "hang"]
Gate = Callable[[str, str, dict[str, str]], Coroutine[Any, Any, tuple[int, str] | None]]
"""``gate(method, path, headers)``: a ``(status, code)`` to answer instead of forwarding,
or None to forward; consulted after the rules (e.g. fencing against etcd's leader key).
It runs on the event loop that served the server, so it may use that loop's clients."""


@dataclass
class Fault:
    """One rule: requests whose path contains ``fragment`` (and method, if given) get
    ``action`` (an injected ``status``, or ``hang``), ``times`` times or until healed."""

    fragment: str
    action: Action
    status: int = 503
    method: str | None = None
    times: int | None = None
    code: str = "injected"
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        return self.fragment in path and (self.method is None or self.method == method)


@dataclass(frozen=True, slots=True)
class Seen:
    """One request as it arrived and how it was answered."""

    method: str
    path: str
    query: dict[str, str]
    fencing_token: int | None
    at: float
    """``time.monotonic()`` on arrival."""
    status: int | None
    """The status sent back; None while held (hang) or when no answer was sent."""
    injected: bool


@dataclass
class FaultyHttp:
    """The fault rules and the record of requests; tests change ``faults`` at will."""

    upstream: str
    faults: list[Fault] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    url: str = ""
    #: Requests currently held open by a ``hang`` rule.
    holding: int = 0
    #: When each held request's client gave up (its connection closed), by the
    #: request's arrival time: where a client's own timeout really ended, on a host
    #: too loaded for "arrival + timeout" to say.
    released: dict[float, float] = field(default_factory=dict)
    gate: Gate | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fail(
        self, fragment: str, status: int, *, method: str | None = None, times: int | None = None
    ) -> Fault:
        """Answer matching requests with ``status`` (a storm until :meth:`heal`)."""
        fault = Fault(fragment, "status", status, method, times)
        with self._lock:
            self.faults.append(fault)
        return fault

    def hang(self, fragment: str, *, method: str | None = None, times: int | None = None) -> Fault:
        """Accept matching requests and never answer them."""
        fault = Fault(fragment, "hang", 0, method, times)
        with self._lock:
            self.faults.append(fault)
        return fault

    def heal(self, fault: Fault | None = None) -> None:
        """Remove one rule, or all of them: the broker answers for itself again."""
        with self._lock:
            if fault is None:
                self.faults.clear()
            elif fault in self.faults:
                self.faults.remove(fault)

    def requests(
        self, fragment: str, *, method: str | None = None, since: float = 0.0
    ) -> list[Seen]:
        """Recorded requests whose path contains ``fragment``, in arrival order."""
        return [
            s
            for s in list(self.seen)
            if fragment in s.path and (method is None or s.method == method) and s.at >= since
        ]

    def _rule_for(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.matches(method, path):
                    fault.hits += 1
                    return fault
        return None


def _token(headers: dict[str, str]) -> int | None:
    raw = headers.get("x-fencing-token")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


class _App:
    """The ASGI app: match, then inject, hold, or forward."""

    def __init__(self, state: FaultyHttp, upstream: str, owner: asyncio.AbstractEventLoop) -> None:
        self.state = state
        self.upstream = upstream
        self.owner = owner
        self.client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        state = self.state
        method, path = scope["method"], scope["path"]
        raw_query = scope.get("query_string", b"").decode()
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        at = time.monotonic()
        query = dict(parse_qsl(raw_query, keep_blank_values=True))

        def record(status: int | None, injected: bool) -> None:
            state.seen.append(Seen(method, path, query, _token(headers), at, status, injected))

        fault = state._rule_for(method, path)
        if fault is not None and fault.action == "hang":
            record(None, True)
            state.holding += 1
            try:
                await _wait_for_disconnect(receive)
            finally:
                state.holding -= 1
                state.released[at] = time.monotonic()
            return
        if fault is not None:
            record(fault.status, True)
            body = orjson.dumps({"reason": f"injected HTTP {fault.status}", "code": fault.code})
            await _respond(send, fault.status, body, [(b"content-type", b"application/json")])
            return
        refusal = None
        if state.gate is not None:
            call = state.gate(method, path, headers)
            refusal = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, self.owner))
        if refusal is not None:
            status, code = refusal
            record(status, True)
            body = orjson.dumps({"reason": f"refused by the gate: {code}", "code": code})
            await _respond(send, status, body, [(b"content-type", b"application/json")])
            return
        body = await _read_body(receive)
        forwarded = {k: v for k, v in headers.items() if k not in ("host", "content-length")}
        if self.client is None:  # made on the server's own loop, at its first use
            self.client = httpx.AsyncClient(base_url=self.upstream, timeout=30.0)
        try:
            response = await self.client.request(
                method,
                path + (f"?{raw_query}" if raw_query else ""),
                headers=forwarded,
                content=body,
            )
        except httpx.HTTPError as exc:
            record(502, True)
            await _respond(send, 502, f"upstream failed: {exc}".encode(), [])
            return
        record(response.status_code, False)
        out = [
            (k.encode(), v.encode())
            for k, v in response.headers.items()
            if k.lower() not in ("content-length", "transfer-encoding", "connection")
        ]
        await _respond(send, response.status_code, response.content, out)


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _wait_for_disconnect(receive: Receive) -> None:
    """Hold the request until the client gives up (its timeout, not ours, ends it)."""
    with anyio.move_on_after(HANG_LIMIT_SECONDS):
        while (await receive())["type"] != "http.disconnect":
            pass


class _ThreadServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _serve(server: _ThreadServer, sock: socket.socket, app: _App) -> None:
    async def run() -> None:
        try:
            await server.serve(sockets=[sock])
        finally:
            if app.client is not None:
                await app.client.aclose()

    asyncio.run(run())


@contextlib.asynccontextmanager
async def serve_faulty_http(upstream: str) -> AsyncIterator[FaultyHttp]:
    """Serve a :class:`FaultyHttp` in front of ``upstream`` on a free loopback port.

    The socket listens before the server thread starts, so ``url`` is usable at once.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    state = FaultyHttp(upstream, url=f"http://127.0.0.1:{sock.getsockname()[1]}")
    app = _App(state, upstream, asyncio.get_running_loop())
    config = uvicorn.Config(
        app, log_level="warning", lifespan="off", http="h11", timeout_graceful_shutdown=1
    )
    server = _ThreadServer(config)
    thread = threading.Thread(
        target=_serve, args=(server, sock, app), name="faulty-http", daemon=True
    )
    thread.start()
    try:
        yield state
    finally:
        state.heal()
        server.should_exit = True
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(thread.join, 10.0)
        sock.close()
