"""A TCP proxy that can cut a network path: between controllerd replicas and etcd.

Stopping etcd (SIGSTOP, kill) cuts every client at once, the test included.
A partition is different: the daemons lose etcd while etcd keeps serving
others, so a test can write to etcd *during* the outage (a consumer
registration, a hot load record) and check what the daemons do with it
afterwards. The replicas are given the proxy's address instead of etcd's.

Modes:

* ``pass``: bytes flow both ways.
* ``blackhole``: connections are accepted but nothing is forwarded, and the
  bytes of existing connections are held (not dropped), as on a path whose
  packets vanish: TCP connections stay open, requests never get answers.
  Healing lets the held bytes through, as TCP retransmission would.
* ``refuse``: the listening socket is closed (connections are refused) and
  every existing connection is reset, as when a firewall rejects.

Hand-written on asyncio streams: a few dozen lines, where no maintained
library offers a proxy that can hold connections frozen and resume them.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["pass", "blackhole", "refuse"]
CHUNK = 65536


@dataclass(eq=False)  # compared and hashed by identity (kept in a set)
class _Link:
    """One client connection and its upstream twin."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def reset(self) -> None:
        """Close both sides at once with an RST (SO_LINGER 0), not a polite FIN."""
        for writer in (self.client, self.upstream):
            if writer is None:
                continue
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream``; :meth:`set_mode` cuts or heals."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.mode: Mode = "pass"
        self.connections = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def set_mode(self, mode: Mode) -> None:
        """Switch mode; from ``refuse`` back to another, listen on the same port again."""
        previous, self.mode = self.mode, mode
        if mode == "pass":
            self._flowing.set()
        else:
            self._flowing.clear()
        if mode == "refuse":
            if self._server is not None:
                self._server.close()
                self._server = None
            for link in list(self._links):
                link.reset()
            self._links.clear()
        elif previous == "refuse":
            await self.start()

    async def close(self) -> None:
        """Stop listening, reset every connection, and wait for their handlers to end."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for link in list(self._links):
            link.reset()
        self._links.clear()
        self._flowing.set()  # held handlers see their link gone and return
        handlers = list(self._handlers)
        if handlers:
            await asyncio.wait(handlers, timeout=5.0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.connections += 1
        link = _Link(writer)
        self._links.add(link)
        try:
            await self._flowing.wait()  # blackhole: accepted, never connected onwards
            if link not in self._links:  # reset meanwhile (refuse, close)
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                link.reset()
                return
            link.upstream = up_writer
            link.tasks = [
                asyncio.create_task(self._pump(reader, up_writer)),
                asyncio.create_task(self._pump(up_reader, writer)),
            ]
            await asyncio.gather(*link.tasks, return_exceptions=True)
        finally:
            self._handlers.discard(task)
            self._links.discard(link)
            for side in (writer, link.upstream):
                if side is not None:
                    side.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy one direction; while not flowing, hold the chunk (and stop reading)."""
        try:
            while data := await reader.read(CHUNK):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()


@contextlib.asynccontextmanager
async def serve_proxy(upstream: str) -> AsyncIterator[TcpProxy]:
    """A running :class:`TcpProxy` in front of ``http://host:port`` ``upstream``."""
    host, _, port = upstream.removeprefix("http://").partition(":")
    proxy = TcpProxy(host, int(port))
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
