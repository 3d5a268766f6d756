"""The backtest's plots, rendered and read back as matplotlib objects, and its report."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any, Final

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controllerd.pipeline.report import (
    DAY_MS,
    REPORT_TRACES,
    _cut,
    _file_stems,
    daily,
    pareto_figure,
    pareto_front,
    pct_change,
    render_report,
    trace_figure,
    verdicts,
    worst_traces,
)
from controllerd.pipeline.simulate import (
    RISE_FROM,
    RISE_MS,
    Measure,
    RunArrays,
    Timeline,
    Totals,
    _Runs,
    downsample,
)

T0: Final = 1_420_070_400_000
MINUTE: Final = 60_000


def timeline(days: float, phase: int = 0) -> Timeline:
    n = int(days * 24 * 60 / 5)
    load = [0.2 + 3.5 * ((i + phase) % 288 > 200) for i in range(n)]
    segs = [1 + 3 * ((i + phase) % 288 > 205) for i in range(n)]
    return Timeline(
        [T0 + i * 5 * MINUTE for i in range(n)],
        load,
        [x / s for x, s in zip(load, segs, strict=True)],
        segs,
        [float(s) for s in segs],
    )


def legend_texts(fig: Any) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


@pytest.mark.parametrize("days", [2, 60])
def test_trace_plots_name_every_line_share_scales_and_say_the_time_zone(
    days: int, tmp_path: Path
) -> None:
    rows = [("pip483", timeline(days)), ("controllerd", timeline(days, 7))]
    fig = trace_figure("t", rows)
    panels = [ax for ax in fig.axes if ax.get_ylabel() == "load / threshold"]
    twins = [ax for ax in fig.axes if ax.get_ylabel() == "segments"]
    assert len(panels) == len(twins) == 2
    assert [ax.get_title(loc="left") for ax in panels] == ["pip483", "controllerd"]
    assert panels[0].get_shared_y_axes().joined(panels[0], panels[1])
    assert twins[0].get_shared_y_axes().joined(twins[0], twins[1])
    assert panels[0].get_ylim() == panels[1].get_ylim()
    assert twins[0].get_ylim() == twins[1].get_ylim()
    assert "UTC" in panels[-1].get_xlabel()
    texts = legend_texts(fig)
    for name in ("topic load", "hottest segment", "split threshold", "active segments"):
        assert any(t.startswith(name) for t in texts), (name, texts)
    # Every line drawn on a panel has its entry in the legend (by colour and style).
    entries = {
        (h.get_color(), h.get_linestyle()) for leg in fig.legends for h in leg.legend_handles
    }
    for ax in [*panels, *twins]:
        for line in ax.get_lines():
            assert (line.get_color(), line.get_linestyle()) in entries
    drawn = max(len(line.get_xdata()) for line in panels[0].get_lines())
    if days > 14:  # long traces are daily aggregates, not thousands of points
        assert "per day" in panels[-1].get_xlabel() and drawn <= days + 2
        assert any("daily mean" in t for t in texts)
    else:
        assert drawn == len(rows[0][1].t_ms)
    fig.savefig(tmp_path / "t.png", dpi=40)
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_daily_aggregates_keep_maxima_and_average_the_segments() -> None:
    tl = timeline(3)
    day = daily(tl)
    assert len(day.t_ms) == 3 and all(t % DAY_MS == 0 for t in day.t_ms)
    assert day.load == [3.7, 3.7, 3.7] and day.segments == [4, 4, 4]
    assert day.segments_mean[0] == pytest.approx(sum(tl.segments[:288]) / 288)


def test_pareto_plot_has_no_text_to_overlap_and_names_every_variant() -> None:
    points = {f"variant-{i}": (1000.0 + i, 500.0 - i) for i in range(8)}
    points["same-a"] = points["same-b"] = (2000.0, 0.0)
    front = pareto_front(points)
    fig = pareto_figure(points, front)
    (ax,) = fig.axes
    assert not ax.texts  # names live in the legend only
    texts = legend_texts(fig)
    for name in points:
        assert any(t.startswith(name + ":") for t in texts)
    assert "Pareto front" in texts
    assert ax.get_yscale() == "symlog"
    assert ax.get_xlabel() and ax.get_ylabel()


def expand(runs: _Runs, step_ms: int) -> Timeline:
    """The runs as one entry per step, plainly."""
    ts: list[int] = []
    load: list[float] = []
    hot: list[float] = []
    segs: list[int] = []
    for t, count, m in zip(runs.t, runs.count, runs.measures, strict=True):
        ts.extend(range(t, t + count * step_ms, step_ms))
        load.extend([m[5]] * count)
        hot.extend([m[4]] * count)
        segs.extend([m[0]] * count)
    return Timeline(ts, load, hot, segs, [float(n) for n in segs])


def totals_by_loop(runs: _Runs) -> Totals:
    """What RunArrays.totals computes, as one plain loop over the runs (its oracle)."""
    steps = segment_steps = above_steps = topic_above = spell = longest = max_n = 0
    excess = msgs = late = 0.0
    for count, (n, above, step_excess, step_msgs, hottest, _) in zip(
        runs.count, runs.measures, strict=True
    ):
        steps += count
        segment_steps += n * count
        above_steps += above * count
        excess += step_excess * count
        msgs += step_msgs * count
        max_n = max(max_n, n)
        if hottest > 1.0:
            topic_above += count
            late += step_excess * (count if spell > 0 else count - 1)
            spell += count
            longest = max(longest, spell)
        else:
            spell = 0
    return Totals(
        steps, segment_steps, above_steps, topic_above, longest, max_n, excess, msgs, late
    )


def centre_by_loop(runs: _Runs, step_ms: int) -> int:
    """RunArrays.centre as a sliding minimum over a monotonic deque (its oracle)."""
    window: deque[tuple[int, float]] = deque()  # (end of run, load), loads increasing
    best_rise, best_t = 0.0, -1
    for t, count, m in zip(runs.t, runs.count, runs.measures, strict=True):
        while window and window[0][0] <= t - RISE_MS:
            window.popleft()
        if window and window[0][1] < RISE_FROM and m[5] - window[0][1] > best_rise:
            best_rise, best_t = m[5] - window[0][1], t
        while window and window[-1][1] >= m[5]:
            window.pop()
        window.append((t + count * step_ms, m[5]))
    return best_t if best_t >= 0 else runs.t[0]


def runs_of(rows: list[tuple[int, int, int, float, float, float]], step_ms: int) -> _Runs:
    """A replay's rows, one per visit (RunArrays.of merges equal neighbours)."""
    r = _Runs()
    t = T0
    for count, segments, above, excess, hottest, load in rows:
        measure: Measure = (segments, above, excess, excess * 7.5, hottest, load)
        r.add(t, measure)
        t += count * step_ms
    r.close(t, step_ms)
    return r


def merged(rows: _Runs, step_ms: int) -> _Runs:
    """The rows as runs the plain way (the oracles' input): each row joins the run before
    it when their measures are equal; the runs' steps counted one by one."""
    runs = _Runs()
    counts: list[int] = []
    for t, count, measure in zip(rows.t, rows.count, rows.measures, strict=True):
        if runs.measures and runs.measures[-1] == measure:
            counts[-1] += int(count)
        else:
            runs.add(t, measure)
            counts.append(int(count))
    runs.close(rows.t[-1] + int(rows.count[-1]) * step_ms, step_ms)
    assert runs.count.tolist() == counts
    return runs


RUN_ROWS = st.lists(
    st.tuples(
        st.integers(1, 90),
        st.integers(1, 8),
        st.integers(0, 8),
        st.floats(0, 5),
        st.sampled_from([0.0, 0.5, 1.0, 1.5]) | st.floats(0, 4),
        st.sampled_from([0.0, 0.25, RISE_FROM, 2.0]) | st.floats(0, 6),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(RUN_ROWS, st.integers(1, 50), st.sampled_from([1_000, MINUTE, 300_000]))
def test_run_arrays_equal_the_plain_loops_bit_for_bit(
    rows: list[tuple[int, int, int, float, float, float]], points: int, step_ms: int
) -> None:
    arrays = RunArrays.of(runs_of(rows, step_ms))
    r = merged(runs_of(rows, step_ms), step_ms)
    assert arrays.totals() == totals_by_loop(r)
    assert arrays.centre(step_ms) == centre_by_loop(r, step_ms)
    assert arrays.expand(step_ms) == expand(r, step_ms)
    assert arrays.downsample(step_ms, points) == downsample(expand(r, step_ms), points)
    zoom = arrays.zoom(step_ms, RISE_MS)
    centre = arrays.centre(step_ms)
    everything = expand(r, step_ms)
    near = [i for i, t in enumerate(everything.t_ms) if abs(t - centre) <= RISE_MS / 2]
    assert zoom.t_ms == [everything.t_ms[i] for i in near]
    assert zoom.load == [everything.load[i] for i in near]
    # each row made as two visits with equal measures: merged back into the same runs
    twice = [(1, *row[1:]) for row in rows for _ in range(2)]
    again = RunArrays.of(runs_of(twice, step_ms))
    plain = merged(runs_of(twice, step_ms), step_ms)
    assert again.totals() == totals_by_loop(plain)
    assert again.expand(step_ms) == expand(plain, step_ms)
    assert len(again.t) == len(plain.t) <= len(rows)


def test_the_zoom_centres_on_the_steepest_rise_from_a_quiet_load() -> None:
    quiet, busy = 0.2, 3.0
    # two rises from quiet: a small one, then a steep one; a rise from a busy load
    rows = [(60, 1, 0, 0.0, quiet, quiet), (5, 1, 0, 0.0, 1.0, 1.0), (60, 1, 0, 0.0, quiet, quiet)]
    rows += [(2, 4, 4, 1.0, busy, busy), (120, 2, 0, 0.0, 1.0, 2.0), (3, 8, 8, 9.0, 5.0, 9.0)]
    r = runs_of(rows, MINUTE)
    steep = T0 + (60 + 5 + 60) * MINUTE
    assert RunArrays.of(r).centre(MINUTE) == centre_by_loop(r, MINUTE) == steep
    # a run that ended exactly an hour before has left the window
    edge = runs_of(
        [(10, 1, 0, 0.0, quiet, quiet), (60, 1, 0, 0.0, 1.0, 1.0), (1, 2, 2, 2.0, 1.5, 3.0)], MINUTE
    )
    assert RunArrays.of(edge).centre(MINUTE) == centre_by_loop(edge, MINUTE) == T0 + 10 * MINUTE
    flat = runs_of([(100, 1, 0, 0.0, 0.9, 0.9)], MINUTE)
    assert RunArrays.of(flat).centre(MINUTE) == T0


def test_report_checks_the_issue_targets() -> None:
    rows = []
    for trace, base_ff in (("a", 40), ("b", 0)):
        rows.append((trace, "pip483", 100.0, 1000.0, 50, base_ff))
        rows.append((trace, "good", 120.0, 100.0, 40, 1 if base_ff else 0))
        rows.append((trace, "churny", 120.0, 100.0, 50, 3))
    metrics = pd.DataFrame(
        [
            {
                "trace": t,
                "variant": v,
                "segment_hours": sh,
                "seconds_above_threshold": 0.0,
                "excess_load": ex,
                "late_excess_load": 0.0,
                "splits": ops // 2,
                "merges": ops - ops // 2,
                "operations": ops,
                "flipflops": ff,
                "peak_segments": 4,
            }
            for t, v, sh, ex, ops, ff in rows
        ]
    )
    got = {v.variant: v for v in verdicts(metrics)}
    assert got["good"].ok  # 1 flip-flop <= 5% of 40; 80 < 100 operations
    assert not got["churny"].passed["operations"]  # 100 operations are not fewer
    assert not got["churny"].passed["flipflops"]  # 6 > 2
    assert got["good"].traces_passing["flipflops"] == 2
    text = render_report(metrics, {"command": "x"})
    assert "flip-flops at most 5%" in text and "fewer operations" in text


def test_a_fleet_s_report_lists_its_worst_traces_not_every_one() -> None:
    """Past REPORT_TRACES traces the per-trace table keeps those with the most excess load
    summed over the variants (metrics.csv has all)."""
    count = REPORT_TRACES + 10
    excess = {f"t{i:03}": float((i * 37) % count) for i in range(count)}
    metrics = pd.DataFrame(
        [
            {
                "trace": t,
                "variant": v,
                "segment_hours": 1.0,
                "seconds_above_threshold": 0.0,
                "excess_load": x * share,
                "late_excess_load": 0.0,
                "splits": 0,
                "merges": 0,
                "operations": 0,
                "flipflops": 0,
                "peak_segments": 1,
            }
            for t, x in excess.items()
            for v, share in (("pip483", 0.75), ("other", 0.25))
        ]
    )
    ranked = sorted(excess, key=lambda t: -excess[t])[:REPORT_TRACES]
    assert worst_traces(metrics, REPORT_TRACES) == sorted(ranked)
    assert worst_traces(metrics, 0) == []
    assert worst_traces(metrics, 2) == ["t034", "t047"]  # 58 and 59, in input order
    text = render_report(metrics, {"command": "x"})
    table = text.split("## Per trace")[1]
    assert f"The {REPORT_TRACES} of {count} traces with the most excess load" in table
    listed = {line.split("|")[1].strip() for line in table.splitlines() if "`pip483`" in line}
    assert listed == set(ranked)


def test_every_trace_gets_plot_files_of_its_own() -> None:
    """``x y`` and ``x_y`` made the same file name, a trace ``pareto`` shared the Pareto
    plot's, and ``a-peak`` would share ``a``'s zoom: each wrote over the other's plot."""
    stems = _file_stems(["x y", "x_y", "pareto", "a", "a-peak", "x_y-2"])
    names = [f"{s}{end}.png" for s in stems.values() for end in ("", "-peak")]
    assert len(set(names)) == len(names) and "pareto.png" not in names
    assert stems["x y"] == "x_y" and stems["a"] == "a"  # the first keeps its plain name


@pytest.mark.parametrize(
    ("cut", "shown"),
    [(0.0, "+0.0%"), (-0.0, "+0.0%"), (1e-9, "+0.0%"), (0.5, "-50.0%"), (-0.25, "+25.0%")],
)
def test_a_change_reads_as_what_it_is(cut: float, shown: str) -> None:
    assert pct_change(cut) == shown


def test_excess_load_where_the_baseline_had_none_is_shown_as_more() -> None:
    assert pct_change(_cut(5.0, 0.0)) == "more (baseline: none)"
    assert pct_change(_cut(0.0, 0.0)) == "+0.0%"
    assert pct_change(float("nan")) == "n/a"
