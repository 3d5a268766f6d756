"""Operations HTTP endpoints on one port: ``/metrics``, ``/healthz``, ``/readyz``, ``/status``.

- ``/healthz`` (liveness) answers 200 whenever the event loop runs: a request
  served proves it. It checks nothing else, so a broken etcd never makes a
  supervisor restart a healthy process.
- ``/readyz`` (readiness) is 200 while ``ready()``: etcd answered our last
  probe, the view is loaded, and the replica campaigns or leads (a warm standby
  is ready). Otherwise 503 with ``{"reason": ...}`` saying what it waits for.
- ``/status`` is the controller's JSON view (leader, fencing token, topics, last
  decisions); ``/metrics`` the Prometheus text format.

:func:`serve_ops` runs uvicorn inside the caller's event loop and task group. The
runtime owns signals, so uvicorn must not install handlers; the listening
socket is bound here, so a busy port raises :class:`OSError` instead of
uvicorn's ``sys.exit``.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Callable, Generator, Mapping
from typing import Any, Final

import anyio
import anyio.abc
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from controllerd.daemon.metrics import Metrics

log = structlog.get_logger(__name__)

#: Seconds granted to in-flight requests once serving is cancelled.
SHUTDOWN_TIMEOUT: Final = 1


class _JSON(JSONResponse):
    """JSON that renders values json cannot (datetimes, enums) as strings, so
    a status field of an unexpected type never turns /status into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, default=str, separators=(",", ":")).encode()


def make_ops_app(
    metrics: Metrics,
    status: Callable[[], Mapping[str, Any]],
    ready: Callable[[], bool],
    not_ready_reason: Callable[[], str | None] | None = None,
) -> Starlette:
    """The ASGI app. ``status`` and ``ready`` are called per request, on the loop:
    they must be cheap and non-blocking (read a snapshot, do no I/O)."""

    async def metrics_endpoint(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    async def healthz(request: Request) -> Response:
        return _JSON({"status": "ok"})

    async def readyz(request: Request) -> Response:
        if ready():
            return _JSON({"status": "ready"})
        reason = not_ready_reason() if not_ready_reason is not None else None
        return _JSON({"status": "not ready", "reason": reason}, status_code=503)

    async def status_endpoint(request: Request) -> Response:
        return _JSON(dict(status()))

    return Starlette(
        routes=[
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/status", status_endpoint, methods=["GET"]),
        ]
    )


class _Server(uvicorn.Server):
    """uvicorn without signal handling, reporting when it listens.

    ``capture_signals`` (uvicorn >= 0.29) is where uvicorn installs its SIGINT and
    SIGTERM handlers and re-raises the signals afterwards; here it does nothing.
    """

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_started = on_started

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._on_started()


async def serve_ops(
    app: Starlette,
    host: str,
    port: int,
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``host:port`` until cancelled; reports the bound port when listening.

    Use ``port = await task_group.start(serve_ops, app, host, 0)`` to get the real
    port of an ephemeral bind. On cancellation the listener closes at once and
    in-flight requests get :data:`SHUTDOWN_TIMEOUT` seconds to finish.

    Raises:
        OSError: the address cannot be resolved or bound.
    """
    config = uvicorn.Config(
        app,
        log_config=None,  # logging is ours (controllerd.daemon.logs)
        access_log=False,  # a scrape every few seconds is noise
        lifespan="off",
        timeout_graceful_shutdown=SHUTDOWN_TIMEOUT,
    )
    sock = await _bind(host, port)
    bound_port: int = sock.getsockname()[1]

    def started() -> None:
        log.info("ops.listening", host=host, port=bound_port)
        task_status.started(bound_port)

    server = _Server(config, on_started=started)
    try:
        await server.serve(sockets=[sock])
    finally:
        # Cancelled inside main_loop: uvicorn's own shutdown never ran.
        if server.started and not server.should_exit:
            server.should_exit = True
            with anyio.move_on_after(SHUTDOWN_TIMEOUT + 1.0, shield=True):
                await server.shutdown(sockets=[sock])
        sock.close()


async def _bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on the first address ``host`` resolves to."""
    infos = await anyio.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    if not infos:
        raise OSError(f"cannot resolve {host!r}")
    family, type_, proto, _, address = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
