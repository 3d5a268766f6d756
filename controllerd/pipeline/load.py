"""A topic's load over time and over the hash space, as the simulator replays it (pure).

Two shapes of input (:class:`Trace`):

* ``series`` — the whole topic's four rates over time (an imported time series).
  How they spread over the hash space is chosen at replay time (:class:`Skew`):
  uniformly, or over Zipf-distributed keys placed at random hash values.
* ``history`` — recorded load records: each row gives the rates of one hash
  range from its time on, until a later row covers that range (the recorder's
  Parquet, DESIGN §4). Rates are uniform within a recorded range.

Both are sampled with a zero-order hold: a value holds from its timestamp until
the next one. NAB's values are counts per 5 or 30 minutes, i.e. the mean rate
over that bucket; interpolating between buckets would invent ramps and shave
the very peaks the backtest is about.

A source lists the times its load changes (:meth:`LoadSource.change_times`),
so the simulator can jump from one change to the next instead of visiting
every evaluation step; :meth:`LoadSource.snapshots` gives the step-by-step view.
A snapshot also answers the reporters' histogram (``hashBuckets``): the load of
each of n equal slices of a range.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Final, Literal, Protocol

import numpy as np
import numpy.typing as npt

from controllerd.core.model import HASH_MAX, HASH_SPACE, Rates

RateTuple = tuple[float, float, float, float]
Ranges = tuple[tuple[int, int], ...]
TraceKind = Literal["series", "history"]
ZERO: Final[RateTuple] = (0.0, 0.0, 0.0, 0.0)
MAX_ZIPF_EXPONENT: Final = 20.0
"""Beyond this the hottest key carries all the load to within a float's precision anyway."""
MAX_ZIPF_KEYS: Final = 1_000_000
"""Keys are placed at random hash values (several may share one); this bounds the memory."""
MIN_MOVE_HOURS: Final = 1 / 60
"""A hot spot moves at most once a minute (the shortest evaluation interval worth replaying)."""
MAX_STAMP_MS: Final = 253_402_300_799_999
"""9999-12-31T23:59:59.999Z: times in traces and histories lie in 0..this (a calendar date)."""


@dataclass(frozen=True, slots=True)
class Trace:
    """One topic's load: the input of one backtest group (one trace x one variant).

    Invariants: all columns have the same length; ``t_ms`` is non-decreasing;
    ``0 <= start <= end <= 0xFFFF``. For ``series`` every row spans the whole
    hash space. Rows with equal times apply in order.
    """

    name: str
    kind: TraceKind
    t_ms: Sequence[int]
    start: Sequence[int]
    end: Sequence[int]
    rates: Sequence[RateTuple]
    #: history only: the recorded ``hashBuckets`` of each row (None: uniform over the range).
    buckets: Sequence[tuple[float, ...] | None] | None = None

    def __post_init__(self) -> None:
        n = len(self.t_ms)
        if not (len(self.start) == len(self.end) == len(self.rates) == n):
            raise ValueError(f"trace {self.name}: columns differ in length")
        if self.buckets is not None and len(self.buckets) != n:
            raise ValueError(f"trace {self.name}: columns differ in length")
        if n == 0:
            raise ValueError(f"trace {self.name}: no rows")
        if any(b < a for a, b in zip(self.t_ms, self.t_ms[1:], strict=False)):
            raise ValueError(f"trace {self.name}: timestamps go backwards")


@dataclass(frozen=True, slots=True)
class Skew:
    """How a series spreads over the hash space.

    * ``uniform``: every hash value carries the same load;
    * ``zipf:S[:KEYS]``: ``keys`` keys (default 1000) with weights ``1/rank**S``,
      each at a random hash value (seeded), so the hottest key carries
      ``1/H(keys, S)`` of the load and no split can divide it (DESIGN §8.7);
    * ``hotkey:SHARE``: one key at a random hash carries SHARE of the load, the
      rest is uniform;
    * ``hotspot:SHARE[:HOURS[:WIDTH]]``: a range WIDTH hashes wide (default 1024)
      carries SHARE of the load and moves to a new random place every HOURS
      (default 6), the rest is uniform: yesterday's good boundaries go stale.
    """

    kind: Literal["uniform", "zipf", "hotkey", "hotspot"] = "uniform"
    exponent: float = 0.0
    keys: int = 1000
    share: float = 0.0
    hours: float = 6.0
    width: int = 1024

    @classmethod
    def parse(cls, text: str) -> Skew:
        parts = text.strip().lower().split(":")
        try:
            if parts == ["uniform"]:
                return cls()
            if parts[0] == "zipf" and len(parts) in (2, 3):
                exponent = float(parts[1])
                keys = int(parts[2]) if len(parts) == 3 else 1000
                if 0 <= exponent <= MAX_ZIPF_EXPONENT and 1 <= keys <= MAX_ZIPF_KEYS:
                    return cls("zipf", exponent, keys)
            if parts[0] == "hotkey" and len(parts) == 2:
                share = float(parts[1])
                if 0 < share <= 1:
                    return cls("hotkey", share=share)
            if parts[0] == "hotspot" and 2 <= len(parts) <= 4:
                share = float(parts[1])
                hours = float(parts[2]) if len(parts) > 2 else 6.0
                width = int(parts[3]) if len(parts) > 3 else 1024
                moves = MIN_MOVE_HOURS <= hours < math.inf
                if 0 < share <= 1 and moves and 1 <= width <= HASH_SPACE:
                    return cls("hotspot", share=share, hours=hours, width=width)
        except ValueError:
            pass
        raise ValueError(
            f"skew {text!r}: expected 'uniform', 'zipf:S[:KEYS]' "
            f"(0 <= S <= {MAX_ZIPF_EXPONENT:g}, 1 <= KEYS <= {MAX_ZIPF_KEYS:,}), 'hotkey:SHARE' or "
            "'hotspot:SHARE[:HOURS[:WIDTH]]' (0 < SHARE <= 1, HOURS >= 1/60, "
            f"1 <= WIDTH <= {HASH_SPACE})"
        )

    def __str__(self) -> str:
        if self.kind == "zipf":
            return f"zipf:{self.exponent:g}:{self.keys}"
        if self.kind == "hotkey":
            return f"hotkey:{self.share:g}"
        if self.kind == "hotspot":
            return f"hotspot:{self.share:g}:{self.hours:g}:{self.width}"
        return "uniform"


class Spread(Protocol):
    def share(self, start: int, end: int) -> float:
        """Fraction of the topic's load in hash range ``[start, end]``."""
        ...


class UniformSpread:
    """Every hash value carries the same load."""

    def share(self, start: int, end: int) -> float:
        return (end - start + 1) / HASH_SPACE


class KeySpread:
    """Load concentrated on keys at hash values; ``share`` is O(1) from a cumulative table."""

    def __init__(self, weights_by_hash: Sequence[float]) -> None:
        if len(weights_by_hash) != HASH_SPACE:
            raise ValueError("one weight per hash value")
        total = sum(weights_by_hash)
        cumulative = [0.0] * (HASH_SPACE + 1)
        running = 0.0
        for h, w in enumerate(weights_by_hash):
            running += w / total
            cumulative[h + 1] = running
        self._cdf = cumulative

    def share(self, start: int, end: int) -> float:
        return self._cdf[end + 1] - self._cdf[start]


class SpotSpread:
    """Uniform, plus ``hot`` of the load spread evenly over ``[lo, lo + width - 1]``; O(1)."""

    def __init__(self, hot: float, lo: int, width: int) -> None:
        self._hot, self._lo, self._width = hot, lo, width
        self._hi = lo + width - 1

    def share(self, start: int, end: int) -> float:
        overlap = min(end, self._hi) - max(start, self._lo) + 1
        base = (1.0 - self._hot) * (end - start + 1) / HASH_SPACE
        return base + (self._hot * overlap / self._width if overlap > 0 else 0.0)


def spread_for(skew: Skew, seed: int, trace_name: str) -> Spread:
    """The spread for one trace; the same (skew, seed, name) always gives the same keys.

    For ``hotspot`` this is where the spot starts; :func:`spreads_over_time` moves it.
    """
    if skew.kind == "uniform":
        return UniformSpread()
    rng = random.Random(f"{seed}:{trace_name}")  # str seeds are stable across runs
    if skew.kind == "hotspot":
        return SpotSpread(skew.share, rng.randrange(HASH_SPACE - skew.width + 1), skew.width)
    weights = [0.0] * HASH_SPACE
    if skew.kind == "hotkey":
        weights = [(1.0 - skew.share) / HASH_SPACE] * HASH_SPACE
        weights[rng.randrange(HASH_SPACE)] += skew.share
        return KeySpread(weights)
    for rank in range(1, skew.keys + 1):
        weights[rng.randrange(HASH_SPACE)] += 1.0 / rank**skew.exponent
    return KeySpread(weights)


def spreads_over_time(
    skew: Skew, seed: int, trace_name: str, start_ms: int, last_ms: int
) -> tuple[list[int], list[Spread]]:
    """(times, spreads): spread i holds from times[i]; one entry unless the spot moves."""
    first = spread_for(skew, seed, trace_name)
    if skew.kind != "hotspot":
        return [start_ms], [first]
    rng = random.Random(f"{seed}:{trace_name}:moves")
    period = max(1, round(skew.hours * 3_600_000))
    times, spreads = [start_ms], [first]
    t = start_ms + period
    while t <= last_ms:
        times.append(t)
        spreads.append(
            SpotSpread(skew.share, rng.randrange(HASH_SPACE - skew.width + 1), skew.width)
        )
        t += period
    return times, spreads


class Snapshot(Protocol):
    """The load during one evaluation interval."""

    def rates(self, start: int, end: int) -> Rates:
        """The four rates of hash range ``[start, end]``."""
        ...

    def loads(self, ranges: Ranges) -> list[RateTuple]:
        """:meth:`rates` of each range as plain tuples, equal to them: what the replay asks
        at every visited step. The same ``ranges`` object may be passed again while the
        layout holds."""
        ...

    def total(self) -> Rates:
        """The four rates of the whole topic."""
        ...

    def total_load(self) -> RateTuple:
        """:meth:`total` as a plain tuple."""
        ...

    def buckets(self, start: int, end: int, n: int) -> tuple[float, ...]:
        """msgRateIn of each of the n slices of ``[start, end]`` (the ``hashBuckets`` format)."""
        ...


def slice_bounds(start: int, end: int, n: int) -> list[tuple[int, int]]:
    """The n slices of ``[start, end]`` as the ``hashBuckets`` wire format cuts them
    (slice i: ``[start + (i*W)//n, start + ((i+1)*W)//n - 1]``; empty when W < n)."""
    width = end - start + 1
    return [(start + (i * width) // n, start + ((i + 1) * width) // n - 1) for i in range(n)]


class LoadSource(Protocol):
    @property
    def start_ms(self) -> int: ...

    @property
    def last_ms(self) -> int:
        """The last row's time: replay ends at the last step at or before it."""
        ...

    def change_times(self) -> Sequence[int]:
        """Ascending times at which the load changes; the first is ``start_ms``."""
        ...

    def snapshot(self, index: int) -> Snapshot:
        """The load from ``change_times()[index]`` on. Calls must not go backwards."""
        ...

    def snapshots(self, step_ms: int) -> Iterator[tuple[int, Snapshot]]:
        """``(t, load)`` at ``start_ms, start_ms + step_ms, ...`` up to the last row's time.

        A snapshot that did not change since the previous step is yielded again
        (the same object), so callers may compare by identity.
        """
        ...


def _steps(source: LoadSource, step_ms: int) -> Iterator[tuple[int, Snapshot]]:
    times, last = source.change_times(), source.last_ms
    index, t = 0, source.start_ms
    snap = source.snapshot(0)
    while t <= last:
        moved = index
        while moved + 1 < len(times) and times[moved + 1] <= t:
            moved += 1
        if moved != index:
            index = moved
            snap = source.snapshot(index)
        yield t, snap
        t += step_ms


class _ShareMemo:
    """The shares of the last (spread, ranges) pair asked: both change far less often
    than the totals (a layout holds across many changes of the load)."""

    __slots__ = ("ranges", "shares", "spread")

    def __init__(self) -> None:
        self.spread: Spread | None = None
        self.ranges: Ranges | None = None
        self.shares: list[float] = []


@dataclass(slots=True)
class _SeriesSnapshot:
    totals: RateTuple
    spread: Spread
    memo: _ShareMemo = field(default_factory=_ShareMemo)
    _cache: dict[tuple[int, int], Rates] = field(default_factory=dict)

    def rates(self, start: int, end: int) -> Rates:
        key = (start, end)
        cached = self._cache.get(key)
        if cached is None:
            share = self.spread.share(start, end)
            cached = self._cache[key] = Rates(*_scaled(self.totals, share))
        return cached

    def loads(self, ranges: Ranges) -> list[RateTuple]:
        memo = self.memo
        if ranges is not memo.ranges or self.spread is not memo.spread:
            share = self.spread.share
            memo.spread, memo.ranges = self.spread, ranges
            memo.shares = [share(a, b) for a, b in ranges]
        t0, t1, t2, t3 = self.totals  # _scaled, inline: this runs at every visited step
        return [(t0 * s, t1 * s, t2 * s, t3 * s) for s in memo.shares]

    def total(self) -> Rates:
        return Rates(*self.totals)

    def total_load(self) -> RateTuple:
        return self.totals

    def buckets(self, start: int, end: int, n: int) -> tuple[float, ...]:
        msgs, share = self.totals[0], self.spread.share
        return tuple(msgs * share(a, b) if b >= a else 0.0 for a, b in slice_bounds(start, end, n))


class SeriesLoad:
    """A topic total over time, spread over the hash space by a :class:`Spread` (which may
    move at given times).

    A replay only reads it, and what it keeps (change lists, the topic's load, shares)
    is the same for every reader: every variant of a trace may replay on one."""

    def __init__(
        self,
        t_ms: Sequence[int],
        totals: Sequence[RateTuple],
        spread: Spread,
        moves: tuple[Sequence[int], Sequence[Spread]] | None = None,
    ) -> None:
        self._t = t_ms
        self._totals = totals
        spread_times, spreads = moves if moves is not None else ([t_ms[0]], [spread])
        # One change per row time and per move at which the (totals, spread) differ from
        # before: a row repeating the previous values changes nothing.
        self._times: list[int] = []
        self._rows: list[int] = []
        self._spreads: list[Spread] = []
        self._memo = _ShareMemo()
        self._changes: tuple[list[RateTuple], list[Spread]] | None = None
        self._topic: dict[RateTuple, list[float]] = {}
        self._totals_array: npt.NDArray[np.float64] | None = None
        self._visits: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = {}
        self._spread_ids: npt.NDArray[np.int64] | None = None
        self.uniform = all(isinstance(s, UniformSpread) for s in spreads)
        row = move = 0  # the last row and move at or before t (both lists are sorted)
        n_rows, n_moves = len(t_ms), len(spread_times)
        if n_moves == 1 and spread_times[0] <= t_ms[0]:
            self._rows_of(spreads[0])
            return
        for t in sorted({*t_ms, *spread_times}):
            if not t_ms[0] <= t <= t_ms[-1]:
                continue
            while row + 1 < n_rows and t_ms[row + 1] <= t:
                row += 1
            while move + 1 < n_moves and spread_times[move + 1] <= t:
                move += 1
            spread_now = spreads[move]
            if (
                self._rows
                and totals[row] == totals[self._rows[-1]]
                and (spread_now is self._spreads[-1])
            ):
                continue
            self._times.append(t)
            self._rows.append(row)
            self._spreads.append(spread_now)

    def _rows_of(self, spread: Spread) -> None:
        """The changes when one spread holds throughout: one per row time whose last row
        differs from the last kept (as the general loop finds them, in one pass)."""
        t_ms, totals = self._t, self._totals
        times, rows = self._times, self._rows
        kept: RateTuple | None = None
        last = len(t_ms) - 1
        for i, t in enumerate(t_ms):
            if i < last and t_ms[i + 1] == t:
                continue  # a later row at the same time wins
            if (here := totals[i]) != kept:
                kept = here
                times.append(t)
                rows.append(i)
        self._spreads = [spread] * len(times)
        self._spread_ids = np.zeros(len(times), dtype=np.int64)

    @property
    def start_ms(self) -> int:
        return self._t[0]

    @property
    def last_ms(self) -> int:
        return self._t[-1]

    def change_times(self) -> Sequence[int]:
        return self._times

    def changes(self) -> tuple[list[RateTuple], list[Spread]]:
        """The totals and the spread from each change time on: what :meth:`snapshot` of
        that index holds, for a caller that computes a range's load itself (as
        ``(t0 * s, t1 * s, t2 * s, t3 * s)`` with ``s = spread.share(start, end)``,
        bit for bit :meth:`Snapshot.loads`). Kept: every variant replayed on this source
        asks, and the lists are read only."""
        if self._changes is None:
            self._changes = ([self._totals[r] for r in self._rows], self._spreads)
        return self._changes

    def totals_array(self) -> npt.NDArray[np.float64]:
        """:meth:`changes`' totals as one row per change (kept)."""
        if self._totals_array is None:
            totals = self.changes()[0]
            flat = np.fromiter(chain.from_iterable(totals), np.float64, 4 * len(totals))
            self._totals_array = flat.reshape(-1, 4)
        return self._totals_array

    def topic_loads(self, reference: RateTuple) -> list[float]:
        """The topic's load from each change on in units of ``reference``: the highest of
        its four rates over the reference's, as ``max(t0 / r0, ..., t3 / r3)`` gives it bit
        for bit (IEEE division and maximum round alike in numpy). Kept per reference."""
        loads = self._topic.get(reference)
        if loads is None:
            ratios = self.totals_array() / np.array(reference, dtype=np.float64)
            loads = self._topic[reference] = np.max(ratios, axis=1).tolist()
        return loads

    def next_visits(self, step_ms: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """For a replay that steps by ``step_ms`` from :attr:`start_ms` and visits a step
        when the load changed: after a visit at which change ``c`` holds, the next visit
        is at ``after[c]`` (the first step at or after change ``c + 1``; past the last
        step, ``last_ms + step_ms`` rounded up to a step, when there is none), and change
        ``then[c]`` holds there. Kept per step."""
        arrays = self._visits.get(step_ms)
        if arrays is None:
            start, end = self.start_ms, self.last_ms + step_ms
            times = np.array(self._times, dtype=np.int64)
            upcoming = np.append(times[1:], end)
            upcoming[upcoming >= end] = end
            after = start - (start - upcoming) // step_ms * step_ms  # rounded up to a step
            then = (np.searchsorted(times, after, side="right") - 1).astype(np.int64)
            arrays = self._visits[step_ms] = (after, then)
        return arrays

    def spread_ids(self) -> npt.NDArray[np.int64]:
        """For each change, a number for its spread object: equal numbers exactly for the
        same object (a replay asks a spread for a share when the object changes). Kept."""
        if self._spread_ids is None:
            number: dict[int, int] = {}  # id() is stable: self._spreads keeps them alive
            self._spread_ids = np.fromiter(
                (number.setdefault(id(s), len(number)) for s in self._spreads),
                np.int64,
                len(self._spreads),
            )
        return self._spread_ids

    def snapshot(self, index: int) -> Snapshot:
        return _SeriesSnapshot(self._totals[self._rows[index]], self._spreads[index], self._memo)

    def snapshots(self, step_ms: int) -> Iterator[tuple[int, Snapshot]]:
        return _steps(self, step_ms)


class _Pieces:
    """Non-overlapping hash ranges with uniform load; a put overwrites what it covers."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.rates: list[RateTuple] = []

    def copy(self) -> _Pieces:
        other = _Pieces()
        other.starts, other.ends, other.rates = list(self.starts), list(self.ends), list(self.rates)
        return other

    def put(self, start: int, end: int, rates: RateTuple) -> None:
        """Set ``[start, end]`` to ``rates``; pieces it cuts keep their density outside it."""
        i = bisect.bisect_left(self.ends, start)  # first piece ending at or after start
        j = i
        left: tuple[int, int, RateTuple] | None = None
        right: tuple[int, int, RateTuple] | None = None
        while j < len(self.starts) and self.starts[j] <= end:
            s, e, q = self.starts[j], self.ends[j], self.rates[j]
            width = e - s + 1
            if s < start:
                left = (s, start - 1, _scaled(q, (start - s) / width))
            if e > end:
                right = (end + 1, e, _scaled(q, (e - end) / width))
            j += 1
        new = [p for p in (left, (start, end, rates), right) if p is not None]
        self.starts[i:j] = [p[0] for p in new]
        self.ends[i:j] = [p[1] for p in new]
        self.rates[i:j] = [p[2] for p in new]

    def put_histogram(
        self, start: int, end: int, rates: RateTuple, buckets: Sequence[float]
    ) -> None:
        """Set ``[start, end]`` to ``rates`` spread as the recorded histogram says; uniformly
        when it gives no proportions (all zero, or a sum too large for a double, as the
        planner treats it)."""
        total = sum(buckets)
        if not 0.0 < total < math.inf:
            self.put(start, end, rates)
            return
        carry = 0.0
        pending: list[tuple[int, int, float]] = []
        for (a, b), weight in zip(slice_bounds(start, end, len(buckets)), buckets, strict=True):
            if b < a:
                carry += weight
                continue
            pending.append((a, b, weight + carry))
            carry = 0.0
        if carry and pending:
            a, b, w = pending[-1]
            pending[-1] = (a, b, w + carry)
        for a, b, weight in pending:
            self.put(a, b, _scaled(rates, weight / total))

    def query(self, start: int, end: int) -> RateTuple:
        i = bisect.bisect_left(self.ends, start)
        a = b = c = d = 0.0
        while i < len(self.starts) and self.starts[i] <= end:
            s, e, q = self.starts[i], self.ends[i], self.rates[i]
            f = (min(e, end) - max(s, start) + 1) / (e - s + 1)
            a, b, c, d = a + q[0] * f, b + q[1] * f, c + q[2] * f, d + q[3] * f
            i += 1
        return (a, b, c, d)


def _scaled(q: RateTuple, f: float) -> RateTuple:
    return (q[0] * f, q[1] * f, q[2] * f, q[3] * f)


@dataclass(slots=True)
class _HistorySnapshot:
    pieces: _Pieces
    _cache: dict[tuple[int, int], Rates] = field(default_factory=dict)

    def rates(self, start: int, end: int) -> Rates:
        key = (start, end)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._cache[key] = Rates(*self.pieces.query(start, end))
        return cached

    def loads(self, ranges: Ranges) -> list[RateTuple]:
        query = self.pieces.query
        return [query(a, b) for a, b in ranges]

    def total(self) -> Rates:
        return self.rates(0, HASH_MAX)

    def total_load(self) -> RateTuple:
        return self.pieces.query(0, HASH_MAX)

    def buckets(self, start: int, end: int, n: int) -> tuple[float, ...]:
        query = self.pieces.query
        return tuple(query(a, b)[0] if b >= a else 0.0 for a, b in slice_bounds(start, end, n))


class HistoryLoad:
    """Recorded per-range load records replayed in time order (newest covering row wins)."""

    def __init__(self, trace: Trace) -> None:
        self._trace = trace
        self._times = _history_changes(trace)
        self._pieces = _Pieces()
        self._row = 0
        self._index = -1
        self._snap: _HistorySnapshot | None = None

    @property
    def start_ms(self) -> int:
        return self._trace.t_ms[0]

    @property
    def last_ms(self) -> int:
        return self._trace.t_ms[-1]

    def change_times(self) -> Sequence[int]:
        return self._times

    def snapshot(self, index: int) -> Snapshot:
        if index < self._index:
            raise ValueError("history snapshots must be read in time order")
        if index != self._index or self._snap is None:
            tr, t = self._trace, self._times[index]
            while self._row < len(tr.t_ms) and tr.t_ms[self._row] <= t:
                _put_row(self._pieces, tr, self._row)
                self._row += 1
            self._index = index
            self._snap = _HistorySnapshot(self._pieces.copy())
        return self._snap

    def snapshots(self, step_ms: int) -> Iterator[tuple[int, Snapshot]]:
        return _steps(HistoryLoad(self._trace), step_ms)


def _put_row(pieces: _Pieces, trace: Trace, row: int) -> None:
    hist = trace.buckets[row] if trace.buckets is not None else None
    if hist:
        pieces.put_histogram(trace.start[row], trace.end[row], trace.rates[row], hist)
    else:
        pieces.put(trace.start[row], trace.end[row], trace.rates[row])


def _history_changes(trace: Trace) -> list[int]:
    """The row times after which the load differs from before (a recorder records every
    heartbeat, and a heartbeat re-puts what is there)."""
    pieces = _Pieces()
    times: list[int] = []
    row, n = 0, len(trace.t_ms)
    while row < n:
        t = trace.t_ms[row]
        before = (list(pieces.starts), list(pieces.ends), list(pieces.rates))
        while row < n and trace.t_ms[row] == t:
            _put_row(pieces, trace, row)
            row += 1
        if not times or before != (pieces.starts, pieces.ends, pieces.rates):
            times.append(t)
    return times


def source_for(trace: Trace, skew: Skew, seed: int) -> LoadSource:
    """The replayable load of a trace; ``skew`` and ``seed`` apply to series only."""
    if trace.kind == "series":
        moves = spreads_over_time(skew, seed, trace.name, trace.t_ms[0], trace.t_ms[-1])
        return SeriesLoad(trace.t_ms, trace.rates, moves[1][0], moves)
    return HistoryLoad(trace)
