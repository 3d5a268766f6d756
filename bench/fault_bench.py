"""Never die, never lie: the fault figures of issue #10, on real processes.

Real etcd, real ``controllerd run`` replicas and the test broker over real
HTTP behind a fault-injecting server (``tests/faults/chaos.py``). The broker
side fences like the reference broker: a mutation is refused (409 ``fenced``)
unless its ``X-Fencing-Token`` is the create revision of the key named by
``X-Fencing-Key`` in etcd at that instant. Prints one line per section as it
goes, then the table for the README:

* forced failovers (kill -9, SIGTERM, SIGSTOP past the lease TTL, in turn,
  under continuous split/merge work) and double actions: an operation on a
  segment already split or merged, or with a stale fencing token, as sent by
  a replica and as accepted by the broker; exits are replica processes that
  ended on their own, and SIGTERM'd leaders that did not exit 0, each once;
* malformed values (hypothesis, every key kind) written under running
  replicas, with a kill -9 of the leader, and process exits;
* etcd paused (SIGSTOP) for up to 30 s and killed/restarted: replica exits,
  and the time from etcd's return to the first action (the first write after
  its return is a hot load record; the time runs to its split request);
* broker storms (503, 500, a socket that never answers, 409, 412) survived,
  guard leaks, burned cooldowns and requests beyond the retry schedule (of
  those checked: requests into the socket that never answers are counted
  apart, as each waits out the client's timeout);
* GC with backlog > 0, unknown backlog (500, 404, no answer) and retention:
  unsafe deletions (a delete request before the backlog was known to be 0, or
  for a segment inside retention at any time in its round), and crashes
  between prune and delete finished by the next leader.

Usage: python -m bench.fault_bench [--failovers 100] [--malformed 1000]
    [--pauses 1,2,5,10,20,30] [--restarts 10] [--storms 20] [--gc-rounds 3]
    [--ttl 2] [--sections failover,malformed,etcd,storms,gc]

Takes about a quarter of an hour with the defaults; never part of the test suite.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import math
import random
import re
import signal
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.from_thread
import anyio.to_thread
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from controllerd.adapters import backoff
from controllerd.adapters.store import Store, open_store
from controllerd.core.model import TopicName
from tests.faults.chaos import (
    HOT,
    SEGMENTS,
    Chaos,
    open_chaos,
    operations,
    schedule_violations,
    segments_prefix,
    spanning_backoff,
    topic_path,
)
from tests.faults.poison import KINDS, NEVER_REJECTED, Poison, poison_key, poison_values
from tests.support.daemon import Replica, wait_until
from tests.support.etcd import EtcdServer, scratch_etcd

REJECTED = "controllerd_metadata_rejected_total"
_SPLIT = re.compile(r"^/admin/v2/scalable/([^/]+)/([^/]+)/([^/]+)/split/(\d+)$")
_MERGE = re.compile(r"^/admin/v2/scalable/([^/]+)/([^/]+)/([^/]+)/merge/(\d+)/(\d+)$")


@dataclass
class Row:
    """One line of the README's table."""

    what: str
    target: str
    measured: str


@dataclass
class Fencing:
    """The broker's fencing and the double-action count, as a gate in front of it."""

    chaos: Chaos
    sent_stale: int = 0
    sent_sealed: int = 0
    mutations: int = 0

    async def __call__(
        self, method: str, path: str, headers: dict[str, str]
    ) -> tuple[int, str] | None:
        if method == "GET":
            return None
        self.mutations += 1
        key = headers.get("x-fencing-key", self.chaos.keys.leader)
        raw = headers.get("x-fencing-token")
        kv = await self.chaos.store.get(key)
        if raw is None or kv is None or str(kv.create_revision) != raw:
            self.sent_stale += 1
            return 409, "fenced"
        if not self._targets_active(path):
            self.sent_sealed += 1  # the broker's layout check answers 412
        return None

    def _targets_active(self, path: str) -> bool:
        split, merge = _SPLIT.match(path), _MERGE.match(path)
        match = split or merge
        if match is None:
            return True
        layout = self.chaos.broker.topics.get(TopicName(*match.groups()[:3]))
        if layout is None:
            return True
        ids = [int(g) for g in match.groups()[3:]]
        return all(i in layout.segments and layout.segments[i].active for i in ids)

    def accepted_doubles(self) -> int:
        """Mutations the broker applied although stale or on a sealed segment.

        The gate refuses stale tokens and the broker's layout refuses sealed
        segments, so this counts what got through both: it must be 0.
        """
        applied = [
            s
            for s in self.chaos.http.seen
            if s.method == "POST" and not s.injected and s.status is not None and s.status < 300
        ]
        per_parent: collections.Counter[tuple[str, str]] = collections.Counter()
        for seen in applied:
            match = _SPLIT.match(seen.path) or _MERGE.match(seen.path)
            if match is not None:
                for segment in match.groups()[3:]:
                    per_parent[("/".join(match.groups()[:3]), segment)] += 1
        return sum(n - 1 for n in per_parent.values() if n > 1)


async def _every(seconds: float, work: Callable[[], Awaitable[None]]) -> None:
    while True:
        await work()
        await anyio.sleep(seconds)


# -- forced failovers ---------------------------------------------------------------------

FAILOVER_CONFIG = """
[autoscale]
interval_seconds = 1
consumer_settle_seconds = 0
[policy]
split_cooldown_seconds = 1
merge_cooldown_seconds = 1
merge_window_seconds = 1
max_segments = 9
"""


async def _drive_load(chaos: Chaos, topics: Sequence[TopicName]) -> None:
    """Hot for a while, then cold, topic by topic out of phase: splits and merges all along."""
    rng = random.Random(468)
    start = time.monotonic()

    async def once() -> None:
        phase = int((time.monotonic() - start) / 4)
        for i, topic in enumerate(topics):
            layout = chaos.broker.topics.get(topic)
            if layout is None:
                continue
            hot = (phase + i) % 2 == 0
            for seg in layout.active_segments():
                rate = rng.uniform(21_000, 29_000) if hot else rng.uniform(1, 50)
                await chaos.put_load(seg.segment_id, rate, topic)

    await _every(1.0, once)


def _unplanned_ends(
    replicas: Sequence[Replica], stopped: Collection[str]
) -> set[subprocess.Popen[bytes]]:
    """The processes of ``replicas`` that ended although nobody stopped them.

    Processes, not replica names: a replica restarted after an exit is a new
    process, and one exit seen at every later check must count once.
    """
    return {
        r.proc
        for r in replicas
        if r.proc is not None and r.proc.poll() is not None and r.name not in stopped
    }


async def _ended_badly(victim: Replica, sig: signal.Signals) -> bool:
    """Wait for a replica we signalled to end; True if a SIGTERM'd one did not exit 0.

    A graceful shutdown must exit 0 (status 70 is a crash on the way out, which
    ``Chaos.assert_alive`` never sees: the victim is in ``stopped``). A kill -9
    ends by its signal, which says nothing about the daemon.
    """
    status = await anyio.to_thread.run_sync(victim.wait, 20.0)
    return sig == signal.SIGTERM and status != 0


async def failovers(
    args: argparse.Namespace, store: Store, etcd: EtcdServer, tmp: Path
) -> list[Row]:
    async with open_chaos(
        store,
        etcd.endpoint,
        "/bench/failover/",
        tmp,
        count=3,
        extra=FAILOVER_CONFIG,
        lease_ttl=args.ttl,
    ) as chaos:
        fencing = Fencing(chaos)
        chaos.http.gate = fencing
        topics = [TopicName("bench", "failover", f"t{i}") for i in range(6)]
        for topic in topics:
            await chaos.add_topic(topic)
        kinds = itertools.cycle(("kill -9", "SIGTERM", "SIGSTOP"))
        times: dict[str, list[float]] = collections.defaultdict(list)
        exited: set[subprocess.Popen[bytes]] = set()  # each process once
        async with anyio.create_task_group() as tg:
            tg.start_soon(_drive_load, chaos, topics)
            for _ in range(args.failovers):
                kind = next(kinds)
                leader = await chaos.leader(within=60)
                status = await leader.status()
                token = status["fencing_token"] if status else 0

                async def standby_ready(leader: Replica = leader) -> bool:
                    return any([await r.ready() for r in chaos.alive() if r is not leader])

                await wait_until(standby_ready, within=60, step=0.05)
                started = time.monotonic()
                chaos.stopped.add(leader.name)
                sig = {"kill -9": signal.SIGKILL, "SIGTERM": signal.SIGTERM}.get(
                    kind, signal.SIGSTOP
                )
                leader.signal(sig)

                async def taken_over(leader: Replica = leader, token: int = token) -> bool:
                    for replica in chaos.alive():
                        if replica is leader:
                            continue
                        body = await replica.status()
                        if body and body.get("leader") and body["fencing_token"] > token:
                            return True
                    return False

                await wait_until(taken_over, within=60, step=0.02)
                times[kind].append(time.monotonic() - started)
                if kind == "SIGSTOP":
                    leader.signal(signal.SIGCONT)  # wakes past its TTL, deposed
                else:
                    proc = leader.proc
                    if await _ended_badly(leader, sig) and proc is not None:
                        exited.add(proc)
                    leader.start()
                chaos.stopped.discard(leader.name)
                exited |= _unplanned_ends(chaos.replicas, chaos.stopped)
            await anyio.sleep(3.0)  # the last operations land
            tg.cancel_scope.cancel()
        exits = len(exited | _unplanned_ends(chaos.replicas, chaos.stopped))
        applied = sum(
            1
            for s in chaos.http.seen
            if s.method == "POST" and not s.injected and s.status is not None and s.status < 300
        )
        doubles = fencing.accepted_doubles()
        total = sum(len(v) for v in times.values())
        detail = ", ".join(
            f"{k} {len(v)} (median {statistics.median(v):.1f} s)" for k, v in times.items()
        )
        print(
            f"failovers: {total} ({detail}); operations applied {applied}; "
            f"sent with a stale token {fencing.sent_stale} (refused), on a sealed segment "
            f"{fencing.sent_sealed} (refused); accepted double actions {doubles}; exits {exits}"
        )
        return [
            Row(
                f"forced failovers (kill -9, SIGTERM, SIGSTOP past the {args.ttl} s TTL) under "
                f"load / double actions accepted by the broker",
                "100 / 0",
                f"{total} / {doubles} ({applied} operations applied; sent stale "
                f"{fencing.sent_stale} and on sealed segments {fencing.sent_sealed}, all refused; "
                f"{exits} exits)",
            )
        ]


# -- malformed values ---------------------------------------------------------------------


async def malformed(
    args: argparse.Namespace, store: Store, etcd: EtcdServer, tmp: Path
) -> list[Row]:
    batch = 50
    async with open_chaos(store, etcd.endpoint, "/bench/malformed/", tmp, count=2) as chaos:
        await chaos.leader()
        written: list[Poison] = []

        async def put(poisons: list[Poison]) -> None:
            for poison in poisons:
                await store.put(poison_key(chaos.keys, poison.kind, len(written)), poison.value)
                written.append(poison)
            if len(written) >= args.malformed // 2 and not chaos.stopped:
                leader = await chaos.leader()
                chaos.stopped.add(leader.name)  # a kill -9 in the middle of the stream
                leader.signal(signal.SIGKILL)
                await chaos.start_replica(ready=False)

        @settings(
            max_examples=math.ceil(args.malformed / batch),
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(st.lists(poison_values, min_size=batch, max_size=batch))
        def stream(poisons: list[Poison]) -> None:
            anyio.from_thread.run(put, poisons)

        await anyio.to_thread.run_sync(stream)
        survivors = [r for r in chaos.replicas if r.name not in chaos.stopped]
        await chaos.leader(within=60)
        good = TopicName("bench", "malformed", "good")
        await chaos.add_topic(good)
        await chaos.put_load(0, HOT, good)

        async def served() -> bool:
            return chaos.active(good) == 3

        await wait_until(served, within=60)
        counted = [
            sum([await chaos.metric(r, REJECTED, kind=k) for k in KINDS if k not in NEVER_REJECTED])
            for r in survivors
        ]
        exits = sum(1 for r in survivors if not r.alive())
        tried = len(written)
        rejected = sum(1 for p in written if p.kind not in NEVER_REJECTED)
        print(
            f"malformed values: {tried} written "
            f"({dict(collections.Counter(p.kind for p in written))}); "
            f"refusals counted per replica {counted} (of {rejected} refusable); exits {exits}"
        )
        return [
            Row(
                "malformed values of every key kind through the watch (kill -9 of the leader "
                "midway) / process exits",
                ">= 1,000 / 0",
                f"{tried} / {exits}",
            )
        ]


# -- etcd outages -------------------------------------------------------------------------


async def _first_action(chaos: Chaos, topic: TopicName, returned: float) -> float:
    """Seconds from etcd's return to the split request for ``topic`` (written just now)."""
    await chaos.put_load(0, HOT, topic)
    path = topic_path(topic) + "/split/"

    async def arrived() -> bool:
        return bool(chaos.http.requests(path))

    await wait_until(arrived, within=120, step=0.005)
    return chaos.http.requests(path)[0].at - returned


async def etcd_outages(
    args: argparse.Namespace, store: Store, etcd: EtcdServer, tmp: Path
) -> list[Row]:
    async with open_chaos(
        store, etcd.endpoint, "/bench/etcd/", tmp, count=2, lease_ttl=args.ttl
    ) as chaos:
        await chaos.leader()
        pauses: list[tuple[float, float]] = []
        for n, seconds in enumerate(args.pauses):
            topic = TopicName("bench", "pause", f"t{n}")
            await chaos.add_topic(topic)
            etcd.pause()
            await anyio.sleep(seconds)
            etcd.resume()
            pauses.append((seconds, await _first_action(chaos, topic, time.monotonic())))
        restarts: list[float] = []
        downtimes = itertools.cycle((0.5, 1.0, args.ttl + 1.0))
        for n in range(args.restarts):
            topic = TopicName("bench", "restart", f"t{n}")
            await chaos.add_topic(topic)
            await anyio.to_thread.run_sync(etcd.kill)
            await anyio.sleep(next(downtimes))
            await anyio.to_thread.run_sync(etcd.start)
            restarts.append(await _first_action(chaos, topic, time.monotonic()))
        exits = sum(1 for r in chaos.replicas if not r.alive())
        print(
            "etcd pauses: "
            + ", ".join(f"{s:g} s -> first action {t:.2f} s after" for s, t in pauses)
            + f"; {len(restarts)} kill/restarts -> first action median "
            f"{statistics.median(restarts):.2f} s, max {max(restarts):.2f} s; exits {exits}"
        )
        return [
            Row(
                f"etcd paused (SIGSTOP) {', '.join(f'{s:g}' for s, _ in pauses)} s and "
                f"{len(restarts)} kill/restarts, 2 replicas / exits",
                "0 exits",
                f"{len(pauses)} + {len(restarts)} survived / {exits}",
            ),
            Row(
                "etcd's return -> first action (a hot load record written at once), "
                "after each pause / restart",
                "(report)",
                f"pauses: {', '.join(f'{t:.2f}' for _, t in pauses)} s; restarts: median "
                f"{statistics.median(restarts):.2f} s, max {max(restarts):.2f} s",
            ),
        ]


# -- broker storms ------------------------------------------------------------------------

STORM_INTERVAL = 2.0
STORM_CONFIG = f"[autoscale]\ninterval_seconds = {STORM_INTERVAL}\nconsumer_settle_seconds = 0\n"
STORM_KINDS = ("503", "500", "hang", "409", "412")


def _beyond_schedule(ops: list[list[float]], schedule: backoff.Backoff) -> int:
    """Requests the schedules did not allow: past the broker client's one retry in an
    operation, or a whole operation started before the topic's backoff floor."""
    excess = sum(max(0, len(op) - 2) for op in ops)
    early = [v for v in schedule_violations(ops, schedule, 1, 1.0) if "floor" in v]
    return excess + len(early)


def _judge_storm(kind: str, posts: list[float], schedule: backoff.Backoff) -> int | None:
    """How many of one storm topic's split requests (arrival times) the schedules did
    not allow; None when they cannot be checked: each attempt of a hung request waits
    out the client's timeout, so its spacing says nothing about the schedule."""
    if kind == "hang":
        return None
    if kind in ("500", "503"):  # two attempts each (the client's one retry)
        ops = operations(posts, per_op=2)
        # a run spanning a topic backoff is not one operation: count it
        return len(spanning_backoff(ops, schedule)) + _beyond_schedule(ops, schedule)
    return _beyond_schedule(operations(posts), schedule)


async def storms(args: argparse.Namespace, store: Store, etcd: EtcdServer, tmp: Path) -> list[Row]:
    schedule = backoff.TOPIC_RETRY.capped_at(STORM_INTERVAL)
    survived = leaks = burned = checked = unchecked = beyond = 0
    async with open_chaos(
        store, etcd.endpoint, "/bench/storms/", tmp, count=2, extra=STORM_CONFIG
    ) as chaos:
        await chaos.leader()
        for n in range(math.ceil(args.storms / len(STORM_KINDS))):
            kinds = STORM_KINDS[: args.storms - n * len(STORM_KINDS)]
            topics = {kind: TopicName("bench", f"storm{n}", kind) for kind in kinds}
            for kind, topic in topics.items():
                path = topic_path(topic) + "/split/"
                if kind == "hang":
                    chaos.http.hang(path)
                else:
                    chaos.http.fail(path, int(kind))
                await chaos.add_topic(topic)

            async def hot(topics: dict[str, TopicName] = topics) -> None:
                for topic in topics.values():
                    await chaos.put_load(0, random.uniform(24_000, 30_000), topic)

            with anyio.move_on_after(6.0):
                await _every(0.5, hot)
            for topic in topics.values():
                burned += await chaos.cooldown_written(topic)
            chaos.http.heal()
            for kind, topic in topics.items():
                posts = [
                    s.at
                    for s in chaos.http.requests(topic_path(topic) + "/split/", method="POST")
                    if s.injected
                ]
                judged = _judge_storm(kind, posts, schedule)
                if judged is None:
                    unchecked += len(posts)
                else:
                    checked += len(posts)
                    beyond += judged

                async def split(topic: TopicName = topic) -> bool:
                    return chaos.active(topic) == 3 and await chaos.cooldown_written(topic)

                try:
                    await wait_until(split, within=schedule.cap + 15)
                    survived += 1
                except TimeoutError:
                    leaks += 1
        exits = sum(1 for r in chaos.replicas if not r.alive())
    print(
        f"broker storms: {survived} of {args.storms} recovered ({', '.join(STORM_KINDS)}); "
        f"guard leaks {leaks}; burned cooldowns {burned}; split requests sent into the storms "
        f"{checked}, of which beyond the retry schedule {beyond}, and {unchecked} into the "
        f"socket that never answers (not checked); exits {exits}"
    )
    return [
        Row(
            "broker storms (503, 500, no answer, 409, 412; hot load records meanwhile) "
            "survived / guard leaks / burned cooldowns",
            "all / 0 / 0",
            f"{survived} of {args.storms} / {leaks} / {burned} ({beyond} of {checked} split "
            f"requests beyond the retry schedule; {unchecked} more into the socket that never "
            "answers, not checked)",
        )
    ]


# -- GC under chaos -----------------------------------------------------------------------

GC_CONFIG = "[gc]\ninterval_seconds = 0.5\ndefault_retention_seconds = 1\n"


def _segment_requests(chaos: Chaos, topic: TopicName, method: str) -> list[float]:
    return [s.at for s in chaos.http.requests(segments_prefix(topic), method=method)]


def _unsafe_deletes(
    chaos: Chaos, healed_at: float, until_healed: Sequence[TopicName], retained: TopicName
) -> int:
    """Delete requests that must not have been sent: for ``until_healed`` before
    ``healed_at`` (their backlog was > 0 or unknown until then), and for ``retained``
    at any time (its retention outlasts the bench), however late in the round."""
    early = sum(
        1 for t in until_healed for at in _segment_requests(chaos, t, "DELETE") if at < healed_at
    )
    return early + len(_segment_requests(chaos, retained, "DELETE"))


@dataclass
class _GcRound:
    unsafe: int = 0
    collected: int = 0
    kept: bool = False
    crash_finished: bool = False


async def _gc_round(chaos: Chaos, ns: str) -> _GcRound:
    """Every unsafe case at once beside a drained topic; then heal; then a crash."""
    result = _GcRound()
    drained = TopicName("bench", ns, "drained")
    with_backlog = TopicName("bench", ns, "backlog")
    retained = TopicName("bench", ns, "retention")
    unknown = {TopicName("bench", ns, f"http-{s}"): s for s in (500, 404, 0)}
    parents = {drained: await chaos.split_with_subscription(drained)}
    for topic, status in unknown.items():
        parents[topic] = await chaos.split_with_unknown_backlog(topic, status)
    parents[with_backlog] = await chaos.split_with_subscription(with_backlog)
    chaos.broker.backlogs[(with_backlog, parents[with_backlog], "s")] = 3
    parents[retained] = await chaos.split_with_subscription(retained, retention=3_600)
    asked_about = (*unknown, with_backlog)

    async def asked() -> bool:
        return (drained, parents[drained]) in chaos.broker.deleted_segments and all(
            len(_segment_requests(chaos, t, "GET")) >= 2 for t in asked_about
        )

    await wait_until(asked, within=60)
    healed_at = time.monotonic()  # a delete of asked_about that arrived before: unsafe
    chaos.http.heal()
    chaos.broker.backlogs[(with_backlog, parents[with_backlog], "s")] = 0
    collectable = (drained, *asked_about)

    async def all_done() -> bool:
        return all((t, parents[t]) in chaos.broker.deleted_segments for t in collectable)

    await wait_until(all_done, within=60)
    result.collected = len(collectable)

    # A kill -9 between the prune transaction and the broker delete.
    crash = TopicName("bench", ns, "crash")
    descriptor = await chaos.split_with_subscription(crash)
    leader = await chaos.leader()
    fault = chaos.http.hang(f"{SEGMENTS}bench/{ns}/crash/{descriptor}", method="DELETE")

    async def between() -> bool:
        return chaos.http.holding > 0

    await wait_until(between, within=60)
    chaos.stopped.add(leader.name)
    leader.signal(signal.SIGKILL)
    chaos.http.heal(fault)
    marker = chaos.keys.pending_delete(crash, descriptor)

    async def finished() -> bool:
        return await chaos.store.get(marker) is None

    await wait_until(finished, within=60)
    result.crash_finished = (crash, descriptor) in chaos.broker.deleted_segments
    await anyio.to_thread.run_sync(leader.wait, 20.0)
    leader.start()
    chaos.stopped.discard(leader.name)
    await wait_until(leader.ready, within=60)
    result.unsafe = _unsafe_deletes(chaos, healed_at, asked_about, retained)
    result.kept = (retained, parents[retained]) not in chaos.broker.deleted_segments
    return result


async def gc_chaos(
    args: argparse.Namespace, store: Store, etcd: EtcdServer, tmp: Path
) -> list[Row]:
    async with open_chaos(
        store, etcd.endpoint, "/bench/gc/", tmp, count=2, extra=GC_CONFIG, lease_ttl=args.ttl
    ) as chaos:
        await chaos.leader()
        rounds = [await _gc_round(chaos, f"gc{n}") for n in range(args.gc_rounds)]
        exits = sum(1 for r in chaos.replicas if not r.alive())
    unsafe = sum(r.unsafe for r in rounds)
    collected = sum(r.collected for r in rounds)
    kept = sum(r.kept for r in rounds)
    finished = sum(r.crash_finished for r in rounds)
    print(
        f"GC under chaos: {len(rounds)} rounds; unsafe deletions {unsafe}; drained segments "
        f"collected {collected}; kept by retention {kept} of {len(rounds)}; crashes between "
        f"prune and delete finished by the next leader {finished} of {len(rounds)}; "
        f"exits {exits}"
    )
    return [
        Row(
            "GC with backlog > 0, unknown backlog (500, 404, no answer) or inside retention / "
            "unsafe deletions",
            "0",
            f"{unsafe} ({collected} drained segments collected after healing; "
            f"{finished} of {len(rounds)} kill -9s between prune and delete "
            "finished by the next leader)",
        )
    ]


SECTIONS = {
    "failover": failovers,
    "malformed": malformed,
    "etcd": etcd_outages,
    "storms": storms,
    "gc": gc_chaos,
}


async def main_async(args: argparse.Namespace) -> None:
    rows: list[Row] = []
    with scratch_etcd("controllerd-fault-bench-") as (root, etcd):
        async with open_store([etcd.endpoint], timeout=2.0, retry_for=30.0) as store:
            for name in args.sections:
                rows.extend(await SECTIONS[name](args, store, etcd, root / name))
    print()
    print("| what | target | measured |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row.what} | {row.target} | {row.measured} |")


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--failovers", type=int, default=100)
    parser.add_argument("--malformed", type=int, default=1_000)
    parser.add_argument("--pauses", type=_floats, default=[1.0, 2.0, 5.0, 10.0, 20.0, 30.0])
    parser.add_argument("--restarts", type=int, default=10)
    parser.add_argument("--storms", type=int, default=20)
    parser.add_argument("--gc-rounds", type=int, default=3)
    parser.add_argument("--ttl", type=int, default=2, help="lease TTL in seconds")
    parser.add_argument(
        "--sections",
        type=lambda text: [s for s in text.split(",") if s],
        default=list(SECTIONS),
        help=f"comma-separated, of {', '.join(SECTIONS)}",
    )
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    anyio.run(main_async, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
