"""Property tests for the pure core: layout operations, JSON codecs, decide, resolve_policy.

Layouts are only built by random splits, merges and GC-selected prunes from
``initial_layout``, so every property is about layouts the daemon can reach.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from controllerd.core import gc, model
from controllerd.core.layout import (
    LayoutError,
    apply,
    equal_boundaries,
    initial_layout,
    merge,
    merge_depths,
    prune,
    split,
    violations,
)
from controllerd.core.loadreport import ReportRule, should_write
from controllerd.core.model import (
    HASH_MAX,
    PULSAR_PARITY,
    RATE_NAMES,
    Decision,
    HashRange,
    Layout,
    LoadSample,
    Merge,
    NoAction,
    PolicySettings,
    Rates,
    Split,
    decision_to_json,
    layout_from_json,
    layout_to_json,
)
from controllerd.core.policy import (
    HOT_KEY_MIN_RELIEF,
    PolicyInvalid,
    decide,
    is_stale,
    may_act,
    may_act_now,
    next_decision_ms,
    next_ripe_ms,
    plan_split,
    resolve_policy,
    split_score,
)
from controllerd.pipeline.simulate import Gate

NOW0: Final = 1_760_000_000_000
DEFAULT: Final = PolicySettings()
FAST: Final = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
T = TypeVar("T")


class Draw(Protocol):
    """Both ``@st.composite``'s ``draw`` and ``st.data().draw``."""

    def __call__(self, strategy: st.SearchStrategy[T], label: object = ...) -> T: ...


# --- layouts reachable by operations -----------------------------------------------------


@dataclass(frozen=True)
class Step:
    kind: str
    layout: Layout
    split_id: int = -1
    k: int = 0
    merged: tuple[int, int] = (-1, -1)
    wanted: frozenset[int] = frozenset()
    pruned: tuple[int, ...] = ()


def adjacent_pairs(lay: Layout) -> list[tuple[int, int]]:
    active = lay.active_segments()
    return [(a.segment_id, b.segment_id) for a, b in itertools.pairwise(active)]


def sealed_ids(lay: Layout) -> list[int]:
    return sorted(s.segment_id for s in lay.segments.values() if not s.active)


def draw_boundaries(draw: Draw, rng: HashRange) -> tuple[int, ...] | None:
    kind = draw(st.sampled_from(["midpoint", "random", "equal"]))
    if kind == "midpoint":
        return None
    if kind == "equal":
        return equal_boundaries(rng, draw(st.integers(2, min(8, rng.width))))
    picks = draw(
        st.sets(st.integers(rng.start + 1, rng.end), min_size=1, max_size=min(7, rng.width - 1))
    )
    return tuple(sorted(picks))


def draw_step(draw: Draw, lay: Layout, now_ms: int) -> Step:
    """One random valid operation; prunes go through ``gc.select`` like the daemon's GC."""
    splittable = [s for s in lay.active_segments() if s.hash_range.width >= 2]
    pairs = adjacent_pairs(lay)
    sealed = sealed_ids(lay)
    kinds = [k for k, ok in (("split", splittable), ("merge", pairs), ("prune", sealed)) if ok]
    kind = draw(st.sampled_from(kinds))
    if kind == "split":
        seg = draw(st.sampled_from(splittable))
        bounds = draw_boundaries(draw, seg.hash_range)
        k = 2 if bounds is None else len(bounds) + 1
        new = split(lay, seg.segment_id, bounds, now_ms=now_ms)
        return Step(kind, new, split_id=seg.segment_id, k=k)
    if kind == "merge":
        a, b = draw(st.sampled_from(pairs))
        if draw(st.booleans()):
            a, b = b, a
        return Step(kind, merge(lay, a, b, now_ms=now_ms), merged=(a, b))
    roots = [
        sid for sid in sealed if not any(p in lay.segments for p in lay.segments[sid].parent_ids)
    ]
    wanted = draw(st.sets(st.sampled_from(sealed))) | {draw(st.sampled_from(roots))}
    verdicts = {
        sid: gc.Verdict(sid, sid in wanted, "drained" if sid in wanted else "backlog")
        for sid in lay.segments
    }
    chosen = tuple(gc.select(lay, verdicts))
    return Step(kind, prune(lay, chosen), wanted=frozenset(wanted), pruned=chosen)


@st.composite
def reachable(draw: st.DrawFn, max_ops: int = 12) -> tuple[Layout, int]:
    """A layout reached from ``initial_layout(1..8)`` and the clock after its last operation."""
    now = NOW0
    lay = initial_layout(draw(st.integers(1, 8)), now_ms=now)
    for _ in range(draw(st.integers(0, max_ops))):
        now += draw(st.integers(1, 120_000))
        lay = draw_step(draw, lay, now).layout
    return lay, now


# --- 1. operations keep the invariants ----------------------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(1, 8))
def test_random_operations_keep_invariants(data: st.DataObject, n: int) -> None:
    now = NOW0
    lay = initial_layout(n, now_ms=now)
    assert violations(lay) == []
    ever_seen = set(lay.segments)
    gone: set[int] = set()
    for _ in range(data.draw(st.integers(1, 30), label="ops")):
        now += data.draw(st.integers(1, 120_000))
        before_json, before_segments = layout_to_json(lay), dict(lay.segments)
        step = draw_step(data.draw, lay, now)
        new = step.layout
        assert layout_to_json(lay) == before_json
        assert dict(lay.segments) == before_segments
        assert violations(new) == []
        assert new.epoch == lay.epoch + 1
        assert new.next_segment_id >= lay.next_segment_id
        created = set(new.segments) - set(lay.segments)
        removed = set(lay.segments) - set(new.segments)
        assert not created & ever_seen, "a segment id was reused"
        assert all(lay.next_segment_id <= sid < new.next_segment_id for sid in created)
        if step.kind == "split":
            assert len(created) == step.k and not removed
            assert not new.segments[step.split_id].active
            assert new.segments[step.split_id].child_ids == tuple(sorted(created))
        elif step.kind == "merge":
            assert len(created) == 1 and not removed
            (child,) = created
            assert set(new.segments[child].parent_ids) == set(step.merged)
        else:
            assert not created
            assert removed == set(step.pruned)
            assert set(step.pruned) <= step.wanted
            assert all(not lay.segments[sid].active for sid in step.pruned)
            assert step.pruned, "the oldest wanted root is always prunable"
        gone |= removed
        ever_seen |= created
        assert not gone & set(new.segments)
        lay = new


# --- 2. JSON round trip -------------------------------------------------------------------

JSON_SCALARS: Final = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)


@FAST
@given(
    reachable(max_ops=15),
    st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3),
    st.none() | st.dictionaries(st.text(max_size=12), JSON_SCALARS, max_size=4),
)
def test_json_round_trip(
    built: tuple[Layout, int], props: dict[str, str], policy: dict[str, Any] | None
) -> None:
    lay = dataclasses.replace(built[0], properties=props, auto_scale_policy=policy)
    as_json = layout_to_json(lay)
    assert layout_from_json(as_json) == lay
    assert layout_from_json(json.loads(json.dumps(as_json))) == lay
    assert layout_to_json(layout_from_json(json.loads(json.dumps(as_json)))) == as_json


# --- 3. invalid operations raise ----------------------------------------------------------


def expect_error(code: str, lay: Layout, op: Any, *args: Any, **kwargs: Any) -> None:
    before = layout_to_json(lay)
    with pytest.raises(LayoutError) as info:
        op(lay, *args, **kwargs)
    assert info.value.code == code, str(info.value)
    assert layout_to_json(lay) == before


@st.composite
def bad_boundaries(draw: st.DrawFn, rng: HashRange) -> tuple[int, ...]:
    """Boundaries that are empty, outside ``(start, end]``, or not strictly ascending."""
    inside = st.integers(rng.start + 1, rng.end) if rng.width >= 2 else st.just(rng.end)
    outside = st.integers(-5, rng.start) | st.integers(rng.end + 1, HASH_MAX + 5)
    kind = draw(st.sampled_from(["empty", "outside", "repeat", "descending"]))
    if kind == "empty" or (kind != "outside" and rng.width < 3):
        return () if kind == "empty" else (draw(outside),)
    if kind == "outside":
        good = draw(st.lists(inside, max_size=3))
        return (*good[:1], draw(outside), *good[1:])
    if kind == "repeat":
        b = draw(inside)
        return (b, b)
    lo, hi = draw(st.lists(inside, min_size=2, max_size=2, unique=True).map(sorted))
    return (hi, lo)


@FAST
@given(reachable(max_ops=15), st.data())
def test_invalid_operations_raise(built: tuple[Layout, int], data: st.DataObject) -> None:
    lay, now = built
    active = lay.active_segments()
    sealed = sealed_ids(lay)
    if sealed:
        sid = data.draw(st.sampled_from(sealed))
        expect_error("not-active", lay, split, sid, None, now_ms=now)
        expect_error("not-active", lay, split, sid, (lay.segments[sid].hash_range.end,), now_ms=now)
    expect_error("not-found", lay, split, lay.next_segment_id, None, now_ms=now)
    expect_error("not-found", lay, prune, [lay.next_segment_id])

    seg = data.draw(st.sampled_from(active))
    bounds = data.draw(bad_boundaries(seg.hash_range))
    expect_error("bad-boundaries", lay, split, seg.segment_id, bounds, now_ms=now)
    if seg.hash_range.width == 1:
        expect_error("bad-boundaries", lay, split, seg.segment_id, None, now_ms=now)
    expect_error("not-active", lay, prune, [seg.segment_id])
    expect_error("not-active", lay, prune, [*sealed, seg.segment_id])

    adjacent = {frozenset(p) for p in adjacent_pairs(lay)}
    a, b = data.draw(st.sampled_from(active)), data.draw(st.sampled_from(active))
    if frozenset((a.segment_id, b.segment_id)) not in adjacent:
        expect_error("not-adjacent", lay, merge, a.segment_id, b.segment_id, now_ms=now)

    # A sealed segment whose parent stays: split something, then split one of its children.
    wide = [s for s in active if s.hash_range.width >= 4]
    assume(wide)
    parent = data.draw(st.sampled_from(wide))
    grown = split(lay, parent.segment_id, None, now_ms=now + 1)
    child = grown.segments[parent.segment_id].child_ids[0]
    grown = split(grown, child, None, now_ms=now + 2)
    expect_error("parent-present", grown, prune, [child])


# --- 4. decide proposes only valid operations ---------------------------------------------


@st.composite
def policies(draw: st.DrawFn, merge_friendly: bool = False) -> PolicySettings:
    """Random valid settings, thresholds scaled around Pulsar's defaults.

    ``merge_friendly`` makes the settings that rule out any merge (min_segments
    near the active count, depth 0, zero merge thresholds) rare.
    """
    min_segments = draw(st.integers(1, 2) if merge_friendly else st.integers(1, 8))
    factor = draw(st.sampled_from([0.5, 1.0, 2.0]))
    split_t = Rates(*(v * factor for v in DEFAULT.split_thresholds.as_tuple()))
    fractions = [0.05, 0.1, 0.5, 0.9] * (4 if merge_friendly else 1)
    merge_fraction = draw(st.sampled_from([*fractions, 0.0]))
    merge_t = Rates(*(v * merge_fraction for v in split_t.as_tuple()))
    policy = PolicySettings(
        enabled=True,
        min_segments=min_segments,
        max_segments=draw(st.integers(min_segments, 48)),
        max_dag_depth=draw(st.integers(0, 4) | st.integers(1, 20)),
        max_split_fanout=draw(st.integers(2, 8)),
        split_cooldown_seconds=draw(st.sampled_from([0.0, 60.0, 600.0])),
        merge_cooldown_seconds=draw(st.sampled_from([0.0, 300.0, 1200.0])),
        merge_window_seconds=draw(st.sampled_from([0.0, 60.0, 300.0, 900.0])),
        load_ttl_seconds=draw(st.sampled_from([0.0, 60.0, 300.0, 900.0])),
        min_split_width=draw(st.sampled_from([1, 2, 64, 256, 4096, 32768]) | st.integers(1, 2048)),
        merge_combined_max_ratio=draw(st.sampled_from([0.05, 0.5, 0.8, 1.0, 3.0, math.inf])),
        range_split_cooldown=draw(st.booleans()),
        split_thresholds=split_t,
        merge_thresholds=merge_t,
    )
    assert policy.errors() == []
    return policy


def draw_rates(draw: Draw, policy: PolicySettings, mode: str) -> Rates:
    if mode == "cold":
        limits = policy.merge_thresholds.as_tuple()
        return Rates(*(draw(st.floats(0, 1, exclude_max=True)) * t for t in limits))
    limits = policy.split_thresholds.as_tuple()
    return Rates(*(draw(st.floats(0, 3)) * t for t in limits))


AGO: Final = st.integers(-60_000, 2_000_000)
"""Offsets before ``now`` in ms, a few in the future (clock skew)."""


def draw_sample(draw: Draw, policy: PolicySettings, now: int, cold_bias: bool) -> LoadSample:
    modes = ["cold"] * 19 + ["any"] if cold_bias else ["cold", "any"]
    rates = draw_rates(draw, policy, draw(st.sampled_from(modes)))
    recent = st.integers(-1_000, 60_000) if cold_bias else AGO
    long_ago = st.integers(900_000, 5_000_000) | AGO if cold_bias else AGO
    sampled = draw(st.none() | recent.map(lambda ago: now - ago) | AGO.map(lambda ago: now - ago))
    cold_since = draw(st.none() | long_ago.map(lambda ago: now - ago))
    return LoadSample(rates, now - draw(long_ago), sampled, cold_since)


@dataclass(frozen=True)
class Scenario:
    layout: Layout
    loads: dict[int, LoadSample]
    consumers: dict[str, int]
    policy: PolicySettings
    now_ms: int
    last_split_ms: int | None
    last_merge_ms: int | None

    def decide(
        self,
        loads: Mapping[int, LoadSample] | None = None,
        consumers: Mapping[str, int] | None = None,
    ) -> Decision:
        return decide(
            self.layout,
            self.loads if loads is None else loads,
            self.consumers if consumers is None else consumers,
            self.policy,
            self.now_ms,
            self.last_split_ms,
            self.last_merge_ms,
        )


@st.composite
def scenarios(draw: st.DrawFn, cold_bias: bool = False) -> Scenario:
    lay, built_at = draw(reachable())
    now = built_at + draw(st.integers(0, 3_000_000))
    policy = draw(policies(merge_friendly=cold_bias))
    loads: dict[int, LoadSample] = {}
    for sid in sorted(lay.segments):
        present = lay.segments[sid].active and draw(st.integers(0, 9)) > 0
        if present or draw(st.integers(0, 9)) == 0:
            loads[sid] = draw_sample(draw, policy, now, cold_bias)
    consumers = draw(
        st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.integers(0, 40), max_size=3)
        if not cold_bias
        else st.just({})
    )
    stamp = st.none() | st.just(-1) | AGO.map(lambda ago: now - ago)
    if cold_bias:
        stamp = st.sampled_from([None, None, -1, now - 10**7]) | stamp
    return Scenario(lay, loads, consumers, policy, now, draw(stamp), draw(stamp))


def within(stamp: int | None, cooldown_s: float, now_ms: int) -> bool:
    return stamp is not None and stamp >= 0 and now_ms - stamp < cooldown_s * 1000.0


def assert_merge_justified(sc: Scenario, decision: Merge) -> None:
    """DESIGN §6.3 and §8: a merge needs fresh, cold-for-the-window samples on both sides."""
    policy, now = sc.policy, sc.now_ms
    a, b = sc.layout.segments[decision.a], sc.layout.segments[decision.b]
    assert a.active and b.active
    assert a.hash_range.end + 1 == b.hash_range.start
    assert len(sc.layout.active_segments()) - 1 >= policy.min_segments
    assert not within(sc.last_merge_ms, policy.merge_cooldown_seconds, now)
    depths = merge_depths(sc.layout.segments)
    combined = [0.0] * 4
    for seg in (a, b):
        assert depths[seg.segment_id] < policy.max_dag_depth
        sample = sc.loads.get(seg.segment_id)
        assert sample is not None, f"merge on missing load of {seg.segment_id}"
        assert not is_stale(sample, policy, now), f"merge on stale load of {seg.segment_id}"
        for rate, limit in zip(
            sample.rates.as_tuple(), policy.merge_thresholds.as_tuple(), strict=True
        ):
            assert rate < limit
        since = sample.cold_since_ms if sample.cold_since_ms is not None else sample.changed_at_ms
        assert now - since >= policy.merge_window_seconds * 1000.0
        combined = [c + r for c, r in zip(combined, sample.rates.as_tuple(), strict=True)]
    if not math.isinf(policy.merge_combined_max_ratio):
        for total, limit in zip(combined, policy.split_thresholds.as_tuple(), strict=True):
            assert total < policy.merge_combined_max_ratio * limit


def assert_split_justified(sc: Scenario, decision: Split) -> None:
    policy, now = sc.policy, sc.now_ms
    n = len(sc.layout.active_segments())
    seg = sc.layout.segments[decision.segment_id]
    k = len(decision.boundaries) + 1
    assert seg.active
    assert 2 <= k <= policy.max_split_fanout
    assert n - 1 + k <= policy.max_segments
    if policy.range_split_cooldown:  # only a young child of a split waits
        young = 0 <= now - seg.created_at_ms < policy.split_cooldown_seconds * 1000
        split_child = len(seg.parent_ids) == 1 or (
            not seg.parent_ids and within(sc.last_split_ms, policy.split_cooldown_seconds, now)
        )
        assert not (young and split_child)
    else:
        assert not within(sc.last_split_ms, policy.split_cooldown_seconds, now)
    starts = (seg.hash_range.start, *decision.boundaries)
    ends = (*(b - 1 for b in decision.boundaries), seg.hash_range.end)
    assert all(e - s + 1 >= policy.min_split_width for s, e in zip(starts, ends, strict=True))
    if decision.reason == "consumer-count":
        assert max(sc.consumers.values()) > n
    else:
        assert decision.reason in RATE_NAMES
        sample = sc.loads[decision.segment_id]
        assert split_score(sample.rates, policy.split_thresholds)[0] > 1.0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_decide_proposes_only_valid_operations(sc: Scenario) -> None:
    before = layout_to_json(sc.layout)
    decision = sc.decide()
    event(f"{decision.action}/{decision.reason}")
    assert layout_to_json(sc.layout) == before
    new = apply(sc.layout, decision, now_ms=sc.now_ms + 1)
    assert violations(new) == []
    if isinstance(decision, Split):
        assert_split_justified(sc, decision)
        assert len(new.active_segments()) <= sc.policy.max_segments
    elif isinstance(decision, Merge):
        assert_merge_justified(sc, decision)
        assert len(new.active_segments()) >= sc.policy.min_segments
    else:
        assert new is sc.layout


# --- 5. no merge on stale or missing load -------------------------------------------------


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(cold_bias=True))
def test_merge_only_on_fresh_cold_load(sc: Scenario) -> None:
    decision = sc.decide()
    event(f"{decision.action}/{decision.reason}")
    if isinstance(decision, Merge):
        assert_merge_justified(sc, decision)


@FAST
@given(reachable(), st.data())
def test_no_merge_when_one_side_of_every_pair_is_missing_or_stale(
    built: tuple[Layout, int], data: st.DataObject
) -> None:
    lay, now = built
    active = lay.active_segments()
    assume(len(active) >= 2)
    now += 10_000_000
    policy = PolicySettings(
        max_segments=max(64, len(active)),
        max_dag_depth=1_000,
        merge_combined_max_ratio=math.inf,
        load_ttl_seconds=data.draw(st.sampled_from([60.0, 900.0])),
    )
    ttl_ms, window_ms = int(policy.load_ttl_seconds * 1000), int(policy.merge_window_seconds * 1000)

    def cold_sample(sampled_ago: int) -> LoadSample:
        rates = draw_rates(data.draw, policy, "cold")
        since = now - window_ms - data.draw(st.integers(0, 10_000_000))
        cold_since = data.draw(st.none() | st.just(since))
        return LoadSample(rates, since, now - sampled_ago, cold_since)

    fresh = {s.segment_id: cold_sample(data.draw(st.integers(0, ttl_ms))) for s in active}
    # Control: with every sample fresh and cold, the topic does merge.
    assert isinstance(decide(lay, fresh, {}, policy, now), Merge)

    offset = data.draw(st.integers(0, 1))
    poisoned = dict(fresh)
    for i, seg in enumerate(active):
        if i % 2 == offset:
            if data.draw(st.booleans()):
                del poisoned[seg.segment_id]
            else:
                poisoned[seg.segment_id] = cold_sample(ttl_ms + data.draw(st.integers(1, 10**7)))
    for left, right in itertools.pairwise(active):
        pair = (poisoned.get(left.segment_id), poisoned.get(right.segment_id))
        assert any(s is None or is_stale(s, policy, now) for s in pair)
    decision = decide(lay, poisoned, {}, policy, now)
    assert not isinstance(decision, Merge), decision


# --- 6. determinism -----------------------------------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.data())
def test_decide_ignores_dict_order(sc: Scenario, data: st.DataObject) -> None:
    first = sc.decide()
    assert sc.decide() == first
    loads = dict(data.draw(st.permutations(list(sc.loads.items()))))
    consumers = dict(data.draw(st.permutations(list(sc.consumers.items()))))
    segments = dict(data.draw(st.permutations(list(sc.layout.segments.items()))))
    assert sc.decide(loads, consumers) == first
    shuffled = dataclasses.replace(sc, layout=dataclasses.replace(sc.layout, segments=segments))
    assert shuffled.decide(loads, consumers) == first


# --- 7. resolve_policy --------------------------------------------------------------------

OVERRIDE_KEYS: Final = (
    "enabled",
    "minSegments",
    "maxSegments",
    "maxDagDepth",
    "splitCooldownSeconds",
    "mergeCooldownSeconds",
    "mergeWindowSeconds",
    "splitMsgRateInThreshold",
    "splitBytesRateInThreshold",
    "splitMsgRateOutThreshold",
    "splitBytesRateOutThreshold",
    "mergeMsgRateInThreshold",
    "mergeBytesRateInThreshold",
    "mergeMsgRateOutThreshold",
    "mergeBytesRateOutThreshold",
    "maxSplitFanout",
    "minSplitWidth",
    "loadTtlSeconds",
    "mergeCombinedMaxRatio",
)
SIMPLE_FIELDS: Final = {
    "enabled": "enabled",
    "minSegments": "min_segments",
    "maxSegments": "max_segments",
    "maxDagDepth": "max_dag_depth",
    "splitCooldownSeconds": "split_cooldown_seconds",
    "mergeCooldownSeconds": "merge_cooldown_seconds",
    "mergeWindowSeconds": "merge_window_seconds",
    "maxSplitFanout": "max_split_fanout",
    "minSplitWidth": "min_split_width",
    "loadTtlSeconds": "load_ttl_seconds",
    "mergeCombinedMaxRatio": "merge_combined_max_ratio",
}
OVERRIDE_VALUES: Final = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70),
    st.integers(-(2**60), 2**60),
    st.sampled_from([0.0, 0.5, 1.0, 2.0, 8.0, 256.0, 1e12, -1.0, math.inf, -math.inf, math.nan]),
    st.floats(),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
)
OVERRIDES: Final = st.none() | st.dictionaries(
    st.sampled_from(OVERRIDE_KEYS) | st.text(max_size=6), OVERRIDE_VALUES, max_size=6
)


@settings(max_examples=300, deadline=None)
@given(st.lists(OVERRIDES, max_size=3))
def test_resolve_policy_is_valid_or_invalid(overrides: list[dict[str, Any] | None]) -> None:
    resolved = resolve_policy(DEFAULT, *overrides)
    event(type(resolved).__name__)
    if isinstance(resolved, PolicyInvalid):
        assert resolved.detail
        return
    assert resolved.errors() == []
    for key, attr in SIMPLE_FIELDS.items():
        given_values = [o[key] for o in overrides if o and o.get(key) is not None]
        expected = given_values[-1] if given_values else getattr(DEFAULT, attr)
        # A float field holds what Java's double would: float(an int) may round.
        as_field_type = type(getattr(DEFAULT, attr))(expected)
        assert getattr(resolved, attr) == as_field_type, key


@FAST
@given(scenarios(), st.text(min_size=1, max_size=20))
def test_decide_with_invalid_policy_never_acts(sc: Scenario, detail: str) -> None:
    decision = decide(
        sc.layout,
        sc.loads,
        sc.consumers,
        PolicyInvalid(detail),
        sc.now_ms,
        sc.last_split_ms,
        sc.last_merge_ms,
    )
    assert isinstance(decision, NoAction)
    assert decision.reason == "policy-invalid"


# --- 8. PIP-483 parity, with every extension at its "off" value ------------------------------


def pip483_reference(sc: Scenario) -> Decision:
    """PIP-483's evaluator, written out independently of ``policy.decide``.

    The rules of Pulsar's ``AutoScalePolicyEvaluator`` (pulsar-broker,
    ``org/apache/pulsar/broker/service/scalable/AutoScalePolicyEvaluator.java``,
    the PIP-483 version) as DESIGN §6 states them: split pass (consumer count,
    then the highest of four rate ratios over 1), unless at max_segments or in
    the split cooldown; else the merge pass (adjacent pairs, both below every
    merge threshold for the window since the record's last change, merge depth
    under max_dag_depth; the least combined load of the eight rates), unless at
    min_segments or in the merge cooldown. Splits are binary at Pulsar's
    midpoint (``HashRange``: ``mid = start + (end - start) / 2``); a one-hash
    range is never a candidate. Ties go to
    the lower segment id. NoAction reasons are ours, so only actions compare.
    """
    p, now = sc.policy, sc.now_ms
    active = sc.layout.active_segments()
    n = len(active)
    if not p.enabled:
        return NoAction("disabled")

    def split(seg_id: int, reason: str) -> Decision:
        rng = sc.layout.segments[seg_id].hash_range
        return Split(seg_id, (rng.start + (rng.end - rng.start) // 2 + 1,), reason)

    def splittable(seg_id: int) -> bool:
        """A one-hash range has no midpoint: it is no candidate (Pulsar would pick it
        and fail the split; we pick the next one)."""
        rng = sc.layout.segments[seg_id].hash_range
        return rng.end > rng.start

    def msg_in(seg_id: int) -> float:
        s = sc.loads.get(seg_id)
        return s.rates.msg_rate_in if s is not None else 0.0

    in_split_cooldown = within(sc.last_split_ms, p.split_cooldown_seconds, now)
    if n < p.max_segments and not in_split_cooldown:
        consumers = max(sc.consumers.values(), default=0)
        ids = sorted(s.segment_id for s in active if splittable(s.segment_id))
        if consumers > n and ids:
            busiest = max(ids, key=lambda i: (msg_in(i), -i))
            return split(busiest, "consumer-count")
        best: tuple[float, int, str] | None = None
        for i in ids:
            sample = sc.loads.get(i)
            if sample is None:
                continue
            ratios = [
                r / t
                for r, t in zip(sample.rates.as_tuple(), p.split_thresholds.as_tuple(), strict=True)
            ]
            top = max(ratios)
            if top > 1.0 and (best is None or top > best[0]):
                best = (top, i, RATE_NAMES[ratios.index(top)])
        if best is not None:
            return split(best[1], best[2])
    if n <= p.min_segments or within(sc.last_merge_ms, p.merge_cooldown_seconds, now):
        return NoAction("none")
    depths = merge_depths(sc.layout.segments)

    def cold(seg_id: int) -> bool:
        s = sc.loads.get(seg_id)
        return (
            s is not None
            and now - s.changed_at_ms >= p.merge_window_seconds * 1000.0
            and all(
                r < t
                for r, t in zip(s.rates.as_tuple(), p.merge_thresholds.as_tuple(), strict=True)
            )
        )

    pairs = []
    for a, b in itertools.pairwise(active):
        ia, ib = a.segment_id, b.segment_id
        if cold(ia) and cold(ib) and depths[ia] < p.max_dag_depth and depths[ib] < p.max_dag_depth:
            total = sum(sc.loads[ia].rates.as_tuple()) + sum(sc.loads[ib].rates.as_tuple())
            pairs.append((total, min(ia, ib), max(ia, ib), ia, ib))
    if not pairs:
        return NoAction("none")
    _, _, _, ia, ib = min(pairs)
    return Merge(ia, ib, "cold")


@st.composite
def history_fields(draw: st.DrawFn, policy: PolicySettings, now: int) -> dict[str, Any]:
    """Random values for every field of a sample that only our extensions read."""
    n = draw(st.integers(1, 32))
    return {
        "hash_buckets": draw(
            st.none() | st.lists(st.floats(0, 100), min_size=n, max_size=n).map(tuple)
        ),
        "peak_rates": draw(st.none() | st.just(0).map(lambda _: draw_rates(draw, policy, "any"))),
        "flipflops": draw(st.integers(0, 9)),
        "last_flipflop_ms": draw(st.none() | AGO.map(lambda ago: now - ago)),
        "rise": draw(st.sampled_from([0.0, 0.05, 0.5, 3.0])),
        "merged": draw(st.sampled_from([0, 1, 4, 9])),
    }


def off(policy: PolicySettings) -> PolicySettings:
    """``policy`` with every extension the history fields feed at its off value."""
    return dataclasses.replace(
        policy,
        peak_window_seconds=0.0,
        merge_backoff_factor=1.0,
        merge_headroom_half_life_seconds=0.0,
        merge_undo_seconds=0.0,
        range_split_cooldown=False,
        split_to_peak=False,
        load_aware_splits=False,
    )


def with_history(sc: Scenario, data: st.DataObject) -> dict[int, LoadSample]:
    return {
        sid: dataclasses.replace(s, **data.draw(history_fields(sc.policy, sc.now_ms)))
        for sid, s in sc.loads.items()
    }


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.data())
def test_pulsar_parity_settings_decide_exactly_as_pip483(sc: Scenario, data: st.DataObject) -> None:
    parity = PolicySettings(
        **{
            **{f: getattr(sc.policy, f) for f in PolicySettings.__dataclass_fields__},
            **PULSAR_PARITY,
        }
    )
    plain = {sid: dataclasses.replace(s, cold_since_ms=None) for sid, s in sc.loads.items()}
    sc = dataclasses.replace(sc, policy=parity, loads=plain)
    expected = pip483_reference(sc)
    # History fields and histograms are ignored at these settings (load_aware_splits only
    # acts on hashBuckets, which Pulsar never publishes: off here so that any may appear).
    noisy = dataclasses.replace(sc, policy=dataclasses.replace(parity, load_aware_splits=False))
    for decision in (sc.decide(), noisy.decide(with_history(noisy, data))):
        event(f"{decision.action}/{decision.reason}")
        if isinstance(expected, NoAction):
            assert isinstance(decision, NoAction), decision
        else:
            assert decision_to_json(decision) | {"detail": ""} == decision_to_json(expected) | {
                "detail": ""
            }


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.data())
def test_extensions_off_ignore_the_history_fields(sc: Scenario, data: st.DataObject) -> None:
    sc = dataclasses.replace(sc, policy=off(sc.policy))
    assert sc.decide(with_history(sc, data)) == sc.decide()


@st.composite
def extended_policies(draw: st.DrawFn, merge_friendly: bool = False) -> PolicySettings:
    base = draw(policies(merge_friendly=merge_friendly))
    return dataclasses.replace(
        base,
        peak_window_seconds=draw(st.sampled_from([0.0, 600.0, 21_600.0])),
        merge_backoff_factor=draw(st.sampled_from([1.0, 2.0, 4.0])),
        merge_backoff_decay_seconds=draw(st.sampled_from([60.0, 3_600.0, 86_400.0])),
        merge_regret_seconds=draw(st.sampled_from([0.0, 600.0, 43_200.0])),
        merge_headroom_half_life_seconds=draw(st.sampled_from([0.0, 600.0, 86_400.0])),
        merge_undo_seconds=draw(st.sampled_from([0.0, 600.0, 86_400.0])),
        range_split_cooldown=draw(st.booleans()),
        split_to_peak=draw(st.booleans()),
        load_aware_splits=draw(st.booleans()),
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.booleans(), st.data())
def test_extended_decisions_are_valid_and_time_changes_them_only_at_next_decision_ms(
    sc: Scenario, cold_bias: bool, data: st.DataObject
) -> None:
    policy = data.draw(extended_policies(merge_friendly=cold_bias))
    sc = dataclasses.replace(sc, policy=policy)
    sc = dataclasses.replace(sc, loads=with_history(sc, data))
    first = sc.decide()
    event(f"{first.action}/{first.reason}")
    assert violations(apply(sc.layout, first, now_ms=sc.now_ms + 1)) == []
    if isinstance(first, Split):
        starts = (sc.layout.segments[first.segment_id].hash_range.start, *first.boundaries)
        ends = (
            *(b - 1 for b in first.boundaries),
            sc.layout.segments[first.segment_id].hash_range.end,
        )
        assert all(e - s + 1 >= policy.min_split_width for s, e in zip(starts, ends, strict=True))
        assert len(first.boundaries) + 1 <= policy.max_split_fanout
    if not may_act(sc.layout, sc.loads, sc.consumers, policy):
        assert isinstance(first, NoAction)
    wake = next_decision_ms(
        sc.layout, sc.loads, policy, sc.now_ms, sc.last_split_ms, sc.last_merge_ms
    )
    horizon = wake if wake is not None else sc.now_ms + 10**9
    assert horizon > sc.now_ms
    later = data.draw(st.integers(sc.now_ms, horizon - 1), label="later")
    moved = dataclasses.replace(sc, now_ms=later)
    again = moved.decide()
    assert again.action == first.action and again.reason == first.reason
    assert decision_to_json(again)["segments"] == decision_to_json(first)["segments"]
    if not may_act(sc.layout, sc.loads, sc.consumers, policy):
        assert isinstance(again, NoAction)


def same_side(draw: Draw, value: float, merge: float, split: float) -> float:
    """Another rate on the same side of a merge and a split threshold as ``value``."""
    if value < merge:
        return draw(st.floats(0.0, merge, exclude_max=True))
    if value <= split:
        return draw(st.floats(merge, split))
    return draw(st.floats(split, 2 * split + 1, exclude_min=True))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(cold_bias=True), st.data())
def test_a_false_may_act_now_holds_until_next_ripe_ms_across_writes_on_the_same_side(
    sc: Scenario, data: st.DataObject
) -> None:
    """What the replay's short path relies on while cold segments wait for their window:
    decide stays NoAction until next_ripe_ms, whatever records are written in the
    meantime, as long as each stays on its side of every threshold and none was stale."""
    policy = data.draw(extended_policies(merge_friendly=True))
    sc = dataclasses.replace(sc, policy=policy)
    sc = dataclasses.replace(sc, loads=with_history(sc, data))
    acts = may_act_now(sc.layout, sc.loads, sc.consumers, policy, sc.now_ms)
    event(f"may act now: {acts}")
    if acts:
        return
    assert isinstance(sc.decide(), NoAction)
    ripe = next_ripe_ms(sc.layout, sc.loads, policy, sc.now_ms)
    wake = next_decision_ms(
        sc.layout, sc.loads, policy, sc.now_ms, sc.last_split_ms, sc.last_merge_ms
    )
    assert ripe is None or (wake is not None and ripe >= wake)
    horizon = ripe if ripe is not None else sc.now_ms + 10**9
    later = data.draw(st.integers(sc.now_ms, horizon - 1), label="later")
    split, merge = policy.split_thresholds.as_tuple(), policy.merge_thresholds.as_tuple()
    written: dict[int, LoadSample] = {}
    for sid, sample in sc.loads.items():
        # a write stamps its own time: never before the record it replaces
        writable = not is_stale(sample, policy, later) and later >= sample.changed_at_ms
        if writable and data.draw(st.booleans(), label=f"write {sid}"):
            rates = Rates(
                *(
                    same_side(data.draw, v, m, x)
                    for v, m, x in zip(sample.rates.as_tuple(), merge, split, strict=True)
                )
            )
            sampled = later if sample.sampled_at_ms is not None else None
            written[sid] = dataclasses.replace(
                sample, rates=rates, changed_at_ms=later, sampled_at_ms=sampled
            )
        else:
            written[sid] = sample
    moved = dataclasses.replace(sc, now_ms=later, loads=written)
    assert isinstance(moved.decide(), NoAction)
    assert not may_act_now(moved.layout, written, moved.consumers, policy, later)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(0, HASH_MAX - 1).flatmap(
        lambda a: st.tuples(st.just(a), st.integers(a + 1, HASH_MAX))
    ),
    st.lists(st.floats(0, 1e4), min_size=1, max_size=32),
    st.floats(1.0001, 40),
    st.integers(2, 8),
    st.sampled_from([1, 2, 16, 256, 1024]),
)
def test_load_aware_plans_are_valid_splits(
    bounds: tuple[int, int], buckets: list[float], score: float, cap: int, min_width: int
) -> None:
    rng = HashRange(*bounds)
    cap = min(cap, rng.width // min_width)
    assume(cap >= 2)
    plan = plan_split(rng, buckets, score, cap, min_width)
    if plan is None:  # equal-width instead: no histogram, or no slice edge leaves both sides wide
        edges = sorted({rng.start + (i * rng.width) // len(buckets) for i in range(len(buckets))})
        cuts = [e for e in edges if e - rng.start >= min_width and rng.end + 1 - e >= min_width]
        assert sum(buckets) == 0 or not cuts
        return
    event(f"children={len(plan.boundaries) + 1} refused={plan.refused}")
    assert list(plan.boundaries) == sorted(set(plan.boundaries))
    assert all(rng.start < b <= rng.end for b in plan.boundaries)
    assert 2 <= len(plan.boundaries) + 1 <= cap
    assert all(w >= min_width for w in plan.widths)
    assert sum(plan.widths) == rng.width
    assert sum(plan.loads) == pytest.approx(score)
    if plan.refused:
        hot = plan.loads.index(max(plan.loads))
        assert plan.loads[hot] > 1.0 and plan.widths[hot] < 2 * min_width
        relief = (score - plan.loads[hot]) / (score - 1.0)
        assert relief < HOT_KEY_MIN_RELIEF  # it would relieve too little


RATES_ST: Final = st.tuples(
    *(st.sampled_from([0.0, 1.0, 999.0, 1000.0, 1001.0]) | st.floats(0, 2e4) for _ in range(4))
)


@settings(max_examples=500, deadline=None)
@given(RATES_ST, RATES_ST, st.sampled_from([0.1, 0.25, 1.0]), st.booleans())
def test_the_replays_quick_gate_agrees_with_should_write(
    old: tuple[float, ...], new: tuple[float, ...], limit: float, crossing: bool
) -> None:
    rule = ReportRule(DEFAULT.split_thresholds, DEFAULT.merge_thresholds, limit, 0.0, crossing)
    reason = should_write(rule, Rates(*old), Rates(*new), 0, 0)
    assert Gate(rule).quiet((old[0], old[1], old[2], old[3]), *new) == (reason is None)


# --- the fast segment parse agrees with the checked one ------------------------------------

_json_scalar = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text()
_field = _json_scalar | st.lists(_json_scalar | st.integers(0, 50), max_size=3)


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "segmentId": st.integers(0, 99) | _field,
            "hashRange": st.fixed_dictionaries(
                {},
                optional={"start": st.integers(0, 65535) | _field, "end": st.integers() | _field},
            )
            | _field,
            "state": st.sampled_from(["ACTIVE", "SEALED", "active", "gone"]) | _field,
            "parentIds": st.lists(st.integers(0, 99), max_size=3) | _field,
            "childIds": st.lists(st.integers(0, 99), max_size=3) | _field,
            "createdAtEpoch": st.integers(0, 9) | _field,
            "sealedAtEpoch": st.integers(-1, 9) | _field,
            "createdAtMs": st.integers(0, 2**45) | _field,
            "sealedAtMs": st.integers(-1, 2**45) | _field,
            "owner": _field,
        },
    )
)
def test_the_fast_segment_parse_is_the_checked_parse_or_steps_aside(obj: dict[str, Any]) -> None:
    fast = model._segment_fast(obj)
    if fast is None:
        event("fast path declined")
        return
    assert fast == model.segment_from_json(obj)
    assert fast.extra == model.segment_from_json(obj).extra
