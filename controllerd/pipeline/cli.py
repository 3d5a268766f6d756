"""``controllerd backtest`` and ``controllerd record``: the pipeline's subcommands.

Registered by the main CLI with :func:`add_commands`. Nothing heavy is imported
here: pandas, pyarrow, pyspark and matplotlib load inside the commands, so the
rest of ``controllerd`` starts fast and works without the ``spark`` extra.
Exit codes follow the main CLI: 0 success, 2 unusable input.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_BAD_INPUT = 2


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``backtest`` and ``record``; each sets ``func`` returning an exit code."""
    p = subparsers.add_parser(
        "backtest",
        help="replay load traces through policy variants; write metrics, a report and plots",
        description="Replay each trace under each variant with the daemon's own decide(); "
        "write DIR/metrics.csv, DIR/operations.csv, DIR/report.md and DIR/plots/*.png.",
    )
    p.add_argument(
        "--traces",
        nargs="+",
        required=True,
        metavar="PATH",
        help="CSV files (timestamp,value), directories of them, or `record` output directories",
    )
    p.add_argument(
        "--variants",
        metavar="V.toml",
        help="variants file ([variants.<name>] tables); default: pip483, controllerd, static-8",
    )
    p.add_argument("--engine", choices=("local", "spark"), default="local", help="default: local")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument(
        "--master", default="local[*]", help="Spark master URL (engine spark; default local[*])"
    )
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="processes for engine local (default: one per core)",
    )
    p.add_argument(
        "--peak-over-threshold",
        type=float,
        default=4.0,
        metavar="X",
        help="scale each CSV series so its peak is X times the split threshold (default 4)",
    )
    p.add_argument(
        "--skew",
        default="uniform",
        metavar="uniform|zipf:S[:KEYS]",
        help="spread series over the hash space uniformly or over Zipf(S) keys (default 1000)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the Zipf key placement")
    p.add_argument(
        "--max-hours", type=float, metavar="H", help="replay only each trace's first H hours"
    )
    p.add_argument(
        "--msg-bytes", type=float, default=1024.0, help="bytes per message (default 1024)"
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_backtest)

    p = subparsers.add_parser(
        "record",
        help="record load records and layouts from etcd (and the audit topic) as Parquet",
        description="Follow the load records and layouts in etcd, and the decision audit "
        "topic when [audit] is configured, into Parquet partitioned by topic and hour.",
    )
    p.add_argument("--config", metavar="FILE", help="controllerd.toml (or $CONTROLLERD_CONFIG)")
    p.add_argument("--out", required=True, metavar="DIR", help="history directory (appended to)")
    p.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="stop after this long (default: on SIGINT/SIGTERM)",
    )
    p.add_argument(
        "--flush-seconds",
        type=float,
        default=60.0,
        help="write buffered rows at least this often (default 60)",
    )
    p.set_defaults(func=cmd_record)


def _error(message: str) -> int:
    print(f"controllerd: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _progress_bar(enabled: bool, unit: str) -> tuple[Callable[[int, int], None] | None, Any]:
    if not enabled:
        return None, None
    from tqdm import tqdm

    bar = tqdm(unit=unit, file=sys.stderr, dynamic_ncols=True, disable=None)

    def update(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    return update, bar


def cmd_backtest(args: argparse.Namespace) -> int:
    from controllerd.pipeline import engines, report
    from controllerd.pipeline.load import Skew
    from controllerd.pipeline.traces import TraceError, TraceOptions, discover
    from controllerd.pipeline.variants import VariantError, default_variants, load_variants

    try:
        skew = Skew.parse(args.skew)
        if not args.peak_over_threshold > 0:
            raise ValueError("--peak-over-threshold must be > 0")
        if args.workers is not None and args.workers < 1:
            raise ValueError("--workers must be >= 1")
        variants = load_variants(args.variants) if args.variants else default_variants()
        traces = discover(
            args.traces,
            TraceOptions(
                peak_over_threshold=args.peak_over_threshold,
                msg_bytes=args.msg_bytes,
                max_hours=args.max_hours,
            ),
        )
    except VariantError as exc:
        for err in exc.errors:
            print(f"{args.variants}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (TraceError, ValueError) as exc:
        return _error(str(exc))
    options = engines.RunOptions(skew=skew, seed=args.seed)
    unit = "group" if args.engine == "local" else "task"
    progress, bar = _progress_bar(not args.no_progress, unit)
    started = time.monotonic()
    try:
        results = engines.run(
            args.engine,
            traces,
            variants,
            options,
            workers=args.workers,
            master=args.master,
            progress=progress,
        )
    finally:
        if bar is not None:
            bar.close()
    elapsed = time.monotonic() - started
    groups = len(traces) * len(variants)
    run_info = {
        "command": "controllerd " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "engine": args.engine + (f" ({args.master})" if args.engine == "spark" else ""),
        "traces": ", ".join(t.name for t in traces),
        "variants": ", ".join(v.name for v in variants),
        "scaling": f"peak = {args.peak_over_threshold:g} times the split threshold (CSV series)",
        "spread": f"{skew}, seed {args.seed}",
        "run time": f"{elapsed:.1f} s for {groups} trace-variant groups ({groups / elapsed:.2f}/s)"
        if elapsed > 0
        else "",
    }
    out = Path(args.out)
    report.write_outputs(results, out, run_info, plots=not args.no_plots)
    print(f"wrote {out / 'metrics.csv'} and {out / 'report.md'} ({groups} rows)")
    return EXIT_OK


def cmd_record(args: argparse.Namespace) -> int:
    import anyio

    from controllerd import config as config_mod
    from controllerd.pipeline.recorder import record_from_config

    path = args.config or os.environ.get("CONTROLLERD_CONFIG")
    if not path:
        return _error("--config FILE (or CONTROLLERD_CONFIG) is required")
    try:
        cfg = config_mod.load_file(path, os.environ)
    except config_mod.ConfigError as exc:
        for err in exc.errors:
            print(f"{path}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.duration is not None and not args.duration > 0:
        return _error("--duration must be > 0")
    if not args.flush_seconds > 0:
        return _error("--flush-seconds must be > 0")
    counts = anyio.run(record_from_config, cfg, Path(args.out), args.duration, args.flush_seconds)
    print(", ".join(f"{n} {table} rows" for table, n in counts.items()))
    return EXIT_OK
