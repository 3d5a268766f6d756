"""Run every trace x variant through the simulator: locally or on Spark, identically.

Both engines replay each (trace, variant) group with the *same*
:class:`GroupRunner`, which runs :func:`controllerd.pipeline.simulate.simulate`
and returns the group's result row. ``local`` calls it in a process pool (one
process per core) on the trace's frame; ``spark`` gives each task a batch of
groups (:func:`batches`) whose series come from a broadcast, and replays recorded
histories with ``groupBy("trace", "variant").applyInPandas(...)``. The runner
sorts a frame's rows by ``seq`` first, so the order Spark delivers rows in cannot
matter, and Arrow and pickle carry int64 and float64 exactly: the metrics are
bit-identical.

On a cluster (``--master spark://HOST:7077``) the executors need our code:
:func:`ship_code` zips the ``controllerd`` package the driver imported and adds
it with ``SparkContext.addPyFile``, then checks that an executor imports
``controllerd`` from that zip (not from some other installed copy, which would
silently replay another policy). Recorded histories are read by the executors
themselves (``spark.read.parquet``), so their path must be one every executor
can reach (a shared file system, HDFS, S3); CSV series are read by the driver
and travel as broadcasts, one per job of :data:`SERIES_ROWS_PER_JOB` rows,
each fetched once per executor. Spark's and py4j's
logging is cut to errors (a quiet log4j2 configuration for the JVMs), so a run
prints only its own progress.
"""

from __future__ import annotations

import atexit
import hashlib
import heapq
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import uuid
import zipfile
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, fields
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import pandas as pd

import controllerd
from controllerd.core.model import Rates
from controllerd.errors import EXIT_UNAVAILABLE, EXIT_USAGE, OperatorError, first_line
from controllerd.pipeline.load import (
    MAX_STAMP_MS,
    LoadSource,
    SeriesLoad,
    Skew,
    Trace,
    source_for,
)
from controllerd.pipeline.simulate import (
    METRIC_COLUMNS,
    Operation,
    SimResult,
    Strategy,
    Timeline,
    simulate,
)
from controllerd.pipeline.traces import report_skipped
from controllerd.pipeline.variants import REFERENCE_THRESHOLDS, Variant

if TYPE_CHECKING:
    from pyspark import Broadcast
    from pyspark.sql import DataFrame as SparkFrame
    from pyspark.sql import GroupedData, SparkSession

Engine = Literal["local", "spark"]

RATE_COLUMNS: Final = ("msg_rate_in", "byte_rate_in", "msg_rate_out", "byte_rate_out")
TRACE_COLUMNS: Final = ("trace", "kind", "seq", "t_ms", "start", "end", *RATE_COLUMNS, "buckets")
TRACE_DDL: Final = (
    "trace string, kind string, seq long, t_ms long, start int, end int, "
    + ", ".join(f"{c} double" for c in RATE_COLUMNS)
    + ", buckets array<double>"
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
_TIMELINE_TYPES: Final = {
    f"{p}_{c}": t
    for p in ("tl", "zoom")
    for c, t in (
        ("t_ms", "array<bigint>"),
        ("load", "array<double>"),
        ("hottest", "array<double>"),
        ("segments", "array<int>"),
        ("segments_mean", "array<double>"),
    )
}
TIMELINE_COLUMNS: Final = tuple(_TIMELINE_TYPES)
_TIMELINE_DDL: Final = ", ".join(f"{c} {t}" for c, t in _TIMELINE_TYPES.items())
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


def frame_trace(frame: pd.DataFrame) -> Trace:
    """A trace from its rows of :data:`TRACE_COLUMNS` (a recorded history's, as
    :func:`history_rows` reads them), whatever order the rows arrive in."""
    frame = frame.sort_values("seq", kind="stable")
    rates = zip(*(frame[c].astype("float64").tolist() for c in RATE_COLUMNS), strict=True)
    raw = frame["buckets"].tolist() if "buckets" in frame else []
    buckets = [tuple(float(x) for x in b) if b is not None else None for b in raw]
    return Trace(
        str(frame["trace"].iloc[0]),
        "history" if frame["kind"].iloc[0] == "history" else "series",
        [int(t) for t in frame["t_ms"].tolist()],
        [int(s) for s in frame["start"].tolist()],
        [int(e) for e in frame["end"].tolist()],
        [(a, b, c, d) for a, b, c, d in rates],
        buckets if any(b is not None for b in buckets) else None,
    )


class GroupRunner:
    """``applyInPandas`` function: one trace x one variant in, one result row out.

    Picklable (shipped to Spark workers and to pool processes).
    """

    def __init__(self, strategies: Mapping[str, Strategy], options: RunOptions) -> None:
        self.strategies = dict(strategies)
        self.options = options

    def __call__(self, frame: pd.DataFrame) -> pd.DataFrame:
        return self.run(frame_trace(frame), str(frame["variant"].iloc[0]))

    def run(self, trace: Trace, variant: str) -> pd.DataFrame:
        return pd.DataFrame([self.row(trace, variant)])

    def row(self, trace: Trace, variant: str, source: LoadSource | None = None) -> dict[str, Any]:
        """``source``: the trace's, when the caller replays several variants on it (a
        replay only reads it, and what it works out once per trace it keeps)."""
        opts = self.options
        result = simulate(
            source if source is not None else source_for(trace, opts.skew, opts.seed),
            self.strategies[variant],
            opts.reference,
            timeline_points=opts.timeline_points,
        )
        return result_row(trace.name, variant, result)

    def rows(self, trace: Trace, variants: Sequence[str]) -> pd.DataFrame:
        """Every variant of one trace, on one source if it is a series."""
        source = shared_source(trace, self.options)
        return pd.DataFrame([self.row(trace, v, source) for v in variants])


def shared_source(trace: Trace, options: RunOptions) -> LoadSource | None:
    """A source every variant of ``trace`` can replay on, or None: a series is only read
    (:class:`SeriesLoad`), a recorded history is read forward once."""
    if trace.kind != "series":
        return None  # not built here: each variant builds its own
    source = source_for(trace, options.skew, options.seed)
    return source if isinstance(source, SeriesLoad) else None


def _udf(runner: GroupRunner) -> Callable[[pd.DataFrame], pd.DataFrame]:
    """A plain one-argument function: Spark counts parameters (a bound ``self`` would count)."""

    def apply(frame: pd.DataFrame) -> pd.DataFrame:
        return runner(frame)

    return apply


Batch = list[tuple[str, str]]
"""(trace, variant) pairs one Spark task replays, one after the other."""

GROUPS_PER_TASK: Final = 64
"""A fleet's groups go at least this many to a task: a Spark task costs ~40 ms of its own
(launch, a Python worker's round trip, one frame each way), as much as replaying a month."""


SERIES_ROWS_PER_JOB: Final = 4_000_000
"""Series go to Spark in jobs of about this many rows (one broadcast each), so the driver
and every Python worker hold one job's series at a time: 10,000 topics' month of
5-minute rows is ~75 million, several GB as Python objects in each process.
``bench.fleet_bench`` replayed that month in jobs of 500 such topics (3.7 million rows):
7.9 minutes on ``local[2]``. Smaller jobs were not measured."""


def series_jobs(traces: Sequence[Trace], rows: int) -> list[list[Trace]]:
    """``traces`` in order, cut into runs of at most ``rows`` rows (a longer trace alone)."""
    jobs: list[list[Trace]] = []
    held = rows
    for trace in traces:
        if held + len(trace.t_ms) > rows:
            jobs.append([])
            held = 0
        jobs[-1].append(trace)
        held += len(trace.t_ms)
    return jobs


def batches(traces: Sequence[Trace], variants: Sequence[Variant], slots: int) -> list[Batch]:
    """The pairs in tasks of about equal work, longest replays first to the least loaded
    task: 4 tasks per slot while that leaves fewer than :data:`GROUPS_PER_TASK` per task
    (so a few long traces still spread over every core), else that many per task.

    A trace's variants stay together, one after the other, when there are at least as
    many traces as tasks: they share one source (what a replay works out once per trace,
    such as its change times and topic load, is then worked out once). With fewer
    traces the pairs are spread one by one, so every core has work."""
    work = [  # (steps, trace, variant), trace by trace
        (
            (t.t_ms[-1] - t.t_ms[0]) / (v.strategy.interval_seconds * 1000.0) + 1.0,
            t.name,
            v.name,
        )
        for t in traces
        for v in variants
    ]
    count = min(len(work), max(4 * max(1, slots), -(-len(work) // GROUPS_PER_TASK)))
    units: list[tuple[float, list[tuple[str, str]]]] = []
    if len(traces) >= count:
        step = max(1, len(variants))
        for i in range(0, len(work), step):
            chunk = work[i : i + step]
            units.append((sum(w for w, _, _ in chunk), [(t, v) for _, t, v in chunk]))
    else:
        units = [(w, [(t, v)]) for w, t, v in work]
    units.sort(key=lambda u: -u[0])
    loads = [(0.0, i) for i in range(count)]
    out: list[Batch] = [[] for _ in range(count)]
    for steps, pairs in units:
        load, i = heapq.heappop(loads)
        out[i].extend(pairs)
        heapq.heappush(loads, (load + steps, i))
    return [b for b in out if b]


def _batch_task(
    runner: GroupRunner, traces: Broadcast[dict[str, Trace]]
) -> Callable[[Iterable[Batch]], Iterator[pd.DataFrame]]:
    """A task's function: its batch's result rows as one frame. The traces come from the
    broadcast, which each executor fetches once, not once per group; consecutive pairs
    of one trace replay on one source."""

    def apply(batch_list: Iterable[Batch]) -> Iterator[pd.DataFrame]:
        for batch in batch_list:
            rows = []
            source: tuple[str, LoadSource | None] | None = None
            for name, variant in batch:
                trace = traces.value[name]
                if source is None or source[0] != name:
                    source = (name, shared_source(trace, runner.options))
                rows.append(runner.row(trace, variant, source[1]))
            yield pd.DataFrame(rows)

    return apply


OPERATION_FIELDS: Final = tuple(f.name for f in fields(Operation))


def result_row(trace: str, variant: str, result: SimResult) -> dict[str, Any]:
    """One group's result row. The timelines are copied as they are: ``simulate`` builds
    them from Python ints (times, segments) and floats (the rest), which Arrow carries
    exactly; converting each of their ~20,000 values again cost 1.5 ms a group."""
    row: dict[str, Any] = {"trace": trace, "variant": variant}
    metrics = result.metrics  # plain fields: getattr, not asdict's deep copies
    row.update({name: getattr(metrics, name) for name in METRIC_COLUMNS})
    for prefix, timeline in (("tl", result.timeline), ("zoom", result.zoom)):
        row[f"{prefix}_t_ms"] = list(timeline.t_ms)
        row[f"{prefix}_load"] = list(timeline.load)
        row[f"{prefix}_hottest"] = list(timeline.hottest)
        row[f"{prefix}_segments"] = list(timeline.segments)
        row[f"{prefix}_segments_mean"] = list(timeline.segments_mean)
    row["operations_json"] = json.dumps(
        [{name: getattr(op, name) for name in OPERATION_FIELDS} for op in result.operations]
    )
    return row


def timeline_of(row: Mapping[str, Any], prefix: str = "tl") -> Timeline:
    """The timeline stored in a result row (``tl`` = whole run, ``zoom`` = around the peak)."""
    return Timeline(
        [int(t) for t in row[f"{prefix}_t_ms"]],
        [float(x) for x in row[f"{prefix}_load"]],
        [float(x) for x in row[f"{prefix}_hottest"]],
        [int(x) for x in row[f"{prefix}_segments"]],
        [float(x) for x in row[f"{prefix}_segments_mean"]],
    )


def with_timelines(results: pd.DataFrame, replayed: pd.DataFrame) -> pd.DataFrame:
    """``results`` with the timelines of the groups ``replayed`` again (with timelines);
    the other groups keep theirs."""
    key = pd.MultiIndex.from_frame(results[["trace", "variant"]])
    again = replayed.set_index(["trace", "variant"])
    found = key.isin(again.index)
    out = results.copy()
    for column in TIMELINE_COLUMNS:
        values = out[column].tolist()
        for i, k in zip(found.nonzero()[0], key[found], strict=True):
            values[i] = again.at[k, column]
        out[column] = values
    return out


def _ordered(
    results: pd.DataFrame, traces: Sequence[Trace], variants: Sequence[Variant]
) -> pd.DataFrame:
    """Rows in input order (traces, then variants), metrics with their contract dtypes;
    traces Spark read itself (recorded histories) come after, by name."""
    names = [t.name for t in traces]
    names += sorted(set(results["trace"]) - set(names))
    t_rank = {name: i for i, name in enumerate(names)}
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
    names = [v.name for v in variants]
    total = len(traces) * len(names)
    count = workers or os.cpu_count() or 1
    done: list[pd.DataFrame] = []
    replayed = 0
    if count == 1:
        for trace in traces:
            source, rows = shared_source(trace, options), []
            for name in names:
                rows.append(runner.row(trace, name, source))
                replayed += 1
                if progress:
                    progress(replayed, total)
            done.append(pd.DataFrame(rows))
    else:
        # One job per trace (progress counts its variants at once): they share one
        # source. spawn: a fork would copy whatever threads the caller runs (an event
        # loop, a JVM).
        with ProcessPoolExecutor(max_workers=count, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(runner.rows, trace, names) for trace in traces]
            for future in as_completed(futures):
                done.append(future.result())
                replayed += len(names)
                if progress:
                    progress(replayed, total)
    return _ordered(pd.concat(done, ignore_index=True), traces, variants)


QUIET_LOG4J2: Final = """\
# controllerd: Spark's JVMs log errors only (the backtest prints its own progress).
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n%ex
# PySpark's JVM counts as a shell: Spark sets the root level to its main class's
# (WARN unless configured here) and says so on stderr.
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = error
"""


def quiet_log4j2() -> str:
    """A log4j2 configuration file that logs errors only: one per content and user, written
    atomically (a rename), so concurrent runs share it and none leaves one behind."""
    digest = hashlib.sha256(QUIET_LOG4J2.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"controllerd-log4j2-{os.getuid()}-{digest}.properties"
    if not path.exists():
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, delete=False, suffix=".tmp", encoding="utf-8"
        ) as fh:
            fh.write(QUIET_LOG4J2)
        os.replace(fh.name, path)
    return path.as_uri()


def spark_session(master: str = "local[*]", app_name: str = "controllerd-backtest") -> SparkSession:
    """A SparkSession for the backtest (or the active one: Spark allows one per driver).

    Local masters run Python workers on this interpreter. On a ``spark://``
    master on this machine the executors do too (``spark.pyspark.python``);
    elsewhere set ``PYSPARK_PYTHON`` to an interpreter the executors have, with
    pandas and pyarrow. Either way our own code is shipped (:func:`ship_code`).
    Spark and py4j log errors only.
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise missing_spark_extra() from None

    local = master.startswith("local")
    host = master.removeprefix("spark://").split(":")[0]
    if local or host in ("127.0.0.1", "localhost"):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    logging.getLogger("py4j").setLevel(logging.ERROR)
    quiet = f"-Dlog4j2.configurationFile={quiet_log4j2()}"
    builder: Any = SparkSession.builder
    builder = (
        builder.master(master)
        .appName(app_name)
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.extraJavaOptions", quiet)
        .config("spark.executor.extraJavaOptions", quiet)
    )
    if not local and "PYSPARK_PYTHON" in os.environ:
        builder = builder.config("spark.pyspark.python", os.environ["PYSPARK_PYTHON"])
    try:
        session: SparkSession = builder.getOrCreate()
    except Exception as exc:  # py4j/JVM errors have no common type; name the setting
        raise OperatorError(
            f"cannot start Spark on {master}: {first_line(exc)}",
            exit_code=EXIT_UNAVAILABLE,
            setting="--master",
        ) from None
    session.sparkContext.setLogLevel("ERROR")
    return session


def missing_spark_extra() -> OperatorError:
    """The one-line error for a command that needs the ``spark`` extra."""
    from controllerd.pipeline.cli import missing_extra

    return missing_extra()


_SHIPPED: dict[str, str] = {}  # Spark application id -> where its executors import us from


def package_zip(directory: str | None = None) -> Path:
    """A zip of the ``controllerd`` package this driver imported (its ``.py`` files).

    Without ``directory`` it goes to a temporary directory removed when this
    process exits: Spark serves an added file from its path until the context
    stops, so it cannot go sooner, and every backtest used to leave one behind.
    """
    root = Path(controllerd.__file__).resolve().parent
    if directory is None:
        directory = tempfile.mkdtemp(prefix="controllerd-ship-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    out = Path(directory) / "controllerd.zip"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(root.rglob("*.py")):
            zf.write(path, Path("controllerd") / path.relative_to(root))
    return out


def _origin(_: object) -> str:
    import controllerd as shipped

    return str(shipped.__file__)


def ship_code(spark: SparkSession) -> str:
    """Make the executors import this driver's ``controllerd``; returns where they do.

    Once per SparkContext: zip the package, ``addPyFile`` it, then run one tiny
    task to check an executor imports ``controllerd`` from the zip (or, on this
    machine, from the very files the driver imported). Raises
    :class:`OperatorError` if it does not: another copy shadows ours.
    """
    sc = spark.sparkContext
    key = str(sc.applicationId)
    if key in _SHIPPED:
        return _SHIPPED[key]
    if str(sc.master).startswith("local"):
        # The workers run on this machine: if they find the very files this driver
        # imported, they need no zip (and keep the replay kernel's compiled cache,
        # which a zip's per-session path would lose).

        def find_package(_: object) -> str:
            """Where a worker would import ``controllerd`` from, without importing it: a
            nested function travels by value, so a worker that gets the zip next has
            imported no other copy."""
            spec = importlib.util.find_spec("controllerd")
            return str(spec.origin) if spec is not None else ""

        origin = sc.parallelize([0], 1).map(find_package).collect()[0]
        if origin == str(controllerd.__file__):
            _SHIPPED[key] = origin
            return origin
    archive = package_zip()
    sc.addPyFile(str(archive))
    origin = sc.parallelize([0], 1).map(_origin).collect()[0]
    if archive.name not in origin and origin != str(controllerd.__file__):
        raise OperatorError(
            f"Spark executors import controllerd from {origin}, not the shipped code; "
            "remove that copy from the executors' Python path",
            exit_code=EXIT_USAGE,
            setting="--master",
        )
    _SHIPPED[key] = origin
    return origin


def history_rows(
    spark: SparkSession,
    root: str,
    max_hours: float | None = None,
    topics: Collection[str] | None = None,
) -> SparkFrame:
    """A recorded history as trace rows (:data:`TRACE_DDL`), read by the executors
    (only ``topics``' if given: a second replay, whose malformed rows the first counted).

    One trace per topic: its load rows with a known hash range, in time order
    (then etcd revision), as :func:`controllerd.pipeline.traces.import_history`
    builds them on one machine.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    loads = _loads(spark, root)
    if "hash_buckets" not in loads.columns:
        loads = loads.withColumn("hash_buckets", F.lit(None).cast("array<double>"))
    loads = loads.where(F.col("range_start").isNotNull())
    # What import_history skips and counts as malformed, so both engines replay the
    # same rows. Spark orders NaN above +inf, so "< inf" refuses NaN too.
    inf = F.lit(float("inf"))
    ok = (
        F.col("range_start").between(0, 0xFFFF)
        & F.col("range_end").between(F.col("range_start"), F.lit(0xFFFF))
        & F.col("t_ms").between(0, MAX_STAMP_MS)
        & (F.trim(F.col("topic")) != "")  # null, blank: no trace to replay it in
        & F.col("mod_revision").isNotNull()
        & (
            F.col("hash_buckets").isNull()
            | F.forall("hash_buckets", lambda b: b.isNotNull() & (b >= 0) & (b < inf))
        )
    )
    for column in RATE_COLUMNS:
        ok = ok & (F.col(column) >= 0) & (F.col(column) < inf)
    ok = F.coalesce(ok, F.lit(False))  # a null anywhere is malformed too
    if topics is not None:
        loads = loads.where(F.col("topic").isin(sorted(topics)))
    else:
        bad = loads.where(~ok).count()  # one scan, as import_history counts on one machine
        if bad:
            report_skipped(root, bad, "load rows")
    loads = loads.where(ok)
    if max_hours is not None:
        first = F.min("t_ms").over(Window.partitionBy("topic"))
        loads = loads.where(F.col("t_ms") <= first + F.lit(max_hours * 3_600_000))
    order = Window.partitionBy("topic").orderBy("t_ms", "mod_revision")
    return loads.select(
        F.col("topic").alias("trace"),
        F.lit("history").alias("kind"),
        (F.row_number().over(order) - 1).cast("long").alias("seq"),
        F.col("t_ms").cast("long"),
        F.col("range_start").cast("int").alias("start"),
        F.col("range_end").cast("int").alias("end"),
        *(F.col(c).cast("double") for c in RATE_COLUMNS),
        F.col("hash_buckets").cast("array<double>").alias("buckets"),
    )


def _loads(spark: SparkSession, root: str) -> SparkFrame:
    """A history's load rows as Spark reads them; a directory it cannot read (files
    beside the recorder's ``topic=`` directories stop its partition discovery) is the
    operator's to fix, named."""
    try:
        return spark.read.parquet(str(Path(root).resolve() / "loads"))
    except Exception as exc:  # py4j/JVM errors have no common type: name the directory
        raise OperatorError(
            f"{root}: cannot read its load rows on Spark: {first_line(exc, 300)}",
            exit_code=EXIT_USAGE,
            setting="--traces",
        ) from None


def history_topics(spark: SparkSession, root: str) -> set[str]:
    """The topics of a recorded history, from its partition directories (no Spark job).

    Spark lists them as URIs: a topic's escaped ``/`` (``%2F``) is escaped again there
    (``%252F``), so each is unquoted twice, as a URI and then as a partition value."""
    from urllib.parse import unquote, urlparse

    files = _loads(spark, root).inputFiles()
    return {
        unquote(part.removeprefix("topic="))
        for f in files
        for part in unquote(urlparse(f).path).split("/")
        if part.startswith("topic=")
    }


def run_spark(
    traces: Sequence[Trace],
    variants: Sequence[Variant],
    options: RunOptions,
    *,
    spark: SparkSession | None = None,
    master: str = "local[*]",
    progress: Progress | None = None,
    histories: Sequence[str] = (),
    max_hours: float | None = None,
    topics: Collection[str] | None = None,
    listed: Collection[str] | None = None,
) -> pd.DataFrame:
    """Every trace x variant as ``groupBy(trace, variant).applyInPandas`` on Spark.

    Uses ``spark`` if given (and leaves it running), else starts a session on
    ``master`` and stops it afterwards. ``histories`` are recorder output
    directories the executors read themselves (only ``topics`` of them, if given).
    ``listed``: their topics, when the caller has listed them already (listing
    reads every file name of every history, on a cluster's storage). Each
    (trace, variant) group gets its own shuffle partition where hashing allows, so
    groups run in parallel.
    """
    session = spark if spark is not None else spark_session(master)
    shipped: Broadcast[dict[str, Trace]] | None = None
    try:
        ship_code(session)
        session.conf.set("spark.sql.execution.arrow.pyspark.enabled", "true")
        runner = GroupRunner({v.name: v.strategy for v in variants}, options)
        parts: list[SparkFrame] = []
        found = (
            set(listed)
            if listed is not None
            else set().union(*(history_topics(session, h) for h in histories))
        )
        if topics is not None:
            found &= set(topics)
        if found:
            only = found if topics is not None else None
            rows = history_rows(session, histories[0], max_hours, only)
            for h in histories[1:]:
                rows = rows.unionByName(history_rows(session, h, max_hours, only))
            names = session.createDataFrame(pd.DataFrame({"variant": [v.name for v in variants]}))
            count = len(found)
            parts.append(
                _per_group(rows.crossJoin(names), count * len(variants)).applyInPandas(
                    _udf(runner), RESULT_DDL
                )
            )
        if not parts and not traces:
            raise ValueError("run_spark: no traces and no histories to replay")
        group_id = f"controllerd-backtest-{uuid.uuid4().hex}"
        context = session.sparkContext
        context.setJobGroup(group_id, "controllerd backtest")
        watcher = _SparkProgress(session, group_id, progress) if progress else nullcontext()
        frames: list[pd.DataFrame] = []
        with watcher:
            for job in series_jobs(traces, SERIES_ROWS_PER_JOB):
                # A job's series travel once, as a broadcast; a task gets a batch of
                # (trace, variant) names, one partition each, and replays it in turn.
                shipped = context.broadcast({t.name: t for t in job})
                work = batches(job, variants, context.defaultParallelism)
                frames += (
                    context.parallelize(work, len(work))
                    .mapPartitions(_batch_task(runner, shipped))
                    .collect()
                )
                shipped.unpersist()
                shipped = None
            for part in parts:
                frames.append(part.toPandas())
        result = pd.concat(frames, ignore_index=True)
    finally:
        if shipped is not None:
            shipped.unpersist()
        if spark is None:
            session.stop()
    return _ordered(result, traces, variants)


def _per_group(rows: SparkFrame, groups: int) -> GroupedData:
    """``rows`` grouped by (trace, variant), each group in a partition of its own where
    hashing allows. An explicit partition count is never coalesced by adaptive execution,
    and the groupBy reuses this partitioning instead of shuffling again."""
    return rows.repartition(max(1, groups), "trace", "variant").groupBy("trace", "variant")


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
    histories: Sequence[str] = (),
    max_hours: float | None = None,
    topics: Collection[str] | None = None,
    listed: Collection[str] | None = None,
) -> pd.DataFrame:
    """Run on ``engine``; ``histories`` (recorded, read by Spark's executors; only
    ``topics`` of them if given; ``listed``: all their topics, if known) are Spark only."""
    if engine == "local":
        return run_local(traces, variants, options, workers=workers, progress=progress)
    return run_spark(
        traces,
        variants,
        options,
        spark=spark,
        master=master,
        progress=progress,
        histories=histories,
        max_hours=max_hours,
        topics=topics,
        listed=listed,
    )
