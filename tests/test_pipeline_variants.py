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


@pytest.mark.parametrize(
    "text",
    [
        "[variants.a]\npolicy.max_segments = " + "9" * 5000 + "\n",  # past int('...')'s limit
        "[variants.a]\ndescription = " + "[" * 5000 + "]" * 5000 + "\n",  # RecursionError
    ],
    ids=["huge-integer", "deep-nesting"],
)
def test_toml_the_parser_cannot_take_is_invalid_toml_not_an_internal_error(text: str) -> None:
    """Only TOMLDecodeError was caught: both ended as an internal error (exit 70)."""
    with pytest.raises(VariantError) as info:
        parse_variants(text)
    (error,) = info.value.errors
    assert error.startswith("invalid TOML: ") and len(error) < 320


@pytest.mark.parametrize(
    ("toml", "setting"),
    [
        ("policy.merge_window_seconds = 1" + "0" * 400, "policy.merge_window_seconds"),
        ("policy.split_thresholds.msg_rate_in = 1" + "0" * 400, "split_thresholds.msg_rate_in"),
        (f"policy.max_segments = {10**30}", "policy.max_segments"),
        (f"simulator.initial_segments = {-(2**63) - 1}", "simulator.initial_segments"),
        (f'grid."policy.max_segments" = [{2**63}]', "policy.max_segments"),
    ],
)
def test_a_number_out_of_the_daemon_config_s_range_is_refused_naming_it(
    toml: str, setting: str
) -> None:
    """A float setting's huge integer raised OverflowError (exit 70); an integer past
    int64 ran although the daemon's config refuses it."""
    with pytest.raises(VariantError) as info:
        parse_variants(f"[variants.a]\n{toml}\n")
    (error,) = info.value.errors
    assert error.startswith("variants.a") and f"{setting}: an integer of " in error, error
    assert error.endswith("bits is out of range")


def test_the_largest_numbers_the_daemon_config_takes_are_taken() -> None:
    (v,) = parse_variants(
        "[variants.a]\npolicy.max_segments = 9223372036854775807\n"
        f"policy.split_thresholds.msg_rate_in = {2**1000 - 1}\n"
    )
    assert v.strategy.policy.max_segments == 2**63 - 1
    assert v.strategy.policy.split_thresholds.msg_rate_in == float(2**1000 - 1)


def test_a_file_s_errors_name_it_once_and_a_bom_is_no_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(VariantError) as info:
        load_variants(missing)
    assert info.value.errors == [f"{missing}: cannot read: No such file or directory"]
    bad = tmp_path / "bad.toml"
    bad.write_text("[variants.a]\npolicy.min_segments = 0\n", encoding="utf-8")
    with pytest.raises(VariantError) as info:
        load_variants(bad)
    assert all(err.startswith(f"{bad}: variants.a.") for err in info.value.errors)
    marked = tmp_path / "bom.toml"
    marked.write_text('\ufeff[variants.a]\npreset = "pip483"\n', encoding="utf-8")
    assert [v.name for v in load_variants(marked)] == ["a"]


def test_a_device_that_never_ends_is_refused_not_read_for_ever() -> None:
    with pytest.raises(VariantError) as info:
        load_variants("/dev/zero")
    assert info.value.errors == ["/dev/zero: larger than 16 MiB; not a variants file"]
