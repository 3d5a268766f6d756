"""The shipped defaults on public traffic that no setting was ever looked at on.

Two sources, neither from NAB (which every other backtest figure comes from):

* ``microsoft/cloud-monitoring-dataset`` (MIT licence): Microsoft production
  telemetry. The five load folders are replayed, one trace set per folder:
  e-commerce API requests/s (hourly, 258 days), MongoDB queries/s per
  application and per machine (per minute, 11 and 14 days), data ingress rates
  (per minute, 11 days) and store purchases (hourly, 52 days). Its other
  folders (crash rates, latency, errors) are not load and are left out.
* ``nimamahmoudi/worldcup98-dataset``: requests per minute to the 1998 World Cup
  web site (the ITA WorldCup98 access logs, free to use and redistribute with
  their notice), one trace per calendar month, May to July 1998.

Both checkouts come from GitHub (``fetch`` here, where github.com does not
resolve). Nothing is chosen on these traces: a setting changed because of them
would no longer be held out.

The MIT files stamp every row with a ``Z`` but follow US daylight saving time
(``api-01`` repeats 2017-11-05 01:00 and skips 2018-03-11 02:00); each file is
one row per step, so rows are re-stamped evenly from the first one. Minutes the
World Cup logs have no request in are 0.

Usage: python -m bench.heldout_public --ms-cloud DIR --worldcup DIR [--variants FILE]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import time
from collections.abc import Sequence
from pathlib import Path

from bench.heldout_nab import cell
from controllerd.pipeline import engines
from controllerd.pipeline.load import Trace
from controllerd.pipeline.report import BASELINE
from controllerd.pipeline.traces import TraceError, TraceOptions, parse_time, series_trace
from controllerd.pipeline.tune import score
from controllerd.pipeline.variants import Variant, controllerd, load_variants, pip483

#: the Microsoft dataset's load folders (the others hold crash rates, latency, errors)
MS_LOAD_FOLDERS = (
    "ecommerce-api-incoming-rps",
    "mongodb-application-rps",
    "mongodb-machine-rps",
    "data-ingress-rate",
    "consumer-purchase-rate",
)
MINUTE_MS = 60_000


def _trace(name: str, t_ms: Sequence[int], values: Sequence[float]) -> Trace:
    return series_trace(name, t_ms, values, TraceOptions())


def ms_cloud(root: Path) -> dict[str, tuple[list[Trace], list[str]]]:
    """Per load folder: its series, evenly re-stamped (see the module docstring)."""
    sets: dict[str, tuple[list[Trace], list[str]]] = {}
    for folder in MS_LOAD_FOLDERS:
        traces: list[Trace] = []
        refused: list[str] = []
        for path in sorted((root / "data" / folder).glob("*.csv")):
            with path.open(newline="", encoding="utf-8") as fh:
                rows = list(csv.DictReader(fh))
            try:
                stamps = [parse_time(r["TimeStamp"]) for r in rows]
                step = min(b - a for a, b in itertools.pairwise(stamps) if b > a)
                t_ms = [stamps[0] + i * step for i in range(len(rows))]
                traces.append(_trace(path.stem, t_ms, [float(r["Value"]) for r in rows]))
            except (TraceError, ValueError, KeyError) as exc:
                refused.append(f"{path}: {exc}")
        sets[f"ms:{folder}"] = (traces, refused)
    return sets


def worldcup(root: Path) -> dict[str, tuple[list[Trace], list[str]]]:
    """Requests per minute, one trace per calendar month from May 1998."""
    counts: dict[int, float] = {}
    with (root / "invocation_count.csv").open(newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            counts[parse_time(row["period"])] = float(row["count"])
    traces = []
    for month in (5, 6, 7):
        start = parse_time(f"1998-{month:02d}-01 00:00:00")
        end = min(parse_time(f"1998-{month + 1:02d}-01 00:00:00"), max(counts) + MINUTE_MS)
        t_ms = list(range(start, end, MINUTE_MS))
        traces.append(_trace(f"wc98-{month:02d}", t_ms, [counts.get(t, 0.0) for t in t_ms]))
    return {"worldcup98": (traces, [])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms-cloud", type=Path, help="microsoft/cloud-monitoring-dataset")
    parser.add_argument("--worldcup", type=Path, help="nimamahmoudi/worldcup98-dataset")
    parser.add_argument("--variants", help="variants TOML (default: the shipped defaults)")
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    if args.ms_cloud is None and args.worldcup is None:
        parser.error("name at least one of --ms-cloud and --worldcup")
    variants = (
        load_variants(args.variants) if args.variants else [Variant("controllerd", controllerd())]
    )
    if all(v.name != BASELINE for v in variants):
        variants = [Variant(BASELINE, pip483()), *variants]
    sets = {
        **(ms_cloud(args.ms_cloud) if args.ms_cloud else {}),
        **(worldcup(args.worldcup) if args.worldcup else {}),
    }
    everything = [t for traces, _ in sets.values() for t in traces]
    print(f"{len(everything)} traces, in {len(sets)} sets")
    print("| set | traces | variant | excess load | segment-hours | operations | flip-flops |")
    print("|" + "---|" * 7)
    started = time.monotonic()
    rows = engines.run(
        "local", everything, variants, engines.RunOptions(timeline_points=0), workers=args.workers
    )
    named = {name: [t.name for t in traces] for name, (traces, _) in sets.items()}
    for name, names in {**named, "all": [t.name for t in everything]}.items():
        for v in variants:
            if v.name != BASELINE:
                figures = cell(score(rows, v.name, names))
                print(f"| {name} | {len(names)} | `{v.name}` | {figures} |")
    for _, refused in sets.values():
        for reason in refused:
            print(f"  skipped: {reason}")
    print(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
