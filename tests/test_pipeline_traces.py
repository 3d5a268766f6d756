"""Trace importers: NAB-style CSV series scaled to the split threshold; skew parsing."""

from __future__ import annotations

import datetime as dt
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
    ("text", "message"),
    [
        ("timestamp,value\n", "no rows"),
        ("2015-01-01 00:00:00,x\n2015-01-01 00:05:00,1\n", ":1:"),
        ("2015-01-01 00:00:00\n", "expected timestamp,value"),
        ("0,0\n60,0\n", "all values are zero"),
        ("0,-1\n", "negative"),
    ],
)
def test_bad_csv_is_refused_with_the_file_and_row(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        import_csv(write(tmp_path / "bad.csv", text), TraceOptions())


def test_discover_reads_a_directory_and_refuses_duplicate_names(tmp_path: Path) -> None:
    write(tmp_path / "a.csv", "0,1\n60,2\n")
    write(tmp_path / "b.csv", "0,1\n60,2\n")
    assert [t.name for t in discover([tmp_path], TraceOptions())] == ["a", "b"]
    with pytest.raises(TraceError, match="repeated: a"):
        discover([tmp_path, tmp_path / "a.csv"], TraceOptions())
    with pytest.raises(TraceError, match="no such file"):
        discover([tmp_path / "missing"], TraceOptions())


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
