"""A real single-node etcd for tests: started once per session, restartable per test.

``/usr/bin/etcd`` (Debian's 3.4) runs on free loopback ports with a temporary
data dir and fast raft timings (``--heartbeat-interval 10 --election-timeout
100``), so it is ready in well under a second and restarts keep their data.
Each test gets its own key prefix, so tests never see each other's keys.

Usage in a test module::

    from tests.support.etcd import (  # noqa: F401 - fixtures
        etcd_prefix_fixture,
        etcd_server_fixture,
        store_fixture,
    )

    async def test_x(store: Store, etcd_prefix: str) -> None: ...

The fixtures are named ``etcd_server``, ``etcd_prefix`` and ``store``; their
functions carry a ``_fixture`` suffix so that importing them does not make ruff
report every test parameter of that name as a redefinition (F811). The plain
names are exported too (``from tests.support.etcd import etcd_server, store``)
for modules that do not mind.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import anyio
import pytest
from etcd3aio import Etcd3Client

from controllerd.adapters.store import (
    KeyValue,
    Store,
    StoreError,
    StoreUnavailable,
    WatchEvent,
    open_store,
)

ETCD_BINARY = "/usr/bin/etcd"
#: Seconds to wait for etcd to answer /health after (re)start; it needs ~0.3 s.
READY_TIMEOUT = 15.0
#: Seconds to wait for a graceful stop before killing.
STOP_TIMEOUT = 10.0


@dataclass(frozen=True)
class Pki:
    """PEM files for mutual TLS: a CA, a server cert for 127.0.0.1, a client cert."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_pki(directory: Path) -> Pki:
    """Throwaway certificates (EC P-256, one day) made with the openssl CLI."""
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=controllerd-test-ca",
    )
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        (directory / f"{name}.ext").write_text(
            f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n"
        )
        run(
            "req",
            *ec,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=controllerd-test-{name}",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
        )
    return Pki(
        *(directory / f for f in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key"))
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EtcdServer:
    """One etcd process on fixed ports and a fixed data dir, so it can be restarted.

    Invariant: after :meth:`start` returns, etcd has a raft leader and serves
    client requests on :attr:`endpoint`.
    """

    def __init__(self, data_dir: Path, pki: Pki | None = None) -> None:
        self.data_dir = data_dir
        self.pki = pki
        self.client_port = _free_port()
        self.peer_port = _free_port()
        scheme = "https" if pki else "http"
        self.endpoint = f"{scheme}://127.0.0.1:{self.client_port}"
        self._log_path = data_dir.parent / "etcd.log"
        self._log: IO[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start etcd (again) on the same ports and data dir; return once it is healthy.

        A paused etcd is resumed.
        """
        if self.running:
            self.resume()
            return
        peer = f"http://127.0.0.1:{self.peer_port}"
        if self._log is None:
            self._log = self._log_path.open("ab")
        self._proc = subprocess.Popen(
            [
                ETCD_BINARY,
                "--name",
                "default",
                "--data-dir",
                str(self.data_dir),
                "--listen-client-urls",
                self.endpoint,
                "--advertise-client-urls",
                self.endpoint,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"default={peer}",
                "--heartbeat-interval",
                "10",
                "--election-timeout",
                "100",
                "--logger",
                "zap",
                "--log-outputs",
                "stderr",
                *self._tls_flags(),
            ],
            stdout=self._log,
            stderr=self._log,
            env={**os.environ, "ETCD_UNSUPPORTED_ARCH": os.uname().machine},
        )
        self._wait_ready()

    def _tls_flags(self) -> list[str]:
        if self.pki is None:
            return []
        return [
            "--cert-file",
            str(self.pki.server_cert),
            "--key-file",
            str(self.pki.server_key),
            "--client-cert-auth",
            "--trusted-ca-file",
            str(self.pki.ca),
        ]

    def _wait_ready(self) -> None:
        """Readiness probe: poll ``/health`` in a short bounded loop (not a tick)."""
        context = None
        if self.pki is not None:
            context = ssl.create_default_context(cafile=str(self.pki.ca))
            context.load_cert_chain(self.pki.client_cert, self.pki.client_key)
        deadline = time.monotonic() + READY_TIMEOUT
        for attempt in itertools.count():
            if self._proc is not None and self._proc.poll() is not None:
                code = self._proc.returncode
                raise RuntimeError(f"etcd exited with {code}; see {self._log_path}")
            try:
                url = f"{self.endpoint}/health"
                with urllib.request.urlopen(url, timeout=1.0, context=context) as resp:
                    if b'"true"' in resp.read():
                        return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not healthy after {READY_TIMEOUT}s; see {self._log_path}")
            time.sleep(min(0.2, 0.01 * 2**attempt))

    def pause(self) -> None:
        """Freeze etcd (SIGSTOP): connections stay open and nothing answers, as in a
        long GC pause, a hung disk or a VM migration."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused etcd run again (SIGCONT)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop etcd gracefully (SIGTERM), as an operator restart would."""
        self._terminate(signal.SIGTERM)

    def kill(self) -> None:
        """Kill etcd abruptly (SIGKILL), as a crash would."""
        self._terminate(signal.SIGKILL)

    def _terminate(self, sig: signal.Signals) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)  # a paused etcd cannot act on SIGTERM
        proc.send_signal(sig)
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        self.kill()
        if self._log is not None:
            self._log.close()
            self._log = None


@contextlib.contextmanager
def scratch_etcd(prefix: str) -> Iterator[tuple[Path, EtcdServer]]:
    """A fresh etcd of its own in a new temporary directory, and that directory
    (the benches': their numbers must not depend on what a shared one holds); both
    are gone after."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    etcd = EtcdServer(root / "etcd")
    try:
        etcd.start()
        yield root, etcd
    finally:
        etcd.close()
        shutil.rmtree(root, ignore_errors=True)


class _Shared:
    """The session's one etcd, created by the first test that asks for it."""

    server: EtcdServer | None = None


def _shared_server(config: pytest.Config) -> EtcdServer:
    if _Shared.server is None:
        root = Path(tempfile.mkdtemp(prefix="controllerd-etcd-"))
        server = EtcdServer(root / "data")

        def shutdown() -> None:
            server.close()
            shutil.rmtree(root, ignore_errors=True)

        config.add_cleanup(shutdown)
        _Shared.server = server
    return _Shared.server


@pytest.fixture(name="etcd_server")
def etcd_server_fixture(request: pytest.FixtureRequest) -> Iterator[EtcdServer]:
    """The session's etcd (started once), running when the test starts and after it ends.

    Self-contained so that test modules can import it by name.
    """
    server = _shared_server(request.config)
    server.start()
    yield server
    server.start()


_prefixes = itertools.count()


@pytest.fixture(name="etcd_prefix")
def etcd_prefix_fixture(request: pytest.FixtureRequest) -> str:
    """A key prefix no other test uses, e.g. ``/t/3-test_put_get/``."""
    return f"/t/{next(_prefixes)}-{request.node.name}/"


@pytest.fixture(name="store")
async def store_fixture(etcd_server: EtcdServer) -> AsyncIterator[Store]:
    """A :class:`Store` on the test etcd, with short retries so failures surface fast."""
    async with open_store([etcd_server.endpoint], timeout=2.0, retry_for=5.0) as opened:
        yield opened


etcd_server = etcd_server_fixture
etcd_prefix = etcd_prefix_fixture
store = store_fixture


async def compact(endpoint: str, revision: int) -> None:
    """Compact etcd's history up to ``revision`` (Store has no compaction on purpose)."""
    async with Etcd3Client([endpoint.removeprefix("http://")]) as client:
        assert client.kv is not None
        await client.kv.compact(revision, physical=True)


class FailingStore:
    """The real store, except that the first watch waits for ``release`` and then
    fails with an error etcd can answer but a test cannot provoke on demand (the
    watch cancelled), and the first read after ``fail_reads`` is set fails as an
    unreachable etcd does. Pass it where a :class:`Store` is expected with
    ``cast(Store, failing)``: it has only ``get_prefix`` and ``watch_prefix``."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.release = anyio.Event()
        self.watches = 0
        self.fail_reads = False
        self.failed_reads = 0

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        if self.fail_reads and not self.failed_reads:
            self.failed_reads += 1
            raise StoreUnavailable("KV.Range: etcd unavailable for 0.5s (injected)")
        return await self.store.get_prefix(prefix)

    async def watch_prefix(
        self, prefix: str, start_revision: int
    ) -> AsyncGenerator[list[WatchEvent], None]:
        self.watches += 1
        if self.watches == 1:
            await self.release.wait()
            raise StoreError("watch cancelled by etcd: injected")
        async with aclosing(self.store.watch_prefix(prefix, start_revision)) as batches:
            async for batch in batches:
                yield batch
