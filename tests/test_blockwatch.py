"""The block watch names the code that holds the event loop, while it holds it."""

from __future__ import annotations

import time

from controllerd.daemon.blockwatch import BlockWatch


def hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # a synchronous call on the loop: what a stall is made of


async def test_a_blocked_loop_is_reported_once_with_the_code_that_blocks_it() -> None:
    reports: list[tuple[float, list[str]]] = []
    with BlockWatch(lambda age, stack: reports.append((age, stack)), threshold=0.1) as watch:
        watch.beat()
        hold_the_loop(0.5)
        watch.beat()
    held = [(age, stack) for age, stack in reports if any("hold_the_loop" in s for s in stack)]
    assert len(held) == 1, reports  # one report per stall, however long it lasts
    assert held[0][0] >= 0.1
