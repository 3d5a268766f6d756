"""Exit statuses and the one exception type for mistakes an operator can fix.

Every ``controllerd`` command ends with one of these statuses (docs/operations.md
lists them). An :class:`OperatorError` is printed as one line naming the cause
and, where there is one, the setting to change; never as a traceback. Anything
else that escapes a command is a bug (:data:`EXIT_SOFTWARE`).
"""

from __future__ import annotations

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
