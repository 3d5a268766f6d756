"""The issue's yardstick replayed on a fleet-shaped sample, not projected from 65 groups.

``bench.backtest_bench`` projects 10,000 topics x 30 days x 5 variants from the
shared traces as they are: 13 traces of 14 to 214 days, whose longest ones decide
when a two-core run ends. A fleet is many topics over the same month. This bench
builds one: topic ``i`` replays shared trace ``i mod 13`` from a seeded random
row for ``--days`` days (the trace repeated end to end where it is shorter),
every topic starting on the same day, as a recorded month would. It replays the
fleet on the engine in chunks of ``--chunk`` topics, each chunk one backtest run
(one broadcast of its series, as ``controllerd backtest`` sends them), and times
everything but the Spark session's start, which it prints apart. The chunks are
alike and independent, so the time for ``--project`` topics is the measured time
scaled by topics, plus the session start once. The first chunk also starts the
Python workers and loads the compiled kernels; that cost is scaled with the rest.

The topics are series, as the shared traces are. A recorded history (``record``'s
Parquet) replays through the general loop, not the compiled short path, and costs
several times more per step; this bench does not measure it.

Usage: python -m bench.fleet_bench [--topics 1000] [--days 30] [--chunk 500] \\
           [--engines spark] [--master local[2]] [--project 10000]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from controllerd.pipeline.engines import RunOptions, run_local, run_spark, spark_session
from controllerd.pipeline.load import Trace
from controllerd.pipeline.traces import TraceOptions, discover
from controllerd.pipeline.variants import load_variants
from tests.support.shared import traces_dir

ROOT = Path(__file__).resolve().parent.parent
FLEET_START_MS = 1_767_225_600_000  # 2026-01-01T00:00Z: every topic's month starts here
DAY_MS = 86_400_000


def fleet_trace(name: str, base: Trace, days: float, rng: random.Random) -> Trace:
    """``base`` from a random row for ``days`` days, repeated end to end where it is
    shorter; the rows' rate tuples are ``base``'s own objects (a broadcast pickles each
    once)."""
    t = np.asarray(base.t_ms, dtype=np.int64)
    n = len(t)
    step = int(np.median(np.diff(t))) if n > 1 else 60_000
    period = int(t[-1] - t[0]) + step  # one pass of the trace, then it starts again
    span = int(days * DAY_MS)
    offset = int(t[rng.randrange(n)] - t[0])  # at a row: the topic's first row is at the start
    passes = (offset + span) // period + 1
    times = np.concatenate([t - t[0] + k * period for k in range(passes + 1)])
    index = np.arange(len(times)) % n
    keep = (times >= offset) & (times < offset + span)
    kept_times = times[keep] - offset + FLEET_START_MS
    return Trace(
        name,
        "series",
        kept_times.tolist(),
        [0] * int(keep.sum()),
        [0xFFFF] * int(keep.sum()),
        [base.rates[i] for i in index[keep].tolist()],
    )


def build_fleet(
    bases: Sequence[Trace], first: int, count: int, days: float, seed: int
) -> list[Trace]:
    """Topics ``first`` to ``first + count - 1``. A topic's offset depends on the seed and
    its number alone, so the fleet built in chunks is the fleet built at once."""
    out = []
    for i in range(first, first + count):
        base, rng = bases[i % len(bases)], random.Random(seed * 1_000_003 + i)
        out.append(fleet_trace(f"topic-{i:05d}-{base.name}", base, days, rng))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--traces", nargs="+", default=[str(traces_dir() / "nab"), str(traces_dir() / "aws")]
    )
    parser.add_argument("--variants", default=str(ROOT / "examples/variants.toml"))
    parser.add_argument("--topics", type=int, default=1000)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--chunk", type=int, default=500, help="topics per backtest run")
    parser.add_argument("--engines", default="spark")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--workers", type=int, default=2, help="the local engine's processes")
    parser.add_argument("--project", type=int, default=10_000, help="topics to project to")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.topics < 1 or args.chunk < 1 or args.days <= 0:
        parser.error("--topics and --chunk must be at least 1, --days above 0")
    engines = args.engines.split(",")
    if unknown := [e for e in engines if e not in ("local", "spark")]:
        parser.error(f"unknown engine {unknown[0]!r}")

    variants = load_variants(args.variants)
    bases = discover(args.traces, TraceOptions())
    steps = sum(args.days * 86_400 / v.strategy.interval_seconds * args.topics for v in variants)
    print(
        f"fleet: {args.topics:,} topics x {args.days:g} days x {len(variants)} variants "
        f"= {steps:,.0f} evaluation steps, from {len(bases)} traces"
    )
    options = RunOptions(timeline_points=0)
    firsts = range(0, args.topics, args.chunk)
    for engine in engines:
        start = 0.0
        session = None
        if engine == "spark":
            started = time.perf_counter()
            session = spark_session(args.master)
            start = time.perf_counter() - started
        times: list[float] = []
        groups = rows = 0
        try:
            for first in firsts:
                # Built before its run and not timed: a fleet's month is read, not built,
                # and 10,000 topics at once would hold ~5 GB of Python lists.
                count = min(args.chunk, args.topics - first)
                chunk = build_fleet(bases, first, count, args.days, args.seed)
                rows += sum(len(t.t_ms) for t in chunk)
                started = time.perf_counter()
                if session is None:
                    result = run_local(chunk, variants, options, workers=args.workers)
                else:
                    result = run_spark(chunk, variants, options, spark=session)
                times.append(time.perf_counter() - started)
                groups += len(result)
                del chunk, result
        finally:
            if session is not None:
                session.stop()
        if groups != args.topics * len(variants):
            raise SystemExit(
                f"{engine}: {groups} groups replayed, not {args.topics * len(variants)}"
            )
        total = sum(times)
        label = (
            f"spark ({args.master})" if engine == "spark" else f"local ({args.workers} processes)"
        )
        print(f"\n{label}: {len(firsts)} runs of up to {args.chunk} topics")
        print(f"  load rows:      {rows:,} ({rows / args.topics:,.0f} a topic)")
        print(f"  session start:  {start:.1f} s (not in the runs)")
        print("  runs:           " + ", ".join(f"{t:.1f}" for t in times) + " s")
        print(
            f"  replay:         {total:.1f} s, {steps / total:,.0f} steps/s, "
            f"{groups / total:,.1f} groups/s"
        )
        scale = args.project / args.topics
        print(
            f"  {args.project:,} topics: {start:.1f} s + {total:.1f} s x {scale:g} "
            f"= {(start + total * scale) / 60:.1f} minutes (goal <= 10)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
