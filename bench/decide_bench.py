"""Throughput of ``policy.decide`` over a fleet of topics, on one core.

The fleet mimics production load: every topic has ``--segments`` active
segments (some after a few splits and merges, so sealed segments and merge
nodes exist), lognormal per-segment rates with ~5% of topics holding a hot
segment, ~40% a run of adjacent segments cold past the merge window, the rest
in the dead band, plus missing and stale samples, a few consumer bursts,
per-topic overrides and cooldown stamps. Only ``decide`` is timed: layouts,
loads and resolved policies are built beforehand.

Usage: python bench/decide_bench.py [--topics 10000] [--segments 16] [--seed 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from controllerd.core.layout import initial_layout, merge, split
from controllerd.core.model import Decision, Layout, LoadSample, PolicySettings, Rates
from controllerd.core.policy import PolicyInvalid, decide, resolve_policy

NOW_MS: Final = 1_760_000_000_000
BASE: Final = PolicySettings()
HOT_SHARE: Final = 0.05
COLD_SHARE: Final = 0.40
CHURNED_SHARE: Final = 0.15
MISSING_SHARE: Final = 0.02
STALE_SHARE: Final = 0.02
BURST_SHARE: Final = 0.01
OVERRIDES: Final[tuple[tuple[float, dict[str, Any]], ...]] = (
    (0.05, {"maxSplitFanout": 2, "minSplitWidth": 1, "mergeCombinedMaxRatio": math.inf}),
    (0.05, {"mergeWindowSeconds": 600, "loadTtlSeconds": 0}),
    (0.005, {"minSegments": 0}),
)


@dataclass(frozen=True, slots=True)
class Topic:
    layout: Layout
    loads: dict[int, LoadSample]
    consumers: dict[str, int]
    policy: PolicySettings | PolicyInvalid
    last_split_ms: int | None
    last_merge_ms: int | None


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _rates(rng: random.Random, kind: str) -> Rates:
    """Correlated rates: msg/s in, a lognormal message size and a subscription fan-out."""
    if kind == "hot":
        msg_in = _clamp(rng.lognormvariate(math.log(15_000), 0.4), 11_000, 60_000)
    elif kind == "cold":
        msg_in = _clamp(rng.lognormvariate(math.log(100), 1.0), 0, 900)
    else:
        msg_in = _clamp(rng.lognormvariate(math.log(3_000), 0.4), 1_200, 9_000)
    size = _clamp(rng.lognormvariate(math.log(1_024), 0.5), 64, 4_000)
    fanout = rng.choice((1, 1, 2, 3))
    return Rates(msg_in, msg_in * size, msg_in * fanout, msg_in * size * fanout)


def _layout(rng: random.Random, segments: int, overrides: dict[str, Any] | None) -> Layout:
    """``initial_layout(segments)``; for some topics a few merge+split rounds keep it at size."""
    now = NOW_MS - 86_400_000
    layout = initial_layout(segments, now_ms=now)
    if segments >= 2 and rng.random() < CHURNED_SHARE:
        for _ in range(rng.randint(1, 3)):
            now += 3_600_000
            active = layout.active_segments()
            i = rng.randrange(len(active) - 1)
            layout = merge(layout, active[i].segment_id, active[i + 1].segment_id, now_ms=now)
            widest = max(layout.active_segments(), key=lambda s: s.hash_range.width)
            layout = split(layout, widest.segment_id, now_ms=now + 1)
    if overrides is None:
        return layout
    return Layout(
        epoch=layout.epoch,
        next_segment_id=layout.next_segment_id,
        segments=layout.segments,
        auto_scale_policy=overrides,
    )


def _sample(rng: random.Random, kind: str, ttl_ms: int) -> LoadSample:
    if kind == "cold" and rng.random() < 0.9:
        changed = NOW_MS - 300_000 - rng.randrange(3_600_000)
    else:
        changed = NOW_MS - rng.randrange(600_000)
    sampled = NOW_MS - rng.randrange(300_000)
    if rng.random() < STALE_SHARE:
        sampled = NOW_MS - ttl_ms - 1_000 - rng.randrange(3_600_000)
    return LoadSample(_rates(rng, kind), changed, sampled)


def build_topic(rng: random.Random, segments: int) -> Topic:
    overrides: dict[str, Any] | None = None
    draw = rng.random()
    for share, candidate in OVERRIDES:
        if draw < share:
            overrides = candidate
            break
        draw -= share
    layout = _layout(rng, segments, overrides)
    policy = resolve_policy(BASE, layout.auto_scale_policy)
    active = layout.active_segments()
    kinds = ["band"] * len(active)
    draw = rng.random()
    if draw < HOT_SHARE:
        kinds[rng.randrange(len(active))] = "hot"
    elif draw < HOT_SHARE + COLD_SHARE:
        run = min(len(active), rng.randint(2, 8))
        start = rng.randrange(len(active) - run + 1)
        kinds[start : start + run] = ["cold"] * run
    ttl_ms = int(BASE.load_ttl_seconds * 1000)
    loads = {
        seg.segment_id: _sample(rng, kind, ttl_ms)
        for seg, kind in zip(active, kinds, strict=True)
        if rng.random() >= MISSING_SHARE
    }
    consumers = {"sub-0": rng.randint(1, 8)}
    if rng.random() < 0.3:
        consumers["sub-1"] = rng.randint(1, 4)
    if rng.random() < BURST_SHARE:
        consumers["burst"] = rng.randint(segments + 1, 3 * segments)
    last_split = NOW_MS - rng.randrange(120_000) if rng.random() < 0.1 else None
    last_merge = NOW_MS - rng.randrange(600_000) if rng.random() < 0.2 else None
    return Topic(layout, loads, consumers, policy, last_split, last_merge)


def run_once(topics: Sequence[Topic]) -> tuple[float, list[Decision]]:
    """Decide every topic once; returns the wall time of the decide calls only."""
    out: list[Decision] = []
    append = out.append
    start = time.perf_counter()
    for t in topics:
        append(
            decide(
                t.layout, t.loads, t.consumers, t.policy, NOW_MS, t.last_split_ms, t.last_merge_ms
            )
        )
    return time.perf_counter() - start, out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--topics", type=int, default=10_000)
    parser.add_argument("--segments", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    rng = random.Random(args.seed)
    topics = [build_topic(rng, args.segments) for _ in range(args.topics)]
    # The first pass also fills each layout's active-segment cache, as the daemon's
    # first evaluation after a layout change does; later passes reuse it, as the
    # daemon does between layout changes. Both numbers are printed.
    runs = [run_once(topics) for _ in range(max(1, args.repeat))]
    first = runs[0][0]
    best, decisions = min(runs, key=lambda r: r[0])
    total_segments = sum(len(t.layout.segments) for t in topics)
    mix = Counter(f"{d.action}/{d.reason}" for d in decisions)

    print(f"topics:               {len(topics)}")
    print(
        f"segments per topic:   {args.segments} active "
        f"({total_segments / max(1, len(topics)):.2f} incl. sealed)"
    )
    print(f"total decisions:      {len(decisions)}")
    print(f"seconds (best of {args.repeat}): {best:.4f}")
    print(f"topic-decisions/s:    {len(decisions) / best:,.0f}")
    print(f"first pass (new layouts): {len(decisions) / first:,.0f} topic-decisions/s")
    print("decision mix:")
    for key, count in sorted(mix.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {key:<26} {count:>7}  {100 * count / len(decisions):5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
