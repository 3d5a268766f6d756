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
most the rows buffered since the last flush. ``hour`` is UTC, from ``t_ms``:
``sampledAtMs`` for load records that carry it, else the time the recorder saw
the change.
"""

from __future__ import annotations

import datetime as dt
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


def hour_of(t_ms: int) -> str:
    return dt.datetime.fromtimestamp(t_ms / 1000, tz=dt.UTC).strftime("%Y-%m-%dT%H")


def write_rows(root: str | Path, table: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Append ``rows`` (dicts of the table's columns) as new Parquet files.

    Blocking: call it from a worker thread in async code.
    """
    if not rows:
        return
    schema = SCHEMAS[table]
    columns = {name: [row.get(name) for row in rows] for name in schema.names}
    columns["hour"] = [hour_of(int(row["t_ms"])) for row in rows]
    data = pa.Table.from_pydict(columns, schema=schema.append(pa.field("hour", pa.string())))
    pq.write_to_dataset(
        data,
        str(Path(root) / table),
        partition_cols=["topic", "hour"],
        basename_template=f"part-{uuid.uuid4().hex}-{{i}}.parquet",
        existing_data_behavior="overwrite_or_ignore",
    )


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
