"""The pacer keeps background work to its share of the loop, on a clock the test moves."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controllerd.daemon.pacer import Pacer


class Time:
    """Time that moves only when work is done (``work``) or the pacer sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def read(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        await anyio.lowlevel.checkpoint()


def paced(
    t: Time, share: float = 0.5, burst: float = 0.005, busy: list[bool] | None = None
) -> tuple[Pacer, list[float]]:
    waits: list[float] = []
    contended = (lambda: busy[0]) if busy is not None else (lambda: True)
    pacer = Pacer(
        share, burst, now=t.read, sleep=t.sleep, on_wait=waits.append, contended=contended
    )
    return pacer, waits


async def test_work_within_the_burst_takes_its_turn_at_once() -> None:
    t = Time()
    pacer, waits = paced(t)
    t.now += 0.004
    pacer.charge(0.004)
    await pacer.turn()
    assert t.slept == [] and waits == []


async def test_work_beyond_the_burst_waits_until_the_share_is_restored() -> None:
    t = Time()
    pacer, waits = paced(t, share=0.5, burst=0.005)
    t.now += 0.010  # 10 ms of work: 5 ms accrued meanwhile, 5 ms of burst, so credit -0
    pacer.charge(0.010)
    await pacer.turn()
    assert t.slept == []
    t.now += 0.010  # 10 ms more: credit -5 ms, restored by 10 ms at share 0.5
    pacer.charge(0.010)
    await pacer.turn()
    assert t.slept == pytest.approx([0.010])
    assert waits == pytest.approx([0.010])


async def test_pause_charges_the_work_since_the_mark() -> None:
    t = Time()
    pacer, _ = paced(t, share=0.25, burst=0.001)
    mark = pacer.now()
    t.now += 0.005
    mark = await pacer.pause(mark)
    # 5 ms of work, 1.25 ms accrued + 1 ms of burst: 2.75 ms short, 11 ms at 0.25
    assert t.slept == pytest.approx([0.011])
    assert mark == pytest.approx(0.016)


async def test_on_an_idle_loop_the_debt_is_forgiven_and_nothing_waits() -> None:
    t = Time()
    busy = [False]
    pacer, waits = paced(t, share=0.5, burst=0.005, busy=busy)
    for _ in range(10):  # 50 ms of work back to back: nobody else wants the loop
        t.now += 0.005
        pacer.charge(0.005)
        await pacer.turn()
    assert waits == []
    busy[0] = True  # watch events arrive: from now on the share holds
    for _ in range(4):
        t.now += 0.005
        pacer.charge(0.005)
        await pacer.turn()
    assert waits == pytest.approx([0.005] * 4)  # the forgiven debt left no burst: 50 %


@settings(max_examples=200, deadline=None)
@given(
    share=st.floats(0.05, 1.0),
    burst=st.floats(0.0005, 0.05),
    costs=st.lists(st.floats(0.0, 0.02), min_size=1, max_size=60),
)
def test_work_never_exceeds_its_share_plus_one_burst(
    share: float, burst: float, costs: list[float]
) -> None:
    """Invariant: charged work <= share * elapsed + burst + the last piece's cost."""

    async def run() -> None:
        t = Time()
        pacer, _ = paced(t, share=share, burst=burst)
        done = 0.0
        for cost in costs:
            await pacer.turn()
            assert done <= share * t.now + burst + 1e-9
            t.now += cost
            pacer.charge(cost)
            done += cost
        assert done <= share * t.now + burst + costs[-1] + 1e-9

    anyio.run(run)


@pytest.mark.parametrize(("share", "burst"), [(0.0, 0.01), (1.5, 0.01), (0.5, 0.0)])
def test_a_share_outside_0_1_or_an_empty_burst_is_refused(share: float, burst: float) -> None:
    with pytest.raises(ValueError, match=r"^(share|burst) must be"):
        Pacer(share, burst)
