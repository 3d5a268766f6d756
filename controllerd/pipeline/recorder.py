"""``controllerd record``: load history from etcd (and the audit topic) into Parquet.

The recorder reads the topics prefix once (one consistent snapshot) and then
follows it with one watch from the snapshot's revision, so no change between
the two is lost (:meth:`controllerd.adapters.store.Store.watch_prefix`). Layouts become
``layouts`` rows and tell it each segment's hash range; load records become
``loads`` rows carrying that range, so a recorded history replays on its own
(:func:`controllerd.pipeline.traces.import_history`). When ``[audit]`` names a
Kafka cluster, decisions become ``decisions`` rows. Rows are buffered and
appended as new Parquet files (see :mod:`controllerd.pipeline.history`) every
``flush_seconds``, when ``flush_rows`` are waiting, and on exit; audit offsets
are committed only after the rows they produced are on disk (at least once).

A value that does not parse is skipped and counted (``rejected``), never fatal.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Awaitable, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import structlog
from anyio.abc import TaskStatus

from controllerd.adapters.secrets import read_secret
from controllerd.adapters.store import Store, StoreError, open_store
from controllerd.config import Config
from controllerd.core.model import ModelError, layout_from_json, load_sample_from_json
from controllerd.core.view import Keys
from controllerd.daemon.clock import SystemClock
from controllerd.errors import EXIT_UNAVAILABLE, OperatorError
from controllerd.pipeline.history import DECISIONS, LAYOUTS, LOADS, write_rows
from controllerd.pipeline.load import MAX_STAMP_MS

log = structlog.get_logger(__name__)

#: Rows buffered before a flush is forced, whatever the flush interval.
FLUSH_ROWS: Final = 50_000
#: Consumer group of the audit follower: offsets survive recorder restarts.
AUDIT_GROUP: Final = "controllerd-recorder"


@dataclass
class ParquetSink:
    """Buffers rows per table and appends them to the history under ``root``."""

    root: Path
    flush_rows: int = FLUSH_ROWS
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys((LOADS, LAYOUTS, DECISIONS), 0)
    )
    _pending: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    _after_flush: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    _lock: anyio.Lock = field(default_factory=anyio.Lock)

    @property
    def pending(self) -> int:
        return sum(len(rows) for rows in self._pending.values())

    def add(self, table: str, row: dict[str, Any]) -> None:
        self._pending.setdefault(table, []).append(row)

    def after_flush(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run ``callback`` after every flush (e.g. commit the offsets now on disk)."""
        self._after_flush.append(callback)

    def remove_after_flush(self, callback: Callable[[], Awaitable[None]]) -> None:
        self._after_flush.remove(callback)

    async def flush(self) -> None:
        async with self._lock:
            batches, self._pending = self._pending, {}
            for table, rows in batches.items():
                await anyio.to_thread.run_sync(write_rows, self.root, table, rows)
                self.counts[table] += len(rows)
            for callback in self._after_flush:
                await callback()

    async def flush_if_full(self) -> None:
        if self.pending >= self.flush_rows:
            await self.flush()


class Recorder:
    """Turns etcd keys under the topics prefix into history rows.

    Invariant: a load row's range is the segment's range in the newest layout
    seen before it (None if no layout has named the segment yet).
    """

    def __init__(self, keys: Keys, now_ms: Callable[[], int]) -> None:
        self._keys = keys
        self._now_ms = now_ms
        self._ranges: dict[tuple[str, int], tuple[int, int]] = {}
        self.rejected = 0

    def rows(self, key: str, value: bytes, mod_revision: int) -> tuple[str, dict[str, Any]] | None:
        """The history row for a put of ``key``, or None if it is not one we record."""
        prefix = self._keys.topics_prefix
        if not key.startswith(prefix):
            return None
        parts = key[len(prefix) :].split("/")
        try:
            if len(parts) == 3:
                return LAYOUTS, self._layout_row("/".join(parts), value, mod_revision)
            if len(parts) == 6 and parts[3] == "segments" and parts[5] == "load":
                return LOADS, self._load_row(
                    "/".join(parts[:3]), _segment_id(parts[4]), value, mod_revision
                )
        except (ModelError, ValueError, RecursionError) as exc:
            # RecursionError: json.loads of a deeply nested value
            self.rejected += 1
            log.warning("record.rejected", key=key, error=str(exc))
        return None

    def _layout_row(self, topic: str, value: bytes, mod_revision: int) -> dict[str, Any]:
        layout = layout_from_json(json.loads(value))
        for seg in layout.segments.values():
            self._ranges[(topic, seg.segment_id)] = (seg.hash_range.start, seg.hash_range.end)
        return {
            "topic": topic,
            "t_ms": self._now_ms(),
            "mod_revision": mod_revision,
            "epoch": layout.epoch,
            "active_segments": len(layout.active_segments()),
            "layout_json": value.decode(),
        }

    def _load_row(
        self, topic: str, segment_id: int, value: bytes, mod_revision: int
    ) -> dict[str, Any]:
        now = self._now_ms()
        sample = load_sample_from_json(json.loads(value), f"load[{segment_id}]", seen_at_ms=now)
        for name, stamp in (
            ("sampledAtMs", sample.sampled_at_ms),
            ("changedAtMs", sample.changed_at_ms),
        ):
            if stamp is not None and not 0 <= stamp <= MAX_STAMP_MS:
                # Parquet holds int64 and the hour partition needs a calendar date.
                raise ValueError(f"load[{segment_id}].{name}: {stamp} is not a time in 1970-9999")
        start, end = self._ranges.get((topic, segment_id), (None, None))
        r = sample.rates
        return {
            "topic": topic,
            "t_ms": sample.sampled_at_ms if sample.sampled_at_ms is not None else now,
            "observed_at_ms": now,
            "mod_revision": mod_revision,
            "segment_id": segment_id,
            "range_start": start,
            "range_end": end,
            "msg_rate_in": r.msg_rate_in,
            "byte_rate_in": r.byte_rate_in,
            "msg_rate_out": r.msg_rate_out,
            "byte_rate_out": r.byte_rate_out,
            "changed_at_ms": sample.changed_at_ms,
            "sampled_at_ms": sample.sampled_at_ms,
            "hash_buckets": list(sample.hash_buckets) if sample.hash_buckets else None,
        }

    async def run(
        self,
        store: Store,
        sink: ParquetSink,
        *,
        task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Record the snapshot, report its revision as started, then follow the watch."""
        prefix = self._keys.topics_prefix
        kvs, revision = await store.get_prefix(prefix)
        # Layouts first, so that the snapshot's load rows know their ranges.
        for kv in sorted(kvs, key=lambda kv: kv.key.count("/")):
            self._add(sink, kv.key, kv.value, kv.mod_revision)
        task_status.started(revision)
        async with aclosing(store.watch_prefix(prefix, revision + 1)) as batches:
            async for batch in batches:
                for event in batch:
                    if event.kind == "put":
                        self._add(sink, event.key, event.value, event.mod_revision)
                await sink.flush_if_full()

    def _add(self, sink: ParquetSink, key: str, value: bytes, mod_revision: int) -> None:
        row = self.rows(key, value, mod_revision)
        if row is not None:
            sink.add(*row)


def _segment_id(text: str) -> int:
    """A load key's segment id, which Parquet stores as int64.

    Raises:
        ValueError: not an integer in 0..2**63-1. Checked here, where the key is
            skipped and counted, because at the flush it would end the recorder and
            lose every row buffered with it.
    """
    number = int(text)
    if not 0 <= number < 2**63:
        raise ValueError(f"segment id {text} is not in 0..2**63-1")
    return number


def decision_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """A ``decisions`` row from an audit record (see :mod:`controllerd.adapters.audit`)."""
    decision = record.get("decision") or {}
    if not isinstance(decision, Mapping) or not isinstance(record.get("ts_ms"), int):
        raise ValueError("audit record without decision or ts_ms")
    return {
        "topic": str(record.get("topic", "")),
        "t_ms": int(record["ts_ms"]),
        "action": str(decision.get("action", "")),
        "reason": str(decision.get("reason", "")),
        "detail": str(decision.get("detail", "")),
        "outcome": str(record.get("outcome", "")),
        "record_json": json.dumps(record, sort_keys=True),
    }


async def follow_audit(
    bootstrap: str,
    topic: str,
    sink: ParquetSink,
    *,
    group_id: str = AUDIT_GROUP,
    consumer_options: Mapping[str, Any] | None = None,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Record every audit record; commit offsets only once their rows are flushed."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group_id,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        **dict(consumer_options or {}),
    )
    consumed: dict[TopicPartition, int] = {}
    committed: dict[TopicPartition, int] = {}

    async def commit() -> None:
        ready = {tp: off for tp, off in consumed.items() if committed.get(tp) != off}
        if ready:
            await consumer.commit(ready)
            committed.update(ready)

    await consumer.start()
    sink.after_flush(commit)
    try:
        task_status.started()
        async for message in consumer:
            try:
                sink.add(DECISIONS, decision_row(json.loads(message.value)))
            except (ValueError, TypeError) as exc:
                log.warning("record.audit.rejected", offset=message.offset, error=str(exc))
            consumed[TopicPartition(message.topic, message.partition)] = message.offset + 1
            await sink.flush_if_full()
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await sink.flush()  # commits what it wrote
            finally:
                sink.remove_after_flush(commit)
                await consumer.stop()


async def _flush_every(sink: ParquetSink, seconds: float) -> None:
    while True:
        await anyio.sleep(seconds)
        await sink.flush()


async def _stop_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return


def _cause(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of ``kinds`` in ``exc`` or, for a group, in its members."""
    if isinstance(exc, kinds):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _cause(inner, kinds)) is not None:
                return found
    return None


@dataclass(frozen=True, slots=True)
class Recorded:
    """What a ``record`` run wrote (rows per table) and skipped (values that did not parse)."""

    rows: dict[str, int]
    rejected: int

    def summary(self) -> str:
        tables = ", ".join(f"{n} {table} rows" for table, n in self.rows.items())
        return f"{tables}, {self.rejected} malformed values skipped"


async def record_from_config(
    cfg: Config,
    out: Path,
    duration: float | None,
    flush_seconds: float,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> Recorded:
    """Record until ``duration`` elapses or SIGINT/SIGTERM; returns what it wrote and skipped.

    ``task_status`` is started once etcd's snapshot is recorded (and the audit
    consumer joined); ``duration`` counts from then, so a run never ends
    "successfully" without having read etcd. etcd or Kafka that cannot be
    reached is an :class:`OperatorError` (``EXIT_UNAVAILABLE``) naming the
    setting. The rows buffered so far are flushed however it ends.
    """
    from aiokafka.errors import KafkaError

    sink = ParquetSink(out)
    clock = SystemClock()
    recorder = Recorder(Keys(cfg.metadata_prefix, cfg.controller_root), clock.now_ms)
    password = read_secret(cfg.etcd.password_file, "etcd.password_file")
    try:
        async with open_store(
            cfg.etcd.endpoints,
            username=cfg.etcd.username,
            password=password,
            ca_file=cfg.etcd.ca_file,
            cert_file=cfg.etcd.cert_file,
            key_file=cfg.etcd.key_file,
            timeout=cfg.etcd.timeout_seconds,
        ) as store:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_stop_on_signal, tg.cancel_scope, name="signals")
                    tg.start_soon(_flush_every, sink, flush_seconds, name="flusher")
                    await tg.start(recorder.run, store, sink, name="etcd-recorder")
                    if cfg.audit.kafka_bootstrap:
                        await tg.start(
                            follow_audit,
                            cfg.audit.kafka_bootstrap,
                            cfg.audit.topic,
                            sink,
                            name="audit-recorder",
                        )
                    log.info("record.started", out=str(out))
                    task_status.started()
                    if duration is not None:
                        await anyio.sleep(duration)
                        tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):
                    await sink.flush()
    except (StoreError, KafkaError, BaseExceptionGroup) as exc:
        etcd = _cause(exc, (StoreError,))
        if etcd is not None:
            endpoints = ", ".join(cfg.etcd.endpoints)
            raise OperatorError(
                f"etcd at {endpoints} is unreachable: {_first_line(etcd)}",
                exit_code=EXIT_UNAVAILABLE,
                setting="etcd.endpoints",
            ) from None
        kafka = _cause(exc, (KafkaError,))
        if kafka is not None:
            raise OperatorError(
                f"Kafka at {cfg.audit.kafka_bootstrap} is unreachable: {_first_line(kafka)}",
                exit_code=EXIT_UNAVAILABLE,
                setting="audit.kafka_bootstrap",
            ) from None
        raise
    log.info("record.stopped", rows=sink.counts, rejected=recorder.rejected)
    return Recorded(dict(sink.counts), recorder.rejected)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
