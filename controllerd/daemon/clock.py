"""The one clock the daemon reads: wall time for load records, loop time for timers.

Decision code never reads a clock; the controller passes ``now_ms`` in. Tests
inject :class:`ManualClock` and advance it, so nothing waits for a real tick.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Protocol

import anyio


class Clock(Protocol):
    def now_ms(self) -> int:
        """Wall-clock epoch milliseconds (load records and layouts use them)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (scheduling)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Sleep on this clock's time."""
        ...


class SystemClock:
    """Real time: ``time.time`` for wall time, the event loop's clock for the rest."""

    def now_ms(self) -> int:
        return int(time.time() * 1000)

    def monotonic(self) -> float:
        return anyio.current_time()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(max(0.0, seconds))


class ManualClock:
    """A clock that moves only when told to; sleepers wake when it passes their deadline.

    Wall time and monotonic time advance together, so ``now_ms`` is
    ``start_ms + monotonic() * 1000``.
    """

    def __init__(self, start_ms: int = 1_760_000_000_000) -> None:
        self._start_ms = start_ms
        self._now = 0.0
        self._sleepers: list[tuple[float, int, anyio.Event]] = []
        self._seq = itertools.count()

    def now_ms(self) -> int:
        return self._start_ms + round(self._now * 1000)

    def monotonic(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await anyio.lowlevel.checkpoint()
            return
        event = anyio.Event()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), event))
        await event.wait()

    @property
    def sleepers(self) -> int:
        """How many tasks are asleep on this clock (tests wait for workers to park)."""
        return len(self._sleepers)

    async def advance(self, seconds: float) -> None:
        """Move time forward and let every sleeper whose deadline passed run."""
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            heapq.heappop(self._sleepers)[2].set()
        for _ in range(5):
            await anyio.lowlevel.checkpoint()
