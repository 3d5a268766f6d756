"""A stand-in for systemd's notification socket, for daemons run as subprocesses.

systemd gives a ``Type=notify`` service ``$NOTIFY_SOCKET``, a unix datagram socket it
listens on; the service sends ``KEY=VALUE`` lines (``READY=1``, ``WATCHDOG=1``, ...).
:class:`NotifySocket` binds such a socket and lets a test wait, with a deadline, for
the next message that assigns a given key, in the order the daemon sent them.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import anyio

#: Longest ``sun_path`` Linux accepts, including the terminating NUL.
_SUN_PATH_MAX = 108


def parse(datagram: bytes) -> dict[str, str]:
    """One sd_notify datagram as a dict: newline-separated ``KEY=VALUE`` assignments."""
    message: dict[str, str] = {}
    for line in datagram.decode().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            message[key] = value
    return message


class NotifySocket:
    """A bound unix datagram socket; every message received is kept in :attr:`messages`.

    :meth:`expect` consumes messages in arrival order: after it returns a message,
    the next call only looks at messages that came later, so a sequence of calls
    asserts the order of the daemon's notifications.
    """

    def __init__(self, sock: socket.socket, path: Path) -> None:
        self._sock = sock
        self.path = path
        self.messages: list[dict[str, str]] = []
        #: ``time.monotonic()`` at which each message of :attr:`messages` was read.
        self.received_at: list[float] = []
        self._cursor = 0

    @property
    def env(self) -> Mapping[str, str]:
        """The environment that points a child process at this socket."""
        return {"NOTIFY_SOCKET": str(self.path)}

    async def _receive(self) -> None:
        await anyio.wait_readable(self._sock)
        while True:
            try:
                datagram = self._sock.recv(4096)
            except BlockingIOError:
                return
            self.messages.append(parse(datagram))
            self.received_at.append(time.monotonic())

    async def expect(self, key: str, value: str = "1", *, within: float) -> dict[str, str]:
        """The next message assigning ``key=value``; fails after ``within`` seconds.

        Messages skipped on the way (e.g. watchdog pings) stay in :attr:`messages`.
        """
        with anyio.fail_after(within):
            while True:
                while self._cursor < len(self.messages):
                    message = self.messages[self._cursor]
                    self._cursor += 1
                    if message.get(key) == value:
                        return message
                await self._receive()

    async def expect_where(
        self, key: str, predicate: Callable[[str], bool], *, within: float
    ) -> dict[str, str]:
        """The next message assigning ``key`` a value ``predicate`` accepts (e.g. a STATUS=
        line, whose text carries details that change)."""
        with anyio.fail_after(within):
            while True:
                while self._cursor < len(self.messages):
                    message = self.messages[self._cursor]
                    self._cursor += 1
                    if key in message and predicate(message[key]):
                        return message
                await self._receive()

    def times(self, key: str, value: str = "1") -> list[float]:
        """When each message so far assigning ``key=value`` was read (consumes none)."""
        return [
            t for m, t in zip(self.messages, self.received_at, strict=True) if m.get(key) == value
        ]


@contextlib.contextmanager
def notify_socket(directory: Path) -> Iterator[NotifySocket]:
    """A :class:`NotifySocket` bound at ``directory/notify.sock``, closed on exit."""
    path = directory / "notify.sock"
    if len(str(path).encode()) >= _SUN_PATH_MAX:
        raise ValueError(f"socket path too long for AF_UNIX: {path}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.bind(str(path))
        sock.setblocking(False)
        try:
            yield NotifySocket(sock, path)
        finally:
            path.unlink(missing_ok=True)
