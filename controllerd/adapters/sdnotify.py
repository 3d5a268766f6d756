"""Minimal systemd ``sd_notify(3)`` client for ``Type=notify`` / ``notify-reload`` units.

The protocol is one datagram of newline-separated ``KEY=VALUE`` assignments sent
to the unix socket named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the
abstract namespace), so it is written out here rather than taken from a
library: ``python-systemd`` needs the libsystemd headers and a C compiler to
install, and ``sdnotify`` on PyPI is unmaintained (no abstract sockets, no
``MONOTONIC_USEC``).

Every function is a no-op returning False when not run under systemd, and never
raises for a missing or unreachable socket: supervision must not take the
daemon down. The socket is non-blocking, so a stuck manager cannot stall the
event loop (a full queue just makes :func:`notify` return False).
"""

from __future__ import annotations

import os
import socket
import time


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to ``$NOTIFY_SOCKET``; True when sent.

    False when the variable is unset or empty, names an unsupported address
    family (e.g. ``vsock:``), or the datagram could not be sent.
    """
    address = os.environ.get("NOTIFY_SOCKET", "")
    if address.startswith("@"):
        address = "\0" + address[1:]  # Linux abstract namespace
    elif not address.startswith("/"):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            # STATUS= text may hold anything; no character may make this raise
            sock.sendto(state.encode(errors="backslashreplace"), address)
    except OSError:
        return False
    return True


def ready() -> bool:
    """Startup (or a reload) finished: systemd considers the unit active."""
    return notify("READY=1")


def stopping() -> bool:
    """Shutdown has begun; systemd waits for exit up to ``TimeoutStopSec``."""
    return notify("STOPPING=1")


def reloading() -> bool:
    """A reload has begun (``Type=notify-reload``); send :func:`ready` when done.

    ``MONOTONIC_USEC`` is CLOCK_MONOTONIC in microseconds, which systemd requires
    to match this message with the reload it started.
    """
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")


def watchdog() -> bool:
    """Keep-alive ping for ``WatchdogSec=``; send every :func:`watchdog_interval` / 2."""
    return notify("WATCHDOG=1")


def status(text: str) -> bool:
    """One-line status shown by ``systemctl status`` (newlines are flattened)."""
    return notify("STATUS=" + " ".join(text.splitlines()))


def watchdog_interval() -> float | None:
    """Seconds within which systemd expects a :func:`watchdog` ping, or None if disabled.

    From ``$WATCHDOG_USEC``; None when unset, not a positive integer, or when
    ``$WATCHDOG_PID`` is set to another process (the watchdog is not ours: we were
    forked by the supervised process, or the variable was inherited).
    """
    pid = os.environ.get("WATCHDOG_PID")
    if pid is not None:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 1_000_000 if usec > 0 else None
