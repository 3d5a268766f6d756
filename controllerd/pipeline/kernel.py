"""The replay's one-segment short path, compiled (numba).

Most of a backtest's visits are idle visits of a layout whose segments all evolve
alike: one segment, or N equal static ones (:meth:`simulate._Idle._one`). Each such
visit scales the topic's totals, asks the report gate and records a row: about a
microsecond of interpreted Python, a quarter of the whole replay. The loop is
sequential (whether a visit writes depends on the record the last write left), so
numpy cannot take it; compiled, a visit costs tens of nanoseconds.

The kernel works on arrays and scalars only. It stops and hands back to Python for
a new spread (the segment's share is worked out by the
:class:`~controllerd.pipeline.load.Spread`); the times at which a record turned cold
or warm while cold-since is tracked it lists, for the caller to apply in order (an
inherited cold-since comes from the layout, which no visit here changes).

Invariant: every float operation is the interpreted loop's, in the same order, in
IEEE double precision without fast-math (no reassociation, no fused multiply-add),
so every metric stays bit-identical to the general loop and to the step-by-step
replay (the tests compare them).
"""

# ruff: noqa: PLR1730 - `if x > m: m = x`, not max(): the interpreted loop's exact steps

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt

#: Imported from a zip (the code shipped to a Spark cluster's executors, unpacked at a
#: new path each session), a disk cache would only pile up: each process compiles.
CACHED: Final = ".zip" + os.sep not in __file__


I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

# What the kernel answers: why it stopped.
DONE: Final = 0  #: past the last step, or at ``cut``
STOP: Final = 1  #: at a visit the general loop must make (a hot record, a ripe pair)
SPREAD: Final = 2  #: the spread changes at this visit: set ``F_SHARE`` and ``S_SPREAD``

# Float parameters (``fp``): the gate's limit, its split and merge thresholds, the
# policy's merge and split thresholds, the merge window, the heartbeat period and the
# segment's share of the current spread.
F_LIMIT: Final = 0
F_GATE_SPLIT: Final = 1
F_GATE_MERGE: Final = 5
F_MERGE: Final = 9
F_SPLIT: Final = 13
F_WINDOW: Final = 17
F_HEARTBEAT: Final = 18
F_SHARE: Final = 19
F_SIZE: Final = 20

# Integer parameters (``ip``); flags are 0 or 1.
P_LAST: Final = 0
P_STEP: Final = 1
P_HEARTBEAT: Final = 2
P_LAZY: Final = 3
P_CROSSING: Final = 4
P_ENABLED: Final = 5
P_COLD_STOPS: Final = 6
P_TRACK_COLD: Final = 7
P_SEGMENTS: Final = 8
P_SIZE: Final = 9

# State (``st``), read on entry and written back on return.
S_T: Final = 0  #: the next visit's time
S_C: Final = 1  #: the change that holds at it
S_CHANGE: Final = 2  #: the change of the last visit made
S_WRITTEN_AT: Final = 3
S_CHANGED_AT: Final = 4
S_WROTE: Final = 5  #: the change index of the last write, or -1
S_TOUCHED: Final = 6
S_WRITES: Final = 7
S_COLD: Final = 8
S_HAS_UNTIL: Final = 9
S_UNTIL: Final = 10
S_CUT: Final = 11
S_SPREAD: Final = 12  #: the spread id ``F_SHARE`` belongs to (-1: none yet)
S_ROWS: Final = 13  #: rows put in ``rows_t``/``rows_c`` by this call
S_FLIPS: Final = 14  #: times put in ``flips`` by this call
S_SIZE: Final = 15


def _moved(o: float, c: float, lim: float, crossing: bool, split: float, merge: float) -> bool:
    """One rate of :meth:`simulate.Gate.quiet`, negated: whether a change from ``o`` to
    ``c`` is material (a record is written)."""
    return o != c and (
        o == 0.0
        or c == 0.0
        or abs(c - o) > lim * abs(o)
        or (crossing and ((o > split) != (c > split) or (o < merge) != (c < merge)))
    )


def _idle_one(
    totals: F64,
    after: I64,
    then: I64,
    spread_id: I64,
    fp: F64,
    ip: I64,
    st: I64,
    written: F64,
    rows_t: I64,
    rows_c: I64,
    flips: I64,
) -> int:
    """Visit from ``st[S_T]`` until a visit needs Python or the general loop; record
    each visit made as a row (its time and change index), and each visit at which a
    tracked record turned cold or warm (its time), and answer why it stopped."""
    lim = fp[F_LIMIT]
    g0, g1, g2, g3 = fp[1], fp[2], fp[3], fp[4]
    h0, h1, h2, h3 = fp[5], fp[6], fp[7], fp[8]
    m0, m1, m2, m3 = fp[9], fp[10], fp[11], fp[12]
    s0, s1, s2, s3 = fp[13], fp[14], fp[15], fp[16]
    window_ms, hb_ms, share = fp[F_WINDOW], fp[F_HEARTBEAT], fp[F_SHARE]
    last, step_ms, heartbeat_ms = ip[P_LAST], ip[P_STEP], ip[P_HEARTBEAT]
    lazy, crossing, enabled = ip[P_LAZY] != 0, ip[P_CROSSING] != 0, ip[P_ENABLED] != 0
    cold_stops, track_cold, n = ip[P_COLD_STOPS] != 0, ip[P_TRACK_COLD] != 0, ip[P_SEGMENTS]
    t, c, change = st[S_T], st[S_C], st[S_CHANGE]
    written_at, changed_at, wrote = st[S_WRITTEN_AT], st[S_CHANGED_AT], st[S_WROTE]
    touched, writes, cold = st[S_TOUCHED], st[S_WRITES], st[S_COLD] != 0
    has_until, until, cut, sid = st[S_HAS_UNTIL] != 0, st[S_UNTIL], st[S_CUT], st[S_SPREAD]
    o0, o1, o2, o3 = written[0], written[1], written[2], written[3]
    rows = n_flips = 0
    code = DONE
    while t <= last:
        if t >= cut:
            break  # a GC changes the layout, or decide's answer may change with time
        if spread_id[c] != sid:
            code = SPREAD
            break
        c0, c1 = totals[c, 0] * share, totals[c, 1] * share
        c2, c3 = totals[c, 2] * share, totals[c, 3] * share
        w = written_at
        due = 0
        if lazy and t - w > heartbeat_ms:
            due = (t - 1 - w) // heartbeat_ms
            w += due * heartbeat_ms
        quiet = not (
            _moved(o0, c0, lim, crossing, g0, h0)
            or _moved(o1, c1, lim, crossing, g1, h1)
            or _moved(o2, c2, lim, crossing, g2, h2)
            or _moved(o3, c3, lim, crossing, g3, h3)
        )
        if quiet:
            if heartbeat_ms != 0 and t - w >= hb_ms:
                w = t
                writes += (due + 1) * n
                touched = 1
            elif due != 0:
                writes += due * n
                touched = 1
            written_at = w
        else:
            now_cold = c0 < m0 and c1 < m1 and c2 < m2 and c3 < m3
            if enabled and (c0 > s0 or c1 > s1 or c2 > s2 or c3 > s3):
                code = STOP  # a hot record: may_act_now
                break
            if enabled and now_cold and not cold and cold_stops:
                # n equal records turn cold together: they ripen when the window ends
                ripens = math.floor(t + window_ms)
                if ripens <= t:
                    code = STOP
                    break
                if not has_until or ripens < until:
                    has_until, until = True, ripens
                    cut = min(cut, until)
            writes += (due + 1) * n
            touched = 1
            o0, o1, o2, o3 = c0, c1, c2, c3
            written_at, changed_at, wrote = t, t, c
            if enabled and now_cold != cold:
                cold = now_cold
                if track_cold:
                    flips[n_flips] = t
                    n_flips += 1
        change = c
        following = after[c]
        if following > cut:  # the first step at or after it (cut > t here)
            following = t - (t - cut) // step_ms * step_ms
        rows_t[rows] = t
        rows_c[rows] = c
        rows += 1
        t, c = following, then[c]
    st[S_T], st[S_C], st[S_CHANGE] = t, c, change
    st[S_WRITTEN_AT], st[S_CHANGED_AT], st[S_WROTE] = written_at, changed_at, wrote
    st[S_TOUCHED], st[S_WRITES], st[S_COLD] = touched, writes, 1 if cold else 0
    st[S_HAS_UNTIL], st[S_UNTIL], st[S_CUT] = 1 if has_until else 0, until, cut
    st[S_ROWS], st[S_FLIPS] = rows, n_flips
    written[0], written[1], written[2], written[3] = o0, o1, o2, o3
    return code


# What :func:`idle_run` also answers.
EVENTS: Final = 3  #: the event buffer is full: apply the events, again

# Per-group integer columns (``gi``).
G_WRITTEN_AT: Final = 0
G_CHANGED_AT: Final = 1
G_WROTE: Final = 2  #: the change index of the group's last write in this run, or -1
G_TOUCHED: Final = 3
G_COLD: Final = 4
G_COUNT: Final = 5  #: segments in the group
G_INHERITED: Final = 6  #: tracked: 1 the segment inherits ``G_SINCE``, 2 it inherits none
G_SINCE: Final = 7
G_LISTED: Final = 8  #: whether the caller's cold-since holds the group's segment
G_KIND: Final = 9  #: this visit's pending change: -1 none, 0 heartbeats caught up,
G_AT: Final = 10  #: 1 and one at t, 2 a new record (loads in ``gf[G_LOADS:]``)
G_DUE: Final = 11
G_INT: Final = 12

# Per-group float columns (``gf``).
G_SHARE: Final = 0
G_WRITTEN: Final = 1  #: four columns: the record's rates
G_LOADS: Final = 5  #: four columns: this visit's new record
G_SCORE: Final = 9
G_FIRST: Final = 10  #: msg/s in at this visit
G_FLOAT: Final = 11

# Extra float parameters of :func:`idle_run`: the reference rates.
F_REFERENCE: Final = F_SIZE
F_RUN_SIZE: Final = F_SIZE + 4

# Extra integer parameters of :func:`idle_run`.
P_MERGING: Final = P_SIZE  #: more segments than the policy's minimum
P_APART: Final = P_SIZE + 1  #: one segment a group, in segment order
P_RUN_SIZE: Final = P_SIZE + 2

# State of :func:`idle_run` (``st``).
R_T: Final = 0
R_C: Final = 1
R_CHANGE: Final = 2
R_WRITES: Final = 3
R_VISITS: Final = 4
R_HAS_UNTIL: Final = 5
R_UNTIL: Final = 6
R_CUT: Final = 7
R_SPREAD: Final = 8
R_ROWS: Final = 9
R_EVENTS: Final = 10
R_SIZE: Final = 11

#: a cold-since event: (group, time, 1 listed / 0 removed)
EVENT_SIZE: Final = 3


def _idle_run(
    totals: F64,
    after: I64,
    then: I64,
    spread_id: I64,
    fp: F64,
    ip: I64,
    st: I64,
    gi: I64,
    gf: F64,
    group_of: I64,
    rows_t: I64,
    rows_c: I64,
    rows_above: I64,
    rows_f: F64,
    events: I64,
) -> int:
    """:meth:`simulate._Idle.run`'s visits for several groups of segments, from ``st[R_T]``.

    A visit is all or nothing: one that stops (a hot record, a pair ripe now, a share to
    work out) changes no state, and is made again on the next call. Each visit made is
    a row: its time, change index, segments above the reference, excess, excess msg/s
    and hottest segment (``rows_f``' three columns). Changes to the caller's cold-since
    are events, applied by the caller in order."""
    lim = fp[F_LIMIT]
    g0, g1, g2, g3 = fp[1], fp[2], fp[3], fp[4]
    h0, h1, h2, h3 = fp[5], fp[6], fp[7], fp[8]
    m0, m1, m2, m3 = fp[9], fp[10], fp[11], fp[12]
    s0, s1, s2, s3 = fp[13], fp[14], fp[15], fp[16]
    r0, r1, r2, r3 = fp[F_REFERENCE], fp[F_REFERENCE + 1], fp[F_REFERENCE + 2], fp[F_REFERENCE + 3]
    window_ms, hb_ms = fp[F_WINDOW], fp[F_HEARTBEAT]
    last, step_ms, heartbeat_ms = ip[P_LAST], ip[P_STEP], ip[P_HEARTBEAT]
    lazy, crossing, enabled = ip[P_LAZY] != 0, ip[P_CROSSING] != 0, ip[P_ENABLED] != 0
    track_cold, merging, apart = ip[P_TRACK_COLD] != 0, ip[P_MERGING] != 0, ip[P_APART] != 0
    t, c, change, writes, visits = st[R_T], st[R_C], st[R_CHANGE], st[R_WRITES], st[R_VISITS]
    has_until, until, cut, sid = st[R_HAS_UNTIL] != 0, st[R_UNTIL], st[R_CUT], st[R_SPREAD]
    ng = gi.shape[0]
    capacity = events.shape[0]
    rows = n_events = 0
    code = DONE
    while t <= last:
        if t >= cut:
            break  # a GC changes the layout, or decide's answer may change with time
        if spread_id[c] != sid:
            code = SPREAD
            break
        if n_events + ng > capacity:
            code = EVENTS
            break
        t0, t1, t2, t3 = totals[c, 0], totals[c, 1], totals[c, 2], totals[c, 3]
        stop = False
        visit_has_until = False
        visit_until = 0
        above = 0
        step_excess = step_msgs = hottest = 0.0
        for g in range(ng):
            sh = gf[g, G_SHARE]
            c0, c1, c2, c3 = t0 * sh, t1 * sh, t2 * sh, t3 * sh
            score = c0 / r0
            x = c1 / r1
            if x > score:
                score = x
            x = c2 / r2
            if x > score:
                score = x
            x = c3 / r3
            if x > score:
                score = x
            if apart:  # the groups are the segments, in order: measure them here
                if score > 1.0:
                    above += 1
                    step_excess += score - 1.0
                    if c0 > r0:
                        step_msgs += c0 - r0
                if score > hottest:
                    hottest = score
            else:
                gf[g, G_SCORE], gf[g, G_FIRST] = score, c0
            w = gi[g, G_WRITTEN_AT]
            due = 0
            if lazy and t - w > heartbeat_ms:
                due = (t - 1 - w) // heartbeat_ms
                w += due * heartbeat_ms
            gi[g, G_KIND] = -1
            if not (
                _moved(gf[g, G_WRITTEN], c0, lim, crossing, g0, h0)
                or _moved(gf[g, G_WRITTEN + 1], c1, lim, crossing, g1, h1)
                or _moved(gf[g, G_WRITTEN + 2], c2, lim, crossing, g2, h2)
                or _moved(gf[g, G_WRITTEN + 3], c3, lim, crossing, g3, h3)
            ):
                if heartbeat_ms != 0 and t - w >= hb_ms:
                    gi[g, G_KIND], gi[g, G_AT], gi[g, G_DUE] = 1, t, due
                elif due != 0:
                    gi[g, G_KIND], gi[g, G_AT], gi[g, G_DUE] = 0, w, due
                continue
            if enabled:
                if c0 > s0 or c1 > s1 or c2 > s2 or c3 > s3:
                    stop = True  # a hot record: may_act_now
                    code = STOP
                    break
                if merging and c0 < m0 and c1 < m1 and c2 < m2 and c3 < m3 and gi[g, G_COLD] == 0:
                    # a new cold record: no pair with it ripens before its window ends
                    since = t
                    if track_cold and gi[g, G_INHERITED] == 1:
                        since = gi[g, G_SINCE]
                    ripens = math.floor(since + window_ms)
                    if ripens <= t:
                        stop = True
                        code = STOP
                        break
                    if not visit_has_until or ripens < visit_until:
                        visit_has_until, visit_until = True, ripens
            gi[g, G_KIND], gi[g, G_AT], gi[g, G_DUE] = 2, t, due
            gf[g, G_LOADS], gf[g, G_LOADS + 1] = c0, c1
            gf[g, G_LOADS + 2], gf[g, G_LOADS + 3] = c2, c3
        if stop:
            break
        # commit the visit: the groups that wrote or caught up on heartbeats
        if visit_has_until and (not has_until or visit_until < until):
            has_until, until = True, visit_until
            cut = min(cut, until)
        change = c
        for g in range(ng):
            kind = gi[g, G_KIND]
            if kind < 0:
                continue
            gi[g, G_WRITTEN_AT] = gi[g, G_AT]
            writes += (gi[g, G_DUE] + (1 if kind > 0 else 0)) * gi[g, G_COUNT]
            gi[g, G_TOUCHED] = 1
            if kind == 2:
                l0, l1 = gf[g, G_LOADS], gf[g, G_LOADS + 1]
                l2, l3 = gf[g, G_LOADS + 2], gf[g, G_LOADS + 3]
                gf[g, G_WRITTEN], gf[g, G_WRITTEN + 1] = l0, l1
                gf[g, G_WRITTEN + 2], gf[g, G_WRITTEN + 3] = l2, l3
                gi[g, G_CHANGED_AT], gi[g, G_WROTE] = t, c
                if enabled:
                    is_cold = l0 < m0 and l1 < m1 and l2 < m2 and l3 < m3
                    gi[g, G_COLD] = 1 if is_cold else 0
                    if track_cold:
                        listed = gi[g, G_LISTED] != 0
                        if is_cold != listed:
                            events[n_events, 0], events[n_events, 1] = g, t
                            events[n_events, 2] = 1 if is_cold else 0
                            n_events += 1
                            gi[g, G_LISTED] = 1 if is_cold else 0
        if not apart:
            for i in range(group_of.shape[0]):  # segment order
                g = group_of[i]
                score = gf[g, G_SCORE]
                if score > 1.0:
                    above += 1
                    step_excess += score - 1.0
                    x = gf[g, G_FIRST]
                    if x > r0:
                        step_msgs += x - r0
                if score > hottest:
                    hottest = score
        visits += 1
        following = after[c]
        if following > cut:  # the first step at or after it (cut > t here)
            following = t - (t - cut) // step_ms * step_ms
        rows_t[rows], rows_c[rows], rows_above[rows] = t, c, above
        rows_f[rows, 0], rows_f[rows, 1], rows_f[rows, 2] = step_excess, step_msgs, hottest
        rows += 1
        t, c = following, then[c]
    st[R_T], st[R_C], st[R_CHANGE], st[R_WRITES], st[R_VISITS] = t, c, change, writes, visits
    st[R_HAS_UNTIL], st[R_UNTIL], st[R_CUT] = 1 if has_until else 0, until, cut
    st[R_ROWS], st[R_EVENTS] = rows, n_events
    return code


Kernel = Callable[..., int]

# Declared here, compiled on first use (:func:`__getattr__`).
idle_one: Kernel
idle_run: Kernel


def __getattr__(name: str) -> Kernel:
    """Compile the kernels when one is first asked for, and cache them on disk next to
    this file (or, where that is not writable, in the user's cache directory): about 6 s
    once per machine and version of this file, then 0.3 s a process to load. numba is
    imported only then (0.45 s), so a process that never replays does not pay for it."""
    if name not in ("idle_one", "idle_run"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from numba import njit

    jit = njit(cache=CACHED, nogil=True)
    module = globals()
    module["_moved"] = jit(_moved)  # before the kernels that call it are compiled
    module["idle_one"] = jit(_idle_one)
    module["idle_run"] = jit(_idle_run)
    kernel: Kernel = module[name]
    return kernel
