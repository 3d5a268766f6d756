"""Ops endpoints over real HTTP (uvicorn on an ephemeral port), and log formatting."""

from __future__ import annotations

import io
import json
import logging
import logging.config
import signal
import socket
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import anyio
import httpx
import pytest
import structlog
import uvicorn.config

from controllerd.daemon.logs import configure_logging
from controllerd.daemon.metrics import Metrics
from controllerd.daemon.ops import make_ops_app, serve_ops


class _Controller:
    """The two callbacks the ops app needs, with state a test can flip."""

    def __init__(self) -> None:
        self.is_ready = False
        self.snapshot: dict[str, Any] = {}

    def ready(self) -> bool:
        return self.is_ready

    def status(self) -> Mapping[str, Any]:
        return self.snapshot


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def controller() -> _Controller:
    return _Controller()


@asynccontextmanager
async def serving(metrics: Metrics, controller: _Controller) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for the ops app served on an ephemeral port.

    A context manager rather than a fixture: the task group must be entered and
    exited in the same task, which pytest-asyncio does not guarantee for fixtures.
    """
    app = make_ops_app(metrics, controller.status, controller.ready)
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_ops, app, "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            yield client
        tg.cancel_scope.cancel()


async def test_metrics_endpoint(metrics: Metrics, controller: _Controller) -> None:
    metrics.is_leader.set(1)
    async with serving(metrics, controller) as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert "controllerd_is_leader 1.0" in response.text
    assert 'controllerd_audit_messages_total{outcome="dropped"} 0.0' in response.text


async def test_healthz(metrics: Metrics, controller: _Controller) -> None:
    async with serving(metrics, controller) as client:
        response = await client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


async def test_readyz_follows_ready_callback(metrics: Metrics, controller: _Controller) -> None:
    async with serving(metrics, controller) as client:
        assert (await client.get("/readyz")).status_code == 503
        controller.is_ready = True
        assert (await client.get("/readyz")).status_code == 200


async def test_status_is_the_controllers_mapping(metrics: Metrics, controller: _Controller) -> None:
    controller.snapshot = {
        "leader": True,
        "fencing_token": 42,
        "topics": ["t/ns/a"],
        "last_decision_at": datetime(2026, 1, 2, 3, 4, 5),  # not JSON: rendered as text
    }
    async with serving(metrics, controller) as client:
        response = await client.get("/status")
    assert response.status_code == 200
    assert response.json() == {
        "leader": True,
        "fencing_token": 42,
        "topics": ["t/ns/a"],
        "last_decision_at": "2026-01-02 03:04:05",
    }


async def test_serving_leaves_signals_alone_and_stops_on_cancel(
    metrics: Metrics, controller: _Controller
) -> None:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    app = make_ops_app(metrics, controller.status, controller.ready)
    # A hang guard, not a timing (a wall-clock bound fails on a loaded host): the
    # server must stop on cancel although a client holds a keep-alive connection.
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            port = await tg.start(serve_ops, app, "127.0.0.1", 0)
            async with httpx.AsyncClient() as client:  # keeps an idle keep-alive connection
                assert (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
                assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
                tg.cancel_scope.cancel()
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


async def test_busy_port_raises(metrics: Metrics, controller: _Controller) -> None:
    app = make_ops_app(metrics, controller.status, controller.ready)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError):
            await serve_ops(app, "127.0.0.1", other.getsockname()[1])


# --- logging ------------------------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Undo configure_logging: the root logger and structlog are process-global."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(False)
    structlog.reset_defaults()


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.mark.usefixtures("restore_logging")
def test_json_logs_are_events_with_fields() -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream)
    structlog.get_logger("controllerd.test").info("segment.split", topic="t/ns/a", reason="cpu")
    (line,) = _lines(stream)
    assert line["event"] == "segment.split"
    assert line["topic"] == "t/ns/a"
    assert line["reason"] == "cpu"
    assert line["level"] == "info"
    assert line["logger"] == "controllerd.test"
    assert datetime.fromisoformat(line["timestamp"]).tzinfo is not None


@pytest.mark.usefixtures("restore_logging")
def test_stdlib_logging_is_json_too() -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream)
    logging.getLogger("aiokafka").warning("Unable connect to %s", "node-1")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("uvicorn.error").exception("request failed")
    first, second = _lines(stream)
    assert first["event"] == "Unable connect to node-1"
    assert first["logger"] == "aiokafka"
    assert first["level"] == "warning"
    assert second["level"] == "error"
    assert "ValueError: boom" in second["exception"]


@pytest.mark.usefixtures("restore_logging")
def test_uvicorn_loggers_configured_by_uvicorn_are_routed_back() -> None:
    logging.config.dictConfig(uvicorn.config.LOGGING_CONFIG)  # what any uvicorn.run() does
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream)
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 1)
    assert _lines(stream)[0]["event"] == "Started server process [1]"


@pytest.mark.usefixtures("restore_logging")
def test_reconfiguring_replaces_the_handler_and_level() -> None:
    first, second = io.StringIO(), io.StringIO()
    log = structlog.get_logger("controllerd.test")  # created before configuration
    configure_logging("debug", "json", stream=first)
    configure_logging("warning", "json", stream=second)  # SIGHUP with a new level
    log.info("tick.skipped")
    logging.getLogger("etcd3aio").info("connected")
    log.warning("watch.restarted", attempt=2)
    assert first.getvalue() == ""
    assert [line["event"] for line in _lines(second)] == ["watch.restarted"]


@pytest.mark.usefixtures("restore_logging")
def test_auto_format_is_console_on_a_terminal_only() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Terminal(), io.StringIO()
    configure_logging("info", "auto", stream=tty)
    structlog.get_logger().info("leader.elected", token=7)
    assert "leader.elected" in tty.getvalue()
    with pytest.raises(json.JSONDecodeError):
        json.loads(tty.getvalue())
    configure_logging("info", "auto", stream=pipe)
    structlog.get_logger().info("leader.elected", token=7)
    assert _lines(pipe)[0]["token"] == 7


def test_unknown_level_is_rejected() -> None:
    with pytest.raises(ValueError, match="log level"):
        configure_logging("verbose", "json", stream=io.StringIO())
