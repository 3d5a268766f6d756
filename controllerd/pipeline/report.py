"""Backtest outputs: ``metrics.csv``, ``operations.csv``, ``report.md`` and PNG plots.

``metrics.csv`` is a scripted contract: one row per trace x variant, columns
``trace, variant, segment_hours, seconds_above_threshold, excess_load, splits,
merges, flipflops, peak_segments`` first, more after them. ``report.md``
compares variants over all traces (sums; the peak is a max), checks each one
against the baseline (``pip483``) on the issue's targets, and lists the Pareto
front of cost (segment-hours) against overload (excess load).
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

import pandas as pd

from controllerd.pipeline.engines import timeline_of
from controllerd.pipeline.simulate import METRIC_COLUMNS, Timeline

BASELINE: Final = "pip483"
SUMMED: Final = (
    "segment_hours",
    "seconds_above_threshold",
    "excess_load",
    "late_excess_load",
    "splits",
    "merges",
    "operations",
    "flipflops",
)


@dataclass(frozen=True, slots=True)
class Targets:
    """The issue's bar for a variant against the baseline, over all traces."""

    min_excess_cut: float = 0.5
    max_cost_ratio: float = 1.25
    #: flip-flops allowed, as a share of the baseline's count.
    max_flipflop_share: float = 0.05


Row = Mapping[str, Any]


def totals(metrics: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Per variant (input order): sums over traces, the highest peak and the trace count."""
    out: dict[str, dict[str, float]] = {}
    for row in _records(metrics):
        tot = out.setdefault(
            str(row["variant"]), dict.fromkeys((*SUMMED, "peak_segments", "traces"), 0.0)
        )
        for key in SUMMED:
            tot[key] += float(row[key])
        tot["peak_segments"] = max(tot["peak_segments"], float(row["peak_segments"]))
        tot["traces"] += 1
    return out


PLOT_TRACES: Final = 20
"""``backtest`` plots at most this many traces unless told (``--plot-traces``): a plotted
group brings its timelines (~12,000 values) to the driver, which a fleet's 50,000 groups
could not afford, and nobody reads 20,000 plots."""

REPORT_TRACES: Final = 50
"""``report.md``'s per-trace table lists at most this many traces (``metrics.csv`` has all)."""


def worst_traces(metrics: pd.DataFrame, limit: int) -> list[str]:
    """The ``limit`` traces with the most excess load summed over the variants, in the
    results' order (ties too): where some variant was overloaded is where the policies
    part ways, and where an operator looks first."""
    if limit <= 0:
        return []
    excess = metrics.groupby("trace", sort=False)["excess_load"].sum()
    keep = set(excess.sort_values(ascending=False, kind="stable").index[:limit])
    return [str(t) for t in excess.index if t in keep]


def _records(metrics: pd.DataFrame) -> list[dict[str, Any]]:
    return cast(list[dict[str, Any]], metrics.to_dict("records"))


def pareto_front(points: Mapping[str, tuple[float, float]]) -> list[str]:
    """Names not dominated on (cost, overload), both minimised; in cost order."""
    front = [
        name
        for name, (c, o) in points.items()
        if not any(
            (c2 <= c and o2 <= o) and (c2 < c or o2 < o)
            for other, (c2, o2) in points.items()
            if other != name
        )
    ]
    return sorted(front, key=lambda n: points[n])


@dataclass(frozen=True, slots=True)
class Verdict:
    variant: str
    excess_cut: float
    late_excess_cut: float
    cost_ratio: float
    operations: int
    baseline_operations: int
    flipflops: int
    passed: Mapping[str, bool]
    traces_passing: Mapping[str, int]
    trace_count: int

    @property
    def ok(self) -> bool:
        return all(self.passed.values())


def _cut(new: float, old: float) -> float:
    """Fraction by which ``new`` is below ``old`` (0.6 = 60% less)."""
    return 1.0 - new / old if old > 0 else (0.0 if new == 0 else -math.inf)


def verdicts(
    metrics: pd.DataFrame, baseline: str = BASELINE, targets: Targets | None = None
) -> list[Verdict]:
    """Each variant (but the baseline) against the baseline: totals, and trace by trace."""
    targets = targets or Targets()
    tot = totals(metrics)
    if baseline not in tot:
        return []
    base = tot[baseline]
    rows = _records(metrics)
    per_base = {r["trace"]: r for r in rows if r["variant"] == baseline}
    out = []
    for name, row in tot.items():
        if name == baseline:
            continue
        checks = _checks(row, base, targets)
        passing = dict.fromkeys(checks, 0)
        mine = [r for r in rows if r["variant"] == name and r["trace"] in per_base]
        for r in mine:
            for key, ok in _checks(r, per_base[r["trace"]], targets).items():
                passing[key] += ok
        out.append(
            Verdict(
                variant=name,
                excess_cut=_cut(row["excess_load"], base["excess_load"]),
                late_excess_cut=_cut(row["late_excess_load"], base["late_excess_load"]),
                cost_ratio=row["segment_hours"] / base["segment_hours"],
                operations=int(row["operations"]),
                baseline_operations=int(base["operations"]),
                flipflops=int(row["flipflops"]),
                passed=checks,
                traces_passing=passing,
                trace_count=len(mine),
            )
        )
    return out


def _checks(row: Row, base: Row, targets: Targets) -> dict[str, bool]:
    if base["excess_load"] == 0:
        excess_ok = row["excess_load"] == 0
    else:
        excess_ok = _cut(row["excess_load"], base["excess_load"]) >= targets.min_excess_cut
    ops, base_ops = row["operations"], base["operations"]
    return {
        "excess": bool(excess_ok),
        "cost": bool(row["segment_hours"] <= targets.max_cost_ratio * base["segment_hours"]),
        "operations": bool(ops < base_ops or ops == base_ops == 0),
        "flipflops": bool(row["flipflops"] <= targets.max_flipflop_share * base["flipflops"]),
    }


# --- files -------------------------------------------------------------------------------


def write_metrics(results: pd.DataFrame, path: Path) -> pd.DataFrame:
    metrics = results[["trace", "variant", *METRIC_COLUMNS]]
    metrics.to_csv(path, index=False)
    return metrics


def write_operations(results: pd.DataFrame, path: Path) -> None:
    """Every split and merge each variant made: what the policy *would have done*."""
    rows: list[dict[str, Any]] = []
    for r in _records(results[["trace", "variant", "operations_json"]]):
        for op in json.loads(r["operations_json"]):
            rows.append(
                {
                    "trace": r["trace"],
                    "variant": r["variant"],
                    "time": _iso(op["t_ms"]),
                    **op,
                }
            )
    columns = [
        "trace",
        "variant",
        "time",
        "t_ms",
        "action",
        "start",
        "end",
        "reason",
        "segments_after",
        "flipflop",
    ]
    pd.DataFrame(rows, columns=columns).to_csv(path, index=False)


def _iso(t_ms: int) -> str:
    return dt.datetime.fromtimestamp(t_ms / 1000, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def pct_change(cut: float) -> str:
    """A cut (0.6 = 60% less) as a signed change: ``-60.0%``. No cut reads ``+0.0%``
    (not ``-0.0%``, which reads as one); more where the baseline had none (a cut of
    -inf) says so rather than ``n/a``."""
    if cut == -math.inf:
        return "more (baseline: none)"
    if not math.isfinite(cut):
        return "n/a"
    return f"{round(-100 * cut, 1) + 0.0:+.1f}%"


def render_report(
    metrics: pd.DataFrame,
    run_info: Mapping[str, str],
    plots: Mapping[str, Sequence[str]] | None = None,
    baseline: str = BASELINE,
) -> str:
    """``report.md``: totals, the target check, the Pareto front, per-trace rows, plots."""
    tot = totals(metrics)
    lines = ["# Backtest report", ""]
    lines += [f"- {k}: {v}" for k, v in run_info.items()]
    lines += [
        "",
        "Units: segment-hours of active segments; `excess_load` in threshold-seconds",
        "(a segment at s times its split threshold for t seconds adds (s-1)·t); `late_excess_load`",
        "is excess_load without the first interval of each overload, which no policy can",
        "avoid (the load is reported at its end). Load is measured against the reference",
        "split thresholds (Pulsar's defaults) whatever the variant's own thresholds.",
        "",
        "## Totals over all traces",
        "",
    ]
    has_base = baseline in tot
    base = tot.get(baseline)
    rows = []
    for name, r in tot.items():
        vs_cost = f"{r['segment_hours'] / base['segment_hours']:.3f}x" if base is not None else ""
        vs_excess = (
            pct_change(_cut(r["excess_load"], base["excess_load"]))
            if base is not None and name != baseline
            else ""
        )
        rows.append(
            [
                f"`{name}`",
                f"{r['segment_hours']:.1f}",
                vs_cost,
                f"{r['excess_load']:.1f}",
                vs_excess,
                f"{r['late_excess_load']:.1f}",
                f"{r['seconds_above_threshold']:.0f}",
                int(r["splits"]),
                int(r["merges"]),
                int(r["operations"]),
                int(r["flipflops"]),
                int(r["peak_segments"]),
            ]
        )
    header = [
        "variant",
        "segment_hours",
        f"vs {baseline}",
        "excess_load",
        f"vs {baseline}",
        "late_excess",
        "seconds_above",
        "splits",
        "merges",
        "ops",
        "flipflops",
        "peak",
    ]
    lines += _table(header, rows)

    if has_base:
        lines += ["", f"## Targets against `{baseline}`", ""]
        t = Targets()
        lines += [
            f"Excess load cut by at least {t.min_excess_cut:.0%}, at most "
            f"{t.max_cost_ratio}x the segment-hours, fewer operations, flip-flops at most "
            f"{t.max_flipflop_share:.0%} of the baseline's; over all traces (and, in "
            "brackets, on how many traces one by one).",
            "",
        ]
        vrows = []
        for v in verdicts(metrics, baseline):
            n = v.trace_count

            def mark(key: str, v: Verdict = v, n: int = n) -> str:
                return f"{'✅' if v.passed[key] else '❌'} ({v.traces_passing[key]}/{n})"

            vrows.append(
                [
                    f"`{v.variant}`",
                    f"{pct_change(v.excess_cut)} {mark('excess')}",
                    f"{pct_change(v.late_excess_cut)}",
                    f"{v.cost_ratio:.3f}x {mark('cost')}",
                    f"{v.operations} vs {v.baseline_operations} {mark('operations')}",
                    f"{v.flipflops} {mark('flipflops')}",
                    "**yes**" if v.ok else "no",
                ]
            )
        lines += _table(
            [
                "variant",
                "excess load",
                "late excess",
                "segment-hours",
                "operations",
                "flip-flops",
                "all met",
            ],
            vrows,
        )

    points = {n: (r["segment_hours"], r["excess_load"]) for n, r in tot.items()}
    front = pareto_front(points)
    lines += [
        "",
        "## Pareto front: cost (segment-hours) vs overload (excess load)",
        "",
        "Variants no other variant beats on both; cheapest first.",
        "",
    ]
    lines += _table(
        ["variant", "segment_hours", "excess_load"],
        [[f"`{n}`", f"{points[n][0]:.1f}", f"{points[n][1]:.1f}"] for n in front],
    )
    if plots and PARETO in plots:
        lines += ["", f"![Pareto front]({plots[PARETO][0]})"]

    lines += ["", "## Per trace", ""]
    names = metrics["trace"].unique()
    if len(names) > REPORT_TRACES:
        shown = worst_traces(metrics, REPORT_TRACES)
        lines += [
            f"The {len(shown)} of {len(names):,} traces with the most excess load over the "
            "variants; `metrics.csv` has every one.",
            "",
        ]
        metrics = metrics[metrics["trace"].isin(shown)]
    per = []
    for r in _records(metrics):
        per.append(
            [
                r["trace"],
                f"`{r['variant']}`",
                f"{r['segment_hours']:.1f}",
                f"{r['seconds_above_threshold']:.0f}",
                f"{r['excess_load']:.1f}",
                f"{r['late_excess_load']:.1f}",
                int(r["splits"]),
                int(r["merges"]),
                int(r["flipflops"]),
                int(r["peak_segments"]),
            ]
        )
    lines += _table(
        [
            "trace",
            "variant",
            "segment_hours",
            "seconds_above",
            "excess_load",
            "late_excess",
            "splits",
            "merges",
            "flipflops",
            "peak",
        ],
        per,
    )
    if plots:
        lines += ["", "## Plots", ""]
        for trace, files in plots.items():
            if trace == PARETO:
                continue
            lines += [f"### {trace}", ""] + [f"![{trace}]({f})" for f in files] + [""]
    return "\n".join(lines).rstrip() + "\n"


# --- plots -------------------------------------------------------------------------------

DAILY_AFTER_DAYS: Final = 14
"""Whole-trace plots of longer traces show daily aggregates: minute data is a solid block."""
DAY_MS: Final = 86_400_000
LOAD_COLOR: Final = "0.6"
HOT_COLOR: Final = "tab:red"
SEG_COLOR: Final = "tab:blue"


def _times(t_ms: Sequence[int]) -> list[dt.datetime]:
    return [dt.datetime.fromtimestamp(t / 1000, tz=dt.UTC) for t in t_ms]


def daily(timeline: Timeline) -> Timeline:
    """Per UTC day: the maxima of load, hottest and segments, and the mean segment count."""
    days: dict[int, list[int]] = {}
    for i, t in enumerate(timeline.t_ms):
        days.setdefault(t // DAY_MS, []).append(i)
    means = timeline.segments_mean or [float(x) for x in timeline.segments]
    return Timeline(
        [day * DAY_MS for day in days],
        [max(timeline.load[i] for i in idx) for idx in days.values()],
        [max(timeline.hottest[i] for i in idx) for idx in days.values()],
        [max(timeline.segments[i] for i in idx) for idx in days.values()],
        [sum(means[i] for i in idx) / len(idx) for idx in days.values()],
    )


def trace_figure(trace: str, rows: Sequence[tuple[str, Timeline]], title_suffix: str = "") -> Any:
    """One panel per variant: topic load and hottest segment (in units of the split
    threshold, left axis) and active segments (right axis); every panel on the same
    scales, one legend naming every line, time in UTC. Traces longer than
    :data:`DAILY_AFTER_DAYS` are drawn as daily aggregates."""
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    span = max((tl.t_ms[-1] - tl.t_ms[0] for _, tl in rows if tl.t_ms), default=0)
    by_day = span > DAILY_AFTER_DAYS * DAY_MS
    if by_day:
        rows = [(name, daily(tl)) for name, tl in rows]
    fig = Figure(figsize=(12, 1.9 * len(rows) + 1.4), layout="constrained")
    axes = fig.subplots(len(rows), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    twins = [ax.twinx() for ax in axes]
    for twin in twins[1:]:
        twin.sharey(twins[0])
    top_load = max((max([*tl.load, *tl.hottest], default=1.0) for _, tl in rows), default=1.0)
    top_segments = max((max(tl.segments, default=1) for _, tl in rows), default=1)
    for ax, twin, (variant, tl) in zip(axes, twins, rows, strict=True):
        times = _times(tl.t_ms)
        if by_day:
            ax.step(times, tl.load, where="post", color=LOAD_COLOR, linewidth=0.9)
            ax.step(times, tl.hottest, where="post", color=HOT_COLOR, linewidth=0.9)
            twin.step(times, tl.segments_mean, where="post", color=SEG_COLOR, linewidth=1.1)
            twin.step(
                times, tl.segments, where="post", color=SEG_COLOR, linewidth=0.8, linestyle=":"
            )
        else:
            ax.plot(times, tl.load, color=LOAD_COLOR, linewidth=0.8)
            ax.plot(times, tl.hottest, color=HOT_COLOR, linewidth=0.9)
            twin.step(times, tl.segments, where="post", color=SEG_COLOR, linewidth=1.0)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        ax.set_ylabel("load / threshold")
        twin.set_ylabel("segments", color=SEG_COLOR)
        ax.set_title(variant, loc="left", fontsize=9)
        ax.set_ylim(0, top_load * 1.08 + 0.05)
        twin.set_ylim(0, top_segments * 1.15 + 0.5)
    locator = AutoDateLocator(tz=dt.UTC)  # type: ignore[no-untyped-call]
    axes[-1].xaxis.set_major_locator(locator)
    axes[-1].xaxis.set_major_formatter(
        ConciseDateFormatter(locator, tz=dt.UTC)  # type: ignore[no-untyped-call]
    )
    axes[-1].set_xlabel("time (UTC)" + (", one step per day" if by_day else ""))
    handles = [
        Line2D([], [], color=LOAD_COLOR, label="topic load" + (" (daily max)" if by_day else "")),
        Line2D(
            [], [], color=HOT_COLOR, label="hottest segment" + (" (daily max)" if by_day else "")
        ),
        Line2D([], [], color="black", linestyle="--", label="split threshold"),
    ]
    if by_day:
        handles += [
            Line2D([], [], color=SEG_COLOR, label="active segments (daily mean)"),
            Line2D([], [], color=SEG_COLOR, linestyle=":", label="active segments (daily max)"),
        ]
    else:
        handles.append(Line2D([], [], color=SEG_COLOR, label="active segments (right axis)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    fig.suptitle(f"{trace}{title_suffix}", fontsize=11)
    return fig


def plot_trace(
    trace: str, rows: Sequence[tuple[str, Timeline]], path: Path, title_suffix: str = ""
) -> None:
    trace_figure(trace, rows, title_suffix).savefig(path, dpi=90)


def pareto_figure(points: Mapping[str, tuple[float, float]], front: Sequence[str]) -> Any:
    """Cost against overload, one marker per variant named in the legend (no text on the
    plot, so no labels can overlap), the front joined by a line; symlog overload so
    that 0 and 10^5 fit on one axis."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5.5), layout="constrained")
    ax = fig.subplots()
    markers = "osD^v<>PX*h"
    for i, (name, (c, o)) in enumerate(points.items()):
        ax.scatter(
            [c],
            [o],
            marker=markers[i % len(markers)],
            s=60 if name in front else 30,
            edgecolors="black" if name in front else "none",
            label=f"{name}: {c:,.0f} h, {o:,.0f}" + (" (front)" if name in front else ""),
            zorder=3,
        )
    if front:
        ax.plot(
            [points[n][0] for n in front],
            [points[n][1] for n in front],
            color="tab:red",
            linewidth=0.8,
            label="Pareto front",
            zorder=2,
        )
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("segment-hours (cost)")
    ax.set_ylabel("excess load, threshold-seconds (overload, symlog)")
    ax.set_title("Pareto front over all traces")
    ax.grid(True, linewidth=0.3)
    fig.legend(loc="outside right upper", fontsize=7)
    return fig


def plot_pareto(
    points: Mapping[str, tuple[float, float]], front: Sequence[str], path: Path
) -> None:
    pareto_figure(points, front).savefig(path, dpi=90)


PARETO: Final = "\x00pareto"
"""The key of the Pareto plot in :func:`write_plots`' answer: no trace can be named so."""


def _file_stems(traces: Sequence[str]) -> dict[str, str]:
    """A distinct file stem per trace (``<stem>.png`` and ``<stem>-peak.png``): the name
    with what a file name should not hold replaced, and ``-2``, ``-3`` ... where that
    would take a name already given (``x y`` and ``x_y``; ``a-peak`` after ``a``'s
    zoom; ``pareto``, the Pareto plot's)."""
    taken = {"pareto.png"}
    stems: dict[str, str] = {}
    for trace in traces:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(trace))
        stem, n = safe, 1
        while f"{stem}.png" in taken or f"{stem}-peak.png" in taken:
            n += 1
            stem = f"{safe}-{n}"
        taken.update((f"{stem}.png", f"{stem}-peak.png"))
        stems[trace] = stem
    return stems


def write_plots(results: pd.DataFrame, out: Path) -> dict[str, list[str]]:
    """PNG files per trace that has timelines (whole run, and around its steepest rise;
    a replay with ``timeline_points=0`` has none) and the Pareto plot (key :data:`PARETO`)."""
    plot_dir = out / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[str]] = {}
    records = _records(results[results["tl_t_ms"].map(len) > 0])  # not all of a fleet's
    traces = list(dict.fromkeys(str(r["trace"]) for r in records))
    for trace, stem in _file_stems(traces).items():
        rows = [r for r in records if str(r["trace"]) == trace]
        whole = [(str(r["variant"]), timeline_of(r, "tl")) for r in rows]
        zoom = [(str(r["variant"]), timeline_of(r, "zoom")) for r in rows]
        plot_trace(trace, whole, plot_dir / f"{stem}.png")
        plot_trace(
            trace,
            zoom,
            plot_dir / f"{stem}-peak.png",
            " (6 h around its steepest rise from a light load, every minute)",
        )
        files[trace] = [f"plots/{stem}.png", f"plots/{stem}-peak.png"]
    tot = totals(results[["trace", "variant", *METRIC_COLUMNS]])
    points = {n: (r["segment_hours"], r["excess_load"]) for n, r in tot.items()}
    plot_pareto(points, pareto_front(points), plot_dir / "pareto.png")
    files[PARETO] = ["plots/pareto.png"]
    return files


def write_outputs(
    results: pd.DataFrame, out: Path, run_info: Mapping[str, str], *, plots: bool = True
) -> pd.DataFrame:
    """Write every output file under ``out``; returns the metrics table."""
    out.mkdir(parents=True, exist_ok=True)
    metrics = write_metrics(results, out / "metrics.csv")
    write_operations(results, out / "operations.csv")
    plot_files = write_plots(results, out) if plots else None
    (out / "report.md").write_text(render_report(metrics, run_info, plot_files), encoding="utf-8")
    return metrics
