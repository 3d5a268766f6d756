"""``controllerd tune``: the choice, the cross-validation folds, the TOML it prints."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Final

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controllerd import config
from controllerd.cli import main as run_cli
from controllerd.pipeline.load import Trace
from controllerd.pipeline.tune import (
    SUMMED,
    AllBut,
    Sums,
    choose,
    cross_validate,
    folds_for,
    render,
    score,
    split_in_time,
    toml_snippet,
)
from controllerd.pipeline.variants import Variant, controllerd, default_variants
from tests.support.shared import ROOT, traces_dir

T0: Final = 1_420_070_400_000


def metrics(rows: list[tuple[str, str, float, float, int, int]]) -> pd.DataFrame:
    """(trace, variant, segment_hours, excess_load, operations, flipflops) rows."""
    return pd.DataFrame(
        [
            {
                "trace": t,
                "variant": v,
                "segment_hours": sh,
                "excess_load": ex,
                "operations": ops,
                "flipflops": ff,
            }
            for t, v, sh, ex, ops, ff in rows
        ]
    )


def test_slack_is_zero_at_each_target_and_one_at_its_best() -> None:
    m = metrics(
        [
            ("a", "pip483", 100.0, 1000.0, 101, 40),
            ("a", "bar", 125.0, 500.0, 100, 2),
            ("a", "best", 100.0, 0.0, 49, 0),
        ]
    )
    bar = score(m, "bar", ["a"])
    assert bar.slack == pytest.approx(
        {"excess": 0.0, "cost": 0.0, "operations": 0.0, "flipflops": 0.0}
    )
    assert bar.all_met
    best = score(m, "best", ["a"])
    assert best.slack == pytest.approx(
        {"excess": 1.0, "cost": 1.0, "operations": 1.0, "flipflops": 1.0}
    )
    same_ops = score(metrics([("a", "pip483", 1, 1, 5, 0), ("a", "x", 1, 0, 5, 0)]), "x", ["a"])
    assert not same_ops.met["operations"]  # "fewer" is strict


def test_the_choice_maximises_the_smallest_slack_per_trace_set() -> None:
    rows = []
    for trace, group in (("n1", "nab"), ("n2", "nab"), ("w1", "aws")):
        big = 10 if group == "nab" else 1
        rows.append((trace, "pip483", 100.0 * big, 1000.0 * big, 100 * big, 40 * big))
        # "pooled" shines on the big set and misses the cost bar on the small one;
        # "even" meets every bar on both sets with a margin.
        cost = 101.0 if group == "nab" else 140.0
        rows.append((trace, "pooled", cost * big, 10.0 * big, 50 * big, 0))
        rows.append((trace, "even", 110.0 * big, 300.0 * big, 70 * big, 1))
    m = metrics(rows)
    traces = ["n1", "n2", "w1"]
    assert choose(m, ["pooled", "even"], traces).variant == "pooled"  # pooled totals hide aws
    groups = {"n1": "nab", "n2": "nab", "w1": "aws"}
    assert choose(m, ["pooled", "even"], traces, groups=groups).variant == "even"


def test_cross_validation_scores_each_choice_on_what_it_did_not_see() -> None:
    rows = []
    for trace in ("a", "b", "c"):
        rows.append((trace, "pip483", 100.0, 1000.0, 100, 40))
        rows.append((trace, "fits-c", 100.0, 900.0 if trace != "c" else 0.0, 90, 0))
        rows.append((trace, "steady", 110.0, 400.0, 80, 0))
    m = metrics(rows)
    names = ["a", "b", "c"]
    folds = folds_for(
        "loto", [Trace(n, "series", [0], [0], [1], [(0, 0, 0, 0)]) for n in names], {}
    )
    assert [(tuple(f.train), tuple(f.test)) for f in folds] == [
        (("b", "c"), ("a",)),
        (("a", "c"), ("b",)),
        (("a", "b"), ("c",)),
    ]
    result = cross_validate(m, ["fits-c", "steady"], folds, names)
    assert [f.chosen for f in result.folds] == ["steady", "steady", "steady"]
    assert result.pooled.excess_cut == pytest.approx(0.6)
    assert result.final.variant == "steady"


finite = st.floats(0.0, 1e18, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.tuples(finite, finite, st.integers(0, 10**6)), min_size=1, max_size=12),
    chosen=st.lists(st.booleans(), min_size=12, max_size=12),
    left_out=st.sets(st.integers(0, 11), max_size=4),
)
def test_sums_over_any_set_are_the_exact_sums(
    values: list[tuple[float, float, int]], chosen: list[bool], left_out: set[int]
) -> None:
    """Whatever way a set is picked (its traces, every trace but a few, one trace set,
    a superset minus the rest), its totals are the correctly rounded exact sums: fsum."""
    names = [f"t{i}" for i in range(len(values))]
    groups = {n: "ab"[i % 2] for i, n in enumerate(names)}
    m = metrics(
        [(n, "v", sh, ex, ops, ops % 7) for n, (sh, ex, ops) in zip(names, values, strict=True)]
    )
    sums = Sums(m, groups)

    def exact(members: list[str]) -> dict[str, float]:
        rows = m[m["trace"].isin(members)]
        return {k: math.fsum(float(x) for x in rows[k]) for k in SUMMED}

    some = [n for n, keep in zip(names, chosen, strict=False) if keep]
    assert sums.totals("v", sums.pick(some)) == exact(some)
    out = {names[i] for i in left_out if i < len(names)}
    rest = AllBut(names, frozenset(names), out)
    assert list(rest) == [n for n in names if n not in out] and len(rest) == len(names) - len(out)
    assert sums.totals("v", sums.pick(rest)) == exact(list(rest))
    for g in sums.groups(rest):
        members = [n for n in rest if groups[n] == g]
        assert sums.totals("v", sums.pick(rest, g)) == exact(members)
        assert sums.totals("v", sums.pick(members, g)) == exact(members)
    assert sums.totals("nobody", sums.pick(some)) == dict.fromkeys(SUMMED, 0.0)


def test_candidates_equal_on_the_training_traces_tie_exactly() -> None:
    """Chosen on nab, two candidates equal there tie (the earlier wins) however much they
    differ on the held-out set: nab's totals are every trace's minus aws', which in
    floats would not cancel (1e17 + 0.1 - 1e17 is 0)."""
    rows = []
    for trace in ("n1", "n2", "n3"):
        rows.append((trace, "pip483", 100.0, 1000.0, 100, 40))
        rows += [(trace, v, 110.1, 0.1, 60, 0) for v in ("x", "y")]
    for trace, big in (("w1", 1e17), ("w2", 3e16)):
        rows.append((trace, "pip483", 100.0, 1000.0, 100, 40))
        rows += [(trace, "x", 0.3, 7.0, 1, 0), (trace, "y", big, big, 90, 3)]
    m = metrics(rows)
    groups = {"n1": "nab", "n2": "nab", "n3": "nab", "w1": "aws", "w2": "aws"}
    traces = [Trace(n, "series", [0], [0], [1], [(0, 0, 0, 0)]) for n in groups]
    folds = folds_for("group", traces, groups)
    result = cross_validate(m, ["y", "x"], folds, list(groups), groups=groups)
    assert [(f.fold.name, f.chosen) for f in result.folds] == [("nab", "x"), ("aws", "y")]
    assert result.folds[1].in_sample.cost_ratio == pytest.approx(1.101)


def test_a_fleet_s_folds_are_counted_by_choice_not_listed() -> None:
    rows = []
    names = [f"t{i:02}" for i in range(60)]
    for i, trace in enumerate(names):
        rows.append((trace, "pip483", 100.0, 1000.0, 100, 40))
        rows.append((trace, "steady", 110.0, 400.0, 80, 0))
        rows.append((trace, "lucky", 100.0, 0.0 if i else 990_000.0, 60, 0))
    m = metrics(rows)
    folds = folds_for(
        "loto", [Trace(n, "series", [0], [0], [1], [(0, 0, 0, 0)]) for n in names], {}
    )
    result = cross_validate(m, ["lucky", "steady"], folds, names)
    assert [f.chosen for f in result.folds] == ["lucky"] + ["steady"] * 59
    text = render(result, {"command": "x"}, "[policy]\n")
    assert "60 folds; how many chose each candidate:" in text
    assert "| `steady` | 59 |" in text and "| `lucky` | 1 |" in text
    assert "| t00 |" not in text


def test_time_cv_cuts_every_trace_in_two() -> None:
    trace = Trace("t", "series", [T0 + i * 60_000 for i in range(10)], [0] * 10, [9] * 10,
                  [(float(i), 0.0, 0.0, 0.0) for i in range(10)])  # fmt: skip
    first, second = split_in_time([trace], 0.5)
    assert (first.name, second.name) == ("t@train", "t@test")
    assert len(first.t_ms) + len(second.t_ms) == 10
    assert max(first.t_ms) < min(second.t_ms)


def test_the_training_part_is_scaled_by_its_own_peak_and_the_test_part_alike() -> None:
    """Both parts were cut from a series scaled by its whole peak: a spike in the test
    part flattened the training part, so what was chosen depended on held-out data."""

    def cut(tail: list[float]) -> tuple[Trace, Trace]:
        values = [10.0, 50.0, 100.0, 20.0, *tail]
        factor = 40_000.0 / max(values)  # scaled as traces.series_trace does, peak 4x
        rates = [(v * factor, v * factor * 2, v * factor, v * factor * 2) for v in values]
        t_ms = [T0 + i * 300_000 for i in range(len(values))]
        first, second = split_in_time([Trace("t", "series", t_ms, [0] * 8, [9] * 8, rates)], 0.45)
        return first, second

    for tail in ([10.0, 20.0, 30.0, 100.0], [10.0, 20.0, 30.0, 1000.0]):
        train, test = cut(tail)
        assert [r[0] for r in train.rates] == pytest.approx([4000, 20000, 40000, 8000])
        assert test.rates[-1][0] == pytest.approx(400 * tail[-1])  # the training scale
        assert train.rates[1][1] == pytest.approx(2 * train.rates[1][0])


@pytest.mark.parametrize(
    ("base_ops", "ops", "slack"),
    [(4, 2, 1.0), (4, 3, 0.0), (10, 5, 1.0), (10, 7, 0.5), (1, 0, 1.0), (2, 1, 1.0), (2, 2, -1.0)],
)
def test_operations_slack_is_one_at_half_the_baseline_whatever_its_size(
    base_ops: int, ops: int, slack: float
) -> None:
    """It was 1 - 2/base at half (0.5 for a baseline of 4), which could flip a choice,
    and zero operations against a baseline of 1 scored as just at the bar."""
    m = metrics([("a", "pip483", 1.0, 1.0, base_ops, 0), ("a", "x", 1.0, 0.0, ops, 0)])
    assert score(m, "x", ["a"]).slack["operations"] == pytest.approx(slack)


def test_the_snippet_is_valid_policy_toml_with_only_what_differs() -> None:
    base = controllerd()
    tuned = dataclasses.replace(
        base,
        policy=dataclasses.replace(
            base.policy,
            merge_window_seconds=3600.0,
            range_split_cooldown=not base.policy.range_split_cooldown,
            merge_combined_max_ratio=math.inf,
            merge_thresholds=dataclasses.replace(base.policy.merge_thresholds, msg_rate_in=2e3),
        ),
    )
    text = toml_snippet(Variant("x", tuned))
    loaded = config.load(text)
    assert loaded.policy == tuned.policy
    assert "merge_window_seconds = 3600.0" in text and "max_segments" not in text
    assert "(the shipped defaults)" in toml_snippet(Variant("d", base))


def test_the_snippet_keeps_every_setting_the_choice_depends_on() -> None:
    """A static-8 choice used to read as plain `enabled = false`, and a grid over the
    tick or the retention lost them: the snippet said less than was measured."""
    base = controllerd()
    ticked = dataclasses.replace(base, interval_seconds=30.0, gc_retention_seconds=3600.0)
    loaded = config.load(toml_snippet(Variant("t", ticked)))
    assert loaded.autoscale.interval_seconds == 30.0
    assert loaded.gc.default_retention_seconds == 3600.0
    (static8,) = [v for v in default_variants() if v.name == "static-8"]
    text = toml_snippet(static8)
    assert "create it with 8 segment(s)" in text
    assert config.load(text).policy.enabled is False


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    folder = tmp_path / "traces"
    folder.mkdir()
    for name, period in (("spiky", 23), ("calm", 61), ("waves", 41)):
        with (folder / f"{name}.csv").open("w", encoding="utf-8") as fh:
            fh.write("timestamp,value\n")
            for i in range(12 * 48):
                value = 500 if i % period < 3 else 10 + 5 * math.sin(i / 3)
                fh.write(f"{1_420_070_400 + 300 * i},{value:.1f}\n")
    return folder


def test_tune_end_to_end_prints_toml_and_reuses_its_metrics(
    tmp_path: Path, traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grid = tmp_path / "grid.toml"
    grid.write_text(
        '[variants.c]\npreset = "controllerd"\n'
        'grid."policy.merge_window_seconds" = [600, 7200]\n'
        'grid."policy.merge_backoff_factor" = [1.0, 2.0]\n',
        encoding="utf-8",
    )
    out = tmp_path / "out"
    common = ["tune", "--traces", str(traces), "--grid", str(grid), "--no-progress"]
    assert run_cli([*common, "--out", str(out), "--workers", "1"]) == 0
    first = capsys.readouterr()
    assert first.out.startswith("# chosen by controllerd tune: c[")
    assert "[policy]" in first.out and "out of sample (loto, 3 traces)" in first.err
    config.load(first.out)  # the snippet is a valid config
    report = (out / "tune.md").read_text(encoding="utf-8")
    for heading in ("## Folds", "## Out of sample, pooled", "## Chosen on all traces"):
        assert heading in report
    assert report.count("| spiky |") + report.count("| calm |") + report.count("| waves |") == 3
    rows = pd.read_csv(out / "metrics.csv")
    assert len(rows) == 3 * 5  # 3 traces x (pip483 + 4 candidates)
    # Choosing again from the same metrics gives the same answer, without replaying.
    again = tmp_path / "again"
    reuse = [*common, "--out", str(again), "--reuse", str(out / "metrics.csv")]
    assert run_cli(reuse) == 0
    assert capsys.readouterr().out == first.out
    # ... and refuses metrics that lack a candidate.
    rows[rows["variant"] != rows["variant"].iloc[-1]].to_csv(tmp_path / "short.csv", index=False)
    bad = [*common, "--out", str(again), "--reuse", str(tmp_path / "short.csv")]
    assert run_cli(bad) == 2
    assert "(setting: --reuse)" in capsys.readouterr().err


def test_tune_rejects_a_bad_cross_validation(
    tmp_path: Path, traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grid = tmp_path / "grid.toml"
    grid.write_text('[variants.c]\npreset = "controllerd"\n', encoding="utf-8")
    for cv in ("time:1.5", "kfold", "group", "loto:", "group:x"):
        code = run_cli(
            ["tune", "--traces", str(traces), "--grid", str(grid), "--cv", cv,
             "--out", str(tmp_path / "o")]
        )  # fmt: skip
        assert code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("controllerd: ") and "--cv" in line


def test_the_shipped_grid_chooses_the_shipped_defaults_and_holds_out_of_sample(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What docs/backtest.md reports, on the shared traces: ``tune`` on
    examples/tune-grid.toml picks the shipped ``[policy]`` defaults; every trace
    held out in turn meets every target per set; and settings chosen on nab
    alone meet every target on aws (chosen on aws alone, nab's operations miss)."""
    shared = traces_dir()
    common = ["tune", "--traces", str(shared / "nab"), str(shared / "aws"), "--grid",
              str(ROOT / "examples" / "tune-grid.toml"), "--no-progress"]  # fmt: skip
    loto, group = tmp_path / "loto", tmp_path / "group"
    assert run_cli([*common, "--out", str(loto)]) == 0
    assert "# (the shipped defaults)" in capsys.readouterr().out
    reuse = ["--reuse", str(loto / "metrics.csv"), "--cv", "group", "--out", str(group)]
    assert run_cli([*common, *reuse]) == 0
    capsys.readouterr()

    def per_set(out: Path, name: str, count: int) -> str:
        report = (out / "tune.md").read_text(encoding="utf-8").splitlines()
        (row,) = [r for r in report if r.startswith(f"| {name} | {count} |")]
        return row

    assert per_set(loto, "nab", 8).endswith("| **yes** |")
    assert per_set(loto, "aws", 5).endswith("| **yes** |")
    assert per_set(group, "aws", 5).endswith("| **yes** |")
    assert "vs 818 ❌" in per_set(group, "nab", 8)


def test_two_traces_paths_of_one_name_are_two_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--traces x1 y/x1 --cv group`` keyed both by ``x1``: one set, not two folds."""
    monkeypatch.chdir(tmp_path)
    for folder, name in (("x1", "a"), ("y/x1", "b"), ("x2", "c")):
        (tmp_path / folder).mkdir(parents=True)
        rows = "".join(
            f"{1_420_070_400 + 300 * i},{500 if i % 17 < 2 else 10}\n" for i in range(48)
        )
        (tmp_path / folder / f"{name}.csv").write_text(rows, encoding="utf-8")
    grid = tmp_path / "grid.toml"
    grid.write_text('[variants.c]\npreset = "controllerd"\n', encoding="utf-8")
    argv = ["tune", "--traces", "x1", "y/x1", "x2", "--grid", str(grid), "--cv", "group"]
    assert run_cli([*argv, "--out", "out", "--workers", "1", "--no-progress"]) == 0
    capsys.readouterr()
    report = (tmp_path / "out" / "tune.md").read_text(encoding="utf-8")
    for held_out in (f"{tmp_path.name}/x1", "y/x1", "x2"):  # x2's name needs no parent
        assert f"| {held_out} | `c` |" in report, report


def test_a_set_is_named_by_as_little_of_its_path_as_tells_it_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controllerd.pipeline.cli import set_names

    monkeypatch.chdir(tmp_path)
    assert set_names(["nab", "data/aws/"]) == ["nab", "aws"]  # as before: the last part
    assert set_names(["a/b/x1", "c/b/x1", "x1", "x2"]) == [
        "a/b/x1",
        "c/b/x1",
        f"{tmp_path.name}/x1",
        "x2",
    ]
