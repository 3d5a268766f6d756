"""The local and Spark engines run the same function and give identical metrics."""

from __future__ import annotations

import math
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pandas as pd
import pytest

from controllerd.errors import EXIT_USAGE, OperatorError
from controllerd.pipeline import engines
from controllerd.pipeline.engines import (
    RATE_COLUMNS,
    TIMELINE_COLUMNS,
    RunOptions,
    batches,
    frame_trace,
    package_zip,
    run_local,
    run_spark,
    with_timelines,
)
from controllerd.pipeline.history import LOADS, write_rows
from controllerd.pipeline.load import Skew, Trace
from controllerd.pipeline.simulate import METRIC_COLUMNS
from controllerd.pipeline.variants import Variant, parse_variants
from tests.support.spark import spark_fixture  # noqa: F401 - fixture

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

T0: Final = 1_420_070_400_000
FIVE_MIN: Final = 300_000
VARIANTS: Final = """
[variants.pip483]
preset = "pip483"
[variants.controllerd]
preset = "controllerd"
[variants.static-3]
static_segments = 3
[variants.w]
preset = "controllerd"
grid."policy.merge_window_seconds" = [600]
"""


def bursty(name: str, hours: int, period: int) -> Trace:
    """Low chatter with a burst every ``period`` buckets: Twitter-like, at 5-minute steps."""
    n = hours * 12
    values = [
        (40_000.0 if i % period == 0 else 300.0 + 200.0 * math.sin(i)) * (1 + (i % 7) / 10)
        for i in range(n)
    ]
    return Trace(
        name,
        "series",
        [T0 + i * FIVE_MIN for i in range(n)],
        [0] * n,
        [0xFFFF] * n,
        [(v, v * 1024, v, v * 1024) for v in values],
    )


def daily(name: str, hours: int) -> Trace:
    """Demand with a daily cycle: taxi-like, at 30-minute steps."""
    n = hours * 2
    values = [20_000.0 * (1.0 - math.cos(2 * math.pi * i / 48)) + 500.0 for i in range(n)]
    return Trace(
        name,
        "series",
        [T0 + i * 6 * FIVE_MIN for i in range(n)],
        [0] * n,
        [0xFFFF] * n,
        [(v, v * 1024, v, v * 1024) for v in values],
    )


def recorded(name: str) -> Trace:
    """A recorded history: a whole-topic record, then two children's records."""
    rows = [(0, 0, 0xFFFF, 15_000.0), (10, 0, 0x7FFF, 9_000.0), (11, 0x8000, 0xFFFF, 2_000.0)]
    rows += [(20 + i, 0, 0x7FFF, 500.0) for i in range(40)]
    return Trace(
        name,
        "history",
        [T0 + m * 60_000 for m, *_ in rows],
        [s for _, s, _, _ in rows],
        [e for _, _, e, _ in rows],
        [(r, r * 100, r, r * 100) for *_, r in rows],
    )


TRACES: Final = [
    bursty("burst-a", 30, 37),
    bursty("burst-b", 24, 50),
    daily("cycle", 72),
    recorded("t/n/rec"),
]


@pytest.fixture(scope="module")
def variants() -> list[Variant]:
    return parse_variants(VARIANTS)


def metrics(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[["trace", "variant", *METRIC_COLUMNS]]


def test_a_fleet_s_batches_keep_each_trace_s_variants_together(variants: list[Variant]) -> None:
    many = [bursty(f"t{i}", 24 + i, 12) for i in range(20)]
    work = batches(many, variants, slots=2)
    assert len(work) == 8  # 4 tasks per slot
    pairs = [pair for batch in work for pair in batch]
    assert sorted(pairs) == sorted((t.name, v.name) for t in many for v in variants)
    for batch in work:  # each trace's variants in one batch, one after the other
        names = [trace for trace, _ in batch]
        for i in range(0, len(names), len(variants)):
            assert len(set(names[i : i + len(variants)])) == 1
    # the longest traces go first, each to the least loaded task: loads within a trace
    steps = [sum(24 + int(t[1:]) for t, _ in batch) for batch in work]
    assert max(steps) - min(steps) <= 43 * len(variants)
    # fewer traces than tasks: their pairs spread one by one so every core has work
    few = batches(many[:3], variants, slots=2)
    assert len(few) == 8
    assert any(len({t for t, _ in batch}) > 1 for batch in few) or len(few) > 3


def trace_frame(trace: Trace) -> pd.DataFrame:
    """A trace as rows of TRACE_COLUMNS, as a recorded history arrives at a Spark task."""
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
    data["buckets"] = (
        [list(b) if b is not None else None for b in trace.buckets]
        if trace.buckets is not None
        else [None] * n
    )
    frame = pd.DataFrame(data)
    return frame.astype({"seq": "int64", "t_ms": "int64", "start": "int32", "end": "int32"})


def test_trace_frames_round_trip_in_any_row_order() -> None:
    for trace in TRACES:
        frame = trace_frame(trace)
        shuffled = frame.sample(frac=1.0, random_state=3).assign(variant="v")
        assert frame_trace(shuffled) == trace


def test_local_and_spark_give_identical_results(
    spark: SparkSession, variants: list[Variant]
) -> None:
    options = RunOptions(skew=Skew.parse("zipf:0.9:300"), seed=5, timeline_points=50)
    local = run_local(TRACES, variants, options, workers=1)
    seen: list[tuple[int, int]] = []
    remote = run_spark(
        TRACES, variants, options, spark=spark, progress=lambda d, n: seen.append((d, n))
    )
    assert len(local) == len(TRACES) * len(variants) == 16
    assert list(local["variant"][:4]) == [
        "pip483",
        "controllerd",
        "static-3",
        "w[merge_window_seconds=600]",
    ]
    pd.testing.assert_frame_equal(metrics(local), metrics(remote), check_exact=True)
    assert list(local["operations_json"]) == list(remote["operations_json"])
    assert [list(x) for x in local["tl_segments"]] == [list(x) for x in remote["tl_segments"]]
    assert local["splits"].sum() > 0 and local["merges"].sum() > 0  # the set exercises both
    assert seen and seen[-1][0] == seen[-1][1]  # the progress callback reached the end


def test_series_go_in_jobs_of_a_bounded_row_count_in_order() -> None:
    sizes = [len(t.t_ms) for t in TRACES]
    assert [len(j) for j in engines.series_jobs(TRACES, sum(sizes))] == [len(TRACES)]
    one_each = engines.series_jobs(TRACES, 1)  # a trace longer than the bound goes alone
    assert one_each == [[t] for t in TRACES]
    pairs = engines.series_jobs(TRACES, sizes[0] + sizes[1])
    assert [t for job in pairs for t in job] == list(TRACES)
    assert all(sum(len(t.t_ms) for t in job) <= sizes[0] + sizes[1] for job in pairs[:-1])
    assert engines.series_jobs([], 10) == []


def test_spark_replays_series_in_several_jobs_as_in_one(
    spark: SparkSession, variants: list[Variant], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet's series go in jobs of bounded size, one broadcast each: same rows."""
    options = RunOptions(timeline_points=0)
    local = run_local(TRACES, variants[:2], options, workers=1)
    jobs: list[list[Trace]] = []
    cut = engines.series_jobs

    def spy(traces: Sequence[Trace], rows: int) -> list[list[Trace]]:
        jobs.extend(cut(traces, rows))
        return jobs

    monkeypatch.setattr(engines, "SERIES_ROWS_PER_JOB", 1)
    monkeypatch.setattr(engines, "series_jobs", spy)
    remote = run_spark(TRACES, variants[:2], options, spark=spark)
    assert len(jobs) == len(TRACES)
    pd.testing.assert_frame_equal(metrics(local), metrics(remote), check_exact=True)


def test_the_process_pool_gives_the_same_results(variants: list[Variant]) -> None:
    options = RunOptions(timeline_points=20)
    few = TRACES[:2]
    inline = run_local(few, variants[:2], options, workers=1)
    pooled = run_local(few, variants[:2], options, workers=2)
    pd.testing.assert_frame_equal(metrics(inline), metrics(pooled), check_exact=True)


def test_only_the_traces_replayed_again_keep_timelines(variants: list[Variant]) -> None:
    """A fleet's first replay keeps no timelines; the traces to plot are replayed again
    with them, and only their rows get them."""
    options = RunOptions(timeline_points=20)
    full = run_local(TRACES, variants[:2], options, workers=1)
    bare = run_local(TRACES, variants[:2], RunOptions(timeline_points=0), workers=1)
    pd.testing.assert_frame_equal(metrics(full), metrics(bare), check_exact=True)
    assert list(full["operations_json"]) == list(bare["operations_json"])
    assert all(len(bare[c][i]) == 0 for c in TIMELINE_COLUMNS for i in range(len(bare)))
    again = run_local(TRACES[1:2], variants[:2], options, workers=1)
    merged = with_timelines(bare, again)
    pd.testing.assert_frame_equal(metrics(merged), metrics(full), check_exact=True)
    for column in TIMELINE_COLUMNS:
        for i, trace in enumerate(merged["trace"]):
            want = list(full[column][i]) if trace == TRACES[1].name else []
            assert list(merged[column][i]) == want, (column, trace)
    assert len(merged["tl_t_ms"][2]) > 0  # the second trace's first variant


def test_the_shipped_zip_holds_the_package_and_is_removed_when_the_driver_exits() -> None:
    """Spark needs the zip until its context stops; the process's exit removes it."""
    code = (
        "import zipfile\n"
        "from controllerd.pipeline.engines import package_zip\n"
        "z = package_zip()\n"
        "print(z)\n"
        "print(len([n for n in zipfile.ZipFile(z).namelist() if n.endswith('core/policy.py')]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    path, policies = done.stdout.split()
    assert policies == "1"
    assert Path(path).name == "controllerd.zip"
    assert not Path(path).parent.exists()


def test_a_zip_in_a_given_directory_is_left_there(tmp_path: Path) -> None:
    archive = package_zip(str(tmp_path))
    assert archive.parent == tmp_path
    assert "controllerd/pipeline/engines.py" in zipfile.ZipFile(archive).namelist()


def test_spark_reads_the_recorded_history(spark: SparkSession, tmp_path: Path) -> None:
    """The recorder's topic=/hour= partitions decode back to real topic names in Spark."""
    row: dict[str, Any] = dict.fromkeys(RATE_COLUMNS, 1.0)
    row |= {
        "topic": "acme/ns/orders",
        "t_ms": T0,
        "observed_at_ms": T0,
        "mod_revision": 7,
        "segment_id": 0,
        "range_start": 0,
        "range_end": 0xFFFF,
        "changed_at_ms": T0,
    }
    write_rows(tmp_path, LOADS, [row])
    (got,) = (
        spark.read.parquet(str(tmp_path / LOADS)).select("topic", "hour", "mod_revision").collect()
    )
    assert (got["topic"], got["hour"], got["mod_revision"]) == (
        "acme/ns/orders",
        "2015-01-01T00",
        7,
    )


def test_a_history_spark_cannot_read_is_an_operator_error_naming_it(
    spark: SparkSession, variants: list[Variant], tmp_path: Path
) -> None:
    """A file beside the recorder's topic= directories (no topic= level) stops Spark's
    partition discovery; that is the operator's directory, not a bug of ours (exit 2,
    not 70)."""
    row: dict[str, Any] = dict.fromkeys(RATE_COLUMNS, 1.0)
    row |= {"topic": "a/b/c", "t_ms": T0, "observed_at_ms": T0, "mod_revision": 1}
    row |= {"segment_id": 0, "range_start": 0, "range_end": 0xFFFF, "changed_at_ms": T0}
    write_rows(tmp_path, LOADS, [row])
    stray = tmp_path / LOADS / "hour=2015-01-01T00"
    stray.mkdir()
    (next((tmp_path / LOADS).glob("topic=*/hour=*/*.parquet"))).rename(stray / "x.parquet")
    write_rows(tmp_path, LOADS, [row])
    with pytest.raises(OperatorError) as refused:
        run_spark([], variants[:1], RunOptions(), spark=spark, histories=[str(tmp_path)])
    assert str(tmp_path) in str(refused.value) and refused.value.exit_code == EXIT_USAGE


def test_both_engines_skip_the_same_malformed_history_rows(
    spark: SparkSession,
    variants: list[Variant],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Spark reads a history itself: it must drop what import_history drops, or the two
    engines would replay different rows."""
    from controllerd.pipeline.traces import TraceOptions, discover

    rates = dict.fromkeys(RATE_COLUMNS, 100.0)
    base = {"topic": "a/b/c", "observed_at_ms": T0, "segment_id": 0, "changed_at_ms": T0}
    rows: list[dict[str, Any]] = []
    for i in range(240):
        load = 16_000.0 if (i // 30) % 2 else 200.0
        row = {**base, **rates, "msg_rate_in": load, "t_ms": T0 + 60_000 * i, "mod_revision": i}
        rows.append({**row, "range_start": 0, "range_end": 0xFFFF})
    rows[40]["msg_rate_in"] = math.inf
    rows[41]["byte_rate_out"] = math.nan
    rows[42]["range_start"], rows[42]["range_end"] = 0x9000, 0x8000
    rows[43]["hash_buckets"] = [1.0, -1.0]
    rows[44]["t_ms"] = -5
    rows[45]["mod_revision"] = None
    rows[46]["topic"] = None  # no trace to replay it in
    other = [{**r, "topic": "x/y/z", "msg_rate_in": 2 * r["msg_rate_in"]} for r in rows[100:]]
    write_rows(tmp_path, LOADS, rows + other)
    options = RunOptions(timeline_points=20)
    local = run_local(discover([tmp_path], TraceOptions()), variants[:2], options, workers=1)
    capsys.readouterr()
    remote = run_spark([], variants[:2], options, spark=spark, histories=[str(tmp_path)])
    assert f"{tmp_path}: skipped 7 malformed load rows" in capsys.readouterr().err
    pd.testing.assert_frame_equal(metrics(local), metrics(remote), check_exact=True)
    assert local["splits"].sum() > 0
    assert set(local["trace"]) == {"a/b/c", "x/y/z"}
    # A second replay of some topics only (the ones to plot) reads just their rows.
    some = run_spark(
        [], variants[:2], options, spark=spark, histories=[str(tmp_path)], topics=["x/y/z"]
    )
    want = metrics(local[local["trace"] == "x/y/z"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(metrics(some), want, check_exact=True)
    assert "malformed" not in capsys.readouterr().err  # the first replay said it once
    # Topics the caller listed already are not listed again (a pass over every file name).
    two = ["a/b/c", "x/y/z"]
    with monkeypatch.context() as patch:
        patch.setattr(engines, "history_topics", _listed_twice)
        again = run_spark(
            [], variants[:2], options, spark=spark, histories=[str(tmp_path)], listed=two
        )
    pd.testing.assert_frame_equal(metrics(again), metrics(local), check_exact=True)


def _listed_twice(*_: object) -> set[str]:
    raise AssertionError("history_topics called although the caller listed the topics")
