"""Pure operations on a scalable topic's segment DAG (DESIGN §1).

Every operation validates its preconditions, returns a *new* layout with
``epoch + 1`` and never mutates its input. :func:`violations` is the invariant
check every caller runs on layouts it did not build itself. It accepts every
shape Pulsar 5 writes, because a rejected layout leaves its topic unmanaged:

* every segment's range is valid and its id is below ``nextSegmentId``;
* active segments tile ``0..0xFFFF`` exactly and have no children;
* links between two segments that are both present are mutual, and the
  present links form a DAG;
* a link may name a segment that is no longer present: it was pruned. Pulsar's
  own readers treat a missing id the same way (SegmentLayout.java
  ``getChildren``/``getParents``/``mergeDepth`` skip it), so a reference to a
  missing id below ``nextSegmentId`` is not an error;
* sealed segments need *not* be covered by their children. Pulsar's GC prunes
  drained sealed segments in any order (ScalableTopicController.java:1224-1229
  "pruning is allowed in any order"; SegmentLayout.java:291-326
  ``pruneSegment`` drops the pruned segment from its parents' ``childIds`` and
  its children's ``parentIds``), so a sealed parent can stay while its child
  is gone. Realistic: a subscription created after the parent was sealed has no
  cursor on it (cursors go to active segments only, ScalableTopicController.java:943-947),
  so the parent never drains while the child does.

PIP-475 migrated layouts (N sealed full-range legacy parents, every child
listing every parent) and PIP-486 rebucket rollovers (a sealed parent with one
child of the same range) satisfy these rules; their extra fields
(``legacyTopicName``, ``entryBucketSplits``) are kept by the JSON model.

Our own GC (:func:`prune`) is stricter than Pulsar's on purpose: it prunes a
sealed segment only together with, or after, every parent still present
(oldest first), so every sealed segment we leave keeps its path to the active
segments. Pulsar can prune out of order because its drain-before-assign
ordering makes "child drained" imply "parent drained" for the subscriptions
that read the parent; controllerd sees backlogs, not that ordering (QUEUE
subscriptions and cursors created after a seal break the implication), so it
keeps the conservative rule for the prunes it makes itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from controllerd.core.model import (
    HASH_MAX,
    HASH_MIN,
    HASH_SPACE,
    Decision,
    HashRange,
    Layout,
    Merge,
    Segment,
    SegmentState,
    Split,
)


class LayoutError(ValueError):
    """An operation's precondition does not hold.

    ``code`` mirrors the broker's answer: ``not-found`` (404), ``not-active``,
    ``not-adjacent``, ``bad-boundaries``, ``parent-present`` (412).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def initial_layout(num_segments: int, now_ms: int = 0) -> Layout:
    """Pulsar's initial layout: equal ranges of ``65536 // n``, the last ending at 0xFFFF."""
    if not 1 <= num_segments <= HASH_SPACE:
        raise LayoutError("bad-boundaries", f"numInitialSegments must be 1..{HASH_SPACE}")
    size = HASH_SPACE // num_segments
    segments = {}
    for i in range(num_segments):
        end = HASH_MAX if i == num_segments - 1 else i * size + size - 1
        segments[i] = Segment(
            segment_id=i,
            hash_range=HashRange(i * size, end),
            state=SegmentState.ACTIVE,
            created_at_ms=now_ms,
        )
    return Layout(epoch=0, next_segment_id=num_segments, segments=segments)


def equal_boundaries(hash_range: HashRange, k: int) -> tuple[int, ...]:
    """Start values of children 2..k of an equal-width k-way split.

    For k = 2 this is exactly Pulsar's midpoint split
    (``mid = start + (end - start) / 2``; second child starts at ``mid + 1``).
    """
    width = hash_range.width
    if not 2 <= k <= width:
        raise LayoutError("bad-boundaries", f"cannot split a range of width {width} {k} ways")
    return tuple(hash_range.start + (width * i + k - 1) // k for i in range(1, k))


def _require(layout: Layout, segment_id: int) -> Segment:
    seg = layout.segments.get(segment_id)
    if seg is None:
        raise LayoutError("not-found", f"segment {segment_id} does not exist")
    return seg


def _require_active(layout: Layout, segment_id: int) -> Segment:
    seg = _require(layout, segment_id)
    if not seg.active:
        raise LayoutError("not-active", f"segment {segment_id} is not active")
    return seg


def split(
    layout: Layout,
    segment_id: int,
    boundaries: Sequence[int] | None = None,
    *,
    now_ms: int,
) -> Layout:
    """Seal ``segment_id`` and create ``len(boundaries) + 1`` children partitioning it.

    ``boundaries`` are the start values of children 2..k, strictly ascending and
    strictly inside the range; None means Pulsar's midpoint split.
    """
    parent = _require_active(layout, segment_id)
    rng = parent.hash_range
    bounds = tuple(equal_boundaries(rng, 2) if boundaries is None else boundaries)
    if not bounds:
        raise LayoutError("bad-boundaries", "a split needs at least one boundary")
    previous = rng.start
    for b in bounds:
        if not previous < b <= rng.end:
            raise LayoutError(
                "bad-boundaries",
                f"boundaries {list(bounds)} must ascend strictly inside "
                f"[{rng.start}, {rng.end}] of segment {segment_id}",
            )
        previous = b
    epoch = layout.epoch + 1
    starts = (rng.start, *bounds)
    ends = (*(b - 1 for b in bounds), rng.end)
    child_ids = tuple(range(layout.next_segment_id, layout.next_segment_id + len(starts)))
    segments = dict(layout.segments)
    segments[segment_id] = parent.sealed(epoch, now_ms, child_ids)
    for cid, start, end in zip(child_ids, starts, ends, strict=True):
        segments[cid] = Segment(
            segment_id=cid,
            hash_range=HashRange(start, end),
            state=SegmentState.ACTIVE,
            parent_ids=(segment_id,),
            created_at_epoch=epoch,
            created_at_ms=now_ms,
        )
    return layout.succeeded(segments, child_ids[-1] + 1)


def merge(layout: Layout, a: int, b: int, *, now_ms: int) -> Layout:
    """Seal two adjacent active segments and create one child covering both."""
    first, second = _require_active(layout, a), _require_active(layout, b)
    if first.hash_range.start > second.hash_range.start:
        first, second = second, first
    if first.hash_range.end + 1 != second.hash_range.start:
        raise LayoutError("not-adjacent", f"segments {a} and {b} are not adjacent")
    epoch = layout.epoch + 1
    child_id = layout.next_segment_id
    segments = dict(layout.segments)
    for parent in (first, second):
        segments[parent.segment_id] = parent.sealed(epoch, now_ms, (child_id,))
    segments[child_id] = Segment(
        segment_id=child_id,
        hash_range=HashRange(first.hash_range.start, second.hash_range.end),
        state=SegmentState.ACTIVE,
        parent_ids=(first.segment_id, second.segment_id),
        created_at_epoch=epoch,
        created_at_ms=now_ms,
    )
    return layout.succeeded(segments, child_id + 1)


def prune(layout: Layout, segment_ids: Iterable[int]) -> Layout:
    """Remove sealed segments and every link to them.

    Refuses a segment whose parent stays in the layout (see module docstring).
    """
    doomed = set(segment_ids)
    for sid in sorted(doomed):
        seg = _require(layout, sid)
        if seg.active:
            raise LayoutError("not-active", f"segment {sid} is active and cannot be pruned")
        kept_parents = [p for p in seg.parent_ids if p not in doomed and p in layout.segments]
        if kept_parents:
            raise LayoutError(
                "parent-present",
                f"segment {sid} still has parent(s) {kept_parents} in the layout",
            )
    segments: dict[int, Segment] = {}
    isdisjoint = doomed.isdisjoint  # most segments link to none of them: check in C
    for sid, seg in layout.segments.items():
        if sid in doomed:
            continue
        if isdisjoint(seg.parent_ids) and isdisjoint(seg.child_ids):
            segments[sid] = seg
            continue
        parents = tuple(p for p in seg.parent_ids if p not in doomed)
        children = tuple(c for c in seg.child_ids if c not in doomed)
        segments[sid] = seg.relinked(parents, children)
    return layout.succeeded(segments, layout.next_segment_id)


def apply(layout: Layout, decision: Decision, *, now_ms: int) -> Layout:
    """Apply a policy decision; NoAction returns the layout unchanged."""
    if isinstance(decision, Split):
        return split(layout, decision.segment_id, decision.boundaries, now_ms=now_ms)
    if isinstance(decision, Merge):
        return merge(layout, decision.a, decision.b, now_ms=now_ms)
    return layout


class MergeDepths:
    """Lazy, memoised merge depth: merge nodes (>= 2 parents) in a segment's ancestry.

    The segment itself counts. Ancestors already pruned no longer count (the
    layout has forgotten them). Lazy because the policy needs the depth of a
    few merge candidates, not of the whole DAG. Cycles (invalid layouts) are
    cut rather than looped.
    """

    def __init__(self, segments: Mapping[int, Segment]) -> None:
        self._segments = segments
        self._ancestry: dict[int, frozenset[int]] = {}

    def _merge_ancestry(self, root: int) -> frozenset[int]:
        """Depth-first over the parents, with a stack of our own: a chain of segments
        1,000 deep (a rebucket's rollovers) exceeded Python's recursion limit."""
        cached = self._ancestry.get(root)
        if cached is not None:
            return cached
        segments, known = self._segments, self._ancestry
        visiting = {root}
        stack = [(root, iter(segments[root].parent_ids))]
        while stack:
            sid, parents = stack[-1]
            for pid in parents:
                if pid in segments and pid not in visiting and pid not in known:
                    visiting.add(pid)
                    stack.append((pid, iter(segments[pid].parent_ids)))
                    break
            else:  # every parent known (or pruned, or on the stack: a cycle, cut)
                stack.pop()
                seg = segments[sid]
                found: set[int] = {sid} if len(seg.parent_ids) >= 2 else set()
                for pid in seg.parent_ids:
                    ancestry = known.get(pid)
                    if ancestry is not None:
                        found |= ancestry
                visiting.discard(sid)
                known[sid] = frozenset(found)
        return known[root]

    def __getitem__(self, segment_id: int) -> int:
        return len(self._merge_ancestry(segment_id))


def merge_depths(segments: Mapping[int, Segment]) -> dict[int, int]:
    """Merge depth of every segment (see :class:`MergeDepths`)."""
    depths = MergeDepths(segments)
    return {sid: depths[sid] for sid in segments}


def merge_depth(layout: Layout, segment_id: int) -> int:
    return merge_depths(layout.segments)[segment_id]


def violations(layout: Layout) -> list[str]:
    """Every broken invariant, as sentences naming the segments (empty = valid)."""
    problems: list[str] = []
    segs = layout.segments
    for sid, seg in segs.items():
        r = seg.hash_range
        if sid != seg.segment_id:
            problems.append(f"segment keyed {sid} has segmentId {seg.segment_id}")
        if not HASH_MIN <= r.start <= r.end <= HASH_MAX:
            problems.append(f"segment {sid} has invalid range [{r.start}, {r.end}]")
        if sid >= layout.next_segment_id:
            problems.append(f"segment {sid} is not below nextSegmentId {layout.next_segment_id}")
        for pid in seg.parent_ids:
            parent = segs.get(pid)
            if parent is None:
                problems += _never_created(layout, sid, "parent", pid)
            elif sid not in parent.child_ids:
                problems.append(f"segment {sid} names parent {pid}, which does not list it")
        for cid in seg.child_ids:
            child = segs.get(cid)
            if child is None:
                problems += _never_created(layout, sid, "child", cid)
            elif sid not in child.parent_ids:
                problems.append(f"segment {sid} names child {cid}, which does not list it")
        if seg.active and seg.child_ids:
            problems.append(f"active segment {sid} has children {list(seg.child_ids)}")
    expected = HASH_MIN
    for seg in layout.active_segments():
        if seg.hash_range.start != expected:
            problems.append(
                f"active segments do not tile the hash space at {expected:#06x} "
                f"(segment {seg.segment_id} starts at {seg.hash_range.start:#06x})"
            )
        expected = max(expected, seg.hash_range.end + 1)
    if expected == HASH_MIN:
        problems.append("no active segments: they must tile the hash space")
    elif expected != HASH_SPACE:
        problems.append(
            f"active segments do not tile the hash space: they end at {expected - 1:#06x}, "
            f"not {HASH_MAX:#06x}"
        )
    if _has_cycle(segs):
        problems.append("parent links form a cycle")
    return problems


def _never_created(layout: Layout, sid: int, role: str, other: int) -> list[str]:
    """A link to an absent segment is fine (pruned) unless that id was never handed out."""
    if 0 <= other < layout.next_segment_id:
        return []
    return [
        f"segment {sid} names {role} {other}, which was never created "
        f"(nextSegmentId {layout.next_segment_id})"
    ]


def _has_cycle(segments: Mapping[int, Segment]) -> bool:
    indegree = {sid: 0 for sid in segments}
    for seg in segments.values():
        for cid in seg.child_ids:
            if cid in indegree:
                indegree[cid] += 1
    ready = [sid for sid, n in indegree.items() if n == 0]
    seen = 0
    while ready:
        sid = ready.pop()
        seen += 1
        for cid in segments[sid].child_ids:
            if cid in indegree:
                indegree[cid] -= 1
                if indegree[cid] == 0:
                    ready.append(cid)
    return seen != len(segments)


def check(layout: Layout) -> Layout:
    """Return ``layout`` if it holds every invariant, else raise LayoutError('invalid')."""
    problems = violations(layout)
    if problems:
        raise LayoutError("invalid", "; ".join(problems))
    return layout
