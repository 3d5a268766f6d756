"""The files a config names: secrets (systemd credentials, EnvironmentFile, Kubernetes
Secrets), CA bundles, client certificates and keys.

One reader for every command that needs the etcd password or the broker token,
so a missing or unreadable file is the same one-line operator error everywhere;
one check of every named file, for ``check-config``, start and SIGHUP alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from controllerd.config import header_safe
from controllerd.errors import OperatorError
from controllerd.files import read_regular

if TYPE_CHECKING:
    from controllerd.config import Config


def read_secret(path: str | None, setting: str, *, header: bool = False) -> str | None:
    """The file's text without surrounding whitespace; None when no file is configured.
    ``header``: the secret goes in an HTTP header (a bearer token).

    Raises:
        OperatorError: the file cannot be read, or :func:`secret_problem` (EXIT_USAGE),
            naming ``setting``.
    """
    if path is None:
        return None
    try:
        data = read_regular(path)
    except OSError as exc:
        raise OperatorError(f"cannot read {path}: {exc.strerror or exc}", setting=setting) from None
    problem = secret_problem(data, header=header)
    if problem is not None:
        raise OperatorError(f"{path} {problem}", setting=setting)
    return data.decode("utf-8").strip()


def secret_problem(data: bytes, *, header: bool = False) -> str | None:
    """Why these bytes cannot be a password or (``header``) a bearer token, or None.

    A secret is one non-empty line of UTF-8 (a trailing newline is fine): a second
    line would go into an HTTP header or a gRPC call and fail there, later. A bearer
    token goes in an HTTP header as is, so it must also be printable ASCII: httpx
    refused any other when it built each request, and every broker call failed.
    """
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text ({exc.reason})"
    if not text:
        return "is empty"
    if "\n" in text or "\r" in text:
        return "must hold one line"
    if header and not header_safe(text):
        return "must be printable ASCII (a bearer token goes in an HTTP header)"
    return None


def _referenced_files(cfg: Config) -> Iterator[tuple[str, str, str]]:
    """(setting, path, kind) of every file the config names; kind: secret, ca, cert, key."""
    for table in ("etcd", "broker"):
        settings = getattr(cfg, table)
        secret = "password_file" if table == "etcd" else "token_file"
        for name, kind in (
            (secret, "secret"),
            ("ca_file", "ca"),
            ("cert_file", "cert"),
            ("key_file", "key"),
        ):
            path = getattr(settings, name)
            if path is not None:
                yield f"{table}.{name}", path, kind


def config_file_errors(cfg: Config) -> list[str]:
    """Every file the config names that cannot serve its purpose, as ``setting: why``.

    Each file is opened and read (as the daemon will, later, as this same user):
    secrets must be non-empty, CA bundles must load as PEM certificates, and a
    client certificate must load with its key. ``run`` and ``status`` call this
    before they start anything, the daemon on every SIGHUP; ``check-config`` reports
    it with the config's own errors. Reads files only; changes nothing.
    """
    import ssl  # here, not at the top: decide must start fast

    errors: list[str] = []
    readable: dict[str, str] = {}
    for setting, path, kind in _referenced_files(cfg):
        try:
            data = read_regular(path)
        except OSError as exc:
            errors.append(f"{setting}: cannot read {path}: {exc.strerror or exc}")
            continue
        readable[setting] = path
        if (
            kind == "secret"
            and (problem := secret_problem(data, header=setting == "broker.token_file")) is not None
        ):
            errors.append(f"{setting}: {path} {problem}")
        elif kind == "ca":
            try:
                ssl.create_default_context(cafile=path)
            except (ssl.SSLError, ValueError) as exc:
                errors.append(f"{setting}: {path} is not a PEM CA bundle: {_ssl_reason(exc)}")
    for table in ("etcd", "broker"):
        cert, key = f"{table}.cert_file", f"{table}.key_file"
        if cert in readable and key in readable:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            try:
                # An empty password: an encrypted key fails here instead of OpenSSL
                # prompting on the terminal (a daemon has none).
                context.load_cert_chain(readable[cert], readable[key], password="")
            except (ssl.SSLError, ValueError, OSError) as exc:
                errors.append(
                    f"{cert}: {readable[cert]} and {key} {readable[key]} do not load as a "
                    f"PEM certificate and its unencrypted private key: {_ssl_reason(exc)}"
                )
    from controllerd.adapters.store import endpoints_problem

    if (problem := endpoints_problem(cfg.etcd.endpoints)) is not None:
        errors.append(f"etcd.endpoints: {problem}")
    if cfg.etcd.username is not None and cfg.etcd.password_file is None:
        errors.append("etcd.password_file: must be set when etcd.username is")
    if cfg.etcd.password_file is not None and cfg.etcd.username is None:
        errors.append("etcd.username: must be set when etcd.password_file is")
    return errors


def _ssl_reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)  # ssl.SSLError's library reason code
    if isinstance(reason, str) and reason:
        return reason
    return " ".join(str(exc).split()) or type(exc).__name__
