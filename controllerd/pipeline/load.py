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
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

from controllerd.core.model import HASH_MAX, HASH_SPACE, Rates

RateTuple = tuple[float, float, float, float]
TraceKind = Literal["series", "history"]
ZERO: Final[RateTuple] = (0.0, 0.0, 0.0, 0.0)


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

    def __post_init__(self) -> None:
        n = len(self.t_ms)
        if not (len(self.start) == len(self.end) == len(self.rates) == n):
            raise ValueError(f"trace {self.name}: columns differ in length")
        if n == 0:
            raise ValueError(f"trace {self.name}: no rows")
        if any(b < a for a, b in zip(self.t_ms, self.t_ms[1:], strict=False)):
            raise ValueError(f"trace {self.name}: timestamps go backwards")


@dataclass(frozen=True, slots=True)
class Skew:
    """How a series spreads over the hash space: ``uniform`` or ``zipf:S[:KEYS]``.

    Zipf: ``keys`` keys with weights ``1/rank**exponent``, each at a random hash
    value (seeded), so the hottest key carries ``1/H(keys, S)`` of the load and
    no split can divide it (DESIGN §8.7).
    """

    kind: Literal["uniform", "zipf"] = "uniform"
    exponent: float = 0.0
    keys: int = 1000

    @classmethod
    def parse(cls, text: str) -> Skew:
        parts = text.strip().lower().split(":")
        if parts == ["uniform"]:
            return cls()
        if parts[0] == "zipf" and len(parts) in (2, 3):
            try:
                exponent = float(parts[1])
                keys = int(parts[2]) if len(parts) == 3 else 1000
            except ValueError:
                pass
            else:
                if exponent >= 0 and keys >= 1:
                    return cls("zipf", exponent, keys)
        raise ValueError(f"skew {text!r}: expected 'uniform' or 'zipf:S[:KEYS]' (S >= 0)")

    def __str__(self) -> str:
        return "uniform" if self.kind == "uniform" else f"zipf:{self.exponent:g}:{self.keys}"


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


def spread_for(skew: Skew, seed: int, trace_name: str) -> Spread:
    """The spread for one trace; the same (skew, seed, name) always gives the same keys."""
    if skew.kind == "uniform":
        return UniformSpread()
    rng = random.Random(f"{seed}:{trace_name}")  # str seeds are stable across runs
    weights = [0.0] * HASH_SPACE
    for rank in range(1, skew.keys + 1):
        weights[rng.randrange(HASH_SPACE)] += 1.0 / rank**skew.exponent
    return KeySpread(weights)


class Snapshot(Protocol):
    """The load during one evaluation interval."""

    def rates(self, start: int, end: int) -> Rates:
        """The four rates of hash range ``[start, end]``."""
        ...

    def total(self) -> Rates:
        """The four rates of the whole topic."""
        ...


class LoadSource(Protocol):
    @property
    def start_ms(self) -> int: ...

    def snapshots(self, step_ms: int) -> Iterator[tuple[int, Snapshot]]:
        """``(t, load)`` at ``start_ms, start_ms + step_ms, ...`` up to the last row's time.

        A snapshot that did not change since the previous step is yielded again
        (the same object), so callers may compare by identity.
        """
        ...


@dataclass(slots=True)
class _SeriesSnapshot:
    totals: RateTuple
    spread: Spread
    _cache: dict[tuple[int, int], Rates] = field(default_factory=dict)

    def rates(self, start: int, end: int) -> Rates:
        key = (start, end)
        cached = self._cache.get(key)
        if cached is None:
            s = self.spread.share(start, end)
            t = self.totals
            cached = self._cache[key] = Rates(t[0] * s, t[1] * s, t[2] * s, t[3] * s)
        return cached

    def total(self) -> Rates:
        return Rates(*self.totals)


class SeriesLoad:
    """A topic total over time, spread over the hash space by a fixed :class:`Spread`."""

    def __init__(self, t_ms: Sequence[int], totals: Sequence[RateTuple], spread: Spread) -> None:
        self._t = t_ms
        self._totals = totals
        self._spread = spread

    @property
    def start_ms(self) -> int:
        return self._t[0]

    def snapshots(self, step_ms: int) -> Iterator[tuple[int, Snapshot]]:
        times, last = self._t, self._t[-1]
        row, t = -1, times[0]
        snap: _SeriesSnapshot | None = None
        while t <= last:
            current = bisect.bisect_right(times, t, lo=max(row, 0)) - 1
            if current != row or snap is None:
                row = current
                snap = _SeriesSnapshot(self._totals[row], self._spread)
            yield t, snap
            t += step_ms


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

    def total(self) -> Rates:
        return self.rates(0, HASH_MAX)


class HistoryLoad:
    """Recorded per-range load records replayed in time order (newest covering row wins)."""

    def __init__(self, trace: Trace) -> None:
        self._trace = trace

    @property
    def start_ms(self) -> int:
        return self._trace.t_ms[0]

    def snapshots(self, step_ms: int) -> Iterator[tuple[int, Snapshot]]:
        tr = self._trace
        pieces = _Pieces()
        n, row, t, last = len(tr.t_ms), 0, tr.t_ms[0], tr.t_ms[-1]
        snap: _HistorySnapshot | None = None
        while t <= last:
            changed = False
            while row < n and tr.t_ms[row] <= t:
                pieces.put(tr.start[row], tr.end[row], tr.rates[row])
                row, changed = row + 1, True
            if changed or snap is None:
                snap = _HistorySnapshot(pieces.copy())
            yield t, snap
            t += step_ms


def source_for(trace: Trace, skew: Skew, seed: int) -> LoadSource:
    """The replayable load of a trace; ``skew`` and ``seed`` apply to series only."""
    if trace.kind == "series":
        return SeriesLoad(trace.t_ms, trace.rates, spread_for(skew, seed, trace.name))
    return HistoryLoad(trace)
