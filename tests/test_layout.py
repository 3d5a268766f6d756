"""Layout model: Pulsar JSON, initial layouts, split/merge/prune, merge depth, invariants."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest

from controllerd.core.layout import (
    LayoutError,
    MergeDepths,
    check,
    equal_boundaries,
    initial_layout,
    merge,
    merge_depth,
    prune,
    split,
    violations,
)
from controllerd.core.model import (
    HashRange,
    Layout,
    ModelError,
    Segment,
    SegmentState,
    layout_from_json,
    layout_to_json,
    load_sample_from_json,
)
from tests.support.layouts import split_merge_chain


def ranges(layout: Layout) -> list[tuple[int, int]]:
    return [(s.hash_range.start, s.hash_range.end) for s in layout.active_segments()]


def test_initial_layout_matches_pulsar() -> None:
    assert ranges(initial_layout(1)) == [(0, 0xFFFF)]
    assert ranges(initial_layout(3)) == [(0, 21844), (21845, 43689), (43690, 0xFFFF)]
    lay = initial_layout(4)
    assert lay.epoch == 0 and lay.next_segment_id == 4 and violations(lay) == []
    with pytest.raises(LayoutError):
        initial_layout(0)


def test_midpoint_split_matches_pulsar() -> None:
    lay = split(initial_layout(1), 0, now_ms=7)
    assert ranges(lay) == [(0, 0x7FFF), (0x8000, 0xFFFF)]
    parent = lay.segments[0]
    assert parent.state is SegmentState.SEALED and parent.child_ids == (1, 2)
    assert parent.sealed_at_ms == 7 and parent.sealed_at_epoch == 1
    assert lay.segments[1].parent_ids == (0,) and lay.segments[1].created_at_epoch == 1
    # Odd width: mid = start + (end - start) / 2 -> [0, 2] and [3, 4].
    assert equal_boundaries(HashRange(0, 4), 2) == (3,)
    assert equal_boundaries(HashRange(10, 13), 2) == (12,)


def test_k_way_equal_and_explicit_boundaries() -> None:
    lay = split(initial_layout(1), 0, equal_boundaries(HashRange(0, 0xFFFF), 4), now_ms=0)
    assert ranges(lay) == [(0, 0x3FFF), (0x4000, 0x7FFF), (0x8000, 0xBFFF), (0xC000, 0xFFFF)]
    lay = split(initial_layout(1), 0, (0x10, 0x9000), now_ms=0)
    assert ranges(lay) == [(0, 0xF), (0x10, 0x8FFF), (0x9000, 0xFFFF)]
    assert lay.next_segment_id == 4 and violations(lay) == []


@pytest.mark.parametrize("bounds", [(), (0,), (0x10000,), (0x9000, 0x10), (5, 5)])
def test_bad_boundaries_are_refused(bounds: tuple[int, ...]) -> None:
    with pytest.raises(LayoutError) as exc:
        split(initial_layout(1), 0, bounds, now_ms=0)
    assert exc.value.code == "bad-boundaries"


def test_operations_never_mutate_and_bump_epoch() -> None:
    before = initial_layout(2)
    snapshot = json.dumps(layout_to_json(before))
    after = merge(split(before, 0, now_ms=1), 3, 1, now_ms=2)
    assert json.dumps(layout_to_json(before)) == snapshot
    assert after.epoch == 2 and violations(after) == []


def test_merge_adjacent_only_and_order_free() -> None:
    lay = merge(initial_layout(3), 2, 1, now_ms=5)
    child = lay.segments[3]
    assert child.parent_ids == (1, 2) and child.hash_range == HashRange(21845, 0xFFFF)
    assert lay.segments[1].child_ids == (3,) and lay.segments[2].sealed_at_ms == 5
    with pytest.raises(LayoutError) as exc:
        merge(initial_layout(3), 0, 2, now_ms=0)
    assert exc.value.code == "not-adjacent"


def test_operations_on_sealed_or_missing_segments_fail() -> None:
    lay = split(initial_layout(1), 0, now_ms=0)
    ops: list[Callable[[], Layout]] = [
        lambda: split(lay, 0, now_ms=0),
        lambda: merge(lay, 0, 1, now_ms=0),
    ]
    for op in ops:
        with pytest.raises(LayoutError) as exc:
            op()
        assert exc.value.code == "not-active"
    with pytest.raises(LayoutError) as exc:
        split(lay, 99, now_ms=0)
    assert exc.value.code == "not-found"


def test_prune_removes_links_and_refuses_active_or_orphaning() -> None:
    lay = split(split(initial_layout(1), 0, now_ms=0), 1, now_ms=0)
    with pytest.raises(LayoutError) as exc:
        prune(lay, [2])
    assert exc.value.code == "not-active"
    with pytest.raises(LayoutError) as exc:
        prune(lay, [1])  # its parent 0 stays: 0 would lose its link to 3, 4
    assert exc.value.code == "parent-present"
    pruned = prune(lay, [0, 1])
    assert set(pruned.segments) == {2, 3, 4}
    assert pruned.segments[3].parent_ids == () and pruned.segments[2].parent_ids == ()
    assert pruned.next_segment_id == lay.next_segment_id and violations(pruned) == []
    assert prune(prune(lay, [0]), [1]).segments.keys() == {2, 3, 4}
    assert prune(lay, [0]).segments[3] is lay.segments[3]  # linked to none of them: kept as is
    # a one-sided link (a layout read as it is) goes too, parent or child
    odd = dataclasses.replace(lay.segments[2], parent_ids=(0, 1), child_ids=(1, 7))
    skewed = dataclasses.replace(lay, segments={**lay.segments, 2: odd})
    cut = prune(skewed, [0, 1])
    assert (cut.segments[2].parent_ids, cut.segments[2].child_ids) == ((), (7,))


def test_merge_depth_counts_merge_nodes_in_ancestry() -> None:
    lay = merge(initial_layout(4), 0, 1, now_ms=0)  # 4 = merge(0, 1)
    lay = merge(lay, 2, 3, now_ms=0)  # 5 = merge(2, 3)
    assert merge_depth(lay, 4) == 1 and merge_depth(lay, 0) == 0
    lay = merge(lay, 4, 5, now_ms=0)  # 6 = merge(4, 5): itself + 4 + 5
    assert merge_depth(lay, 6) == 3
    lay = split(lay, 6, now_ms=0)  # a split child inherits its parent's ancestry
    assert merge_depth(lay, 7) == 3
    # Pruned ancestors no longer count: without 0 and 1, segment 4 has no parents left.
    assert merge_depth(prune(lay, [0, 1]), 7) == 2


def test_merge_depth_of_an_ancestry_deeper_than_the_recursion_limit() -> None:
    """A split, then a merge of its children, 600 times: 1,200 generations, which the
    recursive walk could not count (RecursionError; that topic was never decided again)."""
    lay = split_merge_chain(600)
    (top,) = [s.segment_id for s in lay.active_segments()]
    assert MergeDepths(lay.segments)[top] == 600  # lazily, from the top: as decide asks
    assert merge_depth(lay, top) == 600


def _raw(lay: Layout) -> dict[str, Any]:
    return json.loads(json.dumps(layout_to_json(lay)))  # type: ignore[no-any-return]


def test_invariant_check_detects_gaps_overlaps_and_broken_links() -> None:
    raw = _raw(split(initial_layout(1), 0, now_ms=0))
    gap = json.loads(json.dumps(raw))
    gap["segments"]["2"]["hashRange"]["start"] = 0x8001
    assert any("tile" in p for p in violations(layout_from_json(gap)))
    overlap = json.loads(json.dumps(raw))
    overlap["segments"]["1"]["hashRange"]["end"] = 0x8000
    assert violations(layout_from_json(overlap))
    one_sided = json.loads(json.dumps(raw))
    one_sided["segments"]["0"]["childIds"] = [1]  # 2 still names 0 as its parent
    assert any("does not list it" in p for p in violations(layout_from_json(one_sided)))
    # A link to an id that was never handed out is corruption, not a prune.
    never = json.loads(json.dumps(raw))
    never["segments"]["1"]["parentIds"] = [0, 42]
    assert any("42, which was never created" in p for p in violations(layout_from_json(never)))
    with pytest.raises(LayoutError):
        check(layout_from_json(never))


def pulsar_prune(layout: Layout, segment_id: int) -> Layout:
    """Pulsar's ``SegmentLayout.pruneSegment`` (SegmentLayout.java:291-326), written out.

    Any sealed segment goes, whatever its parents; its id leaves its children's
    ``parentIds`` and its parents' ``childIds``; epoch + 1. Kept independent of
    :func:`prune`, which refuses some of these on purpose.
    """
    seg = layout.segments[segment_id]
    assert not seg.active, "Pulsar refuses to prune an active segment"
    segments = dict(layout.segments)
    del segments[segment_id]
    for cid in seg.child_ids:
        if cid in segments:
            c = segments[cid]
            segments[cid] = dataclasses.replace(
                c, parent_ids=tuple(p for p in c.parent_ids if p != segment_id)
            )
    for pid in seg.parent_ids:
        if pid in segments:
            p = segments[pid]
            segments[pid] = dataclasses.replace(
                p, child_ids=tuple(c for c in p.child_ids if c != segment_id)
            )
    return dataclasses.replace(layout, epoch=layout.epoch + 1, segments=segments)


def test_pulsar_gc_shape_from_the_compat_review_is_valid() -> None:
    """pulsar-compat.md 2.7: 0 -> 1, 2; 1 -> 3, 4; Pulsar prunes 1 while 0 stays sealed.

    The old rule called this "sealed segment 0 is not covered by its children"
    and the view dropped the topic for good. Pulsar writes it (its GC prunes in
    any order, ScalableTopicController.java:1224-1229), so it is valid now.
    """
    lay = split(split(initial_layout(1), 0, now_ms=1), 1, now_ms=2)
    pruned = pulsar_prune(lay, 1)
    assert violations(pruned) == []
    assert check(pruned) is pruned
    assert pruned.segments[0].child_ids == (2,)  # sealed, half of its range uncovered
    assert pruned.segments[3].parent_ids == () and pruned.segments[4].parent_ids == ()
    # The same shape as Pulsar serialises it, through the JSON parser.
    assert violations(layout_from_json(_raw(pruned))) == []


def _history() -> Layout:
    """Splits, a merge and a split of the merge child: sealed 0, 1, 2, 3, 4, 7."""
    lay = split(initial_layout(1), 0, now_ms=1)  # 1, 2
    lay = split(lay, 1, now_ms=2)  # 3, 4
    lay = split(lay, 2, now_ms=3)  # 5, 6
    lay = merge(lay, 4, 5, now_ms=4)  # 7
    return split(lay, 7, now_ms=5)  # 8, 9


def test_every_pulsar_prune_order_leaves_a_valid_layout() -> None:
    lay = _history()
    sealed = sorted(s.segment_id for s in lay.segments.values() if not s.active)
    assert sealed == [0, 1, 2, 4, 5, 7]
    for order in itertools.permutations(sealed):
        current = lay
        for sid in order:
            current = pulsar_prune(current, sid)
            assert violations(current) == [], (order, sid, violations(current))
        assert sorted(current.segments) == [3, 6, 8, 9]


def test_our_prune_stays_oldest_first_on_pulsar_shapes() -> None:
    # Pulsar pruned 1 while 0 stays (1's children 3 and 4 lost their parent).
    lay = pulsar_prune(
        split(split(split(initial_layout(1), 0, now_ms=1), 1, now_ms=2), 2, now_ms=3), 1
    )
    with pytest.raises(LayoutError) as exc:
        prune(lay, [2])  # its parent 0 is still present: ours never orphans a path
    assert exc.value.code == "parent-present"
    both = prune(lay, [0, 2])
    assert sorted(both.segments) == [3, 4, 5, 6] and violations(both) == []


def _migrated(n: int) -> dict[str, Any]:
    """PIP-475 ``createMigratedMetadata`` (ScalableTopicController.java:1545-1590)."""
    size = 0x10000 // n
    segments: dict[str, Any] = {}
    for k in range(n):
        segments[str(k)] = {
            "segmentId": k,
            "hashRange": {"start": 0, "end": 0xFFFF},
            "state": "SEALED",
            "parentIds": [],
            "childIds": list(range(n, 2 * n)),
            "createdAtEpoch": 0,
            "sealedAtEpoch": 0,
            "createdAtMs": 1000,
            "sealedAtMs": 1000,
            "legacyTopicName": f"persistent://acme/ns/orders-partition-{k}",
            "entryBucketSplits": [],
        }
    for j in range(n):
        end = 0xFFFF if j == n - 1 else j * size + size - 1
        segments[str(n + j)] = {
            "segmentId": n + j,
            "hashRange": {"start": j * size, "end": end},
            "state": "ACTIVE",
            "parentIds": list(range(n)),
            "childIds": [],
            "createdAtEpoch": 0,
            "sealedAtEpoch": -1,
            "createdAtMs": 1000,
            "sealedAtMs": -1,
            "entryBucketSplits": [32768] if n == 2 else [],
        }
    return {"epoch": 0, "nextSegmentId": 2 * n, "segments": segments, "properties": {}}


def test_migrated_and_rebucket_layouts_pass_and_keep_their_fields() -> None:
    migrated = layout_from_json(_migrated(3))
    assert violations(migrated) == []
    assert layout_to_json(migrated)["segments"]["0"]["legacyTopicName"].endswith("partition-0")
    for sid in (0, 1, 2):  # Pulsar may prune any legacy parent first
        assert violations(pulsar_prune(migrated, sid)) == []
    two = layout_to_json(layout_from_json(_migrated(2)))
    assert two["segments"]["2"]["entryBucketSplits"] == [32768]
    # PIP-486 rebucket (SegmentLayout.java rebucketSegment): a sealed parent with one
    # same-range successor carrying new entry-bucket splits.
    rebucket = _raw(initial_layout(1))
    rebucket["segments"]["0"].update(state="SEALED", childIds=[1], sealedAtEpoch=1, sealedAtMs=5)
    rebucket["segments"]["1"] = {
        **rebucket["segments"]["0"],
        "segmentId": 1,
        "state": "ACTIVE",
        "parentIds": [0],
        "childIds": [],
        "createdAtEpoch": 1,
        "sealedAtEpoch": -1,
        "sealedAtMs": -1,
        "entryBucketSplits": [16384, 32768, 49152],
    }
    rebucket.update(epoch=1, nextSegmentId=2)
    parsed = layout_from_json(rebucket)
    assert violations(parsed) == []
    assert layout_to_json(parsed)["segments"]["1"]["entryBucketSplits"] == [16384, 32768, 49152]


def test_links_to_pruned_ids_are_read_as_pruned() -> None:
    raw = _raw(split(initial_layout(1), 0, now_ms=0))
    dangling = json.loads(json.dumps(raw))
    del dangling["segments"]["0"]  # a writer that dropped only one side of the link
    assert dangling["segments"]["1"]["parentIds"] == [0]
    assert violations(layout_from_json(dangling)) == []


def test_cycle_is_detected() -> None:
    a = Segment(0, HashRange(0, 0xFFFF), SegmentState.SEALED, (1,), (1,))
    b = Segment(1, HashRange(0, 0xFFFF), SegmentState.ACTIVE, (0,), ())
    c = Segment(1, HashRange(0, 0xFFFF), SegmentState.SEALED, (0,), (0,))
    assert violations(Layout(1, 2, {0: a, 1: b}))  # active with... consistent? b lacks child 0
    assert any("cycle" in p for p in violations(Layout(1, 2, {0: a, 1: c})))


def test_json_parsing_is_lenient_and_round_trips_unknown_fields() -> None:
    raw = _raw(initial_layout(2))
    raw["futureField"] = {"x": 1}
    raw["segments"]["0"]["brokerHint"] = "b-1"
    raw["segments"]["1"]["state"] = "active"
    del raw["segments"]["1"]["createdAtMs"]
    lay = layout_from_json(raw)
    assert lay.segments[1].active and lay.segments[1].created_at_ms == 0
    out = layout_to_json(lay)
    assert out["futureField"] == {"x": 1} and out["segments"]["0"]["brokerHint"] == "b-1"
    assert layout_from_json(out) == lay


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: r.update(segments=[1, 2]), "layout.segments"),
        (lambda r: r["segments"]["0"].update(state="MELTED"), "state"),
        (lambda r: r["segments"]["0"].update(hashRange=None), "hashRange"),
        (lambda r: r["segments"]["0"]["hashRange"].update(start="zero"), "start"),
        (lambda r: r["segments"]["0"].update(segmentId=5), "segmentId"),
        (lambda r: r.update(epoch=1.5), "epoch"),
        (lambda r: r.update(autoScalePolicy=[1]), "autoScalePolicy"),
    ],
)
def test_malformed_layouts_name_the_field(mutate: Any, field: str) -> None:
    raw = _raw(initial_layout(2))
    mutate(raw)
    with pytest.raises(ModelError, match=field):
        layout_from_json(raw)


def test_load_record_spellings_and_fallbacks() -> None:
    plain = {"msgRateIn": 1, "bytesRateIn": 2, "msgRateOut": 3, "bytesRateOut": 4}
    sample = load_sample_from_json({**plain, "changedAtMs": 5})
    assert sample.rates.as_tuple() == (1, 2, 3, 4) and sample.sampled_at_ms is None
    assert load_sample_from_json(plain, seen_at_ms=9).changed_at_ms == 9
    with pytest.raises(ModelError, match="changedAtMs"):
        load_sample_from_json(plain)
    with pytest.raises(ModelError, match="msgRateOut"):
        load_sample_from_json({"msgRateIn": 1, "byteRateIn": 2, "byteRateOut": 4})
    with pytest.raises(ModelError, match="msgRateIn"):
        load_sample_from_json({**plain, "msgRateIn": -1, "changedAtMs": 5})
    full = load_sample_from_json({**plain, "changedAtMs": 5, "sampledAtMs": 6, "coldSinceMs": 1})
    assert (full.changed_at_ms, full.sampled_at_ms, full.cold_since_ms) == (5, 6, 1)


def test_sealed_relinked_and_succeeded_are_replace_on_every_field() -> None:
    """The layout operations' fast copies must keep every field, including any added later."""
    seg = Segment(
        7,
        HashRange(16, 31),
        SegmentState.ACTIVE,
        parent_ids=(1, 2),
        child_ids=(9,),
        created_at_epoch=3,
        sealed_at_epoch=4,
        created_at_ms=5,
        sealed_at_ms=6,
        extra={"x": 1},
    )
    defaults = Segment(0, HashRange(0, 0), SegmentState.ACTIVE)
    assert all(getattr(seg, f.name) != f.default for f in dataclasses.fields(Segment)), (
        "give every field a non-default value above"
    )
    for s in (seg, defaults):
        sealed = s.sealed(8, 9, (10, 11))
        assert sealed == dataclasses.replace(
            s,
            state=SegmentState.SEALED,
            child_ids=(10, 11),
            sealed_at_epoch=8,
            sealed_at_ms=9,
        )
        assert s.relinked((3,), ()) == dataclasses.replace(s, parent_ids=(3,), child_ids=())
        assert sealed.extra is s.extra and s.relinked((), ()).extra is s.extra
    lay = Layout(4, 12, {7: seg}, properties={"p": "q"}, auto_scale_policy={"a": 1}, extra={"e": 2})
    assert all(getattr(lay, f.name) != f.default for f in dataclasses.fields(Layout) if f.init), (
        "give every field a non-default value above"
    )
    for layout in (lay, Layout(0, 1, {})):
        later = layout.succeeded({}, 40)
        assert later == dataclasses.replace(
            layout, epoch=layout.epoch + 1, next_segment_id=40, segments={}
        )
        assert later.extra is layout.extra
