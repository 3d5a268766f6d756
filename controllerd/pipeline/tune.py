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
  first parts (each series scaled by its own first part's peak), test on the rest.

The out-of-sample figures pool each fold's held-out traces under that fold's
choice. The settings printed at the end are the choice on *all* traces (with
``time:F``, on the first parts; what
the shipped defaults should be), with the out-of-sample figures as the
estimate of how they do on traffic they were not chosen on.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, overload

import pandas as pd

from controllerd.config import AutoscaleSettings, GcSettings, LoadReportSettings
from controllerd.core.model import PolicySettings
from controllerd.pipeline.load import Trace
from controllerd.pipeline.report import BASELINE, REPORT_TRACES, Targets, pct_change
from controllerd.pipeline.variants import Variant

SUMMED: Final = ("segment_hours", "excess_load", "operations", "flipflops")


@dataclass(frozen=True, slots=True)
class Fold:
    name: str
    train: Sequence[str]
    test: Sequence[str]


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


class AllBut(Sequence[str]):
    """Every name of ``names`` but ``left_out``, in order, without a copy: leaving one
    trace out of a fleet's 10,000 would otherwise hold 10,000 lists of 9,999 names.
    ``every`` is ``frozenset(names)``, shared by the folds."""

    def __init__(self, names: Sequence[str], every: frozenset[str], left_out: Collection[str]):
        self.names, self.every = names, every
        self.left_out = frozenset(left_out) & every
        self._len = len(every) - len(self.left_out)

    def __iter__(self) -> Iterator[str]:
        return (n for n in self.names if n not in self.left_out)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return tuple(self)[index]  # a copy: nothing here indexes a fold's traces

    def __contains__(self, name: object) -> bool:
        return name in self.every and name not in self.left_out


_NONE: Final = "\x00none"
"""The key of no kept set (a pick of ``extra`` traces only)."""


@dataclass(frozen=True, slots=True)
class _Pick:
    """Traces as positions: those of kept set ``kept`` but ``out``, and ``extra``."""

    kept: str | None
    out: frozenset[int]
    extra: frozenset[int]


class Sums:
    """Each variant's :data:`SUMMED` metrics per trace, summed over sets of traces exactly:
    as integers (a float is an integer times a power of two; a column's values share
    the smallest such power), so a sum does not depend on its order, and a set's total
    is a kept superset's (every trace; each trace set) minus the few it lacks. Exact,
    so candidates with equal figures on a set tie exactly, as the tie-breaks (fewer
    segment-hours, then the earlier candidate) need. Leaving one trace out of a fleet
    asks for 10,000 folds x every candidate of sums over 9,999 traces: filtering the
    frame for each took 39 s at 200 traces, growing with the square."""

    def __init__(self, metrics: pd.DataFrame, groups: Mapping[str, str] | None = None) -> None:
        names = list(dict.fromkeys(str(t) for t in metrics["trace"]))
        self._pos = {t: i for i, t in enumerate(names)}
        self._every = frozenset(names)
        self._scale: list[int] = []
        columns: list[list[tuple[int, int]]] = []
        for k in SUMMED:
            ratios = [float(x).as_integer_ratio() for x in metrics[k].tolist()]
            self._scale.append(max((d for _, d in ratios), default=1))  # powers of two
            columns.append(ratios)
        self._values: dict[str, list[list[int]]] = {}
        rows = zip(metrics["variant"].tolist(), metrics["trace"].tolist(), strict=True)
        for r, (variant, trace) in enumerate(rows):
            per = self._values.get(str(variant))
            if per is None:
                per = self._values[str(variant)] = [[0] * len(names) for _ in SUMMED]
            at = self._pos[str(trace)]
            for j, scale in enumerate(self._scale):
                n, d = columns[j][r]
                per[j][at] = n * (scale // d)
        self._group = {t: (groups or {}).get(t, "") for t in names}
        kept: dict[str | None, set[int]] = {None: set(range(len(names))), _NONE: set()}
        for t, i in self._pos.items():
            kept.setdefault(self._group[t], set()).add(i)
        self._kept = {key: frozenset(m) for key, m in kept.items()}
        self._whole: dict[tuple[str, str | None], list[int]] = {}

    def pick(self, traces: Sequence[str], group: str | None = None) -> _Pick:
        """``traces`` (those of trace set ``group`` only, if given) as positions."""
        if isinstance(traces, AllBut) and traces.every == self._every:
            out = frozenset(self._pos[t] for t in traces.left_out)
            return _Pick(group, out & self._kept.get(group, frozenset()), frozenset())
        idx = frozenset(
            self._pos[t]
            for t in traces
            if t in self._pos and (group is None or self._group[t] == group)
        )
        for key in (None, group) if group is not None else self._kept:
            members = self._kept.get(key, frozenset())
            if len(members) - len(idx) < len(idx) and idx <= members:
                return _Pick(key, members - idx, frozenset())
        return _Pick(_NONE, frozenset(), idx)

    def count(self, pick: _Pick) -> int:
        return len(self._kept.get(pick.kept, frozenset())) - len(pick.out) + len(pick.extra)

    def groups(self, traces: Sequence[str]) -> list[str]:
        """The trace sets ``traces`` come from."""
        if isinstance(traces, AllBut) and traces.every == self._every:
            out = {self._pos[t] for t in traces.left_out}
            return [
                key
                for key, members in self._kept.items()
                if key not in (None, _NONE) and not members <= out
            ]
        return list(dict.fromkeys(self._group[t] for t in traces if t in self._pos))

    def totals(self, variant: str, pick: _Pick) -> dict[str, float]:
        """The sums over the picked traces (a variant with no rows adds nothing)."""
        per = self._values.get(variant)
        if per is None:
            return dict.fromkeys(SUMMED, 0.0)
        whole = self._whole.get((variant, pick.kept))
        if whole is None:
            members = self._kept.get(pick.kept, frozenset())
            whole = [sum(c[p] for p in members) for c in per]
            self._whole[(variant, pick.kept)] = whole
        sums = [
            w - sum(c[p] for p in pick.out) + sum(c[p] for p in pick.extra)
            for w, c in zip(whole, per, strict=True)
        ]
        return self._floats(sums)

    def mixed(self, variant_of: Mapping[str, str]) -> dict[str, float]:
        """The sums over the traces of ``variant_of``, each under its own variant."""
        sums = [0] * len(SUMMED)
        for trace, variant in variant_of.items():
            per = self._values.get(variant)
            if per is not None and trace in self._pos:
                sums = [x + c[self._pos[trace]] for x, c in zip(sums, per, strict=True)]
        return self._floats(sums)

    def _floats(self, sums: Sequence[int]) -> dict[str, float]:
        return {k: x / scale for k, x, scale in zip(SUMMED, sums, self._scale, strict=True)}


def score(
    metrics: pd.DataFrame | Sums,
    variant: str,
    traces: Sequence[str],
    baseline: str = BASELINE,
    targets: Targets | None = None,
) -> Score:
    """``variant`` against ``baseline`` on the totals over ``traces``."""
    sums = metrics if isinstance(metrics, Sums) else Sums(metrics)
    pick = sums.pick(traces)
    mine, base = sums.totals(variant, pick), sums.totals(baseline, pick)
    return _score(variant, len(traces), mine, base, targets or Targets())


def _score(
    variant: str, count: int, mine: Mapping[str, float], base: Mapping[str, float], t: Targets
) -> Score:
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
        "operations": _operations_slack(ops, base_ops),
        "flipflops": (allowed_ff - ff) / allowed_ff
        if allowed_ff > 0
        else (1.0 if ff == 0 else -ff),
    }
    return Score(variant, count, cut, ratio, ops, base_ops, ff, base_ff, slack)


def _operations_slack(ops: int, base_ops: int) -> float:
    """0 at the bar ("fewer": one operation less than the baseline's), 1 at half the
    baseline's count or fewer, linear between (it was ``1 - 2/base`` at half: 0.5 for
    a baseline of 4, and zero operations on a baseline of 1 scored as at the bar)."""
    if not base_ops:
        return 1.0 if ops == 0 else -1.0
    bar, best = base_ops - 1, base_ops / 2
    if best >= bar:  # a baseline of 1 or 2: the bar is already half
        return 1.0 if ops <= bar else float(bar - ops)
    return min(1.0, (bar - ops) / (bar - best))


def choose(
    metrics: pd.DataFrame | Sums,
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
    sums = metrics if isinstance(metrics, Sums) else Sums(metrics, groups)
    whole = sums.pick(traces)
    sets = [sums.pick(traces, g) for g in sums.groups(traces)] if groups else [whole]
    targets = Targets()
    bases = [sums.totals(baseline, p) for p in sets]

    def worst(c: str) -> float:
        return min(
            _score(c, 0, sums.totals(c, p), base, targets).worst
            for p, base in zip(sets, bases, strict=True)
        )

    order = {c: i for i, c in enumerate(candidates)}
    key = {c: (worst(c), -sums.totals(c, whole)["segment_hours"], -order[c]) for c in candidates}
    best = max(candidates, key=key.__getitem__)
    return _score(
        best, len(traces), sums.totals(best, whole), sums.totals(baseline, whole), targets
    )


def folds_for(scheme: str, traces: Sequence[Trace], groups: Mapping[str, str]) -> list[Fold]:
    """The folds of ``loto`` or ``group`` over trace names (``time`` splits the traces first)."""
    names = [t.name for t in traces]
    if scheme == "loto":
        if len(names) < 2:
            raise ValueError("--cv loto needs at least two traces (one held out, one to tune on)")
        every = frozenset(names)
        return [Fold(n, AllBut(names, every, (n,)), (n,)) for n in names]
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
    """Each trace cut at ``fraction`` of its duration into ``name@train`` and ``name@test``.

    A series was scaled by its whole peak; both parts are scaled again so that the
    first part's peak is that target, the test part by the same factor. Scaled by a
    peak in the test part, the training part's load (and every figure chosen on)
    depended on held-out data: a spike to come made it light, or trivial.
    """
    out: list[Trace] = []
    for trace in traces:
        cut = trace.t_ms[0] + fraction * (trace.t_ms[-1] - trace.t_ms[0])
        first = [i for i, t in enumerate(trace.t_ms) if t <= cut]
        rest = [i for i, t in enumerate(trace.t_ms) if t > cut]
        rates = trace.rates
        if trace.kind == "series" and first:
            peak = max(r[0] for r in rates)
            train_peak = max(rates[i][0] for i in first)
            if train_peak <= 0:
                raise ValueError(f"trace {trace.name} has no load before the cut at {fraction:g}")
            again = peak / train_peak
            rates = [(a * again, b * again, c * again, d * again) for a, b, c, d in rates]
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
                    [rates[i] for i in rows],
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
    sums = Sums(metrics, groups)
    results = []
    chosen_for: dict[str, str] = {}  # held-out trace -> the choice of the fold that held it
    for fold in folds:
        best = choose(sums, candidates, fold.train, baseline, groups)
        held = score(sums, best.variant, fold.test, baseline)
        results.append(FoldResult(fold, best.variant, best, held))
        chosen_for.update(dict.fromkeys(fold.test, best.variant))
    held_out = sorted(chosen_for)
    names = {t: (groups or {}).get(t, "") for t in held_out}

    def pooled_score(members: Sequence[str]) -> Score:
        mine = sums.mixed({t: chosen_for[t] for t in members})
        base = sums.totals(baseline, sums.pick(members))
        return _score("held-out", len(members), mine, base, Targets())

    pooled = pooled_score(held_out)
    time_cv = len(folds) == 1 and folds[0].name == "time"
    final_traces = list(folds[0].train) if time_cv else list(everything)
    final = choose(sums, candidates, final_traces, baseline, groups)
    final_held = score(sums, final.variant, folds[0].test, baseline) if time_cv else None
    per_set: dict[str, Score] = {}
    if len(set(names.values())) > 1:
        for name in dict.fromkeys(names.values()):
            per_set[name] = pooled_score([t for t in held_out if names[t] == name])
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


def _cells(s: Score) -> list[str]:
    met = s.met
    mark = {k: "✅" if ok else "❌" for k, ok in met.items()}
    return [
        f"{pct_change(s.excess_cut)} {mark['excess']}",
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
    ]
    if len(result.folds) > REPORT_TRACES:
        # one row per fold is one per trace of a fleet: say how often each choice was made
        times = Counter(fr.chosen for fr in result.folds)
        lines += [
            f"{len(result.folds):,} folds; how many chose each candidate:",
            "",
            "| chosen | folds |",
            "|---|---|",
        ]
        lines += [f"| `{name}` | {count:,} |" for name, count in times.most_common()]
    else:
        lines += [
            "| held out | chosen | in: excess | in: cost | in: ops | in: flip-flops "
            "| out: excess | out: cost | out: ops | out: flip-flops |",
            "|" + "---|" * 10,
        ]
        for fr in result.folds:
            cells = [fr.fold.name, f"`{fr.chosen}`"]
            cells += _cells(fr.in_sample) + _cells(fr.out_of_sample)
            lines.append("| " + " | ".join(cells) + " |")
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
