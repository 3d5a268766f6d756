"""Keeps background work to a share of the event loop (issue #12).

The follower reads one watch message per turn of the event loop. A full tick
over 10,000 topics used to put 16 background evaluations in every turn, so
for its ~3 s the follower fell seconds behind a 5,000 writes/s load storm, and
a consumer registration waited behind it: reaction p99 0.7-1.5 s, against
60 ms outside the tick. Background work (the tick's pass, a term's first pass,
the GC round) now spends from a token bucket and waits when it is empty, so
the follower and urgent evaluations keep the rest of the loop. It waits only
while something else wants the loop; on an idle loop a pass runs at full speed.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel


class Pacer:
    """A token bucket over real time: background work may use ``share`` of it.

    Credit accrues at ``share`` seconds per elapsed second, up to ``burst``;
    :meth:`charge` spends what a piece of work cost, and :meth:`turn` waits while
    the credit is negative. Invariant: over any span of T seconds, the work
    charged is at most ``share * T + burst`` plus one piece's cost. Costs are read
    from ``now`` (real time by default, not the injected clock: they measure the
    CPU this machine took, and a :class:`ManualClock` that only moves when a test
    says so would park the pass for ever).

    Work-conserving: a turn waits only while ``contended()`` says something else
    wants the loop (the controller: watch events applied in the last few
    milliseconds, or urgent evaluations queued); otherwise the debt is forgiven
    and a pass on an idle loop runs at full speed. Contended, a pass takes at
    most ``1 / share`` times as long as unpaced.
    """

    def __init__(
        self,
        share: float,
        burst: float,
        *,
        now: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        on_wait: Callable[[float], None] = lambda seconds: None,
        contended: Callable[[], bool] = lambda: True,
    ) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], not {share!r}")
        if burst <= 0.0:
            raise ValueError(f"burst must be > 0, not {burst!r}")
        self.share = share
        self.burst = burst
        self.now = now
        self._sleep = sleep
        self._credit = burst
        self._last = now()
        self._on_wait = on_wait
        self._contended = contended

    def _refill(self, spent: float = 0.0) -> None:
        at = self.now()
        # What accrued while the work ran counts before the cap: the work was part of it.
        accrued = (at - self._last) * self.share
        self._credit = min(self.burst, self._credit + accrued - spent)
        self._last = at

    def charge(self, seconds: float) -> None:
        """Spend ``seconds`` of work."""
        self._refill(max(0.0, seconds))

    async def turn(self) -> None:
        """Yield to the loop; wait first while the credit is negative and the loop
        is contended."""
        self._refill()
        if self._credit < 0.0 and not self._contended():
            self._credit = 0.0
        if self._credit >= 0.0:
            await anyio.lowlevel.checkpoint()
            return
        wait = -self._credit / self.share
        self._on_wait(wait)
        await self._sleep(wait)
        self._refill()
        # The wait paid the debt; a float hair left (or a sleep ended a hair early)
        # must not become a loop of ever smaller waits.
        self._credit = max(self._credit, 0.0)

    async def pause(self, since: float) -> float:
        """Charge the work done since ``since`` (a :attr:`now` reading), take a
        turn, and return the reading to pass next time."""
        self.charge(self.now() - since)
        await self.turn()
        return self.now()
