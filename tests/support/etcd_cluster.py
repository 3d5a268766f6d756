"""A real three-member etcd cluster whose members can be cut off from each other.

What a single etcd cannot show: a member that still answers its clients but has
lost the quorum (a network partition between etcd hosts), or one member frozen
while the others serve. Peer traffic passes one proxy per member: member ``i``
advertises its proxy's address, so every connection *to* ``i`` passes proxy
``i``, and a connection *from* ``i`` is recognised by the ``X-Server-From``
header etcd's rafthttp puts on every peer request. :meth:`EtcdCluster.isolate`
holds (never resets) both kinds, so ``i`` sees its peers go silent, as on a
path whose packets vanish; :meth:`EtcdCluster.heal` lets the held bytes through.

The proxies run on an event loop of their own in a thread, so the cluster can
outlive one test's loop. Hand-written on asyncio streams, like
:mod:`tests.support.proxy`: no maintained library sniffs a header and holds a
connection frozen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import IO

from tests.support.etcd import ETCD_BINARY, READY_TIMEOUT, STOP_TIMEOUT, _free_port

CHUNK = 65536
#: rafthttp names the sending member (hex id) on every peer request.
_SERVER_FROM = re.compile(rb"X-Server-From: ([0-9a-f]+)")
#: How often a held pump looks whether it may go on (proxy-internal, not a test tick).
_HOLD_POLL = 0.02


class _PeerProxy:
    """Forwards one member's peer port; holds a connection while :attr:`held` says so."""

    def __init__(self, cluster: EtcdCluster, member: int) -> None:
        self.cluster = cluster
        self.member = member
        self.target = cluster.peer_ports[member]
        self.port = _free_port()
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    def _held(self, sender: list[str | None]) -> bool:
        cut = self.cluster.isolated
        return self.member in cut or any(
            sender[0] == self.cluster.ids.get(other) for other in cut if other != self.member
        )

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        sender: list[str | None] = [None]
        await asyncio.gather(
            self._pump(reader, up_writer, sender, sniff=True),
            self._pump(up_reader, writer, sender, sniff=False),
            return_exceptions=True,
        )

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        sender: list[str | None],
        *,
        sniff: bool,
    ) -> None:
        try:
            while data := await reader.read(CHUNK):
                if sniff and sender[0] is None:
                    found = _SERVER_FROM.search(data)
                    sender[0] = found.group(1).decode() if found else ""
                while self._held(sender):  # noqa: ASYNC110 - set by the test thread
                    await asyncio.sleep(_HOLD_POLL)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()


class EtcdCluster:
    """Three etcd members on loopback, each with a peer proxy; see the module doc.

    Invariant: after :meth:`start` returns, every member is healthy (has a leader).
    """

    def __init__(self, root: Path, size: int = 3) -> None:
        self.root = root
        self.size = size
        self.client_ports = [_free_port() for _ in range(size)]
        self.peer_ports = [_free_port() for _ in range(size)]
        self.endpoints = [f"http://127.0.0.1:{port}" for port in self.client_ports]
        #: member index -> hex member id, known once started
        self.ids: dict[int, str] = {}
        #: members whose peer traffic is held
        self.isolated: set[int] = set()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._proxies = [_PeerProxy(self, i) for i in range(size)]

    def start(self) -> None:
        self._thread.start()
        for proxy in self._proxies:
            self._call(proxy.start()).result(timeout=5)
        initial = ",".join(
            f"m{i}=http://127.0.0.1:{proxy.port}" for i, proxy in enumerate(self._proxies)
        )
        for i in range(self.size):
            log = (self.root / f"m{i}.log").open("ab")
            self._logs.append(log)
            self._procs.append(
                subprocess.Popen(
                    [
                        ETCD_BINARY,
                        "--name",
                        f"m{i}",
                        "--data-dir",
                        str(self.root / f"m{i}"),
                        "--listen-client-urls",
                        self.endpoints[i],
                        "--advertise-client-urls",
                        self.endpoints[i],
                        "--listen-peer-urls",
                        f"http://127.0.0.1:{self.peer_ports[i]}",
                        "--initial-advertise-peer-urls",
                        f"http://127.0.0.1:{self._proxies[i].port}",
                        "--initial-cluster",
                        initial,
                        "--initial-cluster-state",
                        "new",
                        "--heartbeat-interval",
                        "50",
                        "--election-timeout",
                        "500",
                        "--pre-vote",
                        "--logger",
                        "zap",
                        "--log-outputs",
                        "stderr",
                    ],
                    stdout=log,
                    stderr=log,
                    env={**os.environ, "ETCD_UNSUPPORTED_ARCH": os.uname().machine},
                )
            )
        self.wait_healthy(range(self.size))
        body = self._post(0, "/v3/cluster/member/list")
        by_name = {m["name"]: format(int(m["ID"]), "x") for m in body["members"]}
        self.ids = {i: by_name[f"m{i}"] for i in range(self.size)}

    def wait_healthy(self, members: range | list[int]) -> None:
        """Return once each of ``members`` says it is healthy (has a leader)."""
        deadline = time.monotonic() + READY_TIMEOUT
        pending = set(members)
        while pending:
            for i in sorted(pending):
                if self._procs[i].poll() is not None:
                    raise RuntimeError(f"etcd m{i} exited; see {self.root / f'm{i}.log'}")
                try:
                    with urllib.request.urlopen(f"{self.endpoints[i]}/health", timeout=1) as r:
                        if b'"true"' in r.read():
                            pending.discard(i)
                except (OSError, urllib.error.URLError):
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"etcd members {sorted(pending)} not healthy; see {self.root}")
            if pending:
                time.sleep(0.1)

    def watchers(self, member: int) -> int:
        """How many watches ``member`` serves now (its own gauge, from /metrics)."""
        with urllib.request.urlopen(f"{self.endpoints[member]}/metrics", timeout=2) as resp:
            text = resp.read().decode()
        found = re.search(r"^etcd_debugging_mvcc_watcher_total (\S+)$", text, re.MULTILINE)
        return int(float(found.group(1))) if found else 0

    def isolate(self, member: int) -> None:
        """Hold every peer connection to and from ``member``; its clients still connect."""
        self.isolated.add(member)

    def heal(self) -> None:
        self.isolated.clear()

    def pause(self, member: int) -> None:
        """Freeze ``member`` (SIGSTOP): its connections stay open and nothing answers."""
        self._procs[member].send_signal(signal.SIGSTOP)

    def resume(self, member: int) -> None:
        self._procs[member].send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.isolated.clear()
        for proc in self._procs:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_TIMEOUT)
        for log in self._logs:
            log.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _call(self, coro: object) -> Future[None]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]

    def _post(self, member: int, path: str) -> dict[str, list[dict[str, str]]]:
        request = urllib.request.Request(self.endpoints[member] + path, data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=2) as resp:
            result: dict[str, list[dict[str, str]]] = json.loads(resp.read())
        return result


@contextlib.contextmanager
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A started :class:`EtcdCluster` in a temporary directory, gone after."""
    root = Path(tempfile.mkdtemp(prefix="controllerd-etcd-cluster-"))
    cluster = EtcdCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
