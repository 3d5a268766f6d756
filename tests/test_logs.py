"""Logging stays quiet about per-request noise, whatever reconfigures it (SIGHUP).

The real ops server (uvicorn, as ``controllerd run`` serves it) answers real
HTTP requests from a real httpx client; the records that reach our handler are
what a log shipper would receive.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
import structlog

from controllerd.daemon.logs import QUIET, configure_logging
from controllerd.daemon.metrics import Metrics
from controllerd.daemon.ops import make_ops_app, serve_ops


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Undo configure_logging: the root logger, library levels and structlog are global."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    library = {name: logging.getLogger(name) for name in (*QUIET, "uvicorn", "uvicorn.error")}
    saved = {name: (lg.level, lg.propagate, list(lg.handlers)) for name, lg in library.items()}
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    for name, (lvl, propagate, own) in saved.items():
        library[name].setLevel(lvl)
        library[name].propagate = propagate
        library[name].handlers = own
    logging.captureWarnings(False)
    structlog.reset_defaults()


def events(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


async def test_probes_scrapes_and_broker_requests_are_not_logged_after_a_reload() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("info", "json", stream=first)  # start-up
    app = make_ops_app(Metrics(), lambda: {"leader": False}, lambda: True)
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_ops, app, "127.0.0.1", 0)
        configure_logging("debug", "json", stream=second)  # SIGHUP, even to debug
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for path in ("/healthz", "/readyz", "/metrics", "/status"):
                assert (await client.get(path)).status_code == 200
        structlog.get_logger("controllerd.test").info("tick.done")
        logging.getLogger("httpx").warning("connection pool full")
        tg.cancel_scope.cancel()
    seen = [(e["logger"], e["event"]) for e in events(second)]
    noisy = [e for e in seen if e[0].startswith(("uvicorn.access", "httpx", "httpcore"))]
    assert noisy == [("httpx", "connection pool full")], seen
    assert ("controllerd.test", "tick.done") in seen  # debug is on for our own loggers
    for name in QUIET:
        assert logging.getLogger(name).getEffectiveLevel() == logging.WARNING


def test_every_reconfiguration_holds_the_quiet_loggers_at_warning() -> None:
    stream = io.StringIO()
    for level in ("info", "debug", "info"):
        logging.getLogger("uvicorn.access").setLevel(logging.NOTSET)  # as uvicorn leaves it
        configure_logging(level, "json", stream=stream)
        for name in QUIET:
            logging.getLogger(name).info("GET /metrics 200")
    assert stream.getvalue() == ""
