"""``controllerd backtest`` end to end on small traces: the files other tools script against."""

from __future__ import annotations

import csv
import io
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from controllerd.cli import main

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

    # With more traces than --plot-traces, the worst are replayed again for their plots;
    # the metrics do not change.
    fewer = tmp_path / "fewer"
    args = ["--variants", str(variants), "--workers", "1", "--skew", "zipf:1.0:100"]
    args += ["--seed", "3", "--peak-over-threshold", "3", "--no-progress"]
    assert (
        main(
            ["backtest", "--traces", str(traces), "--out", str(fewer), *args, "--plot-traces", "1"]
        )
        == 0
    )
    assert (fewer / "metrics.csv").read_bytes() == (out / "metrics.csv").read_bytes()
    excess = {
        t: sum(float(r["excess_load"]) for r in rows if r["trace"] == t) for t in ("calm", "spiky")
    }
    worst = max(excess, key=lambda t: excess[t])
    assert excess[worst] > min(excess.values())
    pngs = sorted(p.name for p in (fewer / "plots").glob("*.png"))
    assert pngs == sorted([f"{worst}-peak.png", f"{worst}.png", "pareto.png"])
    assert (fewer / "plots" / f"{worst}.png").read_bytes() == (
        out / "plots" / f"{worst}.png"
    ).read_bytes()
    report = (fewer / "report.md").read_text(encoding="utf-8")
    assert "- plots: 1 of 2 traces, those with the most excess load" in report


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


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-hours", "-1"], "--max-hours must be a finite number > 0"),
        (["--max-hours", "nan"], "--max-hours must be a finite number > 0"),
        (["--msg-bytes", "0"], "--msg-bytes must be a finite number > 0"),
        (["--msg-bytes", "inf"], "--msg-bytes must be a finite number > 0"),
        (["--peak-over-threshold", "inf"], "--peak-over-threshold must be a finite number"),
        (["--skew", "zipf:400"], "0 <= S <= 20"),
        (["--skew", "hotspot:0.5:1e-9"], "HOURS >= 1/60"),
        (["--skew", "hotspot:0.5:inf"], "HOURS >= 1/60"),
        (["--plot-traces", "-1"], "--plot-traces must be >= 0"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    tmp_path: Path,
    traces: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    out = str(tmp_path / "out")
    assert main(["backtest", "--traces", str(traces), "--out", out, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_an_out_that_cannot_be_written_is_refused_before_the_replay(
    tmp_path: Path, traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x", encoding="utf-8")
    for out in (str(afile), str(afile / "sub"), ""):
        assert main(["backtest", "--traces", str(traces), "--out", out, "--no-plots"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("controllerd: --out ") and len(err.splitlines()) == 1
    blocked = tmp_path / "blocked"
    (blocked / "metrics.csv").mkdir(parents=True)  # a directory where the file goes
    assert main(["backtest", "--traces", str(traces), "--out", str(blocked), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("controllerd: --out ") and "metrics.csv" in err


def test_tune_refuses_what_it_cannot_cross_validate(
    tmp_path: Path, traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grid = tmp_path / "grid.toml"
    grid.write_text(
        '[variants.c]\npreset = "controllerd"\ngrid."policy.merge_window_seconds" = [600, 3600]\n',
        encoding="utf-8",
    )
    one = str(traces / "calm.csv")
    out = str(tmp_path / "out")
    assert main(["tune", "--traces", one, "--grid", str(grid), "--out", out]) == 2
    assert "--cv loto needs at least two traces" in capsys.readouterr().err
    # --reuse: a metrics.csv with a column missing, then with a cell that is not a number
    args = ["tune", "--traces", str(traces), "--grid", str(grid), "--out", out]
    assert main([*args, "--workers", "1"]) == 0
    capsys.readouterr()
    good = (Path(out) / "metrics.csv").read_text(encoding="utf-8").splitlines()
    for name, lines, message in (
        ("cut.csv", [",".join(good[0].split(",")[:-3])], "no column"),
        ("nan.csv", [good[0], good[1].replace(good[1].split(",")[2], "nan", 1)], ":2: "),
        ("twice.csv", [good[0], good[1], good[1]], "appears twice"),
    ):
        reuse = tmp_path / name
        reuse.write_text("\n".join(lines) + "\n", encoding="utf-8")
        assert main([*args, "--reuse", str(reuse)]) == 2
        err = capsys.readouterr().err
        assert message in err and "(setting: --reuse)" in err, err


@pytest.mark.parametrize(
    ("extra", "short"),
    [
        ([], "onerow"),  # a one-row CSV next to the fixture's traces
        (["--max-hours", "0.01"], "calm"),  # 36 s of a trace sampled every 5 minutes
    ],
)
def test_time_cv_refuses_a_trace_too_short_to_cut_naming_cv(
    tmp_path: Path,
    traces: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    short: str,
) -> None:
    """It was an internal error (exit 70) from the cut, outside the --cv error handling."""
    (traces / "onerow.csv").write_text("timestamp,value\n1420070400,5\n", encoding="utf-8")
    grid = tmp_path / "grid.toml"
    grid.write_text('[variants.c]\npreset = "controllerd"\n', encoding="utf-8")
    args = ["tune", "--traces", str(traces), "--grid", str(grid), "--cv", "time:0.5"]
    assert main([*args, "--out", str(tmp_path / "out"), *extra]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"trace {short} is too short to cut at 0.5" in line and "(setting: --cv)" in line


def test_time_cv_keeps_a_trace_whose_name_ends_like_a_half(
    tmp_path: Path, traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``x@test`` cut in two is ``x@test@train``: stripping both suffixes looked up ``x``."""
    (traces / "spiky.csv").rename(traces / "x@test.csv")
    grid = tmp_path / "grid.toml"
    grid.write_text(
        '[variants.c]\npreset = "controllerd"\ngrid."policy.merge_window_seconds" = [600, 3600]\n',
        encoding="utf-8",
    )
    args = ["tune", "--traces", str(traces), "--grid", str(grid), "--cv", "time:0.5"]
    assert main([*args, "--out", str(tmp_path / "out"), "--workers", "1", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("# chosen by controllerd tune: c[")


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        # a zero replay step (division by zero) and an overflowing one: exit 70 before
        ("autoscale.interval_seconds = 1e-300", "variants.a.autoscale.interval_seconds: "),
        ("autoscale.interval_seconds = 1e300", "variants.a.autoscale.interval_seconds: "),
        ("gc.default_retention_seconds = -inf", "variants.a.gc.default_retention_seconds: "),
        # config settings the replay never reads: accepted and ignored before
        ("autoscale.consumer_settle_seconds = -5", "variants.a.autoscale.consumer_settle_seconds"),
        ("gc.interval_seconds = -1", "variants.a.gc.interval_seconds: unknown setting"),
        # grid keys that vary nothing: identical variants under different names before
        ('grid."grid.x" = [1, 2]', 'variants.a.grid."grid.x": not a setting'),
        ('grid.description = ["p", "q"]', 'variants.a.grid."description": not a setting'),
    ],
)
def test_a_variant_setting_the_replay_cannot_honour_exits_2_naming_it(
    tmp_path: Path, traces: Path, capsys: pytest.CaptureFixture[str], toml: str, key: str
) -> None:
    variants = tmp_path / "v.toml"
    variants.write_text(f'[variants.a]\npreset = "controllerd"\n{toml}\n', encoding="utf-8")
    out = tmp_path / "out"
    args = ["backtest", "--traces", str(traces), "--variants", str(variants), "--out", str(out)]
    assert main([*args, "--workers", "1", "--no-plots", "--no-progress"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert key in line and line.endswith("(setting: --variants)"), line
    assert not out.exists()


def test_tune_reuses_its_own_metrics_for_traces_named_like_numbers_or_na(
    tmp_path: Path, traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """pandas read trace ``1`` as an integer and ``NA`` as missing, so no row matched."""
    (traces / "spiky.csv").rename(traces / "1.csv")
    (traces / "calm.csv").rename(traces / "NA.csv")
    grid = tmp_path / "grid.toml"
    grid.write_text(
        '[variants.c]\npreset = "controllerd"\ngrid."policy.merge_window_seconds" = [600, 3600]\n',
        encoding="utf-8",
    )
    args = ["tune", "--traces", str(traces), "--grid", str(grid), "--no-progress"]
    first = tmp_path / "first"
    assert main([*args, "--out", str(first), "--workers", "1"]) == 0
    chosen = capsys.readouterr().out
    reuse = ["--reuse", str(first / "metrics.csv")]
    assert main([*args, "--out", str(tmp_path / "again"), *reuse]) == 0
    assert capsys.readouterr().out == chosen


@pytest.mark.parametrize("operations", ["2.5", "1e+300"])
def test_reuse_refuses_a_count_that_is_not_a_whole_number(
    tmp_path: Path, traces: Path, capsys: pytest.CaptureFixture[str], operations: str
) -> None:
    from controllerd.pipeline.simulate import METRIC_COLUMNS

    row = {c: "1" for c in METRIC_COLUMNS} | {"operations": operations}
    reuse = tmp_path / "metrics.csv"
    reuse.write_text(
        ",".join(["trace", "variant", *row]) + "\n" + ",".join(["calm", "pip483", *row.values()]),
        encoding="utf-8",
    )
    grid = tmp_path / "grid.toml"
    grid.write_text('[variants.c]\npreset = "controllerd"\n', encoding="utf-8")
    args = ["tune", "--traces", str(traces), "--grid", str(grid), "--reuse", str(reuse)]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f":2: operations {operations}" in line and "is not a whole number" in line, line


# --- the console command, as an operator runs it --------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
BLOCKER = '''
"""Test helper: make the modules named in $CONTROLLERD_TEST_BLOCK unimportable."""
import importlib.abc
import os
import sys

BLOCKED = set(filter(None, os.environ.get("CONTROLLERD_TEST_BLOCK", "").split(",")))


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Block())
'''


def console(
    args: list[str], tmp_path: Path, block: str = "", timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``controllerd ARGS`` in a fresh interpreter, optionally without some modules."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER, encoding="utf-8")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "CONTROLLERD_TEST_BLOCK": block,
    }
    return subprocess.run(
        [sys.executable, "-m", "controllerd.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize(
    ("block", "command"),
    [
        ("pyspark", ["backtest", "--engine", "spark"]),
        ("pandas", ["backtest"]),
        ("pyspark", ["tune", "--engine", "spark", "--grid", "GRID"]),
        ("matplotlib", ["backtest"]),
    ],
)
def test_without_the_spark_extra_a_command_says_how_to_install_it(
    tmp_path: Path, traces: Path, block: str, command: list[str]
) -> None:
    grid = tmp_path / "grid.toml"
    grid.write_text('[variants.c]\npreset = "controllerd"\n', encoding="utf-8")
    args = [a if a != "GRID" else str(grid) for a in command]
    proc = console(
        [*args, "--traces", str(traces), "--out", str(tmp_path / "out"), "--workers", "1"],
        tmp_path,
        block=block,
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert (
        line == "controllerd: this command needs the spark extra: pip install 'controllerd[spark]'"
    )


def test_record_without_pyarrow_says_how_to_install_it(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[etcd]\nendpoints = ["http://127.0.0.1:1"]\n', encoding="utf-8")
    proc = console(
        ["record", "--config", str(config), "--out", str(tmp_path / "h"), "--duration", "1"],
        tmp_path,
        block="pyarrow",
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "controllerd: this command needs the spark extra: pip install 'controllerd[spark]'"
    ]


def test_record_fails_naming_the_setting_when_etcd_is_unreachable(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "c.toml"
    config.write_text(
        f'[etcd]\nendpoints = ["http://127.0.0.1:{port}"]\ntimeout_seconds = 1\n',
        encoding="utf-8",
    )
    out = tmp_path / "history"
    proc = console(
        ["record", "--config", str(config), "--out", str(out), "--duration", "1"], tmp_path
    )
    assert proc.returncode == 3, proc.stderr  # EXIT_UNAVAILABLE, not 0 with nothing recorded
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"controllerd: etcd at http://127.0.0.1:{port} is unreachable")
    assert line.endswith("(setting: etcd.endpoints)")
    assert not (out / "loads").exists()


def test_progress_is_a_line_per_group_when_stderr_is_not_a_terminal(
    tmp_path: Path, traces: Path
) -> None:
    proc = console(
        [
            "backtest",
            "--traces",
            str(traces),
            "--out",
            str(tmp_path / "out"),
            "--workers",
            "1",
            "--no-plots",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    # 2 traces x the 3 default variants: one line each, counting up.
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == [f"{i}/6" for i in range(1, 7)]
    assert all(
        line.startswith("controllerd backtest: ") and "groups done" in line for line in lines
    )


def test_record_names_a_file_the_config_names_not_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing etcd.ca_file was reported as '--out ...: cannot write /nonexistent/ca.pem'."""
    config = tmp_path / "c.toml"
    config.write_text(f'[etcd]\nca_file = "{tmp_path / "missing.pem"}"\n', encoding="utf-8")
    out = tmp_path / "h"
    assert main(["record", "--config", str(config), "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "etcd.ca_file: cannot read" in line and "--out" not in line
    assert not out.exists()


def test_a_spark_backtest_lists_each_recorded_history_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listing a history reads every file name under it (on a cluster, its storage):
    ``backtest`` lists it once and hands the topics to both replays (the second replays
    only the traces it plots). The engine here is the local one behind Spark's seam;
    the real Spark path is ``test_pipeline_engines`` and the cluster test."""
    from controllerd.pipeline import engines
    from controllerd.pipeline.history import LOADS, write_rows
    from controllerd.pipeline.traces import TraceOptions, discover

    history = tmp_path / "history"
    rates = {"byte_rate_in": 1e5, "msg_rate_out": 100.0, "byte_rate_out": 1e5}
    rows = [
        {
            "topic": topic,
            "observed_at_ms": 1_420_070_400_000 + 60_000 * i,
            "t_ms": 1_420_070_400_000 + 60_000 * i,
            "mod_revision": i,
            "segment_id": 0,
            "range_start": 0,
            "range_end": 0xFFFF,
            "changed_at_ms": 1_420_070_400_000,
            "msg_rate_in": (16_000.0 if (i // 30) % 2 else 200.0) * scale,
            **rates,
        }
        for topic, scale in (("t/n/a", 1.0), ("t/n/b", 2.0))
        for i in range(120)
    ]
    write_rows(history, LOADS, rows)
    listings: list[str] = []
    calls: list[dict[str, object]] = []

    class Session:
        def stop(self) -> None:
            pass

    def run(engine: str, traces: object, variants: list[Any], options: Any, **kw: Any) -> Any:
        calls.append(kw)
        found = discover([history], TraceOptions())
        wanted = [t for t in found if kw["topics"] is None or t.name in kw["topics"]]
        return engines.run_local(wanted, variants, options, workers=1)

    def listing(_: object, root: str) -> set[str]:
        listings.append(root)
        return {"t/n/a", "t/n/b"}

    monkeypatch.setattr(engines, "spark_session", lambda *_: Session())
    monkeypatch.setattr(engines, "ship_code", lambda _: "zip")
    monkeypatch.setattr(engines, "history_topics", listing)
    monkeypatch.setattr(engines, "run", run)
    argv = ["backtest", "--engine", "spark", "--traces", str(history), "--no-progress"]
    assert main([*argv, "--plot-traces", "1", "--out", str(tmp_path / "out")]) == 0
    assert listings == [str(history.resolve())]
    assert [c["topics"] for c in calls] == [None, ["t/n/b"]]
    assert all(c["listed"] == {"t/n/a", "t/n/b"} for c in calls)


@pytest.mark.parametrize(
    ("command", "option"),
    [("backtest", "--variants"), ("tune", "--grid")],
    ids=["backtest", "tune"],
)
@pytest.mark.parametrize(
    "body",
    [
        "policy.max_segments = " + "9" * 5000,  # int('9' * 5000) raises ValueError
        "x = " + "[" * 5000 + "]" * 5000,  # the parser's RecursionError
        "policy.merge_window_seconds = 1" + "0" * 400,  # float(value): OverflowError
    ],
    ids=["huge-integer", "deep-nesting", "float-overflow"],
)
def test_a_variants_file_the_parser_chokes_on_exits_2_naming_file_and_option(
    tmp_path: Path,
    traces: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    option: str,
    body: str,
) -> None:
    """Each was an internal error (exit 70)."""
    variants = tmp_path / "v.toml"
    variants.write_text(f"[variants.a]\n{body}\n", encoding="utf-8")
    out = str(tmp_path / "out")
    assert main([command, "--traces", str(traces), option, str(variants), "--out", out]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"controllerd: {variants}: ") and line.endswith(f"(setting: {option})")
    assert "internal error" not in line and line.count(str(variants)) == 1


@pytest.mark.parametrize(
    ("command", "option"),
    [("backtest", "--variants"), ("tune", "--grid")],
    ids=["backtest", "tune"],
)
def test_an_unreadable_variants_file_is_named_once(
    tmp_path: Path, traces: Path, capsys: pytest.CaptureFixture[str], command: str, option: str
) -> None:
    """It read 'nope.toml: nope.toml: cannot read: [Errno 2] ...'."""
    missing = tmp_path / "nope.toml"
    out = str(tmp_path / "out")
    assert main([command, "--traces", str(traces), option, str(missing), "--out", out]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"controllerd: {missing}: cannot read: No such file or directory (setting: {option})"
    ]


def test_traces_that_name_a_device_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``/dev/null`` was 'no such file or directory'."""
    assert main(["backtest", "--traces", "/dev/null", "--out", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("controllerd: /dev/null: not a regular file or a directory"), line


def test_record_names_an_unreadable_config_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It read 'nope.toml: nope.toml: cannot read config file: ...'."""
    missing = tmp_path / "nope.toml"
    assert main(["record", "--config", str(missing), "--out", str(tmp_path / "h")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"controllerd: {missing}: cannot read config file: No such file or directory "
        "(setting: --config)"
    ]


@pytest.mark.parametrize(
    ("stdin", "message"),
    [
        ('[etcd]\nca_file = "/nonexistent/ca.pem"\n', "<stdin>: etcd.ca_file: cannot read"),
        ("[etcd]\ntimeout_seconds = -1\n", "<stdin>: etcd.timeout_seconds: must be > 0"),
        ("# nothing\n", "<stdin>: config file is empty"),
    ],
    ids=["read-and-checked", "invalid", "empty"],
)
def test_record_reads_its_config_from_stdin_given_dash(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    stdin: str,
    message: str,
) -> None:
    """As check-config and status take ``-``; it was '-: -: cannot read config file'."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8"))))
    out = tmp_path / "h"
    assert main(["record", "--config", "-", "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"controllerd: {message}") and line.endswith("(setting: --config)")
    assert not out.exists()
