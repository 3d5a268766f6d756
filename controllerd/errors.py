"""Exit statuses and the one exception type for mistakes an operator can fix.

Every ``controllerd`` command ends with one of these statuses (docs/operations.md
lists them per command). An :class:`OperatorError` is printed as one line naming
the cause and, where there is one, the setting to change; never as a traceback.
Anything else that escapes a command is a bug (:data:`EXIT_SOFTWARE`):
``controllerd.cli.main`` prints :func:`internal_error_line` and, only when
:data:`DEBUG_ENV` is ``1``, the traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

EXIT_OK: Final = 0
"""Done; for ``run``: stopped on request (SIGTERM, SIGINT)."""
EXIT_FAILED: Final = 1
"""A check failed: ``check-config`` found errors, ``status`` found no leader."""
EXIT_USAGE: Final = 2
"""Bad usage, an invalid config or input file, a setting that cannot work (a busy port)."""
EXIT_UNAVAILABLE: Final = 3
"""A dependency (etcd, Kafka, the broker) could not be reached or refused our credentials."""
EXIT_SOFTWARE: Final = 70
"""An internal error: a bug. The supervisor restarts the daemon; please report it."""
EXIT_INTERRUPTED: Final = 130
"""Interrupted from the terminal (Ctrl-C, SIGINT outside ``run``): 128 + SIGINT, as shells do."""

EXIT_STATUSES: Final[Mapping[int, str]] = {
    EXIT_OK: "success (run: stopped on request)",
    EXIT_FAILED: "a check failed (check-config: errors found; status: no leader), or "
    "standard output closed early (| head)",
    EXIT_USAGE: "bad usage, an invalid config or input file, or a setting that cannot work",
    EXIT_UNAVAILABLE: "etcd, Kafka, the broker or Spark unreachable, or it refused our credentials",
    EXIT_SOFTWARE: "internal error (a bug: please report it)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}
"""Every status a command can end with, in one line each (for ``--help`` and the docs)."""

DEBUG_ENV: Final = "CONTROLLERD_DEBUG"
"""Set to ``1`` to print the traceback of an internal error (never of an operator error)."""


class OperatorError(Exception):
    """Something the operator can fix; printed as ``controllerd: <message>``.

    Attributes:
        exit_code: one of the ``EXIT_*`` statuses above.
        setting: the dotted config setting (or CLI option) to look at, if any.
    """

    def __init__(self, message: str, *, exit_code: int = EXIT_USAGE, setting: str | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.setting = setting

    def line(self) -> str:
        """The one line printed for this error (no newline inside)."""
        text = " ".join(str(self).split())
        if self.setting and self.setting not in text:
            text = f"{text} (setting: {self.setting})"
        return text


def internal_error_line(exc: BaseException) -> str:
    """The one line printed for an unexpected exception: a bug, not the operator's doing."""
    message = " ".join(str(exc).split())
    cause = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return f"internal error: {cause} (a bug: please report it; set {DEBUG_ENV}=1 for the traceback)"


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """An exception's first line (cut at ``limit``), for a one-line message: a JVM or
    parser error goes on for pages; an empty one is named by its type."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:limit]
