"""Replay one topic's load through the daemon's own policy and measure what it did (pure).

The replay evaluates at every step ``t`` of a grid of ``dt`` (the daemon's
autoscale tick; it also evaluates on every load-record write, which at one
report per interval is the same instant). At step ``t``:

1. **Measure** the interval that just ended, ``(t - dt, t]``, served by the
   current layout: reporters' rates are trailing means, so the load reported at
   ``t`` is what the segments carried *before* any decision taken at ``t``.
   Every overload therefore costs at least one interval, for every policy.
2. **Report**: each active segment's reporter applies
   :func:`controllerd.core.loadreport.should_write` (materiality gate, threshold
   crossing, heartbeat) to decide whether etcd's record changes, with the
   segment's ``hashBuckets`` histogram when the strategy publishes one. The
   policy sees only records, never the true load: that is how a 25% gate hides a
   segment running above its split threshold (DESIGN §8.2).
3. **Track** cold-since exactly like the controller (DESIGN §8.1), when the
   strategy does: on the record being below every merge threshold, remember
   ``min(changedAtMs, now)``; forget it when the record is not. Peaks and
   flip-flops go to a :class:`controllerd.core.policy.TopicHistory`, as the
   daemon keeps them.
4. **Decide** with :func:`controllerd.core.policy.decide` and **apply** with
   :func:`controllerd.core.layout.apply`; a split or merge happens at ``t`` and its
   new segments report from ``t + dt`` on. The new layout is decided on again
   at once (the daemon's layout watch does the same), so cooldowns, not the
   step, limit how many operations one instant sees.
5. **GC** sealed segments past retention (backlog assumed drained), oldest first,
   as the daemon does; that bounds the merge depth ``decide`` sees.

**Event-driven replay.** Most steps change nothing: the load holds between a
trace's rows (5 or 30 minutes against a 60 s step), no record is written, and
no cooldown or window runs out. Such a step measures exactly what the step
before it measured, and ``decide`` would answer what it answered. So the
replay visits only the steps where something can happen: a change of the load
(:meth:`LoadSource.change_times`), the step after an operation, a heartbeat
that could let a record go stale, a cooldown, window, staleness or backoff
running out, a recent rise decaying enough to let a pair merge
(:func:`controllerd.core.policy.next_decision_ms`), a peak leaving
its window, a GC due; and within a visited step it calls ``decide`` only when
its inputs changed or one of those times passed. Heartbeats that cannot matter
(the record cannot go stale between two of them) are counted, not replayed.
The steps in between are added as runs of identical measurements. Both modes
accumulate the same runs in the same order, so ``step_by_step=True`` (every
step, ``decide`` every time) gives bit-identical metrics; the tests check it.
Visits at which ``decide`` need not be asked at all (:func:`may_act_now` False,
and no write that could change that) take a short path (:class:`_Idle`).

Load is measured against fixed ``reference`` thresholds (the capacity the
trace was scaled to), never the variant's own, so a variant that splits
earlier is credited for it and one that raises its thresholds is charged.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from controllerd.config import LoadReportSettings
from controllerd.core.layout import apply, check, initial_layout, prune
from controllerd.core.loadreport import ReportRule, WriteReason
from controllerd.core.model import (
    MAX_HASH_BUCKETS,
    MAX_POLICY_SECONDS,
    Layout,
    LoadSample,
    Merge,
    PolicySettings,
    Rates,
    Split,
)
from controllerd.core.policy import (
    TopicHistory,
    below,
    decide,
    inherited_cold_since,
    may_act,
    may_act_now,
    next_decision_ms,
    next_ripe_ms,
    observes_records,
    stale_at,
)
from controllerd.pipeline import kernel
from controllerd.pipeline.load import (
    LoadSource,
    Ranges,
    RateTuple,
    SeriesLoad,
)

FLIPFLOP_WINDOW_MS: Final = 30 * 60 * 1000
"""A merge undone by a split of the same range (or the reverse) within this is a flip-flop."""
MAX_OPS_PER_STEP: Final = 64
"""Bound on back-to-back operations at one instant (only reachable with zero cooldowns)."""
MIN_INTERVAL_SECONDS: Final = 0.001
"""The shortest replay step: the replay counts time in whole milliseconds."""


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
    #: slices of the ``hashBuckets`` histogram reporters publish; 0 = none (Pulsar).
    hash_buckets: int = 0

    def errors(self) -> list[str]:
        """Problems, each named by its key in a variants file.

        The replay steps in whole milliseconds, so an interval under one rounds to a
        zero step; one over :data:`MAX_POLICY_SECONDS` overflows the step counts.
        """
        errs = self.policy.errors("policy") + self.report.errors("load_report")
        if not MIN_INTERVAL_SECONDS <= self.interval_seconds <= MAX_POLICY_SECONDS:  # also NaN
            errs.append(
                f"autoscale.interval_seconds: must be {MIN_INTERVAL_SECONDS:g}.."
                f"{MAX_POLICY_SECONDS:,} (got {self.interval_seconds!r})"
            )
        retention = self.gc_retention_seconds
        # Negative keeps sealed segments forever, as in the daemon's config; -inf is a typo.
        if not (math.isfinite(retention) and retention <= MAX_POLICY_SECONDS):
            errs.append(
                "gc.default_retention_seconds: must be finite and at most "
                f"{MAX_POLICY_SECONDS:,}, negative to keep forever (got {retention!r})"
            )
        if not 1 <= self.initial_segments <= 65536:
            errs.append(
                f"simulator.initial_segments: must be 1..65536 (got {self.initial_segments!r})"
            )
        if not 0 <= self.hash_buckets <= MAX_HASH_BUCKETS:
            errs.append(
                f"simulator.hash_buckets: must be 0..{MAX_HASH_BUCKETS} (got {self.hash_buckets!r})"
            )
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
    bucket's maximum, so no spike disappears from a plot, and the mean segment count
    (what the bucket cost)."""

    t_ms: Sequence[int]
    load: Sequence[float]
    hottest: Sequence[float]
    segments: Sequence[int]
    segments_mean: Sequence[float] = ()


NO_TIMELINE: Final = Timeline((), (), (), (), ())
"""What a replay run with ``timeline_points=0`` keeps (it plots nothing)."""


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
    #: steps the replay visited (the rest were added as runs).
    visited_steps: int = 0


@dataclass(slots=True)
class _Reporter:
    """One segment's reporter and what etcd holds for it."""

    #: the record etcd holds: its rates, sampledAtMs, changedAtMs and hashBuckets
    written: RateTuple | None = None
    #: ``written`` as Rates, for what decide reads (kept only when the policy is enabled)
    rates: Rates | None = None
    written_at: int | None = None
    changed_at: int = 0
    buckets: tuple[float, ...] | None = None
    #: whether the record was stale when cold-since was last tracked (None: never).
    stale: bool | None = None


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


class Gate:
    """The content half of :func:`controllerd.core.loadreport.should_write`, unrolled.

    ``quiet(old, *new)`` is True exactly when ``should_write`` would give no
    reason but a heartbeat (tested against it): the replay asks it first, on
    every segment of every visited step, and calls ``should_write`` only when a
    record is written.
    """

    def __init__(self, rule: ReportRule) -> None:
        self.rule = rule
        self.limit = rule.rate_change_threshold
        self.crossing = rule.threshold_crossing
        self.split = rule.split_thresholds.as_tuple()
        self.merge = rule.merge_thresholds.as_tuple()

    def quiet(self, old: RateTuple, c0: float, c1: float, c2: float, c3: float) -> bool:
        """``old`` is the record's rates; ``c0``-``c3`` the new ones, in :class:`Rates` order."""
        # Unrolled: this runs for every active segment at every visited step.
        lim, crossing = self.limit, self.crossing
        s0, s1, s2, s3 = self.split
        m0, m1, m2, m3 = self.merge
        o, c = old[0], c0
        if o != c and (
            o == 0.0
            or c == 0.0
            or abs(c - o) > lim * abs(o)
            or (crossing and ((o > s0) != (c > s0) or (o < m0) != (c < m0)))
        ):
            return False
        o, c = old[1], c1
        if o != c and (
            o == 0.0
            or c == 0.0
            or abs(c - o) > lim * abs(o)
            or (crossing and ((o > s1) != (c > s1) or (o < m1) != (c < m1)))
        ):
            return False
        o, c = old[2], c2
        if o != c and (
            o == 0.0
            or c == 0.0
            or abs(c - o) > lim * abs(o)
            or (crossing and ((o > s2) != (c > s2) or (o < m2) != (c < m2)))
        ):
            return False
        o, c = old[3], c3
        return not (
            o != c
            and (
                o == 0.0
                or c == 0.0
                or abs(c - o) > lim * abs(o)
                or (crossing and ((o > s3) != (c > s3) or (o < m3) != (c < m3)))
            )
        )


Measure = tuple[int, int, float, float, float, float]
"""One step's measurement: (active segments, segments above, excess, excess msg/s,
hottest segment, topic load), the last three in units of the reference threshold."""


Block = tuple[int, float, int, list[int]]
"""Rows the short path made for ``n`` equal segments of one share: (first row, share,
``n``, each row's change index)."""


@dataclass(slots=True)
class _Runs:
    """The replay's visits as rows, in time order: (first t, steps, measure). Consecutive
    rows with equal measures are one run of identical steps (:meth:`RunArrays.of` merges
    them). A row's measure is given (``measures``, for the rows outside any block) or,
    for the rows of a :data:`Block`, worked out from the change index once the replay
    ends, all at once: per visit, that was a third of the short path's work."""

    t: list[int] = field(default_factory=list)
    measures: list[Measure] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    #: steps per row, set by :meth:`close`
    count: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))

    def add(self, t: int, measure: Measure) -> None:
        self.t.append(t)
        self.measures.append(measure)

    def close(self, end_ms: int, step_ms: int) -> None:
        """Count each row's steps, up to ``end_ms`` (just after the last step). Rows tile
        the steps, each starting where the one before ended, so a row's steps are the
        gap to the next row's: not counted per visit (a tenth of a short-path visit)."""
        bounds = np.array([*self.t, end_ms], dtype=np.int64)
        self.count = (bounds[1:] - bounds[:-1]) // step_ms


class _Idle:
    """The replay's short path for the visits at which ``decide`` need not be asked.

    :func:`may_act_now` False means no record is hot and no two adjacent cold
    records are past their merge window: ``decide`` answers NoAction, and keeps
    answering it across writes that put no record over a split threshold and
    no new record under the merge thresholds, until a pair could ripen. On nab
    + aws that holds at nine visits in ten: in calm stretches (``may_act``
    False, nothing cold beside something cold) and while cold segments wait
    out their merge window. Such visits only measure and let reporters write.
    This walks them in compiled code (:mod:`.kernel`) instead of the general
    loop, given
    ``until`` (when a pair could ripen, :func:`next_ripe_ms`; None: never), and
    stops *before* the first visit that could be anything else: a hot record,
    a new cold record whose window is already over (a merge child that
    inherits its parents' cold-since), ``until``, a GC, the end. The general
    loop makes that visit from scratch. A new cold record otherwise moves
    ``until`` to its window's end (backoff only lengthens a window); the
    caller then decides no later than that.

    Identical segments (same share of every spread, same record) are walked
    once when nothing per segment is tracked: a static layout of N equal
    ranges. Only for series sources, where a record cannot go stale at a visit
    (heartbeats that are counted, or no heartbeats and no TTL) and no peak
    window is kept. Every metric stays bit-identical to the general loop (tests
    compare both with the step-by-step replay); the per-visit sums add the
    segments' terms in the same order. Python keeps what needs its objects: the
    groups, a spread's shares, inherited cold-since, the reporters handed back.
    """

    def __init__(
        self,
        source: SeriesLoad,
        gate: Gate,
        policy: PolicySettings,
        reference: RateTuple,
        *,
        step_ms: int,
        heartbeat_ms: int,
        hb_ms: float,
        lazy_heartbeats: bool,
        track_cold: bool,
        n_buckets: int,
    ) -> None:
        self.source = source
        self.times = source.change_times()
        self.spreads = source.changes()[1]
        self.uniform = source.uniform
        self.policy = policy
        self.step_ms = step_ms
        self.track_cold = track_cold
        self.n_buckets = n_buckets
        self.split = policy.split_thresholds.as_tuple()
        self.merge = policy.merge_thresholds.as_tuple()
        #: the topic's load from each change on, as the general loop measures it
        self.topic_at = source.topic_loads(reference)
        # what the compiled one-segment path reads (kernel.py)
        self.totals_array = source.totals_array()
        self.after_array, self.then_array = source.next_visits(step_ms)
        self.spread_ids = source.spread_ids()
        self.rows_t = np.empty(len(self.times) + 2, dtype=np.int64)
        self.rows_c = np.empty(len(self.times) + 2, dtype=np.int64)
        self.flips = np.empty(len(self.times) + 2, dtype=np.int64)
        self.state = np.zeros(kernel.S_SIZE, dtype=np.int64)
        self.written = np.zeros(4, dtype=np.float64)
        # one set of parameters for both kernels (each sets its per-call ones first)
        fp = np.zeros(kernel.F_RUN_SIZE, dtype=np.float64)
        fp[kernel.F_LIMIT] = gate.limit
        fp[kernel.F_GATE_SPLIT : kernel.F_GATE_SPLIT + 4] = gate.split
        fp[kernel.F_GATE_MERGE : kernel.F_GATE_MERGE + 4] = gate.merge
        fp[kernel.F_MERGE : kernel.F_MERGE + 4] = self.merge
        fp[kernel.F_SPLIT : kernel.F_SPLIT + 4] = self.split
        fp[kernel.F_WINDOW] = policy.merge_window_seconds * 1000.0  # backoff only lengthens it
        fp[kernel.F_HEARTBEAT] = hb_ms
        fp[kernel.F_REFERENCE : kernel.F_REFERENCE + 4] = reference
        self.params_float = fp
        ip = np.zeros(kernel.P_RUN_SIZE, dtype=np.int64)
        ip[kernel.P_STEP], ip[kernel.P_HEARTBEAT] = step_ms, heartbeat_ms
        ip[kernel.P_LAZY], ip[kernel.P_CROSSING] = lazy_heartbeats, gate.crossing
        ip[kernel.P_ENABLED], ip[kernel.P_TRACK_COLD] = policy.enabled, track_cold
        self.params_int = ip
        self.rows_above = np.empty(len(self.times) + 2, dtype=np.int64)
        self.rows_f = np.empty((len(self.times) + 2, 3), dtype=np.float64)
        self.events = np.empty((len(self.times) + 2, kernel.EVENT_SIZE), dtype=np.int64)

    def run(
        self,
        t: int,
        change: int,
        last: int,
        segs: list[tuple[int, int, int, _Reporter]],
        layout: Layout,
        cold_since: dict[int, int],
        sealed_cold: dict[int, int],
        sealed: deque[tuple[int, int]],
        retention_ms: float,
        stale_view: set[int],
        runs: _Runs,
        until: int | None,
    ) -> tuple[int, int, int, int, int | None]:
        """Make the visits from ``t`` on while ``decide`` need not be asked; returns ``(t,
        change, writes, visits, until)`` where ``t`` is the first visit left to the
        general loop (or past ``last``) and ``until`` the (maybe earlier) time by
        which it must decide again."""
        for _, _, _, rep in segs:
            if rep.written is None or rep.written_at is None:
                return t, change, 0, 0, until
        policy, track_cold = self.policy, self.track_cold
        # groups of segments that evolve identically: key -> index
        keys: dict[tuple[object, ...], int] = {}
        group_of: list[int] = []
        members: list[list[int]] = []
        for i, (sid, a, b, rep) in enumerate(segs):
            where: object = (b - a) if self.uniform else (a, b)
            key = (sid,) if track_cold else (where, rep.written, rep.written_at, rep.changed_at)
            g = keys.setdefault(key, len(keys))
            if g == len(members):
                members.append([])
            members[g].append(i)
            group_of.append(g)
        ng = len(members)
        if ng == 1:
            return self._one(
                t,
                change,
                last,
                segs,
                layout,
                cold_since,
                sealed_cold,
                sealed,
                retention_ms,
                stale_view,
                runs,
                until,
            )
        k = kernel
        firsts = [segs[m[0]] for m in members]
        m0, m1, m2, m3 = self.merge
        # one array each, built from rows: a call costs less than a column
        int_rows: list[list[int]] = []
        float_rows: list[list[float]] = []
        cut, c = self._start(t, change, last + self.step_ms, sealed, retention_ms, until)
        spread = self.spreads[c]  # the first visit's (a new one makes the kernel hand back)
        # with cold-since tracked, a group is one segment, whose inherited cold-since the
        # layout fixes for the whole run
        inherited: list[int | None] = [
            inherited_cold_since(layout, sid, sealed_cold) if track_cold else None
            for sid, _, _, _ in firsts
        ]
        for (sid, a, b, rep), m, since in zip(firsts, members, inherited, strict=True):
            w0, w1, w2, w3 = rep.written  # type: ignore[misc]
            cold = w0 < m0 and w1 < m1 and w2 < m2 and w3 < m3
            listed = track_cold and sid in cold_since
            at: int = rep.written_at  # type: ignore[assignment]  # checked above
            known = 2 if since is None else 1
            int_rows.append([at, rep.changed_at, -1, 0, cold, len(m), known, since or 0, listed])
            float_rows.append([spread.share(a, b), w0, w1, w2, w3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
        gi = np.zeros((ng, k.G_INT), dtype=np.int64)
        gi[:, : k.G_LISTED + 1] = int_rows
        gf = np.array(float_rows, dtype=np.float64)
        st = np.array(
            [t, c, change, 0, 0, until is not None, until or 0, cut, self.spread_ids[c], 0, 0],
            dtype=np.int64,
        )
        ip = self.params_int
        ip[k.P_LAST], ip[k.P_SEGMENTS] = last, len(segs)
        ip[k.P_MERGING] = len(segs) > policy.min_segments
        ip[k.P_APART] = group_of == list(range(ng))  # one segment a group, in segment order
        group_array = np.array(group_of, dtype=np.int64)
        if len(self.events) <= ng:  # a visit's events must fit
            self.events = np.empty((2 * ng, kernel.EVENT_SIZE), dtype=np.int64)
        events = self.events
        rows_t, rows_c, rows_above, rows_f = self.rows_t, self.rows_c, self.rows_above, self.rows_f
        run_t, run_measures, topic_at, n = runs.t, runs.measures, self.topic_at, len(segs)
        while True:
            code = k.idle_run(
                self.totals_array, self.after_array, self.then_array, self.spread_ids,
                self.params_float, ip, st, gi, gf, group_array,
                rows_t, rows_c, rows_above, rows_f, events,
            )  # fmt: skip
            (t, c, change, writes, visits, has_until, until_ms, _, _, rows, n_events) = st.tolist()
            if rows:
                run_t.extend(rows_t[:rows].tolist())
                run_measures.extend(
                    zip(
                        repeat(n, rows),
                        rows_above[:rows].tolist(),
                        rows_f[:rows, 0].tolist(),
                        rows_f[:rows, 1].tolist(),
                        rows_f[:rows, 2].tolist(),
                        map(topic_at.__getitem__, rows_c[:rows].tolist()),
                        strict=True,
                    )
                )
            for g, at, listed in events[:n_events].tolist():  # tracked: one segment a group
                sid, since = firsts[g][0], inherited[g]
                if listed:
                    cold_since[sid] = since if since is not None else at
                else:
                    del cold_since[sid]
            if code == k.SPREAD:
                spread = self.spreads[c]
                gf[:, k.G_SHARE] = [spread.share(a, b) for _, a, b, _ in firsts]
                st[k.R_SPREAD] = self.spread_ids[c]
            elif code != k.EVENTS:
                break
        for m, ints, floats in zip(members, gi.tolist(), gf.tolist(), strict=True):
            group = [segs[i] for i in m]
            wrote = ints[k.G_WROTE]
            loads = floats[k.G_WRITTEN : k.G_WRITTEN + 4]
            self._hand_back(
                group,
                (loads[0], loads[1], loads[2], loads[3]) if wrote >= 0 else group[0][3].written,  # type: ignore[arg-type]
                ints[k.G_WRITTEN_AT],
                ints[k.G_CHANGED_AT],
                bool(ints[k.G_TOUCHED]),
                wrote,
                stale_view,
            )
        return t, change, writes, visits, until_ms if has_until else None

    def _start(
        self,
        t: int,
        change: int,
        end: int,
        sealed: deque[tuple[int, int]],
        retention_ms: float,
        until: int | None,
    ) -> tuple[int, int]:
        """Where a run of visits from ``t`` starts: the first step at which a GC is due or
        ``decide`` must be asked again (``end`` when neither comes), and the change that
        holds at ``t``."""
        cut = sealed[0][0] + math.ceil(retention_ms) if retention_ms >= 0 and sealed else end
        if until is not None and until < cut:
            cut = until
        times = self.times
        while change + 1 < len(times) and times[change + 1] <= t:
            change += 1
        return cut, change

    def _hand_back(
        self,
        segs: list[tuple[int, int, int, _Reporter]],
        written: RateTuple,
        written_at: int,
        changed_at: int,
        touched: bool,
        wrote: int,
        stale_view: set[int],
    ) -> None:
        """Leave a group's record in its reporters as the general loop would have: the
        record's rates (and histogram) only if written in this run (``wrote``: the change
        index of its last write, or -1); the view entries of touched ones go stale."""
        enabled = self.policy.enabled
        rates = Rates(*written) if enabled and wrote >= 0 else None
        snap = self.source.snapshot(wrote) if self.n_buckets and rates is not None else None
        for sid, a, b, rep in segs:
            rep.written, rep.written_at, rep.changed_at = written, written_at, changed_at
            if touched:
                stale_view.add(sid)
                if self.track_cold:
                    rep.stale = False
            if rates is not None:
                rep.rates = rates
                if snap is not None:
                    rep.buckets = snap.buckets(a, b, self.n_buckets)

    def _one(
        self,
        t: int,
        change: int,
        last: int,
        segs: list[tuple[int, int, int, _Reporter]],
        layout: Layout,
        cold_since: dict[int, int],
        sealed_cold: dict[int, int],
        sealed: deque[tuple[int, int]],
        retention_ms: float,
        stale_view: set[int],
        runs: _Runs,
        until: int | None,
    ) -> tuple[int, int, int, int, int | None]:
        """:meth:`run` when every segment evolves alike (one segment, or N equal static ones).

        The visits are made by the compiled kernel (:mod:`.kernel`), which hands back
        for a new spread (a share to work out); the times at which a tracked record
        turned cold or warm it lists, and they are applied here, in order."""
        n = len(segs)
        sid0, a0, b0, rep0 = segs[0]
        written = self.written
        written[:] = rep0.written
        m0, m1, m2, m3 = self.merge
        w0, w1, w2, w3 = rep0.written  # type: ignore[misc]
        cold = w0 < m0 and w1 < m1 and w2 < m2 and w3 < m3
        cut, c = self._start(t, change, last + self.step_ms, sealed, retention_ms, until)
        st = self.state
        written_at: int = rep0.written_at  # type: ignore[assignment]  # run() checked it
        st[:] = (
            t, c, change, written_at, rep0.changed_at, -1, 0, 0, cold,
            until is not None, until or 0, cut, -1, 0, 0,
        )  # fmt: skip
        ip = self.params_int
        ip[kernel.P_LAST], ip[kernel.P_SEGMENTS] = last, n
        # n equal records that turn cold are n adjacent cold records
        ip[kernel.P_COLD_STOPS] = self.policy.enabled and n >= 2 and n > self.policy.min_segments
        fp = self.params_float
        run_t, spreads, ids = runs.t, self.spreads, self.spread_ids
        rows_t, rows_c, flips = self.rows_t, self.rows_c, self.flips
        first_row = len(run_t)
        block: list[int] = []
        inherited: tuple[int | None] | None = None
        if t <= last and t < cut:  # the first visit's spread (a new one makes it hand back)
            fp[kernel.F_SHARE] = share = spreads[c].share(a0, b0)
            st[kernel.S_SPREAD] = ids[c]
            runs.blocks.append((first_row, share, n, block))
        while True:
            code = kernel.idle_one(
                self.totals_array, self.after_array, self.then_array, ids, fp, ip, st,
                written, rows_t, rows_c, flips,
            )  # fmt: skip
            (t, c, change, written_at, changed_at, wrote, touched, writes, _, has_until,
             until_ms, _, _, rows, n_flips) = st.tolist()  # fmt: skip
            if rows:
                run_t.extend(rows_t[:rows].tolist())
                block.extend(rows_c[:rows].tolist())
            for at in flips[:n_flips].tolist():  # tracked, so n == 1
                cold = not cold
                if cold and sid0 not in cold_since:
                    if inherited is None:  # the layout fixes it for the whole run
                        inherited = (inherited_cold_since(layout, sid0, sealed_cold),)
                    since = inherited[0]
                    cold_since[sid0] = since if since is not None else at
                elif not cold and sid0 in cold_since:
                    del cold_since[sid0]
            if code != kernel.SPREAD:
                break
            fp[kernel.F_SHARE] = share = spreads[c].share(a0, b0)
            st[kernel.S_SPREAD] = ids[c]
            block = []
            runs.blocks.append((len(run_t), share, n, block))
        if wrote >= 0:
            w0, w1, w2, w3 = written.tolist()
        self._hand_back(
            segs,
            (w0, w1, w2, w3) if wrote >= 0 else rep0.written,  # type: ignore[arg-type]
            written_at,
            changed_at,
            bool(touched),
            wrote,
            stale_view,
        )
        return t, change, writes, len(run_t) - first_row, until_ms if has_until else None


def simulate(
    source: LoadSource,
    strategy: Strategy,
    reference: Rates,
    *,
    check_layout: bool = False,
    timeline_points: int = 2000,
    zoom_seconds: float = 6 * 3600.0,
    step_by_step: bool = False,
) -> SimResult:
    """Replay ``source`` under ``strategy``; see the module docstring.

    Args:
        reference: the split thresholds that stand for segment capacity in the metrics.
        check_layout: verify the layout invariants after every change (tests);
            raises :class:`controllerd.core.layout.LayoutError` on a violation.
        timeline_points: at most this many points in the result's timeline; 0 for
            neither a timeline nor a zoom (a run that plots nothing: a fleet's groups
            would bring ~12,000 values each to the driver).
        step_by_step: visit every step and decide at each (the reference the
            event-driven replay is tested against; much slower).
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
    enabled = policy.enabled
    track_cold = strategy.track_cold_since and enabled  # cold-since only feeds decide
    merge_limits = policy.merge_thresholds
    n_buckets = strategy.hash_buckets
    # A heartbeat first comes at the first step >= max_interval after the write.
    heartbeat_ms = 0
    if report.report_max_interval_seconds > 0:
        heartbeat_ms = math.ceil(report.report_max_interval_seconds * 1000.0 / step_ms) * step_ms
    ttl_ms = policy.load_ttl_seconds * 1000.0
    # Heartbeats only matter to decide through staleness; if a record cannot go stale
    # between two of them, the replay counts them instead of visiting them.
    lazy_heartbeats = heartbeat_ms > 0 and (ttl_ms <= 0 or heartbeat_ms - step_ms <= ttl_ms)
    hb_ms = report.report_max_interval_seconds * 1000.0
    gate = Gate(rule)
    use_history = policy.enabled and (
        observes_records(policy)
        or policy.merge_backoff_factor > 1.0
        or policy.merge_undo_seconds > 0
    )

    layout = initial_layout(strategy.initial_segments, now_ms=source.start_ms)
    reporters: dict[int, _Reporter] = {}
    cold_since: dict[int, int] = {}
    sealed_cold: dict[int, int] = {}  # cold-since of sealed segments, for their children
    view: dict[int, LoadSample] = {}
    # Segments whose view entry is behind their reporter: rebuilt only when decide reads
    # the view (building a record per write and per heartbeat was most of a visit's cost).
    stale_view: set[int] = set()
    history = TopicHistory()
    sealed: deque[tuple[int, int]] = deque()
    ops = _Ops()
    log: list[Operation] = []
    last_split: int | None = None
    last_merge: int | None = None
    runs = _Runs()
    splits = merges = children = writes = visited = 0
    peak = len(layout.active_segments())

    times = source.change_times()
    change = 0
    snap = source.snapshot(0)
    last = source.last_ms
    t = source.start_ms
    topic_of: tuple[object, float] = (None, 0.0)  # the last snapshot and its topic load
    dirty = True  # decide's inputs changed since its last NoAction
    seg_layout: Layout | None = None
    segs: list[tuple[int, int, int, _Reporter]] = []
    ranges: Ranges = ()
    wake: int | None = None  # next_decision_ms after that NoAction
    # may_act_now is False on the records as they are (no decide, GC or operation since):
    # decide answers NoAction until `ripe` (None: until a record changes), across writes
    # that keep every record on its side of each threshold
    waiting = False
    ripe: int | None = None  # with waiting: next_ripe_ms, when a pair could ripen
    fast = (
        _Idle(
            source,
            gate,
            policy,
            (r0, r1, r2, r3),
            step_ms=step_ms,
            heartbeat_ms=heartbeat_ms,
            hb_ms=hb_ms,
            lazy_heartbeats=lazy_heartbeats,
            track_cold=track_cold,
            n_buckets=n_buckets,
        )
        if not step_by_step
        and isinstance(source, SeriesLoad)
        and (lazy_heartbeats or (heartbeat_ms == 0 and ttl_ms <= 0))
        # it writes records without TopicHistory.observe, which must then see every one
        and not (enabled and observes_records(policy))
        else None
    )

    while t <= last:
        if waiting and fast is not None and layout is seg_layout:
            t, moved, added, made, ripens = fast.run(
                t,
                change,
                last,
                segs,
                layout,
                cold_since,
                sealed_cold,
                sealed,
                retention_ms,
                stale_view,
                runs,
                ripe,
            )
            if ripens is not None and ripens != ripe:  # new cold pairs: decide by then
                ripe = ripens
                wake = ripens if wake is None or ripens < wake else wake
            writes += added
            visited += made
            if moved != change:
                change = moved
                snap = source.snapshot(change)
            if t > last:
                break
        visited += 1
        if change + 1 < len(times) and times[change + 1] <= t:
            change = bisect.bisect_right(times, t, lo=change) - 1
            snap = source.snapshot(change)
        if layout is not seg_layout:  # the segments, their ranges and reporters, per layout
            seg_layout = layout
            segs = []
            for seg in layout.active_segments():
                rep = reporters.get(seg.segment_id)
                if rep is None:
                    rep = reporters[seg.segment_id] = _Reporter()
                segs.append((seg.segment_id, seg.hash_range.start, seg.hash_range.end, rep))
            ranges = tuple((a, b) for _, a, b, _ in segs)
        n = len(segs)

        # 1. measure the interval that just ended, on the layout that served it;
        # 2. reporters write material changes; 3. the controller tracks cold-since
        hottest = step_excess = step_msgs = 0.0
        above = 0
        for (sid, start, end, rep), (c0, c1, c2, c3) in zip(segs, snap.loads(ranges), strict=True):
            score = c0 / r0
            if (x := c1 / r1) > score:
                score = x
            if (x := c2 / r2) > score:
                score = x
            if (x := c3 / r3) > score:
                score = x
            if score > 1.0:
                above += 1
                step_excess += score - 1.0
                if c0 > r0:
                    step_msgs += c0 - r0
            if score > hottest:  # noqa: PLR1730 - not max(): this runs per segment per step
                hottest = score

            written = rep.written
            if written is None:
                reason: WriteReason | None = WriteReason.FIRST
            else:
                if lazy_heartbeats and not step_by_step and rep.written_at is not None:
                    # the heartbeats of the steps skipped since this reporter's last visit
                    due = (t - 1 - rep.written_at) // heartbeat_ms
                    if due > 0:
                        rep.written_at += due * heartbeat_ms
                        writes += due
                        stale_view.add(sid)
                if gate.quiet(written, c0, c1, c2, c3):
                    # no change worth a write (the common case): only a heartbeat can be due
                    reason = (
                        WriteReason.HEARTBEAT
                        if heartbeat_ms
                        and rep.written_at is not None
                        and t - rep.written_at >= hb_ms
                        else None
                    )
                else:
                    # Not quiet: should_write gives a reason other than a heartbeat
                    # (tested against it); which one does not matter here.
                    reason = WriteReason.MATERIAL_CHANGE
            if reason is None:
                touched = False
            elif reason is WriteReason.HEARTBEAT:
                rep.written_at = t
                writes += 1
                touched = True
            else:
                rep.written, rep.written_at, rep.changed_at = (c0, c1, c2, c3), t, t
                writes += 1
                touched = True
                if enabled:  # what decide reads; a disabled policy reads nothing
                    current = rep.rates = Rates(c0, c1, c2, c3)
                    if n_buckets:
                        rep.buckets = snap.buckets(start, end, n_buckets)
                    if use_history:
                        history.observe(sid, current, t, policy)
            if not enabled or rep.rates is None or rep.written_at is None:
                continue
            if track_cold:
                # The outcome only changes with the record or its staleness: the
                # event-driven replay skips the rest (the step-by-step one never does).
                stale = stale_at(rep.written_at, policy, t)
                if step_by_step or touched or stale is not rep.stale:
                    rep.stale = stale
                    cold = not stale and below(rep.rates, merge_limits)
                    if cold and sid not in cold_since:
                        inherited = inherited_cold_since(layout, sid, sealed_cold)
                        cold_since[sid] = (
                            inherited if inherited is not None else min(rep.changed_at, t)
                        )
                        touched = True
                    elif not stale and not cold and sid in cold_since:
                        del cold_since[sid]
                        touched = True
            if touched:
                dirty = True
                stale_view.add(sid)
        if snap is not topic_of[0]:
            c0, c1, c2, c3 = snap.total_load()
            topic_of = (snap, max(c0 / r0, c1 / r1, c2 / r2, c3 / r3))
        measure: Measure = (n, above, step_excess, step_msgs, hottest, topic_of[1])

        # 4. decide and apply; the new layout triggers another evaluation at once,
        # as its watch event does in the daemon (so a cooldown of 0 allows a second op)
        operated = False
        if (
            stale_view
            and enabled  # a disabled policy reads no records
            and (step_by_step or dirty or (wake is not None and t >= wake))
        ):
            # what etcd holds for these segments, as the controller reads it
            for sid in stale_view:
                rep = reporters[sid]
                if rep.rates is not None and rep.written_at is not None:
                    view[sid] = LoadSample(
                        rep.rates,
                        rep.changed_at,
                        rep.written_at,
                        cold_since.get(sid),
                        hash_buckets=rep.buckets,
                    )
            stale_view.clear()
        if not step_by_step and dirty and not may_act(layout, view, {}, policy):
            # may_act False: nothing can happen until a record changes
            dirty, wake, waiting, ripe = False, None, True, None
        if step_by_step or dirty or (wake is not None and t >= wake):
            waiting = False
            for _ in range(MAX_OPS_PER_STEP):
                seen = (
                    {sid: history.annotate(sid, s, t, policy) for sid, s in view.items()}
                    if use_history
                    else view
                )
                decision = decide(layout, seen, {}, policy, t, last_split, last_merge)
                if not isinstance(decision, Split | Merge):
                    dirty = False
                    if operated and not step_by_step:
                        # the next step is visited, and its new segments' first records
                        # make decide run again there: no wake-up time is needed
                        wake = None
                    elif not step_by_step:
                        wake = _wake(layout, seen, policy, t, last_split, last_merge, history)
                        waiting = fast is not None and not may_act_now(layout, seen, {}, policy, t)
                        if waiting:
                            ripe = next_ripe_ms(layout, seen, policy, t)
                    break
                operated = True
                if isinstance(decision, Split):
                    gone: tuple[int, ...] = (decision.segment_id,)
                    rng = layout.segments[decision.segment_id].hash_range
                    start, end = rng.start, rng.end
                    splits += 1
                    children += len(decision.boundaries) + 1
                    last_split = t
                else:
                    gone = (decision.a, decision.b)
                    start = layout.segments[decision.a].hash_range.start
                    end = layout.segments[decision.b].hash_range.end
                    merges += 1
                    children += 1
                    last_merge = t
                flipflop = ops.add(t, decision.action, start, end)
                before = layout
                layout = apply(layout, decision, now_ms=t)
                if use_history:
                    history.applied(before, decision, layout, t, policy, view)
                    history.forget(s.segment_id for s in layout.active_segments())
                log.append(
                    Operation(
                        t,
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
                    stale_view.discard(sid)
                    sealed.append((t, sid))
                peak = max(peak, log[-1].segments_after)
                if check_layout:
                    check(layout)

        # 5. GC: oldest first, so a segment's parents are always pruned before it
        if retention_ms >= 0 and sealed and t - sealed[0][0] >= retention_ms:
            due_ids = []
            while sealed and t - sealed[0][0] >= retention_ms:
                due_ids.append(sealed.popleft()[1])
            layout = prune(layout, due_ids)
            dirty, waiting = True, False  # merge depths may have changed
            if check_layout:
                check(layout)

        # Which step is the next that can differ from this one?
        if step_by_step or operated or dirty:  # dirty: GC changed what decide sees
            following = t + step_ms
        else:
            nxt = last + step_ms
            if change + 1 < len(times):
                nxt = min(nxt, times[change + 1])
            if heartbeat_ms and not lazy_heartbeats:
                for rep in reporters.values():
                    if rep.written_at is not None:
                        nxt = min(nxt, rep.written_at + heartbeat_ms)
            if wake is not None:
                nxt = min(nxt, wake)
            if retention_ms >= 0 and sealed:
                nxt = min(nxt, sealed[0][0] + math.ceil(retention_ms))
            following = t + max(1, -(-(nxt - t) // step_ms)) * step_ms
        runs.add(t, measure)
        t = following

    if lazy_heartbeats and not step_by_step:
        end_ms = source.start_ms + len_steps(source, step_ms) * step_ms
        for rep in reporters.values():
            if rep.written_at is not None and rep.written is not None:
                writes += max(0, (end_ms - 1 - rep.written_at) // heartbeat_ms)
    runs.close(last + step_ms, step_ms)
    return _result(
        runs,
        dt,
        step_ms,
        splits,
        merges,
        children,
        writes,
        ops.flipflops,
        peak,
        log,
        layout,
        timeline_points,
        zoom_seconds,
        visited,
        source.totals_array() if runs.blocks and isinstance(source, SeriesLoad) else None,
        (r0, r1, r2, r3),
    )


def len_steps(source: LoadSource, step_ms: int) -> int:
    """How many evaluation steps a replay of ``source`` has."""
    return (source.last_ms - source.start_ms) // step_ms + 1


def _wake(
    layout: Layout,
    seen: dict[int, LoadSample],
    policy: PolicySettings,
    now: int,
    last_split: int | None,
    last_merge: int | None,
    history: TopicHistory,
) -> int | None:
    """When ``decide`` must be asked again though nothing was written."""
    times = [
        x
        for x in (
            next_decision_ms(layout, seen, policy, now, last_split, last_merge),
            history.next_expiry_ms(now, policy),
        )
        if x is not None
    ]
    return min(times) if times else None


def _result(
    runs: _Runs,
    dt: float,
    step_ms: int,
    splits: int,
    merges: int,
    children: int,
    writes: int,
    flipflops: int,
    peak: int,
    log: list[Operation],
    layout: Layout,
    timeline_points: int,
    zoom_seconds: float,
    visited: int,
    change_totals: npt.NDArray[np.float64] | None,
    reference: RateTuple,
) -> SimResult:
    """The metrics, timeline and zoom of a replay's rows. ``change_totals``: the source's
    totals per change (:meth:`SeriesLoad.totals_array`), when the short path left blocks."""
    arrays = RunArrays.of(runs, change_totals, reference)
    totals = arrays.totals()
    metrics = Metrics(
        segment_hours=totals.segment_steps * dt / 3600.0,
        seconds_above_threshold=totals.above_steps * dt,
        excess_load=totals.excess * dt,
        splits=splits,
        merges=merges,
        flipflops=flipflops,
        peak_segments=max(peak, totals.max_segments),
        operations=splits + merges,
        children_created=children,
        mean_segments=totals.segment_steps / totals.steps if totals.steps else 0.0,
        topic_seconds_above_threshold=totals.topic_above * dt,
        longest_overload_seconds=totals.longest * dt,
        excess_messages=totals.excess_msgs * dt,
        late_excess_load=totals.late * dt,
        load_writes=writes,
        hours=totals.steps * dt / 3600.0,
    )
    if timeline_points <= 0:
        timeline = zoom = NO_TIMELINE
    else:
        timeline = arrays.downsample(step_ms, timeline_points)
        zoom = arrays.zoom(step_ms, zoom_seconds * 1000.0)
    return SimResult(metrics, log, timeline, zoom, layout, visited)


RISE_MS: Final = 3_600_000
"""The zoom centres on the steepest rise of the topic's load over this long
(:meth:`RunArrays.centre`)."""


RISE_FROM: Final = 0.5
"""...from a load below this (in split thresholds): a topic that light has merged down."""


def _block_measures(
    blocks: list[Block], totals: npt.NDArray[np.float64], reference: RateTuple
) -> npt.NDArray[np.float64]:
    """The measures of the blocks' rows, as the general loop takes them for ``n`` equal
    segments, bit for bit: a segment's load is each total times the share, its score the
    highest of the four over the reference's, and the excess adds up segment by segment
    (``n`` sums of one term, in order; not ``n`` times the term). Column by column: a
    maximum along a row of four is several times slower in numpy."""
    cs = np.fromiter(chain.from_iterable(b[3] for b in blocks), np.int64)
    sizes = [len(b[3]) for b in blocks]
    share = np.repeat(np.array([b[1] for b in blocks], dtype=np.float64), sizes)
    n = np.repeat(np.array([b[2] for b in blocks], dtype=np.int64), sizes)
    r0, r1, r2, r3 = reference
    t0, t1, t2, t3 = (totals[:, i][cs] for i in range(4))
    c0 = t0 * share
    score = np.maximum(
        np.maximum(c0 / r0, t1 * share / r1), np.maximum(t2 * share / r2, t3 * share / r3)
    )
    hot = score > 1.0
    gap, over = score - 1.0, c0 - r0
    heavy = hot & (c0 > r0)
    out = np.zeros((len(cs), 6))
    excess, msgs = out[:, 2], out[:, 3]
    for k in range(int(n.max()) if len(n) else 0):
        more = n > k
        np.add(excess, gap, out=excess, where=hot & more)
        np.add(msgs, over, out=msgs, where=heavy & more)
    out[:, 0] = n
    out[:, 1] = np.where(hot, n, 0)
    out[:, 4] = np.where(score > 0.0, score, 0.0)
    out[:, 5] = np.maximum(np.maximum(t0 / r0, t1 / r1), np.maximum(t2 / r2, t3 / r3))
    return out


@dataclass(frozen=True, slots=True)
class Totals:
    """What a replay's runs add up to, in steps; ``excess``, ``excess_msgs`` and ``late``
    in threshold-steps (msg/s-steps for ``excess_msgs``)."""

    steps: int
    segment_steps: int
    above_steps: int
    #: steps at which some segment was above its threshold
    topic_above: int
    #: the longest such spell
    longest: int
    max_segments: int
    excess: float
    excess_msgs: float
    #: excess beyond each spell's first step, which no policy can avoid
    late: float


@dataclass(frozen=True, slots=True)
class RunArrays:
    """A replay's runs as columns, for the passes over them once the replay is done.

    A month of 5-minute load is ~8,600 runs, and the three passes (totals,
    timeline, zoom) cost a fifth of a replay as Python loops; as array operations,
    with the short path's measures worked out here too, an eighth. Each result
    equals the plain loops' bit for bit (a test keeps those loops as its oracle):
    float sums add one term at a time in run order (``cumsum``, not the pairwise
    ``sum``), and a float times a count, an int over an int and a maximum round
    the same in both. Runs tile the steps: each starts where the one before
    ended, and none is empty.
    """

    t: npt.NDArray[np.int64]
    count: npt.NDArray[np.int64]
    #: the step index at which each run starts
    first: npt.NDArray[np.int64]
    segments: npt.NDArray[np.int64]
    above: npt.NDArray[np.int64]
    excess: npt.NDArray[np.float64]
    msgs: npt.NDArray[np.float64]
    hottest: npt.NDArray[np.float64]
    load: npt.NDArray[np.float64]

    @classmethod
    def of(
        cls,
        runs: _Runs,
        totals: npt.NDArray[np.float64] | None = None,
        reference: RateTuple = (1.0, 1.0, 1.0, 1.0),
    ) -> RunArrays:
        """The rows as runs: blocks measured, then consecutive equal rows merged (their
        steps added), as adding them one by one to the last equal run would."""
        t = np.array(runs.t, dtype=np.int64)
        count = np.asarray(runs.count, dtype=np.int64)
        if len(count) != len(t):
            raise ValueError("RunArrays.of: the rows are not closed (_Runs.close)")
        flat = chain.from_iterable(runs.measures)  # faster than from a list of tuples
        m = np.fromiter(flat, np.float64, 6 * len(runs.measures)).reshape(-1, 6)
        if runs.blocks:
            if totals is None:
                raise ValueError("RunArrays.of: blocks need the source's totals")
            inside = np.zeros(len(t), dtype=bool)
            rows = np.concatenate(
                [
                    np.arange(first, first + len(cs), dtype=np.int64)
                    for first, _, _, cs in runs.blocks
                ]
            )
            inside[rows] = True
            given = m
            m = np.empty((len(t), 6))
            m[~inside] = given
            m[rows] = _block_measures(runs.blocks, totals, reference)
        if len(t) > 1:
            same = m[1:, 0] == m[:-1, 0]  # column by column: faster than along rows
            for i in range(1, 6):
                same &= m[1:, i] == m[:-1, i]
            if same.any():
                starts = np.flatnonzero(np.concatenate(([True], ~same)))
                t, m, count = t[starts], m[starts], np.add.reduceat(count, starts)
        return cls(
            t,
            count,
            np.cumsum(count) - count,
            m[:, 0].astype(np.int64),
            m[:, 1].astype(np.int64),
            m[:, 2],
            m[:, 3],
            m[:, 4],
            m[:, 5],
        )

    def totals(self) -> Totals:
        count = self.count
        if not len(count):
            return Totals(0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0)
        hot = self.hottest > 1.0
        after_hot = np.concatenate(([False], hot[:-1]))
        before_hot = np.concatenate((hot[1:], [False]))
        # a spell's first step is not late: a hot run after a calm one counts a step less
        late = np.where(hot, self.excess * np.where(after_hot, count, count - 1), 0.0)
        hot_steps = np.where(hot, count, 0)
        through = np.cumsum(hot_steps)
        starts, ends = np.flatnonzero(hot & ~after_hot), np.flatnonzero(hot & ~before_hot)
        spells = through[ends] - through[starts] + hot_steps[starts]
        return Totals(
            steps=int(count.sum()),
            segment_steps=int((self.segments * count).sum()),
            above_steps=int((self.above * count).sum()),
            topic_above=int(through[-1]),
            longest=int(spells.max()) if len(spells) else 0,
            max_segments=int(self.segments.max()),
            excess=float(np.cumsum(self.excess * count)[-1]),
            excess_msgs=float(np.cumsum(self.msgs * count)[-1]),
            late=float(np.cumsum(late)[-1]),
        )

    def _steps(
        self, step_ms: int, first: int = 0, stop: int | None = None
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Runs ``first`` to ``stop``, one entry per step: each step's time and run."""
        count = self.count[first:stop]
        run = np.repeat(np.arange(first, first + len(count), dtype=np.int64), count)
        if not len(run):
            return run, run
        index = np.arange(self.first[first], self.first[first] + len(run), dtype=np.int64)
        return self.t[run] + (index - self.first[run]) * step_ms, run

    def _timeline(self, at: npt.NDArray[np.int64], run: npt.NDArray[np.int64]) -> Timeline:
        segments = self.segments[run]
        return Timeline(
            at.tolist(),
            self.load[run].tolist(),
            self.hottest[run].tolist(),
            segments.tolist(),
            segments.astype(np.float64).tolist(),
        )

    def expand(self, step_ms: int) -> Timeline:
        """Every step."""
        return self._timeline(*self._steps(step_ms))

    def downsample(self, step_ms: int, points: int) -> Timeline:
        """:func:`downsample` of :meth:`expand`, from the runs: a bucket's maxima are those
        of the runs it overlaps, its segment-steps a difference of running totals."""
        total = int(self.count.sum())
        size = max(1, math.ceil(total / max(1, points)))
        if size == 1:
            return self.expand(step_ms)
        starts = np.arange(0, total, size, dtype=np.int64)
        stops = np.minimum(starts + size, total)
        opening = np.searchsorted(self.first, starts, side="right") - 1
        closing = np.searchsorted(self.first, stops - 1, side="right") - 1
        before = np.cumsum(self.segments * self.count) - self.segments * self.count

        def segment_steps(step: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
            run = np.searchsorted(self.first, step, side="right") - 1
            steps: npt.NDArray[np.int64] = before[run] + self.segments[run] * (
                step - self.first[run]
            )
            return steps

        def peak(x: npt.NDArray[np.float64] | npt.NDArray[np.int64]) -> list[Any]:
            # runs opening[b] .. opening[b+1]-1, and the one that carries into bucket b+1
            peaks: list[Any] = np.maximum(np.maximum.reduceat(x, opening), x[closing]).tolist()
            return peaks

        return Timeline(
            (self.t[opening] + (starts - self.first[opening]) * step_ms).tolist(),
            peak(self.load),
            peak(self.hottest),
            peak(self.segments),
            ((segment_steps(stops) - segment_steps(starts)) / (stops - starts)).tolist(),
        )

    def centre(self, step_ms: int) -> int:
        """When the topic's load rose most within an hour from below :data:`RISE_FROM` (ties:
        the first); else the start of the trace. Where a quiet topic suddenly needs several
        segments is where the policies part ways; at the peak every variant has usually
        caught up long before, and a topic that is never quiet only differs at its start,
        where every policy begins from one segment.

        A run's rise is its load over the lowest load of the runs before it that end
        within the hour; that minimum over a sliding range comes from a sparse table
        (level ``k`` holds the minimum of each ``2**k`` runs)."""
        load = self.load
        ends = self.t + self.count * step_ms
        lo = np.searchsorted(ends, self.t - RISE_MS, side="right")
        width = np.arange(len(load), dtype=np.int64) - lo  # runs lo .. i-1 are the window
        level_of = np.frexp(width.astype(np.float64))[1] - 1  # floor(log2(width)); -1 if 0
        lowest = np.full(len(load), np.inf)
        level, k = load, 0
        while len(level) and (1 << k) <= width.max():
            pick = np.flatnonzero(level_of == k)
            lowest[pick] = np.minimum(level[lo[pick]], level[pick - (1 << k)])
            level = np.minimum(level[: -(1 << k)], level[(1 << k) :])
            k += 1
        rise = np.where(lowest < RISE_FROM, load - lowest, 0.0)
        best = int(np.argmax(rise)) if len(rise) else 0
        return int(self.t[best]) if len(rise) and rise[best] > 0.0 else int(self.t[0])

    def zoom(self, step_ms: int, span_ms: float) -> Timeline:
        """Full resolution within ``span_ms / 2`` of :meth:`centre`."""
        if not len(self.t):
            return Timeline([], [], [], [], [])
        centre = self.centre(step_ms)
        first = int(np.searchsorted(self.t, centre - span_ms / 2, side="right")) - 1
        stop = int(np.searchsorted(self.t, centre + span_ms / 2, side="right"))
        at, run = self._steps(step_ms, max(0, first), stop)
        keep = np.abs(at - centre) <= span_ms / 2
        return self._timeline(at[keep], run[keep])


def downsample(timeline: Timeline, points: int) -> Timeline:
    """At most ``points`` buckets of equal length, each keeping its maxima (and first time)
    and the mean segment count."""
    n = len(timeline.t_ms)
    size = max(1, math.ceil(n / max(1, points)))
    if size == 1:
        return timeline
    ts, load, hot, segs, means = [], [], [], [], []
    for i in range(0, n, size):
        j = min(n, i + size)
        ts.append(timeline.t_ms[i])
        load.append(max(timeline.load[i:j]))
        hot.append(max(timeline.hottest[i:j]))
        segs.append(max(timeline.segments[i:j]))
        means.append(sum(timeline.segments[i:j]) / (j - i))
    return Timeline(ts, load, hot, segs, means)
