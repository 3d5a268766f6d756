"""The auto split/merge decision (DESIGN §6), pure: time and load come from the caller.

``decide`` is Pulsar PIP-483's evaluator rule for rule, plus our extensions,
each of which a setting turns off (``max_split_fanout = 2``,
``min_split_width = 1``, ``merge_combined_max_ratio = inf``,
``load_ttl_seconds = 0``, no ``cold_since_ms`` in samples):

* k-way splits, so a consumer burst or a k-times overload converges in one step;
* no split that would leave a child narrower than ``min_split_width``;
* no merge whose combined load reaches ``merge_combined_max_ratio`` of the split
  thresholds, nor one that leaves fewer segments than a subscription has
  consumers (either would re-split at once); ``inf`` turns both off;
* no merge on stale load (``sampled_at_ms`` older than ``load_ttl_seconds``);
* the merge window measured from ``cold_since_ms`` when the sample carries it.

Segments are visited in ascending id, so ties always go to the lower id.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from controllerd.core.layout import MergeDepths, equal_boundaries
from controllerd.core.model import (
    RATE_NAMES,
    Decision,
    Layout,
    LoadSample,
    Merge,
    NoAction,
    PolicySettings,
    Rates,
    Segment,
    Split,
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
    if name == "enabled":
        return _Value(value) if isinstance(value, bool) else f"expected true/false, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"expected a number, got {value!r}"
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
            return f"expected an integer, got {value!r}"
        return _Value(int(number))
    return _Value(number)


def _within(last_ms: int | None, cooldown_s: float, now_ms: int) -> bool:
    return last_ms is not None and last_ms >= 0 and now_ms - last_ms < cooldown_s * 1000.0


def is_stale(sample: LoadSample, policy: PolicySettings, now_ms: int) -> bool:
    """True when a reporter has not vouched for the record within ``load_ttl``."""
    return (
        policy.load_ttl_seconds > 0
        and sample.sampled_at_ms is not None
        and now_ms - sample.sampled_at_ms > policy.load_ttl_seconds * 1000.0
    )


def below(rates: Rates, limits: Rates) -> bool:
    """All four rates strictly below ``limits`` (a 0 limit is never satisfied)."""
    return (
        rates.msg_rate_in < limits.msg_rate_in
        and rates.byte_rate_in < limits.byte_rate_in
        and rates.msg_rate_out < limits.msg_rate_out
        and rates.byte_rate_out < limits.byte_rate_out
    )


def is_cold(sample: LoadSample | None, policy: PolicySettings, now_ms: int) -> bool:
    """Merge-eligible: a fresh sample below every merge threshold for the whole window."""
    if sample is None or is_stale(sample, policy, now_ms):
        return False
    since = sample.cold_since_ms if sample.cold_since_ms is not None else sample.changed_at_ms
    return now_ms - since >= policy.merge_window_seconds * 1000.0 and below(
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


def _split_pass(
    active: Sequence[Segment],
    loads: Mapping[int, LoadSample],
    max_consumers: int,
    policy: PolicySettings,
) -> Split | NoAction | None:
    """A Split, a NoAction naming why a needed split is blocked, or None (nothing hot)."""
    n = len(active)
    if max_consumers > n:
        busiest: Segment | None = None
        narrow: list[int] = []
        for seg in _by_id(active):
            if _fanout_cap(seg, policy, n) < 2:
                narrow.append(seg.segment_id)
            elif busiest is None or _msg_rate_in(loads.get(seg.segment_id)) > _msg_rate_in(
                loads.get(busiest.segment_id)
            ):
                busiest = seg
        if busiest is None:
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
    best: Segment | None = None
    best_score, best_rate = 1.0, ""
    hot_but_narrow: list[int] = []
    for seg in _by_id(hot):
        score, rate = split_score(loads[seg.segment_id].rates, limits)
        if _fanout_cap(seg, policy, n) < 2:
            hot_but_narrow.append(seg.segment_id)
        elif score > best_score:
            best, best_score, best_rate = seg, score, rate
    if best is None:
        return _too_narrow(hot_but_narrow, policy, "are over a split threshold")
    k = min(_fanout_cap(best, policy, n), max(2, math.ceil(best_score)))
    attr = _RATE_FIELDS[RATE_NAMES.index(best_rate)]
    return Split(
        best.segment_id,
        equal_boundaries(best.hash_range, k),
        best_rate,
        f"segment {best.segment_id} {best_rate} "
        f"{getattr(loads[best.segment_id].rates, attr):g}/s is "
        f"{best_score:.2f}x the split threshold {getattr(limits, attr):g}/s; {k}-way split",
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
    flags = []
    for seg in active:
        sample = loads.get(seg.segment_id)
        if sample is None:
            flags.append(False)
            continue
        r = sample.rates
        since = sample.cold_since_ms if sample.cold_since_ms is not None else sample.changed_at_ms
        sampled = sample.sampled_at_ms
        flags.append(
            r.msg_rate_in < m0
            and r.byte_rate_in < m1
            and r.msg_rate_out < m2
            and r.byte_rate_out < m3
            and now_ms - since >= window_ms
            and not (ttl_ms > 0 and sampled is not None and now_ms - sampled > ttl_ms)
        )
    return flags


def _merge_pass(
    layout: Layout,
    active: Sequence[Segment],
    loads: Mapping[int, LoadSample],
    policy: PolicySettings,
    now_ms: int,
) -> Merge | None:
    cold = _cold_flags(active, loads, policy, now_ms)
    depths: MergeDepths | None = None
    best: tuple[float, int, int] | None = None
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
        ra, rb = loads[a.segment_id].rates, loads[b.segment_id].rates
        if not _combined_ok(ra, rb, policy):
            continue
        key = (
            sum(ra.as_tuple()) + sum(rb.as_tuple()),
            min(a.segment_id, b.segment_id),
            max(a.segment_id, b.segment_id),
        )
        if best is None or key < best:
            best = key
    if best is None:
        return None
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
        loads: load samples by segment id; a missing sample is never cold.
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
    if n >= policy.max_segments or _within(last_split_ms, policy.split_cooldown_seconds, now_ms):
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
        result = _split_pass(active, loads, max_consumers, policy)
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
            if blocked is None and _merge_pass(layout, active, loads, policy, now_ms):
                blocked = NoAction(
                    "merge-cooldown",
                    f"a cold pair could merge but the last merge was less than "
                    f"{policy.merge_cooldown_seconds:g}s ago",
                )
        else:
            merged = _merge_pass(layout, active, loads, policy, now_ms)
            if merged is not None:
                return merged
    return blocked or NoAction("balanced", f"{n} active segments; no split or merge is due")
