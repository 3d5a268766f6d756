"""The shipped defaults on the NAB traces that ``../shared`` does not hold.

The defaults were chosen on ``../shared/traces`` (nab: seven Twitter traces and
the taxi trace; aws: three CloudWatch and two traffic traces), all from NAB
(github.com/numenta/NAB, MIT licence). NAB's ``data/`` folders hold 45 more
series, 44 of them readable. This replays them, one trace set per folder, under
``pip483`` and the variants, and prints each set against ``pip483`` with the
issue's targets. Nothing is chosen on these traces: it is an evaluation, and a
setting changed because of it would no longer be held out.

Files the loader refuses, or keeps only after dropping malformed rows, are
left out and named: a series with holes is not the traffic it recorded (one
artificial series has negative values in 2,352 of its 4,032 rows, and a load
cannot be negative; the loader now skips such rows rather than the file).

Usage: git clone https://github.com/numenta/NAB /tmp/NAB
       python -m bench.heldout_nab --nab /tmp/NAB [--variants FILE] [--workers N]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time
from pathlib import Path

from controllerd.pipeline import engines
from controllerd.pipeline.load import Trace
from controllerd.pipeline.report import BASELINE, Targets
from controllerd.pipeline.traces import TraceError, TraceOptions, discover
from controllerd.pipeline.tune import Score, score
from controllerd.pipeline.variants import Variant, controllerd, load_variants, pip483
from tests.support.shared import traces_dir


def held_out(nab: Path, shared: Path) -> dict[str, tuple[list[Trace], list[str]]]:
    """Per NAB data folder: the traces not in ``shared``, and the files left out (refused
    by the loader, or with rows it had to drop)."""
    known = {p.name for p in shared.rglob("*.csv")}
    sets: dict[str, tuple[list[Trace], list[str]]] = {}
    for folder in sorted(p for p in (nab / "data").iterdir() if p.is_dir()):
        traces: list[Trace] = []
        refused: list[str] = []
        for path in sorted(folder.glob("*.csv")):
            if path.name in known:
                continue
            said = io.StringIO()
            try:
                with contextlib.redirect_stderr(said):
                    found = discover([path], TraceOptions())
            except TraceError as exc:
                refused.append(str(exc))
                continue
            if "malformed" in said.getvalue():  # report_skipped's line: rows were dropped
                refused.append(said.getvalue().strip().removeprefix("controllerd: "))
                continue
            traces += found
        if traces:
            sets[folder.name] = (traces, refused)
    return sets


def cell(s: Score) -> str:
    met = s.met
    flag = {k: "" if ok else " ❌" for k, ok in met.items()}
    allowed = Targets().max_flipflop_share * s.base_flipflops
    return (
        f"{-100 * s.excess_cut:.1f}%{flag['excess']} | {s.cost_ratio:.3f}x{flag['cost']} | "
        f"{s.operations} vs {s.base_operations}{flag['operations']} | "
        f"{s.flipflops} vs {s.base_flipflops} (≤ {allowed:.1f}){flag['flipflops']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nab", required=True, type=Path, help="a checkout of numenta/NAB")
    parser.add_argument("--variants", help="variants TOML (default: the shipped defaults)")
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    variants = (
        load_variants(args.variants) if args.variants else [Variant("controllerd", controllerd())]
    )
    if all(v.name != BASELINE for v in variants):
        variants = [Variant(BASELINE, pip483()), *variants]
    sets = held_out(args.nab, traces_dir())
    print(f"{sum(len(t) for t, _ in sets.values())} traces held out, in {len(sets)} sets")
    print("| set | traces | variant | excess load | segment-hours | operations | flip-flops |")
    print("|" + "---|" * 7)
    started = time.monotonic()
    for name, (traces, refused) in sets.items():
        rows = engines.run(
            "local", traces, variants, engines.RunOptions(timeline_points=0), workers=args.workers
        )
        names = [t.name for t in traces]
        for v in variants:
            if v.name != BASELINE:
                print(
                    f"| {name} | {len(traces)} | `{v.name}` | {cell(score(rows, v.name, names))} |"
                )
        for reason in refused:
            print(f"  skipped: {reason}")
    print(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
