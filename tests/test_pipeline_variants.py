"""Policy variants from TOML: presets, overrides, grids, and errors naming the key."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from controllerd.config import LoadReportSettings
from controllerd.core.model import PolicySettings
from controllerd.pipeline.variants import (
    PULSAR_POLICY,
    VariantError,
    load_variants,
    parse_variants,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "variants.toml"

CONTRACT = """
[variants.pip483]
preset = "pip483"
[variants.controllerd]
preset = "controllerd"
[variants.static-8]
static_segments = 8
[variants.short-window]
preset = "controllerd"
policy.merge_window_seconds = 120
"""


def test_the_issue_example_parses_in_file_order() -> None:
    variants = {v.name: v.strategy for v in parse_variants(CONTRACT)}
    assert list(variants) == ["pip483", "controllerd", "static-8", "short-window"]
    pip, ours, static, short = variants.values()
    assert pip.policy == PULSAR_POLICY
    assert pip.report == LoadReportSettings(0.25, 0.0, threshold_crossing=False)
    assert not pip.track_cold_since
    assert ours.policy == PolicySettings() and ours.report == LoadReportSettings()
    assert ours.track_cold_since
    assert not static.policy.enabled and static.initial_segments == 8
    assert short.policy.merge_window_seconds == 120
    assert short.policy.split_thresholds == PolicySettings().split_thresholds


def test_pip483_is_pulsar_exactly() -> None:
    p = PULSAR_POLICY
    assert (p.max_split_fanout, p.min_split_width, p.load_ttl_seconds) == (2, 1, 0)
    assert math.isinf(p.merge_combined_max_ratio)
    assert p.split_cooldown_seconds == 60 and p.merge_window_seconds == 300


def test_a_grid_expands_to_one_variant_per_combination() -> None:
    variants = parse_variants(
        """
        [variants.g]
        preset = "pip483"
        load_report.threshold_crossing = true
        grid."policy.merge_window_seconds" = [60, 600]
        grid."policy.max_split_fanout" = [2, 8]
        """
    )
    assert [v.name for v in variants] == [
        "g[merge_window_seconds=60,max_split_fanout=2]",
        "g[merge_window_seconds=60,max_split_fanout=8]",
        "g[merge_window_seconds=600,max_split_fanout=2]",
        "g[merge_window_seconds=600,max_split_fanout=8]",
    ]
    last = variants[-1].strategy
    assert last.policy.merge_window_seconds == 600 and last.policy.max_split_fanout == 8
    assert last.report.threshold_crossing and last.policy.min_split_width == 1


def test_nested_thresholds_and_every_table_can_be_varied() -> None:
    (v,) = parse_variants(
        """
        [variants.x]
        preset = "controllerd"
        policy.merge_thresholds.msg_rate_in = 2500
        load_report.rate_change_threshold = 0.1
        autoscale.interval_seconds = 30
        gc.default_retention_seconds = -1
        simulator.track_cold_since = false
        simulator.initial_segments = 4
        """
    )
    s = v.strategy
    assert s.policy.merge_thresholds.msg_rate_in == 2500.0
    assert s.policy.merge_thresholds.byte_rate_in == PolicySettings().merge_thresholds.byte_rate_in
    assert s.report.rate_change_threshold == 0.1
    assert (s.interval_seconds, s.gc_retention_seconds) == (30.0, -1.0)
    assert (s.track_cold_since, s.initial_segments) == (False, 4)


def test_static_preset_name_works_too() -> None:
    (v,) = parse_variants('[variants.s]\npreset = "static-3"\n')
    assert v.strategy.initial_segments == 3 and not v.strategy.policy.enabled


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[variants.a]\npreset = "kafka"\n', "variants.a.preset: expected pip483"),
        ("[variants.a]\npolicy.max_segmnts = 3\n", "variants.a.policy.max_segmnts: unknown"),
        ('[variants.a]\npolicy.min_segments = "2"\n', "expected an integer"),
        ("[variants.a]\npolicy.min_segments = 0\n", "policy.min_segments: must be >= 1"),
        ("[variants.a]\nstatic_segments = 0\n", "static_segments: expected an integer"),
        ('[variants.a]\npreset = "pip483"\nstatic_segments = 2\n', "not both"),
        ("[variants.a]\ngrid.x = 3\n", "variants.a.grid: expected a table"),
        ("[variants.a]\ncolour = 1\n", "variants.a.colour: unknown key"),
        ("[other]\n", "variants: expected at least one"),
        ("[variants.a\n", "invalid TOML"),
        ('[variants.""]\n', "a name must be printable and not blank"),
        ('[variants."a\\nb"]\n', "a name must be printable and not blank"),
        ("[variants.a]\ndescription = 5\n", "variants.a.description: expected a string"),
        ("[variants.a]\npolicy.merge_window_seconds = 1e308\n", "merge_window_seconds: must be"),
        ("[variants.a]\ngc.default_retention_seconds = nan\n", "default_retention_seconds"),
    ],
)
def test_errors_name_the_key(text: str, message: str) -> None:
    with pytest.raises(VariantError) as info:
        parse_variants(text)
    assert any(message in err for err in info.value.errors), info.value.errors


def test_the_example_file_loads() -> None:
    names = [v.name for v in load_variants(EXAMPLES)]
    assert {"pip483", "controllerd", "short-window", "static-8"} <= set(names)
