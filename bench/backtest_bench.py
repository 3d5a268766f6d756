"""Backtest throughput: trace x variant groups per second, local and Spark engines.

Runs the same traces and variants through each engine ``--repeat`` times (the
Spark session start is not timed; its first query also starts the Python
workers) and prints, for the best run, groups/s, replayed trace-hours per
second and simulated evaluation steps per second. Both engines must agree on
every metric, which the bench checks too.

Usage: python -m bench.backtest_bench [--traces ../shared/traces/nab] \
           [--variants examples/variants.toml] [--engines local,spark] [--max-hours H] \
           [--workers N] [--master local[*]] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from controllerd.pipeline.engines import RunOptions, run_local, run_spark, spark_session
from controllerd.pipeline.simulate import METRIC_COLUMNS
from controllerd.pipeline.traces import TraceOptions, discover
from controllerd.pipeline.variants import load_variants

ROOT = Path(__file__).resolve().parent.parent


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--traces", nargs="+", default=[str(ROOT.parent / "shared/traces/nab")])
    parser.add_argument("--variants", default=str(ROOT / "examples/variants.toml"))
    parser.add_argument("--engines", default="local,spark")
    parser.add_argument("--max-hours", type=float)
    parser.add_argument("--workers", type=int)
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--repeat", type=int, default=2, help="runs per engine (best shown)")
    args = parser.parse_args(argv)

    traces = discover(args.traces, TraceOptions(max_hours=args.max_hours))
    variants = load_variants(args.variants)
    groups = len(traces) * len(variants)
    options = RunOptions()
    print(f"cores:            {os.cpu_count()}")
    print(f"traces x variants: {len(traces)} x {len(variants)} = {groups} groups")
    results: dict[str, pd.DataFrame] = {}
    for engine in args.engines.split(","):
        if engine not in ("local", "spark"):
            parser.error(f"unknown engine {engine!r}")
        session = spark_session(args.master) if engine == "spark" else None
        times: list[float] = []
        try:
            for _ in range(max(1, args.repeat)):
                started = time.perf_counter()
                if session is None:
                    result = run_local(traces, variants, options, workers=args.workers)
                else:
                    result = run_spark(traces, variants, options, spark=session)
                times.append(time.perf_counter() - started)
        finally:
            if session is not None:
                session.stop()
        seconds = min(times)
        hours = float(result["hours"].sum())
        steps = sum(
            h * 3600 / v.strategy.interval_seconds
            for h, v in zip(result["hours"], variants * len(traces), strict=True)
        )
        runs = ", ".join(f"{t:.1f}" for t in times)
        print(f"\n{engine}: runs {runs} s (the first Spark query also starts its Python workers)")
        print(f"  groups/s:              {groups / seconds:.2f}")
        print(f"  trace-hours/s:         {hours / seconds:,.0f}")
        print(f"  evaluation steps/s:    {steps / seconds:,.0f}")
        results[engine] = result
    if len(results) == 2:
        local, spark = (r[["trace", "variant", *METRIC_COLUMNS]] for r in results.values())
        pd.testing.assert_frame_equal(local, spark, check_exact=True)
        print("\nlocal and spark metrics: identical")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
