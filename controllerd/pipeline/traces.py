"""Importers: turn a time series or recorded load history into :class:`Trace` inputs.

A CSV series (``timestamp,value`` as in NAB: Twitter mentions per 5 minutes, NYC
taxi demand per 30 minutes) becomes one topic's load: the value is scaled so
that the series' peak is ``peak_over_threshold`` times the reference split
threshold on ``msgRateIn`` (so at the peak a uniform topic needs that many
segments), and the other three rates follow from a message size and a
subscription fan-out. The spread over the hash space is chosen at replay time.

A recorder output directory (see :mod:`controllerd.pipeline.history`) becomes
one ``history`` trace per topic, in the recorded units (no scaling).
"""

from __future__ import annotations

import csv
import datetime as dt
import itertools
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controllerd.core.model import Rates
from controllerd.pipeline.load import MAX_STAMP_MS, RateTuple, Trace
from controllerd.pipeline.variants import REFERENCE_THRESHOLDS


class TraceError(ValueError):
    """A trace cannot be imported; the message names the file and row."""


@dataclass(frozen=True, slots=True)
class TraceOptions:
    #: the series' peak msgRateIn, in multiples of the reference split threshold.
    peak_over_threshold: float = 4.0
    #: bytes per message: byteRateIn = msgRateIn * msg_bytes.
    msg_bytes: float = 1024.0
    #: subscriptions reading every message: msgRateOut = msgRateIn * out_fanout.
    out_fanout: float = 1.0
    #: keep only the first hours of each trace (None = all).
    max_hours: float | None = None
    reference: Rates = REFERENCE_THRESHOLDS


def parse_time(text: str, what: str = "time") -> int:
    """``YYYY-MM-DD HH:MM:SS`` (or ISO 8601, or epoch seconds) as UTC epoch milliseconds.

    Raises:
        ValueError: ``text`` is no such time, or not one in 1970-9999; the message
            starts with ``what`` (the column it came from).
    """
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            stamp = dt.datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(
                f"{what} {_shown(text)} is not YYYY-MM-DD HH:MM:SS, ISO 8601 or epoch seconds"
            ) from None
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=dt.UTC)
        seconds = stamp.timestamp()
    if not 0 <= seconds * 1000 <= MAX_STAMP_MS:  # also NaN
        late = seconds * 1000 > MAX_STAMP_MS
        hint = " (epoch seconds expected, not milliseconds)" if late else ""
        raise ValueError(f"{what} {_shown(text)} is not in 1970-9999{hint}")
    return round(seconds * 1000)


def _shown(text: str) -> str:
    """A cell quoted for a one-line message, cut short: an unclosed quote can swallow
    the rest of the file into one cell."""
    return repr(text if len(text) <= 40 else f"{text[:37]}...")


def report_skipped(source: str | Path, count: int, what: str, first: str | None = None) -> None:
    """The one stderr line for an input's malformed rows: they are skipped, not fatal,
    but an operator must see that some of the input was not replayed."""
    detail = f" (first: {first})" if first else ""
    print(f"controllerd: {source}: skipped {count} malformed {what}{detail}", file=sys.stderr)


def read_series_csv(path: str | Path) -> tuple[list[int], list[float]]:
    """``timestamp,value`` rows (a header row is skipped), sorted by time.

    A row that cannot be used (fewer than two columns, a time that is none or is
    outside 1970-9999, a value that is not a finite number >= 0) is skipped and
    counted on one stderr line naming the first; one bad row of a long series must
    not end a backtest. A file with no usable row is refused.
    """
    rows: list[tuple[int, float]] = []
    columns = ("timestamp", "value")
    bad = 0
    first: str | None = None
    line = 0
    try:
        # utf-8-sig: a spreadsheet's BOM would otherwise glue to the first cell, and a
        # headerless file's first date would be taken for a header and lost.
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh)
            for row in reader:
                start, line = line + 1, reader.line_num
                if not row:
                    continue
                if start == 1 and _is_header(row[0]):
                    columns = _column_names(row, columns)
                    continue
                try:
                    if line > start:
                        raise ValueError(f"a quoted field runs on to line {line}")
                    rows.append(_series_row(row, columns))
                except ValueError as exc:
                    bad += 1
                    first = first or f"line {start}: {exc}"
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except csv.Error as exc:
        raise TraceError(f"{path}:{line + 1}: {exc}") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not rows and bad:
        raise TraceError(f"{path}: no usable rows: all {bad} malformed (first: {first})")
    if not rows:
        raise TraceError(f"{path}: no rows")
    if bad:
        report_skipped(path, bad, "rows", first)
    rows.sort(key=lambda r: r[0])  # stable: rows with one time keep the file's order
    # The replay holds the last row of a time; the rows it shadows must not set the
    # scaling peak either, so they go here.
    kept = [a for a, b in itertools.pairwise(rows) if a[0] != b[0]] + rows[-1:]
    if len(kept) < len(rows):
        print(
            f"controllerd: {path}: {len(rows) - len(kept)} rows repeat a later row's time; "
            "the last of each is kept",
            file=sys.stderr,
        )
        rows = kept
    return [t for t, _ in rows], [v for _, v in rows]


def _series_row(row: list[str], columns: tuple[str, str]) -> tuple[int, float]:
    """One CSV row as (epoch ms, value); a ValueError names the column at fault."""
    if len(row) < 2:
        raise ValueError(f"expected {columns[0]},{columns[1]}")
    t_ms = parse_time(row[0], what=columns[0])
    try:
        value = float(row[1])
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{columns[1]} {_shown(row[1])} is not a finite number >= 0")
    return t_ms, value


def _column_names(header: list[str], default: tuple[str, str]) -> tuple[str, str]:
    """The header's names for the time and value columns, for messages about them."""
    names = [cell.lstrip("\ufeff").strip() for cell in header[:2]]
    return (
        names[0] or default[0],
        names[1] if len(names) > 1 and names[1] else default[1],
    )


def _is_header(cell: str) -> bool:
    """A first cell that is neither a number nor a date names a column; a number or a
    date out of range is a bad time, reported as such."""
    text = cell.strip()
    try:
        float(text)
    except ValueError:
        pass
    else:
        return False
    try:
        dt.datetime.fromisoformat(text)
    except ValueError:
        return True
    return False


def series_trace(
    name: str,
    t_ms: Sequence[int],
    values: Sequence[float],
    options: TraceOptions,
    *,
    source: str | Path | None = None,
) -> Trace:
    """One topic's load from a series (see the module docstring for the scaling).

    Messages name ``source`` (the file) if given, else the trace. Every rate is a
    finite number: the replay sizes segments from them, and an infinite one has no
    segment count.
    """
    where = source or f"trace {name}"
    if options.max_hours is not None:
        cut = t_ms[0] + options.max_hours * 3_600_000
        keep = [i for i, t in enumerate(t_ms) if t <= cut]
        t_ms, values = [t_ms[i] for i in keep], [values[i] for i in keep]
        if not keep:
            raise TraceError(f"{where}: no rows in the first {options.max_hours:g} hours")
    peak = max(values)
    if peak <= 0:
        raise TraceError(f"{where}: all values are zero")
    factor = options.peak_over_threshold * options.reference.msg_rate_in / peak
    # Every value is <= the peak and products are monotonic, so the peak's rates bound all.
    if not all(map(math.isfinite, (factor, *_rates(peak * factor, options)))):
        raise TraceError(
            f"{where}: the peak value {peak:g} scaled to --peak-over-threshold "
            f"{options.peak_over_threshold:g} times {options.reference.msg_rate_in:g} msg/s, "
            f"at --msg-bytes {options.msg_bytes:g}, gives rates that are not finite numbers; "
            "lower --peak-over-threshold or --msg-bytes, or rescale the file's values"
        )
    rates = [_rates(v * factor, options) for v in values]
    n = len(rates)
    return Trace(name, "series", list(t_ms), [0] * n, [0xFFFF] * n, rates)


def _rates(msgs: float, options: TraceOptions) -> RateTuple:
    """The four rates of ``msgs`` messages per second (see :class:`TraceOptions`)."""
    return (
        msgs,
        msgs * options.msg_bytes,
        msgs * options.out_fanout,
        msgs * options.msg_bytes * options.out_fanout,
    )


def import_csv(path: str | Path, options: TraceOptions) -> Trace:
    t_ms, values = read_series_csv(path)
    return series_trace(Path(path).stem, t_ms, values, options, source=path)


def import_history(root: str | Path, options: TraceOptions) -> list[Trace]:
    """One ``history`` trace per recorded topic.

    Rows without a known range are skipped (the recorder had not yet seen a layout);
    rows that cannot be replayed (no topic or etcd revision, a time outside 1970-9999,
    a range outside the hash space, a rate that is not a finite number >= 0) are
    skipped and counted on stderr.
    """
    import pyarrow as pa

    from controllerd.pipeline.history import LOADS, read_table

    try:
        table = read_table(root, LOADS).to_pydict()
    except (OSError, ValueError, pa.ArrowException) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise TraceError(f"{root}: cannot read the recorded history: {first}") from None
    by_topic: dict[str, list[int]] = {}
    bad = 0
    for i, (topic, start) in enumerate(zip(table["topic"], table["range_start"], strict=True)):
        if start is None:
            continue
        if _replayable(table, i):
            by_topic.setdefault(topic, []).append(i)
        else:
            bad += 1
    if bad:
        report_skipped(root, bad, "load rows")
    if not by_topic:
        raise TraceError(f"{root}: no load rows with a known hash range")
    traces = []
    for topic, indices in sorted(by_topic.items()):
        rows = sorted(indices, key=lambda i: (table["t_ms"][i], table["mod_revision"][i]))
        if options.max_hours is not None:
            cut = table["t_ms"][rows[0]] + options.max_hours * 3_600_000
            rows = [i for i in rows if table["t_ms"][i] <= cut]
        traces.append(
            Trace(
                topic,
                "history",
                [table["t_ms"][i] for i in rows],
                [table["range_start"][i] for i in rows],
                [table["range_end"][i] for i in rows],
                [
                    (
                        table["msg_rate_in"][i],
                        table["byte_rate_in"][i],
                        table["msg_rate_out"][i],
                        table["byte_rate_out"][i],
                    )
                    for i in rows
                ],
                _buckets([table["hash_buckets"][i] for i in rows]),
            )
        )
    return traces


def _replayable(table: dict[str, list[Any]], i: int) -> bool:
    """Whether row ``i`` can be replayed; the topic names its trace, and the etcd
    revision orders records of one time."""
    topic = table["topic"][i]
    if not (isinstance(topic, str) and topic.strip()) or table["mod_revision"][i] is None:
        return False
    start, end, t = table["range_start"][i], table["range_end"][i], table["t_ms"][i]
    if end is None or t is None or not (0 <= start <= end <= 0xFFFF and 0 <= t <= MAX_STAMP_MS):
        return False
    rates = (table[c][i] for c in ("msg_rate_in", "byte_rate_in", "msg_rate_out", "byte_rate_out"))
    if not all(r is not None and math.isfinite(r) and r >= 0 for r in rates):
        return False
    buckets = table["hash_buckets"][i]
    return not buckets or all(b is not None and math.isfinite(b) and b >= 0 for b in buckets)


def _buckets(raw: list[list[float] | None]) -> list[tuple[float, ...] | None] | None:
    """Recorded histograms as tuples; None when no row has one."""
    if all(b is None for b in raw):
        return None
    return [tuple(b) if b else None for b in raw]


def discover(paths: Iterable[str | Path], options: TraceOptions) -> list[Trace]:
    """Every trace named: CSV files, directories of CSV files, recorder output directories.

    Names must be unique across the run (the file stem or the topic name).
    """
    from controllerd.pipeline.history import is_history

    traces: list[Trace] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir() and is_history(path):
            traces.extend(import_history(path, options))
        elif path.is_dir():
            files = sorted(path.glob("*.csv"))
            if not files:
                raise TraceError(f"{path}: no *.csv files and no recorded history")
            traces.extend(import_csv(f, options) for f in files)
        elif path.is_file():
            traces.append(import_csv(path, options))
        elif path.exists():
            raise TraceError(
                f"{path}: not a regular file or a directory (a device, pipe or socket)"
            )
        else:
            raise TraceError(f"{path}: no such file or directory")
    names = [t.name for t in traces]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise TraceError(f"trace names must be unique; repeated: {', '.join(dupes)}")
    return traces
