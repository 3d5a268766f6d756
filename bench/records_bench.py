"""One topic holding N load records for segment ids its layout does not have.

The view keeps such records until the topic's next layout (docs/operations.md,
"Known gaps"), so one topic can hold tens of thousands of them, and every
record the view applies looks its segment's row up in that topic's
``LoadTable``. This bench puts N plain records (ids 1,000 on; the layout has 2
segments) into a fresh view the way the follower loads them (one
``MetadataView.apply_put`` a key, the key as text), then follows the same N
records again the way it follows the watch (``apply_events``, ``SLICE`` events
a call: the fast path that writes a known row), then applies a new layout,
which drops them all in one call. It prints the total time of each phase and
its slowest single call, and its slowest ``SLICE`` records: the follower
yields to the event loop only between slices, so that is the loop's stall.
A normal topic (16 segments, N records over them) is measured the same way for
comparison.

``--view FILE`` takes ``MetadataView`` from another copy of
``controllerd/core/view.py`` (e.g. ``git show <commit>:controllerd/core/view.py >
/tmp/view.py``), to compare one version with another in the same process.

Usage: python -m bench.records_bench [--records 30000] [--view FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence
from typing import cast

import orjson

from controllerd.core.layout import initial_layout
from controllerd.core.model import TopicName, layout_to_json
from controllerd.core.view import Keys, MetadataView, Outcome
from controllerd.daemon.follower import SLICE

KEYS = Keys("/bench/pulsar", "/bench/controllerd/default")
TOPIC = TopicName("acme", "ns", "orders")
NOW = 1_760_000_000_000
FIRST_UNKNOWN = 1_000


def view_class(path: str | None) -> type[MetadataView]:
    """``MetadataView`` from ``path`` (None: this checkout's)."""
    if path is None:
        return MetadataView
    spec = importlib.util.spec_from_file_location("bench_records_view", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return cast(type[MetadataView], module.MetadataView)


def record(i: int) -> bytes:
    """A plain record: four rates and the time it was sampled (no extension)."""
    template = (
        b'{"msgRateIn": %d.5, "byteRateIn": 100.0, "msgRateOut": 1.0, '
        b'"byteRateOut": 2.0, "sampledAtMs": %d}'
    )
    return template % (i % 97, NOW - i)


def timed(calls: Sequence[Callable[[], object]]) -> list[float]:
    """Seconds each call took, made in order."""
    took: list[float] = []
    for call in calls:
        started = time.perf_counter()
        call()
        took.append(time.perf_counter() - started)
    return took


def _ignore(outcome: Outcome) -> None:
    """Drops an outcome: only the view's own work is measured."""


def run(cls: type[MetadataView], records: int, segments: int, ids: Sequence[int]) -> None:
    """Load, follow and re-layout one topic of a ``segments``-segment layout holding
    ``records`` records for ``ids`` (cycled); print each phase's numbers."""
    view = cls(KEYS)
    layout = orjson.dumps(layout_to_json(initial_layout(segments, NOW - 60_000)))
    view.apply_put(KEYS.layout(TOPIC), layout, 1, NOW)
    keys = [KEYS.load(TOPIC, ids[i % len(ids)]) for i in range(records)]
    values = [record(i) for i in range(records)]
    revision = 2

    def put(key: str, value: bytes, rev: int) -> Callable[[], object]:
        return lambda: view.apply_put(key, value, rev, NOW)

    load = timed(
        [put(k, v, revision + i) for i, (k, v) in enumerate(zip(keys, values, strict=True))]
    )
    held = len(view.topics[TOPIC].loads)
    revision += records
    events = [
        (True, k.encode(), v, revision + i)
        for i, (k, v) in enumerate(zip(keys, values[1:] + values[:1], strict=True))
    ]
    revision += records

    def follow(start: int) -> Callable[[], object]:
        return lambda: view.apply_events(events[start : start + SLICE], NOW, _ignore)

    follow_times = timed([follow(start) for start in range(0, len(events), SLICE)])
    relayout = orjson.dumps(layout_to_json(initial_layout(segments, NOW - 30_000)))
    drop = timed([lambda: view.apply_put(KEYS.layout(TOPIC), relayout, revision, NOW)])
    left = len(view.topics[TOPIC].loads)
    print(f"  {records:,} records held in {held:,} rows ({left:,} after the new layout)")
    slices = [sum(load[start : start + SLICE]) for start in range(0, len(load), SLICE)]
    for label, took, stall in (
        ("load (apply_put, one a call)", load, max(slices)),
        (f"follow (apply_events, {SLICE} a call)", follow_times, max(follow_times)),
    ):
        total, per = sum(took), sum(took) / records * 1e6
        print(
            f"  {label:36} {total:8.3f} s  {per:8.2f} us a record  "
            f"slowest call {max(took):.4f} s  slowest {SLICE} records {stall:.4f} s"
        )
    print(f"  {'new layout (one call)':36} {drop[0]:8.3f} s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--records", type=int, default=30_000)
    parser.add_argument("--view", default=None, help="another copy of controllerd/core/view.py")
    args = parser.parse_args(argv)
    cls = view_class(args.view)
    print(f"view: {args.view or 'controllerd/core/view.py'}")
    unknown = range(FIRST_UNKNOWN, FIRST_UNKNOWN + args.records)
    print(f"one topic, 2 segments, {args.records:,} records for unknown segment ids:")
    run(cls, args.records, 2, unknown)
    print(f"one topic, 16 segments, {args.records:,} records over its own segments:")
    run(cls, args.records, 16, range(16))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
