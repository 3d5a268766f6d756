"""sd_notify over a real unix datagram socket standing in for systemd."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from controllerd.adapters import sdnotify


@pytest.fixture
def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A bound datagram socket named by $NOTIFY_SOCKET, as systemd provides."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(1.0)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def test_lifecycle_messages_arrive(manager: socket.socket) -> None:
    assert sdnotify.ready()
    assert manager.recv(4096) == b"READY=1"
    assert sdnotify.watchdog()
    assert manager.recv(4096) == b"WATCHDOG=1"
    assert sdnotify.status("leader\nof 3 topics")
    assert manager.recv(4096) == b"STATUS=leader of 3 topics"
    assert sdnotify.stopping()
    assert manager.recv(4096) == b"STOPPING=1"


def test_reloading_carries_monotonic_usec(manager: socket.socket) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert sdnotify.reloading()
    lines = manager.recv(4096).decode().split("\n")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert lines[0] == "RELOADING=1"
    key, value = lines[1].split("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"controllerd-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(1.0)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.ready()
        assert sock.recv(4096) == b"READY=1"


def test_unset_or_unusable_socket_is_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert sdnotify.ready() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")  # not supported: unix sockets only
    assert sdnotify.ready() is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert sdnotify.ready() is False


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", None, 30.0),
        ("500000", "self", 0.5),
        ("30000000", "other", None),  # the watchdog belongs to another process
        ("30000000", "junk", None),
        (None, None, None),
        ("0", None, None),
        ("-5", None, None),
        ("soon", None, None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    for name, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            pids = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}
            monkeypatch.setenv(name, pids.get(value, value))
    assert sdnotify.watchdog_interval() == expected
