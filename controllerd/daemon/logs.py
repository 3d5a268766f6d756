"""Structured logging: one JSON object per line in production, for every logger.

controllerd logs with structlog, events as names plus fields
(``log.info("segment.split", topic=..., reason=...)``). Libraries (uvicorn,
aiokafka, etcd3aio, asyncio) log through the stdlib :mod:`logging`; both go to a
single stdlib handler whose :class:`structlog.stdlib.ProcessorFormatter` renders
them identically, so a log shipper sees one format.

structlog's own configuration never changes between calls; only the root
logger's level and our handler do. That makes :func:`configure_logging` safe to
call again (SIGHUP with a new level) and keeps already-created loggers valid.
Every call also holds the per-request loggers in :data:`QUIET` at WARNING, so
no reconfiguration can turn probes, scrapes or broker requests into log lines.
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Final

import structlog
from structlog.typing import Processor

FORMATS: Final = ("auto", "json", "console")

_LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

# Processors shared by structlog events and stdlib records (the "foreign pre-chain").
_SHARED: Final[list[Processor]] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


# Loggers that uvicorn's default dictConfig gives their own handlers and
# propagate=False (any uvicorn.run() in the process does it): routed back to root.
_SELF_CONFIGURED: Final = ("uvicorn", "uvicorn.error", "uvicorn.access")

#: Loggers held at WARNING whatever ``[logging] level`` says, on every call:
#: ``uvicorn.access`` logs each probe and scrape (several a second across a
#: fleet), ``httpx``/``httpcore`` each broker admin request at INFO; the daemon
#: logs what matters of both itself (``operation.*``, metrics). Their warnings
#: and errors still go through.
QUIET: Final = ("uvicorn.access", "httpx", "httpcore")


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the root handler this module owns, so a reconfiguration replaces only it."""


def configure_logging(
    level: str = "info", fmt: str = "auto", stream: IO[str] | None = None
) -> None:
    """Route structlog and stdlib logging to ``stream`` (default: ``sys.stderr`` now).

    ``level`` is one of debug, info, warning, error; ``fmt`` one of :data:`FORMATS`
    (plain ``str``s, as ``LoggingSettings`` holds them). ``fmt="auto"`` picks the
    human console renderer when ``stream`` is a terminal and JSON otherwise.
    Idempotent: a second call replaces the handler of the first, never adds one;
    handlers installed by others (e.g. pytest's capture) are left alone.

    Raises:
        ValueError: unknown ``level`` or ``fmt``.
    """
    try:
        numeric_level = _LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; expected one of {list(_LEVELS)}") from None
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; expected one of {list(FORMATS)}")
    out = sys.stderr if stream is None else stream
    console = fmt == "console" or (fmt == "auto" and _isatty(out))

    renderer: list[Processor]
    if console:
        renderer = [structlog.dev.ConsoleRenderer(colors=_isatty(out))]
    else:
        renderer = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *_SHARED,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: a module-level logger used before configure_logging() must
        # still pick up this configuration.
        cache_logger_on_first_use=False,
    )

    handler = _Handler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=_SHARED,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric_level)
    for name in _SELF_CONFIGURED:
        library_logger = logging.getLogger(name)
        for own in list(library_logger.handlers):
            library_logger.removeHandler(own)
        library_logger.propagate = True
        library_logger.setLevel(logging.NOTSET)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.captureWarnings(True)


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
