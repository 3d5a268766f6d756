"""The reporter's write rule: Pulsar's materiality gate plus threshold crossings."""

from __future__ import annotations

import pytest

from controllerd.core.loadreport import ReportRule, WriteReason, should_write
from controllerd.core.model import PolicySettings, Rates

POLICY = PolicySettings()
RULE = ReportRule(POLICY.split_thresholds, POLICY.merge_thresholds)
PULSAR = ReportRule(
    POLICY.split_thresholds,
    POLICY.merge_thresholds,
    max_interval_seconds=0,
    threshold_crossing=False,
)


def r(
    msg_in: float, byte_in: float = 100.0, msg_out: float = 100.0, byte_out: float = 100.0
) -> Rates:
    return Rates(msg_in, byte_in, msg_out, byte_out)


def test_first_write_always() -> None:
    assert should_write(RULE, None, r(0, 0, 0, 0), 0) is WriteReason.FIRST


def test_identical_value_is_not_rewritten() -> None:
    assert should_write(RULE, r(5_000), r(5_000), 0, last_written_at_ms=0) is None


def test_material_change_over_25_percent_either_way() -> None:
    assert should_write(PULSAR, r(5_000), r(6_250), 0) is None  # exactly 25%
    assert should_write(PULSAR, r(5_000), r(6_251), 0) is WriteReason.MATERIAL_CHANGE
    assert should_write(PULSAR, r(5_000), r(3_749), 0) is WriteReason.MATERIAL_CHANGE
    assert should_write(PULSAR, r(5_000), r(5_000, byte_out=126), 0) is (
        WriteReason.MATERIAL_CHANGE
    )


@pytest.mark.parametrize(("old", "new"), [(0.0, 0.001), (0.001, 0.0)])
def test_crossing_to_or_from_zero(old: float, new: float) -> None:
    assert should_write(PULSAR, r(old), r(new), 0) is WriteReason.ZERO_CROSSING


def test_the_25_percent_blind_spot_and_its_fix() -> None:
    # Written at 9,000 msg/s; now 11,000 (22% more): over the split threshold of 10,000.
    assert should_write(PULSAR, r(9_000), r(11_000), 0) is None
    assert should_write(RULE, r(9_000), r(11_000), 0) is WriteReason.THRESHOLD_CROSSING
    # ... and back below it.
    assert should_write(RULE, r(11_000), r(9_500), 0) is WriteReason.THRESHOLD_CROSSING


def test_merge_threshold_crossing_both_ways() -> None:
    assert should_write(RULE, r(1_100), r(950), 0) is WriteReason.THRESHOLD_CROSSING
    assert should_write(RULE, r(950), r(1_000), 0) is WriteReason.THRESHOLD_CROSSING
    assert should_write(PULSAR, r(950), r(1_000), 0) is None


def test_small_moves_inside_a_band_stay_quiet() -> None:
    assert should_write(RULE, r(5_000), r(5_500), 1_000, last_written_at_ms=0) is None


def test_heartbeat_republishes_after_max_interval() -> None:
    assert should_write(RULE, r(5_000), r(5_000), 299_999, last_written_at_ms=0) is None
    assert should_write(RULE, r(5_000), r(5_000), 300_000, last_written_at_ms=0) is (
        WriteReason.HEARTBEAT
    )
    assert should_write(PULSAR, r(5_000), r(5_000), 10**9, last_written_at_ms=0) is None
