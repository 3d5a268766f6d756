"""``controllerd backtest`` end to end on small traces: the files other tools script against."""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import pytest

from controllerd.pipeline.cli import add_commands

REQUIRED = [
    "trace",
    "variant",
    "segment_hours",
    "seconds_above_threshold",
    "excess_load",
    "splits",
    "merges",
    "flipflops",
    "peak_segments",
]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="controllerd")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    folder = tmp_path / "traces"
    folder.mkdir()
    for name, period in (("spiky", 40), ("calm", 90)):
        with (folder / f"{name}.csv").open("w", encoding="utf-8") as fh:
            fh.write("timestamp,value\n")
            for i in range(12 * 24):
                value = 500 if i % period == 5 else 10 + 5 * math.sin(i / 3)
                fh.write(f"{1_420_070_400 + 300 * i},{value:.1f}\n")
    return folder


def test_backtest_writes_metrics_report_and_plots(tmp_path: Path, traces: Path) -> None:
    out = tmp_path / "out"
    variants = tmp_path / "v.toml"
    variants.write_text(
        '[variants.pip483]\npreset = "pip483"\n[variants.controllerd]\npreset = "controllerd"\n'
        "[variants.static-4]\nstatic_segments = 4\n",
        encoding="utf-8",
    )
    code = main(
        [
            "backtest",
            "--traces",
            str(traces),
            "--variants",
            str(variants),
            "--engine",
            "local",
            "--out",
            str(out),
            "--workers",
            "1",
            "--skew",
            "zipf:1.0:100",
            "--seed",
            "3",
            "--peak-over-threshold",
            "3",
            "--no-progress",
        ]
    )
    assert code == 0
    with (out / "metrics.csv").open(encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0])[: len(REQUIRED)] == REQUIRED
    assert [(r["trace"], r["variant"]) for r in rows] == [
        (t, v) for t in ("calm", "spiky") for v in ("pip483", "controllerd", "static-4")
    ]
    static = [r for r in rows if r["variant"] == "static-4"]
    assert all(r["splits"] == r["merges"] == "0" and r["peak_segments"] == "4" for r in static)
    report = (out / "report.md").read_text(encoding="utf-8")
    for heading in (
        "## Totals over all traces",
        "## Targets against `pip483`",
        "## Pareto front",
        "## Per trace",
    ):
        assert heading in report
    assert "zipf:1:100, seed 3" in report
    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert pngs == ["calm-peak.png", "calm.png", "pareto.png", "spiky-peak.png", "spiky.png"]
    assert (out / "plots" / "spiky.png").read_bytes()[:4] == b"\x89PNG"
    with (out / "operations.csv").open(encoding="utf-8") as fh:
        ops = list(csv.DictReader(fh))
    assert {o["action"] for o in ops} == {"split", "merge"}


def test_bad_input_exits_2_naming_the_problem(
    tmp_path: Path, traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[variants.x]\npreset = "nope"\n', encoding="utf-8")
    out = str(tmp_path / "out")
    assert main(["backtest", "--traces", str(traces), "--variants", str(bad), "--out", out]) == 2
    assert "variants.x.preset" in capsys.readouterr().err
    assert main(["backtest", "--traces", str(tmp_path / "none"), "--out", out]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["backtest", "--traces", str(traces), "--skew", "zipf", "--out", out]) == 2
    assert "zipf:S" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
