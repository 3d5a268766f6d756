"""Replay one topic's load through the daemon's own policy and measure what it did (pure).

The loop runs once per evaluation interval ``dt`` (the daemon's autoscale tick;
it also evaluates on every load-record write, which at one report per interval
is the same instant). At step ``t``:

1. **Measure** the interval that just ended, ``(t - dt, t]``, served by the
   current layout: reporters' rates are trailing means, so the load reported at
   ``t`` is what the segments carried *before* any decision taken at ``t``.
   Every overload therefore costs at least one interval, for every policy.
2. **Report**: each active segment's reporter applies
   :func:`controllerd.core.loadreport.should_write` (materiality gate, threshold
   crossing, heartbeat) to decide whether etcd's record changes. The policy
   sees only records, never the true load: that is how a 25% gate hides a
   segment running above its split threshold (DESIGN §8.2).
3. **Track cold-since** exactly like the controller (DESIGN §8.1), when the
   strategy does: on the record being below every merge threshold, remember
   ``min(changedAtMs, now)``; forget it when the record is not.
4. **Decide** with :func:`controllerd.core.policy.decide` and **apply** with
   :func:`controllerd.core.layout.apply`; a split or merge happens at ``t`` and its
   new segments report from ``t + dt`` on. The new layout is decided on again
   at once (the daemon's layout watch does the same), so cooldowns, not the
   step, limit how many operations one instant sees.
5. **GC** sealed segments past retention (backlog assumed drained), oldest first,
   as the daemon does; that bounds the merge depth ``decide`` sees.

Load is measured against fixed ``reference`` thresholds (the capacity the
trace was scaled to), never the variant's own, so a variant that splits
earlier is credited for it and one that raises its thresholds is charged.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from controllerd.config import LoadReportSettings
from controllerd.core.layout import apply, check, initial_layout, prune
from controllerd.core.loadreport import ReportRule, WriteReason, should_write
from controllerd.core.model import Layout, LoadSample, Merge, PolicySettings, Rates, Split
from controllerd.core.policy import below, decide, inherited_cold_since, is_stale
from controllerd.pipeline.load import LoadSource

FLIPFLOP_WINDOW_MS: Final = 30 * 60 * 1000
"""A merge undone by a split of the same range (or the reverse) within this is a flip-flop."""
MAX_OPS_PER_STEP: Final = 64
"""Bound on back-to-back operations at one instant (only reachable with zero cooldowns)."""


@dataclass(frozen=True, slots=True)
class Strategy:
    """Everything a variant sets: the policy, the reporters' rule, what the daemon tracks.

    A static topic is ``policy.enabled = False`` with ``initial_segments = N``.
    """

    policy: PolicySettings
    report: LoadReportSettings
    #: seconds between evaluations (and load reports): ``[autoscale].interval_seconds``.
    interval_seconds: float = 60.0
    #: DESIGN §8.1: the merge window runs from "continuously cold since", not changedAtMs.
    track_cold_since: bool = True
    initial_segments: int = 1
    #: ``[gc].default_retention_seconds``; negative keeps sealed segments forever.
    gc_retention_seconds: float = 86_400.0

    def errors(self) -> list[str]:
        errs = self.policy.errors("policy") + self.report.errors("load_report")
        if not (self.interval_seconds > 0 and math.isfinite(self.interval_seconds)):
            errs.append(f"interval_seconds: must be > 0 (got {self.interval_seconds!r})")
        if not 1 <= self.initial_segments <= 65536:
            errs.append(f"initial_segments: must be 1..65536 (got {self.initial_segments!r})")
        return errs


@dataclass(frozen=True, slots=True)
class Metrics:
    """One trace x variant. The first seven fields are the ``metrics.csv`` contract.

    Units: hours and seconds of replayed time. ``seconds_above_threshold`` and
    ``excess_load`` sum over segments: a segment at ``s`` times its split
    threshold (``s > 1``, the highest of the four rate ratios) for ``dt`` seconds
    adds ``dt`` and ``(s - 1) * dt`` (threshold-seconds: one is a full
    threshold's worth of traffic for one second beyond capacity).
    """

    segment_hours: float
    seconds_above_threshold: float
    excess_load: float
    splits: int
    merges: int
    flipflops: int
    peak_segments: int
    operations: int
    children_created: int
    mean_segments: float
    topic_seconds_above_threshold: float
    longest_overload_seconds: float
    excess_messages: float
    late_excess_load: float
    load_writes: int
    hours: float


METRIC_COLUMNS: Final = tuple(Metrics.__dataclass_fields__)


@dataclass(frozen=True, slots=True)
class Timeline:
    """Per-step series for plots: times, topic load and hottest segment (both in units of
    the reference threshold), and active segments. Downsampled series keep each
    bucket's maximum, so no spike disappears from a plot."""

    t_ms: Sequence[int]
    load: Sequence[float]
    hottest: Sequence[float]
    segments: Sequence[int]


@dataclass(frozen=True, slots=True)
class Operation:
    """One applied split or merge: when, what, the hash range it acted on, and why."""

    t_ms: int
    action: str
    start: int
    end: int
    reason: str
    segments_after: int
    flipflop: bool


@dataclass(frozen=True, slots=True)
class SimResult:
    metrics: Metrics
    operations: Sequence[Operation]
    #: the whole replay, downsampled to at most ``timeline_points`` buckets.
    timeline: Timeline
    #: full resolution around the topic's peak load.
    zoom: Timeline
    final_layout: Layout


@dataclass(slots=True)
class _Reporter:
    """One segment's reporter and what etcd holds for it."""

    written: Rates | None = None
    written_at: int | None = None
    changed_at: int = 0
    record: LoadSample | None = None
    last_seen: Rates | None = None
    quiet: bool = False


@dataclass(slots=True)
class _Ops:
    """Recent splits and merges, for flip-flop detection."""

    recent: deque[tuple[int, str, int, int]] = field(default_factory=deque)
    flipflops: int = 0

    def add(self, t: int, kind: str, start: int, end: int) -> bool:
        """Record an operation; True if it is a flip-flop."""
        while self.recent and t - self.recent[0][0] > FLIPFLOP_WINDOW_MS:
            self.recent.popleft()
        undone = "merge" if kind == "split" else "split"
        # A merge inside a recent split's range undoes (part of) it; a split of a
        # range inside a recent merge's result undoes that merge.
        flipflop = any(k == undone and s <= start and end <= e for _, k, s, e in self.recent)
        self.flipflops += flipflop
        self.recent.append((t, kind, start, end))
        return flipflop


def simulate(
    source: LoadSource,
    strategy: Strategy,
    reference: Rates,
    *,
    check_layout: bool = False,
    timeline_points: int = 2000,
    zoom_seconds: float = 6 * 3600.0,
) -> SimResult:
    """Replay ``source`` under ``strategy``; see the module docstring for the step.

    Args:
        reference: the split thresholds that stand for segment capacity in the metrics.
        check_layout: verify the layout invariants after every change (tests);
            raises :class:`controllerd.core.layout.LayoutError` on a violation.
    """
    policy, report = strategy.policy, strategy.report
    rule = ReportRule(
        policy.split_thresholds,
        policy.merge_thresholds,
        report.rate_change_threshold,
        report.report_max_interval_seconds,
        report.threshold_crossing,
    )
    step_ms = round(strategy.interval_seconds * 1000)
    dt = step_ms / 1000.0
    r0, r1, r2, r3 = reference.as_tuple()
    retention_ms = strategy.gc_retention_seconds * 1000.0
    track_cold = strategy.track_cold_since
    merge_limits = policy.merge_thresholds

    layout = initial_layout(strategy.initial_segments, now_ms=source.start_ms)
    reporters: dict[int, _Reporter] = {}
    cold_since: dict[int, int] = {}
    sealed_cold: dict[int, int] = {}  # cold-since of sealed segments, for their children
    view: dict[int, LoadSample] = {}
    sealed: deque[tuple[int, int]] = deque()
    ops = _Ops()
    log: list[Operation] = []
    last_split: int | None = None
    last_merge: int | None = None

    steps = segment_steps = above_steps = topic_above_steps = 0
    run = longest_run = 0
    excess = excess_msgs = late_excess = 0.0
    splits = merges = children = writes = 0
    peak = len(layout.active_segments())
    tl_t: list[int] = []
    tl_load: list[float] = []
    tl_hot: list[float] = []
    tl_n: list[int] = []

    for now, snap in source.snapshots(step_ms):
        active = layout.active_segments()
        n = len(active)
        steps += 1
        segment_steps += n

        # 1. measure the interval that just ended, on the layout that served it
        hottest = step_excess = 0.0
        for seg in active:
            r = snap.rates(seg.hash_range.start, seg.hash_range.end)
            score = max(
                r.msg_rate_in / r0, r.byte_rate_in / r1, r.msg_rate_out / r2, r.byte_rate_out / r3
            )
            if score > 1.0:
                above_steps += 1
                step_excess += score - 1.0
                if r.msg_rate_in > r0:
                    excess_msgs += r.msg_rate_in - r0
            hottest = max(hottest, score)
        excess += step_excess
        if hottest > 1.0:
            topic_above_steps += 1
            if run > 0:
                late_excess += step_excess
            run += 1
            longest_run = max(longest_run, run)
        else:
            run = 0
        total = snap.total()
        tl_t.append(now)
        tl_load.append(
            max(
                total.msg_rate_in / r0,
                total.byte_rate_in / r1,
                total.msg_rate_out / r2,
                total.byte_rate_out / r3,
            )
        )
        tl_hot.append(hottest)
        tl_n.append(n)

        # 2. reporters write material changes; 3. the controller tracks cold-since
        for seg in active:
            sid = seg.segment_id
            rep = reporters.get(sid)
            if rep is None:
                rep = reporters[sid] = _Reporter()
            current = snap.rates(seg.hash_range.start, seg.hash_range.end)
            if rep.quiet and rep.written is not None and current == rep.last_seen:
                # Same inputs as last time, which wrote nothing: only a heartbeat can be due.
                reason = should_write(rule, rep.written, rep.written, now, rep.written_at)
            else:
                reason = should_write(rule, rep.written, current, now, rep.written_at)
            rep.last_seen, rep.quiet = current, reason is None
            touched = False
            if reason is WriteReason.HEARTBEAT and rep.record is not None:
                rep.written_at = now
                rep.record = LoadSample(rep.record.rates, rep.changed_at, now)
                touched = True
            elif reason is not None:
                rep.written, rep.written_at, rep.changed_at = current, now, now
                rep.record = LoadSample(current, now, now)
                touched = True
            if touched:
                writes += 1
            record = rep.record
            if record is None:
                continue
            if track_cold and not is_stale(record, policy, now):
                cold = below(record.rates, merge_limits)
                if cold and sid not in cold_since:
                    inherited = inherited_cold_since(layout, sid, sealed_cold)
                    cold_since[sid] = (
                        inherited if inherited is not None else min(record.changed_at_ms, now)
                    )
                    touched = True
                elif not cold and sid in cold_since:
                    del cold_since[sid]
                    touched = True
            if touched:
                view[sid] = (
                    LoadSample(record.rates, record.changed_at_ms, record.sampled_at_ms, cs)
                    if (cs := cold_since.get(sid)) is not None
                    else record
                )

        # 4. decide and apply; the new layout triggers another evaluation at once,
        # as its watch event does in the daemon (so a cooldown of 0 allows a second op)
        for _ in range(MAX_OPS_PER_STEP):
            decision = decide(layout, view, {}, policy, now, last_split, last_merge)
            if not isinstance(decision, Split | Merge):
                break
            if isinstance(decision, Split):
                gone: tuple[int, ...] = (decision.segment_id,)
                rng = layout.segments[decision.segment_id].hash_range
                start, end = rng.start, rng.end
                splits += 1
                children += len(decision.boundaries) + 1
                last_split = now
            else:
                gone = (decision.a, decision.b)
                start = layout.segments[decision.a].hash_range.start
                end = layout.segments[decision.b].hash_range.end
                merges += 1
                children += 1
                last_merge = now
            flipflop = ops.add(now, decision.action, start, end)
            layout = apply(layout, decision, now_ms=now)
            log.append(
                Operation(
                    now,
                    decision.action,
                    start,
                    end,
                    decision.reason,
                    len(layout.active_segments()),
                    flipflop,
                )
            )
            for sid in gone:
                reporters.pop(sid, None)
                if (was := cold_since.pop(sid, None)) is not None:
                    sealed_cold[sid] = was  # a merge child may take it over
                view.pop(sid, None)
                sealed.append((now, sid))
            peak = max(peak, log[-1].segments_after)
            if check_layout:
                check(layout)

        # 5. GC: oldest first, so a segment's parents are always pruned before it
        if retention_ms >= 0 and sealed and now - sealed[0][0] >= retention_ms:
            due = []
            while sealed and now - sealed[0][0] >= retention_ms:
                due.append(sealed.popleft()[1])
            layout = prune(layout, due)
            if check_layout:
                check(layout)

    hours = steps * dt / 3600.0
    metrics = Metrics(
        segment_hours=segment_steps * dt / 3600.0,
        seconds_above_threshold=above_steps * dt,
        excess_load=excess * dt,
        splits=splits,
        merges=merges,
        flipflops=ops.flipflops,
        peak_segments=max(peak, max(tl_n, default=0)),
        operations=splits + merges,
        children_created=children,
        mean_segments=segment_steps / steps if steps else 0.0,
        topic_seconds_above_threshold=topic_above_steps * dt,
        longest_overload_seconds=longest_run * dt,
        excess_messages=excess_msgs * dt,
        late_excess_load=late_excess * dt,
        load_writes=writes,
        hours=hours,
    )
    full = Timeline(tl_t, tl_load, tl_hot, tl_n)
    return SimResult(
        metrics,
        log,
        downsample(full, timeline_points),
        _window(full, zoom_seconds * 1000.0),
        layout,
    )


def downsample(timeline: Timeline, points: int) -> Timeline:
    """At most ``points`` buckets of equal length, each keeping its maxima (and first time)."""
    n = len(timeline.t_ms)
    size = max(1, math.ceil(n / max(1, points)))
    if size == 1:
        return timeline
    ts, load, hot, segs = [], [], [], []
    for i in range(0, n, size):
        j = min(n, i + size)
        ts.append(timeline.t_ms[i])
        load.append(max(timeline.load[i:j]))
        hot.append(max(timeline.hottest[i:j]))
        segs.append(max(timeline.segments[i:j]))
    return Timeline(ts, load, hot, segs)


def _window(timeline: Timeline, span_ms: float) -> Timeline:
    """The steps within ``span_ms / 2`` of the topic's peak load (the first, if tied)."""
    if not timeline.t_ms:
        return timeline
    peak = max(range(len(timeline.load)), key=timeline.load.__getitem__)
    centre = timeline.t_ms[peak]
    keep = [i for i, t in enumerate(timeline.t_ms) if abs(t - centre) <= span_ms / 2]
    return Timeline(
        [timeline.t_ms[i] for i in keep],
        [timeline.load[i] for i in keep],
        [timeline.hottest[i] for i in keep],
        [timeline.segments[i] for i in keep],
    )
