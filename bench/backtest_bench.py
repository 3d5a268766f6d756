"""Backtest throughput, and what it means for a real fleet's history.

Replays the traces under the variants on each engine ``--repeat`` times (the
Spark session start is not timed; its first query also starts the Python
workers) and prints, for the best run, groups/s and replayed evaluation steps
per second (an evaluation step is one ``[autoscale].interval_seconds`` of one
topic under one variant, visited or skipped by the event-driven replay). Both
engines must agree on every metric, which the bench checks too.

It also replays a sample in one process both ways, event-driven and step by
step (the reference the event-driven replay is tested against), and prints the
speed-up and the share of steps the replay visits. Finally it projects the time
for ``--topics`` topics x ``--days`` days x ``--fleet-variants`` variants (the
issue's yardstick: 10,000 x 30 x 5) at the measured Spark rate, and again with the
run's fixed cost (Spark's per-query overhead, worker start) paid once, from the
rate of the steps beyond the first ``--short-hours`` of each trace: that assumes a
fleet whose load changes as often as these traces' does (NAB and AWS: every 5 or
30 minutes); a quieter fleet replays faster, one that changes every minute slower.
Groups keep no timelines unless ``--timeline-points`` says so: a fleet's backtest
keeps them only for the traces it plots (``--plot-traces``, replayed a second
time). It prints the result's size a group, and what the fleet's groups would
bring to the driver.

These are projections from 65 groups of traces 14 to 214 days long, at whose size
Spark's per-run cost and the longest traces weigh as much as the replay;
``bench.fleet_bench --topics 10000`` replays the yardstick itself, on a fleet of equal
months built from the same traces.

Usage: python -m bench.backtest_bench [--traces ../shared/traces/nab ../shared/traces/aws] \\
           [--variants examples/variants.toml] [--engines local,spark] [--max-hours H] \\
           [--workers N] [--master local[2]] [--repeat 2] [--timeline-points N]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import pyarrow as pa

from controllerd.pipeline.engines import RunOptions, run_local, run_spark, spark_session
from controllerd.pipeline.load import Skew, Trace, source_for
from controllerd.pipeline.simulate import METRIC_COLUMNS, simulate
from controllerd.pipeline.traces import TraceOptions, discover
from controllerd.pipeline.variants import REFERENCE_THRESHOLDS, Variant, load_variants
from tests.support.shared import traces_dir

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ROOT = Path(__file__).resolve().parent.parent


def steps_of(result: pd.DataFrame, interval_seconds: dict[str, float]) -> float:
    return float(
        sum(
            h * 3600 / interval_seconds[v]
            for h, v in zip(result["hours"], result["variant"], strict=True)
        )
    )


def host_reference() -> float:
    """Seconds for a fixed pure-Python loop (best of 3): this machine's speed varies by a
    third from hour to hour, so figures from different runs compare only next to it."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        total = 0
        for i in range(20_000_000):
            total += i
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--traces", nargs="+", default=[str(traces_dir() / "nab"), str(traces_dir() / "aws")]
    )
    parser.add_argument("--variants", default=str(ROOT / "examples/variants.toml"))
    parser.add_argument("--engines", default="local,spark")
    parser.add_argument("--max-hours", type=float)
    parser.add_argument(
        "--short-hours",
        type=float,
        default=48.0,
        help="also replay each trace's first H hours, to split fixed cost from cost per step",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--repeat", type=int, default=2, help="runs per engine (best shown)")
    parser.add_argument("--topics", type=int, default=10_000)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--fleet-variants", type=int, default=5)
    parser.add_argument(
        "--sample", default="Twitter_volume_IBM", help="trace replayed both ways in one process"
    )
    parser.add_argument(
        "--timeline-points",
        type=int,
        default=0,
        help="timeline points per group (default 0: a fleet's backtest keeps timelines only "
        "for the few traces it plots, replayed again; 2000 is what a plotted group keeps)",
    )
    args = parser.parse_args(argv)

    traces = discover(args.traces, TraceOptions(max_hours=args.max_hours))
    variants = load_variants(args.variants)
    interval = {v.name: v.strategy.interval_seconds for v in variants}
    groups = len(traces) * len(variants)
    options = RunOptions(timeline_points=args.timeline_points)
    print(f"cores:             {os.cpu_count()}")
    print(f"this host's speed: {host_reference():.2f} s for 20 million additions in Python")
    print(f"traces x variants: {len(traces)} x {len(variants)} = {groups} groups")
    print(f"timeline points:   {args.timeline_points} a group")

    sample = next((t for t in traces if t.name == args.sample), traces[0])
    # Not timed: a process's first replay loads the compiled kernels (about 0.3 s from
    # the disk cache, 6 s to compile without one), as each Spark worker does once.
    simulate(source_for(sample, Skew(), 0), variants[0].strategy, REFERENCE_THRESHOLDS)
    fast = slow = 0.0
    steps = visited = 0
    for v in variants:
        started = time.perf_counter()
        quick = simulate(source_for(sample, Skew(), 0), v.strategy, REFERENCE_THRESHOLDS)
        fast += time.perf_counter() - started
        started = time.perf_counter()
        simulate(source_for(sample, Skew(), 0), v.strategy, REFERENCE_THRESHOLDS, step_by_step=True)
        slow += time.perf_counter() - started
        steps += round(quick.metrics.hours * 3600 / v.strategy.interval_seconds)
        visited += quick.visited_steps
    print(f"\none process, {sample.name} x {len(variants)} variants ({steps:,} steps):")
    print(f"  step by step:        {steps / slow:,.0f} steps/s")
    print(f"  event-driven:        {steps / fast:,.0f} steps/s ({slow / fast:.1f}x)")
    print(f"  steps visited:       {100 * visited / steps:.1f}%")

    short = discover(args.traces, TraceOptions(max_hours=args.short_hours))
    results: dict[str, pd.DataFrame] = {}
    rate: dict[str, float] = {}
    marginal: dict[str, tuple[float, float]] = {}  # engine -> (fixed seconds, steps/s)
    model: dict[str, tuple[float, float, float]] = {}  # engine -> s a run, a group, a step
    for engine in args.engines.split(","):
        if engine not in ("local", "spark"):
            parser.error(f"unknown engine {engine!r}")
        session = spark_session(args.master) if engine == "spark" else None

        def replay(
            which: Sequence[Trace],
            these: Sequence[Variant] = variants,
            spark: SparkSession | None = session,
        ) -> pd.DataFrame:
            if spark is None:
                return run_local(which, these, options, workers=args.workers)
            return run_spark(which, these, options, spark=spark)

        times: list[float] = []
        short_times: list[float] = []
        few_times: list[float] = []
        try:
            for _ in range(max(1, args.repeat)):
                started = time.perf_counter()
                result = replay(traces)
                times.append(time.perf_counter() - started)
            for _ in range(max(1, args.repeat)):
                started = time.perf_counter()
                short_result = replay(short)
                short_times.append(time.perf_counter() - started)
            for _ in range(max(1, args.repeat)):
                started = time.perf_counter()
                few_result = replay(short, variants[:1])
                few_times.append(time.perf_counter() - started)
        finally:
            if session is not None:
                session.stop()
        seconds = min(times)
        total = steps_of(result, interval)
        rate[engine] = total / seconds
        short_total = steps_of(short_result, interval)
        few_total = steps_of(few_result, interval)
        if seconds > min(short_times) and total > short_total:
            per_step = (seconds - min(short_times)) / (total - short_total)
            marginal[engine] = (max(0.0, seconds - total * per_step), 1.0 / per_step)
            few_groups = len(short) * 1
            if groups > few_groups:
                per_group = (
                    min(short_times) - min(few_times) - (short_total - few_total) * per_step
                ) / (groups - few_groups)
                per_run = min(short_times) - groups * per_group - short_total * per_step
                model[engine] = (per_run, per_group, per_step)
        label = (
            f"{engine} ({args.master})"
            if engine == "spark"
            else f"local ({args.workers} processes)"
        )
        runs = ", ".join(f"{t:.1f}" for t in times)
        print(f"\n{label}: runs {runs} s (the first Spark query also starts its Python workers)")
        print(f"  groups/s:              {groups / seconds:.2f}")
        print(f"  evaluation steps/s:    {rate[engine]:,.0f} ({total:,.0f} steps)")
        print(
            f"  first {args.short_hours:g} h of each trace: runs "
            + ", ".join(f"{t:.1f}" for t in short_times)
            + f" s ({short_total:,.0f} steps)"
        )
        print(
            f"  first {args.short_hours:g} h, {len(short)} groups (one variant): runs "
            + ", ".join(f"{t:.1f}" for t in few_times)
            + f" s ({few_total:,.0f} steps)"
        )
        if engine in marginal:
            fixed, steps_per_s = marginal[engine]
            print(
                f"  fixed cost per run:    {fixed:.1f} s; each further step: "
                f"{steps_per_s:,.0f} steps/s (from the two sizes)"
            )
        if engine in model:
            per_run, per_group, per_step = model[engine]
            print(
                f"  cost model:            {per_run:.2f} s a run + "
                f"{1000 * per_group:.1f} ms a group + {1e9 * per_step:,.0f} ns a step "
                "(from the three runs)"
            )
        results[engine] = result
        size = pa.Table.from_pandas(result).nbytes / groups
        print(
            f"  result size:           {size / 1024:,.1f} KiB a group (Arrow); "
            f"{size * args.topics * args.fleet_variants / 2**30:,.2f} GiB for the fleet's "
            "groups at the driver"
        )
    if len(results) == 2:
        local, spark = (r[["trace", "variant", *METRIC_COLUMNS]] for r in results.values())
        pd.testing.assert_frame_equal(local, spark, check_exact=True)
        print("\nlocal and spark metrics: identical")
    fleet = args.topics * args.days * 86_400 / 60.0 * args.fleet_variants
    engine = "spark" if "spark" in rate else next(iter(rate))
    minutes = fleet / rate[engine] / 60
    print(
        f"\nprojected: {args.topics:,} topics x {args.days:g} days x {args.fleet_variants} "
        f"variants = {fleet:,.0f} steps at {rate[engine]:,.0f} steps/s ({engine}): "
        f"{minutes:,.1f} minutes (goal <= 10)"
    )
    if engine in marginal:
        fixed, steps_per_s = marginal[engine]
        print(
            f"  with the fixed cost paid once, not per {groups} groups: {fixed:.1f} s + "
            f"{fleet:,.0f} steps at {steps_per_s:,.0f} steps/s = "
            f"{(fixed + fleet / steps_per_s) / 60:,.1f} minutes"
        )
    if engine in model:
        per_run, per_group, per_step = model[engine]
        fleet_groups = args.topics * args.fleet_variants
        seconds = max(0.0, per_run) + fleet_groups * max(0.0, per_group) + fleet * per_step
        print(
            f"  each cost where a fleet pays it: {max(0.0, per_run):.1f} s once + "
            f"{fleet_groups:,} groups x {1000 * max(0.0, per_group):.1f} ms + "
            f"{fleet:,.0f} steps x {1e9 * per_step:,.0f} ns = {seconds / 60:,.1f} minutes "
            "(goal <= 10)"
        )
    print("  the yardstick replayed, not projected: python -m bench.fleet_bench --topics 10000")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
