"""The backtest simulator: layout invariants, convergence, and the PIP-483 gaps it measures."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controllerd.config import LoadReportSettings
from controllerd.core.model import PolicySettings
from controllerd.pipeline.load import HistoryLoad, SeriesLoad, Skew, Trace, source_for
from controllerd.pipeline.simulate import NO_TIMELINE, SimResult, Strategy, simulate
from controllerd.pipeline.variants import REFERENCE_THRESHOLDS, controllerd, pip483, static

T0: Final = 1_700_000_000_000
MINUTE: Final = 60_000
THRESHOLD: Final = REFERENCE_THRESHOLDS.msg_rate_in


def series(name: str, levels: Sequence[float], step_ms: int = MINUTE) -> Trace:
    """A topic whose msgRateIn is ``level * threshold`` for each step (other rates tiny)."""
    n = len(levels)
    return Trace(
        name,
        "series",
        [T0 + i * step_ms for i in range(n)],
        [0] * n,
        [0xFFFF] * n,
        [(x * THRESHOLD, x * THRESHOLD * 100, x * THRESHOLD, x * THRESHOLD * 100) for x in levels],
    )


def run(trace: Trace, strategy: Strategy, skew: Skew | None = None) -> SimResult:
    return simulate(
        source_for(trace, skew or Skew(), 7), strategy, REFERENCE_THRESHOLDS, check_layout=True
    )


def with_policy(strategy: Strategy, **changes: Any) -> Strategy:
    return dataclasses.replace(strategy, policy=dataclasses.replace(strategy.policy, **changes))


levels = st.lists(
    st.one_of(st.floats(0, 0.2), st.floats(0, 9)),
    min_size=2,
    max_size=30,
).map(lambda xs: [x for x in xs for _ in range(5)])  # hold each level five minutes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    loads=levels,
    preset=st.sampled_from(["pip483", "controllerd"]),
    skew=st.sampled_from(["uniform", "zipf:1.2:50"]),
)
def test_layout_is_valid_at_every_step(loads: list[float], preset: str, skew: str) -> None:
    """``check_layout`` raises on the first invalid layout; the counts add up."""
    strategy = pip483() if preset == "pip483" else controllerd()
    strategy = with_policy(strategy, merge_window_seconds=120, merge_cooldown_seconds=60)
    result = run(series("h", loads), strategy, Skew.parse(skew))
    m = result.metrics
    assert m.operations == m.splits + m.merges == len(result.operations)
    assert m.flipflops == sum(op.flipflop for op in result.operations)
    assert 1 <= m.peak_segments <= strategy.policy.max_segments
    assert m.seconds_above_threshold >= m.topic_seconds_above_threshold >= 0
    assert m.excess_load >= m.late_excess_load >= 0
    assert m.segment_hours >= m.hours > 0
    assert abs(m.segment_hours - m.mean_segments * m.hours) < 1e-6 * m.segment_hours


def test_flat_load_below_merge_thresholds_merges_down_to_min_segments() -> None:
    quiet = series("quiet", [0.01] * 240)
    for strategy in (pip483(), controllerd()):
        for floor in (1, 3):
            start = dataclasses.replace(
                with_policy(strategy, min_segments=floor), initial_segments=8
            )
            result = run(quiet, start)
            assert len(result.final_layout.active_segments()) == floor
            assert result.metrics.splits == 0
            assert result.metrics.merges == 8 - floor


def test_a_step_to_k_times_threshold_splits_to_at_least_k_segments() -> None:
    for k in (2, 3, 5, 8):
        step = series("step", [0.05] * 10 + [k * 0.98] * 60)
        for strategy in (pip483(), controllerd()):
            result = run(step, strategy)
            active = result.final_layout.active_segments()
            assert len(active) >= k, (k, strategy.policy.max_split_fanout)
            assert result.timeline.hottest[-1] <= 1.0


def test_k_way_splits_react_in_one_step_where_binary_splits_take_rounds() -> None:
    step = series("step", [0.05] * 5 + [3.9] * 30)
    ours, theirs = run(step, controllerd()).metrics, run(step, pip483()).metrics
    assert ours.splits == 1 and theirs.splits == 3  # 1 -> 4 at once; 1 -> 2 -> 3 -> 4
    assert ours.late_excess_load == 0 < theirs.late_excess_load


def test_threshold_crossing_closes_the_25_percent_blind_spot() -> None:
    """DESIGN §8.2: a ramp from 0.9x to 1.1x never moves the record 25%: Pulsar stays blind."""
    ramp = series("ramp", [0.9] * 5 + [1.1] * 60)
    blind = run(ramp, pip483()).metrics
    assert blind.splits == 0 and blind.seconds_above_threshold == 60 * 60
    seen = run(ramp, controllerd()).metrics
    assert seen.splits == 1 and seen.seconds_above_threshold == 60


def test_cold_since_lets_noisy_low_traffic_merge() -> None:
    """DESIGN §8.1: 10 <-> 50 msg/s rewrites the record every minute; only cold-since merges."""
    noisy = series("noisy", [0.001, 0.005] * 60)
    for strategy, merges in ((pip483(), 0), (controllerd(), 1)):
        start = dataclasses.replace(
            with_policy(strategy, merge_window_seconds=300), initial_segments=2
        )
        assert run(noisy, start).metrics.merges == merges


def test_a_merge_undone_by_a_split_within_30_minutes_is_a_flipflop() -> None:
    bursty = series("bursty", [1.5] * 3 + [0.01] * 12 + [1.5] * 3 + [0.01] * 60 + [1.5] * 3)
    result = run(bursty, pip483())
    kinds = [(op.action, op.flipflop) for op in result.operations]
    # split, merge 5 min later (undoes it), split 5 min after that (undoes the merge),
    # merge again; the last split comes over 30 minutes after that merge.
    assert kinds == [
        ("split", False),
        ("merge", True),
        ("split", True),
        ("merge", True),
        ("split", False),
    ]
    assert result.metrics.flipflops == 3


def test_static_provisioning_never_changes_and_costs_n_segments_all_the_time() -> None:
    result = run(series("s", [0.1, 3.0, 0.1] * 20), static(4))
    m = result.metrics
    assert (m.operations, m.peak_segments) == (0, 4)
    assert m.segment_hours == 4 * m.hours


def test_metrics_use_the_reference_thresholds_not_the_variants() -> None:
    """A variant with doubled thresholds is still charged for load above the reference."""
    lax = with_policy(
        controllerd(),
        split_thresholds=dataclasses.replace(
            PolicySettings().split_thresholds, msg_rate_in=2 * THRESHOLD
        ),
    )
    result = run(series("x", [1.5] * 10), lax)
    assert result.metrics.splits == 0
    assert result.metrics.seconds_above_threshold == 600


def test_heartbeat_keeps_records_fresh_and_the_topic_mergeable() -> None:
    steady = series("steady", [0.01] * 200)
    strategy = dataclasses.replace(
        with_policy(controllerd(), load_ttl_seconds=600, merge_window_seconds=1800),
        initial_segments=2,
    )
    assert run(steady, strategy).metrics.merges == 1
    no_heartbeat = dataclasses.replace(
        strategy, report=LoadReportSettings(report_max_interval_seconds=0)
    )
    assert run(steady, no_heartbeat).metrics.merges == 0  # stale after 10 min: never merges


def test_the_replay_is_deterministic() -> None:
    trace = series("d", [0.2, 2.5, 0.4, 6.0, 0.02] * 12)
    skew = Skew.parse("zipf:1.1:200")
    a, b = run(trace, controllerd(), skew), run(trace, controllerd(), skew)
    assert a.metrics == b.metrics and a.operations == b.operations


def test_a_replay_without_timelines_measures_the_same() -> None:
    """``timeline_points=0`` (a group nobody plots) drops the timelines and nothing else."""
    trace = series("t", [0.2, 2.5, 0.4, 6.0, 0.02] * 12)
    source = source_for(trace, Skew.parse("zipf:1.1:200"), 7)
    full = simulate(source, controllerd(), REFERENCE_THRESHOLDS)
    bare = simulate(source, controllerd(), REFERENCE_THRESHOLDS, timeline_points=0)
    assert len(full.timeline.t_ms) > 0 and len(full.zoom.t_ms) > 0
    assert bare.timeline == bare.zoom == NO_TIMELINE
    assert (bare.metrics, bare.operations, bare.final_layout, bare.visited_steps) == (
        full.metrics,
        full.operations,
        full.final_layout,
        full.visited_steps,
    )


def test_history_rows_overwrite_the_ranges_they_cover() -> None:
    """A child's record replaces its part of the parent's; the rest keeps the parent's density."""
    trace = Trace(
        "t/n/x",
        "history",
        [T0, T0 + MINUTE],
        [0, 0],
        [0xFFFF, 0x7FFF],
        [(1000.0, 0.0, 0.0, 0.0), (100.0, 0.0, 0.0, 0.0)],
    )
    snaps = list(HistoryLoad(trace).snapshots(MINUTE))
    assert [t for t, _ in snaps] == [T0, T0 + MINUTE]
    first, second = snaps[0][1], snaps[1][1]
    assert first.rates(0, 0x7FFF).msg_rate_in == 500.0
    assert second.rates(0, 0x7FFF).msg_rate_in == 100.0
    assert second.rates(0x8000, 0xFFFF).msg_rate_in == 500.0
    assert second.rates(0x4000, 0xBFFF).msg_rate_in == 300.0
    assert second.total().msg_rate_in == 600.0


def test_zipf_concentrates_load_on_keys_and_is_reproducible() -> None:
    skew = Skew.parse("zipf:1.5:100")
    a = source_for(series("z", [1.0]), skew, seed=1)
    b = source_for(series("z", [1.0]), skew, seed=1)
    c = source_for(series("z", [1.0]), skew, seed=2)
    (_, sa), (_, sb), (_, sc) = (next(iter(s.snapshots(MINUTE))) for s in (a, b, c))
    halves = [sa.rates(0, 0x7FFF).msg_rate_in, sa.rates(0x8000, 0xFFFF).msg_rate_in]
    assert abs(sum(halves) - THRESHOLD) < 1e-6
    assert halves == [sb.rates(0, 0x7FFF).msg_rate_in, sb.rates(0x8000, 0xFFFF).msg_rate_in]
    assert halves[0] != sc.rates(0, 0x7FFF).msg_rate_in
    slices = [sa.rates(h, h + 0xFF).msg_rate_in for h in range(0, 0x10000, 0x100)]
    assert max(slices) > 0.3 * THRESHOLD  # uniform would give each 1/256 of the load


@pytest.mark.parametrize("skew", ["uniform", "zipf:1.2:50", "hotkey:0.4", "hotspot:0.6:1"])
def test_a_snapshots_plain_load_equals_its_rates(skew: str) -> None:
    """The replay reads ``loads`` (tuples); records and tests read ``rates``: the same numbers."""
    history = Trace(
        "t/n/h",
        "history",
        [T0, T0 + MINUTE, T0 + 2 * MINUTE],
        [0, 0, 0x9000],
        [0xFFFF, 0x7FFF, 0xA000],
        [(1000.0, 7.0, 3.0, 1.0), (100.0, 1.0, 2.0, 3.0), (33.3, 0.1, 0.2, 0.3)],
    )
    sources = [source_for(series("z", [1.0, 2.5, 0.7]), Skew.parse(skew), seed=3)]
    sources.append(HistoryLoad(history))
    ranges = [(0, 0xFFFF), (0, 0x7FFF), (0x8000, 0xFFFF), (0x4000, 0xBFFF), (0x9000, 0x9000)]
    for source in sources:
        for index in range(len(source.change_times())):
            snap = source.snapshot(index)
            assert snap.total_load() == snap.total().as_tuple()
            expected = [snap.rates(start, end).as_tuple() for start, end in ranges]
            assert snap.loads(tuple(ranges)) == expected
            assert snap.loads(tuple(ranges[1:])) == expected[1:]  # another layout


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 400_000), min_size=1, max_size=30),
    st.sampled_from([1_000, MINUTE, 90_000]),
    st.sampled_from(["uniform", "hotspot:0.5:0.05"]),
)
def test_next_visits_are_the_steps_at_which_the_load_changed(
    gaps: list[int], step_ms: int, skew: str
) -> None:
    """``next_visits`` against walking every step: after a visit at which change ``c``
    holds, the next step whose change differs is ``after[c]``, and there ``then[c]``."""
    t_ms = [T0]
    for gap in gaps:
        t_ms.append(t_ms[-1] + gap)
    n = len(t_ms)
    trace = Trace(
        "t",
        "series",
        t_ms,
        [0] * n,
        [0xFFFF] * n,
        [(float(i % 3), 1.0, 1.0, 1.0) for i in range(n)],
    )
    source = source_for(trace, Skew.parse(skew), seed=1)
    assert isinstance(source, SeriesLoad)
    times = list(source.change_times())
    after, then = source.next_visits(step_ms)
    assert source.next_visits(step_ms)[0] is after  # kept
    end = source.last_ms + step_ms
    steps = list(range(source.start_ms, end, step_ms))
    change_at = [max(i for i, x in enumerate(times) if x <= t) for t in steps]
    for c in set(change_at):
        first = change_at.index(c)
        later = [k for k in range(first, len(steps)) if change_at[k] != c]
        if later:
            assert (after[c], then[c]) == (steps[later[0]], change_at[later[0]])
        else:  # no change after c: the replay runs to its end
            assert after[c] >= end and after[c] - end < step_ms
