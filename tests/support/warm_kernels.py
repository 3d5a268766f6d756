"""Compile the replay's kernels into numba's disk cache once, before the tests start.

On a fresh checkout there is no cache yet, and every process that replays first
(each pytest worker, each ``controllerd backtest`` a test starts) would compile the
kernels itself, about 6 s of CPU each, at the same time. ``./dev.sh test`` runs this
beside the linters; a test that replays before it ends compiles as it would have.

Usage: python -m tests.support.warm_kernels
"""

from __future__ import annotations

from controllerd.pipeline import kernel
from controllerd.pipeline.load import Skew, source_for
from controllerd.pipeline.simulate import simulate
from controllerd.pipeline.traces import TraceOptions, series_trace
from controllerd.pipeline.variants import REFERENCE_THRESHOLDS, controllerd, static


def main() -> int:
    """A day of bursts, replayed as one segment that splits (the several-group kernel)
    and as four equal static segments (the one-group kernel)."""
    t_ms = [300_000 * i for i in range(288)]
    values = [900.0 if i % 37 == 5 else 20.0 + 10 * ((i * 7) % 5) for i in range(288)]
    trace = series_trace("warm", t_ms, values, TraceOptions())
    for strategy in (controllerd(), static(4)):
        simulate(source_for(trace, Skew(), 0), strategy, REFERENCE_THRESHOLDS, timeline_points=0)
    compiled = [k.signatures for k in (kernel.idle_one, kernel.idle_run)]  # type: ignore[attr-defined]
    return 0 if all(compiled) else 1


if __name__ == "__main__":
    raise SystemExit(main())
