"""The auto split/merge decision (DESIGN §6), pure: time and load come from the caller.

``decide`` is Pulsar PIP-483's evaluator rule for rule, plus our extensions,
each of which a setting turns off (``max_split_fanout = 2``,
``min_split_width = 1``, ``merge_combined_max_ratio = inf``,
``load_ttl_seconds = 0``, no ``cold_since_ms`` in samples):

* k-way splits, so a consumer burst or a k-times overload converges in one step;
* no split that would leave a child narrower than ``min_split_width``;
* no merge whose combined load reaches ``merge_combined_max_ratio`` of the split
  thresholds (it would re-split at once);
* no merge on stale load (``sampled_at_ms`` older than ``load_ttl_seconds``);
* the merge window measured from ``cold_since_ms`` when the sample carries it.

Segments are visited in ascending id, so ties always go to the lower id.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from controllerd.layout import equal_boundaries, merge_depths
from controllerd.model import (
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
                problem = _type_problem(name, value)
                if problem:
                    return PolicyInvalid(f"override #{index + 1} {key}: {problem}")
                values[name] = value
            elif key in _THRESHOLD_KEYS:
                table, attr = _THRESHOLD_KEYS[key]
                if isinstance(value, bool) or not isinstance(value, int | float):
                    return PolicyInvalid(
                        f"override #{index + 1} {key}: expected a number, got {value!r}"
                    )
                thresholds[table][attr] = float(value)
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


def _type_problem(name: str, value: Any) -> str | None:
    if name == "enabled":
        return None if isinstance(value, bool) else f"expected true/false, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"expected a number, got {value!r}"
    if name in _INT_FIELDS and not float(value).is_integer():
        return f"expected an integer, got {value!r}"
    return None


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


def _split_pass(
    active: list[Segment],
    loads: Mapping[int, LoadSample],
    max_consumers: int,
    policy: PolicySettings,
) -> Split | NoAction | None:
    """A Split, a NoAction naming why a needed split is blocked, or None (nothing hot)."""
    n = len(active)
    by_id = sorted(active, key=lambda s: s.segment_id)
    too_narrow: list[int] = []
    if max_consumers > n:
        busiest: Segment | None = None
        for seg in by_id:
            if _fanout_cap(seg, policy, n) < 2:
                too_narrow.append(seg.segment_id)
            elif busiest is None or _msg_rate_in(loads.get(seg.segment_id)) > _msg_rate_in(
                loads.get(busiest.segment_id)
            ):
                busiest = seg
        if busiest is not None:
            k = min(_fanout_cap(busiest, policy, n), max(2, max_consumers - n + 1))
            return Split(
                busiest.segment_id,
                equal_boundaries(busiest.hash_range, k),
                "consumer-count",
                f"a subscription has {max_consumers} consumers but only {n} segments are "
                f"active; {k}-way split of the busiest segment {busiest.segment_id} "
                f"({_msg_rate_in(loads.get(busiest.segment_id)):g} msg/s in)",
            )
    best: Segment | None = None
    best_score, best_rate = 1.0, ""
    hot_but_narrow: list[int] = []
    for seg in by_id:
        sample = loads.get(seg.segment_id)
        if sample is None:
            continue
        score, rate = split_score(sample.rates, policy.split_thresholds)
        if score > 1.0 and _fanout_cap(seg, policy, n) < 2:
            hot_but_narrow.append(seg.segment_id)
        elif score > best_score:
            best, best_score, best_rate = seg, score, rate
    if best is not None:
        k = min(_fanout_cap(best, policy, n), max(2, math.ceil(best_score)))
        attr = _RATE_FIELDS[RATE_NAMES.index(best_rate)]
        sample = loads[best.segment_id]
        return Split(
            best.segment_id,
            equal_boundaries(best.hash_range, k),
            best_rate,
            f"segment {best.segment_id} {best_rate} {getattr(sample.rates, attr):g}/s is "
            f"{best_score:.2f}x the split threshold "
            f"{getattr(policy.split_thresholds, attr):g}/s; {k}-way split",
        )
    if hot_but_narrow:
        return NoAction(
            "min-split-width",
            f"segment(s) {hot_but_narrow} are over a split threshold but narrower than "
            f"2 x min_split_width ({policy.min_split_width}): likely a hot key",
        )
    return None


def _hot_segments(
    active: list[Segment],
    loads: Mapping[int, LoadSample],
    max_consumers: int,
    policy: PolicySettings,
) -> list[int]:
    if max_consumers > len(active):
        return [s.segment_id for s in active]
    hot = []
    for seg in active:
        sample = loads.get(seg.segment_id)
        if sample is not None and split_score(sample.rates, policy.split_thresholds)[0] > 1.0:
            hot.append(seg.segment_id)
    return sorted(hot)


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


def _merge_pass(
    layout: Layout,
    active: list[Segment],
    loads: Mapping[int, LoadSample],
    policy: PolicySettings,
    now_ms: int,
) -> Merge | None:
    cold = [is_cold(loads.get(s.segment_id), policy, now_ms) for s in active]
    depths: dict[int, int] | None = None
    best: tuple[float, int, int] | None = None
    for i in range(len(active) - 1):
        if not (cold[i] and cold[i + 1]):
            continue
        a, b = active[i], active[i + 1]
        if depths is None:
            depths = merge_depths(layout.segments)
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
    if n > policy.min_segments:
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
