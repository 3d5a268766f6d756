"""Trace importers: NAB-style CSV series scaled to the split threshold; skew parsing."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path

import pytest

from controllerd.pipeline.load import Skew
from controllerd.pipeline.traces import TraceError, TraceOptions, discover, import_csv
from tests.support.shared import traces_dir


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_the_peak_becomes_a_multiple_of_the_split_threshold(tmp_path: Path) -> None:
    csv = write(
        tmp_path / "t.csv",
        "timestamp,value\n2015-02-26 21:47:53,5\n2015-02-26 21:42:53,10\n2015-02-26 21:52:53,0\n",
    )
    trace = import_csv(csv, TraceOptions(peak_over_threshold=3, msg_bytes=100, out_fanout=2))
    assert trace.name == "t" and trace.kind == "series"
    first = dt.datetime(2015, 2, 26, 21, 42, 53, tzinfo=dt.UTC).timestamp() * 1000
    assert trace.t_ms == [first + i * 300_000 for i in range(3)]
    assert [r[0] for r in trace.rates] == [30_000.0, 15_000.0, 0.0]  # sorted by time
    assert trace.rates[0] == (30_000.0, 3_000_000.0, 60_000.0, 6_000_000.0)
    assert set(trace.start) == {0} and set(trace.end) == {0xFFFF}


def test_max_hours_cuts_the_series_before_scaling(tmp_path: Path) -> None:
    csv = write(tmp_path / "t.csv", "0,1\n1800,2\n3600,3\n7200,100\n")
    trace = import_csv(csv, TraceOptions(max_hours=1))
    assert trace.t_ms == [0, 1_800_000, 3_600_000]
    assert trace.rates[-1][0] == 4 * 10_000.0


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("60,x", "value 'x' is not a finite number >= 0"),
        ("60", "expected timestamp,value"),
        ("60,-1", "value '-1' is not a finite number >= 0"),
        ("60,nan", "value 'nan' is not a finite number >= 0"),
        ("60,1e400", "value '1e400' is not a finite number >= 0"),
        ("inf,2", "timestamp 'inf' is not in 1970-9999"),
        ("1e300,2", "timestamp '1e300' is not in 1970-9999 (epoch seconds expected, not millis"),
        ("-1e15,2", "timestamp '-1e15' is not in 1970-9999"),
        ("notadate,2", "timestamp 'notadate' is not YYYY-MM-DD HH:MM:SS, ISO 8601 or epoch sec"),
        (",2", "timestamp '' is not YYYY-MM-DD HH:MM:SS, ISO 8601 or epoch seconds"),
        ("1969-12-31T23:59:59,3", "timestamp '1969-12-31T23:59:59' is not in 1970-9999"),
    ],
)
def test_a_malformed_csv_row_is_skipped_and_counted_naming_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, reason: str
) -> None:
    """One bad row of a long series used to end the whole backtest; it is dropped,
    and one stderr line says how many and which first."""
    csv = write(tmp_path / "t.csv", f"0,1\n{line}\n120,3\n")
    trace = import_csv(csv, TraceOptions())
    assert trace.t_ms == [0, 120_000]
    (said,) = capsys.readouterr().err.splitlines()
    assert said.startswith(f"controllerd: {csv}: skipped 1 malformed rows (first: line 2: ")
    assert reason in said


def test_skipped_csv_rows_are_counted_once_per_file_with_the_header_s_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The message names the column as the file does; an unclosed quote, which swallows
    the lines after it into one cell, is reported as such."""
    csv = write(tmp_path / "t.csv", 'time,count\n0,1\nnotadate,2\n60,x\n\n120,3\n"180,4\n240,5\n')
    assert import_csv(csv, TraceOptions()).t_ms == [0, 120_000]
    assert capsys.readouterr().err.splitlines() == [
        f"controllerd: {csv}: skipped 3 malformed rows (first: line 3: time 'notadate' "
        "is not YYYY-MM-DD HH:MM:SS, ISO 8601 or epoch seconds)"
    ]
    import_csv(write(tmp_path / "v.csv", "time,count\n0,1\n60,x\n"), TraceOptions())
    assert "(first: line 3: count 'x' is not a finite number >= 0)" in capsys.readouterr().err
    import_csv(write(tmp_path / "q.csv", '0,1\n"60,2\n120,3\n180,4\n'), TraceOptions())
    assert "(first: line 2: a quoted field runs on to line 4)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("timestamp,value\n", r"bad.csv: no rows$"),
        ("2015-01-01 00:00:00\n", r": no usable rows: all 1 malformed \(first: line 1: expected"),
        ("0,0\n60,0\n", "bad.csv: all values are zero"),
        ("timestamp,value\nx,1\n0,y\n", r": all 2 malformed \(first: line 2: timestamp 'x' is"),
        ("1441115100000,3\n1441115400000,4\n", r"all 2 malformed \(first: line 1: .* milliseconds"),
        (
            "1969-12-31T23:59:59,3\n",
            r"line 1: timestamp '1969-12-31T23:59:59' is not in 1970-9999\)$",
        ),
    ],
)
def test_a_csv_with_no_usable_row_is_refused_naming_the_file(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(TraceError, match=message):
        import_csv(write(tmp_path / "bad.csv", text), TraceOptions())


def test_a_file_that_is_not_utf8_text_is_refused_naming_it(tmp_path: Path) -> None:
    binary = tmp_path / "garbage.csv"
    binary.write_bytes(b"0,1\n60,2\n\xbe\xef\x00\xff,3\n")
    with pytest.raises(TraceError, match=r"garbage.csv: not UTF-8 text"):
        discover([tmp_path], TraceOptions())


@pytest.mark.parametrize("header", ["", "timestamp,value\n"], ids=["headerless", "header"])
def test_a_byte_order_mark_loses_no_row(tmp_path: Path, header: str) -> None:
    """A headerless file's BOM glued to its first date made the row look like a header:
    the row was dropped without a word."""
    rows = "2015-02-26 21:42:53,5\n2015-02-26 21:47:53,10\n"
    marked = tmp_path / "marked.csv"
    marked.write_bytes(("\ufeff" + header + rows).encode("utf-8"))
    trace = import_csv(marked, TraceOptions())
    assert [r[0] for r in trace.rates] == [20_000.0, 40_000.0]  # both rows, peak 4 x 10k


def test_max_hours_that_keeps_no_row_is_refused(tmp_path: Path) -> None:
    csv = write(tmp_path / "t.csv", "3600,1\n7200,2\n")
    assert len(import_csv(csv, TraceOptions(max_hours=0.5)).t_ms) == 1
    with pytest.raises(TraceError, match="no rows in the first"):
        import_csv(csv, TraceOptions(max_hours=-1))


def test_discover_reads_a_directory_and_refuses_duplicate_names(tmp_path: Path) -> None:
    write(tmp_path / "a.csv", "0,1\n60,2\n")
    write(tmp_path / "b.csv", "0,1\n60,2\n")
    assert [t.name for t in discover([tmp_path], TraceOptions())] == ["a", "b"]
    with pytest.raises(TraceError, match="repeated: a"):
        discover([tmp_path, tmp_path / "a.csv"], TraceOptions())
    with pytest.raises(TraceError, match="no such file"):
        discover([tmp_path / "missing"], TraceOptions())
    # a device was "no such file or directory" too
    with pytest.raises(TraceError, match=r"^/dev/null: not a regular file or a directory"):
        discover(["/dev/null"], TraceOptions())


def test_the_shared_nab_traces_import() -> None:
    traces = discover([traces_dir() / "nab"], TraceOptions(max_hours=24))
    names = [t.name for t in traces]
    assert "nyc_taxi" in names and "Twitter_volume_AAPL" in names
    assert all(max(r[0] for r in t.rates) == pytest.approx(40_000.0) for t in traces)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("uniform", Skew()),
        ("zipf:1.2", Skew("zipf", 1.2, 1000)),
        ("ZIPF:0.8:50", Skew("zipf", 0.8, 50)),
    ],
)
def test_skew_parses(text: str, expected: Skew) -> None:
    assert Skew.parse(text) == expected
    assert Skew.parse(str(expected)) == expected


@pytest.mark.parametrize("text", ["zipf", "zipf:-1", "zipf:1:0", "pareto:1", "zipf:a"])
def test_bad_skew_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="uniform"):
        Skew.parse(text)


def test_history_rows_that_cannot_be_replayed_are_skipped_and_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from controllerd.pipeline.history import LOADS, write_rows

    t0 = 1_420_070_400_000
    base = {"topic": "a/b/c", "observed_at_ms": t0, "mod_revision": 1, "segment_id": 0}
    rates = {"msg_rate_in": 5.0, "byte_rate_in": 5.0, "msg_rate_out": 5.0, "byte_rate_out": 5.0}
    good = {**base, **rates, "t_ms": t0, "range_start": 0, "range_end": 0xFFFF, "changed_at_ms": t0}
    rows = [
        good,
        {**good, "t_ms": t0 + 60_000, "msg_rate_in": math.inf},
        {**good, "t_ms": t0 + 120_000, "range_start": 0x9000, "range_end": 0x8000},
        {**good, "t_ms": t0 + 180_000, "hash_buckets": [1.0, -2.0]},
        {**good, "t_ms": t0 + 240_000, "range_start": None, "range_end": None},  # no layout yet
    ]
    write_rows(tmp_path, LOADS, rows)
    (trace,) = discover([tmp_path], TraceOptions())
    assert trace.t_ms == [t0]
    assert "skipped 3 malformed load rows" in capsys.readouterr().err
    empty = tmp_path / "empty"
    write_rows(empty, LOADS, rows[1:])
    with pytest.raises(TraceError, match="no load rows with a known hash range"):
        discover([empty], TraceOptions())
    (empty / LOADS / "README.txt").write_text("not parquet", encoding="utf-8")
    with pytest.raises(TraceError, match="cannot read the recorded history"):
        discover([empty], TraceOptions())


def test_rows_that_repeat_a_time_are_counted_and_the_last_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    csv = write(tmp_path / "t.csv", "0,1\n60,2\n60,3\n60,4\n120,5\n")
    trace = import_csv(csv, TraceOptions())
    assert "2 rows repeat a later row's time" in capsys.readouterr().err
    assert trace.t_ms == [0, 60_000, 120_000]
    assert trace.rates[1][0] == 4 / 5 * trace.rates[2][0]  # the last row at 60 s, 4
    # the shadowed rows set no peak: 10 at 60 s, then 1, scales on 1's peak (4 thresholds)
    spiky = import_csv(write(tmp_path / "s.csv", "0,1\n60,10\n60,1\n120,1\n"), TraceOptions())
    assert max(r[0] for r in spiky.rates) == 4 * 10_000.0


def test_a_history_of_the_wrong_types_is_refused_naming_the_directory(tmp_path: Path) -> None:
    """pyarrow's cast errors are not all ValueErrors: one ended as an internal error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    part = tmp_path / "loads" / "topic=a%2Fb%2Fc" / "hour=2015-01-01T00"
    part.mkdir(parents=True)
    pq.write_table(pa.table({"hash_buckets": pa.array(["not a list"])}), part / "p.parquet")
    with pytest.raises(TraceError, match="cannot read the recorded history"):
        discover([tmp_path], TraceOptions())


@pytest.mark.parametrize(
    "flags",
    [
        ["--peak-over-threshold", "1e308"],
        ["--msg-bytes", "1e308"],
        [],  # with the subnormal series below: its peak is too small to scale
    ],
)
def test_a_scaling_that_overflows_is_refused_naming_the_file_and_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    """An infinite rate used to end the replay as an internal error (OverflowError)."""
    from controllerd.cli import main

    values = ("5e-324", "0", "5e-324") if not flags else ("1", "0", "2")
    csv = write(tmp_path / "s.csv", "".join(f"{60 * i},{v}\n" for i, v in enumerate(values)))
    out = tmp_path / "out"
    assert main(["backtest", "--traces", str(csv), "--out", str(out), "--no-plots", *flags]) == 2
    (said,) = capsys.readouterr().err.splitlines()
    assert said.startswith(f"controllerd: {csv}: the peak value ")
    assert "gives rates that are not finite numbers" in said
    assert "--peak-over-threshold" in said and "--msg-bytes" in said


@pytest.mark.parametrize("bad", ["null topic", "blank topic", "null revision"])
def test_history_rows_without_a_topic_or_revision_are_skipped_and_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    """A null topic or revision ended the import in a sort (TypeError); a blank topic
    became a trace named " "."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from controllerd.pipeline.history import LOADS, SCHEMAS, write_rows

    t0 = 1_420_070_400_000
    rates = {"msg_rate_in": 5.0, "byte_rate_in": 5.0, "msg_rate_out": 5.0, "byte_rate_out": 5.0}
    good = {"topic": "a/b/c", "observed_at_ms": t0, "mod_revision": 1, "segment_id": 0}
    good |= {**rates, "t_ms": t0, "range_start": 0, "range_end": 0xFFFF}
    rows = [good, {**good, "t_ms": t0 + 60_000, "mod_revision": 2}]
    if bad == "null topic":  # a file outside any topic= partition
        part = tmp_path / LOADS / "hour=2015-01-01T00"
        part.mkdir(parents=True)
        row = {k: v for k, v in good.items() if k != "topic"}
        schema = SCHEMAS[LOADS].remove(SCHEMAS[LOADS].get_field_index("topic"))
        pq.write_table(pa.Table.from_pylist([row], schema=schema), part / "p.parquet")
    elif bad == "blank topic":
        rows.append({**good, "topic": " "})
    else:
        rows.append({**good, "t_ms": t0 + 30_000, "mod_revision": None})
    write_rows(tmp_path, LOADS, rows)
    (trace,) = discover([tmp_path], TraceOptions())
    assert trace.name == "a/b/c" and trace.t_ms == [t0, t0 + 60_000]
    assert capsys.readouterr().err.splitlines() == [
        f"controllerd: {tmp_path}: skipped 1 malformed load rows"
    ]
