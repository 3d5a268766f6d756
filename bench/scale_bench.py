"""controllerd at 1k, 10k and 100k topics: load, evaluation, memory, stalls, watch rate,
reaction under a write storm and warm takeover (issue #12).

For each N it starts a fresh real etcd (``--quota-backend-bytes`` 8 GiB), writes N
topics (16 active segments with Pulsar-shaped load records, one subscription,
one consumer each; ``tests/support/populate.py``), starts a leader
(``controllerd run``, reference profile, the test broker over real HTTP in this
process, mirroring layouts into etcd) and a standby, and prints:

* in process, no I/O, before anything starts: CPU per key the view's parsing
  boundary takes to load, per load record it follows, and per load record a
  loaded standby's gate adds (the view handing records to ``Controller.note_load``);
* populate time; load time (``/status`` ``metadata.load_seconds``);
* start -> first decision (``controllerd_decisions_total`` > 0; a lone
  replica leads while it loads and decides each topic once it is wholly
  loaded), and -> first *full evaluation*: ``/status`` ``first_pass_remaining``
  is 0, i.e. the view is loaded and every topic was decided at least once;
* RSS per topic: the leader's ``VmRSS`` after the full evaluation minus the RSS
  of a leader of 0 topics (measured first), over N;
* tick: wall time and CPU seconds of the leader from the first decision of the
  next ``autoscale.interval_seconds`` tick to N more decisions;
* the longest event-loop stall (``/status`` ``max_loop_stall_s``), leader
  changes (``controllerd_leader_elections_total`` over both replicas, minus the
  first election) before the takeover phase;
* raw watch rate: a plain Python watcher (``Store.watch_prefix_raw`` only, a
  process of its own) counting a backlog of ``--raw-events`` load-record puts
  written under a prefix no replica watches;
* live burst: ``--raw-events`` load puts written as fast as etcd takes them,
  followed at once by the leader, the standby and a plain watcher of the same
  prefix (the issue's "plain Python etcd client" under a load-record storm):
  each one's events/s, and each replica's as a share of the plain watcher's;
* burst and backlog: the same again with the standby stopped (SIGSTOP); the
  leader's events/s, then the standby's as it works off the whole backlog,
  each as a share of the raw (backlog) watch rate;
* keep-up: a writer process updates K load records/s (transactions of up to
  128 puts every 10 ms; values stay balanced, so no decision is due) for
  ``--step-seconds``; the replica *kept up* when, after the writer stops, its
  ``metadata.revision`` reaches etcd's within 1 s. K climbs ``--rates`` until it
  does not; the highest K kept up is printed over the raw rate;
* reaction p50/p99: consumer registration put -> split request at the broker on
  fresh 1-segment topics while the writer runs at ``--reaction-rate`` writes/s,
  with ``consumer_settle_seconds`` 0.05 (default) and 0 (SIGHUP reload);
* takeover after SIGTERM and after kill -9 of the leader, warm standby: signal
  -> standby leads, -> its first decision, -> its first operation (a split due
  on a topic whose second consumer registered right after the signal, so in
  the leaderless gap), -> its full evaluation; and whether its follower loaded
  anything again (``keys_loaded``).

``--profile DIR`` records the leader with py-spy (start, tick, keep-up), and the
standby while it works off the burst's backlog, and prints the top functions of
each profile.

Usage: python -m bench.scale_bench [--topics 1000,10000,100000] [--profile DIR]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final, cast

import anyio
import anyio.to_thread
import httpx
import orjson
from anyio.streams.memory import MemoryObjectReceiveStream

from controllerd.adapters.audit import AuditSink
from controllerd.adapters.broker import BrokerClient
from controllerd.adapters.store import Put, Store, open_store
from controllerd.core.layout import initial_layout
from controllerd.core.model import TopicName, layout_to_json
from controllerd.core.view import Keys, MetadataView, Outcome, TopicState
from controllerd.daemon.clock import ManualClock
from controllerd.daemon.controller import Controller
from controllerd.daemon.follower import SLICE
from controllerd.daemon.metrics import Metrics
from tests.support.broker import TestBrokerState, layout_json, mirror_into, serve_test_broker
from tests.support.daemon import Replica, write_config
from tests.support.etcd import EtcdServer
from tests.support.harness import make_config
from tests.support.kafka import free_port
from tests.support.populate import (
    TXN_OPS,
    balanced_record,
    populate,
    put_all,
    put_batch,
    topic_names,
    topic_puts,
)

QUOTA_BYTES: Final = 8 * 2**30
TENANT: Final = "scale"
NAMESPACES: Final = 100
#: A replica kept up when it reaches etcd's revision this soon after the writer stops.
KEEP_UP_SECONDS: Final = 1.0
WRITER_SLOT: Final = 0.01
PREFIX: Final = "/bench/"

PHASES: Final = ("tick", "raw-watch", "keep-up", "reaction", "takeover")
GOALS: Final = {
    "first_decision_s": "<= 30 s (100k)",
    "rss_per_topic_kb": "<= 15 KB",
    "rss_mb": "<= 1.5 GB (100k)",
    "leader_changes": "0",
    "max_stall_ms": "<= 100 ms",
    "keep_up_ratio": ">= 80 %",
    "reaction_p99_ms": "<= 100 ms (10k, 5k writes/s)",
    "takeover_kill9_s": "<= TTL + 1 s",
    "takeover_sigterm_s": "<= 1 s",
}


# -- small process helpers ----------------------------------------------------------------


def rss_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    parts = stat[stat.rindex(")") + 2 :].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class Probe:
    """/status and /metrics of one replica over one kept-alive HTTP client."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._client = httpx.AsyncClient(base_url=replica.url, timeout=5.0)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def status(self) -> dict[str, Any] | None:
        try:
            response = await self._client.get("/status")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        body: dict[str, Any] = response.json()
        return body

    async def metrics(self) -> dict[str, float]:
        """Every sample summed over its labels: ``{"controllerd_decisions_total": 12.0, ...}``."""
        try:
            response = await self._client.get("/metrics")
        except httpx.HTTPError:
            return {}
        sums: dict[str, float] = collections.defaultdict(float)
        for line in response.text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                sums[key.partition("{")[0]] += float(value)
        return sums

    async def decisions(self) -> float:
        return (await self.metrics()).get("controllerd_decisions_total", 0.0)


async def first_pass_done(probe: Probe, status: dict[str, Any] | None = None) -> bool:
    """Whether the replica leads, its view is loaded and it evaluated every topic once."""
    status = status if status is not None else await probe.status()
    return bool(status and status.get("leader") and status.get("first_pass_remaining") == 0)


async def poll(
    predicate: Callable[[], Awaitable[bool]], within: float, step: float = 0.05
) -> float | None:
    """Seconds until ``predicate`` holds, or None if it never did within ``within``."""
    start = time.monotonic()
    with anyio.move_on_after(within):
        while not await predicate():  # noqa: ASYNC110 - another process: no event to await
            await anyio.sleep(step)
        return time.monotonic() - start
    return None


class Profiler:
    """py-spy record of one process per phase, in py-spy's raw (collapsed) format."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._proc: subprocess.Popen[bytes] | None = None
        self._path: Path | None = None
        self.files: list[Path] = []

    def start(self, pid: int, name: str) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self._path = self.directory / f"{name}.txt"
        self._proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "py-spy"),
                "record",
                "--pid",
                str(pid),
                "--rate",
                "100",
                "--format",
                "raw",
                "--nonblocking",
                "--output",
                str(self._path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or self._path is None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._path.exists():
            self.files.append(self._path)
            print(summarise_profile(self._path))


def summarise_profile(path: Path, top: int = 12) -> str:
    """Top functions by own and by total samples, from a py-spy raw profile."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame(f) for f in stack.split(";")]
        samples += count
        own[frames[-1]] += count
        for name in set(frames):
            total[name] += count
    if not samples:
        return f"profile {path.name}: no samples"
    lines = [f"profile {path.name}: {samples} active samples"]
    # Total time of our own functions only: the loop and runner frames are in every stack.
    ours = collections.Counter(
        {
            name: count
            for name, count in total.items()
            if "controllerd/" in name or "(store.py)" in name
        }
    )
    for title, counter in (("own time", own), ("total time, controllerd code", ours)):
        lines.append(f"  top by {title}:")
        for name, count in counter.most_common(top):
            lines.append(f"    {100 * count / samples:5.1f}%  {name}")
    return "\n".join(lines)


def _frame(frame: str) -> str:
    """``func (path/to/file.py:12)`` -> ``func (dir/file.py)``: one name per function."""
    name, _, where = frame.partition(" (")
    file = where.rstrip(")").rpartition(":")[0]
    parts = file.split("/")
    parts = parts[parts.index("controllerd") :] if "controllerd" in parts else parts[-2:]
    return f"{name} ({'/'.join(parts)})" if file else name


# -- the cluster under test -------------------------------------------------------------------


@dataclass
class Bench:
    args: argparse.Namespace
    root: Path
    etcd: EtcdServer
    store: Store
    keys: Keys
    broker: TestBrokerState
    broker_url: str
    profiler: Profiler
    probes: dict[str, Probe] = field(default_factory=dict)
    replicas: dict[str, Replica] = field(default_factory=dict)
    started_at: dict[str, float] = field(default_factory=dict)
    helpers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def config_text(self, settle: float) -> str:
        return (
            f"[autoscale]\ninterval_seconds = {self.args.interval}\n"
            f"consumer_settle_seconds = {settle}\n"
        )

    async def start_replica(self, name: str, settle: float = 0.05) -> Replica:
        if name in self.probes:
            await self.probes.pop(name).aclose()
        port = free_port()
        path = write_config(
            self.root / f"{name}.toml",
            etcd=self.etcd.endpoint,
            prefix=PREFIX,
            broker_url=self.broker_url,
            port=port,
            extra=self.config_text(settle),
            lease_ttl=self.args.ttl,
        )
        replica = Replica(name, path, port, self.root / f"{name}.log")
        self.started_at[name] = time.monotonic()
        replica.start()
        self.replicas[name] = replica
        self.probes[name] = Probe(replica)
        return replica

    def reconfigure(self, settle: float) -> None:
        """What an operator does: edit the config and SIGHUP every replica."""
        for replica in self.replicas.values():
            if replica.alive():
                text = replica.config.read_text()
                head = text.split("[autoscale]")[0]
                replica.config.write_text(head + self.config_text(settle))
                replica.signal(signal.SIGHUP)

    async def stop_all(self) -> None:
        for replica in self.replicas.values():
            await replica.stop()
        for probe in self.probes.values():
            await probe.aclose()
        self.replicas.clear()
        self.probes.clear()

    async def revision(self) -> int:
        return await self.store.probe(self.keys.leader, 5.0)

    async def leader(self) -> str | None:
        for name, probe in self.probes.items():
            if self.replicas[name].alive():
                status = await probe.status()
                if status and status.get("leader"):
                    return name
        return None

    def pid(self, name: str) -> int:
        proc = self.replicas[name].proc
        assert proc is not None
        return proc.pid


@contextlib.asynccontextmanager
async def open_bench(args: argparse.Namespace, tag: str) -> AsyncIterator[Bench]:
    """A fresh etcd with an 8 GiB quota, the store, and the test broker."""
    root = Path(tempfile.mkdtemp(prefix=f"controllerd-scale-{tag}-"))
    os.environ["ETCD_QUOTA_BACKEND_BYTES"] = str(QUOTA_BYTES)  # etcd reads its flags from env
    etcd = EtcdServer(root / "etcd")
    etcd.start()
    bench: Bench | None = None
    try:
        async with open_store([etcd.endpoint], timeout=10.0, retry_for=30.0) as store:
            keys = Keys(f"{PREFIX}pulsar", f"{PREFIX}controllerd/default")
            broker = TestBrokerState(profile="reference")
            broker.on_layout_change = mirror_into(store, keys)
            async with serve_test_broker(broker) as url:
                profiler = Profiler(Path(args.profile) / tag if args.profile is not None else None)
                bench = Bench(args, root, etcd, store, keys, broker, url, profiler)
                try:
                    yield bench
                finally:
                    profiler.stop()
                    for helper in bench.helpers:
                        if helper.poll() is None:
                            helper.kill()
                            helper.wait()
                    with anyio.CancelScope(shield=True):
                        await bench.stop_all()
    finally:
        etcd.close()
        shutil.rmtree(root, ignore_errors=True)


# -- phases -----------------------------------------------------------------------------------


async def baseline_rss(args: argparse.Namespace) -> int:
    """RSS (KiB) of a leader with 0 topics, after it is ready and leading."""
    async with open_bench(args, "baseline") as bench:
        await bench.start_replica("empty")
        probe = bench.probes["empty"]

        async def leads() -> bool:
            status = await probe.status()
            return bool(status and status.get("leader"))

        await poll(leads, 60)
        await anyio.sleep(2.0)
        rss, _ = rss_kb(bench.pid("empty"))
        print(f"baseline: leader with 0 topics, VmRSS {rss / 1024:.1f} MiB")
        return rss


async def start_leader(bench: Bench, n: int, out: dict[str, Any]) -> None:
    """Start the first replica; time its load, first decision and first full evaluation."""
    replica = await bench.start_replica("r0")
    probe = bench.probes["r0"]
    bench.profiler.start(bench.pid("r0"), "start")
    t0 = bench.started_at["r0"]
    first: float | None = None
    budget = load_budget(n)
    deadline = t0 + budget
    while time.monotonic() < deadline:
        if not replica.alive():
            raise RuntimeError(f"r0 exited; see {replica.log_path}")
        total = await probe.decisions()
        now = time.monotonic()
        if first is None and total >= 1:
            first = now - t0
        if first is not None and await first_pass_done(probe):
            out["full_evaluation_s"] = time.monotonic() - t0
            break
        await anyio.sleep(0.1)
    bench.profiler.stop()
    out["start_cpu_s"] = cpu_seconds(bench.pid("r0"))
    status = await probe.status() or {}
    out["first_decision_s"] = first
    out["load_s"] = status.get("metadata", {}).get("load_seconds")
    out["keys_loaded"] = status.get("metadata", {}).get("keys_loaded")
    out.setdefault("full_evaluation_s", None)
    rss, hwm = rss_kb(bench.pid("r0"))
    out["rss_kb"], out["hwm_kb"] = rss, hwm


async def start_standby(bench: Bench, out: dict[str, Any]) -> None:
    await bench.start_replica("r1")
    probe = bench.probes["r1"]

    async def ready() -> bool:
        status = await probe.status()
        return bool(status and status.get("ready"))

    waited = await poll(ready, load_budget(out["topics"]))
    status = await probe.status() or {}
    out["standby_ready_s"] = waited
    out["standby_load_s"] = status.get("metadata", {}).get("load_seconds")
    out["standby_rss_kb"] = rss_kb(bench.pid("r1"))[0]


async def measure_tick(bench: Bench, n: int, out: dict[str, Any]) -> None:
    """The next tick after the full evaluation: N more decisions, wall and CPU time."""
    probe, pid = bench.probes["r0"], bench.pid("r0")
    plateau = await probe.decisions()
    while True:  # settle: the full evaluation may still be finishing
        await anyio.sleep(1.0)
        now = await probe.decisions()
        if now == plateau:
            break
        plateau = now
    budget = bench.args.interval + 60 + n / 500
    started = cpu = None
    end = time.monotonic() + budget
    while time.monotonic() < end:
        total = await probe.decisions()
        if started is None and total > plateau:
            started, cpu = time.monotonic(), cpu_seconds(pid)
            bench.profiler.start(pid, "tick")
        if started is not None and cpu is not None and total >= plateau + n:
            out["tick_s"] = time.monotonic() - started
            out["tick_cpu_s"] = cpu_seconds(pid) - cpu
            break
        await anyio.sleep(0.05)
    bench.profiler.stop()
    out.setdefault("tick_s", None)
    out.setdefault("tick_cpu_s", None)


async def leader_changes(bench: Bench) -> int:
    elections = 0.0
    for probe in bench.probes.values():
        elections += (await probe.metrics()).get("controllerd_leader_elections_total", 0.0)
    return int(elections) - 1


def run_role(bench: Bench, role: str, *extra: str) -> subprocess.Popen[bytes]:
    """Start one of this module's helper roles as a process of its own (killed at the end)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.scale_bench",
            role,
            "--etcd",
            bench.etcd.endpoint,
            *extra,
        ],
        stdout=subprocess.PIPE,
    )
    bench.helpers.append(proc)
    return proc


async def finish(proc: subprocess.Popen[bytes], within: float = 600) -> dict[str, Any]:
    """The JSON line a helper role printed last, once it exits."""

    def wait() -> bytes:
        out, _ = proc.communicate(timeout=within)
        return out

    raw = await anyio.to_thread.run_sync(wait)
    lines = raw.decode().strip().splitlines()
    result: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    return result


async def raw_watch_rate(bench: Bench, n: int, out: dict[str, Any]) -> None:
    """A plain watcher's events/s over a backlog no replica watches."""
    events = bench.args.raw_events
    raw_keys = Keys("/raw/pulsar", "/raw/controllerd")
    topics = topic_names(max(1, min(n, events // 16)), tenant=TENANT, namespaces=NAMESPACES)
    rng = random.Random(3)
    start = await bench.revision()
    puts = (
        Put(raw_keys.load(topics[i % len(topics)], (i // len(topics)) % 16), balanced_record(rng))
        for i in range(events)
    )
    await put_all(bench.store, puts)
    watcher = run_role(
        bench,
        "_raw_watch",
        "--prefix",
        raw_keys.topics_prefix,
        "--from",
        str(start + 1),
        "--events",
        str(events),
    )
    result = await finish(watcher)
    out["raw_events_per_s"] = result["events"] / result["seconds"]


async def keep_up(bench: Bench, n: int, out: dict[str, Any]) -> None:
    """How fast each replica follows etcd: a burst, a backlog, then K writes/s climbing."""
    pid = bench.pid("r0")
    bench.profiler.start(pid, "keepup")
    await live_burst(bench, n, out)
    await burst(bench, n, out)
    results: list[dict[str, Any]] = []
    for rate in bench.args.rates:
        step = await write_storm(bench, n, rate, bench.args.step_seconds)
        results.append(step)
        print(
            f"  keep-up K={rate}/s: wrote {step['achieved']:.0f}/s; caught up after "
            + ", ".join(
                f"{name} {_fmt(step.get(f'catch_up_{name}_s'), 's')}" for name in ("r0", "r1")
            )
        )
        if not step["kept_up"]:
            break
    bench.profiler.stop()
    kept = [s for s in results if s["kept_up"]]
    out["keep_up_steps"] = results
    out["keep_up_k"] = max((s["achieved"] for s in kept), default=0.0)
    # Every step kept up: the writer (and etcd taking its writes) was the limit, so
    # the highest K is a lower bound of what the replica follows.
    out["keep_up_writer_bound"] = bool(results) and len(kept) == len(results)
    raw = out.get("raw_events_per_s")
    out["keep_up_ratio"] = out["keep_up_k"] / raw if raw else None
    out["max_stall_after_keepup_ms"] = await max_stall_ms(bench, "r0")
    out["max_stall_on_cpu_after_keepup_ms"] = await max_stall_ms(
        bench, "r0", "max_loop_stall_on_cpu_s"
    )


def burst_puts(bench: Bench, n: int, events: int, *, seed: int) -> Iterator[Put]:
    """``events`` balanced load records, each on a random segment of one of N topics."""
    topics = topic_names(n, tenant=TENANT, namespaces=NAMESPACES)
    rng = random.Random(seed)
    for _ in range(events):
        yield Put(bench.keys.load(rng.choice(topics), rng.randrange(16)), balanced_record(rng))


async def live_burst(bench: Bench, n: int, out: dict[str, Any]) -> None:
    """``--raw-events`` load puts written as fast as etcd takes them, followed live by
    both replicas and by a plain watcher (``_raw_watch``, a process of its own) at
    once: the issue's yardstick, "a plain Python etcd client" under a load-record
    storm. Events/s of each: the burst over the time from its first write to when
    that follower had seen its last."""
    events = bench.args.raw_events
    puts = burst_puts(bench, n, events, seed=7)
    start = await bench.revision()
    watcher = run_role(
        bench,
        "_raw_watch",
        "--prefix",
        bench.keys.topics_prefix,
        "--from",
        str(start + 1),
        "--events",
        str(events),
        "--ready",
    )
    assert watcher.stdout is not None
    ready = await anyio.to_thread.run_sync(watcher.stdout.readline)
    if not ready:
        print("  live burst: the plain watcher did not start")
        return
    started = time.monotonic()
    written, final = await put_all(bench.store, puts)
    wrote = time.monotonic() - started
    reached: dict[str, float | None] = {}

    async def follow(name: str) -> None:
        reached[name] = await caught_up(bench.probes[name], final, 300)

    async with anyio.create_task_group() as tg:
        for name in ("r0", "r1"):
            if name in bench.probes and bench.replicas[name].alive():
                tg.start_soon(follow, name)
    result = await finish(watcher)
    out["live_write_per_s"] = written / wrote
    plain = result.get("last_at")
    if plain is not None:
        out["live_plain_per_s"] = written / max(wrote, plain - started)
    for name, key in (("r0", "live_leader_per_s"), ("r1", "live_standby_per_s")):
        at = reached.get(name)
        if at is not None:
            out[key] = written / max(wrote, at - started)
            if plain is not None:
                out[key.replace("_per_s", "_ratio")] = out[key] / out["live_plain_per_s"]
    print(
        f"  live burst of {written} puts at {out['live_write_per_s']:.0f}/s, followed by "
        f"the plain watcher at {_fmt(out.get('live_plain_per_s'), 'ev/s', digits=0)}, "
        f"the leader at {_fmt(out.get('live_leader_per_s'), 'ev/s', digits=0)} "
        f"({_fmt(out.get('live_leader_ratio'), '%', 100, 0)}), the standby at "
        f"{_fmt(out.get('live_standby_per_s'), 'ev/s', digits=0)} "
        f"({_fmt(out.get('live_standby_ratio'), '%', 100, 0)})"
    )


async def burst(bench: Bench, n: int, out: dict[str, Any]) -> None:
    """``--raw-events`` load puts written as fast as etcd takes them (as for the raw
    watcher) with the standby stopped: the leader follows live, the standby then
    works off the whole backlog; events/s of each."""
    puts = burst_puts(bench, n, bench.args.raw_events, seed=5)
    standby = bench.replicas["r1"]
    profiler = Profiler(bench.profiler.directory)  # the leader's runs meanwhile
    standby.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        written, final = await put_all(bench.store, puts)
        wrote = time.monotonic() - started
    finally:
        standby.signal(signal.SIGCONT)
    resumed = time.monotonic()
    profiler.start(bench.pid("r1"), "backlog")
    leader = await caught_up(bench.probes["r0"], final, 300)
    backlog = await caught_up(bench.probes["r1"], final, 300)
    profiler.stop()
    out["burst_write_per_s"] = written / wrote
    if leader is not None:
        behind = max(0.0, leader - resumed)  # the leader is polled first: add nothing twice
        out["burst_leader_per_s"] = written / (wrote + behind)
        out["burst_leader_bounded"] = behind <= KEEP_UP_SECONDS
    if backlog is not None:
        out["backlog_standby_per_s"] = written / (backlog - resumed)
    raw = out.get("raw_events_per_s")
    for key in ("burst_leader_per_s", "backlog_standby_per_s"):
        if raw and key in out:
            out[key.replace("_per_s", "_ratio")] = out[key] / raw
    print(
        f"  burst of {written} puts at {out['burst_write_per_s']:.0f}/s: leader followed at "
        f"{_fmt(out.get('burst_leader_per_s'), 'ev/s', digits=0)}"
        + (" (as fast as etcd took the writes)" if out.get("burst_leader_bounded") else "")
        + f"; stopped standby worked off the backlog at "
        f"{_fmt(out.get('backlog_standby_per_s'), 'ev/s', digits=0)}"
    )


async def caught_up(probe: Probe, revision: int, within: float) -> float | None:
    """``time.monotonic()`` when the replica's followed revision reached ``revision``."""

    async def reached() -> bool:
        status = await probe.status()
        return bool(status and status.get("metadata", {}).get("revision", 0) >= revision)

    waited = await poll(reached, within, step=0.02)
    return None if waited is None else time.monotonic()


async def write_storm(bench: Bench, n: int, rate: int, seconds: float) -> dict[str, Any]:
    """Run the writer at ``rate`` for ``seconds``; how long each replica took to catch up."""
    writer = writer_process(bench, n, rate, seconds)
    result = await finish(writer)
    final = result["last_revision"]
    step: dict[str, Any] = {"rate": rate, "achieved": result["written"] / result["seconds"]}
    kept = True
    stopped = time.monotonic()
    for name in ("r0", "r1"):
        probe = bench.probes.get(name)
        if probe is None or not bench.replicas[name].alive():
            continue
        at = await caught_up(probe, final, 120)
        step[f"catch_up_{name}_s"] = None if at is None else at - stopped
        if name == "r0":
            kept = at is not None and at - stopped <= KEEP_UP_SECONDS
    step["kept_up"] = kept
    return step


def writer_process(bench: Bench, n: int, rate: int, seconds: float) -> subprocess.Popen[bytes]:
    return run_role(
        bench,
        "_writer",
        "--metadata-prefix",
        bench.keys.metadata_prefix,
        "--topics",
        str(n),
        "--rate",
        str(rate),
        "--seconds",
        str(seconds),
    )


async def reaction(bench: Bench, n: int, out: dict[str, Any]) -> None:
    """Registration -> split request on fresh topics, while the writer runs."""
    rate = bench.args.reaction_rate
    samples = bench.args.reaction_samples
    writer = writer_process(bench, n, rate, 3600)
    bench.profiler.start(bench.pid("r0"), "reaction")
    try:
        await anyio.sleep(1.0)
        for settle in (0.05, 0.0):
            bench.reconfigure(settle)
            # A reload empties the leader's policy cache; every topic the storm touches
            # resolves its policy again (measured: ~2 s of slow reactions at 10k topics).
            await anyio.sleep(bench.args.after_reload)
            ms = await reaction_round(bench, f"settle{int(settle * 1000)}", samples, out)
            out[f"reaction_{settle}"] = ms
            print(
                f"  reaction (settle {settle}s, {rate} writes/s): n={len(ms)} "
                f"p50={statistics.median(ms):.1f} ms p99={percentile(ms, 0.99):.1f} ms "
                f"max={max(ms):.1f} ms"
            )
    finally:
        bench.profiler.stop()
        writer.send_signal(signal.SIGTERM)
        result = await finish(writer)
        out["reaction_writes_per_s"] = result["written"] / result["seconds"]


async def prepare_topic(bench: Bench, topic: TopicName) -> None:
    """A 1-segment topic with one consumer: one more consumer makes a split due."""
    layout = bench.broker.add_topic(topic, 1)
    bench.broker.subscriptions[topic]["s"] = "STREAM"
    await bench.store.put(bench.keys.layout(topic), layout_json(layout))
    await bench.store.put(bench.keys.subscription(topic, "s"), b'{"type":"STREAM"}')
    await bench.store.put(bench.keys.consumer(topic, "s", "c1"), b"{}")


def split_requests(bench: Bench, topic: TopicName) -> list[Any]:
    path = f"/{topic.namespace}/{topic.topic}/split/"
    return [r for r in bench.broker.requests if path in r.path]


async def reaction_round(bench: Bench, tag: str, samples: int, out: dict[str, Any]) -> list[float]:
    latencies = []
    timeline = out.setdefault("reaction_timeline", [])
    for i in range(samples):
        topic = TopicName("react", tag, f"t{i}")
        await prepare_topic(bench, topic)
        await anyio.sleep(0.2)  # let the one-consumer evaluation pass first
        start = time.monotonic()
        await bench.store.put(bench.keys.consumer(topic, "s", "c2"), b"{}")

        async def arrived(topic: TopicName = topic) -> bool:
            return bool(split_requests(bench, topic))

        if await poll(arrived, 30, step=0.001) is None:
            # Counted as 30 s, so the percentiles show it, and the run goes on.
            print(f"  reaction: no split for {topic} within 30 s", flush=True)
            out[f"reaction_timeouts_{tag}"] = out.get(f"reaction_timeouts_{tag}", 0) + 1
            latencies.append(30_000.0)
            continue
        latencies.append((split_requests(bench, topic)[0].at - start) * 1000)
        timeline.append((time.time(), tag, latencies[-1]))
    return latencies


async def takeover(
    bench: Bench, n: int, sig: signal.Signals, old: str, new: str, out: dict[str, Any]
) -> None:
    """Signal the leader ``old``; time ``new`` to lead, decide, act and evaluate all."""
    label = "kill9" if sig == signal.SIGKILL else "sigterm"
    probe = bench.probes[new]
    before = (await probe.status() or {}).get("metadata", {})
    decided = await probe.decisions()
    gap = TopicName("gap", label, "t")
    await prepare_topic(bench, gap)
    await anyio.sleep(0.5)
    signalled = time.monotonic()
    bench.replicas[old].signal(sig)
    await bench.store.put(bench.keys.consumer(gap, "s", "c2"), b"{}")  # in the gap
    marks: dict[str, float | None] = {"lead": None, "decision": None, "action": None, "full": None}
    end = signalled + bench.args.ttl + 120 + n / 200
    while time.monotonic() < end and (marks["full"] is None or marks["action"] is None):
        now = time.monotonic() - signalled
        status = await probe.status() or {}
        if marks["lead"] is None and status.get("leader"):
            marks["lead"] = now
        if marks["lead"] is not None:
            total = await probe.decisions()
            if marks["decision"] is None and total > decided:
                marks["decision"] = now
            if marks["full"] is None and await first_pass_done(probe, status):
                marks["full"] = now
        if marks["action"] is None and split_requests(bench, gap):
            marks["action"] = split_requests(bench, gap)[0].at - signalled
        await anyio.sleep(0.01)
    after = (await probe.status() or {}).get("metadata", {})
    for key, value in marks.items():
        out[f"takeover_{label}_{key}_s"] = value
    out[f"takeover_{label}_reloaded_keys"] = after.get("keys_loaded", 0) - before.get(
        "keys_loaded", 0
    )
    await anyio.to_thread.run_sync(bench.replicas[old].wait, 30.0)


async def max_stall_ms(bench: Bench, name: str, field: str = "max_loop_stall_s") -> float | None:
    """The replica's longest loop stall so far, in ms (None: no answer or no such field).

    ``max_loop_stall_on_cpu_s`` (the part the process spent on CPU, not waiting to be
    scheduled) is read when the daemon reports it.
    """
    status = await bench.probes[name].status()
    if status is None or field not in status:
        return None
    return 1000 * float(status[field])


@contextlib.contextmanager
def phase(out: dict[str, Any], name: str) -> Iterator[None]:
    """Record the wall-clock span of a phase, to attribute the replicas' stalls to it."""
    started = time.time()
    try:
        yield
    finally:
        out.setdefault("phases", []).append((name, started, time.time()))


def view_apply_costs(n: int, segments: int, events: int = 100_000) -> dict[str, float]:
    """CPU per key of the parsing boundary alone, in this process, no I/O: what the
    follower pays per key of the initial load and per load-record event it follows.
    Steadier than wall-clock numbers on a shared machine (one core, nothing else)."""
    keys = Keys(f"{PREFIX}pulsar", f"{PREFIX}controllerd/default")
    layout = initial_layout(segments, int(time.time() * 1000))
    value = orjson.dumps(layout_to_json(layout))
    ids = sorted(layout.segments)
    rng = random.Random(9)
    topics = topic_names(n, tenant=TENANT, namespaces=NAMESPACES)
    puts = [p for t in topics for p in topic_puts(keys, t, value, ids, rng)]
    view = MetadataView(keys)
    started = time.process_time()
    for revision, put in enumerate(puts, 1):
        view.apply_put(put.key, put.value, revision, 0)
    load = (time.process_time() - started) / len(puts)
    updates = [
        (True, keys.load(rng.choice(topics), rng.randrange(segments)).encode(), record, revision)
        for revision in range(len(puts) + 1, len(puts) + 1 + events)
        for record in (balanced_record(rng),)
    ]
    standby = standby_gate(view)
    gc.freeze()  # as the follower does after its load: collections skip the view

    def per_event(
        note: Callable[[Outcome], None],
        note_load: Callable[[TopicState, int], None] | None = None,
    ) -> float:
        started = time.process_time()
        for start in range(0, events, SLICE):  # as the follower hands them over
            view.apply_events(updates[start : start + SLICE], 0, note, note_load)
        return (time.process_time() - started) / events

    # The same records three times each way, alternating: the best of each (a shared
    # host's noise only ever adds).
    runs = [(per_event(_ignore), per_event(standby.note, standby.note_load)) for _ in "abc"]
    follow, gated = min(r[0] for r in runs), min(r[1] for r in runs)
    gc.unfreeze()
    return {
        "load_us_per_key": load * 1e6,
        "follow_us_per_event": follow * 1e6,
        "standby_follow_us_per_event": gated * 1e6,
    }


def _ignore(outcome: Outcome) -> None:
    """The view's outcomes, dropped as they come (kept, 300,000 of them made the
    collector's full passes part of what was measured; the daemon keeps none)."""


def standby_gate(view: MetadataView) -> Controller:
    """A controller over ``view`` as a loaded standby runs it (leading nothing), for
    its per-record gate alone: the store and the broker are never reached."""
    config = make_config(PREFIX, settle=0.05, interval=30.0)
    controller = Controller(
        config=lambda: config,
        store=cast(Store, None),
        broker=cast(BrokerClient, None),
        view=view,
        metrics=Metrics(),
        audit=AuditSink(),
        clock=ManualClock(),
        replica="bench",
    )
    controller._running = True  # what run() sets; its workers have nothing to do here
    return controller


def where(out: dict[str, Any], at: float) -> str:
    return next((p for p, start, end in out.get("phases", []) if start <= at <= end), "between")


def stalls_by_phase(
    bench: Bench, out: dict[str, Any], noise: list[list[float]]
) -> dict[str, dict[str, list[float]]]:
    """Each replica's ``loop.stalled`` warnings (> 100 ms), in ms, by phase; and the
    late wake-ups over 100 ms of an idle process (``noise``: the machine, not us)."""
    found: dict[str, dict[str, list[float]]] = {}
    for at, ms in noise:
        if ms > 100:
            found.setdefault("idle process", {}).setdefault(where(out, at), []).append(ms)
    for name in ("r0", "r1"):
        path = bench.root / f"{name}.log"
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if '"loop.stalled"' not in line:
                continue
            with contextlib.suppress(ValueError, KeyError):
                event = json.loads(line)
                at = datetime.fromisoformat(event["timestamp"]).timestamp()
                found.setdefault(name, {}).setdefault(where(out, at), []).append(
                    1000 * event["seconds"]
                )
    return found


async def run_one(args: argparse.Namespace, n: int, baseline: int) -> dict[str, Any]:
    out: dict[str, Any] = {"topics": n, "loadavg_before": os.getloadavg()}
    wanted = set(args.phases)
    costs = view_apply_costs(min(n, 10_000), args.segments)
    out.update(costs)
    print(
        f"N={n}: in-process view (parsing boundary only, CPU): "
        f"{costs['load_us_per_key']:.1f} us/key loaded, "
        f"{costs['follow_us_per_event']:.1f} us/load event followed; with a standby's "
        f"gate {costs['standby_follow_us_per_event']:.1f} us"
    )
    async with open_bench(args, f"n{n}") as bench:
        noise = run_role(bench, "_noise")
        with phase(out, "populate"):
            topics = topic_names(n, tenant=TENANT, namespaces=NAMESPACES)
            populated = await populate(bench.store, bench.keys, topics, segments=args.segments)
            del topics
        out["populate_s"] = populated.seconds
        print(f"N={n}: populated {populated.keys} keys in {populated.seconds:.1f}s")
        with phase(out, "start"):
            await start_leader(bench, n, out)
        out["rss_per_topic_kb"] = (out["rss_kb"] - baseline) / n
        print(
            f"N={n}: load {_fmt(out['load_s'], 's')}, first decision "
            f"{_fmt(out['first_decision_s'], 's')}, full evaluation "
            f"{_fmt(out['full_evaluation_s'], 's')}, RSS {out['rss_kb'] / 1024:.0f} MiB "
            f"({out['rss_per_topic_kb']:.1f} KiB/topic)"
        )
        with phase(out, "standby-start"):
            await start_standby(bench, out)
        if "tick" in wanted:
            with phase(out, "tick"):
                await measure_tick(bench, n, out)
        out["leader_changes"] = await leader_changes(bench)
        out["max_stall_ms"] = await max_stall_ms(bench, "r0")
        out["max_stall_on_cpu_ms"] = await max_stall_ms(bench, "r0", "max_loop_stall_on_cpu_s")
        out["standby_max_stall_ms"] = await max_stall_ms(bench, "r1")
        print(
            f"N={n}: standby ready {_fmt(out['standby_ready_s'], 's')}; tick "
            f"{_fmt(out.get('tick_s'), 's')} ({_fmt(out.get('tick_cpu_s'), 's')} CPU); "
            f"max stall {out['max_stall_ms']:.0f} ms; leader changes {out['leader_changes']}"
        )
        if "raw-watch" in wanted:
            with phase(out, "raw-watch"):
                await raw_watch_rate(bench, n, out)
        print(f"N={n}: raw watch {_fmt(out.get('raw_events_per_s'), 'events/s', digits=0)}")
        if "keep-up" in wanted:
            with phase(out, "keep-up"):
                await keep_up(bench, n, out)
        if "reaction" in wanted:
            with phase(out, "reaction"):
                await reaction(bench, n, out)
        out["leader_changes_after_storms"] = await leader_changes(bench)
        if "takeover" in wanted:
            with phase(out, "takeover-sigterm"):
                await takeover(bench, n, signal.SIGTERM, "r0", "r1", out)
            with phase(out, "restart-r0"):
                await bench.start_replica("r0")
                probe = bench.probes["r0"]

                async def ready() -> bool:
                    status = await probe.status()
                    return bool(status and status.get("ready"))

                await poll(ready, load_budget(n))
            with phase(out, "takeover-kill9"):
                await takeover(bench, n, signal.SIGKILL, "r1", "r0", out)
        noise.send_signal(signal.SIGTERM)
        late = (await anyio.to_thread.run_sync(noise.communicate))[0].decode().splitlines()
        idle = [json.loads(line) for line in late]
        out["idle_max_late_ms"] = max((ms for _, ms in idle), default=0.0)
        out["stalls"] = stalls_by_phase(bench, out, idle)
        for name, phases in out["stalls"].items():
            print(
                f"N={n}: {name} stalls > 100 ms: "
                + ", ".join(f"{p} {len(ms)}x (max {max(ms):.0f} ms)" for p, ms in phases.items())
            )
        if args.logs is not None:
            target = Path(args.logs) / f"n{n}"
            target.mkdir(parents=True, exist_ok=True)
            for log in bench.root.glob("*.log"):
                shutil.copy(log, target / log.name)
            shutil.copy(bench.etcd.data_dir.parent / "etcd.log", target / "etcd.log")
    return out


def _idle(ms: float | None) -> str:
    return _fmt(ms, "ms", digits=0) if ms else "< 50 ms"


def _fmt(value: float | None, unit: str, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f} {unit}".strip()


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """One markdown table: a row per measurement, a column per N, the goal beside."""
    rows: dict[str, tuple[str, list[str]]] = {}
    for r in results:
        for title, goal, value in cells(r, args):
            rows.setdefault(title, (goal, []))[1].append(value)
    head = "| measured | goal | " + " | ".join(f"{r['topics']:,} topics" for r in results) + " |"
    lines = [head, "|---|---|" + "---|" * len(results)]
    lines += [f"| {t} | {goal} | " + " | ".join(vals) + " |" for t, (goal, vals) in rows.items()]
    return "\n".join(lines)


def cells(r: dict[str, Any], args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(row title, goal, this N's value) for every row of the report."""
    g = r.get

    def takeover(label: str) -> str:
        return (
            f"lead {_fmt(g(f'takeover_{label}_lead_s'), 's')}, "
            f"decide {_fmt(g(f'takeover_{label}_decision_s'), 's')}, "
            f"act {_fmt(g(f'takeover_{label}_action_s'), 's')}, "
            f"all {_fmt(g(f'takeover_{label}_full_s'), 's', digits=1)}, "
            f"reloaded {g(f'takeover_{label}_reloaded_keys')} keys"
        )

    def reaction(settle: float) -> str:
        ms = g(f"reaction_{settle}")
        if not ms:
            return "-"
        return f"p50 {statistics.median(ms):.0f} / p99 {percentile(ms, 0.99):.0f} ms"

    def mib(value: float | None) -> str:
        return _fmt(value, "MiB", 1 / 1024, 0)

    writes = f"{args.reaction_rate} writes/s"
    return [
        ("populate etcd", "", _fmt(g("populate_s"), "s", digits=1)),
        ("load (metadata.load_seconds)", "", _fmt(g("load_s"), "s")),
        ("start -> first decision", GOALS["first_decision_s"], _fmt(g("first_decision_s"), "s")),
        ("start -> full evaluation", "", _fmt(g("full_evaluation_s"), "s")),
        ("leader RSS", GOALS["rss_mb"], mib(g("rss_kb"))),
        (
            "RSS per topic (minus a 0-topic leader)",
            GOALS["rss_per_topic_kb"],
            _fmt(g("rss_per_topic_kb"), "KiB", digits=1),
        ),
        (
            "standby: ready after its start / its RSS",
            "",
            f"{_fmt(g('standby_ready_s'), 's')} / {mib(g('standby_rss_kb'))}",
        ),
        ("tick: wall / leader CPU", "", f"{_fmt(g('tick_s'), 's')} / {_fmt(g('tick_cpu_s'), 's')}"),
        (
            "longest loop stall, leader: to the tick / after the storms",
            GOALS["max_stall_ms"],
            f"{_fmt(g('max_stall_ms'), 'ms', digits=0)} / "
            f"{_fmt(g('max_stall_after_keepup_ms'), 'ms', digits=0)}",
        ),
        (
            "  of which on CPU (daemon's max_loop_stall_on_cpu_s, if reported)",
            GOALS["max_stall_ms"],
            f"{_fmt(g('max_stall_on_cpu_ms'), 'ms', digits=0)} / "
            f"{_fmt(g('max_stall_on_cpu_after_keepup_ms'), 'ms', digits=0)}",
        ),
        (
            "idle process on the same host: longest late wake-up",
            "",
            _idle(g("idle_max_late_ms")),
        ),
        (
            "load average (1 min) when this N started",
            "",
            f"{g('loadavg_before', [None])[0]}",
        ),
        (
            "leader changes: to the tick / after the storms",
            GOALS["leader_changes"],
            f"{g('leader_changes')} / {g('leader_changes_after_storms')}",
        ),
        (
            "live burst: written / a plain watcher followed it (events/s)",
            "",
            f"{_fmt(g('live_write_per_s'), 'ev/s', digits=0)} / "
            f"{_fmt(g('live_plain_per_s'), 'ev/s', digits=0)}",
        ),
        (
            "leader / standby follow the live burst (events/s; % of the plain watcher)",
            GOALS["keep_up_ratio"],
            f"{_fmt(g('live_leader_per_s'), 'ev/s', digits=0)}; "
            f"{_fmt(g('live_leader_ratio'), '%', 100, 0)} / "
            f"{_fmt(g('live_standby_per_s'), 'ev/s', digits=0)}; "
            f"{_fmt(g('live_standby_ratio'), '%', 100, 0)}",
        ),
        (
            "raw watch rate (plain watcher, a backlog)",
            "",
            _fmt(g("raw_events_per_s"), "ev/s", digits=0),
        ),
        (
            "leader follows a burst (events/s; % of raw)",
            GOALS["keep_up_ratio"],
            f"{_fmt(g('burst_leader_per_s'), 'ev/s', digits=0)}; "
            f"{_fmt(g('burst_leader_ratio'), '%', 100, 0)}"
            + (" (bounded by the writer)" if g("burst_leader_bounded") else ""),
        ),
        (
            "standby works off a backlog (events/s; % of raw)",
            GOALS["keep_up_ratio"],
            f"{_fmt(g('backlog_standby_per_s'), 'ev/s', digits=0)}; "
            f"{_fmt(g('backlog_standby_ratio'), '%', 100, 0)}",
        ),
        (
            "highest K kept up (leader)",
            "",
            _fmt(g("keep_up_k"), "writes/s", digits=0)
            + (" (every step: bounded by the writer)" if g("keep_up_writer_bound") else ""),
        ),
        (
            "K kept up / raw watch rate",
            GOALS["keep_up_ratio"],
            _fmt(g("keep_up_ratio"), "%", 100, 0)
            + (" (at least)" if g("keep_up_writer_bound") else ""),
        ),
        (f"reaction, settle 0.05 s, {writes}", GOALS["reaction_p99_ms"], reaction(0.05)),
        (f"reaction, settle 0, {writes}", GOALS["reaction_p99_ms"], reaction(0.0)),
        ("takeover after SIGTERM", GOALS["takeover_sigterm_s"], takeover("sigterm")),
        (
            f"takeover after kill -9 (TTL {args.ttl} s)",
            GOALS["takeover_kill9_s"],
            takeover("kill9"),
        ),
    ]


async def main_async(args: argparse.Namespace) -> None:
    print(
        f"scale bench: topics {args.topics}, {args.segments} segments each, TTL {args.ttl}s, "
        f"interval {args.interval}s, {os.cpu_count()} cores"
    )
    baseline = await baseline_rss(args)
    results = []
    for n in args.topics:
        try:
            results.append(await run_one(args, n, baseline))
        finally:
            if results and args.json:
                await anyio.Path(args.json).write_text(json.dumps(results, indent=1))
        print(report(results, args))
    print()
    print(report(results, args))


# -- helper roles (processes of their own) ----------------------------------------------------


async def writer_role(args: argparse.Namespace) -> None:
    """Update ``rate`` random load records a second, balanced values, for ``seconds``.

    Every 10 ms the puts due so far go out in transactions of <= 128 puts, sent by
    four tasks that live as long as the writer (so a slow answer does not stop the
    pacing); prints what it wrote, how fast, and the last revision.
    """
    keys = Keys(args.metadata_prefix, "/unused")
    topics = topic_names(args.topics, tenant=TENANT, namespaces=NAMESPACES)
    rng = random.Random(os.getpid())
    values = [balanced_record(rng) for _ in range(256)]
    stop: list[bool] = []
    queued = written = last = 0

    def on_term(*_: object) -> None:
        stop.append(True)  # seen at the next 10 ms slot

    signal.signal(signal.SIGTERM, on_term)

    async def sender(batches: MemoryObjectReceiveStream[list[Put]]) -> None:
        nonlocal written, last
        async with batches:
            async for batch in batches:
                last = max(last, await put_batch(store, batch))
                written += len(batch)

    send, receive = anyio.create_memory_object_stream[list[Put]](64)
    async with (
        open_store([args.etcd], timeout=10.0, retry_for=30.0) as store,
        anyio.create_task_group() as tg,
    ):
        with receive:
            for _ in range(4):
                tg.start_soon(sender, receive.clone())
        started = time.monotonic()
        end = started + args.seconds
        async with send:
            while not stop and (now := time.monotonic()) < end:
                due = int(args.rate * (now - started)) - queued
                while due > 0:
                    size = min(due, TXN_OPS)
                    batch = {
                        put.key: put
                        for put in (
                            Put(
                                keys.load(rng.choice(topics), rng.randrange(16)), rng.choice(values)
                            )
                            for _ in range(size)
                        )
                    }
                    await send.send(list(batch.values()))
                    queued += size
                    due -= size
                await anyio.sleep(WRITER_SLOT)
    seconds = time.monotonic() - started
    print(json.dumps({"written": written, "seconds": seconds, "last_revision": last}))


async def raw_watch_role(args: argparse.Namespace) -> None:
    """Count events under ``prefix`` from ``from`` until ``events`` arrived; print when
    the last came (``time.monotonic()``, one clock for every process on the host).

    With ``--ready`` it first prints a line once connected, so a live burst can wait
    for it before writing."""
    async with open_store([args.etcd], timeout=10.0, retry_for=30.0) as store:
        if args.ready:
            await store.probe(args.prefix, 5.0)
            print(json.dumps({"ready": True}), flush=True)
        count = 0
        started = time.monotonic()
        # The cheapest way into Python the store has (the follower's own): each event
        # a tuple of its bytes, nothing decoded or built beyond that.
        async with contextlib.aclosing(store.watch_prefix_raw(args.prefix, args.start)) as watch:
            async for batch in watch:
                count += len(batch)
                if count >= args.events:
                    break
        last_at = time.monotonic()
    print(json.dumps({"events": count, "seconds": last_at - started, "last_at": last_at}))


async def noise_role(args: argparse.Namespace) -> None:
    """The scheduling noise floor: a loop that does nothing but the daemon's loop monitor
    (wake every 50 ms); prints each late wake-up over 50 ms as ``[wall time, ms]``."""
    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    while not stop:
        before = time.monotonic()
        await anyio.sleep(0.05)
        late = time.monotonic() - before - 0.05
        if late > 0.05:
            print(json.dumps([time.time(), round(late * 1000, 1)]), flush=True)


def load_budget(n: int) -> float:
    """Seconds a replica may take to load N topics before the bench gives up on it
    (generous: etcd 3.4 pages a large prefix in quadratic time)."""
    return 120 + n / 50


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("_writer", "_raw_watch", "_noise"):
        role = argparse.ArgumentParser()
        role.add_argument("role")
        role.add_argument("--etcd", required=True)
        role.add_argument("--metadata-prefix")
        role.add_argument("--topics", type=int)
        role.add_argument("--rate", type=int)
        role.add_argument("--seconds", type=float)
        role.add_argument("--prefix")
        role.add_argument("--from", dest="start", type=int)
        role.add_argument("--events", type=int)
        role.add_argument("--ready", action="store_true")
        parsed = role.parse_args(argv)
        roles = {"_writer": writer_role, "_raw_watch": raw_watch_role, "_noise": noise_role}
        anyio.run(roles[parsed.role], parsed)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--topics", type=_ints, default=[1_000, 10_000, 100_000])
    parser.add_argument("--segments", type=int, default=16)
    parser.add_argument("--ttl", type=int, default=10, help="lease TTL in seconds")
    parser.add_argument("--interval", type=float, default=30.0, help="autoscale interval (s)")
    parser.add_argument("--raw-events", type=int, default=100_000)
    parser.add_argument(
        "--rates", type=_ints, default=[1_000, 2_000, 5_000, 10_000, 15_000, 20_000, 30_000]
    )
    parser.add_argument("--step-seconds", type=float, default=10.0)
    parser.add_argument("--reaction-rate", type=int, default=5_000)
    parser.add_argument("--reaction-samples", type=int, default=50)
    parser.add_argument(
        "--after-reload", type=float, default=5.0, help="seconds between SIGHUP and reactions"
    )
    parser.add_argument("--profile", help="directory for py-spy profiles of the leader")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--logs", help="keep the replicas' and etcd's logs in this directory")
    parser.add_argument(
        "--phases",
        type=lambda text: text.split(","),
        default=list(PHASES),
        help=f"optional phases to run (comma-separated; default all: {','.join(PHASES)})",
    )
    anyio.run(main_async, parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
