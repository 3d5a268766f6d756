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
        OperatorError: the file cannot be read, or :func:`secret_problem` (EXIT_USAGE),
            naming ``setting``.
    """
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise OperatorError(f"cannot read {path}: {exc.strerror or exc}", setting=setting) from None
    problem = secret_problem(data)
    if problem is not None:
        raise OperatorError(f"{path} {problem}", setting=setting)
    return data.decode("utf-8").strip()


def secret_problem(data: bytes) -> str | None:
    """Why these bytes cannot be a password or a bearer token, or None.

    A secret is one non-empty line of UTF-8 (a trailing newline is fine): a second
    line would go into an HTTP header or a gRPC call and fail there, later.
    """
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text ({exc.reason})"
    if not text:
        return "is empty"
    if "\n" in text or "\r" in text:
        return "must hold one line"
    return None
