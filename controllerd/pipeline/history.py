"""The load-history store: Parquet datasets partitioned by topic and hour (pyarrow).

Layout under the output directory (hive partitioning, so Spark, pandas and
pyarrow read it as one table each)::

    loads/topic=<tenant.ns.topic>/hour=<YYYY-MM-DDTHH>/part-*.parquet
    layouts/topic=.../hour=.../part-*.parquet
    decisions/topic=.../hour=.../part-*.parquet      (audit topic, when configured)

``topic`` and ``hour`` are partition columns only (not inside the files), so
Spark's ``spark.read.parquet(dir)`` and pyarrow both read them back; pyarrow
percent-encodes the ``/`` of topic names in directory names and both decode it.
Each flush appends new files and never rewrites old ones, so a crash loses at
most the rows buffered since the last flush. A file is written under a hidden
name (``.part-*``, which pyarrow and Spark skip) and renamed once complete, so a
process killed mid-write leaves no truncated part behind to break every later
read (only a hidden one, safe to delete). ``hour`` is UTC, from ``t_ms``:
``sampledAtMs`` for load records that carry it, else the time the recorder saw
the change.
"""

from __future__ import annotations

import datetime as dt
import urllib.parse
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

LOADS: Final = "loads"
LAYOUTS: Final = "layouts"
DECISIONS: Final = "decisions"

SCHEMAS: Final[Mapping[str, pa.Schema]] = {
    LOADS: pa.schema(
        [
            ("topic", pa.string()),
            ("t_ms", pa.int64()),
            ("observed_at_ms", pa.int64()),
            ("mod_revision", pa.int64()),
            ("segment_id", pa.int64()),
            # From the newest layout seen before the record; null if none named it yet.
            ("range_start", pa.int32()),
            ("range_end", pa.int32()),
            ("msg_rate_in", pa.float64()),
            ("byte_rate_in", pa.float64()),
            ("msg_rate_out", pa.float64()),
            ("byte_rate_out", pa.float64()),
            ("changed_at_ms", pa.int64()),
            ("sampled_at_ms", pa.int64()),
            # The reporter's hashBuckets histogram over the range (null: none published).
            ("hash_buckets", pa.list_(pa.float64())),
        ]
    ),
    LAYOUTS: pa.schema(
        [
            ("topic", pa.string()),
            ("t_ms", pa.int64()),
            ("mod_revision", pa.int64()),
            ("epoch", pa.int64()),
            ("active_segments", pa.int32()),
            ("layout_json", pa.string()),
        ]
    ),
    DECISIONS: pa.schema(
        [
            ("topic", pa.string()),
            ("t_ms", pa.int64()),
            ("action", pa.string()),
            ("reason", pa.string()),
            ("detail", pa.string()),
            ("outcome", pa.string()),
            ("record_json", pa.string()),
        ]
    ),
}


#: Longest file name ext4, XFS, btrfs and APFS take, in bytes: a ``topic=``
#: directory longer than this fails the whole write it is part of.
MAX_NAME_BYTES: Final = 255
#: Prefix of a file still being written: pyarrow and Spark skip hidden files.
_WRITING: Final = "."
_INT_RANGES: Final[Mapping[pa.DataType, tuple[int, int]]] = {
    pa.int64(): (-(2**63), 2**63 - 1),
    pa.int32(): (-(2**31), 2**31 - 1),
}


def hour_of(t_ms: int) -> str:
    return dt.datetime.fromtimestamp(t_ms / 1000, tz=dt.UTC).strftime("%Y-%m-%dT%H")


def check_row(table: str, row: Mapping[str, Any]) -> None:
    """Raise if :func:`write_rows` could not write ``row`` into ``table``.

    Call it where a row is buffered, so that a bad one is skipped alone: at the
    write it would fail the whole flush, and every row buffered beside it with
    it. Checks what pyarrow and the file system refuse (an integer beyond its
    column, a string that is not UTF-8, a time with no calendar hour, a topic
    that makes no directory name), not what the values mean.

    Raises:
        ValueError: naming the column that does not fit.
    """
    for column in SCHEMAS[table]:
        value = row.get(column.name)
        if value is None:
            continue
        bounds = _INT_RANGES.get(column.type)
        if bounds is not None:
            if type(value) is not int or not bounds[0] <= value <= bounds[1]:
                raise ValueError(f"{column.name}: not an integer in {bounds[0]}..{bounds[1]}")
        elif column.type == pa.string():
            if type(value) is not str:
                raise ValueError(f"{column.name}: expected a string, got {type(value).__name__}")
            value.encode()  # UnicodeEncodeError (a ValueError): a lone surrogate
        elif column.type == pa.float64():
            if type(value) is not float:
                raise ValueError(f"{column.name}: expected a float, got {type(value).__name__}")
        elif not isinstance(value, list | tuple) or any(type(v) is not float for v in value):
            raise ValueError(f"{column.name}: expected a list of floats")
    t_ms, topic = row.get("t_ms"), row.get("topic")
    if t_ms is None or topic is None:
        raise ValueError("t_ms and topic (the partition columns) must not be null")
    try:
        hour_of(t_ms)
    except (ValueError, OverflowError, OSError):
        raise ValueError(f"t_ms: {t_ms} has no calendar hour") from None
    if "\x00" in topic:
        raise ValueError("topic: holds a NUL, which no directory name can")
    escaped = len(f"topic={urllib.parse.quote(topic, safe='')}".encode())  # as pyarrow escapes
    if escaped > MAX_NAME_BYTES:
        raise ValueError(f"topic: its directory name would be {escaped} > {MAX_NAME_BYTES} bytes")


def write_rows(root: str | Path, table: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Append ``rows`` (dicts of the table's columns) as new Parquet files.

    Each file appears under its final name only once complete (written hidden,
    then renamed), so readers never see part of one. Blocking: call it from a
    worker thread in async code.
    """
    if not rows:
        return
    schema = SCHEMAS[table]
    columns = {name: [row.get(name) for row in rows] for name in schema.names}
    columns["hour"] = [hour_of(int(row["t_ms"])) for row in rows]
    data = pa.Table.from_pydict(columns, schema=schema.append(pa.field("hour", pa.string())))
    written: list[str] = []
    pq.write_to_dataset(
        data,
        str(Path(root) / table),
        partition_cols=["topic", "hour"],
        basename_template=f"{_WRITING}part-{uuid.uuid4().hex}-{{i}}.parquet",
        existing_data_behavior="overwrite_or_ignore",
        file_visitor=lambda file: written.append(file.path),
    )
    for path in map(Path, written):
        path.replace(path.with_name(path.name.removeprefix(_WRITING)))


def read_table(root: str | Path, table: str) -> pa.Table:
    """One dataset as a table, with the ``topic`` and ``hour`` partition columns."""
    directory = Path(root) / table
    schema = SCHEMAS[table].append(pa.field("hour", pa.string()))
    if not directory.is_dir():
        return schema.empty_table()
    dataset = ds.dataset(
        directory,
        schema=schema,
        format="parquet",
        partitioning=ds.partitioning(
            pa.schema([("topic", pa.string()), ("hour", pa.string())]), flavor="hive"
        ),
    )
    return dataset.to_table()


def is_history(path: str | Path) -> bool:
    """Whether ``path`` is a recorder output directory."""
    return (Path(path) / LOADS).is_dir()
