"""The auto split/merge decision (DESIGN §6), pure: time and load come from the caller.

``decide`` is Pulsar PIP-483's evaluator rule for rule, plus our extensions,
each of which a setting turns off (:data:`controllerd.core.model.PULSAR_PARITY`;
and no ``cold_since_ms`` in samples):

* k-way splits, so a consumer burst or a k-times overload converges in one step;
* no split that would leave a child narrower than ``min_split_width``;
* no merge whose combined load reaches ``merge_combined_max_ratio`` of the split
  thresholds, nor one that leaves fewer segments than a subscription has
  consumers (either would re-split at once); ``inf`` turns both off;
* no merge on stale load (``sampled_at_ms`` older than ``load_ttl_seconds``);
* the merge window measured from ``cold_since_ms`` when the sample carries it;
* merges judged on each side's peak over ``peak_window_seconds`` (HPA's
  scale-down stabilisation), and a merge window that grows with a range's
  recent flip-flops (``merge_backoff_factor``), where a merge undone within
  ``merge_regret_seconds`` counts as one too;
* a merge leaves room for either range's largest recent rise between two of its
  records (``merge_headroom_half_life_seconds``, headroom from recent volatility);
* a split cooldown that holds back only a recent split's children
  (``range_split_cooldown``), and a fanout sized for the range's recent peak
  (``split_to_peak``) or, for a range made by recent merges, for the segments
  they replaced (``merge_undo_seconds``);
* split boundaries from the reporter's ``hashBuckets``: children of equal load,
  a hot key isolated in the narrowest allowed child, and no split that would
  not relieve it (``hot-key``).

The history those rules need (peaks, flip-flops, rises) is not decide's to keep: the
caller keeps a :class:`TopicHistory` per topic and hands it in on the samples,
so ``decide`` stays a function of its arguments. Segments are visited in
ascending id, so ties always go to the lower id.

The boundary search is hand-written (an exact dynamic programme over slice edges:
the least load of the hottest child, then the most even children): at most 32
slices and ``max_split_fanout`` children, and no library partitions a histogram
under a minimum-width constraint.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from controllerd.core.layout import MergeDepths, equal_boundaries
from controllerd.core.model import (
    MAX_BACKOFF_STEPS,
    RATE_NAMES,
    Decision,
    HashRange,
    Layout,
    LoadSample,
    Merge,
    NoAction,
    PolicySettings,
    Rates,
    Segment,
    Split,
    shown,
)


@dataclass(frozen=True, slots=True)
class PolicyInvalid:
    """Resolving the overrides gave an invalid policy: auto-scale is off for the topic."""

    detail: str


# Pulsar AutoScalePolicyOverride field -> PolicySettings field (ours are camelCase too).
_OVERRIDE_FIELDS: Final = {
    "enabled": "enabled",
    "minSegments": "min_segments",
    "maxSegments": "max_segments",
    "maxDagDepth": "max_dag_depth",
    "splitCooldownSeconds": "split_cooldown_seconds",
    "mergeCooldownSeconds": "merge_cooldown_seconds",
    "mergeWindowSeconds": "merge_window_seconds",
    "maxSplitFanout": "max_split_fanout",
    "loadTtlSeconds": "load_ttl_seconds",
    "minSplitWidth": "min_split_width",
    "mergeCombinedMaxRatio": "merge_combined_max_ratio",
    "peakWindowSeconds": "peak_window_seconds",
    "mergeBackoffFactor": "merge_backoff_factor",
    "mergeBackoffDecaySeconds": "merge_backoff_decay_seconds",
    "mergeRegretSeconds": "merge_regret_seconds",
    "mergeHeadroomHalfLifeSeconds": "merge_headroom_half_life_seconds",
    "mergeUndoSeconds": "merge_undo_seconds",
    "rangeSplitCooldown": "range_split_cooldown",
    "splitToPeak": "split_to_peak",
    "loadAwareSplits": "load_aware_splits",
}
_RATE_FIELDS: Final = ("msg_rate_in", "byte_rate_in", "msg_rate_out", "byte_rate_out")
_THRESHOLD_KEYS: Final = {
    f"{kind}{stem}Threshold": (f"{kind}_thresholds", attr)
    for kind in ("split", "merge")
    for stems, attr in zip(
        (
            ("MsgRateIn",),
            ("BytesRateIn", "ByteRateIn"),
            ("MsgRateOut",),
            ("BytesRateOut", "ByteRateOut"),
        ),
        _RATE_FIELDS,
        strict=True,
    )
    for stem in stems
}
_JAVA_INT_MIN: Final = -(2**31)
_JAVA_INT_MAX: Final = 2**31 - 1
_INT_FIELDS: Final = frozenset(
    {"min_segments", "max_segments", "max_dag_depth", "max_split_fanout", "min_split_width"}
)
_BOOL_FIELDS: Final = frozenset(
    {"enabled", "range_split_cooldown", "split_to_peak", "load_aware_splits"}
)


def resolve_policy(
    base: PolicySettings, *overrides: Mapping[str, Any] | None
) -> PolicySettings | PolicyInvalid:
    """Apply overrides (broadest first: tenant, namespace, topic) field by field.

    Absent or null fields inherit; unknown fields are ignored (lenient, like the
    broker). A wrongly typed field or an invalid resulting policy gives
    :class:`PolicyInvalid`, which ``decide`` turns into NoAction for that topic.
    """
    values: dict[str, Any] = {}
    thresholds = {
        "split_thresholds": dict(zip(_RATE_FIELDS, base.split_thresholds.as_tuple(), strict=True)),
        "merge_thresholds": dict(zip(_RATE_FIELDS, base.merge_thresholds.as_tuple(), strict=True)),
    }
    for index, override in enumerate(overrides):
        if not override:
            continue
        for key, value in override.items():
            if value is None:
                continue
            if key in _OVERRIDE_FIELDS:
                name = _OVERRIDE_FIELDS[key]
                coerced = _coerce(name, value)
                if isinstance(coerced, str):
                    return PolicyInvalid(f"override #{index + 1} {key}: {coerced}")
                values[name] = coerced.value
            elif key in _THRESHOLD_KEYS:
                table, attr = _THRESHOLD_KEYS[key]
                coerced = _coerce(attr, value)
                if isinstance(coerced, str):
                    return PolicyInvalid(f"override #{index + 1} {key}: {coerced}")
                thresholds[table][attr] = float(coerced.value)
    resolved = dataclasses.replace(
        base,
        **values,
        split_thresholds=Rates(**thresholds["split_thresholds"]),
        merge_thresholds=Rates(**thresholds["merge_thresholds"]),
    )
    errors = resolved.errors("policy")
    if errors:
        return PolicyInvalid("; ".join(errors))
    return resolved


@dataclass(frozen=True, slots=True)
class _Value:
    value: bool | int | float


def _coerce(name: str, value: Any) -> _Value | str:
    """The override value as the field's Python type, or a message saying why not.

    JSON gives ints of any size and floats for integral numbers; both are
    normalised here so that no value that passed can crash ``decide`` later.
    """
    if name in _BOOL_FIELDS:
        return (
            _Value(value) if isinstance(value, bool) else f"expected true/false, got {shown(value)}"
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"expected a number, got {shown(value)}"
    if isinstance(value, int) and name in _INT_FIELDS:
        # Pulsar's override fields are Java ints; an exact check, since float()
        # would round integers beyond 2**53.
        if not _JAVA_INT_MIN <= value <= _JAVA_INT_MAX:
            return f"{str(value)[:20]}... is out of range"
        return _Value(value)
    try:
        number = float(value)
    except OverflowError:
        return f"{str(value)[:20]}... is out of range"
    if name in _INT_FIELDS:
        if not number.is_integer():
            return f"expected an integer, got {shown(value)}"
        return _Value(int(number))
    return _Value(number)


def _within(last_ms: int | None, cooldown_s: float, now_ms: int) -> bool:
    return last_ms is not None and last_ms >= 0 and now_ms - last_ms < cooldown_s * 1000.0


def is_stale(sample: LoadSample, policy: PolicySettings, now_ms: int) -> bool:
    """True when a reporter has not vouched for the record within ``load_ttl``."""
    return sample.sampled_at_ms is not None and stale_at(sample.sampled_at_ms, policy, now_ms)


def stale_at(sampled_at_ms: int, policy: PolicySettings, now_ms: int) -> bool:
    """:func:`is_stale` of a record sampled at ``sampled_at_ms`` (the replay keeps no record)."""
    return policy.load_ttl_seconds > 0 and now_ms - sampled_at_ms > policy.load_ttl_seconds * 1000.0


def below(rates: Rates, limits: Rates) -> bool:
    """All four rates strictly below ``limits`` (a 0 limit is never satisfied)."""
    return (
        rates.msg_rate_in < limits.msg_rate_in
        and rates.byte_rate_in < limits.byte_rate_in
        and rates.msg_rate_out < limits.msg_rate_out
        and rates.byte_rate_out < limits.byte_rate_out
    )


def backoff_steps(
    flipflops: int, last_flipflop_ms: int | None, policy: PolicySettings, now_ms: int
) -> int:
    """Flip-flops a range still answers for: one is forgotten per ``merge_backoff_decay_seconds``
    of calm since the last, and at most :data:`MAX_BACKOFF_STEPS` count."""
    if flipflops <= 0:
        return 0
    if last_flipflop_ms is not None:
        flipflops -= _calm_periods(last_flipflop_ms, policy, now_ms)
    return max(0, min(flipflops, MAX_BACKOFF_STEPS))


def _calm_periods(last_flipflop_ms: int, policy: PolicySettings, now_ms: int) -> int:
    """Whole ``merge_backoff_decay_seconds`` periods from the last flip-flop to ``now_ms``
    (0 before it): each forgets one flip-flop."""
    if now_ms <= last_flipflop_ms:
        return 0
    return int((now_ms - last_flipflop_ms) // (policy.merge_backoff_decay_seconds * 1000.0))


def merge_window_ms(sample: LoadSample, policy: PolicySettings, now_ms: int) -> float:
    """How long (ms) this range must stay cold before it may merge: the merge window,
    times ``merge_backoff_factor`` per flip-flop it still answers for."""
    if policy.merge_backoff_factor > 1.0 and sample.flipflops > 0:
        steps = backoff_steps(sample.flipflops, sample.last_flipflop_ms, policy, now_ms)
        return _backed_off_ms(steps, policy)
    return policy.merge_window_seconds * 1000.0


def _backed_off_ms(steps: int, policy: PolicySettings) -> float:
    """The merge window (ms) of a range that still answers for ``steps`` flip-flops."""
    window = policy.merge_window_seconds * 1000.0
    if policy.merge_backoff_factor > 1.0:
        window *= policy.merge_backoff_factor**steps
    return window


def is_cold(sample: LoadSample | None, policy: PolicySettings, now_ms: int) -> bool:
    """Merge-eligible: a fresh sample below every merge threshold for the whole window."""
    if sample is None or is_stale(sample, policy, now_ms):
        return False
    since = sample.cold_since_ms if sample.cold_since_ms is not None else sample.changed_at_ms
    return now_ms - since >= merge_window_ms(sample, policy, now_ms) and below(
        sample.rates, policy.merge_thresholds
    )


def inherited_cold_since(
    layout: Layout, segment_id: int, cold_since: Mapping[int, int]
) -> int | None:
    """Cold-since a new segment takes over from its parents, or None.

    A merge child of two segments that were each continuously cold covers a
    range that has been cold since the later of the two; without this every
    merge would restart the merge window, and merging a cold topic down from
    n segments would take log2(n) windows instead of one. Only when every
    parent still has a cold-since (all of them were cold when sealed).
    """
    seg = layout.segments.get(segment_id)
    if seg is None or not seg.parent_ids:
        return None
    times = [cold_since.get(pid) for pid in seg.parent_ids]
    if any(t is None for t in times):
        return None
    return max(t for t in times if t is not None)


def split_score(rates: Rates, thresholds: Rates) -> tuple[float, str]:
    """Highest rate/threshold ratio and the name of the rate that gave it."""
    ratios = (
        rates.msg_rate_in / thresholds.msg_rate_in,
        rates.byte_rate_in / thresholds.byte_rate_in,
        rates.msg_rate_out / thresholds.msg_rate_out,
        rates.byte_rate_out / thresholds.byte_rate_out,
    )
    best = 0
    for i in (1, 2, 3):
        if ratios[i] > ratios[best]:
            best = i
    return ratios[best], RATE_NAMES[best]


def _fanout_cap(seg: Segment, policy: PolicySettings, active: int) -> int:
    """Most children a split of ``seg`` may have (< 2: it may not split)."""
    return min(
        policy.max_split_fanout,
        policy.max_segments - active + 1,
        seg.hash_range.width // policy.min_split_width,
    )


def _msg_rate_in(sample: LoadSample | None) -> float:
    return sample.rates.msg_rate_in if sample is not None else 0.0


def _over(rates: Rates, limits: Rates) -> bool:
    """Any rate strictly above its limit (the cheap test before computing scores)."""
    return (
        rates.msg_rate_in > limits.msg_rate_in
        or rates.byte_rate_in > limits.byte_rate_in
        or rates.msg_rate_out > limits.msg_rate_out
        or rates.byte_rate_out > limits.byte_rate_out
    )


def _by_id(segments: Sequence[Segment]) -> list[Segment]:
    return sorted(segments, key=_segment_id)


def _segment_id(segment: Segment) -> int:
    return segment.segment_id


def _too_narrow(ids: list[int], policy: PolicySettings, why: str) -> NoAction:
    return NoAction(
        "min-split-width",
        f"segment(s) {ids} {why} but a split would leave children narrower than "
        f"min_split_width ({policy.min_split_width}): likely a hot key",
    )


def _held_back(
    active: Sequence[Segment], policy: PolicySettings, now_ms: int, last_split_ms: int | None
) -> frozenset[int]:
    """With ``range_split_cooldown``: children of a split younger than the split cooldown,
    by their ``createdAtMs``, which the layout keeps. GC may have pruned a child's
    parent (and its link to it): a parentless segment that young counts as a split's
    child while the topic's own split stamp is within the cooldown, so the guarantee
    survives a failover after GC, as the topic-wide cooldown does."""
    if not policy.range_split_cooldown or policy.split_cooldown_seconds <= 0:
        return frozenset()
    cooldown_ms = policy.split_cooldown_seconds * 1000.0
    recent_split = _within(last_split_ms, policy.split_cooldown_seconds, now_ms)
    # A creation time ahead of our clock (a broker's clock runs ahead) counts as the
    # topic's split stamp (the caller caps it at when it saw the split): else the
    # children of every split by such a broker could split again at once. With no stamp
    # it holds nothing back: a hot range splits.
    return frozenset(
        s.segment_id
        for s in active
        if (
            0 <= now_ms - s.created_at_ms < cooldown_ms
            or (s.created_at_ms > now_ms and len(s.parent_ids) == 1 and recent_split)
        )
        and (len(s.parent_ids) == 1 or (not s.parent_ids and recent_split))
    )


# --- split boundaries from the load histogram ----------------------------------------------


HOT_KEY_MIN_RELIEF: Final = 0.1
"""A split whose hottest child stays over the threshold, and can split no further, must
take at least this share of the range's overload off it. Measured on ``hotkey:0.3``
(docs/backtest.md): refusing below one half left a permanently hot key's segment
wider than it could be, and its small extra load, summed over weeks, cost more
excess load than the segments it saved."""


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """Where to split one range, and the load each child is expected to carry.

    ``loads`` are in units of the split threshold (1.0 = at the threshold), from
    the histogram's proportions times the range's score; ``widths`` in hashes.
    ``refused`` is set when the split would not relieve the hot child (``hot-key``).
    """

    boundaries: tuple[int, ...]
    loads: tuple[float, ...]
    widths: tuple[int, ...]
    refused: bool = False


def _units(
    hash_range: HashRange, buckets: Sequence[float]
) -> tuple[list[int], list[int], list[float]]:
    """Slices of the histogram as (starts, widths, weights), empty slices folded into the next.

    Slice i of n covers ``[start + (i*W)//n, start + ((i+1)*W)//n - 1]`` (the
    ``hashBuckets`` wire format); when W < n some slices are empty, and their
    weight belongs to the hash the next slice starts at.
    """
    n, width, start = len(buckets), hash_range.width, hash_range.start
    starts: list[int] = []
    widths: list[int] = []
    weights: list[float] = []
    carry = 0.0
    for i in range(n):
        lo = start + (i * width) // n
        hi = start + ((i + 1) * width) // n
        if hi == lo:
            carry += buckets[i]
            continue
        starts.append(lo)
        widths.append(hi - lo)
        weights.append(buckets[i] + carry)
        carry = 0.0
    if carry and weights:
        weights[-1] += carry
    return starts, widths, weights


_TOL: Final = 1e-9
"""Relative slack when comparing loads summed in different orders (they may differ in the
last bits), so that a child exactly at the threshold counts as under it."""


def _last_starts(pw: Sequence[int], min_width: int) -> list[int]:
    """``last[i]``: the last slice edge ``j`` with ``pw[i] - pw[j] >= min_width``, or -1.

    ``pw`` is the prefix sum of the slice widths; every ``j <= last[i]`` qualifies
    too, as widths are positive.
    """
    last: list[int] = []
    j = -1
    for top in pw:
        while pw[j + 1] + min_width <= top:
            j += 1
        last.append(j)
    return last


def _hottest(
    widths: Sequence[int],
    loads: Sequence[float],
    most: int,
    min_width: int,
    floor: float = 0.0,
    least: int = 1,
) -> list[float]:
    """``best[k]`` for k = 0..``most``: the least load the hottest child can have when the
    slices are cut into exactly ``k`` children, each at least ``min_width`` wide (inf:
    no such cut). It stops (the rest left inf) after the first ``k >= least`` whose
    best is at most ``floor``: the caller wants no more children than that.

    An exact search (dynamic programming over slice edges): ``row[i]`` is the best for
    slices ``0..i-1`` in ``k`` children, the least over the last child's start ``j`` of
    the larger of ``prev[j]`` and that child's load. At most ``most`` x 32 x 32 steps,
    fewer in practice: loads are >= 0, so a child's load only grows as ``j`` moves
    left, and the scan stops once it alone is hotter than the best found.
    """
    n = len(widths)
    pw = list(itertools.accumulate(widths, initial=0))
    pl = list(itertools.accumulate(loads, initial=0.0))
    last = _last_starts(pw, min_width)
    inf = math.inf
    best = [inf] * (most + 1)
    prev = [0.0] + [inf] * n
    first = 0  # the first edge prev reaches
    for k in range(1, most + 1):
        row = [inf] * (n + 1)
        # A later row reads this one up to last[n] only; the best is at n.
        for i in (*range(first + 1, last[n] + 1), n):
            top, v = pl[i], inf
            for j in range(last[i], first - 1, -1):
                child = top - pl[j]
                if child >= v:
                    break
                f = prev[j]
                if f < v:  # then max(f, child) < v too
                    v = f if f > child else child
            row[i] = v
        best[k] = row[n]
        if k >= least and best[k] <= floor:
            break
        reached = [i for i in range(n + 1) if row[i] < inf]
        if not reached:  # no k children fit, nor any more
            break
        first, prev = reached[0], row
    return best


def _cuts(
    widths: Sequence[int], loads: Sequence[float], k: int, limit: float, min_width: int
) -> list[int] | None:
    """Cut indices (first slice of each child after the first) of exactly ``k`` children,
    each at least ``min_width`` wide and carrying at most ``limit``; None if impossible.

    Of those, the most even: the least sum of squared loads, then of squared widths
    (so load-free slices are shared out evenly rather than all left to one child).
    The same search as :func:`_hottest`, keeping where each child starts.
    """
    n = len(widths)
    pw = list(itertools.accumulate(widths, initial=0))
    pl = list(itertools.accumulate(loads, initial=0.0))
    last = _last_starts(pw, min_width)
    inf = math.inf
    cost: list[float] = [0.0] + [inf] * n
    spread: list[int] = [0] * (n + 1)
    starts: list[list[int]] = []
    first = 0  # the first edge the children so far reach
    for done in range(1, k + 1):
        row: list[float] = [inf] * (n + 1)
        row_spread = [0] * (n + 1)
        start = [-1] * (n + 1)
        room = (k - done) * min_width  # what the children still to come need
        ends = [n] if done == k else range(first + 1, last[n] + 1)
        for i in ends:
            if pw[n] - pw[i] < room:
                break
            top, wide = pl[i], pw[i]
            best, best_spread, arg = inf, 0, -1
            for j in range(last[i], first - 1, -1):
                child = top - pl[j]
                if child > limit:
                    break
                c = cost[j]
                if c == inf:
                    continue
                c += child * child
                w = wide - pw[j]
                s = spread[j] + w * w
                if c < best or (c == best and s < best_spread):
                    best, best_spread, arg = c, s, j
            row[i], row_spread[i], start[i] = best, best_spread, arg
        reached = [i for i in range(n + 1) if row[i] < inf]
        if not reached:
            return None
        first, cost, spread = reached[0], row, row_spread
        starts.append(start)
    cuts: list[int] = []
    i = n
    for start in reversed(starts):
        i = start[i]
        cuts.append(i)
    return sorted(cuts[:-1])  # the last is the first child's start, 0


def _children_count(best: Sequence[float], least: int) -> int | None:
    """How many children to cut into, from :func:`_hottest`'s ``best``: the fewest (at
    least ``least``) that bring every child under the threshold, else the fewest that
    leave the hottest child as cool as any count can; None if no count fits."""
    fits = [k for k in range(least, len(best)) if best[k] < math.inf]
    if not fits:
        return None
    for k in fits:
        if best[k] <= 1.0 + _TOL:
            return k
    low = min(best[k] for k in fits)
    return next(k for k in fits if best[k] <= low * (1.0 + _TOL))


def _balanced(
    widths: Sequence[int], loads: Sequence[float], best: Sequence[float], least: int, min_width: int
) -> list[int] | None:
    """Cuts into the children :func:`_children_count` picks, or more up to ``least`` (what recent
    merges folded into the range) if that leaves the hottest child no hotter."""
    k = _children_count(best, 2)
    if k is None:
        return None
    for more in range(min(least, len(best) - 1), k, -1):
        if best[more] <= best[k] * (1.0 + _TOL):
            k = more
            break
    return _cuts(widths, loads, k, best[k] * (1.0 + _TOL), min_width)


def _hot_block(
    widths: Sequence[int], loads: Sequence[float], hot: int, min_width: int
) -> tuple[int, int] | None:
    """The slices ``first..last`` of the child that isolates slice ``hot``: of the runs
    holding it at least ``min_width`` wide whose two sides are each empty or at least
    ``min_width`` wide (else they could not be children), the one with the least load,
    then the narrowest, then the lowest; None if there is none.

    Both sides count: widening toward the lighter neighbour alone can leave a sliver
    on the other side that would have to join the hot child.
    """
    n = len(widths)
    pw = list(itertools.accumulate(widths, initial=0))
    pl = list(itertools.accumulate(loads, initial=0.0))
    total = pw[n]
    chosen: tuple[float, int, int, int] | None = None  # (load, width, first, last)
    for first in range(hot, -1, -1):
        if 0 < pw[first] < min_width:
            continue
        last = max(hot, bisect.bisect_left(pw, pw[first] + min_width) - 1)
        while last < n and 0 < total - pw[last + 1] < min_width:
            last += 1
        if last >= n:
            continue
        key = (pl[last + 1] - pl[first], pw[last + 1] - pw[first], first, last)
        if chosen is None or key < chosen:
            chosen = key
    return None if chosen is None else (chosen[2], chosen[3])


def _floor(widths: Sequence[int], loads: Sequence[float], min_width: int) -> float:
    """Where the search for the hottest child may stop: at the threshold (the fewest
    children under it are wanted, not the coolest), or, if more, at the least load a
    child holding the hottest slice can carry (:func:`_hot_block`): no cut does better."""
    top = max(range(len(loads)), key=loads.__getitem__)
    block = _hot_block(widths, loads, top, min_width)
    least = sum(loads[block[0] : block[1] + 1]) if block is not None else 0.0
    return max(1.0, least) * (1.0 + _TOL)


def _isolated(
    widths: Sequence[int], loads: Sequence[float], children: int, min_width: int
) -> list[int] | None:
    """Cuts that give each slice over the threshold (a hot key) a child of its own, as
    narrow as ``min_width`` allows (:func:`_hot_block`), and cut each cold stretch between
    them into the fewest children under the threshold (or, if none can be, as even as
    they can be); None if there is no hot slice or it needs more than ``children``.
    """
    n = len(widths)
    blocks: list[tuple[int, int]] = []
    for hot in sorted(range(n), key=lambda j: (-loads[j], j)):
        if loads[hot] <= 1.0:
            break
        if any(a <= hot <= b for a, b in blocks):
            continue
        block = _hot_block(widths, loads, hot, min_width)
        if block is None:
            return None
        blocks.append(block)
    if not blocks:
        return None
    # Pieces in hash order: hot blocks (overlapping ones joined) and the cold stretches between.
    pieces: list[list[int]] = []  # [first, last, hot]
    pos = 0
    for first, last in sorted(blocks):
        if pieces and pieces[-1][2] and first <= pieces[-1][1]:  # overlapping hot blocks
            pieces[-1][1] = max(pieces[-1][1], last)
            pos = pieces[-1][1] + 1
            continue
        if first > pos:
            pieces.append([pos, first - 1, 0])
        pieces.append([first, last, 1])
        pos = last + 1
    if pos < n:
        pieces.append([pos, n - 1, 0])
    # A cold stretch too narrow to be a child joins the hot child before it (or after it).
    kept: list[list[int]] = []
    for piece in pieces:
        if not piece[2] and sum(widths[piece[0] : piece[1] + 1]) < min_width:
            if kept:
                kept[-1][1] = piece[1]
            else:
                piece[2] = 2  # joins the next piece
                kept.append(piece)
            continue
        if kept and kept[-1][2] == 2:
            piece[0] = kept.pop()[0]
        kept.append(piece)
    cuts: list[int] = []
    for first, last, hot in kept:
        if first > 0:
            cuts.append(first)
        if hot:
            continue
        w, ld = widths[first : last + 1], loads[first : last + 1]
        most = min(children, sum(w) // min_width)
        best = _hottest(w, ld, most, min_width, _floor(w, ld, min_width))
        k = _children_count(best, 1)
        part = _cuts(w, ld, k, best[k] * (1.0 + _TOL), min_width) if k is not None else None
        cuts.extend(first + c for c in part or ())
    if len(cuts) + 1 > children:
        return None
    return sorted(cuts)


def plan_split(
    hash_range: HashRange,
    buckets: Sequence[float],
    score: float,
    max_children: int,
    min_width: int,
    min_children: int = 2,
) -> SplitPlan | None:
    """Boundaries for a traffic split of a range whose load histogram is ``buckets``.

    The fewest children (``min_children``..``max_children``) that bring every child
    under the threshold, with boundaries that balance their loads; if no count can,
    the fewest that leave the hottest child as cool as any allowed split can. A
    slice that alone is over the threshold (a hot key) gets a child of its own, as
    narrow as ``min_width`` allows (that cut ignores ``min_children``: relieving the
    key comes first), unless that leaves a hotter child than the best balance.
    Boundaries fall on slice edges: the histogram says nothing finer. None when the
    histogram is empty (all zero) or its sum is not a finite number (it cannot give
    proportions), or no slice edge leaves two children wide enough: split equal-width.
    The plan is ``refused`` when its hottest child would still be over the
    threshold, too narrow to split again, and the split would take less than
    :data:`HOT_KEY_MIN_RELIEF` of the range's overload off it: such a split adds a
    segment without relieving the hot key (and, as the hottest child is the least
    any allowed split leaves, none would).
    """
    starts, widths, weights = _units(hash_range, buckets)
    total = sum(weights)
    if not (0.0 < total < math.inf) or len(starts) < 2 or max_children < 2:
        return None
    loads = [w / total * score for w in weights]
    least = min(min_children, max_children)
    floor = _floor(widths, loads, min_width)
    best = _hottest(widths, loads, max_children, min_width, floor, max(2, least))
    if min(best[2:]) == math.inf:
        return None
    cuts: list[int] | None = None
    if max(loads) > 1.0:
        cuts = _isolated(widths, loads, max_children, min_width) or None
        if cuts is not None:
            edges = [0, *cuts, len(starts)]
            hot_load = max(sum(loads[a:b]) for a, b in itertools.pairwise(edges))
            if hot_load > min(best[2:]) * (1.0 + _TOL):  # hot keys close together
                cuts = None
    if cuts is None:
        cuts = _balanced(widths, loads, best, least, min_width)
    if not cuts:
        return None
    edges = [0, *cuts, len(starts)]
    child_loads = tuple(sum(loads[a:b]) for a, b in itertools.pairwise(edges))
    child_widths = tuple(sum(widths[a:b]) for a, b in itertools.pairwise(edges))
    hottest = max(range(len(child_loads)), key=child_loads.__getitem__)
    # Relief: the share of the range's overload (score - 1) the split takes off its
    # hottest part; with no further split possible, too little is not worth a segment.
    relief = (score - child_loads[hottest]) / (score - 1.0) if score > 1.0 else 1.0
    refused = (
        child_loads[hottest] > 1.0
        and child_widths[hottest] < 2 * min_width
        and relief < HOT_KEY_MIN_RELIEF
    )
    return SplitPlan(tuple(starts[c] for c in cuts), child_loads, child_widths, refused)


def _children_for(
    seg: Segment, sample: LoadSample, score: float, cap: int, policy: PolicySettings, undo: int
) -> SplitPlan:
    """The split of a hot range: load-aware when its record has a histogram, else
    equal-width; at least ``undo`` children (what recent merges folded into it)."""
    k_score = score
    if policy.split_to_peak and policy.peak_window_seconds > 0 and sample.peak_rates is not None:
        k_score = max(score, split_score(sample.peak_rates, policy.split_thresholds)[0])
    least = min(cap, max(2, undo))
    if policy.load_aware_splits and sample.hash_buckets is not None:
        plan = plan_split(
            seg.hash_range, sample.hash_buckets, k_score, cap, policy.min_split_width, least
        )
        if plan is not None:
            return plan
    k = min(cap, max(2, math.ceil(k_score), least))
    return SplitPlan(equal_boundaries(seg.hash_range, k), (), ())


def _split_pass(
    active: Sequence[Segment],
    loads: Mapping[int, LoadSample],
    max_consumers: int,
    policy: PolicySettings,
    now_ms: int,
    last_split_ms: int | None = None,
) -> Split | NoAction | None:
    """A Split, a NoAction naming why a needed split is blocked, or None (nothing hot).

    With ``range_split_cooldown``, children of a recent split are held back; that is
    worked out only once something needs a split (the common case needs none).
    """
    n = len(active)
    if max_consumers > n:
        held = _held_back(active, policy, now_ms, last_split_ms)
        busiest: Segment | None = None
        narrow: list[int] = []
        waiting: list[int] = []
        for seg in _by_id(active):
            if seg.segment_id in held:
                waiting.append(seg.segment_id)
            elif _fanout_cap(seg, policy, n) < 2:
                narrow.append(seg.segment_id)
            elif busiest is None or _msg_rate_in(loads.get(seg.segment_id)) > _msg_rate_in(
                loads.get(busiest.segment_id)
            ):
                busiest = seg
        if busiest is None:
            if waiting and not narrow:
                return _cooling(waiting, policy)
            return _too_narrow(narrow, policy, f"are needed by {max_consumers} consumers")
        k = min(_fanout_cap(busiest, policy, n), max(2, max_consumers - n + 1))
        return Split(
            busiest.segment_id,
            equal_boundaries(busiest.hash_range, k),
            "consumer-count",
            f"a subscription has {max_consumers} consumers but only {n} segments are "
            f"active; {k}-way split of the busiest segment {busiest.segment_id} "
            f"({_msg_rate_in(loads.get(busiest.segment_id)):g} msg/s in)",
        )
    limits = policy.split_thresholds
    s0, s1 = limits.msg_rate_in, limits.byte_rate_in
    s2, s3 = limits.msg_rate_out, limits.byte_rate_out
    hot = []
    for seg in active:  # the hot path: _over() inlined
        sample = loads.get(seg.segment_id)
        if sample is not None:
            r = sample.rates
            if (
                r.msg_rate_in > s0
                or r.byte_rate_in > s1
                or r.msg_rate_out > s2
                or r.byte_rate_out > s3
            ):
                hot.append(seg)
    if not hot:
        return None
    held = _held_back(active, policy, now_ms, last_split_ms)
    candidates: list[tuple[float, int, Segment, str]] = []
    hot_but_narrow: list[int] = []
    waiting = []
    for seg in hot:
        score, rate = split_score(loads[seg.segment_id].rates, limits)
        if seg.segment_id in held:
            waiting.append(seg.segment_id)
        elif _fanout_cap(seg, policy, n) < 2:
            hot_but_narrow.append(seg.segment_id)
        else:
            candidates.append((-score, seg.segment_id, seg, rate))
    candidates.sort(key=lambda c: (c[0], c[1]))
    refused: list[tuple[int, SplitPlan]] = []
    undo_on = policy.merge_undo_seconds > 0
    for neg_score, sid, seg, rate in candidates:
        sample = loads[sid]
        cap = _fanout_cap(seg, policy, n)
        undo = sample.merged if undo_on else 0
        plan = _children_for(seg, sample, -neg_score, cap, policy, undo)
        if plan.refused:
            refused.append((sid, plan))
            continue
        attr = _RATE_FIELDS[RATE_NAMES.index(rate)]
        k = len(plan.boundaries) + 1
        how = (
            "load-aware split, children at "
            + "/".join(f"{x:.2f}" for x in plan.loads)
            + "x the threshold"
            if plan.loads
            else f"{k}-way split"
        )
        # said only when the undo added children, not of a split the load alone sizes
        alone = _children_for(seg, sample, -neg_score, cap, policy, 0) if undo > 1 else None
        if alone is not None and k > len(alone.boundaries) + 1:
            how += (
                f", undoing merges of the last {policy.merge_undo_seconds:g}s "
                f"that made it of {undo} segments"
            )
        return Split(
            sid,
            plan.boundaries,
            rate,
            f"segment {sid} {rate} {getattr(sample.rates, attr):g}/s is "
            f"{-neg_score:.2f}x the split threshold {getattr(limits, attr):g}/s; {how}",
        )
    if refused:
        sid, plan = refused[0]
        return NoAction(
            "hot-key",
            f"segment(s) {sorted(s for s, _ in refused)} are over a split threshold, but the "
            f"best split of segment {sid} would leave a child {plan.widths[_argmax(plan.loads)]} "
            f"hashes wide at {max(plan.loads):.2f}x the threshold: a hot key that no split "
            f"can relieve (min_split_width {policy.min_split_width})",
        )
    if waiting and not hot_but_narrow:
        return _cooling(sorted(waiting), policy)
    return _too_narrow(sorted(hot_but_narrow), policy, "are over a split threshold")


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def _cooling(ids: list[int], policy: PolicySettings) -> NoAction:
    return NoAction(
        "split-cooldown",
        f"segment(s) {ids} need a split but were created by a split less than "
        f"{policy.split_cooldown_seconds:g}s ago",
    )


def _hot_segments(
    active: Sequence[Segment],
    loads: Mapping[int, LoadSample],
    max_consumers: int,
    policy: PolicySettings,
) -> list[int]:
    if max_consumers > len(active):
        return [s.segment_id for s in active]
    limits = policy.split_thresholds
    return sorted(
        seg.segment_id
        for seg in active
        if (sample := loads.get(seg.segment_id)) is not None and _over(sample.rates, limits)
    )


def _combined_ok(a: Rates, b: Rates, policy: PolicySettings) -> bool:
    ratio, split = policy.merge_combined_max_ratio, policy.split_thresholds
    if math.isinf(ratio):
        return True
    return (
        a.msg_rate_in + b.msg_rate_in < ratio * split.msg_rate_in
        and a.byte_rate_in + b.byte_rate_in < ratio * split.byte_rate_in
        and a.msg_rate_out + b.msg_rate_out < ratio * split.msg_rate_out
        and a.byte_rate_out + b.byte_rate_out < ratio * split.byte_rate_out
    )


def _peak(sample: LoadSample) -> Rates:
    """The sample's rates, raised to its window peak where that is higher."""
    p, r = sample.peak_rates, sample.rates
    if p is None:
        return r
    return Rates(
        max(p.msg_rate_in, r.msg_rate_in),
        max(p.byte_rate_in, r.byte_rate_in),
        max(p.msg_rate_out, r.msg_rate_out),
        max(p.byte_rate_out, r.byte_rate_out),
    )


def _cold_flags(
    active: Sequence[Segment],
    loads: Mapping[int, LoadSample],
    policy: PolicySettings,
    now_ms: int,
) -> list[bool]:
    """``is_cold`` for every active segment, inlined: this loop is the policy's hot path.

    The cheapest test that usually fails (msg rate in) runs first.
    """
    m = policy.merge_thresholds
    m0, m1, m2, m3 = m.msg_rate_in, m.byte_rate_in, m.msg_rate_out, m.byte_rate_out
    window_ms = policy.merge_window_seconds * 1000.0
    ttl_ms = policy.load_ttl_seconds * 1000.0
    backoff = policy.merge_backoff_factor > 1.0
    flags = []
    for seg in active:
        sample = loads.get(seg.segment_id)
        if sample is None:
            flags.append(False)
            continue
        r = sample.rates
        since = sample.cold_since_ms if sample.cold_since_ms is not None else sample.changed_at_ms
        sampled = sample.sampled_at_ms
        window = (
            merge_window_ms(sample, policy, now_ms)
            if backoff and sample.flipflops > 0
            else window_ms
        )
        flags.append(
            r.msg_rate_in < m0
            and r.byte_rate_in < m1
            and r.msg_rate_out < m2
            and r.byte_rate_out < m3
            and now_ms - since >= window
            and not (ttl_ms > 0 and sampled is not None and now_ms - sampled > ttl_ms)
        )
    return flags


def _headroom_short(sa: LoadSample, sb: LoadSample, policy: PolicySettings) -> float:
    """How far (in split thresholds) the pair's combined load plus both recent rises
    reaches past ``merge_combined_max_ratio``; < 0: the merge leaves enough room (-inf
    with no rise, or with the setting off)."""
    rise = sa.rise + sb.rise
    off = policy.merge_headroom_half_life_seconds <= 0
    if rise <= 0 or off or math.isinf(policy.merge_combined_max_ratio):
        return -math.inf
    both = Rates(*(x + y for x, y in zip(sa.rates.as_tuple(), sb.rates.as_tuple(), strict=True)))
    combined = split_score(both, policy.split_thresholds)[0]
    return combined + rise - policy.merge_combined_max_ratio


def _merge_pass(
    layout: Layout,
    active: Sequence[Segment],
    loads: Mapping[int, LoadSample],
    policy: PolicySettings,
    now_ms: int,
) -> Merge | NoAction | None:
    """The coldest ripe pair's merge; NoAction ``merge-headroom`` if every ripe pair
    was refused only for a recent rise; None if no pair is ripe."""
    cold = _cold_flags(active, loads, policy, now_ms)
    depths: MergeDepths | None = None
    best: tuple[float, int, int] | None = None
    short: tuple[int, int, float] | None = None  # a pair refused for headroom
    on_peak = policy.peak_window_seconds > 0
    for i in range(len(active) - 1):
        if not (cold[i] and cold[i + 1]):
            continue
        a, b = active[i], active[i + 1]
        if depths is None:
            depths = MergeDepths(layout.segments)
        if depths[a.segment_id] >= policy.max_dag_depth:
            continue
        if depths[b.segment_id] >= policy.max_dag_depth:
            continue
        sa, sb = loads[a.segment_id], loads[b.segment_id]
        ra, rb = sa.rates, sb.rates
        if on_peak:
            if not _combined_ok(_peak(sa), _peak(sb), policy):
                continue
        elif not _combined_ok(ra, rb, policy):
            continue
        if (sa.rise or sb.rise) and _headroom_short(sa, sb, policy) >= 0:
            short = short or (a.segment_id, b.segment_id, sa.rise + sb.rise)
            continue
        key = (
            sum(ra.as_tuple()) + sum(rb.as_tuple()),
            min(a.segment_id, b.segment_id),
            max(a.segment_id, b.segment_id),
        )
        if best is None or key < best:
            best = key
    if best is None:
        if short is None:
            return None
        return NoAction(
            "merge-headroom",
            f"adjacent segments {short[0]} and {short[1]} are cold, but their combined load "
            f"plus their recent rise ({short[2]:.2f} split thresholds) would reach "
            f"{policy.merge_combined_max_ratio:g} of a split threshold",
        )
    first, second = (
        (best[1], best[2])
        if layout.segments[best[1]].hash_range.start < layout.segments[best[2]].hash_range.start
        else (best[2], best[1])
    )
    return Merge(
        first,
        second,
        "cold",
        f"adjacent segments {first} and {second} have been below every merge threshold for "
        f">= {policy.merge_window_seconds:g}s (combined load {best[0]:g}/s)",
    )


def decide(
    layout: Layout,
    loads: Mapping[int, LoadSample],
    consumers: Mapping[str, int],
    policy: PolicySettings | PolicyInvalid,
    now_ms: int,
    last_split_ms: int | None = None,
    last_merge_ms: int | None = None,
) -> Decision:
    """Decide one topic's next operation.

    Args:
        layout: a layout that holds the invariants (``layout.check``).
        loads: load samples by segment id; a missing sample is never cold. The
            history fields (``peak_rates``, ``flipflops``, ``merged``) come from the
            caller's :class:`TopicHistory`; without them those rules are off.
        consumers: consumer count per STREAM/CHECKPOINT subscription (QUEUE
            subscriptions must be left out by the caller); the max is used.
        policy: the resolved policy for this topic.
        now_ms: the caller's clock.
        last_split_ms, last_merge_ms: cooldown stamps (None or -1: never).
    """
    if isinstance(policy, PolicyInvalid):
        return NoAction("policy-invalid", f"auto-scale off for this topic: {policy.detail}")
    if not policy.enabled:
        return NoAction("disabled", "auto-scale is disabled for this topic")
    active = layout.active_segments()
    n = len(active)
    max_consumers = max(consumers.values(), default=0)
    blocked: NoAction | None = None
    topic_cooldown = not policy.range_split_cooldown and _within(
        last_split_ms, policy.split_cooldown_seconds, now_ms
    )
    if n >= policy.max_segments or topic_cooldown:
        hot = _hot_segments(active, loads, max_consumers, policy)
        if hot:
            at_max = n >= policy.max_segments
            blocked = NoAction(
                "max-segments" if at_max else "split-cooldown",
                f"segment(s) {hot} need a split but "
                + (
                    f"{n} segments is max_segments"
                    if at_max
                    else f"the last split was less than {policy.split_cooldown_seconds:g}s ago"
                ),
            )
    else:
        result = _split_pass(active, loads, max_consumers, policy, now_ms, last_split_ms)
        if isinstance(result, Split):
            return result
        blocked = result
    resplit_guard = not math.isinf(policy.merge_combined_max_ratio)
    if n > policy.min_segments and resplit_guard and n - 1 < max_consumers:
        # Ours: a merge would leave a consumer without a segment, and the
        # consumer-count rule would split again at once (a flip-flop).
        blocked = blocked or NoAction(
            "consumers",
            f"{n} active segments serve a subscription with {max_consumers} consumers; "
            "a merge would be split again at once",
        )
    elif n > policy.min_segments:
        if _within(last_merge_ms, policy.merge_cooldown_seconds, now_ms):
            merged = _merge_pass(layout, active, loads, policy, now_ms) if blocked is None else None
            if isinstance(merged, NoAction):
                blocked = merged
            elif merged is not None:
                blocked = NoAction(
                    "merge-cooldown",
                    f"a cold pair could merge but the last merge was less than "
                    f"{policy.merge_cooldown_seconds:g}s ago",
                )
        else:
            merged = _merge_pass(layout, active, loads, policy, now_ms)
            if isinstance(merged, Merge):
                return merged
            blocked = blocked or merged
    return blocked or NoAction("balanced", f"{n} active segments; no split or merge is due")


def may_act(
    layout: Layout,
    loads: Mapping[int, LoadSample],
    consumers: Mapping[str, int],
    policy: PolicySettings | PolicyInvalid,
) -> bool:
    """False only when ``decide`` answers NoAction with these inputs at *any* time.

    Every operation needs a record over a split threshold, more consumers than
    segments, or two adjacent records below every merge threshold; time only
    gates them. A cheap pre-check for callers that re-evaluate on every change
    (the backtest's replay): kept beside ``decide`` so the two change together.
    """
    if isinstance(policy, PolicyInvalid) or not policy.enabled:
        return False
    active = layout.active_segments()
    if max(consumers.values(), default=0) > len(active):
        return True
    s, m = policy.split_thresholds, policy.merge_thresholds
    merging = len(active) > policy.min_segments
    was_cold = False
    for seg in active:
        sample = loads.get(seg.segment_id)
        if sample is None:
            was_cold = False
            continue
        r = sample.rates
        if (
            r.msg_rate_in > s.msg_rate_in
            or r.byte_rate_in > s.byte_rate_in
            or r.msg_rate_out > s.msg_rate_out
            or r.byte_rate_out > s.byte_rate_out
        ):
            return True
        cold = (
            r.msg_rate_in < m.msg_rate_in
            and r.byte_rate_in < m.byte_rate_in
            and r.msg_rate_out < m.msg_rate_out
            and r.byte_rate_out < m.byte_rate_out
        )
        if merging and cold and was_cold:
            return True
        was_cold = cold
    return False


def may_act_now(
    layout: Layout,
    loads: Mapping[int, LoadSample],
    consumers: Mapping[str, int],
    policy: PolicySettings | PolicyInvalid,
    now_ms: int,
) -> bool:
    """False only when ``decide`` answers NoAction at ``now_ms``, whatever the rates.

    :func:`may_act` at one instant: no subscription has more consumers than
    segments, no record is over a split threshold, and no two adjacent records
    are ripe for a merge (below every merge threshold, fresh, and past their
    merge window, as ``decide`` judges it). Then every rule ``decide`` has is
    out, and the records' rates matter only through which side of each
    threshold they are on. Until :func:`next_ripe_ms`, no pair ripens unless a
    record crosses a merge threshold, its cold-since or changedAt moves
    earlier, or a stale record is refreshed: a caller may carry a False across
    writes that do none of these and cross no split threshold (the backtest's
    replay does, while two cold segments wait for their merge window).
    """
    if isinstance(policy, PolicyInvalid) or not policy.enabled:
        return False
    active = layout.active_segments()
    if _hot_segments(active, loads, max(consumers.values(), default=0), policy):
        return True  # decide's split rules (more consumers than segments counts as hot)
    if len(active) <= policy.min_segments:
        return False
    ripe = _cold_flags(active, loads, policy, now_ms)
    return any(a and b for a, b in itertools.pairwise(ripe))


def next_decision_ms(
    layout: Layout,
    loads: Mapping[int, LoadSample],
    policy: PolicySettings | PolicyInvalid,
    now_ms: int,
    last_split_ms: int | None = None,
    last_merge_ms: int | None = None,
) -> int | None:
    """The earliest time after ``now_ms`` at which ``decide`` could answer differently
    with the same inputs, or None if time alone never changes its answer.

    (``LoadSample.merged`` is an input: :meth:`TopicHistory.annotate` stops passing it
    ``merge_undo_seconds`` after the merge. It only shapes a split, never decides
    whether one happens, so no wake is listed for it.)

    Time enters ``decide`` only through cooldowns, merge windows (and their
    backoff decay), record staleness and the decay of recent rises; this lists
    when each runs out. It is
    conservative: a time may come before any change, never after one. A caller
    that holds its inputs still (the backtest's event-driven replay, a daemon
    timer) need not decide again before it.
    """
    if isinstance(policy, PolicyInvalid) or not policy.enabled:
        return None
    found: list[int] = []

    def at_or_after(base: int, duration_ms: float = 0.0) -> None:
        # "now - base >= duration" turns true here (see _ends_ms)
        if (t := _ends_ms(base, duration_ms)) > now_ms:
            found.append(t)

    split_ms = policy.split_cooldown_seconds * 1000.0
    if last_split_ms is not None and last_split_ms >= 0:
        at_or_after(last_split_ms, split_ms)
    if last_merge_ms is not None and last_merge_ms >= 0:
        at_or_after(last_merge_ms, policy.merge_cooldown_seconds * 1000.0)
    active = layout.active_segments()
    for seg in active:
        if policy.range_split_cooldown and len(seg.parent_ids) <= 1:
            at_or_after(seg.created_at_ms)
            at_or_after(seg.created_at_ms, split_ms)
        sample = loads.get(seg.segment_id)
        if sample is not None:
            found.extend(_record_wakes(sample, policy, now_ms))
    if policy.merge_headroom_half_life_seconds > 0:
        for a, b in itertools.pairwise(active):
            sa, sb = loads.get(a.segment_id), loads.get(b.segment_id)
            if sa is not None and sb is not None:
                roomy = _headroom_ms(sa, sb, policy, now_ms)
                if roomy is not None:
                    found.append(roomy)
    return min(found) if found else None


def _ends_ms(base: int, duration_ms: float) -> int:
    """The first whole ms at which ``now - base >= duration_ms`` holds. Exact: the sum
    ``base + duration_ms`` in floats rounds at epoch stamps (1.76e12 + 7920000.000000001
    gives 1760007920000.0), and a wake 1 ms early found the condition still false and
    was dropped as past: the merge or split waited for an unrelated later wake."""
    return base + math.ceil(duration_ms)


def _headroom_ms(sa: LoadSample, sb: LoadSample, policy: PolicySettings, now_ms: int) -> int | None:
    """When the pair's recent rises will have decayed enough for ``merge-headroom`` to let
    it merge (with these records), or None if it already does or never will. Rounded
    down, so it is never late: both rises halve together, so their sum at ``now + d`` is
    ``(sa.rise + sb.rise) * 2 ** (-d / half_life)``."""
    rise = sa.rise + sb.rise
    over = _headroom_short(sa, sb, policy)
    if over < 0:
        return None
    room = rise - over  # what the rise must fall below
    if room <= 0:
        return None  # the combined load alone reaches the ratio: no decay helps
    half_life_ms = policy.merge_headroom_half_life_seconds * 1000.0
    return max(now_ms + 1, math.floor(now_ms + half_life_ms * math.log2(rise / room)))


def _record_wakes(sample: LoadSample, policy: PolicySettings, now_ms: int) -> list[int]:
    """The times after ``now_ms`` at which time alone changes how ``decide`` judges this
    record: its merge window ends, it goes stale, its backoff forgets a flip-flop."""
    found: list[int] = []
    since = sample.cold_since_ms if sample.cold_since_ms is not None else sample.changed_at_ms
    ends = _ends_ms(since, merge_window_ms(sample, policy, now_ms))
    if ends > now_ms:
        found.append(ends)
    ttl_ms = policy.load_ttl_seconds * 1000.0
    if ttl_ms > 0 and sample.sampled_at_ms is not None:
        # "now - sampled > ttl" turns true just after it (integers, exact as in _ends_ms)
        stale = sample.sampled_at_ms + math.floor(ttl_ms) + 1
        if stale > now_ms:
            found.append(stale)
    if policy.merge_backoff_factor > 1.0 and sample.flipflops > 0:
        last = sample.last_flipflop_ms
        if last is not None:  # a flip-flop stamped ahead of now_ms: from `last` on
            forgets = _next_calm_ms(last, policy, now_ms)
            if forgets > now_ms:
                found.append(forgets)
    return found


def _next_calm_ms(last_flipflop_ms: int, policy: PolicySettings, now_ms: int) -> int:
    """The first ms after ``now_ms`` at which :func:`_calm_periods` counts one more period,
    by that function's own arithmetic: a product of floats rounded either way would
    wake a ms early (the wake then dropped as past) or late."""
    decay_ms = policy.merge_backoff_decay_seconds * 1000.0
    want = _calm_periods(last_flipflop_ms, policy, now_ms) + 1
    at = max(now_ms + 1, last_flipflop_ms + math.ceil(want * decay_ms))
    while at - 1 > now_ms and _calm_periods(last_flipflop_ms, policy, at - 1) >= want:
        at -= 1
    while _calm_periods(last_flipflop_ms, policy, at) < want:
        at += 1
    return at


def next_ripe_ms(
    layout: Layout,
    loads: Mapping[int, LoadSample],
    policy: PolicySettings | PolicyInvalid,
    now_ms: int,
) -> int | None:
    """The earliest time after ``now_ms`` at which a record below every merge threshold
    could be past its merge window, with the same records; None if none could.

    While :func:`may_act_now` is False, time can change ``decide``'s answer only by
    ripening a pair, so it answers NoAction until then. The part of
    :func:`next_decision_ms` that concerns cold records (their window's end, its
    backoff decay steps, when they go stale), and no later than it for them.
    """
    if isinstance(policy, PolicyInvalid) or not policy.enabled:
        return None
    found: list[int] = []
    limits = policy.merge_thresholds
    for seg in layout.active_segments():
        sample = loads.get(seg.segment_id)
        if sample is not None and below(sample.rates, limits):
            found.extend(_record_wakes(sample, policy, now_ms))
    return min(found) if found else None


# --- the history decide's history-based rules read ------------------------------------------


@dataclass(slots=True)
class _Range:
    """One segment's history: per rate, a deque of (t_ms, value) with values decreasing
    (a monotonic queue: its head is the window's maximum; none without a peak window:
    four empty deques are 2.5 KiB a range), its flip-flops, and its largest recent
    rise (``rise`` at ``rise_ms``, decaying from then) with the split score of its
    last record (``score``, what the next record rises from). ``score`` is only ever
    this range's own record's, kept in memory: a new range (split or merge child) or a
    new leader starts without one, since a score guessed from a parent, or stored at the
    last operation, would show the next record rising by a jump that never happened.
    ``merged`` is how many segments the range's merges folded into it, the last at
    ``merged_ms`` (0: it is not a merge's child)."""

    peaks: tuple[deque[tuple[int, float]], ...] = ()
    flipflops: int = 0
    last_flipflop_ms: int | None = None
    rise: float = 0.0
    rise_ms: int = 0
    score: float | None = None
    merged: int = 0
    merged_ms: int = 0


def _decayed(rise: float, since_ms: int, policy: PolicySettings, now_ms: int) -> float:
    """``rise`` measured at ``since_ms``, halved every ``merge_headroom_half_life_seconds``."""
    half_life_ms = policy.merge_headroom_half_life_seconds * 1000.0
    if rise <= 0 or half_life_ms <= 0:
        return 0.0
    return rise * math.pow(2.0, -max(0, now_ms - since_ms) / half_life_ms)


def observes_records(policy: PolicySettings) -> bool:
    """Whether :meth:`TopicHistory.observe` keeps anything under ``policy`` (a peak window,
    the rise headroom): its caller must then feed it every record written."""
    return policy.peak_window_seconds > 0 or policy.merge_headroom_half_life_seconds > 0


class TopicHistory:
    """What the history-based rules need, kept by the caller for one topic (pure, no clock).

    ``decide`` is a function of its inputs; the peak of each range's load over
    ``peak_window_seconds`` and its flip-flops are history, so the caller keeps
    them here and :meth:`annotate` copies them onto the samples it passes in.
    The backtest simulator uses it as the daemon would:

    * :meth:`observe` every load record written (heartbeats, same rates, may be skipped);
    * :meth:`applied` after each split or merge is applied;
    * :meth:`forget` segments no longer active;
    * :meth:`annotate` each sample before ``decide``.

    A split child inherits its parent's peaks scaled by its share of the
    parent's load (from the histogram when the record has one, else by width); a
    merge child inherits the sum of its parents' peaks, stamped with the later
    of their times. A flip-flop is a split of a merge child, or a merge of a
    split child, within that range's merge window of its creation; children
    inherit the flip-flops their parent still answers for. With ``merge_undo_seconds``
    a merge child counts the segments its merges folded in (a parent merged within
    that time of this merge brings its own count), for the split that may undo them.
    Losing this state
    (a restart) only makes merges judge the current load and the plain window.
    """

    def __init__(self) -> None:
        self._ranges: dict[int, _Range] = {}

    def __contains__(self, segment_id: object) -> bool:
        return segment_id in self._ranges

    def observe(self, segment_id: int, rates: Rates, now_ms: int, policy: PolicySettings) -> None:
        """A record of ``rates`` was written for ``segment_id`` at ``now_ms``."""
        if not observes_records(policy):
            return
        window_ms = policy.peak_window_seconds * 1000.0
        state = self._ranges.get(segment_id)
        if state is None:
            state = self._ranges[segment_id] = _Range()
        if policy.merge_headroom_half_life_seconds > 0:
            score = split_score(rates, policy.split_thresholds)[0]
            if state.score is not None:
                jump = score - state.score
                if jump > _decayed(state.rise, state.rise_ms, policy, now_ms):
                    state.rise, state.rise_ms = jump, now_ms
            state.score = score
        if window_ms <= 0:
            return
        if not state.peaks:
            state.peaks = (deque(), deque(), deque(), deque())
        for queue, value in zip(state.peaks, rates.as_tuple(), strict=True):
            while queue and queue[-1][1] <= value:
                queue.pop()
            queue.append((now_ms, value))
            while queue[0][0] < now_ms - window_ms:
                queue.popleft()

    def peak(self, segment_id: int, now_ms: int, policy: PolicySettings) -> Rates | None:
        """Per-rate maximum of the records within the window, or None if none is."""
        state = self._ranges.get(segment_id)
        window_ms = policy.peak_window_seconds * 1000.0
        if state is None or window_ms <= 0:
            return None
        _expire(state, now_ms - window_ms)
        values = [queue[0][1] if queue else 0.0 for queue in state.peaks]
        if not any(state.peaks):
            return None
        return Rates(*values)

    def next_expiry_ms(self, now_ms: int, policy: PolicySettings) -> int | None:
        """When the oldest peak still counted leaves the window (the peak may drop then)."""
        window_ms = policy.peak_window_seconds * 1000.0
        if window_ms <= 0:
            return None
        for state in self._ranges.values():
            _expire(state, now_ms - window_ms)
        heads = [q[0][0] for r in self._ranges.values() for q in r.peaks if q]
        if not heads:
            return None
        return max(now_ms + 1, math.floor(min(heads) + window_ms) + 1)

    def annotate(
        self, segment_id: int, sample: LoadSample, now_ms: int, policy: PolicySettings
    ) -> LoadSample:
        """``sample`` with this range's peak, flip-flops and recent rise (unchanged if it
        has none)."""
        state = self._ranges.get(segment_id)
        if state is None:
            return sample
        peak = self.peak(segment_id, now_ms, policy)
        rise = _decayed(state.rise, state.rise_ms, policy, now_ms)
        merged = _recent_merges(state, policy, now_ms)
        if state.merged and not merged:  # past merge_undo_seconds: no split will use it
            state.merged = state.merged_ms = 0
            idle = state.flipflops == 0 and state.last_flipflop_ms is None and not state.rise
            if idle and state.score is None and not any(state.peaks):
                del self._ranges[segment_id]  # every merge leaves one: do not keep it
        if peak is None and state.flipflops == 0 and rise == 0 and merged == 0:
            return sample
        return sample.with_history(peak, state.flipflops, state.last_flipflop_ms, rise, merged)

    def to_json(self) -> dict[str, Any]:
        """The whole history as JSON, for a caller that persists it across a failover."""
        return {
            str(sid): {
                "peaks": [[[t, v] for t, v in q] for q in state.peaks],
                "flipflops": state.flipflops,
                "lastFlipflopMs": state.last_flipflop_ms,
                "rise": state.rise,
                "riseMs": state.rise_ms,
                **({"merged": state.merged, "mergedMs": state.merged_ms} if state.merged else {}),
            }
            for sid, state in sorted(self._ranges.items())
        }

    @classmethod
    def from_json(cls, obj: Any) -> TopicHistory:
        """The inverse of :meth:`to_json`; anything malformed is dropped (history is advice)."""
        history = cls()
        if not isinstance(obj, Mapping):
            return history
        for key, raw in obj.items():
            try:
                sid = int(key)
                peaks = tuple(
                    deque((_stamp(t), _finite(v)) for t, v in queue)
                    for queue in raw.get("peaks", [])
                )
                last = raw.get("lastFlipflopMs")
                state = _Range(
                    flipflops=_count(raw.get("flipflops", 0)),
                    last_flipflop_ms=_stamp(last) if last is not None else None,
                    rise=_finite(raw.get("rise", 0.0)),
                    rise_ms=_stamp(raw.get("riseMs", 0)),
                    merged=_count(raw.get("merged", 0)),
                    merged_ms=_stamp(raw.get("mergedMs", 0)),
                )
            except (TypeError, ValueError, AttributeError):
                continue
            if len(peaks) == 4:
                state.peaks = peaks
            history._ranges[sid] = state
        return history

    def forget(self, keep: Iterable[int]) -> None:
        """Drop every segment not in ``keep`` (the active ones)."""
        wanted = set(keep)
        for sid in [s for s in self._ranges if s not in wanted]:
            del self._ranges[sid]

    def applied(
        self,
        before: Layout,
        decision: Split | Merge,
        after: Layout,
        now_ms: int,
        policy: PolicySettings,
        loads: Mapping[int, LoadSample],
    ) -> bool:
        """Carry history over to the new segments of ``decision``; True if it was a flip-flop
        (by this class's definition, which judges against the range's merge window, or
        ``merge_regret_seconds`` when that is longer and the split undoes a merge)."""
        if isinstance(decision, Split):
            parents: tuple[int, ...] = (decision.segment_id,)
            parent = before.segments[decision.segment_id]
            children = after.segments[decision.segment_id].child_ids
        else:
            parents = (decision.a, decision.b)
            merged = after.segments[decision.a].child_ids
            children = merged[:1]
        states = [self._ranges.get(p) for p in parents]
        window_ms = policy.peak_window_seconds * 1000.0
        for state in states:
            if state is not None:
                _expire(state, now_ms - window_ms)
        flipflop = False
        carried: list[tuple[int, int | None]] = []  # (flip-flops answered for, clock start)
        for pid, state in zip(parents, states, strict=True):
            seg = before.segments[pid]
            count = state.flipflops if state is not None else 0
            last = state.last_flipflop_ms if state is not None else None
            steps = backoff_steps(count, last, policy, now_ms)
            if steps:  # a count without a time (from an old record) never decays
                carried.append((steps, None if last is None else _rebased(last, policy, now_ms)))
            undoes = 2 if isinstance(decision, Split) else 1
            window = _backed_off_ms(steps, policy)
            if undoes == 2:  # a split of a merged range: did the merge pay for itself?
                window = max(window, policy.merge_regret_seconds * 1000.0)
            if len(seg.parent_ids) == undoes and now_ms - seg.created_at_ms < window:
                flipflop = True
        count, last_ff = max(carried, key=_latest) if carried else (0, None)
        if flipflop:
            count, last_ff = count + 1, now_ms
        if isinstance(decision, Split):
            state = states[0]
            shares = _child_shares(parent, after, children, loads.get(parent.segment_id))
            for child, share in zip(children, shares, strict=True):
                new = _Range(flipflops=count, last_flipflop_ms=last_ff)
                if state is not None:
                    new.peaks = tuple(deque((t, v * share) for t, v in q) for q in state.peaks)
                    new.rise, new.rise_ms = state.rise * share, state.rise_ms
                if count or any(new.peaks) or new.rise:
                    self._ranges[child] = new
        else:
            new = _Range(flipflops=count, last_flipflop_ms=last_ff)
            if policy.merge_undo_seconds > 0:
                # each parent is the segments its own recent merges folded in, or itself
                new.merged = sum(
                    max(1, _recent_merges(p, policy, now_ms)) if p is not None else 1
                    for p in states
                )
                new.merged_ms = now_ms
            peaks = []
            for k in range(4):
                heads = [s.peaks[k][0] for s in states if s is not None and s.peaks and s.peaks[k]]
                if heads:
                    peaks.append(deque([(max(t for t, _ in heads), sum(v for _, v in heads))]))
                else:
                    peaks.append(deque())
            new.peaks = tuple(peaks) if any(peaks) else ()
            # the merged range may rise by what both parts did (each decayed to now)
            new.rise = sum(
                _decayed(p.rise, p.rise_ms, policy, now_ms) for p in states if p is not None
            )
            new.rise_ms = now_ms
            if count or any(new.peaks) or new.rise or new.merged:
                self._ranges[children[0]] = new
        for pid in parents:
            self._ranges.pop(pid, None)
        return flipflop


def _recent_merges(state: _Range, policy: PolicySettings, now_ms: int) -> int:
    """Segments folded into the range by merges within ``merge_undo_seconds`` (0: none)."""
    undo_ms = policy.merge_undo_seconds * 1000.0
    if state.merged < 2 or undo_ms <= 0 or now_ms - state.merged_ms > undo_ms:
        return 0
    return state.merged


def _count(value: Any) -> int:
    """A stored count: an int >= 0 (not a bool) that fits a signed 64-bit long, else
    ValueError (the range is dropped). A larger one would fail the next write of the
    history (orjson), and that write follows every layout change of the topic."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError(f"not a count: {shown(value)}")
    return value


def _finite(value: Any) -> float:
    """A stored rise or peak: a finite number >= 0, else ValueError (the range is dropped)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"not a number: {shown(value)}")
    number = float(value)
    if not (number >= 0 and math.isfinite(number)):
        raise ValueError(f"not a finite number >= 0: {shown(value)}")
    return number


def _stamp(value: Any) -> int:
    """A stored time (ms): an integer that fits a signed 64-bit long, else ValueError (the
    range is dropped). A larger one would fail the next write of the history (orjson)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"not a time: {shown(value)}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"not a whole number of ms: {shown(value)}")
    stamp = int(value)
    if not -(2**63) <= stamp < 2**63:
        raise ValueError(f"out of range: {shown(value)}")
    return stamp


def _latest(carried: tuple[int, int | None]) -> tuple[int, float]:
    """Order carried flip-flops: the larger count, then the later clock (none = never decays)."""
    steps, start = carried
    return steps, math.inf if start is None else start


def _rebased(last_ms: int, policy: PolicySettings, now_ms: int) -> int:
    """The calm clock of a range whose decayed count is stored: moved on by the decay
    periods already applied (:func:`_calm_periods`), so they are not applied again."""
    decay_ms = policy.merge_backoff_decay_seconds * 1000.0
    return last_ms + int(_calm_periods(last_ms, policy, now_ms) * decay_ms)


def _expire(state: _Range, oldest_ms: float) -> None:
    """Drop the peaks recorded before ``oldest_ms``: they left the window."""
    for queue in state.peaks:
        while queue and queue[0][0] < oldest_ms:
            queue.popleft()


def _child_shares(
    parent: Segment, after: Layout, children: Sequence[int], sample: LoadSample | None
) -> list[float]:
    """Each split child's share of the parent's load: by histogram if known, else by width."""
    width = parent.hash_range.width
    ranges = [after.segments[c].hash_range for c in children]
    buckets = sample.hash_buckets if sample is not None else None
    if buckets:
        starts, widths, weights = _units(parent.hash_range, buckets)
        total = sum(weights)
        if 0.0 < total < math.inf:  # else no proportions, as in plan_split
            shares = []
            for rng in ranges:
                got = 0.0
                for s, w, x in zip(starts, widths, weights, strict=True):
                    overlap = min(s + w - 1, rng.end) - max(s, rng.start) + 1
                    if overlap > 0:
                        got += x * overlap / w
                shares.append(got / total)
            return shares
    return [r.width / width for r in ranges]
