"""Load-aware split boundaries (issue #14): plan_split against an exhaustive search.

The planner promises, for boundaries on slice edges, children at least
``min_split_width`` wide and at most ``max_children`` of them: the fewest children
that bring every child under the threshold when some count can, else a hottest
child as cool as any allowed split leaves; and a ``hot-key`` refusal only when no
allowed split takes :data:`HOT_KEY_MIN_RELIEF` of the overload off its hottest
child. The oracle below tries every set of cuts, so the inputs stay small.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from controllerd.core.layout import equal_boundaries, initial_layout, split
from controllerd.core.model import HASH_MAX, HashRange, LoadSample, PolicySettings, Rates, Split
from controllerd.core.policy import HOT_KEY_MIN_RELIEF, TopicHistory, decide, plan_split
from controllerd.pipeline.load import HistoryLoad, Trace

NOW = 10_000_000
LONG_AGO = NOW - 3 * 7_200_000
POLICY = dataclasses.replace(PolicySettings(), max_segments=128)
THRESHOLD = POLICY.split_thresholds.msg_rate_in
TOL = 1e-9


def _at(x: float) -> LoadSample:
    """A sample at ``x`` times the msgRateIn split threshold, other rates negligible."""
    return LoadSample(Rates(x * THRESHOLD, 1.0, 1.0, 1.0), LONG_AGO)


def _oracle(
    rng: HashRange, buckets: Sequence[float], score: float, cap: int, min_width: int
) -> dict[int, float]:
    """The least hottest-child load for each allowed count of children (2..cap) over every
    set of cuts on slice edges with children at least ``min_width`` wide (the wire
    format: slice i starts at ``start + (i*W)//n``; an empty slice's load sits at
    the hash the next one starts at)."""
    n, width, total = len(buckets), rng.width, sum(buckets)
    at = [rng.start + (i * width) // n for i in range(n)]
    edges = sorted(set(at) - {rng.start})
    best: dict[int, float] = {}
    for k in range(1, cap):
        for cuts in itertools.combinations(edges, k):
            bounds = [rng.start, *cuts, rng.end + 1]
            if any(b - a < min_width for a, b in itertools.pairwise(bounds)):
                continue
            hottest = max(
                sum(x for x, h in zip(buckets, at, strict=True) if a <= h < b) / total * score
                for a, b in itertools.pairwise(bounds)
            )
            best[k + 1] = min(best.get(k + 1, math.inf), hottest)
    return best


HISTOGRAM = st.lists(
    st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0, 3.0, 20.0]) | st.floats(0, 50),
    min_size=2,
    max_size=10,
)


@settings(max_examples=400, deadline=None)
@given(
    st.integers(2, 64) | st.integers(65, 4096),
    st.integers(0, HASH_MAX),
    HISTOGRAM,
    st.floats(1.001, 12),
    st.integers(2, 5),
    st.sampled_from([1, 2, 3, 4, 8]),
    st.integers(2, 6),
)
def test_plan_split_is_as_good_as_an_exhaustive_search(
    width: int,
    start: int,
    buckets: list[float],
    score: float,
    cap: int,
    parts: int,
    undo: int,
) -> None:
    rng = HashRange(min(start, HASH_MAX + 1 - width), min(start, HASH_MAX + 1 - width) + width - 1)
    min_width = max(1, width // parts - (width % 3))  # sometimes just short of a slice edge
    cap = min(cap, width // min_width)
    assume(cap >= 2 and sum(buckets) > 0)
    best = _oracle(rng, buckets, score, cap, min_width)
    plan = plan_split(rng, buckets, score, cap, min_width)
    if plan is None:
        assert not best  # equal-width instead only when no slice edge allows a split
        return
    assert best and 2 <= len(plan.loads) <= cap and min(plan.widths) >= min_width
    hottest = max(plan.loads)
    under = [k for k in sorted(best) if best[k] <= 1.0 + TOL]
    opt = min(best.values())
    event(f"under={bool(under)} refused={plan.refused}")
    if under:  # every child under the threshold, with the fewest children that can be
        assert hottest <= 1.0 + TOL
        assert len(plan.loads) == under[0]
    else:  # the hottest child as cool as any allowed split leaves it
        assert hottest <= opt * (1 + TOL)
    relief = (score - opt) / (score - 1.0)
    if plan.refused:  # no allowed split would relieve the hot child enough
        assert relief < HOT_KEY_MIN_RELIEF
    elif hottest > 1.0 and plan.widths[plan.loads.index(hottest)] < 2 * min_width:
        assert relief >= HOT_KEY_MIN_RELIEF * (1 - TOL)
    # More children to undo recent merges, but never a hotter child for them.
    more = plan_split(rng, buckets, score, cap, min_width, min_children=undo)
    assert more is not None and len(plan.loads) <= len(more.loads) <= cap
    assert min(more.widths) >= min_width and max(more.loads) <= hottest * (1 + TOL)


def test_children_spanning_several_slices_still_come_under_the_threshold() -> None:
    # 32 slices of 32 hashes, min_split_width 256 (8 slices): the first quarter at 0.5x,
    # each other quarter at 0.95x. A child must span 8 slices, so filling children
    # slice by slice up to the threshold left three children over it, each too narrow
    # to split again, where the equal-width quarters put all four under it.
    buckets = [0.5 / 8] * 8 + [0.95 / 8] * 24
    plan = plan_split(HashRange(0, 1023), buckets, sum(buckets), 4, 256)
    assert plan is not None and not plan.refused
    assert plan.boundaries == (256, 512, 768)
    assert max(plan.loads) == pytest.approx(0.95)


def test_a_hot_key_is_isolated_on_the_side_that_leaves_room_for_a_child() -> None:
    # [0, 1023] in 32 slices of 32; min_split_width 256. A 1.2x key in slice 8 and 0.5x
    # in slice 0: widening the key's child toward its lighter neighbour (left, all
    # zero) left [0, 31], too narrow for a child, which then joined the key's child:
    # 1.7x, refused as a hot key. The key's child [256, 511] leaves [0, 255] at 0.5x.
    buckets = [0.0] * 32
    buckets[0], buckets[8] = 0.5, 1.2
    plan = plan_split(HashRange(0, 1023), buckets, 1.7, 4, 256)
    assert plan is not None and not plan.refused
    assert plan.boundaries == (256, 512)
    assert plan.loads == pytest.approx((0.5, 1.2, 0.0))
    layout = initial_layout(64, now_ms=0)  # segment 0 is [0, 1023]
    loads = {s.segment_id: _at(0.1) for s in layout.active_segments()}
    loads[0] = dataclasses.replace(_at(1.7), hash_buckets=tuple(x * THRESHOLD for x in buckets))
    d = decide(layout, loads, {}, POLICY, NOW)
    assert isinstance(d, Split) and d.boundaries == (256, 512)


def test_a_cold_stretch_that_cannot_go_under_the_threshold_is_still_divided() -> None:
    # A hot key at the low edge; beside it every two-slice child (min_split_width) that
    # holds slice 10 is over the threshold. That stretch was left one child at 2.75x.
    buckets = [0.05] * 32
    buckets[0] = 1.5
    buckets[9], buckets[10], buckets[11] = 0.3, 0.8, 0.3
    plan = plan_split(HashRange(0, HASH_MAX), buckets, sum(buckets), 8, 4096)
    assert plan is not None and not plan.refused
    assert plan.widths[0] == 4096 and plan.loads[0] == pytest.approx(1.55)  # the key's child
    assert max(plan.loads[1:]) == pytest.approx(1.1)  # slices 10 and 11: the least it can be
    assert len(plan.loads) <= 8


@pytest.mark.parametrize(
    "buckets",
    [(1e308,) * 32, (1e308, 1e308) + (0.0,) * 30, (1.7e308,) * 2],
    ids=["all-huge", "two-huge", "two-slices"],
)
def test_a_histogram_whose_sum_overflows_counts_as_absent(buckets: tuple[float, ...]) -> None:
    # Each number is a valid double, their sum is not: proportions from it were all 0.
    full = HashRange(0, HASH_MAX)
    assert plan_split(full, buckets, 3.0, 8, 256) is None
    layout = initial_layout(1, now_ms=0)
    hot = {0: dataclasses.replace(_at(3.0), hash_buckets=buckets)}
    d = decide(layout, hot, {}, POLICY, NOW)
    assert isinstance(d, Split) and d.boundaries == equal_boundaries(full, 3)
    # The history hands the parent's peak down by width, as without a histogram.
    policy = dataclasses.replace(POLICY, peak_window_seconds=3_600.0)
    history = TopicHistory()
    history.observe(0, Rates(8_000, 1, 1, 1), 1_000, policy)
    after = split(layout, 0, (0x4000,), now_ms=4_000)
    history.applied(layout, Split(0, (0x4000,), "msgRateIn"), after, 4_000, policy, hot)
    assert history.peak(1, 5_000, policy) == Rates(2_000, 0.25, 0.25, 0.25)
    # The backtest's replay of a recorded history spreads such a record uniformly.
    trace = Trace("t", "history", [0], [0], [HASH_MAX], [(1000.0, 1.0, 1.0, 1.0)], [buckets])
    snap = HistoryLoad(trace).snapshot(0)
    assert snap.rates(0, 0x7FFF).msg_rate_in == pytest.approx(500.0)
