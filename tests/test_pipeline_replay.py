"""The event-driven replay gives exactly the step-by-step metrics; skewed keys and histograms."""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controllerd.core.model import HASH_SPACE
from controllerd.pipeline import simulate as simulate_module
from controllerd.pipeline.load import LoadSource, Skew, Trace, slice_bounds, source_for
from controllerd.pipeline.simulate import SimResult, Strategy, simulate
from controllerd.pipeline.traces import TraceOptions, discover
from controllerd.pipeline.variants import (
    REFERENCE_THRESHOLDS,
    controllerd,
    parse_variants,
    pip483,
    static,
)
from tests.support.shared import traces_dir

T0: Final = 1_700_000_000_000
MINUTE: Final = 60_000
THRESHOLD: Final = REFERENCE_THRESHOLDS.msg_rate_in

EVERYTHING_ON: Final = parse_variants(
    """
[variants.on]
preset = "controllerd"
policy.peak_window_seconds = 7200
policy.merge_backoff_factor = 3.0
policy.merge_backoff_decay_seconds = 3600
policy.merge_regret_seconds = 7200
policy.merge_headroom_half_life_seconds = 3600
policy.merge_undo_seconds = 7200
policy.range_split_cooldown = true
policy.split_to_peak = true
policy.merge_window_seconds = 1200
simulator.hash_buckets = 16
"""
)[0].strategy

HEADROOM: Final = parse_variants(
    """
[variants.headroom]
preset = "controllerd"
policy.merge_headroom_half_life_seconds = 7200
"""
)[0].strategy
"""The defaults with the rise headroom alone: merges it holds back until a rise decays
are woken by ``next_decision_ms``, not by a record or a peak leaving its window."""


def both(
    trace: Trace, strategy: Strategy, skew: Skew, seed: int = 3, source: LoadSource | None = None
) -> tuple[SimResult, SimResult]:
    """The event-driven replay (on ``source`` if given, which earlier replays may have
    read) and the step-by-step one on a fresh source."""
    fast = simulate(
        source if source is not None else source_for(trace, skew, seed),
        strategy,
        REFERENCE_THRESHOLDS,
        check_layout=True,
    )
    slow = simulate(
        source_for(trace, skew, seed), strategy, REFERENCE_THRESHOLDS, step_by_step=True
    )
    return fast, slow


def assert_identical(fast: SimResult, slow: SimResult) -> None:
    assert fast.metrics == slow.metrics  # bit-identical, not approximately equal
    assert fast.operations == slow.operations
    assert fast.timeline == slow.timeline and fast.zoom == slow.zoom
    assert fast.final_layout == slow.final_layout


def shared(path: str, max_hours: float | None = None) -> Trace:
    (trace,) = discover([traces_dir() / path], TraceOptions(max_hours=max_hours))
    return trace


TRACES: Final = [
    ("aws/ec2_disk_write_bytes_1ef3de.csv", None),
    ("aws/ec2_disk_write_bytes_c0d644.csv", None),
    ("aws/occupancy_6005.csv", None),
    ("aws/ec2_cpu_utilization_825cc2.csv", 24 * 7),
    ("nab/Twitter_volume_IBM.csv", 24 * 10),
    ("nab/nyc_taxi.csv", 24 * 21),
]


@pytest.mark.parametrize(("path", "hours"), TRACES)
def test_event_driven_replay_equals_step_by_step_on_the_shared_traces(
    path: str, hours: float | None
) -> None:
    trace = shared(path, hours)
    visited = []
    uniform = source_for(trace, Skew(), 3)  # the first two replay on one source, as engines do
    for strategy, skew, source in (
        (pip483(), Skew(), uniform),
        (controllerd(), Skew(), uniform),
        (EVERYTHING_ON, Skew.parse("hotspot:0.4:12:2048"), None),
        (HEADROOM, Skew(), None),
    ):
        fast, slow = both(trace, strategy, skew, source=source)
        assert_identical(fast, slow)
        assert fast.metrics.operations > 0  # the trace exercises the policy
        visited.append(fast.visited_steps / slow.visited_steps)
    assert max(visited) < 0.5  # and the replay skipped most steps


def test_the_short_path_makes_most_visits_and_changes_no_metric(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Most visits of a bursty trace need no decide: the short path makes them, also while
    cold segments wait for their merge window (a replay without it would still pass the
    tests above, only slower)."""
    made: list[tuple[int | None, int]] = []  # (until given, visits made)
    run = simulate_module._Idle.run

    def counting(self: Any, *args: Any) -> tuple[int, int, int, int, int | None]:
        result = run(self, *args)
        made.append((args[-1], result[3]))
        return result

    monkeypatch.setattr(simulate_module._Idle, "run", counting)
    trace = shared("nab/Twitter_volume_IBM.csv", 24 * 10)
    for strategy in (static(4), static(8), pip483(), controllerd()):
        made.clear()
        fast, slow = both(trace, strategy, Skew())
        assert_identical(fast, slow)
        assert sum(n for _, n in made) > 0.75 * fast.visited_steps
        if strategy.policy.enabled:  # some of them while a pair waited to ripen
            assert sum(n for until, n in made if until is not None) > 0


def wiggle(minutes: int, every: int) -> Trace:
    """A load that moves a few percent a row (the reporters' gate stays quiet), a row every
    ``every`` minutes, with a jump now and then (a record is written)."""
    times, values = [], []
    for i in range(0, minutes, every):
        level = (2.5 if (i // 180) % 2 else 1.2) * (1.0 + 0.03 * ((i // every) % 3))
        times.append(T0 + i * MINUTE)
        values.append(level * THRESHOLD)
    n = len(times)
    return Trace(
        "wiggle", "series", times, [0] * n, [0xFFFF] * n, [(v, v * 100, v, v * 100) for v in values]
    )


@pytest.mark.parametrize("heartbeat", [0.0, 300.0, 900.0])
@pytest.mark.parametrize("segments", [1, 3, 4])
def test_equal_segments_count_the_heartbeats_of_quiet_stretches(
    segments: int, heartbeat: float
) -> None:
    """Equal static segments walked as one (the compiled short path; 3 of 65,536 hashes
    are not equal, 4 are): quiet visits catch up on the heartbeats due since the last
    record, N records each, also when the next is not due at the visit itself."""
    base = static(segments)
    strategy = dataclasses.replace(
        base, report=dataclasses.replace(base.report, report_max_interval_seconds=heartbeat)
    )
    fast, slow = both(wiggle(24 * 60, 20), strategy, Skew())
    assert_identical(fast, slow)
    assert fast.visited_steps < slow.visited_steps / 10
    if heartbeat:  # rows 20 minutes apart: more records than rows that change much
        assert fast.metrics.load_writes > segments * 24 * 60 // 20


levels = st.lists(
    st.tuples(st.one_of(st.floats(0, 0.15), st.floats(0, 6)), st.integers(1, 40)),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    levels=levels,
    preset=st.sampled_from(["pip483", "controllerd", "on", "headroom", "buckets", "static-4"]),
    skew=st.sampled_from(["uniform", "zipf:1.2:50", "hotkey:0.5", "hotspot:0.6:1:512"]),
    changes=st.fixed_dictionaries(
        {
            "merge_window_seconds": st.sampled_from([0.0, 60.0, 300.0]),
            "merge_cooldown_seconds": st.sampled_from([0.0, 60.0, 300.0]),
            "split_cooldown_seconds": st.sampled_from([0.0, 30.0, 60.0, 150.0]),
            "load_ttl_seconds": st.sampled_from([0.0, 120.0, 900.0]),
            "min_segments": st.sampled_from([1, 2]),
        }
    ),
    heartbeat=st.sampled_from([0.0, 60.0, 300.0, 1000.0]),
    retention=st.sampled_from([-1.0, 0.0, 600.0]),
)
def test_event_driven_replay_equals_step_by_step_on_random_load(
    levels: list[tuple[float, int]],
    preset: str,
    skew: str,
    changes: dict[str, Any],
    heartbeat: float,
    retention: float,
) -> None:
    base = {
        "pip483": pip483(),
        "controllerd": controllerd(),
        "on": EVERYTHING_ON,
        "headroom": dataclasses.replace(
            HEADROOM,
            policy=dataclasses.replace(HEADROOM.policy, merge_headroom_half_life_seconds=600),
        ),
        "buckets": dataclasses.replace(controllerd(), hash_buckets=16),
        "static-4": static(4),
    }[preset]
    strategy = dataclasses.replace(
        base,
        policy=dataclasses.replace(base.policy, **changes),
        report=dataclasses.replace(base.report, report_max_interval_seconds=heartbeat),
        gc_retention_seconds=retention,
    )
    times, values, t = [], [], T0
    for level, minutes in levels:
        times.append(t)
        values.append(level * THRESHOLD)
        t += minutes * MINUTE
    times.append(t)
    values.append(values[-1])
    n = len(times)
    trace = Trace(
        "r", "series", times, [0] * n, [0xFFFF] * n, [(v, v * 100, v, v * 100) for v in values]
    )
    assert_identical(*both(trace, strategy, Skew.parse(skew)))


# --- skewed keys and the reporters' histograms -----------------------------------------------


def flat(level: float, minutes: int) -> Trace:
    n = minutes
    return Trace(
        "flat",
        "series",
        [T0 + i * MINUTE for i in range(n)],
        [0] * n,
        [0xFFFF] * n,
        [(level * THRESHOLD, level * THRESHOLD, level * THRESHOLD, level * THRESHOLD)] * n,
    )


def test_reporters_publish_the_histogram_of_their_range() -> None:
    source = source_for(flat(1.0, 1), Skew.parse("hotkey:0.5"), 4)
    snap = source.snapshot(0)
    buckets = snap.buckets(0, 0xFFFF, 32)
    assert len(buckets) == 32 and sum(buckets) == pytest.approx(THRESHOLD)
    assert max(buckets) == pytest.approx(0.5 * THRESHOLD + 0.5 * THRESHOLD / 32)
    assert slice_bounds(0, 15, 32)[0] == (0, -1)  # narrower than n: empty slices


def test_hot_spot_moves_and_load_aware_splits_isolate_it() -> None:
    """A 1024-wide spot with 60% of 3x the threshold: equal-width children leave one child
    hot and need more splits; the histogram puts the spot in a child of its own."""
    trace = flat(3.0, 24 * 60)
    skew = Skew.parse("hotspot:0.6:6:1024")
    source = source_for(trace, skew, 1)
    assert len(source.change_times()) == 4  # the spot moved three times in 24 h
    equal = controllerd()
    aware = dataclasses.replace(equal, hash_buckets=32)
    r_equal = simulate(source_for(trace, skew, 1), equal, REFERENCE_THRESHOLDS)
    r_aware = simulate(source_for(trace, skew, 1), aware, REFERENCE_THRESHOLDS)
    assert r_aware.metrics.excess_load < r_equal.metrics.excess_load
    first = r_aware.operations[0]
    assert first.action == "split"


def test_a_hot_key_alone_above_the_threshold_is_left_alone_once_isolated() -> None:
    """One key carries 1.5x the threshold: no split can relieve it. With the histogram the
    policy isolates it and then says hot-key; equal-width keeps splitting towards it."""
    trace = flat(1.6, 6 * 60)
    skew = Skew.parse("hotkey:0.94")
    aware = dataclasses.replace(controllerd(), hash_buckets=32)
    r_aware = simulate(source_for(trace, skew, 2), aware, REFERENCE_THRESHOLDS)
    r_equal = simulate(source_for(trace, skew, 2), controllerd(), REFERENCE_THRESHOLDS)
    assert r_aware.metrics.splits < r_equal.metrics.splits
    assert r_aware.metrics.peak_segments < r_equal.metrics.peak_segments
    # Neither relieves the key: the excess is the key's own.
    assert r_aware.metrics.excess_load == pytest.approx(r_equal.metrics.excess_load, rel=0.05)
    widths = sorted(s.hash_range.width for s in r_aware.final_layout.active_segments())
    assert widths[0] < HASH_SPACE // 8
