"""``controllerd tune``: choose policy settings by cross-validation over a grid of variants.

A grid file is a variants file (:mod:`.variants`): each candidate is one
variant, usually from ``grid."policy.<key>" = [...]`` tables. Every trace runs
under every candidate and under the baseline (``pip483``) once, on either
engine (one task per trace x variant); the choosing is arithmetic on the
resulting ``metrics.csv`` and happens on the driver.

**The choice.** A candidate is judged on totals over a set of traces against
the baseline's totals on the same traces, on the issue's four targets: excess
load cut by at least 50%, at most 1.25x the segment-hours, fewer operations,
flip-flops at most 5% of the baseline's. Each target gives a *slack*, scaled
so that 0 is the bar and 1 is as good as it needs to be (no excess load, the
baseline's cost, half its operations, no flip-flops). The candidate with the largest
*smallest* slack wins: it meets every target with the widest margin, which is
what has to survive traffic it was not chosen on. When the traces come from
several ``--traces`` paths (trace sets), the smallest slack is taken over the
sets, each on its own totals: the targets hold per set. Ties go to fewer
segment-hours, then to the earlier candidate.

**Cross-validation.** The choice is made on training traces and reported on
held-out ones, per fold:

* ``loto`` — leave one trace out: each trace is held out once;
* ``group`` — leave one input out: each ``--traces`` path (a trace set) is held
  out once, e.g. choose on ``nab`` and test on ``aws``;
* ``time:F`` — every trace is cut at fraction F of its duration; choose on the
  first parts, test on the rest.

The out-of-sample figures pool each fold's held-out traces under that fold's
choice. The settings printed at the end are the choice on *all* traces (what
the shipped defaults should be), with the out-of-sample figures as the
estimate of how they do on traffic they were not chosen on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import pandas as pd

from controllerd.config import AutoscaleSettings, GcSettings, LoadReportSettings
from controllerd.core.model import PolicySettings
from controllerd.pipeline.load import Trace
from controllerd.pipeline.report import BASELINE, Targets
from controllerd.pipeline.variants import Variant

SUMMED: Final = ("segment_hours", "excess_load", "operations", "flipflops")


@dataclass(frozen=True, slots=True)
class Fold:
    name: str
    train: tuple[str, ...]
    test: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Score:
    """A variant against the baseline over a set of traces."""

    variant: str
    traces: int
    excess_cut: float
    cost_ratio: float
    operations: int
    base_operations: int
    flipflops: int
    base_flipflops: int
    slack: Mapping[str, float]

    @property
    def worst(self) -> float:
        return min(self.slack.values())

    @property
    def met(self) -> Mapping[str, bool]:
        """Each target; "fewer operations" is strict (equal counts only if both are 0)."""
        met = {k: v >= 0 for k, v in self.slack.items()}
        met["operations"] = self.operations < self.base_operations or (
            self.operations == self.base_operations == 0
        )
        return met

    @property
    def all_met(self) -> bool:
        return all(self.met.values())


def _totals(metrics: pd.DataFrame, variant: str, traces: Sequence[str]) -> dict[str, float]:
    rows = metrics[(metrics["variant"] == variant) & (metrics["trace"].isin(list(traces)))]
    return {k: float(rows[k].sum()) for k in SUMMED}


def score(
    metrics: pd.DataFrame,
    variant: str,
    traces: Sequence[str],
    baseline: str = BASELINE,
    targets: Targets | None = None,
) -> Score:
    """``variant`` against ``baseline`` on the totals over ``traces``."""
    t = targets or Targets()
    mine, base = _totals(metrics, variant, traces), _totals(metrics, baseline, traces)
    cut = 1.0 - mine["excess_load"] / base["excess_load"] if base["excess_load"] > 0 else 1.0
    if base["excess_load"] <= 0 and mine["excess_load"] > 0:
        cut = -math.inf
    ratio = mine["segment_hours"] / base["segment_hours"] if base["segment_hours"] else math.inf
    ops, base_ops = int(mine["operations"]), int(base["operations"])
    ff, base_ff = int(mine["flipflops"]), int(base["flipflops"])
    allowed_ff = t.max_flipflop_share * base_ff
    slack = {
        "excess": (cut - t.min_excess_cut) / (1.0 - t.min_excess_cut),
        "cost": min(1.0, (t.max_cost_ratio - ratio) / (t.max_cost_ratio - 1.0)),
        # "fewer": the bar is one operation less than the baseline's; half as many is 1.
        "operations": min(1.0, (base_ops - 1 - ops) / (base_ops / 2))
        if base_ops
        else (1.0 if ops == 0 else -1.0),
        "flipflops": (allowed_ff - ff) / allowed_ff
        if allowed_ff > 0
        else (1.0 if ff == 0 else -ff),
    }
    return Score(variant, len(traces), cut, ratio, ops, base_ops, ff, base_ff, slack)


def choose(
    metrics: pd.DataFrame,
    candidates: Sequence[str],
    traces: Sequence[str],
    baseline: str = BASELINE,
    groups: Mapping[str, str] | None = None,
) -> Score:
    """The candidate with the largest smallest slack on ``traces`` (see the module docstring).

    With ``groups`` (trace -> trace set), the slack is the smallest over the sets
    among ``traces``, each scored on its own totals: the targets hold per set,
    so one set's big trace cannot hide another set's misses.
    """
    sets: dict[str, list[str]] = {}
    for t in traces:
        sets.setdefault(groups.get(t, "") if groups else "", []).append(t)
    order = {c: i for i, c in enumerate(candidates)}
    cost = {c: _totals(metrics, c, traces)["segment_hours"] for c in candidates}
    worst = {
        c: min(score(metrics, c, members, baseline).worst for members in sets.values())
        for c in candidates
    }
    best = max(candidates, key=lambda c: (worst[c], -cost[c], -order[c]))
    return score(metrics, best, traces, baseline)


def folds_for(scheme: str, traces: Sequence[Trace], groups: Mapping[str, str]) -> list[Fold]:
    """The folds of ``loto`` or ``group`` over trace names (``time`` splits the traces first)."""
    names = [t.name for t in traces]
    if scheme == "loto":
        if len(names) < 2:
            raise ValueError("--cv loto needs at least two traces (one held out, one to tune on)")
        return [Fold(n, tuple(m for m in names if m != n), (n,)) for n in names]
    if scheme == "group":
        kinds = list(dict.fromkeys(groups[n] for n in names))
        if len(kinds) < 2:
            raise ValueError("--cv group needs at least two --traces paths")
        return [
            Fold(
                g,
                tuple(n for n in names if groups[n] != g),
                tuple(n for n in names if groups[n] == g),
            )
            for g in kinds
        ]
    raise ValueError(f"unknown --cv {scheme!r}")


TRAIN: Final = "@train"
TEST: Final = "@test"


def split_in_time(traces: Sequence[Trace], fraction: float) -> list[Trace]:
    """Each trace cut at ``fraction`` of its duration into ``name@train`` and ``name@test``."""
    out: list[Trace] = []
    for trace in traces:
        cut = trace.t_ms[0] + fraction * (trace.t_ms[-1] - trace.t_ms[0])
        first = [i for i, t in enumerate(trace.t_ms) if t <= cut]
        rest = [i for i, t in enumerate(trace.t_ms) if t > cut]
        for suffix, rows in ((TRAIN, first), (TEST, rest)):
            if not rows:
                raise ValueError(f"trace {trace.name} is too short to cut at {fraction:g}")
            buckets = trace.buckets
            out.append(
                Trace(
                    trace.name + suffix,
                    trace.kind,
                    [trace.t_ms[i] for i in rows],
                    [trace.start[i] for i in rows],
                    [trace.end[i] for i in rows],
                    [trace.rates[i] for i in rows],
                    [buckets[i] for i in rows] if buckets is not None else None,
                )
            )
    return out


def time_fold(traces: Sequence[Trace]) -> Fold:
    names = [t.name for t in traces]
    return Fold(
        "time",
        tuple(n for n in names if n.endswith(TRAIN)),
        tuple(n for n in names if n.endswith(TEST)),
    )


@dataclass(frozen=True, slots=True)
class FoldResult:
    fold: Fold
    chosen: str
    in_sample: Score
    out_of_sample: Score


@dataclass(frozen=True, slots=True)
class TuneResult:
    folds: Sequence[FoldResult]
    #: every fold's held-out traces under that fold's choice, pooled, against the baseline.
    pooled: Score
    #: the choice on all traces (in sample).
    final: Score
    #: the final choice on the held-out parts (time CV only: its out-of-sample figures).
    final_held_out: Score | None
    #: ``pooled``, per trace set (when the traces came from several sets).
    per_set: Mapping[str, Score] = dataclasses.field(default_factory=dict)


def cross_validate(
    metrics: pd.DataFrame,
    candidates: Sequence[str],
    folds: Sequence[Fold],
    everything: Sequence[str],
    baseline: str = BASELINE,
    groups: Mapping[str, str] | None = None,
) -> TuneResult:
    """Choose per fold on its training traces, score on its held-out ones, and pool them.

    ``groups`` (trace -> trace set) makes every choice meet the targets per set.
    """
    results = []
    pooled_rows = []
    for fold in folds:
        best = choose(metrics, candidates, fold.train, baseline, groups)
        held = score(metrics, best.variant, fold.test, baseline)
        results.append(FoldResult(fold, best.variant, best, held))
        test = metrics[metrics["trace"].isin(list(fold.test))]
        pooled_rows.append(test[test["variant"] == best.variant].assign(variant="held-out"))
        pooled_rows.append(test[test["variant"] == baseline])
    pooled_frame = pd.concat(pooled_rows, ignore_index=True)
    held_out = sorted({t for f in folds for t in f.test})
    pooled = score(pooled_frame, "held-out", held_out, baseline)
    time_cv = len(folds) == 1 and folds[0].name == "time"
    final_traces = list(folds[0].train) if time_cv else list(everything)
    final = choose(metrics, candidates, final_traces, baseline, groups)
    final_held = score(metrics, final.variant, folds[0].test, baseline) if time_cv else None
    per_set: dict[str, Score] = {}
    names = {t: (groups or {}).get(t, "") for t in held_out}
    if len(set(names.values())) > 1:
        for name in dict.fromkeys(names.values()):
            members = [t for t in held_out if names[t] == name]
            per_set[name] = score(pooled_frame, "held-out", members, baseline)
    return TuneResult(results, pooled, final, final_held, per_set)


# --- the chosen settings as TOML ----------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    return repr(value)


def toml_snippet(variant: Variant) -> str:
    """The chosen variant's settings that differ from the shipped defaults, as TOML to
    paste into ``controllerd.toml``: ``[policy]``, ``[load_report]``, ``[autoscale]``
    ``interval_seconds`` and ``[gc]`` ``default_retention_seconds``; what the replay set
    that is not a controllerd setting (a static topic's segment count, the reporters'
    histogram) is said in comments, so nothing the choice depends on is lost."""
    strategy = variant.strategy
    lines = [f"# chosen by controllerd tune: {variant.name}"]
    if not strategy.policy.enabled:
        lines.append(
            f"# a static topic: create it with {strategy.initial_segments} segment(s); "
            "with the policy off, controllerd keeps them"
        )
    if strategy.hash_buckets:
        lines.append(
            f"# the replay's reporters published hashBuckets of {strategy.hash_buckets} "
            "slices (a broker setting, not controllerd's)"
        )
    if not strategy.track_cold_since:
        lines.append("# the replay did not track cold-since; the daemon always does")
    lines.append("[policy]")
    header = len(lines)
    policy, default = strategy.policy, PolicySettings()
    nested: list[str] = []
    for f in dataclasses.fields(policy):
        value, base = getattr(policy, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            changed = [
                (g.name, getattr(value, g.name))
                for g in dataclasses.fields(value)
                if getattr(value, g.name) != getattr(base, g.name)
            ]
            if changed:
                nested += ["", f"[policy.{f.name}]"]
                nested += [f"{k} = {_toml_value(v)}" for k, v in changed]
        elif value != base:
            lines.append(f"{f.name} = {_toml_value(value)}")
    if len(lines) == header and not nested:
        lines.append("# (the shipped defaults)")
    lines += nested
    report, report_default = strategy.report, LoadReportSettings()
    changed_report = [
        f"{f.name} = {_toml_value(getattr(report, f.name))}"
        for f in dataclasses.fields(report)
        if getattr(report, f.name) != getattr(report_default, f.name)
    ]
    if changed_report:
        lines += ["", "[load_report]", *changed_report]
    if strategy.interval_seconds != AutoscaleSettings().interval_seconds:
        lines += ["", "[autoscale]", f"interval_seconds = {_toml_value(strategy.interval_seconds)}"]
    if strategy.gc_retention_seconds != GcSettings().default_retention_seconds:
        retention = _toml_value(strategy.gc_retention_seconds)
        lines += ["", "[gc]", f"default_retention_seconds = {retention}"]
    return "\n".join(lines) + "\n"


# --- report -------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{-100 * x:+.1f}%"


def _cells(s: Score) -> list[str]:
    met = s.met
    mark = {k: "✅" if ok else "❌" for k, ok in met.items()}
    return [
        f"{_pct(s.excess_cut)} {mark['excess']}",
        f"{s.cost_ratio:.3f}x {mark['cost']}",
        f"{s.operations} vs {s.base_operations} {mark['operations']}",
        f"{s.flipflops} vs {s.base_flipflops} {mark['flipflops']}",
    ]


def render(result: TuneResult, run_info: Mapping[str, str], snippet: str) -> str:
    """``tune.md``: per fold the choice with in-sample and out-of-sample figures side by side."""
    lines = ["# controllerd tune", ""]
    lines += [f"- {k}: {v}" for k, v in run_info.items()]
    lines += [
        "",
        "Against `pip483`: excess load cut by >= 50%, <= 1.25x its segment-hours, fewer",
        "operations, flip-flops <= 5% of its count. In sample: on the traces the settings were",
        "chosen on. Out of sample: on the traces held out from that choice.",
        "",
        "## Folds",
        "",
        "| held out | chosen | in: excess | in: cost | in: ops | in: flip-flops "
        "| out: excess | out: cost | out: ops | out: flip-flops |",
        "|" + "---|" * 10,
    ]
    for fr in result.folds:
        lines.append(
            "| "
            + " | ".join(
                [fr.fold.name, f"`{fr.chosen}`", *_cells(fr.in_sample), *_cells(fr.out_of_sample)]
            )
            + " |"
        )
    p = result.pooled
    lines += [
        "",
        "## Out of sample, pooled",
        "",
        "Every held-out trace under the settings chosen without it, summed, against `pip483`",
        "on the same traces:",
        "",
        "| traces | excess load | segment-hours | operations | flip-flops | all met |",
        "|---|---|---|---|---|---|",
        f"| {p.traces} | " + " | ".join(_cells(p)) + f" | {'**yes**' if p.all_met else 'no'} |",
    ]
    if result.per_set:
        lines += [
            "",
            "Per trace set (the targets hold per set):",
            "",
            "| set | traces | excess load | segment-hours | operations | flip-flops | all met |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, sc in result.per_set.items():
            lines.append(
                f"| {name} | {sc.traces} | "
                + " | ".join(_cells(sc))
                + f" | {'**yes**' if sc.all_met else 'no'} |"
            )
    lines += [
        "",
        "## Chosen on the first parts"
        if result.final_held_out is not None
        else "## Chosen on all traces",
        "",
        f"`{result.final.variant}` (smallest slack {result.final.worst:+.3f}), in sample:",
        "",
        "| excess load | segment-hours | operations | flip-flops |",
        "|---|---|---|---|",
        "| " + " | ".join(_cells(result.final)) + " |",
    ]
    if result.final_held_out is not None:
        lines += ["", "and on the later part of each trace (out of sample):", ""]
        lines += ["| excess load | segment-hours | operations | flip-flops |", "|---|---|---|---|"]
        lines.append("| " + " | ".join(_cells(result.final_held_out)) + " |")
    lines += ["", "```toml", snippet.rstrip(), "```", ""]
    return "\n".join(lines)
