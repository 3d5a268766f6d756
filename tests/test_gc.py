"""The GC rule: retention chain, keep-forever, backlog per subscription, parent order."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controllerd.core import gc
from controllerd.core.layout import initial_layout, prune, split, violations
from controllerd.core.model import Layout
from tests.support.layouts import split_merge_chain
from tests.test_properties import reachable

DAY_MS = 86_400_000
SEALED_AT = 1_000


def sealed_topic() -> Layout:
    """Segment 0 split at SEALED_AT into 1 and 2; 1 split later into 3 and 4."""
    lay = split(initial_layout(1), 0, now_ms=SEALED_AT)
    return split(lay, 1, now_ms=SEALED_AT + DAY_MS)


def test_drained_past_retention_is_prunable() -> None:
    seg = sealed_topic().segments[0]
    v = gc.prunable(seg, SEALED_AT + DAY_MS, 86_400, {"a": 0, "b": -1})
    assert v.prunable and v.reason == "drained"


def test_no_subscriptions_counts_as_drained() -> None:
    assert gc.prunable(sealed_topic().segments[0], SEALED_AT + DAY_MS, 86_400, {}).prunable


def test_within_retention_is_kept() -> None:
    v = gc.prunable(sealed_topic().segments[0], SEALED_AT + DAY_MS - 1, 86_400, {})
    assert not v.prunable and v.reason == "retention"


@pytest.mark.parametrize(
    ("backlogs", "reason"),
    [
        ({"a": 0, "b": 1}, "backlog"),
        ({"a": None}, "not-drained"),
        ({"a": 5, "b": None}, "not-drained"),
    ],
)
def test_backlog_or_404_on_any_subscription_keeps_it(
    backlogs: dict[str, int | None], reason: str
) -> None:
    v = gc.prunable(sealed_topic().segments[0], SEALED_AT + 10 * DAY_MS, 86_400, backlogs)
    assert not v.prunable and v.reason == reason


def test_negative_retention_keeps_forever_and_active_is_never_prunable() -> None:
    lay = sealed_topic()
    v = gc.prunable(lay.segments[0], 10**15, -1, {})
    assert not v.prunable and v.reason == "keep-forever"
    assert gc.candidates(lay, 10**15, -1) == []
    assert gc.prunable(lay.segments[2], 10**15, 0, {}).reason == "active"


def test_unknown_seal_time_is_never_prunable() -> None:
    lay = sealed_topic()
    seg = lay.segments[0]
    unknown = type(seg)(
        seg.segment_id,
        seg.hash_range,
        seg.state,
        seg.parent_ids,
        seg.child_ids,
        seg.created_at_epoch,
        seg.sealed_at_epoch,
        seg.created_at_ms,
        -1,
    )
    assert gc.prunable(unknown, 10**15, 0, {}).reason == "no-seal-time"


def test_candidates_are_sealed_past_retention_oldest_first() -> None:
    lay = sealed_topic()
    assert [s.segment_id for s in gc.candidates(lay, SEALED_AT + DAY_MS, 86_400)] == [0]
    both = gc.candidates(lay, SEALED_AT + 2 * DAY_MS, 86_400)
    assert [s.segment_id for s in both] == [0, 1]


def test_retention_chain_topic_then_namespace_then_default() -> None:
    lay = sealed_topic()
    assert gc.resolve_retention(86_400, lay) == 86_400
    assert gc.resolve_retention(86_400, lay, {"segmentRetentionSeconds": 60}) == 60
    tenant, namespace = {"segmentRetentionSeconds": 60}, {"segmentRetentionSeconds": 120}
    assert gc.resolve_retention(86_400, lay, tenant, namespace) == 120
    topic = Layout(lay.epoch, lay.next_segment_id, lay.segments, {"segmentRetentionSeconds": "-1"})
    assert gc.resolve_retention(86_400, topic, tenant, namespace) == -1
    assert gc.resolve_retention(86_400, lay, {"segmentRetentionSeconds": "soon"}) == 86_400


def test_select_never_orphans_a_child_of_a_kept_parent() -> None:
    lay = sealed_topic()
    now = SEALED_AT + 3 * DAY_MS
    verdicts = {
        0: gc.prunable(lay.segments[0], now, 0, {"a": 3}),  # parent still has backlog
        1: gc.prunable(lay.segments[1], now, 0, {"a": 0}),
    }
    assert gc.select(lay, verdicts) == []
    verdicts[0] = gc.prunable(lay.segments[0], now, 0, {"a": 0})
    chosen = gc.select(lay, verdicts)
    assert chosen == [0, 1]
    assert violations(prune(lay, chosen)) == []


def _select_by_passes(lay: Layout, verdicts: dict[int, gc.Verdict]) -> list[int]:
    """The rule as first written (the spec): drop a chosen segment while a present parent
    is not chosen, pass after pass until stable."""
    chosen = {sid for sid, v in verdicts.items() if v.prunable and sid in lay.segments}
    changed = True
    while changed:
        changed = False
        for sid in sorted(chosen):
            if any(p in lay.segments and p not in chosen for p in lay.segments[sid].parent_ids):
                chosen.discard(sid)
                changed = True
    return sorted(chosen)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reachable(max_ops=20), st.data())
def test_one_walk_selects_what_the_passes_did(reached: tuple[Layout, int], data: Any) -> None:
    lay, _ = reached
    sealed = sorted(sid for sid, s in lay.segments.items() if not s.active)
    wanted = data.draw(st.sets(st.sampled_from(sealed))) if sealed else set()
    verdicts = {sid: gc.Verdict(sid, sid in wanted, "") for sid in lay.segments}
    assert gc.select(lay, verdicts) == _select_by_passes(lay, verdicts)


def test_a_chain_of_sealed_segments_is_selected_in_one_walk() -> None:
    """A chain of 3,000 sealed generations (it took 2 s a GC round, 25 s at 10,000): all of
    it is selected when its root is; none of it when the root is held back."""
    lay = split_merge_chain(1_500)
    sealed = [sid for sid, s in lay.segments.items() if not s.active]
    every = {sid: gc.Verdict(sid, True, "") for sid in sealed}
    assert gc.select(lay, every) == sorted(sealed)
    assert gc.select(lay, {**every, 0: gc.Verdict(0, False, "")}) == []


def test_a_cycle_of_parents_selects_nothing() -> None:
    """A checked layout has no cycle; were one to reach GC, nothing in it is safe to prune."""
    lay = split(initial_layout(1), 0, now_ms=0)  # 0 -> 1, 2
    parent = lay.segments[0]
    looped = dataclasses.replace(
        lay, segments={**lay.segments, 0: dataclasses.replace(parent, parent_ids=(1,))}
    )  # 0 <-> 1
    verdicts = {sid: gc.Verdict(sid, True, "") for sid in looped.segments}
    assert gc.select(looped, verdicts) == []


@pytest.mark.parametrize(
    "stamp",
    [1, 10 * DAY_MS // 1000, 10 * DAY_MS - 3 * 3_600_000],
    ids=["one", "in-seconds", "clock-3h-behind"],
)
def test_a_seal_stamped_before_the_segment_was_created_is_not_past_retention(stamp: int) -> None:
    """A ``sealedAtMs`` before the segment's ``createdAtMs`` (garbage, seconds for ms, a
    broker clock behind) made a segment sealed a second ago look days old: GC skipped
    its retention. Its age is unknown, so it is kept, as one with no seal time is."""
    created = 10 * DAY_MS
    lay = split(initial_layout(1, created), 0, now_ms=created + 1_000)
    seg = dataclasses.replace(lay.segments[0], sealed_at_ms=stamp)
    lay = dataclasses.replace(lay, segments={**lay.segments, 0: seg})
    now = created + 2_000  # sealed 1 s ago; retention a day
    assert gc.candidates(lay, now, 86_400) == []
    verdict = gc.prunable(seg, now, 86_400, {})
    assert not verdict.prunable and verdict.reason == "seal-before-create"
    # an unknown creation time proves nothing: the seal stamp counts as before
    unknown = dataclasses.replace(seg, created_at_ms=0)
    assert gc.prunable(unknown, now, 0, {}).prunable
