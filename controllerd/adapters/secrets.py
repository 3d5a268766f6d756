"""Secrets read from files (systemd credentials, EnvironmentFile, Kubernetes Secrets).

One reader for every command that needs the etcd password or the broker token,
so a missing or unreadable file is the same one-line operator error everywhere.
"""

from __future__ import annotations

from pathlib import Path

from controllerd.errors import OperatorError


def read_secret(path: str | None, setting: str) -> str | None:
    """The file's text without surrounding whitespace; None when no file is configured.

    Raises:
        OperatorError: the file cannot be read or is not UTF-8 (EXIT_USAGE), naming
            ``setting``.
    """
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise OperatorError(f"cannot read {path}: {reason}", setting=setting) from None
