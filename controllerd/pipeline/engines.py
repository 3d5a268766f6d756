"""Run every trace x variant through the simulator: locally or on Spark, identically.

Both engines hand the *same* pandas frame (one trace's rows, tagged with one
variant) to the *same* :class:`GroupRunner`, which rebuilds the trace, runs
:func:`controllerd.pipeline.simulate.simulate` and returns a one-row frame.
``local`` calls it in a process pool (one process per core); ``spark`` calls it
from ``groupBy("trace", "variant").applyInPandas(...)``. The runner sorts its
input by ``seq`` first, so the order Spark delivers rows in cannot matter, and
Arrow carries int64 and float64 exactly: the metrics are bit-identical.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from typing import TYPE_CHECKING, Any, Final, Literal

import pandas as pd

from controllerd.core.model import Rates
from controllerd.pipeline.load import Skew, Trace, source_for
from controllerd.pipeline.simulate import METRIC_COLUMNS, SimResult, Strategy, Timeline, simulate
from controllerd.pipeline.variants import REFERENCE_THRESHOLDS, Variant

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

Engine = Literal["local", "spark"]

RATE_COLUMNS: Final = ("msg_rate_in", "byte_rate_in", "msg_rate_out", "byte_rate_out")
TRACE_COLUMNS: Final = ("trace", "kind", "seq", "t_ms", "start", "end", *RATE_COLUMNS)
TRACE_DDL: Final = (
    "trace string, kind string, seq long, t_ms long, start int, end int, "
    + ", ".join(f"{c} double" for c in RATE_COLUMNS)
)
_INT_METRICS: Final = frozenset(
    {
        "splits",
        "merges",
        "flipflops",
        "peak_segments",
        "operations",
        "children_created",
        "load_writes",
    }
)
_TIMELINE_DDL: Final = ", ".join(
    f"{p}_{c} {t}"
    for p in ("tl", "zoom")
    for c, t in (
        ("t_ms", "array<bigint>"),
        ("load", "array<double>"),
        ("hottest", "array<double>"),
        ("segments", "array<int>"),
    )
)
RESULT_DDL: Final = (
    "trace string, variant string, "
    + ", ".join(f"{m} {'long' if m in _INT_METRICS else 'double'}" for m in METRIC_COLUMNS)
    + f", {_TIMELINE_DDL}, operations_json string"
)
"""The one-row-per-group result schema (Spark DDL); the local engine builds the same frame."""


@dataclass(frozen=True, slots=True)
class RunOptions:
    """Replay settings shared by every group of a run."""

    skew: Skew = field(default_factory=Skew)
    seed: int = 0
    reference: Rates = REFERENCE_THRESHOLDS
    timeline_points: int = 2000


def trace_frame(trace: Trace) -> pd.DataFrame:
    """A trace as rows of :data:`TRACE_COLUMNS` (what Spark partitions and ships)."""
    n = len(trace.t_ms)
    rates = list(zip(*trace.rates, strict=True))
    data: dict[str, Any] = {
        "trace": [trace.name] * n,
        "kind": [trace.kind] * n,
        "seq": range(n),
        "t_ms": trace.t_ms,
        "start": trace.start,
        "end": trace.end,
    }
    data.update({c: rates[i] for i, c in enumerate(RATE_COLUMNS)})
    frame = pd.DataFrame(data)
    return frame.astype({"seq": "int64", "t_ms": "int64", "start": "int32", "end": "int32"})


def frame_trace(frame: pd.DataFrame) -> Trace:
    """The inverse of :func:`trace_frame`, whatever order the rows arrive in."""
    frame = frame.sort_values("seq", kind="stable")
    rates = zip(*(frame[c].astype("float64").tolist() for c in RATE_COLUMNS), strict=True)
    return Trace(
        str(frame["trace"].iloc[0]),
        "history" if frame["kind"].iloc[0] == "history" else "series",
        [int(t) for t in frame["t_ms"].tolist()],
        [int(s) for s in frame["start"].tolist()],
        [int(e) for e in frame["end"].tolist()],
        [(a, b, c, d) for a, b, c, d in rates],
    )


class GroupRunner:
    """``applyInPandas`` function: one trace x one variant in, one result row out.

    Picklable (shipped to Spark workers and to pool processes).
    """

    def __init__(self, strategies: Mapping[str, Strategy], options: RunOptions) -> None:
        self.strategies = dict(strategies)
        self.options = options

    def __call__(self, frame: pd.DataFrame) -> pd.DataFrame:
        variant = str(frame["variant"].iloc[0])
        trace = frame_trace(frame)
        opts = self.options
        result = simulate(
            source_for(trace, opts.skew, opts.seed),
            self.strategies[variant],
            opts.reference,
            timeline_points=opts.timeline_points,
        )
        return result_frame(trace.name, variant, result)


def _udf(runner: GroupRunner) -> Callable[[pd.DataFrame], pd.DataFrame]:
    """A plain one-argument function: Spark counts parameters (a bound ``self`` would count)."""

    def apply(frame: pd.DataFrame) -> pd.DataFrame:
        return runner(frame)

    return apply


def result_frame(trace: str, variant: str, result: SimResult) -> pd.DataFrame:
    row: dict[str, Any] = {"trace": trace, "variant": variant}
    row.update(asdict(result.metrics))
    for prefix, timeline in (("tl", result.timeline), ("zoom", result.zoom)):
        row[f"{prefix}_t_ms"] = [int(t) for t in timeline.t_ms]
        row[f"{prefix}_load"] = [float(x) for x in timeline.load]
        row[f"{prefix}_hottest"] = [float(x) for x in timeline.hottest]
        row[f"{prefix}_segments"] = [int(x) for x in timeline.segments]
    row["operations_json"] = json.dumps([asdict(op) for op in result.operations])
    return pd.DataFrame([row])


def timeline_of(row: Mapping[str, Any], prefix: str = "tl") -> Timeline:
    """The timeline stored in a result row (``tl`` = whole run, ``zoom`` = around the peak)."""
    return Timeline(
        [int(t) for t in row[f"{prefix}_t_ms"]],
        [float(x) for x in row[f"{prefix}_load"]],
        [float(x) for x in row[f"{prefix}_hottest"]],
        [int(x) for x in row[f"{prefix}_segments"]],
    )


def _ordered(
    results: pd.DataFrame, traces: Sequence[Trace], variants: Sequence[Variant]
) -> pd.DataFrame:
    """Rows in input order (traces, then variants), metrics with their contract dtypes."""
    t_rank = {t.name: i for i, t in enumerate(traces)}
    v_rank = {v.name: i for i, v in enumerate(variants)}
    results = results.assign(
        _t=results["trace"].map(t_rank), _v=results["variant"].map(v_rank)
    ).sort_values(["_t", "_v"], kind="stable")
    results = results.drop(columns=["_t", "_v"]).reset_index(drop=True)
    return results.astype({m: "int64" if m in _INT_METRICS else "float64" for m in METRIC_COLUMNS})


Progress = Callable[[int, int], None]
"""``(done, total)`` callback; the CLI draws a bar with it."""


def run_local(
    traces: Sequence[Trace],
    variants: Sequence[Variant],
    options: RunOptions,
    *,
    workers: int | None = None,
    progress: Progress | None = None,
) -> pd.DataFrame:
    """Every trace x variant in a process pool (``workers`` processes, default one per core).

    ``workers=1`` runs in this process, which is what tests and profilers want.
    """
    runner = GroupRunner({v.name: v.strategy for v in variants}, options)
    frames = {t.name: trace_frame(t) for t in traces}
    jobs = [(t.name, v.name) for t in traces for v in variants]
    count = workers or os.cpu_count() or 1
    done: list[pd.DataFrame] = []
    if count == 1:
        for trace, variant in jobs:
            done.append(runner(frames[trace].assign(variant=variant)))
            if progress:
                progress(len(done), len(jobs))
    else:
        # spawn: a fork would copy whatever threads the caller runs (an event loop, a JVM).
        with ProcessPoolExecutor(max_workers=count, mp_context=get_context("spawn")) as pool:
            futures = [
                pool.submit(runner, frames[trace].assign(variant=variant))
                for trace, variant in jobs
            ]
            for future in as_completed(futures):
                done.append(future.result())
                if progress:
                    progress(len(done), len(jobs))
    return _ordered(pd.concat(done, ignore_index=True), traces, variants)


def spark_session(master: str = "local[*]", app_name: str = "controllerd-backtest") -> SparkSession:
    """A SparkSession for the backtest (or the active one: Spark allows one per driver).

    Local masters run Python workers on this interpreter; on a cluster, the
    executors need ``controllerd[spark]`` installed (or ``--py-files``).
    """
    from pyspark.sql import SparkSession

    if master.startswith("local"):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder: Any = SparkSession.builder
    session: SparkSession = (
        builder.master(master)
        .appName(app_name)
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    return session


def run_spark(
    traces: Sequence[Trace],
    variants: Sequence[Variant],
    options: RunOptions,
    *,
    spark: SparkSession | None = None,
    master: str = "local[*]",
    progress: Progress | None = None,
) -> pd.DataFrame:
    """Every trace x variant as ``groupBy(trace, variant).applyInPandas`` on Spark.

    Uses ``spark`` if given (and leaves it running), else starts a session on
    ``master`` and stops it afterwards. Each (trace, variant) group gets its own
    shuffle partition where hashing allows, so groups run in parallel.
    """
    session = spark if spark is not None else spark_session(master)
    try:
        session.conf.set("spark.sql.execution.arrow.pyspark.enabled", "true")
        runner = GroupRunner({v.name: v.strategy for v in variants}, options)
        rows = session.createDataFrame(
            pd.concat([trace_frame(t) for t in traces], ignore_index=True), schema=TRACE_DDL
        )
        names = session.createDataFrame(pd.DataFrame({"variant": [v.name for v in variants]}))
        groups = len(traces) * len(variants)
        # An explicit partition count is never coalesced by adaptive execution, and the
        # groupBy reuses this partitioning instead of shuffling again.
        grouped = (
            rows.crossJoin(names)
            .repartition(groups, "trace", "variant")
            .groupBy("trace", "variant")
            .applyInPandas(_udf(runner), RESULT_DDL)
        )
        group_id = f"controllerd-backtest-{uuid.uuid4().hex}"
        session.sparkContext.setJobGroup(group_id, "controllerd backtest")
        watcher = _SparkProgress(session, group_id, progress) if progress else nullcontext()
        with watcher:
            result = grouped.toPandas()
    finally:
        if spark is None:
            session.stop()
    return _ordered(result, traces, variants)


class _SparkProgress(AbstractContextManager["_SparkProgress"]):
    """Polls Spark's status tracker for the job group's task counts while a query runs."""

    POLL_SECONDS: Final = 0.5

    def __init__(self, spark: SparkSession, group: str, progress: Progress) -> None:
        self._tracker = spark.sparkContext.statusTracker()
        self._group = group
        self._progress = progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="spark-progress", daemon=True)

    def __enter__(self) -> _SparkProgress:
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._report(finished=exc_type is None)

    def _report(self, finished: bool = False) -> None:
        """Completed and total tasks of the group's stages; a finished query is complete
        (stages Spark skipped because their output existed never count as completed)."""
        done = total = 0
        for job_id in self._tracker.getJobIdsForGroup(self._group):
            job = self._tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job is not None else ():
                stage = self._tracker.getStageInfo(stage_id)
                if stage is not None:
                    done += stage.numCompletedTasks
                    total += stage.numTasks
        if total:
            self._progress(total if finished else done, total)

    def _poll(self) -> None:
        while not self._stop.wait(self.POLL_SECONDS):
            self._report()


def run(
    engine: Engine,
    traces: Sequence[Trace],
    variants: Sequence[Variant],
    options: RunOptions,
    *,
    workers: int | None = None,
    master: str = "local[*]",
    spark: SparkSession | None = None,
    progress: Progress | None = None,
) -> pd.DataFrame:
    if engine == "local":
        return run_local(traces, variants, options, workers=workers, progress=progress)
    return run_spark(traces, variants, options, spark=spark, master=master, progress=progress)
