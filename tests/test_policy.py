"""PIP-483 evaluator rules, one by one, then each controllerd extension."""

from __future__ import annotations

import dataclasses
import math

import pytest

from controllerd.core.layout import initial_layout, merge, split
from controllerd.core.model import (
    Layout,
    LoadSample,
    Merge,
    NoAction,
    PolicySettings,
    Rates,
    Split,
)
from controllerd.core.policy import (
    PolicyInvalid,
    decide,
    inherited_cold_since,
    is_cold,
    resolve_policy,
)

NOW = 10_000_000
WINDOW_MS = 300_000  # PIP483's merge window
LONG_AGO = NOW - 3 * 7_200_000  # past every merge window used here

# Pulsar behaviour: every extension off.
PIP483 = PolicySettings(
    merge_window_seconds=300,
    max_split_fanout=2,
    min_split_width=1,
    merge_combined_max_ratio=math.inf,
    load_ttl_seconds=0,
)
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
