"""PIP-483 evaluator rules, one by one, then each controllerd extension."""

from __future__ import annotations

import dataclasses
import json
import math

import orjson
import pytest

from controllerd.core.layout import initial_layout, merge, prune, split
from controllerd.core.model import (
    PULSAR_PARITY,
    HashRange,
    Layout,
    LoadSample,
    Merge,
    ModelError,
    NoAction,
    PolicySettings,
    Rates,
    Split,
    load_sample_from_json,
    load_sample_to_json,
)
from controllerd.core.policy import (
    PolicyInvalid,
    TopicHistory,
    decide,
    inherited_cold_since,
    is_cold,
    may_act,
    merge_window_ms,
    next_decision_ms,
    plan_split,
    resolve_policy,
)

NOW = 10_000_000
WINDOW_MS = 300_000  # PIP483's merge window
LONG_AGO = NOW - 3 * 7_200_000  # past every merge window used here

# Pulsar behaviour: every extension off.
PIP483 = PolicySettings(**{**PULSAR_PARITY, "merge_window_seconds": 300.0})
OURS = PolicySettings()


def rates(msg_in: float = 0, byte_in: float = 0, msg_out: float = 0, byte_out: float = 0) -> Rates:
    return Rates(msg_in, byte_in, msg_out, byte_out)


def sample(
    msg_in: float = 0,
    byte_in: float = 0,
    msg_out: float = 0,
    byte_out: float = 0,
    *,
    changed: int = LONG_AGO,
    sampled: int | None = None,
    cold_since: int | None = None,
) -> LoadSample:
    return LoadSample(rates(msg_in, byte_in, msg_out, byte_out), changed, sampled, cold_since)


def cold(msg_in: float = 10, **kw: int | None) -> LoadSample:
    return sample(msg_in, **kw)  # type: ignore[arg-type]


def warm() -> LoadSample:
    """In the dead band: above merge thresholds, below split thresholds."""
    return sample(5_000)


def layout_of(n: int) -> Layout:
    return initial_layout(n, now_ms=0)


# --- 1. disabled ---------------------------------------------------------------------------


def test_disabled_policy_never_acts() -> None:
    policy = dataclasses.replace(PIP483, enabled=False)
    d = decide(layout_of(1), {0: sample(1e6)}, {"s": 10}, policy, NOW)
    assert d == NoAction("disabled", d.detail)


# --- 2a. consumer count --------------------------------------------------------------------


def test_consumer_count_uses_max_over_subscriptions_not_sum() -> None:
    # Two subscriptions with 2 consumers each: the sum (4) exceeds 2 segments, the max does not.
    d = decide(layout_of(2), {}, {"a": 2, "b": 2}, PIP483, NOW)
    assert isinstance(d, NoAction)
    d = decide(layout_of(2), {}, {"a": 3, "b": 1}, PIP483, NOW)
    assert isinstance(d, Split) and d.reason == "consumer-count"


def test_consumer_count_equal_to_segments_does_not_split() -> None:
    assert isinstance(decide(layout_of(4), {}, {"a": 4}, PIP483, NOW), NoAction)


def test_consumer_count_splits_busiest_by_msg_rate_in() -> None:
    loads = {0: warm(), 1: sample(7_000, byte_out=1e9), 2: sample(8_000), 3: warm()}
    d = decide(layout_of(4), loads, {"a": 5}, PIP483, NOW)
    # segment 1 has the highest byteRateOut, but busiest is judged by msgRateIn only.
    assert isinstance(d, Split) and d.segment_id == 2 and d.reason == "consumer-count"


def test_consumer_count_ties_go_to_lower_id_and_missing_load_is_zero() -> None:
    d = decide(layout_of(3), {}, {"a": 4}, PIP483, NOW)
    assert isinstance(d, Split) and d.segment_id == 0
    d = decide(layout_of(3), {2: sample(1), 1: sample(1)}, {"a": 4}, PIP483, NOW)
    assert isinstance(d, Split) and d.segment_id == 1


def test_consumer_count_split_is_binary_midpoint_in_pulsar_mode() -> None:
    d = decide(layout_of(1), {}, {"a": 9}, PIP483, NOW)
    assert d == Split(0, (0x8000,), "consumer-count", d.detail)


# --- 2b. traffic -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loadsample", "reason"),
    [
        (sample(10_001), "msgRateIn"),
        (sample(byte_in=50e6 + 1), "byteRateIn"),
        (sample(msg_out=50_001), "msgRateOut"),
        (sample(byte_out=250e6 + 1), "byteRateOut"),
    ],
)
def test_each_of_the_four_ratios_triggers_a_split(loadsample: LoadSample, reason: str) -> None:
    d = decide(layout_of(2), {0: warm(), 1: loadsample}, {}, PIP483, NOW)
    assert isinstance(d, Split)
    assert (d.segment_id, d.reason, d.boundaries) == (1, reason, (0xC000,))


@pytest.mark.parametrize(
    "loadsample",
    [sample(10_000), sample(byte_in=50e6), sample(msg_out=50_000), sample(byte_out=250e6)],
)
def test_exactly_at_split_threshold_does_not_split(loadsample: LoadSample) -> None:
    assert isinstance(decide(layout_of(1), {0: loadsample}, {}, PIP483, NOW), NoAction)


def test_most_overloaded_segment_wins_and_reason_is_winning_rate() -> None:
    loads = {
        0: sample(15_000),  # 1.5x on msgRateIn
        1: sample(12_000, byte_out=500e6),  # 2.0x on byteRateOut
        2: sample(19_000),  # 1.9x
    }
    d = decide(layout_of(3), loads, {}, PIP483, NOW)
    assert isinstance(d, Split) and (d.segment_id, d.reason) == (1, "byteRateOut")


def test_equal_scores_go_to_lower_id() -> None:
    loads = {2: sample(20_000), 1: sample(20_000)}
    d = decide(layout_of(3), loads, {}, PIP483, NOW)
    assert isinstance(d, Split) and d.segment_id == 1


def test_dead_band_between_thresholds_does_nothing() -> None:
    loads = {0: sample(5_000, changed=0), 1: sample(9_999, changed=0)}
    d = decide(layout_of(2), loads, {}, PIP483, NOW)
    assert d.action == "none" and d.reason == "balanced"


def test_split_before_merge() -> None:
    # 0 and 1 are a cold pair; 3 is hot: the split pass wins.
    loads = {0: cold(), 1: cold(), 2: warm(), 3: sample(30_000)}
    d = decide(layout_of(4), loads, {}, PIP483, NOW)
    assert isinstance(d, Split) and d.segment_id == 3


def test_consumer_count_is_checked_before_traffic() -> None:
    loads = {0: sample(1_000), 1: sample(30_000)}
    d = decide(layout_of(2), loads, {"a": 3}, PIP483, NOW)
    assert isinstance(d, Split) and d.reason == "consumer-count" and d.segment_id == 1


# --- caps and cooldowns ------------------------------------------------------------------


def test_no_split_at_max_segments() -> None:
    policy = dataclasses.replace(PIP483, max_segments=4)
    d = decide(layout_of(4), {0: sample(50_000)}, {"a": 9}, policy, NOW)
    assert isinstance(d, NoAction) and d.reason == "max-segments"


def test_no_split_within_split_cooldown() -> None:
    loads = {0: sample(50_000)}
    d = decide(layout_of(1), loads, {}, PIP483, NOW, last_split_ms=NOW - 59_999)
    assert isinstance(d, NoAction) and d.reason == "split-cooldown"
    d = decide(layout_of(1), loads, {}, PIP483, NOW, last_split_ms=NOW - 60_000)
    assert isinstance(d, Split)


def test_negative_stamp_means_never() -> None:
    d = decide(layout_of(1), {0: sample(50_000)}, {}, PIP483, NOW, last_split_ms=-1)
    assert isinstance(d, Split)


def test_split_cooldown_still_allows_merges() -> None:
    loads = {0: cold(), 1: cold(), 2: sample(50_000), 3: warm()}
    d = decide(layout_of(4), loads, {}, PIP483, NOW, last_split_ms=NOW - 1)
    assert isinstance(d, Merge) and (d.a, d.b) == (0, 1)


# --- 3. merge pass -----------------------------------------------------------------------


def test_cold_adjacent_pair_merges() -> None:
    d = decide(layout_of(2), {0: cold(), 1: cold()}, {}, PIP483, NOW)
    assert d == Merge(0, 1, "cold", d.detail)


def test_merge_needs_a_sample_for_both() -> None:
    assert isinstance(decide(layout_of(2), {0: cold()}, {}, PIP483, NOW), NoAction)


def test_merge_needs_the_full_window() -> None:
    loads = {0: cold(), 1: cold(changed=NOW - WINDOW_MS + 1)}
    assert isinstance(decide(layout_of(2), loads, {}, PIP483, NOW), NoAction)
    loads = {0: cold(), 1: cold(changed=NOW - WINDOW_MS)}
    assert isinstance(decide(layout_of(2), loads, {}, PIP483, NOW), Merge)


@pytest.mark.parametrize(
    "warm_sample",
    [sample(1_000), sample(byte_in=5e6), sample(msg_out=5_000), sample(byte_out=25e6)],
)
def test_merge_needs_all_four_rates_strictly_below(warm_sample: LoadSample) -> None:
    d = decide(layout_of(2), {0: cold(), 1: warm_sample}, {}, PIP483, NOW)
    assert isinstance(d, NoAction)


def test_zero_merge_threshold_never_merges() -> None:
    policy = dataclasses.replace(PIP483, merge_thresholds=rates(0, 5e6, 5_000, 25e6))
    d = decide(layout_of(2), {0: sample(), 1: sample()}, {}, policy, NOW)
    assert isinstance(d, NoAction)


def test_merge_respects_min_segments() -> None:
    policy = dataclasses.replace(PIP483, min_segments=2)
    assert isinstance(decide(layout_of(2), {0: cold(), 1: cold()}, {}, policy, NOW), NoAction)
    loads = {0: cold(), 1: cold(), 2: cold()}
    assert isinstance(decide(layout_of(3), loads, {}, policy, NOW), Merge)


def test_merge_respects_merge_cooldown() -> None:
    loads = {0: cold(), 1: cold()}
    d = decide(layout_of(2), loads, {}, PIP483, NOW, last_merge_ms=NOW - 299_999)
    assert isinstance(d, NoAction) and d.reason == "merge-cooldown"
    d = decide(layout_of(2), loads, {}, PIP483, NOW, last_merge_ms=NOW - 300_000)
    assert isinstance(d, Merge)


def test_merge_respects_max_dag_depth() -> None:
    # Build a segment of merge depth 1 (a merge of two halves), then split it.
    lay = merge(layout_of(2), 0, 1, now_ms=0)  # segment 2 = merge node, depth 1
    lay = split(lay, 2, now_ms=0)  # children 3, 4 inherit depth 1
    loads = {3: cold(), 4: cold()}
    assert isinstance(
        decide(lay, loads, {}, dataclasses.replace(PIP483, max_dag_depth=2), NOW), Merge
    )
    d = decide(lay, loads, {}, dataclasses.replace(PIP483, max_dag_depth=1), NOW)
    assert isinstance(d, NoAction)
    d = decide(
        layout_of(2), {0: cold(), 1: cold()}, {}, dataclasses.replace(PIP483, max_dag_depth=0), NOW
    )
    assert isinstance(d, NoAction)


def test_coldest_adjacent_pair_wins() -> None:
    loads = {0: cold(900), 1: cold(900), 2: cold(10), 3: cold(20)}
    d = decide(layout_of(4), loads, {}, PIP483, NOW)
    assert isinstance(d, Merge) and (d.a, d.b) == (2, 3)


def test_combined_load_sums_all_eight_rates() -> None:
    # By msgRateIn alone (0, 1) is coldest; its byteRateOut makes (1, 2) the coldest.
    loads = {0: sample(10, byte_out=20e6), 1: sample(10), 2: sample(500)}
    d = decide(layout_of(3), loads, {}, PIP483, NOW)
    assert isinstance(d, Merge) and (d.a, d.b) == (1, 2)


def test_pair_is_always_adjacent_never_cold_but_distant() -> None:
    # 0 and 2 are cold but not adjacent (1 between them is warm).
    loads = {0: cold(), 1: warm(), 2: cold()}
    assert isinstance(decide(layout_of(3), loads, {}, PIP483, NOW), NoAction)


def test_adjacency_follows_hash_order_not_ids() -> None:
    lay = split(layout_of(2), 0, now_ms=0)  # active: 2 [0,3fff], 3 [4000,7fff], 1 [8000,ffff]
    loads = {1: cold(1), 2: cold(500), 3: cold(1)}
    d = decide(lay, loads, {}, PIP483, NOW)
    # 3 and 1 are adjacent in hash order and the coldest pair.
    assert isinstance(d, Merge) and (d.a, d.b) == (3, 1)


# --- 4. extensions -----------------------------------------------------------------------


def test_k_way_split_converges_an_overload_in_one_step() -> None:
    d = decide(layout_of(1), {0: sample(35_000)}, {}, OURS, NOW)
    assert isinstance(d, Split) and len(d.boundaries) + 1 == 4
    assert d.boundaries == (0x4000, 0x8000, 0xC000)


def test_k_way_split_is_capped_by_fanout_and_max_segments() -> None:
    d = decide(layout_of(1), {0: sample(1e6)}, {}, OURS, NOW)
    assert isinstance(d, Split) and len(d.boundaries) + 1 == OURS.max_split_fanout
    policy = dataclasses.replace(OURS, max_segments=4)
    d = decide(layout_of(2), {0: sample(1e6)}, {}, policy, NOW)
    assert isinstance(d, Split) and len(d.boundaries) + 1 == 3


def test_consumer_burst_gets_a_segment_per_consumer_in_one_decision() -> None:
    d = decide(layout_of(1), {}, {"s": 4}, OURS, NOW)
    assert isinstance(d, Split) and len(d.boundaries) + 1 == 4
    d = decide(layout_of(2), {}, {"s": 5}, OURS, NOW)
    assert isinstance(d, Split) and len(d.boundaries) + 1 == 4  # 2 - 1 + 4 = 5 segments


def test_min_split_width_stops_splitting_a_hot_key() -> None:
    policy = dataclasses.replace(OURS, min_split_width=0x4000)
    lay = split(layout_of(1), 0, now_ms=0)  # two halves of 0x8000: each may split once more
    d = decide(lay, {1: sample(1e6)}, {}, policy, NOW)
    assert isinstance(d, Split) and len(d.boundaries) + 1 == 2
    lay = split(lay, 1, now_ms=0)  # quarters, width 0x4000 = min width: unsplittable
    d = decide(lay, {3: sample(1e6)}, {}, policy, NOW)
    assert isinstance(d, NoAction) and d.reason == "min-split-width"


def test_min_split_width_passes_over_an_unsplittable_hot_segment() -> None:
    policy = dataclasses.replace(OURS, min_split_width=0x4000)
    lay = split(split(layout_of(1), 0, now_ms=0), 1, now_ms=0)  # 2: 0x8000 wide; 3, 4 narrow
    d = decide(lay, {3: sample(1e6), 2: sample(20_000)}, {}, policy, NOW)
    assert isinstance(d, Split) and d.segment_id == 2


def test_no_merge_that_would_resplit() -> None:
    # Narrow dead band: merge thresholds at 60% of split. Each cold, together over 0.8x split.
    policy = dataclasses.replace(OURS, merge_thresholds=rates(6_000, 30e6, 30_000, 150e6))
    loads = {0: cold(5_000), 1: cold(5_000)}
    d = decide(layout_of(2), loads, {}, policy, NOW)
    assert isinstance(d, NoAction)
    loads = {0: cold(3_000), 1: cold(4_000)}
    assert isinstance(decide(layout_of(2), loads, {}, policy, NOW), Merge)
    pulsar = dataclasses.replace(policy, merge_combined_max_ratio=math.inf)
    assert isinstance(
        decide(layout_of(2), {0: cold(5_000), 1: cold(5_000)}, {}, pulsar, NOW), Merge
    )


def test_no_merge_on_stale_load() -> None:
    stale = cold(sampled=NOW - 900_001)
    d = decide(layout_of(2), {0: cold(sampled=NOW), 1: stale}, {}, OURS, NOW)
    assert isinstance(d, NoAction)
    fresh = cold(sampled=NOW - 900_000)
    assert isinstance(decide(layout_of(2), {0: cold(), 1: fresh}, {}, OURS, NOW), Merge)
    # load_ttl 0 disables the check (Pulsar).
    pulsar = dataclasses.replace(OURS, load_ttl_seconds=0)
    assert isinstance(decide(layout_of(2), {0: cold(), 1: stale}, {}, pulsar, NOW), Merge)


def test_cold_since_supersedes_changed_at() -> None:
    # Noisy but always cold: the record changed a minute ago, cold for an hour.
    noisy = cold(changed=NOW - 60_000, cold_since=NOW - 7_200_000)
    assert is_cold(noisy, OURS, NOW)
    assert isinstance(decide(layout_of(2), {0: noisy, 1: noisy}, {}, OURS, NOW), Merge)
    recent = cold(changed=LONG_AGO, cold_since=NOW - 1_000)
    assert not is_cold(recent, OURS, NOW)
    assert not is_cold(cold(changed=NOW - 60_000), OURS, NOW)


def test_every_decision_has_a_human_readable_detail() -> None:
    for d in (
        decide(layout_of(1), {0: sample(25_000)}, {}, OURS, NOW),
        decide(layout_of(2), {0: cold(), 1: cold()}, {}, OURS, NOW),
        decide(layout_of(2), {}, {}, OURS, NOW),
    ):
        assert d.reason and len(d.detail) > 20


# --- overrides -----------------------------------------------------------------------------


def test_overrides_resolve_field_by_field_narrowest_last() -> None:
    tenant = {"maxSegments": 32, "splitMsgRateInThreshold": 2_000}
    namespace = {"maxSegments": 16, "mergeWindowSeconds": None}
    topic = {"splitBytesRateInThreshold": 10e6, "minSegments": 2}
    resolved = resolve_policy(OURS, tenant, namespace, topic)
    assert isinstance(resolved, PolicySettings)
    assert resolved.max_segments == 16
    assert resolved.min_segments == 2
    assert resolved.merge_window_seconds == OURS.merge_window_seconds
    assert resolved.split_thresholds == rates(2_000, 10e6, 50_000, 250e6)
    assert resolved.merge_thresholds == OURS.merge_thresholds


def test_topic_override_from_the_layout_changes_the_decision() -> None:
    topic = {"splitMsgRateInThreshold": 100.0, "mergeMsgRateInThreshold": 10.0}
    resolved = resolve_policy(OURS, topic)
    d = decide(layout_of(1), {0: sample(250)}, {}, resolved, NOW)
    assert isinstance(d, Split) and len(d.boundaries) + 1 == 3


@pytest.mark.parametrize(
    "override",
    [
        {"maxSegments": 0},
        {"minSegments": 5, "maxSegments": 3},
        {"splitMsgRateInThreshold": 500},  # below the merge threshold 1000
        {"maxSegments": "many"},
        {"enabled": "yes"},
        {"maxDagDepth": 1.5},
    ],
)
def test_invalid_override_disables_the_topic_with_a_reason(override: dict[str, object]) -> None:
    resolved = resolve_policy(OURS, override)
    assert isinstance(resolved, PolicyInvalid)
    d = decide(layout_of(1), {0: sample(1e6)}, {}, resolved, NOW)
    assert isinstance(d, NoAction) and d.reason == "policy-invalid"
    assert resolved.detail in d.detail


def test_unknown_override_fields_are_ignored_and_disable_works() -> None:
    resolved = resolve_policy(OURS, {"somethingNew": 1, "enabled": False})
    assert isinstance(resolved, PolicySettings) and not resolved.enabled


# --- overrides that once crashed (found by the property tests) ------------------------------


@pytest.mark.parametrize(
    "override",
    [{"maxSplitFanout": 4.0}, {"minSplitWidth": 1024.0}, {"maxSegments": 32.0}],
)
def test_integral_floats_become_ints(override: dict[str, object]) -> None:
    resolved = resolve_policy(OURS, override)
    assert isinstance(resolved, PolicySettings)
    d = decide(layout_of(16), {0: sample(1e5)}, {}, resolved, NOW)
    assert isinstance(d, Split)


@pytest.mark.parametrize(
    "key",
    ["splitCooldownSeconds", "splitMsgRateInThreshold", "maxSegments", "mergeCombinedMaxRatio"],
)
def test_huge_numbers_are_invalid_not_a_crash(key: str) -> None:
    resolved = resolve_policy(OURS, {key: 10**400})
    assert isinstance(resolved, PolicyInvalid) and "out of range" in resolved.detail


def test_no_merge_that_would_leave_a_consumer_without_a_segment() -> None:
    loads = {0: cold(), 1: cold(), 2: cold()}
    d = decide(layout_of(3), loads, {"s": 3}, OURS, NOW)
    assert isinstance(d, NoAction) and d.reason == "consumers"
    assert isinstance(decide(layout_of(3), loads, {"s": 2}, OURS, NOW), Merge)
    # Pulsar merges, and then splits again for the consumer count.
    assert isinstance(decide(layout_of(3), loads, {"s": 3}, PIP483, NOW), Merge)


def test_a_merge_child_inherits_the_later_cold_since_of_its_parents() -> None:
    lay = merge(layout_of(2), 0, 1, now_ms=0)  # child 2
    assert inherited_cold_since(lay, 2, {0: 100, 1: 300}) == 300
    assert inherited_cold_since(lay, 2, {0: 100}) is None  # one parent was not cold
    assert inherited_cold_since(lay, 0, {0: 100, 1: 300}) is None  # no parents
    assert inherited_cold_since(lay, 99, {}) is None


# --- hashBuckets: the reporters' histogram (wire format agreed with the reference broker) ---


def test_hash_buckets_parse_and_round_trip() -> None:
    record = {"msgRateIn": 10, "byteRateIn": 1, "msgRateOut": 1, "byteRateOut": 1}
    sample = load_sample_from_json({**record, "hashBuckets": [1, 2.5, 0]}, seen_at_ms=5)
    assert sample.hash_buckets == (1.0, 2.5, 0.0)
    assert load_sample_to_json(sample)["hashBuckets"] == [1.0, 2.5, 0.0]
    assert load_sample_from_json(record, seen_at_ms=5).hash_buckets is None
    assert "hashBuckets" not in load_sample_to_json(load_sample_from_json(record, seen_at_ms=5))
    # dropped on its own, as any malformed histogram (float() of it raised OverflowError)
    huge = load_sample_from_json({**record, "hashBuckets": [1, 10**400]}, seen_at_ms=5)
    assert huge.hash_buckets is None and huge.rates.msg_rate_in == 10


@pytest.mark.parametrize(
    "buckets",
    [
        [],
        [1.0] * 33,
        [1, -1],
        [1, float("nan")],
        [1, float("inf")],
        [1, True],
        [1, "2"],
        "1,2",
        {"0": 1},
        7,
    ],
)
def test_a_malformed_histogram_drops_only_the_histogram(buckets: object) -> None:
    record = {"msgRateIn": 10, "byteRateIn": 1, "msgRateOut": 1, "byteRateOut": 1}
    sample = load_sample_from_json({**record, "hashBuckets": buckets}, seen_at_ms=5)
    assert sample.hash_buckets is None
    assert sample.rates == rates(10, 1, 1, 1) and sample.changed_at_ms == 5


def test_history_fields_round_trip_and_bad_ones_name_the_field() -> None:
    sample = LoadSample(
        rates(1, 2, 3, 4), 10, 11, 12, (1.0,), rates(5, 6, 7, 8), flipflops=2, last_flipflop_ms=9
    )
    assert load_sample_from_json(load_sample_to_json(sample)) == sample
    base = load_sample_to_json(sample)
    with pytest.raises(ModelError, match=r"peakRates\.msgRateIn"):
        load_sample_from_json({**base, "peakRates": {"msgRateIn": -1}})
    with pytest.raises(ModelError, match="flipflops"):
        load_sample_from_json({**base, "flipflops": -1})
    # The old positional shape still builds a sample with every extension neutral.
    old = LoadSample(rates(), 1, 2, 3)
    assert (old.hash_buckets, old.peak_rates, old.flipflops, old.last_flipflop_ms) == (
        None,
        None,
        0,
        None,
    )


# --- load-aware split boundaries -------------------------------------------------------------

FULL = HashRange(0, 0xFFFF)


def test_uniform_histogram_splits_like_equal_width() -> None:
    plan = plan_split(FULL, [1.0] * 32, 3.5, 8, 256)
    assert plan is not None and not plan.refused
    assert plan.boundaries == (0x4000, 0x8000, 0xC000)
    assert plan.loads == pytest.approx((0.875,) * 4)


def test_skewed_histogram_gets_children_of_equal_load() -> None:
    # All load in the lower half: equal-width children would leave one child at 2x.
    plan = plan_split(FULL, [1.0] * 16 + [0.0] * 16, 2.0, 8, 256)
    assert plan is not None
    assert plan.boundaries[0] == 0x4000  # the lower half's load split in two
    assert max(plan.loads) <= 1.0
    assert sum(plan.loads) == pytest.approx(2.0)


def test_a_hot_key_gets_the_narrowest_child_allowed() -> None:
    buckets = [0.1] * 32
    buckets[5] = 10.0  # slice 5 of 32: hashes 0x2800..0x2fff
    plan = plan_split(FULL, buckets, 3.0, 8, 256)
    assert plan is not None and not plan.refused
    assert 0x2800 in plan.boundaries and 0x3000 in plan.boundaries
    hot = plan.loads.index(max(plan.loads))
    assert plan.widths[hot] == 0x800  # the slice itself: the histogram says nothing finer
    # Inside a narrow range the hot child is exactly min_split_width wide.
    narrow = HashRange(0, 0x1FFF)  # slices of 256
    plan = plan_split(narrow, buckets, 3.0, 8, 512)
    assert plan is not None
    assert plan.widths[plan.loads.index(max(plan.loads))] == 512


def test_a_split_that_cannot_relieve_a_hot_key_is_refused() -> None:
    buckets = [0.0] * 32
    buckets[5] = 10.0
    plan = plan_split(HashRange(0, 1023), buckets, 3.0, 8, 256)
    assert plan is not None and plan.refused  # its child would be 256 wide and still at 3x
    lay = split(layout_of(1), 0, (1024,), now_ms=0)  # 1: [0, 1023], 2: the rest
    narrow = {1: LoadSample(rates(30_000), LONG_AGO, hash_buckets=tuple(buckets))}
    d = decide(lay, narrow, {}, OURS, NOW)
    assert isinstance(d, NoAction) and d.reason == "hot-key"
    assert "hot key" in d.detail
    # A key of 1.2x in a range at 1.4x: the split takes some of its 0.4 overload off,
    # so it happens though the key's child stays hot (and the key is then left alone).
    mixed = [0.2 / 31] * 32
    mixed[5] = 1.2
    plan = plan_split(HashRange(0, 1023), mixed, 1.4, 8, 256)
    assert plan is not None and not plan.refused
    assert 1.2 <= max(plan.loads) < 1.4 - 0.1 * 0.4
    # Without the histogram the same range splits equal-width (it cannot know).
    assert isinstance(decide(lay, {1: sample(30_000)}, {}, OURS, NOW), Split)


def test_decide_uses_the_histogram_and_falls_back_to_the_next_hot_segment() -> None:
    skewed = tuple([1.0] * 8 + [0.0] * 24)
    lay = layout_of(2)  # 0: [0, 0x7fff], 1: [0x8000, 0xffff]
    loads = {0: LoadSample(rates(20_000), LONG_AGO, hash_buckets=skewed)}
    d = decide(lay, loads, {}, OURS, NOW)
    assert isinstance(d, Split) and d.segment_id == 0
    assert d.boundaries == (0x1000,)  # the load sits in [0, 0x1fff]: split there
    assert "load-aware" in d.detail
    off = dataclasses.replace(OURS, load_aware_splits=False)
    assert decide(lay, loads, {}, off, NOW).boundaries == (0x4000,)  # type: ignore[union-attr]
    # Segment 1 is hotter but its hot key cannot be relieved: segment 0 splits instead.
    hot_key = [0.0] * 32
    hot_key[3] = 1.0
    narrow = split(lay, 1, (0x8000 + 512,), now_ms=0)  # 2: [0x8000, 0x81ff], 3: rest
    loads = {
        2: LoadSample(rates(40_000), LONG_AGO, hash_buckets=tuple(hot_key)),
        0: LoadSample(rates(20_000), LONG_AGO, hash_buckets=skewed),
    }
    d = decide(narrow, loads, {}, OURS, NOW)
    assert isinstance(d, Split) and d.segment_id == 0


# --- the split cooldown per range -------------------------------------------------------------

RANGE = dataclasses.replace(PIP483, range_split_cooldown=True)


def test_range_cooldown_holds_back_only_the_children_of_the_last_split() -> None:
    lay = split(layout_of(2), 0, now_ms=NOW - 10_000)  # children 2, 3 are 10 s old
    loads = {2: sample(30_000), 1: sample(20_000)}
    d = decide(lay, loads, {}, PIP483, NOW, last_split_ms=NOW - 10_000)
    assert isinstance(d, NoAction) and d.reason == "split-cooldown"
    d = decide(lay, loads, {}, RANGE, NOW, last_split_ms=NOW - 10_000)
    assert isinstance(d, Split) and d.segment_id == 1  # 2 is hotter but just created
    d = decide(lay, {2: sample(30_000)}, {}, RANGE, NOW, last_split_ms=NOW - 10_000)
    assert isinstance(d, NoAction) and d.reason == "split-cooldown"
    d = decide(lay, {2: sample(30_000)}, {}, RANGE, NOW + 50_000)
    assert isinstance(d, Split) and d.segment_id == 2
    # GC pruned the parent (and the children's link to it): the topic's split stamp
    # still holds the young children back, as it would without the range rule.
    pruned = prune(lay, [0])
    d = decide(pruned, {2: sample(30_000)}, {}, RANGE, NOW, last_split_ms=NOW - 10_000)
    assert isinstance(d, NoAction) and d.reason == "split-cooldown"
    d = decide(pruned, {1: sample(30_000)}, {}, RANGE, NOW, last_split_ms=NOW - 10_000)
    assert isinstance(d, Split) and d.segment_id == 1  # created long before the split
    # A creation time ahead of our clock (skew) never holds a hot range back by itself ...
    d = decide(lay, {2: sample(30_000)}, {}, RANGE, NOW - 20_000)
    assert isinstance(d, Split) and d.segment_id == 2
    # ... but the topic's split stamp (capped at when we saw the split) dates the children
    # instead: a broker a year ahead no longer lets them split again at once.
    ahead = split(layout_of(2), 0, now_ms=NOW + 365 * 86_400_000)
    for at, held in ((NOW + 10_000, True), (NOW + 59_000, True), (NOW + 61_000, False)):
        d = decide(ahead, {2: sample(30_000)}, {}, RANGE, at, last_split_ms=NOW)
        assert isinstance(d, NoAction if held else Split), (at, d)


# --- merging on the window's peak, and merge backoff after flip-flops --------------------------

PEAK = dataclasses.replace(OURS, peak_window_seconds=3_600.0)


def test_a_pair_that_was_hot_within_the_peak_window_does_not_merge() -> None:
    burst = LoadSample(rates(10), LONG_AGO, peak_rates=rates(7_500))
    calm = LoadSample(rates(10), LONG_AGO, peak_rates=rates(900))
    assert isinstance(decide(layout_of(2), {0: calm, 1: calm}, {}, PEAK, NOW), Merge)
    d = decide(layout_of(2), {0: burst, 1: calm}, {}, PEAK, NOW)
    assert isinstance(d, NoAction)  # 7500 + 900 >= 0.8 x 10000
    # With the window off the peaks are ignored (Pulsar), and so they are with ratio inf.
    assert isinstance(decide(layout_of(2), {0: burst, 1: calm}, {}, OURS, NOW), Merge)
    pulsar = dataclasses.replace(PEAK, merge_combined_max_ratio=math.inf)
    assert isinstance(decide(layout_of(2), {0: burst, 1: calm}, {}, pulsar, NOW), Merge)


def test_flip_flops_lengthen_the_merge_window_and_are_forgotten_with_calm() -> None:
    policy = dataclasses.replace(OURS, merge_backoff_factor=2.0, merge_backoff_decay_seconds=3600)
    window = policy.merge_window_seconds * 1000
    twice = LoadSample(rates(10), 0, cold_since_ms=NOW - int(2 * window), flipflops=2)
    twice = dataclasses.replace(twice, last_flipflop_ms=NOW - 1)
    assert merge_window_ms(twice, policy, NOW) == 4 * window
    assert isinstance(decide(layout_of(2), {0: twice, 1: twice}, {}, policy, NOW), NoAction)
    later = NOW + 3_600_000  # one calm hour: one flip-flop forgotten
    assert merge_window_ms(twice, policy, later) == 2 * window
    assert isinstance(decide(layout_of(2), {0: twice, 1: twice}, {}, policy, later), Merge)
    assert merge_window_ms(twice, dataclasses.replace(OURS, merge_backoff_factor=1), NOW) == window


def test_split_to_peak_sizes_the_split_for_the_recent_peak() -> None:
    policy = dataclasses.replace(OURS, peak_window_seconds=3_600.0, split_to_peak=True)
    swinging = LoadSample(rates(15_000), LONG_AGO, peak_rates=rates(38_000))
    d = decide(layout_of(1), {0: swinging}, {}, policy, NOW)
    assert isinstance(d, Split) and len(d.boundaries) + 1 == 4
    d = decide(layout_of(1), {0: swinging}, {}, OURS, NOW)
    assert isinstance(d, Split) and len(d.boundaries) + 1 == 2


def cascade(
    first_ms: int, second_ms: int, last_ms: int, policy: PolicySettings = OURS
) -> tuple[Layout, TopicHistory]:
    """Four segments merged down to one, as the caller records it: 0+1 -> 4 at
    ``first_ms``, 2+3 -> 5 at ``second_ms``, 4+5 -> 6 at ``last_ms``."""
    lay, history = layout_of(4), TopicHistory()
    for a, b, t in ((0, 1, first_ms), (2, 3, second_ms), (4, 5, last_ms)):
        after = merge(lay, a, b, now_ms=t)
        history.applied(lay, Merge(a, b, "cold", ""), after, t, policy, {})
        history.forget(s.segment_id for s in after.active_segments())
        lay = after
    return lay, history


def hot_at(
    history: TopicHistory, msg_in: float, now: int, policy: PolicySettings = OURS
) -> dict[int, LoadSample]:
    return {6: history.annotate(6, sample(msg_in), now, policy)}


def test_a_merge_cascade_that_turns_hot_is_split_back_whole() -> None:
    """1.2x the threshold needs two children; the range was four segments ten minutes
    ago, and split by split that is three operations, each undoing a merge."""
    lay, history = cascade(NOW - 900_000, NOW - 600_000, NOW - 300_000)
    hot = hot_at(history, 12_000, NOW)
    assert hot[6].merged == 4
    d = decide(lay, hot, {}, OURS, NOW)
    assert isinstance(d, Split) and d.boundaries == (0x4000, 0x8000, 0xC000)
    assert "undoing merges of the last 1800s that made it of 4 segments" in d.detail
    off = dataclasses.replace(OURS, merge_undo_seconds=0.0)
    assert hot_at(history, 12_000, NOW, off)[6].merged == 0
    for plain in (
        decide(lay, hot, {}, off, NOW),
        decide(lay, hot_at(history, 12_000, NOW, off), {}, OURS, NOW),
    ):
        assert isinstance(plain, Split) and plain.boundaries == (0x8000,)
        assert "undoing" not in plain.detail
    # Load that needs more children than the merges replaced gets them, and the undo
    # is not named: the load alone sized the split.
    d = decide(lay, hot_at(history, 55_000, NOW), {}, OURS, NOW)
    assert isinstance(d, Split) and len(d.boundaries) + 1 == 6 and "undoing" not in d.detail
    # Pulsar's settings: a binary midpoint split, as PIP-483, whatever the history says.
    pip = decide(lay, hot, {}, PIP483, NOW)
    assert isinstance(pip, Split) and pip.boundaries == (0x8000,)
    assert decide(lay, hot, {}, dataclasses.replace(PIP483, max_split_fanout=8), NOW) == (
        decide(lay, {6: sample(12_000)}, {}, dataclasses.replace(PIP483, max_split_fanout=8), NOW)
    )


def test_only_merges_within_merge_undo_seconds_are_undone() -> None:
    # 0+1 merged 35 minutes before the last merge: its child 4 was one segment then.
    lay, history = cascade(NOW - 2_400_000, NOW - 600_000, NOW - 300_000)
    d = decide(lay, hot_at(history, 12_000, NOW), {}, OURS, NOW)
    assert isinstance(d, Split) and d.boundaries == (21_846, 43_691)  # the count, not
    assert "made it of 3 segments" in d.detail  # the old boundaries (cut for other load)
    # Up to merge_undo_seconds after the last merge inclusive, then a split for the load.
    edge = NOW - 300_000 + 1_800_000
    assert hot_at(history, 12_000, edge)[6].merged == 3
    assert 6 in history
    late = hot_at(history, 12_000, edge + 1)
    assert late[6].merged == 0
    assert 6 not in history  # an expired count held nothing else: the range is dropped
    d = decide(lay, late, {}, OURS, edge + 1)
    assert isinstance(d, Split) and d.boundaries == (0x8000,) and "undoing" not in d.detail
    # A split's children are not merge children, though their parent was one.
    after = split(lay, 6, (0x8000,), now_ms=NOW)
    history.applied(lay, Split(6, (0x8000,), "msgRateIn", ""), after, NOW, OURS, {})
    history.forget(s.segment_id for s in after.active_segments())
    child = {7: history.annotate(7, sample(12_000), NOW + 60_000, OURS)}
    assert child[7].merged == 0
    d = decide(after, child, {}, OURS, NOW + 60_000)
    assert isinstance(d, Split) and len(d.boundaries) == 1 and "undoing" not in d.detail


def test_merge_undo_respects_the_fanout_and_survives_a_new_leader() -> None:
    lay, history = cascade(NOW - 900_000, NOW - 600_000, NOW - 300_000)
    hot = hot_at(history, 12_000, NOW)
    binary = dataclasses.replace(OURS, max_split_fanout=2)
    d = decide(lay, hot, {}, binary, NOW)
    assert isinstance(d, Split) and d.boundaries == (0x8000,) and "undoing" not in d.detail
    three = dataclasses.replace(OURS, max_split_fanout=3)
    d = decide(lay, hot, {}, three, NOW)
    assert isinstance(d, Split) and len(d.boundaries) + 1 == 3
    assert "made it of 4 segments" in d.detail
    # The count is history, not the layout: a GC that pruned the sealed parents (Pulsar's
    # does within a minute) loses nothing, and a new leader reads it back from etcd.
    gone = prune(lay, [0, 1, 2, 3, 4, 5])
    stored = json.loads(json.dumps(history.to_json()))
    assert stored["6"]["merged"] == 4 and stored["6"]["mergedMs"] == NOW - 300_000
    again = TopicHistory.from_json(stored)
    d = decide(gone, {6: again.annotate(6, sample(12_000), NOW, OURS)}, {}, OURS, NOW)
    assert isinstance(d, Split) and d.boundaries == (0x4000, 0x8000, 0xC000)
    for bad in (True, -1, 2.5, "4", 2**63):
        assert 6 not in TopicHistory.from_json({"6": {**stored["6"], "merged": bad}})
    # A count beyond 64 bits failed the next write of the history (orjson), which
    # follows every layout change: the leader exited on it, and again after a restart.
    for bad in (1e20, 2**64, -1, 2.5, True):
        assert 6 not in TopicHistory.from_json({"6": {**stored["6"], "flipflops": bad}})
    orjson.dumps(TopicHistory.from_json(stored).to_json())
    # ... and so does controllerd decide's LOAD.json.
    record = load_sample_to_json(hot[6])
    assert record["merged"] == 4
    assert load_sample_from_json(record).merged == 4
    with pytest.raises(ModelError, match="merged"):
        load_sample_from_json({**record, "merged": -1})


def test_merge_undo_with_a_histogram_balances_the_children_it_restores() -> None:
    lay, history = cascade(NOW - 900_000, NOW - 600_000, NOW - 300_000)
    skewed = (3.0,) * 16 + (1.0,) * 16  # three quarters of the load in the lower half
    hot = {6: dataclasses.replace(hot_at(history, 12_000, NOW)[6], hash_buckets=skewed)}
    d = decide(lay, hot, {}, OURS, NOW)
    assert isinstance(d, Split) and len(d.boundaries) == 3
    assert d.boundaries[1] < 0x8000  # balanced by load, not equal-width
    plan = plan_split(FULL, list(skewed), 1.2, 8, 256, min_children=4)
    assert plan is not None and len(plan.loads) == 4
    assert max(plan.loads) == pytest.approx(0.3, abs=0.05)
    capped = plan_split(FULL, list(skewed), 1.2, 3, 256, min_children=4)
    assert capped is not None and len(capped.loads) == 3
    # Load in two slices: the balance alone stops at two children; the count is
    # restored where it leaves the hottest child no hotter, load-free slices shared
    # out evenly.
    two = [0.0] * 32
    two[5], two[20] = 1.0, 0.2
    plan = plan_split(FULL, two, 1.2, 8, 256, min_children=4)
    assert plan is not None and len(plan.loads) == 4
    assert min(plan.widths) >= 256 and sum(plan.loads) == pytest.approx(1.2)
    assert plan_split(FULL, two, 1.2, 8, 256) == plan_split(FULL, two, 1.2, 8, 256, min_children=2)
    narrow = plan_split(HashRange(0, 767), two, 1.2, 8, 256, min_children=4)
    # 768 hashes in slices of 24: no three children are each at least min_split_width
    # (256, 11 slices) wide, so the count stays short of four; the load-free slices
    # between the two loaded ones are shared evenly.
    assert narrow is not None and narrow.widths == (384, 384)


# --- history the caller keeps -----------------------------------------------------------------


def test_topic_history_keeps_the_window_peak_and_hands_it_down() -> None:
    history = TopicHistory()
    history.observe(0, rates(8_000, 1, 1, 1), 1_000, PEAK)
    history.observe(0, rates(100, 2, 1, 1), 2_000, PEAK)
    assert history.peak(0, 3_000, PEAK) == rates(8_000, 2, 1, 1)
    assert history.next_expiry_ms(3_000, PEAK) == 1_000 + 3_600_000 + 1
    annotated = history.annotate(0, sample(100), 3_000, PEAK)
    assert annotated.peak_rates == rates(8_000, 2, 1, 1)
    assert history.peak(0, 1_000 + 3_600_001, PEAK) == rates(100, 2, 1, 1)
    history.observe(0, rates(8_000, 1, 1, 1), 3_600_000, PEAK)
    # A split child takes its share of the parent's peak (by width without a histogram).
    lay = layout_of(1)
    after = split(lay, 0, now_ms=4_000)
    history.applied(lay, Split(0, (0x8000,), "msgRateIn"), after, 4_000, PEAK, {})
    assert history.peak(1, 5_000, PEAK) == rates(4_000, 1, 0.5, 0.5)
    assert 0 not in history
    # The merge of the two children inherits the sum of their peaks; merging them a
    # second after the split undoes it within the merge window: a flip-flop.
    merged = merge(after, 1, 2, now_ms=5_000)
    flipflop = history.applied(after, Merge(1, 2, "cold"), merged, 5_000, PEAK, {})
    assert history.peak(3, 6_000, PEAK) == rates(8_000, 2, 1, 1)
    assert flipflop


def test_topic_history_counts_a_split_of_a_fresh_merge_as_a_flip_flop() -> None:
    policy = dataclasses.replace(OURS, merge_backoff_factor=2.0)
    history = TopicHistory()
    lay = layout_of(2)
    merged = merge(lay, 0, 1, now_ms=NOW)
    assert not history.applied(lay, Merge(0, 1, "cold"), merged, NOW, policy, {})
    again = split(merged, 2, now_ms=NOW + 60_000)
    assert history.applied(
        merged, Split(2, (0x8000,), "msgRateIn"), again, NOW + 60_000, policy, {}
    )
    child = history.annotate(3, cold(), NOW + 60_000, policy)
    assert (child.flipflops, child.last_flipflop_ms) == (1, NOW + 60_000)
    # A new leader that restores the persisted history sees the same.
    restored = TopicHistory.from_json(json.loads(json.dumps(history.to_json())))
    assert restored.annotate(3, cold(), NOW + 60_000, policy) == child
    assert TopicHistory.from_json({"x": 1, "4": {"flipflops": "many"}}).to_json() == {}


def test_merge_regret_counts_a_split_of_a_merge_that_did_not_last() -> None:
    """A merge split again 3 h later is past the 2 h merge window, so only the regret
    horizon makes it count; a merge of a split's children is never a regret."""
    base = dataclasses.replace(OURS, merge_window_seconds=7_200, merge_backoff_factor=2.0)
    regret = dataclasses.replace(base, merge_regret_seconds=43_200)
    later = NOW + 3 * 3_600_000
    lay = layout_of(2)
    merged = merge(lay, 0, 1, now_ms=NOW)
    again = split(merged, 2, now_ms=later)
    for policy, counted in ((base, False), (regret, True)):
        history = TopicHistory()
        assert not history.applied(lay, Merge(0, 1, "cold"), merged, NOW, policy, {})
        got = history.applied(merged, Split(2, (0x8000,), "msgRateIn"), again, later, policy, {})
        assert got is counted
        child = history.annotate(3, cold(), later, policy)
        assert merge_window_ms(child, policy, later) == 7_200_000 * (2 if counted else 1)
    # Past the regret horizon the merge paid for itself.
    late = NOW + 43_200_000
    history = TopicHistory()
    history.applied(lay, Merge(0, 1, "cold"), merged, NOW, regret, {})
    far = split(merged, 2, now_ms=late)
    assert not history.applied(merged, Split(2, (0x8000,), "msgRateIn"), far, late, regret, {})
    # Merging a split's children 3 h later undoes nothing that regret judges.
    one = layout_of(1)
    halves = split(one, 0, now_ms=NOW)
    joined = merge(halves, 1, 2, now_ms=later)
    history = TopicHistory()
    history.applied(one, Split(0, (0x8000,), "msgRateIn"), halves, NOW, regret, {})
    assert not history.applied(halves, Merge(1, 2, "cold"), joined, later, regret, {})


def test_a_flip_flop_is_forgotten_once_per_calm_period_across_operations() -> None:
    """Two flip-flops, then a day of calm, then a split: the children still answer for
    one until the second day of calm ends (the split must not apply the first day's
    decay a second time)."""
    policy = dataclasses.replace(OURS, merge_backoff_factor=2.0, merge_backoff_decay_seconds=86_400)
    day, window = 86_400_000, policy.merge_window_seconds * 1000.0
    history = TopicHistory.from_json({"0": {"flipflops": 2, "lastFlipflopMs": NOW}})
    lay = layout_of(1)
    later = NOW + day + 3_600_000
    halves = split(lay, 0, now_ms=later)
    assert not history.applied(lay, Split(0, (0x8000,), "msgRateIn"), halves, later, policy, {})
    for t, factor in ((later, 2), (NOW + 2 * day - 1, 2), (NOW + 2 * day, 1)):
        child = history.annotate(1, cold(), t, policy)
        assert merge_window_ms(child, policy, t) == window * factor, t
    # A count stored without a time never decays, and is carried as it is.
    timeless = TopicHistory.from_json({"0": {"flipflops": 1}})
    assert not timeless.applied(lay, Split(0, (0x8000,), "msgRateIn"), halves, later, policy, {})
    child = timeless.annotate(2, cold(), NOW + 9 * day, policy)
    assert merge_window_ms(child, policy, NOW + 9 * day) == window * 2


# --- headroom for a recent rise ---------------------------------------------------------------

HEADROOM = dataclasses.replace(OURS, merge_headroom_half_life_seconds=3_600.0)


def test_a_pair_that_rose_lately_keeps_room_for_the_rise_until_it_decays() -> None:
    """Range 0 jumped from 0.01 to 0.91 split thresholds between two records and fell
    back: merged with its cold neighbour (0.02 together) it must keep room for 0.9, which
    reaches 0.8 until the rise has decayed below 0.78, log2(0.9 / 0.78) half-lives on."""
    history = TopicHistory()
    rose_at = NOW - 60_000
    for t, level in ((NOW - 120_000, 100), (rose_at, 9_100), (NOW, 100)):
        history.observe(0, rates(level), t, HEADROOM)
    history.observe(1, rates(100), NOW, HEADROOM)
    lay = layout_of(2)

    def loads(t: int) -> dict[int, LoadSample]:
        return {sid: history.annotate(sid, cold(100), t, HEADROOM) for sid in (0, 1)}

    assert loads(rose_at)[0].rise == pytest.approx(0.9)
    assert loads(NOW)[1].rise == 0  # it never rose
    d = decide(lay, loads(NOW), {}, HEADROOM, NOW)
    assert isinstance(d, NoAction) and d.reason == "merge-headroom"
    wake = next_decision_ms(lay, loads(NOW), HEADROOM, NOW)
    assert wake == rose_at + math.floor(3_600_000 * math.log2(0.9 / 0.78))
    assert not isinstance(decide(lay, loads(wake - 1), {}, HEADROOM, wake - 1), Merge)
    assert isinstance(decide(lay, loads(wake + 1), {}, HEADROOM, wake + 1), Merge)
    # Off (0) and Pulsar's infinite ratio ignore it.
    assert isinstance(decide(lay, loads(NOW), {}, OURS, NOW), Merge)
    pulsar = dataclasses.replace(HEADROOM, merge_combined_max_ratio=math.inf)
    assert isinstance(decide(lay, loads(NOW), {}, pulsar, NOW), Merge)
    assert next_decision_ms(lay, loads(NOW), pulsar, NOW) is None


def test_a_rise_is_handed_down_and_survives_a_new_leader() -> None:
    """A split child takes its share of the parent's rise, a merge child the sum of its
    parents' (each decayed to the merge), and the persisted history restores both."""
    history = TopicHistory()
    history.observe(0, rates(0), NOW, HEADROOM)
    history.observe(0, rates(8_000), NOW + 60_000, HEADROOM)  # a rise of 0.8
    one = layout_of(1)
    halves = split(one, 0, now_ms=NOW + 120_000)
    history.applied(one, Split(0, (0x8000,), "msgRateIn"), halves, NOW + 120_000, HEADROOM, {})
    child = history.annotate(1, cold(), NOW + 60_000, HEADROOM)
    assert child.rise == pytest.approx(0.4)  # half the width, half the rise
    hour_on = NOW + 60_000 + 3_600_000
    assert history.annotate(2, cold(), hour_on, HEADROOM).rise == pytest.approx(0.2)
    joined = merge(halves, 1, 2, now_ms=hour_on)
    history.applied(halves, Merge(1, 2, "cold"), joined, hour_on, HEADROOM, {})
    assert history.annotate(3, cold(), hour_on, HEADROOM).rise == pytest.approx(0.4)
    # A new range's first record is not a rise: no score is guessed from its parents
    # (by width, a skewed split's hot child would seem to jump). Its second can be.
    history.observe(3, rates(9_000), hour_on + 1, HEADROOM)
    assert history.annotate(3, cold(), hour_on + 1, HEADROOM).rise == pytest.approx(0.4)
    history.observe(3, rates(500), hour_on + 2, HEADROOM)
    history.observe(3, rates(9_500), hour_on + 3, HEADROOM)  # a rise of 0.9
    assert history.annotate(3, cold(), hour_on + 3, HEADROOM).rise == pytest.approx(0.9)
    hour_on += 3
    restored = TopicHistory.from_json(json.loads(json.dumps(history.to_json())))
    later = hour_on + 7_200_000
    assert restored.annotate(3, cold(), later, HEADROOM) == history.annotate(
        3, cold(), later, HEADROOM
    )
    assert restored.annotate(3, cold(), later, HEADROOM).rise == pytest.approx(0.225)
    # Nor does a new leader guess the last score: its first record is no rise either.
    restored.observe(3, rates(9_900), later, HEADROOM)
    assert restored.annotate(3, cold(), later, HEADROOM).rise == pytest.approx(0.225)
    # `controllerd decide` reads and writes it in LOAD.json as "rise".
    annotated = history.annotate(3, cold(), later, HEADROOM)
    assert load_sample_to_json(annotated)["rise"] == annotated.rise
    assert load_sample_from_json(load_sample_to_json(annotated)) == annotated
    with pytest.raises(ModelError, match="rise"):
        load_sample_from_json({**load_sample_to_json(annotated), "rise": -1})
    # A malformed rise drops the range (history is advice), not the daemon.
    for bad in ("-1", "NaN", "x", True, -1, math.inf):
        assert TopicHistory.from_json({"5": {"rise": bad}}).to_json() == {}
    # A time that does not fit a long would fail the history's next write (orjson).
    for stamp in (1e300, 2**63, "5", True, 1.5):
        assert TopicHistory.from_json({"5": {"rise": 1, "riseMs": stamp}}).to_json() == {}
        assert (
            TopicHistory.from_json({"5": {"flipflops": 1, "lastFlipflopMs": stamp}}).to_json() == {}
        )
    # Without the setting nothing is kept.
    quiet = TopicHistory()
    quiet.observe(0, rates(0), NOW, OURS)
    quiet.observe(0, rates(8_000), NOW + 1, OURS)
    assert 0 not in quiet


# --- when decide needs asking again -------------------------------------------------------------


def test_next_decision_time_is_when_a_window_or_cooldown_runs_out() -> None:
    loads = {0: cold(changed=NOW - 100_000), 1: cold(changed=NOW - 200_000)}
    # Segment 1's window runs out first (nothing changes then: 0 is still warming up).
    assert next_decision_ms(layout_of(2), loads, PIP483, NOW) == NOW - 200_000 + 300_000
    assert isinstance(decide(layout_of(2), loads, {}, PIP483, NOW + 199_999), NoAction)
    assert isinstance(decide(layout_of(2), loads, {}, PIP483, NOW + 200_000), Merge)
    at = next_decision_ms(layout_of(1), {}, PIP483, NOW, last_split_ms=NOW - 1_000)
    assert at == NOW + 59_000
    stale = {0: cold(sampled=NOW)}
    assert next_decision_ms(layout_of(1), stale, OURS, NOW) == NOW + 900_001
    assert next_decision_ms(layout_of(1), {}, OURS, NOW) is None


@pytest.mark.parametrize("factor", [1.1, 1.3, 1.6, 1.8])
def test_a_wake_at_an_epoch_stamp_is_the_first_ms_decide_acts_not_one_before(
    factor: float,
) -> None:
    """since + window summed in floats rounds at epoch stamps (1.76e12 + 7920000.000000001
    gave ...7920000): the wake came 1 ms early, decide still waited, and the next wake
    listed was the backoff's decay a day later. The daemon and the replay sleep on it."""
    since = 1_760_000_000_000
    policy = PolicySettings(merge_backoff_factor=factor, load_ttl_seconds=0)
    flipped = LoadSample(Rates(1.0, 1.0, 1.0, 1.0), since, flipflops=1, last_flipflop_ms=since)
    loads = {0: flipped, 1: flipped}
    wake = next_decision_ms(layout_of(2), loads, policy, since + 1_000)
    assert wake is not None
    assert isinstance(decide(layout_of(2), loads, {}, policy, wake - 1), NoAction)
    assert isinstance(decide(layout_of(2), loads, {}, policy, wake), Merge)


def test_a_cooldown_of_a_fraction_of_a_ms_wakes_when_it_has_run_out() -> None:
    """16.1 s is 16100.000000000002 ms: the wake must be the ms the cooldown ends by
    decide's own test, not a ms before it."""
    since = 1_760_000_000_000
    policy = PolicySettings(split_cooldown_seconds=16.1, range_split_cooldown=False)
    hot = {0: sample(20_000, changed=since)}
    wake = next_decision_ms(layout_of(1), hot, policy, since + 1_000, last_split_ms=since)
    assert wake is not None
    assert isinstance(decide(layout_of(1), hot, {}, policy, wake - 1, since), NoAction)
    assert isinstance(decide(layout_of(1), hot, {}, policy, wake, since), Split)


def test_a_stored_peak_that_is_not_a_finite_number_drops_its_range() -> None:
    """float() took "inf", "nan" and "1e999" as peaks: decide then raised OverflowError
    sizing a split to the peak, or held a merge back on NaN."""
    for bad in ('"inf"', '"nan"', "1e999", "true", "-1"):
        raw = json.loads(f'{{"0": {{"peaks": [[[1000, {bad}]], [], [], []]}}, "1": {{}}}}')
        assert TopicHistory.from_json(raw).to_json() == TopicHistory.from_json({"1": {}}).to_json()


@pytest.mark.parametrize(
    ("override", "setting"),
    [
        ({"mergeBackoffFactor": 1e60}, "merge_backoff_factor"),
        ({"mergeBackoffDecaySeconds": 1e306}, "merge_backoff_decay_seconds"),
    ],
)
def test_a_backoff_that_would_overflow_is_refused(override: dict[str, float], setting: str) -> None:
    """Both passed validation (only finiteness was checked) and made decide raise."""
    resolved = resolve_policy(OURS, override)
    assert isinstance(resolved, PolicyInvalid) and setting in str(resolved)


def test_may_act_is_false_only_when_nothing_can_ever_be_decided() -> None:
    assert not may_act(layout_of(1), {0: warm()}, {}, OURS)
    assert not may_act(layout_of(2), {0: cold(), 1: warm()}, {}, OURS)
    assert may_act(layout_of(2), {0: cold(), 1: cold(changed=NOW)}, {}, OURS)
    assert may_act(layout_of(1), {0: sample(20_000)}, {}, OURS)
    assert may_act(layout_of(1), {}, {"s": 2}, OURS)
    assert not may_act(
        layout_of(2), {0: cold(), 1: cold()}, {}, dataclasses.replace(OURS, min_segments=2)
    )


def test_new_override_keys_resolve() -> None:
    resolved = resolve_policy(
        OURS,
        {
            "peakWindowSeconds": 600,
            "mergeBackoffFactor": 3,
            "mergeBackoffDecaySeconds": 60,
            "mergeRegretSeconds": 14_400,
            "mergeHeadroomHalfLifeSeconds": 7_200,
            "mergeUndoSeconds": 600,
            "rangeSplitCooldown": True,
            "splitToPeak": True,
            "loadAwareSplits": False,
        },
    )
    assert isinstance(resolved, PolicySettings)
    assert (resolved.peak_window_seconds, resolved.merge_backoff_factor) == (600.0, 3.0)
    assert (resolved.merge_backoff_decay_seconds, resolved.merge_regret_seconds) == (60.0, 14_400.0)
    assert resolved.merge_headroom_half_life_seconds == 7_200.0
    assert resolved.merge_undo_seconds == 600.0
    assert resolved.range_split_cooldown and resolved.split_to_peak
    assert not resolved.load_aware_splits
    assert isinstance(resolve_policy(OURS, {"rangeSplitCooldown": 1}), PolicyInvalid)
    assert isinstance(resolve_policy(OURS, {"mergeBackoffFactor": 0.5}), PolicyInvalid)
    assert isinstance(resolve_policy(OURS, {"mergeRegretSeconds": -1}), PolicyInvalid)
    assert isinstance(resolve_policy(OURS, {"mergeHeadroomHalfLifeSeconds": -1}), PolicyInvalid)
    assert isinstance(resolve_policy(OURS, {"mergeUndoSeconds": -1}), PolicyInvalid)


def test_a_refused_value_nested_a_thousand_deep_is_refused_not_raised() -> None:
    """orjson reads JSON nested up to 1,024 deep; a message that showed such a value with
    ``repr`` raised RecursionError while being built: a policy override then failed every
    evaluation of its topics with a traceback instead of being refused."""
    deep = orjson.loads(b"[" * 1000 + b"]" * 1000)
    refused = resolve_policy(OURS, {"mergeWindowSeconds": deep})
    assert isinstance(refused, PolicyInvalid) and "[[[" in refused.detail
    with pytest.raises(ModelError, match="msgRateIn"):
        load_sample_from_json({"msgRateIn": deep, "changedAtMs": 1})
