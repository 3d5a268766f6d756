"""The fleet the yardstick bench replays is what its docstring says: every topic the
same number of days from the same start, its base trace's rows in order from an offset,
the trace repeated end to end where it is shorter; built in chunks or at once alike."""

from __future__ import annotations

from bench.fleet_bench import DAY_MS, FLEET_START_MS, build_fleet
from controllerd.pipeline.load import Trace

HOUR_MS = 3_600_000


def base(name: str, hours: int, first_ms: int) -> Trace:
    """Hourly rows whose rate is the row's number: where a fleet row came from shows."""
    rates = [(float(i), 2.0 * i, 3.0 * i, 4.0 * i) for i in range(hours)]
    t_ms = [first_ms + i * HOUR_MS for i in range(hours)]
    return Trace(name, "series", t_ms, [0] * hours, [0xFFFF] * hours, rates)


def test_each_topic_is_its_base_from_an_offset_repeated_for_the_days_asked() -> None:
    bases = [base("short", 30, 5 * HOUR_MS), base("long", 24 * 9, 7 * HOUR_MS)]
    fleet = build_fleet(bases, 0, 6, 3.0, seed=4)
    assert [t.name for t in fleet] == [
        f"topic-{i:05d}-{('short', 'long')[i % 2]}" for i in range(6)
    ]
    for i, topic in enumerate(fleet):
        source = bases[i % 2]
        assert topic.kind == "series"
        assert len(topic.t_ms) == 3 * 24  # hourly rows for three days, no more, no fewer
        assert topic.t_ms[0] == FLEET_START_MS
        assert topic.t_ms[-1] < FLEET_START_MS + 3 * DAY_MS
        assert all(b - a == HOUR_MS for a, b in zip(topic.t_ms, topic.t_ms[1:], strict=False))
        # Consecutive rows are consecutive rows of the base, wrapping at its end.
        first = source.rates.index(topic.rates[0])
        n = len(source.rates)
        assert list(topic.rates) == [source.rates[(first + k) % n] for k in range(3 * 24)]
        assert set(topic.start) == {0} and set(topic.end) == {0xFFFF}
    # The 30-hour base is repeated to fill three days: its rows come back.
    assert len(set(fleet[0].rates)) == 30


def test_offsets_differ_by_topic_and_a_chunked_fleet_is_the_whole_fleet() -> None:
    bases = [base("only", 24 * 4, 0)]
    whole = build_fleet(bases, 0, 8, 2.0, seed=1)
    chunked = build_fleet(bases, 0, 3, 2.0, seed=1) + build_fleet(bases, 3, 5, 2.0, seed=1)
    assert whole == chunked
    assert len({t.rates[0] for t in whole}) > 1  # not every topic from the same hour
    assert build_fleet(bases, 0, 8, 2.0, seed=2) != whole
