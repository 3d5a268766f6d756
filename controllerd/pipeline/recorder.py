"""``controllerd record``: load history from etcd (and the audit topic) into Parquet.

The recorder reads the topics prefix once (one consistent snapshot) and then
follows it with one watch from the snapshot's revision, so no change between
the two is lost (:meth:`controllerd.adapters.store.Store.watch_prefix`). A watch
that etcd compacted away (after an outage longer than etcd keeps history) is
followed again from a new snapshot, of which only the keys changed meanwhile
are recorded; versions both written and overwritten meanwhile are lost. Once the
first snapshot is recorded, no etcd failure ends the run: it is logged
(``record.watch.failed``) and the watch retried from the last revision recorded. Layouts become
``layouts`` rows and tell it each segment's hash range; load records become
``loads`` rows carrying that range, so a recorded history replays on its own
(:func:`controllerd.pipeline.traces.import_history`). When ``[audit]`` names a
Kafka cluster, decisions become ``decisions`` rows. Rows are buffered and
appended as new Parquet files (see :mod:`controllerd.pipeline.history`) every
``flush_seconds``, when ``flush_rows`` are waiting, and on exit; audit offsets
are committed only after the rows they produced are on disk (at least once).

A value that does not parse, or that does not fit the history's columns, is
skipped and counted (``rejected``) when it is read, never fatal: an etcd key is
recorded again when next written, and a rejected audit record's offset is
committed like any other, so a restart does not read it again.
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

from controllerd.adapters import backoff
from controllerd.adapters.secrets import read_secret
from controllerd.adapters.store import Store, StoreError, WatchCompacted, open_store
from controllerd.config import Config
from controllerd.core.model import HASH_MAX, layout_from_json, load_sample_from_json
from controllerd.core.view import Keys
from controllerd.daemon.clock import SystemClock
from controllerd.errors import EXIT_UNAVAILABLE, OperatorError
from controllerd.pipeline.history import DECISIONS, LAYOUTS, LOADS, check_row, write_rows
from controllerd.pipeline.load import MAX_STAMP_MS

log = structlog.get_logger(__name__)

#: Rows buffered before a flush is forced, whatever the flush interval.
FLUSH_ROWS: Final = 50_000
#: Consumer group of the audit follower: offsets survive recorder restarts.
AUDIT_GROUP: Final = "controllerd-recorder"
#: Seconds an audit offset commit, or the consumer's stop, may take. aiokafka retries
#: a commit for as long as Kafka is away, under the sink's lock: every flush (the etcd
#: rows' too) and the final one at SIGTERM waited for it for ever.
AUDIT_KAFKA_TIMEOUT: Final = 10.0

#: Called as a flush takes the buffered rows; returns what to run once they are on disk.
Checkpoint = Callable[[], Callable[[], Awaitable[None]]]


@dataclass
class ParquetSink:
    """Buffers rows per table and appends them to the history under ``root``.

    Invariant: a row leaves the buffer only once it is on disk. A flush that is
    cancelled (SIGTERM) or fails leaves what it has not written for the next one.
    """

    root: Path
    flush_rows: int = FLUSH_ROWS
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys((LOADS, LAYOUTS, DECISIONS), 0)
    )
    _pending: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    _checkpoints: list[Checkpoint] = field(default_factory=list)
    _lock: anyio.Lock = field(default_factory=anyio.Lock)

    @property
    def pending(self) -> int:
        return sum(len(rows) for rows in self._pending.values())

    def add(self, table: str, row: dict[str, Any]) -> None:
        self._pending.setdefault(table, []).append(row)

    def on_flush(self, checkpoint: Checkpoint) -> None:
        """Call ``checkpoint`` as each flush takes the buffered rows, and await what it
        returns once they are on disk (e.g. commit the offsets of those rows).

        ``checkpoint`` runs in the same step as the flush takes the rows, so it
        sees exactly the state that produced them: rows added while the flush
        writes belong to the next flush, and to the next checkpoint.
        """
        self._checkpoints.append(checkpoint)

    def remove_on_flush(self, checkpoint: Checkpoint) -> None:
        self._checkpoints.remove(checkpoint)

    async def flush(self) -> None:
        """Write every buffered row, then run what the checkpoints returned.

        The writes are shielded from cancellation, so that a SIGTERM cannot
        come between taking rows out of the buffer and having them on disk; it
        waits for the writes under way, as the final flush of ``record`` would
        for the same rows. A write that fails puts its rows back.
        """
        async with self._lock:
            with anyio.CancelScope(shield=True):
                then = [checkpoint() for checkpoint in self._checkpoints]
                for table in list(self._pending):
                    rows = self._pending.pop(table)
                    try:
                        await anyio.to_thread.run_sync(write_rows, self.root, table, rows)
                    except BaseException:
                        self._pending[table] = rows + self._pending.get(table, [])
                        raise
                    self.counts[table] += len(rows)
            for follow_up in then:
                await follow_up()

    async def flush_if_full(self) -> None:
        if self.pending >= self.flush_rows:
            await self.flush()


class Recorder:
    """Turns etcd keys under the topics prefix into history rows.

    Invariant: a load row's range is the segment's range in the newest layout
    of its topic seen before it (None if that layout does not name the segment,
    or the topic has none). Only the newest layout's ranges are kept, so what
    the recorder holds follows the topics there are, not all there ever were.
    """

    def __init__(self, keys: Keys, now_ms: Callable[[], int]) -> None:
        self._keys = keys
        self._now_ms = now_ms
        self._ranges: dict[str, dict[int, tuple[int, int]]] = {}  # topic -> segment -> range
        self.rejected = 0

    def rows(self, key: str, value: bytes, mod_revision: int) -> tuple[str, dict[str, Any]] | None:
        """The history row for a put of ``key``, or None if it is not one we record."""
        parts = self._parts(key)
        try:
            if len(parts) == 3:
                return LAYOUTS, self._layout_row("/".join(parts), value, mod_revision)
            if len(parts) == 6 and parts[3] == "segments" and parts[5] == "load":
                return LOADS, self._load_row(
                    "/".join(parts[:3]), _segment_id(parts[4]), value, mod_revision
                )
        except (ValueError, OverflowError, RecursionError) as exc:
            # ValueError includes ModelError and UnicodeError; OverflowError: a number
            # literal beyond a float's range; RecursionError: a deeply nested value.
            self.rejected += 1
            log.warning("record.rejected", key=key, error=str(exc))
        return None

    def forget(self, key: str) -> None:
        """A delete of ``key``: a deleted layout takes its topic's ranges with it."""
        parts = self._parts(key)
        if len(parts) == 3:
            self._ranges.pop("/".join(parts), None)

    def _parts(self, key: str) -> list[str]:
        """``key``'s path under the topics prefix ([] if it is not under it)."""
        prefix = self._keys.topics_prefix
        return key[len(prefix) :].split("/") if key.startswith(prefix) else []

    def _layout_row(self, topic: str, value: bytes, mod_revision: int) -> dict[str, Any]:
        layout = layout_from_json(json.loads(value))
        ranges: dict[int, tuple[int, int]] = {}
        for seg in layout.segments.values():
            start, end = seg.hash_range.start, seg.hash_range.end
            if not 0 <= start <= end <= HASH_MAX:
                raise ValueError(
                    f"layout.segments[{seg.segment_id}].hashRange: {start}..{end} "
                    f"is not a range of 0..{HASH_MAX}"
                )
            ranges[seg.segment_id] = (start, end)
        row = {
            "topic": topic,
            "t_ms": self._now_ms(),
            "mod_revision": mod_revision,
            "epoch": layout.epoch,
            "active_segments": len(layout.active_segments()),
            "layout_json": value.decode(),
        }
        check_row(LAYOUTS, row)
        self._ranges[topic] = ranges  # only once the layout is taken
        return row

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
        start, end = self._ranges.get(topic, {}).get(segment_id, (None, None))
        r = sample.rates
        row = {
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
        check_row(LOADS, row)
        return row

    async def run(
        self,
        store: Store,
        sink: ParquetSink,
        *,
        task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Record the snapshot, report its revision as started, then follow the watch.

        Only the first snapshot may fail the run (etcd unreachable at start is the
        operator's to fix). Once started, etcd failures are ridden out as the
        daemon's follower does: a compacted watch (:class:`WatchCompacted`) is
        followed again from a new snapshot (:meth:`_snapshot`), and any other
        failure of the watch or of that snapshot is logged and retried with backoff
        from the last revision recorded, so no change is skipped.
        """
        prefix = self._keys.topics_prefix
        revision = await self._snapshot(store, sink, after=0)
        task_status.started(revision)
        failures = 0
        compacted = False
        while True:
            try:
                if compacted:
                    revision = await self._snapshot(store, sink, after=revision)
                    compacted, failures = False, 0
                async with aclosing(store.watch_prefix(prefix, revision + 1)) as batches:
                    async for batch in batches:
                        failures = 0
                        for event in batch:
                            if event.kind == "put":
                                self._add(sink, event.key, event.value, event.mod_revision)
                            else:
                                self.forget(event.key)
                        revision = batch[-1].mod_revision
                        await sink.flush_if_full()
            except WatchCompacted as exc:
                log.warning(
                    "record.watch.compacted", revision=revision, compact_revision=exc.revision
                )
                compacted = True
            except StoreError as exc:
                delay = backoff.ETCD.delay(failures)
                failures += 1
                log.warning(
                    "record.watch.failed",
                    revision=revision,
                    resnapshot=compacted,
                    error=str(exc),
                    retry_in_s=round(delay, 3),
                )
                await anyio.sleep(delay)

    async def _snapshot(self, store: Store, sink: ParquetSink, *, after: int) -> int:
        """Record the keys of a new snapshot written after revision ``after``; its revision.

        Every layout of the snapshot is the newest of its topic, so the ranges of
        topics without one (deleted meanwhile) are dropped; those of the others are
        the ones already held, or replaced by the layout recorded here.
        """
        kvs, revision = await store.get_prefix(self._keys.topics_prefix)
        topics = {"/".join(parts) for kv in kvs if len(parts := self._parts(kv.key)) == 3}
        self._ranges = {topic: r for topic, r in self._ranges.items() if topic in topics}
        # Layouts first, so that the snapshot's load rows know their ranges.
        for kv in sorted(kvs, key=lambda kv: kv.key.count("/")):
            if kv.mod_revision > after:
                self._add(sink, kv.key, kv.value, kv.mod_revision)
        return revision

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


def decision_row(record: object) -> dict[str, Any]:
    """A ``decisions`` row from an audit record (see :mod:`controllerd.adapters.audit`).

    Raises:
        ValueError: not an object with an integer ``ts_ms`` in 1970-9999 and an
            object (or nothing) as ``decision``, or a field the history cannot
            hold (:func:`controllerd.pipeline.history.check_row`).
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"audit record: expected an object, got {type(record).__name__}")
    decision = record.get("decision") or {}
    if not isinstance(decision, Mapping):
        raise ValueError(f"audit record: decision is a {type(decision).__name__}, not an object")
    ts_ms = record.get("ts_ms")
    if type(ts_ms) is not int or not 0 <= ts_ms <= MAX_STAMP_MS:
        got = ts_ms if type(ts_ms) is int else type(ts_ms).__name__
        raise ValueError(f"audit record: ts_ms is not a time in 1970-9999 (got {got})")
    row = {
        "topic": str(record.get("topic", "")),
        "t_ms": ts_ms,
        "action": str(decision.get("action", "")),
        "reason": str(decision.get("reason", "")),
        "detail": str(decision.get("detail", "")),
        "outcome": str(record.get("outcome", "")),
        "record_json": json.dumps(record, sort_keys=True),
    }
    check_row(DECISIONS, row)
    return row


class AuditRecorder:
    """Turns the audit topic's records into ``decisions`` rows.

    Invariant: every record consumed either has its row in the sink or is
    counted in ``rejected``; its offset is committed once the flush that took
    that row (or a later one) is on disk, a rejected record's like any other.
    """

    def __init__(self, kafka_timeout: float = AUDIT_KAFKA_TIMEOUT) -> None:
        self.rejected = 0
        #: offset commits given up (Kafka away): committed by a later flush, or read
        #: again after a restart (at least once)
        self.commits_failed = 0
        self._kafka_timeout = kafka_timeout

    def row(self, value: bytes | None, partition: int, offset: int) -> dict[str, Any] | None:
        """The row for one record's ``value``, or None (counted) if it is not usable."""
        try:
            if value is None:
                raise ValueError("no value (a tombstone)")
            return decision_row(json.loads(value))
        except (ValueError, OverflowError, RecursionError) as exc:
            # ValueError includes UnicodeError (bytes or text that is not UTF-8);
            # RecursionError: a deeply nested value.
            self.rejected += 1
            log.warning("record.audit.rejected", partition=partition, offset=offset, error=str(exc))
            return None

    async def run(
        self,
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

        def checkpoint() -> Callable[[], Awaitable[None]]:
            taken = dict(consumed)  # the offsets of exactly the rows the flush takes

            async def commit() -> None:
                ready = {tp: off for tp, off in taken.items() if committed.get(tp, 0) < off}
                if not ready:
                    return
                with anyio.move_on_after(self._kafka_timeout):
                    await consumer.commit(ready)
                    committed.update(ready)
                    return
                self.commits_failed += 1
                log.warning(
                    "record.audit.commit_failed",
                    error=f"no answer from Kafka in {self._kafka_timeout:g}s",
                    offsets={f"{tp.topic}/{tp.partition}": off for tp, off in ready.items()},
                )

            return commit

        await consumer.start()
        sink.on_flush(checkpoint)
        try:
            task_status.started()
            async for message in consumer:
                row = self.row(message.value, message.partition, message.offset)
                if row is not None:
                    sink.add(DECISIONS, row)
                # No await since the add: a flush takes the row and its offset together.
                consumed[TopicPartition(message.topic, message.partition)] = message.offset + 1
                await sink.flush_if_full()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await sink.flush()  # commits what it wrote
                finally:
                    sink.remove_on_flush(checkpoint)
                    with anyio.move_on_after(self._kafka_timeout) as stopping:
                        await consumer.stop()
                    if stopping.cancelled_caught:
                        log.warning("record.audit.stop_abandoned", timeout_s=self._kafka_timeout)


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
    """What a ``record`` run wrote (rows per table) and skipped (etcd values and audit
    records that did not parse or did not fit the history)."""

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
    reached at start is an :class:`OperatorError` (``EXIT_UNAVAILABLE``) naming
    the setting; etcd failing later is retried (:meth:`Recorder.run`). The rows
    buffered so far are flushed however it ends.
    """
    from aiokafka.errors import KafkaError

    sink = ParquetSink(out)
    clock = SystemClock()
    recorder = Recorder(Keys(cfg.metadata_prefix, cfg.controller_root), clock.now_ms)
    audit = AuditRecorder()
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
                            audit.run,
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
    rejected = recorder.rejected + audit.rejected
    log.info(
        "record.stopped",
        rows=sink.counts,
        rejected=rejected,
        audit_commits_failed=audit.commits_failed,
    )
    return Recorded(dict(sink.counts), rejected)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
