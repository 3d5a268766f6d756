"""``controllerd backtest``, ``controllerd tune`` and ``controllerd record``.

Registered by the main CLI with :func:`add_commands`. Nothing heavy is imported
here: pandas, pyarrow, pyspark and matplotlib load inside the commands, so the
rest of ``controllerd`` starts fast and works without the ``spark`` extra;
without it these commands say, in one line, how to install it. Every mistake an
operator can fix is one line naming the option or setting
(:class:`controllerd.errors.OperatorError`) and its exit status: 2 unusable
input, 3 a dependency (etcd, Kafka, a Spark master) cannot be reached.

Progress goes to stderr: a bar on a terminal, otherwise one line per finished
group (Spark: per finished task), so a run under CI or ``nohup`` shows signs of
life.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from controllerd.errors import EXIT_OK, EXIT_USAGE, OperatorError

if TYPE_CHECKING:
    import pandas as pd

    from controllerd.pipeline.engines import RunOptions
    from controllerd.pipeline.load import Trace
    from controllerd.pipeline.variants import Variant

EXIT_BAD_INPUT: Final = EXIT_USAGE
SPARK_EXTRA: Final = frozenset({"pyspark", "pandas", "pyarrow", "matplotlib", "tqdm", "numpy"})
"""Top-level modules of the ``spark`` extra (and what they pull in)."""


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``backtest``, ``tune`` and ``record``; each sets ``func`` returning an exit code."""
    p = subparsers.add_parser(
        "backtest",
        help="replay load traces through policy variants; write metrics, a report and plots",
        description="Replay each trace under each variant with the daemon's own decide(); "
        "write DIR/metrics.csv, DIR/operations.csv, DIR/report.md and DIR/plots/*.png.",
    )
    _replay_options(p)
    p.add_argument(
        "--variants",
        metavar="V.toml",
        help="variants file ([variants.<name>] tables); default: pip483, controllerd, static-8",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--plot-traces",
        type=int,
        default=None,
        metavar="N",
        help="plot at most N traces: with more, the N with the most excess load over the "
        "variants, replayed again with timelines (default 20)",
    )
    p.set_defaults(func=cmd_backtest)

    p = subparsers.add_parser(
        "tune",
        help="choose policy settings from a grid by cross-validation; print them as TOML",
        description="Run every trace under every variant of GRID.toml and under pip483, "
        "choose the variant that meets the targets with the widest margin on training "
        "traces, report in-sample and out-of-sample figures per fold (DIR/tune.md) and "
        "print the choice on all traces as a [policy] snippet.",
    )
    _replay_options(p)
    p.add_argument(
        "--grid",
        required=True,
        metavar="GRID.toml",
        help="variants file whose variants are the candidates (grid tables expand)",
    )
    p.add_argument(
        "--cv",
        default="loto",
        metavar="loto|group|time:F",
        help="leave one trace out (default), leave one --traces path out, or choose on "
        "the first fraction F of each trace's time and test on the rest",
    )
    p.add_argument(
        "--reuse",
        metavar="METRICS.csv",
        help="choose again from an earlier run's metrics.csv (same traces and grid) "
        "instead of replaying",
    )
    p.set_defaults(func=cmd_tune)

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
        help="stop this long after the first etcd snapshot (default: on SIGINT/SIGTERM)",
    )
    p.add_argument(
        "--flush-seconds",
        type=float,
        default=60.0,
        help="write buffered rows at least this often (default 60)",
    )
    p.set_defaults(func=cmd_record)


def _replay_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--traces",
        nargs="+",
        required=True,
        metavar="PATH",
        help="CSV files (timestamp,value), directories of them, or `record` output directories",
    )
    p.add_argument("--engine", choices=("local", "spark"), default="local", help="default: local")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument(
        "--master",
        default="local[*]",
        help="Spark master URL, e.g. spark://HOST:7077 (engine spark; default local[*]); "
        "recorded histories must then be on a path every executor can read",
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
        metavar="SKEW",
        help="spread series over the hash space: uniform (default), zipf:S[:KEYS], "
        "hotkey:SHARE or hotspot:SHARE[:HOURS[:WIDTH]]",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the key placement")
    p.add_argument(
        "--max-hours", type=float, metavar="H", help="replay only each trace's first H hours"
    )
    p.add_argument(
        "--msg-bytes", type=float, default=1024.0, help="bytes per message (default 1024)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar or lines")


# --- shared plumbing ----------------------------------------------------------------------


def _fail(error: OperatorError) -> int:
    print(f"controllerd: {error.line()}", file=sys.stderr)
    return error.exit_code


def missing_extra() -> OperatorError:
    return OperatorError(
        "this command needs the spark extra: pip install 'controllerd[spark]'",
        exit_code=EXIT_USAGE,
    )


@contextmanager
def _needs_extra() -> Iterator[None]:
    """Turn a missing module of the ``spark`` extra into its one-line error."""
    try:
        yield
    except ImportError as exc:
        name = (getattr(exc, "name", None) or "").split(".")[0]
        if name in SPARK_EXTRA:
            raise missing_extra() from None
        raise


def operator_errors(
    command: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """Run ``command``; an :class:`OperatorError` becomes its one line and exit status."""

    def run(args: argparse.Namespace) -> int:
        try:
            with _needs_extra():
                return command(args)
        except OperatorError as exc:
            return _fail(exc)

    run.__name__ = command.__name__
    run.__doc__ = command.__doc__
    return run


def _out_dir(text: str) -> Path:
    """``--out``, created and proven writable before any replay runs."""
    import tempfile

    if not text.strip():
        raise OperatorError("--out must name a directory", setting="--out")
    out = Path(text)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise OperatorError(
            f"--out {text}: cannot write there: {exc.strerror or exc}", setting="--out"
        ) from None
    return out


@contextmanager
def _writing(out: Path) -> Iterator[None]:
    """An output that cannot be written (say a directory where a file goes) names --out."""
    try:
        yield
    except OSError as exc:
        where = exc.filename or out
        raise OperatorError(
            f"--out {out}: cannot write {where}: {exc.strerror or exc}", setting="--out"
        ) from None


MAX_REUSED_COUNT: Final = 2**53
"""The largest count ``tune --reuse`` takes: whole in a float, and sums of many stay in int64."""


def _reused_metrics(results: pd.DataFrame, path: str) -> pd.DataFrame:
    """A ``metrics.csv`` given to ``tune --reuse``: every column there, every metric a
    finite number >= 0 and every count (an ``int`` field of ``Metrics``) a whole number
    up to :data:`MAX_REUSED_COUNT`, no (trace, variant) twice."""
    import pandas as pd

    from controllerd.pipeline.simulate import METRIC_COLUMNS, Metrics

    counts = {f.name for f in dataclasses.fields(Metrics) if f.type in (int, "int")}
    missing = [c for c in ("trace", "variant", *METRIC_COLUMNS) if c not in results.columns]
    if missing:
        raise OperatorError(f"{path}: no column {missing[0]}", setting="--reuse")
    for column in METRIC_COLUMNS:
        values = pd.to_numeric(results[column], errors="coerce")
        if column in counts:
            bad = ~(values.ge(0) & values.le(MAX_REUSED_COUNT) & values.mod(1).eq(0))
            expected = f"is not a whole number 0..{MAX_REUSED_COUNT:,}"
        else:
            bad = ~(values.ge(0) & values.lt(math.inf))
            expected = "is not a finite number >= 0"
        if bad.any():
            row = int(bad.to_numpy().nonzero()[0][0])
            cell = results[column].iloc[row]
            shown = cell.item() if hasattr(cell, "item") else cell  # 2.5, not np.float64(2.5)
            raise OperatorError(
                f"{path}:{row + 2}: {column} {shown!r} {expected}", setting="--reuse"
            )
        results[column] = values.astype("int64") if column in counts else values
    twice = results.duplicated(["trace", "variant"])
    if twice.any():
        row = int(twice.to_numpy().nonzero()[0][0])
        raise OperatorError(
            f"{path}:{row + 2}: trace {results['trace'].iloc[row]} x variant "
            f"{results['variant'].iloc[row]} appears twice",
            setting="--reuse",
        )
    return results


def _require(args: argparse.Namespace, *modules: str) -> None:
    """Import what the run will need before it starts, not after minutes of replay."""
    import importlib

    wanted = [*modules, "pandas", "pyarrow"]
    if getattr(args, "engine", "local") == "spark":
        wanted.append("pyspark")
    if not getattr(args, "no_plots", True):
        wanted.append("matplotlib")
    if not getattr(args, "no_progress", True) and sys.stderr.isatty():
        wanted.append("tqdm")
    for name in wanted:
        importlib.import_module(name)


class Progress:
    """``(done, total)`` reports: a tqdm bar on a terminal, else a line per step of progress."""

    def __init__(self, enabled: bool, what: str, unit: str) -> None:
        self._bar: Any = None
        self._what, self._unit = what, unit
        self._last = -1
        self._started = time.monotonic()
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(unit=unit, file=sys.stderr, dynamic_ncols=True)

    def __call__(self, done: int, total: int) -> None:
        if self._bar is not None:
            if self._bar.total != total:
                self._bar.total = total
            self._bar.update(done - self._bar.n)
        elif self.enabled and done != self._last:
            self._last = done
            elapsed = time.monotonic() - self._started
            print(
                f"controllerd {self._what}: {done}/{total} {self._unit}s done "
                f"({100 * done / max(1, total):.0f}%) after {elapsed:.0f} s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _inputs(
    args: argparse.Namespace, defer_history: bool
) -> tuple[RunOptions, list[Trace], list[str], dict[str, str]]:
    """(run options, in-memory traces, history dirs for Spark to read, trace -> input path)."""
    from controllerd.pipeline import engines
    from controllerd.pipeline.history import is_history
    from controllerd.pipeline.load import Skew
    from controllerd.pipeline.traces import TraceError, TraceOptions, discover

    try:
        skew = Skew.parse(args.skew)
    except ValueError as exc:
        raise OperatorError(str(exc), setting="--skew") from None
    for flag, value in (
        ("--peak-over-threshold", args.peak_over_threshold),
        ("--msg-bytes", args.msg_bytes),
        ("--max-hours", args.max_hours),
    ):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise OperatorError(f"{flag} must be a finite number > 0 (got {value})", setting=flag)
    if args.workers is not None and args.workers < 1:
        raise OperatorError("--workers must be >= 1", setting="--workers")
    options = TraceOptions(
        peak_over_threshold=args.peak_over_threshold,
        msg_bytes=args.msg_bytes,
        max_hours=args.max_hours,
    )
    traces: list[Trace] = []
    histories: list[str] = []
    groups: dict[str, str] = {}
    try:
        for path, label in zip(args.traces, set_names(args.traces), strict=True):
            if defer_history and Path(path).is_dir() and is_history(path):
                histories.append(str(Path(path).resolve()))
                continue
            found = discover([path], options)
            traces.extend(found)
            groups.update(dict.fromkeys((t.name for t in found), label))
        names = [t.name for t in traces]
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise TraceError(f"trace names must be unique; repeated: {', '.join(dupes)}")
    except TraceError as exc:
        raise OperatorError(str(exc), setting="--traces") from None
    return engines.RunOptions(skew=skew, seed=args.seed), traces, histories, groups


def set_names(paths: list[str]) -> list[str]:
    """The trace set of each ``--traces`` path (``--cv group`` and tune.md name it): its
    last component, or, where two paths share it, as many trailing components of
    the absolute path as tell them apart (``x1`` and ``y/x1`` in /data: ``data/x1``,
    ``y/x1``). Two paths are two sets: sharing a name used to merge them into one."""
    short = [Path(p).name or p for p in paths]
    parts = [Path(os.path.abspath(p)).parts for p in paths]
    names = []
    for i, path_parts in enumerate(parts):
        rivals = [parts[j] for j in range(len(paths)) if j != i and short[j] == short[i]]
        if not rivals:
            names.append(short[i])
            continue
        k = 2
        while k < len(path_parts) and any(r[-k:] == path_parts[-k:] for r in rivals):
            k += 1
        names.append(str(Path(*path_parts[-k:])))
    return names


def _variants(path: str | None, option: str) -> list[Variant]:
    from controllerd.pipeline.variants import VariantError, default_variants, load_variants

    if path is None:
        return default_variants()
    try:
        return load_variants(path)
    except VariantError as exc:
        # Every bad key on its own line (each names the file): the last carries the status.
        for err in exc.errors[:-1]:
            print(f"controllerd: {err}", file=sys.stderr)
        raise OperatorError(exc.errors[-1], setting=option) from None


def _run_info(
    args: argparse.Namespace, options: RunOptions, traces: list[str], variants: list[Variant]
) -> dict[str, str]:
    from controllerd.pipeline.report import REPORT_TRACES

    return {
        "command": "controllerd " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "engine": args.engine
        + (
            f" ({args.master}; executors run controllerd from {args.executors_import})"
            if args.engine == "spark"
            else ""
        ),
        "traces": ", ".join(traces) if len(traces) <= REPORT_TRACES else f"{len(traces):,} traces",
        "variants": ", ".join(v.name for v in variants)
        if len(variants) <= 12
        else f"{len(variants)} variants",
        "scaling": f"peak = {args.peak_over_threshold:g} times the split threshold (CSV series)",
        "spread": f"{options.skew}, seed {options.seed}",
    }


def _execute(
    args: argparse.Namespace,
    what: str,
    traces: list[Trace],
    histories: list[str],
    variants: list[Variant],
    options: RunOptions,
    plot_traces: int = 0,
) -> tuple[Any, float]:
    """Replay on the engine ``args`` names. Only ``plot_traces`` traces keep timelines (for
    plots): all of them if there are no more, else, from a second replay of just those,
    the ones :func:`report.worst_traces` picks from the first (a replay is deterministic).
    """
    from controllerd.pipeline import engines
    from controllerd.pipeline.report import worst_traces

    unit = "group" if args.engine == "local" else "task"
    progress = Progress(not args.no_progress, what, unit)
    spark = engines.spark_session(args.master) if args.engine == "spark" else None
    started = time.monotonic()

    def replay(
        traces: list[Trace], options: RunOptions, topics: list[str] | None = None
    ) -> pd.DataFrame:
        return engines.run(
            args.engine,
            traces,
            variants,
            options,
            workers=args.workers,
            master=args.master,
            spark=spark,
            progress=progress if progress.enabled else None,
            histories=histories,
            max_hours=args.max_hours,
            topics=topics,
            listed=listed,
        )

    listed: set[str] | None = None  # the histories' topics, listed once for both replays
    try:
        if spark is not None:
            args.executors_import = engines.ship_code(spark)
        count = len(traces)
        if spark is not None and histories:
            listed = set().union(*(engines.history_topics(spark, h) for h in histories))
            count += len(listed)
        if plot_traces >= count:
            results = replay(traces, options)
        else:
            results = replay(traces, dataclasses.replace(options, timeline_points=0))
            chosen = worst_traces(results, plot_traces)
            if chosen:
                plotted = replay([t for t in traces if t.name in chosen], options, chosen)
                results = engines.with_timelines(results, plotted)
    finally:
        progress.close()
        if spark is not None:
            spark.stop()
    return results, time.monotonic() - started


# --- commands -----------------------------------------------------------------------------


@operator_errors
def cmd_backtest(args: argparse.Namespace) -> int:
    """Replay every trace under every variant; write metrics, operations, report, plots."""
    _require(args)
    from controllerd.pipeline import report

    limit = report.PLOT_TRACES if args.plot_traces is None else args.plot_traces
    if limit < 0:
        raise OperatorError("--plot-traces must be >= 0", setting="--plot-traces")
    options, traces, histories, _ = _inputs(args, defer_history=args.engine == "spark")
    variants = _variants(args.variants, "--variants")
    out = _out_dir(args.out)
    plot_traces = 0 if args.no_plots else limit
    results, elapsed = _execute(args, "backtest", traces, histories, variants, options, plot_traces)
    names = list(dict.fromkeys(str(t) for t in results["trace"]))
    groups = len(results)
    run_info = _run_info(args, options, names, variants)
    if not args.no_plots and limit < len(names):
        run_info["plots"] = (
            f"{limit} of {len(names):,} traces, those with the most excess load over the "
            "variants (--plot-traces)"
        )
    run_info["run time"] = (
        f"{elapsed:.1f} s for {groups} trace-variant groups ({groups / elapsed:.2f}/s)"
        if elapsed > 0
        else ""
    )
    with _writing(out):
        report.write_outputs(results, out, run_info, plots=not args.no_plots)
    print(f"wrote {out / 'metrics.csv'} and {out / 'report.md'} ({groups} rows)")
    return EXIT_OK


@operator_errors
def cmd_tune(args: argparse.Namespace) -> int:
    """Choose a grid variant by cross-validation; write tune.md and print the TOML."""
    _require(args)
    from controllerd.pipeline import report, tune
    from controllerd.pipeline.variants import Variant, pip483

    scheme, colon, fraction_text = args.cv.partition(":")
    fraction = 0.0
    if scheme == "time":
        try:
            fraction = float(fraction_text or "0.5")
        except ValueError:
            fraction = -1.0
        if not 0 < fraction < 1:
            raise OperatorError("--cv time:F needs 0 < F < 1", setting="--cv")
    elif scheme not in ("loto", "group") or colon:
        raise OperatorError(f"--cv {args.cv!r}: expected loto, group or time:F", setting="--cv")
    options, traces, histories, groups = _inputs(args, defer_history=False)
    candidates = _variants(args.grid, "--grid")
    if any(v.name == report.BASELINE for v in candidates):
        candidates = [v for v in candidates if v.name != report.BASELINE]
    if not candidates:
        raise OperatorError(f"{args.grid}: no candidate besides pip483", setting="--grid")
    variants = [Variant(report.BASELINE, pip483()), *candidates]
    try:
        if scheme == "time":
            # Each half keeps its trace's set: the name with the one suffix the cut added.
            groups = {t.name + s: groups[t.name] for t in traces for s in (tune.TRAIN, tune.TEST)}
            traces = tune.split_in_time(traces, fraction)
        folds = (
            [tune.time_fold(traces)] if scheme == "time" else tune.folds_for(scheme, traces, groups)
        )
    except ValueError as exc:
        raise OperatorError(str(exc), setting="--cv") from None
    names = [t.name for t in traces]
    out = _out_dir(args.out)
    if args.reuse:
        import pandas as pd

        try:
            # As written: a trace named 1 or NA stays that name, not a number or a gap.
            results = pd.read_csv(
                args.reuse, dtype={"trace": str, "variant": str}, keep_default_na=False
            )
        except (OSError, ValueError) as exc:
            raise OperatorError(f"{args.reuse}: cannot read: {exc}", setting="--reuse") from None
        results = _reused_metrics(results, args.reuse)
        have = set(zip(results.get("trace", []), results.get("variant", []), strict=False))
        missing = [(t, v.name) for t in names for v in variants if (t, v.name) not in have]
        if missing:
            t, v = missing[0]
            raise OperatorError(
                f"{args.reuse} has no row for trace {t} x variant {v} "
                f"({len(missing)} missing): was it written with these --traces and --grid?",
                setting="--reuse",
            )
        results = results[results["trace"].isin(names)]
        elapsed = 0.0
    else:
        results, elapsed = _execute(args, "tune", traces, histories, variants, options)
    with _writing(out):
        metrics = report.write_metrics(results, out / "metrics.csv")
    result = tune.cross_validate(metrics, [v.name for v in candidates], folds, names, groups=groups)
    chosen = next(v for v in candidates if v.name == result.final.variant)
    snippet = tune.toml_snippet(chosen)
    run_info = _run_info(args, options, names, variants)
    run_info["cross-validation"] = args.cv
    run_info["run time"] = (
        f"{elapsed:.1f} s for {len(results)} trace-variant groups"
        if not args.reuse
        else f"metrics reused from {args.reuse}"
    )
    with _writing(out):
        (out / "tune.md").write_text(tune.render(result, run_info, snippet), encoding="utf-8")
        (out / "chosen.toml").write_text(snippet, encoding="utf-8")
    pooled = result.pooled
    print(
        f"out of sample ({args.cv}, {pooled.traces} traces): excess load "
        f"{-100 * pooled.excess_cut:+.1f}%, {pooled.cost_ratio:.3f}x segment-hours, "
        f"{pooled.operations} vs {pooled.base_operations} operations, "
        f"{pooled.flipflops} vs {pooled.base_flipflops} flip-flops against pip483; "
        f"details in {out / 'tune.md'}",
        file=sys.stderr,
    )
    print(snippet, end="")
    return EXIT_OK


@operator_errors
def cmd_record(args: argparse.Namespace) -> int:
    """Follow etcd (and the audit topic) into Parquet until the duration or a signal."""
    import anyio

    from controllerd import config as config_mod

    path = args.config or os.environ.get("CONTROLLERD_CONFIG")
    if not path:
        raise OperatorError("--config FILE (or CONTROLLERD_CONFIG) is required", setting="--config")
    if args.duration is not None and not args.duration > 0:
        raise OperatorError("--duration must be > 0", setting="--duration")
    if not args.flush_seconds > 0:
        raise OperatorError("--flush-seconds must be > 0", setting="--flush-seconds")
    shown = "<stdin>" if path == config_mod.STDIN else path
    try:
        text = config_mod.read_text(path)  # its errors name the file already
    except config_mod.ConfigError as exc:
        raise OperatorError(exc.errors[0], setting="--config") from None
    try:
        cfg = config_mod.load(text, os.environ)
    except config_mod.ConfigError as exc:
        for err in exc.errors[:-1]:
            print(f"controllerd: {shown}: {err}", file=sys.stderr)
        raise OperatorError(f"{shown}: {exc.errors[-1]}", setting="--config") from None
    _require(args)
    from controllerd.adapters.secrets import config_file_errors
    from controllerd.daemon.logs import configure_logging
    from controllerd.pipeline.recorder import record_from_config

    configure_logging(cfg.logging.level, cfg.logging.format)
    problems = config_file_errors(cfg)
    if problems:
        raise OperatorError(f"{shown}: {problems[0]}", setting="--config")
    out = _out_dir(args.out)
    recorded = anyio.run(record_from_config, cfg, out, args.duration, args.flush_seconds)
    print(recorded.summary())
    return EXIT_OK
