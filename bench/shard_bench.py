"""Sharded mode (issue #13) on real processes: spread, rebalance time, fencing under churn, speed.

Everything is real except the broker: ``controllerd run`` replicas in
``[election] mode = "sharded"``, an etcd started here, and the test broker over
real HTTP, which checks every split, merge and delete against the create
revision of the topic's shard key in etcd (``EtcdFence``, as the reference
broker does) and mirrors every layout into etcd, as Pulsar does.

Prints four tables:

1. **Distribution**: shards and topics per replica for ``--topics`` topics over
   3 replicas (from each replica's ``/status``).
2. **Rebalance time**, idle, ``--rounds`` times each: from the event (process
   start, SIGTERM, ``kill -9``) until every shard is owned by exactly one live
   replica, the one rendezvous hashing gives it over the live replicas (one
   owner per shard also holds halfway through a move), and every live replica
   sees the same members, read from each replica's ``/status``; also how many
   shards moved and whether only the shards that had to move did.
3. **Churn**: ``--changes`` forced membership changes (``kill -9``; SIGTERM and
   restart; SIGSTOP until the others took its shards, then SIGCONT; a fresh
   replica joining) while a writer keeps making topics hot or cold (new topics,
   hot and cold load records), so every shard has splits and merges to do;
   just before each signal the victim is given splits on its own shards, so
   the change may catch it deciding or with a request in flight.
   A *double action* is a second split or merge past the fence of one segment
   (whatever the operations: a split of 5 then a merge of 5 and 6 is one), or a
   fenced call with an older token accepted after a newer one on the same shard
   key; the target is 0. A SIGSTOP whose victim's shards the others did not
   take within ``--settle-timeout`` counts as a timeout. Calls the broker
   refused as stale are counted by the kind of the membership change before them.
4. **Throughput**: evaluations/s (the growth of
   ``controllerd_evaluation_duration_seconds_count`` in each replica's
   /metrics) for 1, 2 and 3 replicas on the same ``--throughput-topics``
   topics, every topic kept busy by a short ``[autoscale] interval_seconds``
   (``--tick``), so that the replicas, not the ticker, are the limit. Each
   topic has two segments, one below the merge thresholds beside a balanced
   one (:data:`NEVER_QUIET`): ``decide`` answers balanced, but the controller
   never marks such a topic quiet, so its ticker asks for every topic at every
   tick (a quiet topic only on one tick of ``FULL_PASS_EVERY``). These replicas
   use the default lease TTL (``--throughput-ttl 10``): at 2 s, a replica
   starved of CPU loses its lease now and then, which spoils a window.

The broker is served here rather than with ``tests.support.broker.serve_test_broker``
because the bench also needs each mutation's answer (applied, refused by the
layout, or fenced), which a thin ASGI wrapper records.

Usage: python -m bench.shard_bench [--topics 2000] [--shards 256] [--ttl 2] [--rounds 3]
       [--changes 50] [--write-rate 20] [--throughput-topics 20000]
       [--throughput-ttl 10] [--tick 0.2]
       [--measure 15] [--phases distribution,rebalance,churn,throughput] [--seed 1] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
import anyio.to_thread
import httpx
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controllerd.adapters.store import Compare, Put, Store, open_store
from controllerd.core.model import TopicName
from controllerd.core.shards import assignment, shard_of
from controllerd.core.view import Keys
from tests.support.broker import (
    EtcdFence,
    FencedCall,
    TestBrokerState,
    layout_json,
    load_json,
    make_test_broker_app,
    mirror_into,
)
from tests.support.daemon import Replica, wait_until, write_config
from tests.support.etcd import EtcdServer
from tests.support.kafka import free_port

#: Load records: between the merge (1,000) and split (10,000) msg/s thresholds, far
#: over the split threshold (a 3-way split), and far below the merge threshold.
BALANCED: Final = 5_000.0
HOT: Final = 30_000.0
COLD: Final = 10.0
#: One load record per segment of a throughput topic. ``decide`` answers balanced (no
#: cold pair to merge, nothing to split) at every tick, but a cold segment beside
#: another keeps the controller from marking the topic quiet (``Controller._note_quiet``),
#: and quiet topics are skipped on all ticks but one of ``FULL_PASS_EVERY``: with
#: :data:`BALANCED` alone the phase asked a tenth of what it claimed.
NEVER_QUIET: Final = (COLD, BALANCED)
#: Seconds between two polls of every replica's /status while waiting for a rebalance.
POLL: Final = 0.02
#: Keys per etcd transaction when loading topics (etcd allows 128 operations).
BATCH: Final = 100
#: Error codes of the test broker's fence (tests/support/broker.py ``_check_etcd_fence``).
FENCE_CODES: Final = frozenset({"fenced", "fencing-required", "bad-fencing-key"})


# -- the broker, with every mutation's answer recorded ------------------------------------


@dataclass(frozen=True, slots=True)
class Mutation:
    """One split, merge or segment delete as the broker answered it."""

    method: str
    path: str
    token: int | None
    key: str | None
    status: int
    code: str | None
    """The error body's ``code``, if any."""
    at: float

    @property
    def passed_fence(self) -> bool:
        return self.code not in FENCE_CODES

    def action(self) -> tuple[str, ...] | None:
        """``(op, topic, segment ids...)`` for a split or merge, else None."""
        parts = self.path.strip("/").split("/")
        # admin v2 scalable <tenant> <ns> <topic> split <id> | merge <a> <b>
        if self.method != "POST" or len(parts) < 8 or parts[2] != "scalable":
            return None
        return (parts[6], "/".join(parts[3:6]), *parts[7:])


class _RecordMutations:
    """ASGI wrapper: the answer to every POST and DELETE (the mutations)."""

    def __init__(self, app: ASGIApp, into: list[Mutation]) -> None:
        self.app = app
        self.into = into

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "DELETE"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        status, body = 0, b""

        async def capture(message: Message) -> None:
            nonlocal status, body
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and status >= 400:
                body += message.get("body", b"")
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            raw = headers.get("x-fencing-token")
            code = None
            with contextlib.suppress(ValueError, AttributeError):
                code = json.loads(body).get("code") if body else None
            self.into.append(
                Mutation(
                    scope["method"],
                    scope["path"],
                    int(raw) if raw is not None and raw.isdigit() else None,
                    headers.get("x-fencing-key"),
                    status,
                    code,
                    time.monotonic(),
                )
            )


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: Ctrl-C stays the bench's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class Broker:
    """The fenced test broker of one cluster and what it answered."""

    state: TestBrokerState
    keys: Keys
    mutations: list[Mutation] = field(default_factory=list)
    url: str = ""


@contextlib.asynccontextmanager
async def serve_broker(store: Store, prefix: str, shards: int) -> AsyncIterator[Broker]:
    """The test broker fenced on ``<prefix>controllerd/default/shards/*``, on a free port."""
    keys = Keys(f"{prefix}pulsar", f"{prefix}controllerd/default")
    state = TestBrokerState(profile="reference")
    state.fence = EtcdFence(store, keys.controller_root, shards)
    state.on_layout_change = mirror_into(store, keys)
    broker = Broker(state, keys)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    sock.setblocking(False)
    app = _RecordMutations(make_test_broker_app(state), broker.mutations)
    server = _QuietServer(
        uvicorn.Config(app, log_level="warning", lifespan="off", http="h11", access_log=False)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    broker.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield broker
    finally:
        server.should_exit = True
        with anyio.CancelScope(shield=True):
            await task
        sock.close()


def topic_records(
    broker: Broker, topics: Sequence[TopicName], loads: Sequence[float] = (BALANCED,)
) -> list[tuple[str, bytes]]:
    """Keys and values of new topics: ``len(loads)`` active segments each, in hash order,
    segment ``i`` with a load record of ``loads[i]`` msg/s."""
    items: list[tuple[str, bytes]] = []
    for topic in topics:
        layout = broker.state.add_topic(topic, len(loads))
        items.append((broker.keys.layout(topic), layout_json(layout)))
        active = layout.active_segments()
        for segment, rate in zip(active, loads, strict=True):
            items.append((broker.keys.load(topic, segment.segment_id), load_json(rate)))
    return items


async def add_topics(
    store: Store,
    broker: Broker,
    topics: Sequence[TopicName],
    loads: Sequence[float] = (BALANCED,),
) -> None:
    """:func:`topic_records` written in batched transactions."""
    items = topic_records(broker, topics, loads)
    for start in range(0, len(items), BATCH):
        batch = items[start : start + BATCH]
        # The compare is falsified by the batch itself, so a retried batch is a no-op.
        await store.txn([Compare.absent(batch[0][0])], [Put(k, v) for k, v in batch])


# -- replicas -----------------------------------------------------------------------------


class Pool:
    """The replicas of one cluster, started one at a time (so joins can be timed)."""

    def __init__(
        self,
        root: Path,
        etcd: str,
        prefix: str,
        broker_url: str,
        shards: int,
        ttl: int,
        extra: str,
    ) -> None:
        self.root = root
        self.settings: dict[str, Any] = {
            "etcd": etcd,
            "prefix": prefix,
            "broker_url": broker_url,
            "shards": shards,
            "lease_ttl": ttl,
            "extra": extra,
        }
        self.shards = shards
        self.replicas: list[Replica] = []
        self.stopped: set[str] = set()
        self.ids: dict[str, str] = {}
        """Replica slot name -> the daemon's replica id (``host-pid``), from /status."""
        self.client = httpx.AsyncClient(timeout=2.0)

    def spawn(self) -> Replica:
        self.root.mkdir(parents=True, exist_ok=True)
        index, port = len(self.replicas), free_port()
        path = write_config(self.root / f"replica-{index}.toml", port=port, **self.settings)
        replica = Replica(f"r{index}", path, port, self.root / f"replica-{index}.log")
        replica.start()
        self.replicas.append(replica)
        return replica

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive() and r.name not in self.stopped]

    async def status(self, replica: Replica) -> dict[str, Any] | None:
        try:
            response = await self.client.get(replica.url + "/status")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        body: dict[str, Any] = response.json()
        self.ids[replica.name] = str(body.get("replica"))
        return body

    async def settled(
        self, members: Sequence[Replica], leaving: Sequence[Replica] = ()
    ) -> dict[str, set[int]] | None:
        """Ownership by slot name once every shard has exactly one owner among ``members``,
        the one rendezvous hashing gives it over ``members``, each of them sees exactly
        ``members`` as the members, and ``leaving`` own nothing."""
        owned: dict[str, set[int]] = {}
        seen: list[set[str]] = []
        for replica in members:
            status = await self.status(replica)
            if status is None or "shards" not in status:
                return None
            owned[replica.name] = set(status["shards"]["owned"])
            seen.append(set(status["shards"]["members"]))
        ids = {self.ids[r.name] for r in members}
        if any(s != ids for s in seen):
            return None
        counts = collections.Counter(s for shards in owned.values() for s in shards)
        if len(counts) != self.shards or any(n != 1 for n in counts.values()):
            return None
        # ... and it is the final assignment, not a moment in the middle of the moves
        # (a shard that must move but was not yet released is also owned exactly once).
        target = assignment(self.shards, ids)
        for replica in members:
            mine = {s for s, owner in target.items() if owner == self.ids[replica.name]}
            if owned[replica.name] != mine:
                return None
        for replica in leaving:
            if not replica.alive():
                continue
            status = await self.status(replica)
            if status is None:
                if replica.alive():
                    return None
            elif status.get("shards", {}).get("owned"):
                return None
        return owned

    async def wait_settled(
        self, members: Sequence[Replica], leaving: Sequence[Replica] = (), within: float = 60.0
    ) -> tuple[float, dict[str, set[int]]] | None:
        """(monotonic time it was seen settled, ownership), or None after ``within`` s."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            owned = await self.settled(members, leaving)
            if owned is not None:
                return time.monotonic(), owned
            await anyio.sleep(POLL)
        return None

    async def reap(self, replica: Replica) -> None:
        assert replica.proc is not None
        await anyio.to_thread.run_sync(replica.proc.wait, 15.0)

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            for replica in self.replicas:
                if replica.name in self.stopped and replica.alive():
                    replica.signal(signal.SIGCONT)
            self.stopped.clear()
            for replica in self.replicas:
                try:
                    await replica.stop()
                except subprocess.TimeoutExpired:  # stop() kills after 15 s; be sure
                    if replica.proc is not None:
                        replica.proc.kill()
            await self.client.aclose()


class MemberLog:
    """Puts and deletes of member keys as the bench's own etcd watch sees them."""

    def __init__(self, store: Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix
        self.events: list[tuple[float, str, str]] = []

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        _, revision = await self.store.get_prefix(self.prefix)
        task_status.started()
        async with aclosing(self.store.watch_prefix(self.prefix, revision + 1)) as watch:
            async for batch in watch:
                now = time.monotonic()
                for event in batch:
                    self.events.append((now, event.kind, event.key[len(self.prefix) :]))

    def first(self, kind: str, after: float, name: str | None = None) -> float | None:
        return next(
            (
                at
                for at, k, n in self.events
                if k == kind and at >= after and (name is None or n == name)
            ),
            None,
        )


def cpu_seconds(replica: Replica) -> float:
    """User + system CPU seconds of the replica's process (Linux /proc)."""
    assert replica.proc is not None
    fields = Path(f"/proc/{replica.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def moved_shards(before: dict[str, set[int]], after: dict[str, set[int]]) -> set[int]:
    def owner_of(owned: dict[str, set[int]]) -> dict[int, str]:
        return {s: name for name, shards in owned.items() for s in shards}

    a, b = owner_of(before), owner_of(after)
    return {s for s in a.keys() | b.keys() if a.get(s) != b.get(s)}


# -- phases ---------------------------------------------------------------------------------


@dataclass
class Rebalance:
    what: str
    seconds: float
    moved: int = 0
    minimal: bool | None = None


@dataclass
class Context:
    args: argparse.Namespace
    root: Path
    etcd: EtcdServer
    store: Store
    rng: random.Random
    rebalances: list[Rebalance] = field(default_factory=list)
    writer: Writer | None = None


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def print_distribution(
    ctx: Context, pool: Pool, owned: dict[str, set[int]], topics: Sequence[TopicName]
) -> None:
    shards = ctx.args.shards
    per_shard = collections.Counter(shard_of(t, shards) for t in topics)
    rows = []
    for name, mine in sorted(owned.items()):
        rows.append((name, len(mine), sum(per_shard[s] for s in mine)))
    n = len(rows)
    print(f"\n## Distribution: {len(topics):,} topics, {shards} shards, {n} replicas")
    print(f"{'replica':<8} {'shards':>7} {'vs ideal':>9} {'topics':>7} {'vs ideal':>9}")
    for name, s, t in rows:
        print(
            f"{name:<8} {s:>7} {s / (shards / n) - 1:>+9.1%} "
            f"{t:>7} {t / (len(topics) / n) - 1:>+9.1%}"
        )
    s_counts = [r[1] for r in rows]
    t_counts = [r[2] for r in rows]
    print(
        f"max/mean: shards {max(s_counts) / statistics.mean(s_counts):.3f}, "
        f"topics {max(t_counts) / statistics.mean(t_counts):.3f}; "
        f"topics per shard: min {min(per_shard.values(), default=0)}, "
        f"max {max(per_shard.values(), default=0)}, mean {len(topics) / shards:.1f}"
    )
    spread = expected_spread(shards, n, random.Random(ctx.args.seed))
    print(
        f"(rendezvous over {n} random replica names, {len(spread)} draws: shards max/mean "
        f"median {spread[len(spread) // 2]:.3f}, p90 {spread[len(spread) * 9 // 10]:.3f}, "
        f"max {spread[-1]:.3f}; replica names are host-pid, so each run draws anew)"
    )


def expected_spread(shards: int, members: int, rng: random.Random, draws: int = 200) -> list[float]:
    """Sorted max/mean shards per member, for random member names: what luck alone gives."""
    out = []
    for _ in range(draws):
        names = [f"host-{rng.randrange(1 << 22)}" for _ in range(members)]
        counts = collections.Counter(assignment(shards, names).values())
        out.append(max(counts.values()) / (shards / members))
    return sorted(out)


async def timed_departure(
    ctx: Context, pool: Pool, log: MemberLog, within: float, sig: signal.Signals
) -> None:
    """Signal a random member (SIGKILL, or SIGTERM for a graceful leave), time until the
    others own every shard, then bring it back (:func:`timed_join`)."""
    killed = sig == signal.SIGKILL
    what = "kill -9" if killed else "SIGTERM"
    members = pool.live()
    before = await pool.settled(members)
    assert before is not None
    victim = ctx.rng.choice(members)
    victim_id = pool.ids[victim.name]
    start = time.monotonic()
    victim.signal(sig)
    rest = [r for r in members if r is not victim]
    # A graceful leaver still counts while it hands over; a killed one is simply gone.
    done = await pool.wait_settled(rest, [] if killed else [victim], within=within)
    if done is None:
        raise RuntimeError(f"{what}: the others did not take every shard in time")
    at, after = done
    moved = moved_shards(before, after)
    label = "kill -9: signal -> settled" if killed else "graceful leave: SIGTERM -> settled"
    ctx.rebalances.append(Rebalance(label, at - start, len(moved)))
    ctx.rebalances[-1].minimal = moved == before[victim.name]
    expired = log.first("delete", start, victim_id) if killed else None
    if expired is not None:
        ctx.rebalances.append(Rebalance("kill -9: lease expired -> settled", at - expired))
    await pool.reap(victim)
    await timed_join(ctx, pool, log, within, victim)


async def timed_join(
    ctx: Context, pool: Pool, log: MemberLog, within: float, replica: Replica | None = None
) -> None:
    before = await pool.settled(pool.live())
    assert before is not None
    start = time.monotonic()
    if replica is None:
        replica = pool.spawn()
    else:
        replica.start()
    done = await pool.wait_settled(pool.live(), within=within)
    if done is None:
        raise RuntimeError("join: the new replica did not get its shards in time")
    at, after = done
    moved = moved_shards(before, after)
    ctx.rebalances.append(Rebalance("join: process start -> settled", at - start, len(moved)))
    ctx.rebalances[-1].minimal = moved == after[replica.name]
    joined = log.first("put", start)
    if joined is not None:
        ctx.rebalances.append(Rebalance("join: member key put -> settled", at - joined))


def print_rebalances(ctx: Context, title: str, rows: list[Rebalance]) -> None:
    print(f"\n## {title}")
    print(f"{'event':<38} {'n':>3} {'median':>9} {'max':>9} {'moved':>6} {'only needed':>12}")
    by_what: dict[str, list[Rebalance]] = collections.defaultdict(list)
    for row in rows:
        by_what[row.what].append(row)
    for what, group in by_what.items():
        secs = [r.seconds for r in group]
        flags = [r.minimal for r in group if r.minimal is not None]
        moved = statistics.median(r.moved for r in group) if flags else None
        print(
            f"{what:<38} {len(group):>3} {fmt_s(statistics.median(secs)):>9} "
            f"{fmt_s(max(secs)):>9} {'' if moved is None else f'{moved:.0f}':>6} "
            f"{f'{sum(flags)}/{len(flags)}' if flags else '':>12}"
        )


# -- churn ------------------------------------------------------------------------------------


@dataclass
class Writer:
    """Keeps topics busy: new hot topics, hot records on active segments, cold pairs."""

    store: Store
    broker: Broker
    rng: random.Random
    topics: list[TopicName]
    created: int = 0
    hot: int = 0
    cold: int = 0

    async def run(self, rate: float) -> None:
        while True:
            roll = self.rng.random()
            if roll < 0.3:
                await self.new_topic()
            elif roll < 0.75:
                await self.make_hot()
            else:
                await self.make_cold()
            await anyio.sleep(1 / rate)

    async def new_topic(self) -> None:
        topic = TopicName("bench", "hot", f"n{self.created}")
        self.created += 1
        layout = self.broker.state.add_topic(topic, 1)
        await self.store.put(self.broker.keys.layout(topic), layout_json(layout))
        await self.store.put(self.broker.keys.load(topic, 0), load_json(HOT))
        self.topics.append(topic)

    async def make_hot(self) -> None:
        topic = self.rng.choice(self.topics)
        active = self.broker.state.topics[topic].active_segments()
        segment = self.rng.choice(active)
        await self.store.put(self.broker.keys.load(topic, segment.segment_id), load_json(HOT))
        self.hot += 1

    async def provoke(self, pool: Pool, victim: Replica) -> None:
        """Give ``victim`` splits to do on its own shards, then let a random 0-50 ms pass:
        the membership change that follows may catch it deciding or mid-request."""
        status = await pool.status(victim)
        owned = set(status["shards"]["owned"]) if status and "shards" in status else set()
        shards = self.broker.state.fence.shards if self.broker.state.fence else 0
        mine = [t for t in self.topics if shard_of(t, shards) in owned]
        for topic in self.rng.sample(mine, min(3, len(mine))):
            segment = self.rng.choice(self.broker.state.topics[topic].active_segments())
            await self.store.put(self.broker.keys.load(topic, segment.segment_id), load_json(HOT))
            self.hot += 1
        await anyio.sleep(self.rng.uniform(0.0, 0.05))

    async def make_cold(self) -> None:
        topic = self.rng.choice(self.topics)
        active = self.broker.state.topics[topic].active_segments()
        if len(active) < 2:
            return
        i = self.rng.randrange(len(active) - 1)
        for segment in active[i : i + 2]:
            await self.store.put(self.broker.keys.load(topic, segment.segment_id), load_json(COLD))
        self.cold += 1


@dataclass
class Change:
    kind: str
    at: float
    settle: float | None = None
    """Seconds from ``at`` until settled; None: a timeout."""
    missed: str | None = None
    """A wait before the settle that timed out (then ``settle`` stays None)."""


async def stop_until_taken_over(
    pool: Pool, victim: Replica, others: Sequence[Replica], within: float
) -> bool:
    """SIGSTOP ``victim`` until ``others`` own every shard, then SIGCONT it; False if
    they did not within ``within`` seconds (the takeover this change is about never
    happened, so its settle time would time something else)."""
    victim.signal(signal.SIGSTOP)
    pool.stopped.add(victim.name)
    try:
        taken = await pool.wait_settled(others, within=within)
        await anyio.sleep(0.5)  # past the TTL: the others act on its shards
    finally:
        victim.signal(signal.SIGCONT)
        pool.stopped.discard(victim.name)
    return taken is not None


async def churn(ctx: Context, pool: Pool, broker: Broker, topics: list[TopicName]) -> list[Change]:
    """``--changes`` membership changes under load; each waits for the rebalance to settle."""
    args = ctx.args
    kinds = ["kill -9", "join", "SIGTERM + restart", "SIGSTOP + SIGCONT"]
    plan: list[str] = []
    while len(plan) < args.changes:
        cycle = kinds[:]
        ctx.rng.shuffle(cycle)
        plan.extend(cycle)
    plan = plan[: args.changes]
    writer = Writer(ctx.store, broker, ctx.rng, topics)
    changes: list[Change] = []
    within = args.settle_timeout
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer.run, args.write_rate)
        await anyio.sleep(2.0)  # load first
        for number, planned in enumerate(plan, 1):
            live = pool.live()
            # never fewer than 2 before a kill
            kind = "join" if planned == "kill -9" and len(live) <= 2 else planned
            victim = ctx.rng.choice(live)
            if kind != "join":
                await writer.provoke(pool, victim)
            change = Change(kind, time.monotonic())
            changes.append(change)
            if kind == "kill -9":
                victim.signal(signal.SIGKILL)
                await pool.reap(victim)
            elif kind == "join":
                pool.spawn()
            elif kind == "SIGTERM + restart":
                victim.signal(signal.SIGTERM)
                await pool.reap(victim)
                victim.start()
            else:
                others = [r for r in live if r is not victim]
                if not await stop_until_taken_over(pool, victim, others, within):
                    change.missed = "takeover"
                change.at = time.monotonic()  # timed from SIGCONT
            done = await pool.wait_settled(pool.live(), within=within)
            if done is not None and change.missed is None:
                change.settle = done[0] - change.at
            shown = "timeout" if change.settle is None else fmt_s(change.settle)
            missed = f", {change.missed} timed out" if change.missed else ""
            print(
                f"  change {number:>2}/{len(plan)}: {kind:<18} -> settled in {shown:>8} "
                f"({len(pool.live())} live{missed})",
                flush=True,
            )
        tg.cancel_scope.cancel()
    ctx.writer = writer
    return changes


def double_actions(
    broker: Broker,
) -> tuple[dict[tuple[str, str], list[Mutation]], list[FencedCall]]:
    """Segments split or merged more than once past the fence, with those calls, by
    ``(topic, segment id)``; and fenced calls with an older token accepted late.

    Grouped by segment, not by call: a split of 5 and then a merge of 5 and 6, or
    merges of 7 and 8 and of 6 and 7, act twice on one segment (as
    ``bench.fault_bench``'s ``Fencing.accepted_doubles`` counts them). Each doubled
    segment counts ``len(calls) - 1`` (:func:`count_doubles`).
    """
    passed: dict[tuple[str, str], list[Mutation]] = collections.defaultdict(list)
    for m in broker.mutations:
        action = m.action()
        if action is not None and m.passed_fence:
            _, topic, *segments = action
            for segment in segments:
                passed[(topic, segment)].append(m)
    doubles = {segment: calls for segment, calls in passed.items() if len(calls) > 1}
    newest: dict[str, int] = {}
    stale_accepted = []
    for call in sorted(broker.state.fenced_calls, key=lambda c: c.at):
        if not call.accepted:
            continue
        if call.token < newest.get(call.key, 0):
            stale_accepted.append(call)
        newest[call.key] = max(newest.get(call.key, 0), call.token)
    return doubles, stale_accepted


def describe(m: Mutation) -> str:
    """``merge 5+6 token 11 -> 412``: one call of a double action."""
    op, _, *ids = m.action() or (m.method, "")
    return f"{op} {'+'.join(ids)} token {m.token} -> {m.status}"


def count_doubles(doubles: dict[tuple[str, str], list[Mutation]]) -> int:
    """Calls past the fence on a segment beyond its first (:func:`double_actions`)."""
    return sum(len(calls) - 1 for calls in doubles.values())


#: Replica log events worth counting after churn: fencing at work, and trouble.
WATCHED_EVENTS: Final = (
    "operation.fenced",
    "state.write_fenced",
    "gc.prune.refused",
    "operation.skipped",
    "operation.failed",
    "shard.release_failed",
    "membership.lease_lost",
    "membership.failed",
    "evaluation.failed",
    "daemon.worker_failed",
    "loop.stalled",
)


def replica_events(
    replicas: Sequence[Replica], since_wall: float, until_wall: float = float("inf")
) -> collections.Counter[str]:
    """How often each of :data:`WATCHED_EVENTS` was logged by these replicas in the window."""
    counts: collections.Counter[str] = collections.Counter()
    for replica in replicas:
        for event in replica.log_events():
            name, stamp = event.get("event"), event.get("timestamp")
            if name not in WATCHED_EVENTS or not isinstance(stamp, str):
                continue
            if since_wall <= datetime.fromisoformat(stamp).timestamp() <= until_wall:
                counts[name] += 1
    return counts


def print_churn(
    ctx: Context,
    pool: Pool,
    broker: Broker,
    changes: list[Change],
    started: float,
    since_wall: float,
) -> None:
    writer = ctx.writer
    assert writer is not None
    args = ctx.args
    counts = collections.Counter(c.kind for c in changes)
    mix = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    print(f"\n## Churn: {len(changes)} membership changes under load ({mix})")
    print(f"{'change':<20} {'n':>3} {'settled: median':>16} {'max':>9} {'timeouts':>9}")
    for kind in counts:
        secs = [c.settle for c in changes if c.kind == kind and c.settle is not None]
        timeouts = sum(1 for c in changes if c.kind == kind and c.settle is None)
        print(
            f"{kind:<20} {counts[kind]:>3} "
            f"{fmt_s(statistics.median(secs)) if secs else '-':>16} "
            f"{fmt_s(max(secs)) if secs else '-':>9} {timeouts:>9}"
        )
    print(
        "(kill -9 and SIGTERM + restart: from the signal; SIGSTOP: from SIGCONT, after the "
        "others had taken its shards (a timeout if they had not); join: from process start)"
    )
    window = [m for m in broker.mutations if m.at >= started]
    applied = collections.Counter(
        a[0] for m in window if (a := m.action()) is not None and m.status == 204
    )
    layout_refused = sum(
        1 for m in window if m.action() is not None and m.passed_fence and m.status != 204
    )
    fenced = [c for c in broker.state.fenced_calls if c.at >= started]
    refused = [c for c in fenced if not c.accepted]
    shards_worked = {
        shard_of(c.topic, args.shards) for c in fenced if c.accepted and c.method == "POST"
    }
    doubles, stale_accepted = double_actions(broker)
    doubled = count_doubles(doubles)
    print(
        f"writer ({args.write_rate:g} ops/s): {writer.created} new hot topics, {writer.hot} hot "
        f"records, {writer.cold} cold pairs; {len(writer.topics):,} topics in all"
    )
    print(
        f"broker: {applied['split']} splits and {applied['merge']} merges applied on "
        f"{len(shards_worked)}/{args.shards} shards; {len(fenced)} fenced calls, "
        f"{len(fenced) - len(refused)} accepted, {len(refused)} refused as stale; "
        f"{layout_refused} past the fence but refused by the layout"
    )
    print(
        f"double actions: {doubled + len(stale_accepted)} "
        f"(a segment split or merged twice past the fence: {doubled}; "
        f"an older token accepted after a newer one on the same key: {len(stale_accepted)})"
    )
    for (topic, segment), calls in list(doubles.items())[:10]:
        print(f"  double: {topic} segment {segment}: " + ", ".join(map(describe, calls)))
    events = replica_events(pool.replicas, since_wall)
    if events:
        print("replica log events: " + ", ".join(f"{name} {n}" for name, n in events.most_common()))
    by_kind: collections.Counter[str] = collections.Counter()
    for call in refused:
        before = [c for c in changes if c.at <= call.at]
        by_kind[before[-1].kind if before else "(before any change)"] += 1
    if refused:
        print(
            "stale refusals by the last change before them: "
            + ", ".join(f"{kind} {n}" for kind, n in by_kind.most_common())
        )


# -- throughput -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    evaluations: float
    cpu: float
    queued: int


@dataclass(frozen=True, slots=True)
class PerReplica:
    name: str
    rate: float
    topics: int
    cpu: float
    queued: int
    lease_losses: int


async def replica_sample(pool: Pool, replica: Replica) -> Sample:
    count = await replica.metric("controllerd_evaluation_duration_seconds_count")
    status = await pool.status(replica)
    queued = int(status.get("queued", 0)) if status is not None else 0
    return Sample(count or 0.0, cpu_seconds(replica), queued)


async def measure(
    ctx: Context, pool: Pool, owned: dict[str, set[int]], topics: Sequence[TopicName]
) -> list[PerReplica]:
    """Evaluations/s and CPU of every live replica over ``--measure`` seconds."""
    live = pool.live()
    before = [await replica_sample(pool, r) for r in live]
    t0, wall0 = time.monotonic(), time.time()
    await anyio.sleep(ctx.args.measure)
    after = [await replica_sample(pool, r) for r in live]
    elapsed, wall1 = time.monotonic() - t0, time.time()
    shards = ctx.args.shards
    per = []
    for r, b, a in zip(live, before, after, strict=True):
        led = sum(1 for t in topics if shard_of(t, shards) in owned[r.name])
        rate = (a.evaluations - b.evaluations) / elapsed
        lost = replica_events([r], wall0, wall1)["membership.lease_lost"]
        per.append(
            PerReplica(r.name, rate, led, (a.cpu - b.cpu) / elapsed, min(a.queued, b.queued), lost)
        )
    return per


def short_of_demand(per: Sequence[PerReplica], asked: float) -> bool:
    """Whether a window fell well short of ``asked`` with no replica behind (queues
    empty, no lease lost): then the ticker asked for less, and the claim is false."""
    idle = all(p.queued == 0 and p.lease_losses == 0 for p in per)
    return idle and sum(p.rate for p in per) < 0.5 * asked


async def throughput(ctx: Context) -> None:
    args = ctx.args
    topics = [TopicName("bench", "tp", f"t{i}") for i in range(args.throughput_topics)]
    rows: list[tuple[int, list[PerReplica]]] = []
    async with serve_broker(ctx.store, "/tp/", args.shards) as broker:
        loading = time.monotonic()
        await add_topics(ctx.store, broker, topics, NEVER_QUIET)
        print(
            f"\n(loaded {len(topics):,} topics into etcd in {time.monotonic() - loading:.1f} s)",
            flush=True,
        )
        pool = Pool(
            ctx.root / "throughput",
            ctx.etcd.endpoint,
            "/tp/",
            broker.url,
            args.shards,
            args.throughput_ttl,
            f"[autoscale]\ninterval_seconds = {args.tick}\n",
        )
        try:
            for n in (1, 2, 3):
                replica = pool.spawn()
                await wait_until(replica.ready, within=300, step=0.1)
                done = await pool.wait_settled(pool.live(), within=120)
                if done is None:
                    raise RuntimeError(f"throughput: {n} replicas did not settle")
                await anyio.sleep(args.warmup)
                per = await measure(ctx, pool, done[1], topics)
                rows.append((n, per))
                print(
                    f"  {n} replica(s): {sum(p.rate for p in per):,.0f} evaluations/s", flush=True
                )
        finally:
            await pool.close()
    print(
        f"\n## Throughput: {len(topics):,} topics ({len(NEVER_QUIET)} segments, one cold: "
        f"never quiet), {args.shards} shards, every topic re-evaluated every {args.tick:g} s "
        f"(interval_seconds), lease TTL {args.throughput_ttl} s, {args.measure:g} s windows"
    )
    print(
        f"{'replicas':>8} {'evals/s':>9} {'vs 1':>6} {'CPU':>6} {'evals/CPU-s':>12}   "
        "per replica: evals/s, topics owned, CPU, queue, lease losses"
    )
    asked = len(topics) / args.tick
    base = sum(p.rate for p in rows[0][1]) if rows else 1.0
    for n, per in rows:
        total, cpu = sum(p.rate for p in per), sum(p.cpu for p in per)
        detail = "; ".join(
            f"{p.name} {p.rate:,.0f}/s {p.topics:,} {p.cpu:.0%} q{p.queued:,} L{p.lease_losses}"
            for p in per
        )
        print(
            f"{n:>8} {total:>9,.0f} {total / base:>5.2f}x {cpu:>6.0%} "
            f"{total / max(cpu, 1e-9):>12,.0f}   {detail}"
        )
    print(
        f"(asked for {asked:,.0f} evaluations/s in all; queue: topics waiting "
        "at the end of the window (the lower of two samples), above 0 = the replica was the "
        "limit, not the ticker; L: leases lost in the window (all its shards dropped and "
        "claimed again), which spoils the window)"
    )
    for n, per in rows:
        if short_of_demand(per, asked):
            print(
                f"warning: with {n} replica(s) no queue and only "
                f"{sum(p.rate for p in per):,.0f} evaluations/s of {asked:,.0f} asked: "
                "the ticker asked for less (quiet topics?), not the replicas"
            )


# -- main -------------------------------------------------------------------------------------


async def sharded_phases(ctx: Context) -> None:
    """Distribution, idle rebalances and churn on one cluster of ``--topics`` topics."""
    args = ctx.args
    phases = set(args.phases)
    topics = [TopicName("bench", "ns", f"t{i}") for i in range(args.topics)]
    extra = (
        "[autoscale]\ninterval_seconds = 5.0\n"
        "[policy]\nsplit_cooldown_seconds = 1.0\nmerge_cooldown_seconds = 1.0\n"
        "merge_window_seconds = 0.0\n"
    )
    async with serve_broker(ctx.store, "/shard/", args.shards) as broker:
        await add_topics(ctx.store, broker, topics)
        members_prefix = f"{broker.keys.controller_root}/members/"
        log = MemberLog(ctx.store, members_prefix)
        pool = Pool(
            ctx.root / "sharded",
            ctx.etcd.endpoint,
            "/shard/",
            broker.url,
            args.shards,
            args.ttl,
            extra,
        )
        async with anyio.create_task_group() as tg:
            await tg.start(log.run)
            try:
                for _ in range(3):
                    pool.spawn()
                for replica in pool.replicas:
                    await wait_until(replica.ready, within=60)
                done = await pool.wait_settled(pool.live(), within=60)
                if done is None:
                    raise RuntimeError("3 replicas did not settle")
                if "distribution" in phases:
                    print_distribution(ctx, pool, done[1], topics)
                if "rebalance" in phases:
                    within = args.settle_timeout
                    for _ in range(args.rounds):
                        await timed_departure(ctx, pool, log, within, signal.SIGKILL)
                        await timed_departure(ctx, pool, log, within, signal.SIGTERM)
                    print_rebalances(
                        ctx,
                        f"Rebalance, idle: 3 replicas, {args.shards} shards, lease TTL "
                        f"{args.ttl} s, {args.rounds} rounds",
                        ctx.rebalances,
                    )
                if "churn" in phases:
                    print(f"\nchurn: {args.changes} changes ...", flush=True)
                    started, since_wall = time.monotonic(), time.time()
                    changes = await churn(ctx, pool, broker, topics)
                    await pool.wait_settled(pool.live(), within=args.settle_timeout)
                    await anyio.sleep(2.0)  # anything still in flight lands now
                    print_churn(ctx, pool, broker, changes, started, since_wall)
            finally:
                await pool.close()
                tg.cancel_scope.cancel()


async def main_async(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="controllerd-shard-bench-"))
    etcd = EtcdServer(root / "etcd")
    etcd.start()
    load = os.getloadavg()
    print(
        f"sharded mode: {args.shards} shards, lease TTL {args.ttl} s; {os.cpu_count()} CPUs, "
        f"load average {load[0]:.2f} at start; work dir {root}",
        flush=True,
    )
    try:
        async with open_store([etcd.endpoint], timeout=5.0, retry_for=10.0) as store:
            ctx = Context(args, root, etcd, store, random.Random(args.seed))
            if set(args.phases) & {"distribution", "rebalance", "churn"}:
                await sharded_phases(ctx)
            if "throughput" in args.phases:
                await throughput(ctx)
        print(f"\n(load average {os.getloadavg()[0]:.2f} at the end)")
    finally:
        etcd.close()
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


PHASES: Final = ("distribution", "rebalance", "churn", "throughput")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--topics", type=int, default=2000, help="topics of the sharded cluster")
    parser.add_argument("--shards", type=int, default=256)
    parser.add_argument("--ttl", type=int, default=2, help="lease TTL in seconds")
    parser.add_argument("--rounds", type=int, default=3, help="idle kill/leave/join rounds")
    parser.add_argument("--changes", type=int, default=50, help="membership changes of churn")
    parser.add_argument("--write-rate", type=float, default=20.0, help="writer ops/s in churn")
    parser.add_argument("--settle-timeout", type=float, default=60.0)
    parser.add_argument("--throughput-topics", type=int, default=20_000)
    parser.add_argument(
        "--throughput-ttl",
        type=int,
        default=10,
        help="lease TTL of the throughput replicas (the default's; 2 s flaps under full CPU)",
    )
    parser.add_argument("--tick", type=float, default=0.2, help="interval_seconds (throughput)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring")
    parser.add_argument("--measure", type=float, default=15.0, help="seconds measured")
    parser.add_argument(
        "--phases",
        type=lambda s: [p for p in s.split(",") if p],
        default=list(PHASES),
        help="comma-separated subset of " + ",".join(PHASES),
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    args = parser.parse_args(argv)
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        parser.error(f"--phases: unknown {', '.join(sorted(unknown))}")
    anyio.run(main_async, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
