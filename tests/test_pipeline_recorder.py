"""``controllerd record`` against a real etcd (and tansu for the audit topic)."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Coroutine, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.to_thread
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from controllerd import config as config_mod
from controllerd.adapters.store import (
    Store,
    open_store,
)
from controllerd.core.layout import initial_layout, split
from controllerd.core.model import layout_to_json
from controllerd.core.view import Keys
from controllerd.pipeline.history import (
    DECISIONS,
    LAYOUTS,
    LOADS,
    hour_of,
    read_table,
    write_rows,
)
from controllerd.pipeline.load import Skew, source_for
from controllerd.pipeline.recorder import (
    AUDIT_GROUP,
    AuditRecorder,
    ParquetSink,
    Recorder,
    decision_row,
    record_from_config,
)
from controllerd.pipeline.simulate import simulate
from controllerd.pipeline.traces import TraceOptions, import_history
from controllerd.pipeline.variants import REFERENCE_THRESHOLDS, controllerd
from tests.support.daemon import wait_until
from tests.support.etcd import EtcdServer, FailingStore, compact
from tests.support.kafka import run_tansu
from tests.support.proxy import serve_proxy

HOUR_MS = 3_600_000
T0 = 1_760_000_000_000 - 1_760_000_000_000 % HOUR_MS  # an hour boundary
TOPIC = "acme/ns/orders"


class WatchedSink(ParquetSink):
    """A sink that lets the test wait for rows instead of sleeping."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.added: dict[str, int] = {}
        self.changed = anyio.Event()

    def add(self, table: str, row: dict[str, Any]) -> None:
        super().add(table, row)
        self.added[table] = self.added.get(table, 0) + 1
        self.changed.set()

    async def wait_for(self, table: str, count: int) -> None:
        with anyio.fail_after(10):
            while self.added.get(table, 0) < count:
                self.changed = anyio.Event()
                await self.changed.wait()


def follow(audit: AuditRecorder, group_id: str) -> functools.partial[Coroutine[Any, Any, None]]:
    """``audit.run`` in its own consumer group, with a quick group join."""
    return functools.partial(
        audit.run,
        group_id=group_id,
        consumer_options={"session_timeout_ms": 2000, "heartbeat_interval_ms": 500},
    )


async def produce(bootstrap: str, topic: str, values: Sequence[bytes | None]) -> None:
    """``values`` as records of ``topic``'s partition 0, in order (None: a tombstone)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(topic, value, key=b"k", partition=0)
    finally:
        await producer.stop()


async def committed(bootstrap: str, group_id: str, topic: str) -> int | None:
    """The offset ``group_id`` has committed on ``topic``'s partition 0 (None: none yet)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group_id)
    await consumer.start()
    try:
        offset: int | None = await consumer.committed(TopicPartition(topic, 0))
        return offset
    finally:
        await consumer.stop()


def load(msg_rate: float, t_ms: int) -> bytes:
    return json.dumps(
        {
            "msgRateIn": msg_rate,
            "byteRateIn": msg_rate * 1000,
            "msgRateOut": msg_rate,
            "byteRateOut": msg_rate * 1000,
            "sampledAtMs": t_ms,
            "changedAtMs": t_ms,
        }
    ).encode()


async def test_records_snapshot_and_watch_as_parquet_by_topic_and_hour(
    store: Store, etcd_prefix: str, tmp_path: Path
) -> None:
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd/default")
    layout = initial_layout(2, now_ms=T0)
    topic = f"{keys.topics_prefix}{TOPIC}"
    await store.put(topic, json.dumps(layout_to_json(layout)).encode())
    await store.put(f"{topic}/segments/0/load", load(12_000.0, T0 + 1_000))
    await store.put(f"{topic}/subscriptions/sub", b'{"type": "STREAM"}')  # not recorded
    sink = WatchedSink(tmp_path)
    recorder = Recorder(keys, now_ms=lambda: T0 + 5_000)
    async with anyio.create_task_group() as tg:
        revision = await tg.start(recorder.run, store, sink)
        assert revision > 0 and sink.added == {LAYOUTS: 1, LOADS: 1}
        await store.put(f"{topic}/segments/1/load", load(300.0, T0 + 2_000))
        after = split(layout, 0, now_ms=T0 + HOUR_MS)
        await store.put(topic, json.dumps(layout_to_json(after)).encode())
        await store.put(f"{topic}/segments/2/load", load(6_000.0, T0 + HOUR_MS + 60_000))
        await store.put(f"{topic}/segments/3/load", load(5_500.0, T0 + HOUR_MS + 61_000))
        await store.put(f"{topic}/segments/9/load", b"{not json")
        # garbage that parses: times with no calendar hour, an int64 overflow, deep nesting
        await store.put(f"{topic}/segments/9/load", load(1.0, 99_999_999_999_999_999))
        await store.put(f"{topic}/segments/9/load", load(1.0, -62_135_596_800_001))
        bad = json.loads(load(1.0, T0))
        bad["changedAtMs"] = 10**23
        await store.put(f"{topic}/segments/9/load", json.dumps(bad).encode())
        await store.put(f"{topic}/segments/9/load", b"[" * 100_000)
        await store.put(f"{topic}/segments/4/load", load(1.0, T0 + HOUR_MS + 62_000))
        await sink.wait_for(LOADS, 5)
        tg.cancel_scope.cancel()
    await sink.flush()
    assert recorder.rejected == 5  # each skipped and counted; the recorder carries on
    assert sink.counts == {LOADS: 5, LAYOUTS: 2, DECISIONS: 0}

    hours = sorted(p.name for p in (tmp_path / LOADS / "topic=acme%2Fns%2Forders").iterdir())
    assert len(hours) == 2 and all(h.startswith("hour=") for h in hours)
    loads = recorded_loads(tmp_path)
    assert [r["topic"] for r in loads] == [TOPIC] * 5
    assert [(r["segment_id"], r["range_start"], r["range_end"]) for r in loads] == [
        (0, 0, 0x7FFF),
        (1, 0x8000, 0xFFFF),
        (2, 0, 0x3FFF),
        (3, 0x4000, 0x7FFF),
        (4, None, None),  # no layout named segment 4: kept, but it cannot be replayed
    ]
    layouts = read_table(tmp_path, LAYOUTS).sort_by("mod_revision").to_pylist()
    assert [(r["epoch"], r["active_segments"]) for r in layouts] == [(0, 2), (1, 3)]

    (trace,) = import_history(tmp_path, TraceOptions())
    assert trace.name == TOPIC and trace.kind == "history" and len(trace.t_ms) == 4
    result = simulate(source_for(trace, Skew(), 0), controllerd(), REFERENCE_THRESHOLDS)
    # 12,000 msg/s recorded on half the range: the replay splits the whole topic, then
    # that half again once its own record shows it is still above the threshold.
    assert [op.start for op in result.operations] == [0, 0]
    assert result.metrics.merges == 0


async def test_record_command_wiring_flushes_the_snapshot_on_exit(
    etcd_server: EtcdServer, store: Store, etcd_prefix: str, tmp_path: Path
) -> None:
    cfg = config_mod.load(
        f'[etcd]\nendpoints = ["{etcd_server.endpoint}"]\nmetadata_prefix = "{etcd_prefix}pulsar"\n'
    )
    topic = f"{etcd_prefix}pulsar/topics/{TOPIC}"
    await store.put(topic, json.dumps(layout_to_json(initial_layout(1))).encode())
    await store.put(f"{topic}/segments/0/load", load(10.0, T0))
    async with anyio.create_task_group() as tg:
        await tg.start(record_from_config, cfg, tmp_path, None, 3600.0)
        tg.cancel_scope.cancel()
    assert read_table(tmp_path, LOADS).num_rows == 1
    assert read_table(tmp_path, LAYOUTS).num_rows == 1


async def test_audit_records_become_decision_rows(kafka_broker: str, tmp_path: Path) -> None:
    topic = f"audit-{uuid.uuid4().hex}"
    record = {
        "ts_ms": T0,
        "topic": TOPIC,
        "decision": {
            "action": "split",
            "segments": [0],
            "boundaries": [32768],
            "reason": "msgRateIn",
            "detail": "hot",
        },
        "outcome": "ok",
    }
    producer = AIOKafkaProducer(bootstrap_servers=kafka_broker)
    await producer.start()
    try:
        await producer.send_and_wait(topic, json.dumps(record).encode(), partition=0)
        await producer.send_and_wait(topic, b"not json", partition=0)
    finally:
        await producer.stop()
    sink = WatchedSink(tmp_path)
    audit = AuditRecorder()
    async with anyio.create_task_group() as tg:
        await tg.start(follow(audit, f"recorder-{uuid.uuid4().hex}"), kafka_broker, topic, sink)
        await sink.wait_for(DECISIONS, 1)
        tg.cancel_scope.cancel()
    assert audit.rejected == 1
    rows = read_table(tmp_path, DECISIONS).to_pylist()
    assert [(r["topic"], r["action"], r["reason"], r["outcome"]) for r in rows] == [
        (TOPIC, "split", "msgRateIn", "ok")
    ]
    assert json.loads(rows[0]["record_json"]) == record


@pytest.mark.parametrize("level", ["error", "debug"])
async def test_record_prints_only_its_summary_on_stdout_and_logs_as_configured(
    etcd_server: EtcdServer, store: Store, etcd_prefix: str, tmp_path: Path, level: str
) -> None:
    topic = f"{etcd_prefix}pulsar/topics/{TOPIC}"
    await store.put(topic, json.dumps(layout_to_json(initial_layout(1))).encode())
    await store.put(f"{topic}/segments/0/load", load(10.0, T0))
    config = tmp_path / "c.toml"
    config.write_text(
        f'[etcd]\nendpoints = ["{etcd_server.endpoint}"]\n'
        f'metadata_prefix = "{etcd_prefix}pulsar"\n'
        f'[logging]\nlevel = "{level}"\nformat = "json"\n',
        encoding="utf-8",
    )
    proc = await anyio.run_process(
        [
            sys.executable,
            "-m",
            "controllerd.cli",
            "record",
            "--config",
            str(config),
            "--out",
            str(tmp_path / "h"),
            "--duration",
            "1",
        ],
        check=False,
    )
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, stderr
    assert stdout.splitlines() == [
        "1 loads rows, 1 layouts rows, 0 decisions rows, 0 malformed values skipped"
    ]
    logged = [json.loads(line) for line in stderr.splitlines()]
    if level == "error":
        assert logged == []
    else:
        assert any(entry["level"] == "debug" for entry in logged), logged


def recorded_loads(root: Path) -> list[dict[str, Any]]:
    """The load rows recorded under ``root``, in etcd's order."""
    rows: list[dict[str, Any]] = read_table(root, LOADS).sort_by("mod_revision").to_pylist()
    return rows


async def record_snapshot(store: Store, keys: Keys, root: Path) -> tuple[Recorder, ParquetSink]:
    """Record etcd's snapshot under ``keys`` into ``root`` (then stop), flushed."""
    sink = ParquetSink(root)
    recorder = Recorder(keys, now_ms=lambda: T0 + 5_000)
    async with anyio.create_task_group() as tg:
        await tg.start(recorder.run, store, sink)
        tg.cancel_scope.cancel()
    await sink.flush()
    return recorder, sink


async def test_a_segment_id_parquet_cannot_hold_is_skipped_and_the_buffer_kept(
    store: Store, etcd_prefix: str, tmp_path: Path
) -> None:
    """A load key whose segment id does not fit int64 ended the flush (OverflowError)
    and lost the good rows buffered with it."""
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd/default")
    topic = f"{keys.topics_prefix}{TOPIC}"
    await store.put(topic, json.dumps(layout_to_json(initial_layout(1, now_ms=T0))).encode())
    await store.put(f"{topic}/segments/0/load", load(10.0, T0))
    await store.put(f"{topic}/segments/{2**63}/load", load(10.0, T0))
    await store.put(f"{topic}/segments/99999999999999999999/load", load(10.0, T0))
    await store.put(f"{topic}/segments/-1/load", load(10.0, T0))
    recorder, sink = await record_snapshot(store, keys, tmp_path)
    assert recorder.rejected == 3
    assert sink.counts == {LOADS: 1, LAYOUTS: 1, DECISIONS: 0}
    assert read_table(tmp_path, LOADS).column("segment_id").to_pylist() == [0]


AUDIT_RECORD = {"ts_ms": T0, "topic": TOPIC, "decision": {"action": "split"}, "outcome": "ok"}


def layout_json(**changes: Any) -> dict[str, Any]:
    """A one-segment layout's JSON, with ``changes`` applied to its top level."""
    return {**layout_to_json(initial_layout(1, now_ms=T0)), **changes}


async def test_a_number_beyond_a_float_is_skipped_and_counted(
    store: Store, etcd_prefix: str, tmp_path: Path
) -> None:
    """A rate written as a 401-digit integer raised OverflowError out of the parse,
    which ended the recorder (exit 70) instead of skipping the value."""
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd/default")
    topic = f"{keys.topics_prefix}{TOPIC}"
    huge = "1" + "0" * 400
    await store.put(topic, json.dumps(layout_to_json(initial_layout(2, now_ms=T0))).encode())
    sink = WatchedSink(tmp_path)
    recorder = Recorder(keys, now_ms=lambda: T0 + 5_000)
    async with anyio.create_task_group() as tg:
        await tg.start(recorder.run, store, sink)
        await store.put(f"{topic}/segments/0/load", load(10.0, T0))
        bad = json.loads(load(1.0, T0))
        peak = {**bad, "msgRateIn": "HUGE"}
        for record in (peak, {**bad, "peakRates": peak}, {**bad, "rise": "HUGE"}):
            text = json.dumps(record).replace('"HUGE"', huge)
            await store.put(f"{topic}/segments/1/load", text.encode())
        await store.put(f"{topic}/segments/1/load", load(20.0, T0 + 1))
        await sink.wait_for(LOADS, 2)
        tg.cancel_scope.cancel()
    await sink.flush()
    assert recorder.rejected == 3
    rows = recorded_loads(tmp_path)
    assert [(r["segment_id"], r["msg_rate_in"]) for r in rows] == [(0, 10.0), (1, 20.0)]


async def test_a_layout_or_topic_the_history_cannot_hold_is_skipped_at_ingest(
    store: Store, etcd_prefix: str, tmp_path: Path
) -> None:
    """Values that parse but fit no column (an epoch beyond int64, a hash range beyond
    int32) or no directory (a topic name too long, or with a NUL) were taken, then
    failed the flush: the recorder ended (exit 70) and lost every row buffered."""
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd/default")
    prefix = keys.topics_prefix
    good = layout_to_json(initial_layout(1, now_ms=T0))
    await store.put(f"{prefix}{TOPIC}", json.dumps(good).encode())
    await store.put(f"{prefix}{TOPIC}/segments/0/load", load(10.0, T0))
    await store.put(f"{prefix}a/b/epoch", json.dumps(layout_json(epoch=2**63)).encode())
    for name, (start, end) in {"wide": (0, 2**31), "outside": (0, 0x10000), "back": (9, 8)}.items():
        bad = layout_json()
        bad["segments"]["0"]["hashRange"] = {"start": start, "end": end}
        await store.put(f"{prefix}a/b/{name}", json.dumps(bad).encode())
    for name in ("x" * 250, "nul\x00"):
        await store.put(f"{prefix}a/b/{name}", json.dumps(good).encode())
        await store.put(f"{prefix}a/b/{name}/segments/0/load", load(10.0, T0))
    recorder, sink = await record_snapshot(store, keys, tmp_path)
    assert recorder.rejected == 8
    assert sink.counts == {LOADS: 1, LAYOUTS: 1, DECISIONS: 0}
    assert read_table(tmp_path, LOADS).column("topic").to_pylist() == [TOPIC]
    assert read_table(tmp_path, LAYOUTS).column("topic").to_pylist() == [TOPIC]


async def test_bad_audit_records_are_skipped_counted_and_committed(
    kafka_broker: str, tmp_path: Path
) -> None:
    """Audit records that were not an object, nested too deep, timed outside 1970-9999
    or held a lone surrogate ended the recorder (some at the flush, losing its rows);
    their offset was never committed, so every restart ended on them again."""
    topic = f"audit-{uuid.uuid4().hex}"
    good = json.dumps(AUDIT_RECORD).encode()
    bad: list[bytes | None] = [
        b"[1]",
        b'"x"',
        b"[" * 100_000,
        json.dumps({**AUDIT_RECORD, "ts_ms": 10**16}).encode(),
        json.dumps({**AUDIT_RECORD, "ts_ms": 2**63}).encode(),
        json.dumps({**AUDIT_RECORD, "ts_ms": -1}).encode(),
        b'{"ts_ms": %d, "topic": "x\\ud800", "decision": {}}' % T0,
        b'{"ts_ms": %d, "decision": {"action": "\\udfff"}}' % T0,
        json.dumps({**AUDIT_RECORD, "decision": [1]}).encode(),
        b"not json",
        None,
    ]
    await produce(kafka_broker, topic, [good, *bad, good])
    sink = WatchedSink(tmp_path)
    audit = AuditRecorder()
    group = f"recorder-{uuid.uuid4().hex}"
    async with anyio.create_task_group() as tg:
        await tg.start(follow(audit, group), kafka_broker, topic, sink)
        await sink.wait_for(DECISIONS, 2)
        tg.cancel_scope.cancel()
    assert audit.rejected == len(bad)
    assert read_table(tmp_path, DECISIONS).column("action").to_pylist() == ["split"] * 2
    assert await committed(kafka_broker, group, topic) == len(bad) + 2


async def test_record_counts_rejected_audit_records_in_its_summary(
    etcd_server: EtcdServer, etcd_prefix: str, kafka_broker: str, tmp_path: Path
) -> None:
    """The summary counted only etcd's rejected values, not the audit topic's."""
    topic = f"audit-{uuid.uuid4().hex}"
    good = json.dumps(AUDIT_RECORD).encode()
    await produce(kafka_broker, topic, [good, b"not json", None, good])
    config = tmp_path / "c.toml"
    config.write_text(
        f'[etcd]\nendpoints = ["{etcd_server.endpoint}"]\n'
        f'metadata_prefix = "{etcd_prefix}pulsar"\n'
        f'[audit]\nkafka_bootstrap = "{kafka_broker}"\ntopic = "{topic}"\n'
        '[logging]\nlevel = "error"\n',
        encoding="utf-8",
    )
    command = [sys.executable, "-m", "controllerd.cli", "record", "--config", str(config)]
    command += ["--out", str(tmp_path / "h"), "--flush-seconds", "0.05"]
    async with await anyio.open_process(command) as proc:

        async def all_committed_or_ended() -> bool:
            done = await committed(kafka_broker, AUDIT_GROUP, topic) == 4
            return done or proc.returncode is not None

        try:
            await wait_until(all_committed_or_ended, within=30)
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        await proc.wait()
        assert proc.stdout is not None and proc.stderr is not None
        stdout = b"".join([chunk async for chunk in proc.stdout]).decode()
        stderr = b"".join([chunk async for chunk in proc.stderr]).decode()
    assert proc.returncode == 0, stderr
    assert stdout.splitlines() == [
        "0 loads rows, 0 layouts rows, 2 decisions rows, 2 malformed values skipped"
    ]


def two_table_rows() -> list[tuple[str, dict[str, Any]]]:
    """A layout row and a load row, as the recorder makes them."""
    keys = Keys("/r/pulsar", "/r/controllerd/default")
    recorder = Recorder(keys, now_ms=lambda: T0)
    topic = f"{keys.topics_prefix}{TOPIC}"
    made = [
        recorder.rows(topic, json.dumps(layout_json()).encode(), 1),
        recorder.rows(f"{topic}/segments/0/load", load(1.0, T0), 2),
    ]
    return [row for row in made if row is not None]


class BusyDisk:
    """Holds the one worker thread anyio is let use, as a slow disk holds a write: a
    flush takes its rows, then waits for the thread until :meth:`free`.

    Enter it inside the task group whose tasks flush, so that it frees the
    thread (on its exit) before the group waits for them.
    """

    def __init__(self) -> None:
        self._limiter = anyio.to_thread.current_default_thread_limiter()
        self._tokens = self._limiter.total_tokens
        self._held = False

    async def __aenter__(self) -> BusyDisk:
        self._limiter.total_tokens = 1
        await self._limiter.acquire()
        self._held = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.free()
        self._limiter.total_tokens = self._tokens

    async def writer_waiting(self) -> None:
        """Wait until a write waits for the thread (the flush has taken its rows)."""

        async def waiting() -> bool:
            return self._limiter.statistics().tasks_waiting > 0

        await wait_until(waiting, within=10)

    def free(self) -> None:
        if self._held:
            self._held = False
            self._limiter.release()


async def test_a_flush_cancelled_while_it_writes_loses_no_table(tmp_path: Path) -> None:
    """SIGTERM during a periodic flush: the flush had taken every table's rows, the
    cancellation ended it before it wrote them, and the final flush found none."""
    sink = ParquetSink(tmp_path)
    for table, row in two_table_rows():
        sink.add(table, row)
    async with anyio.create_task_group() as tg, BusyDisk() as disk:
        tg.start_soon(sink.flush)
        await disk.writer_waiting()
        tg.cancel_scope.cancel()  # what the signal handler does
    await sink.flush()  # the final flush
    assert sink.counts == {LOADS: 1, LAYOUTS: 1, DECISIONS: 0}
    assert (read_table(tmp_path, LOADS).num_rows, read_table(tmp_path, LAYOUTS).num_rows) == (1, 1)


async def test_audit_offsets_are_committed_only_for_rows_on_disk(
    kafka_broker: str, tmp_path: Path
) -> None:
    """A record consumed while a flush wrote was committed by that flush, before its
    row was on disk: a crash then lost it for good."""
    topic = f"audit-{uuid.uuid4().hex}"
    record = json.dumps(AUDIT_RECORD).encode()
    await produce(kafka_broker, topic, [record])
    sink = WatchedSink(tmp_path)
    group = f"recorder-{uuid.uuid4().hex}"
    async with anyio.create_task_group() as tg:
        await tg.start(follow(AuditRecorder(), group), kafka_broker, topic, sink)
        await sink.wait_for(DECISIONS, 1)
        async with anyio.create_task_group() as flushing, BusyDisk() as disk:
            flushing.start_soon(sink.flush)
            await disk.writer_waiting()
            await produce(kafka_broker, topic, [record])
            await sink.wait_for(DECISIONS, 2)  # consumed while the flush writes
        assert read_table(tmp_path, DECISIONS).num_rows == 1
        assert await committed(kafka_broker, group, topic) == 1
        tg.cancel_scope.cancel()
    assert read_table(tmp_path, DECISIONS).num_rows == 2
    assert await committed(kafka_broker, group, topic) == 2


async def test_audit_recording_flushes_and_stops_with_kafka_gone(tmp_path: Path) -> None:
    """aiokafka retries an offset commit for as long as Kafka is away, and the commit
    ran under the sink's lock: with Kafka gone after records were consumed, every
    later flush (the etcd rows' too) and the stop at SIGTERM waited for ever. Now a
    commit, and the consumer's stop, are given up after ``kafka_timeout``; the rows
    are on disk and their offsets are read again after a restart (at least once)."""
    topic = f"audit-{uuid.uuid4().hex}"
    record = json.dumps(AUDIT_RECORD).encode()
    sink = WatchedSink(tmp_path / "out")
    audit = AuditRecorder(kafka_timeout=1.0)
    with ExitStack() as kafka:
        bootstrap = kafka.enter_context(run_tansu(tmp_path / "tansu.log"))
        await produce(bootstrap, topic, [record] * 3)
        async with anyio.create_task_group() as tg:
            await tg.start(follow(audit, f"recorder-{uuid.uuid4().hex}"), bootstrap, topic, sink)
            await sink.wait_for(DECISIONS, 3)
            kafka.close()  # tansu stopped; the 3 offsets are not committed
            with anyio.fail_after(30):  # a hang guard: each flush waits 1 s for Kafka
                await sink.flush()
                sink.add(DECISIONS, decision_row(AUDIT_RECORD))  # e.g. an etcd row
                await sink.flush()
            # What SIGTERM does. The final flush and the consumer's stop are shielded
            # (no hang guard reaches them): before, this never returned.
            tg.cancel_scope.cancel()
    assert read_table(tmp_path / "out", DECISIONS).num_rows == 4
    assert audit.commits_failed >= 1


async def test_a_compacted_watch_is_followed_again_from_a_new_snapshot(
    etcd_server: EtcdServer, store: Store, etcd_prefix: str, tmp_path: Path
) -> None:
    """etcd compacted the revisions the recorder missed while it could not reach etcd:
    the watch's WatchCompacted ended it with "etcd ... is unreachable" (exit 3)."""
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd/default")
    topic, gone = f"{keys.topics_prefix}{TOPIC}", f"{keys.topics_prefix}acme/ns/gone"
    for name in (topic, gone):
        await store.put(name, json.dumps(layout_to_json(initial_layout(1, now_ms=T0))).encode())
    await store.put(f"{topic}/segments/0/load", load(1.0, T0))
    sink = WatchedSink(tmp_path)
    recorder = Recorder(keys, now_ms=lambda: T0 + 5_000)
    async with (
        serve_proxy(etcd_server.endpoint) as proxy,
        open_store([proxy.endpoint], timeout=0.5, retry_for=0.5) as cut_off,
        anyio.create_task_group() as tg,
    ):
        await tg.start(recorder.run, cut_off, sink)
        await store.put(f"{topic}/segments/0/load", load(1.5, T0 + 1))
        await sink.wait_for(LOADS, 2)  # the watch is up: the cut below comes after its creation
        await proxy.set_mode("refuse")
        await store.delete_prefix(gone)
        await store.put(f"{topic}/segments/0/load", load(2.0, T0 + 2))
        revision = await store.put(f"{topic}/segments/0/load", load(3.0, T0 + 3))
        await compact(etcd_server.endpoint, revision)
        await proxy.set_mode("pass")
        await sink.wait_for(LOADS, 3)
        await store.put(f"{topic}/segments/0/load", load(4.0, T0 + 4))
        await store.put(f"{gone}/segments/0/load", load(5.0, T0 + 5))
        await sink.wait_for(LOADS, 5)
        tg.cancel_scope.cancel()
    await sink.flush()
    assert recorder.rejected == 0
    rows = recorded_loads(tmp_path)
    # the snapshot's record, the watch's, the newest one written while the recorder
    # was cut off (not the one it overwrote), and both written after: the deleted
    # topic's without a range
    assert [(r["msg_rate_in"], r["range_end"]) for r in rows] == [
        (1.0, 0xFFFF),
        (1.5, 0xFFFF),
        (3.0, 0xFFFF),
        (4.0, 0xFFFF),
        (5.0, None),
    ]
    assert read_table(tmp_path, LAYOUTS).num_rows == 2  # the unchanged layout is not repeated


async def test_etcd_failing_after_the_start_ends_no_recording_and_loses_no_change(
    etcd_server: EtcdServer, store: Store, etcd_prefix: str, tmp_path: Path
) -> None:
    """The watch failing for a reason other than a transport failure (gRPC INTERNAL
    when the connection was cut while the watch was being created, etcd cancelling
    it), or the new snapshot after a compaction failing, ended a running ``record``
    with "etcd ... is unreachable" (exit 3). Now each is retried, from the last
    revision recorded: here the watch fails while a record is overwritten and etcd
    compacts, and the new snapshot's first read fails too."""
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd/default")
    topic = f"{keys.topics_prefix}{TOPIC}"
    await store.put(topic, json.dumps(layout_to_json(initial_layout(1, now_ms=T0))).encode())
    await store.put(f"{topic}/segments/0/load", load(1.0, T0))
    sink = WatchedSink(tmp_path)
    recorder = Recorder(keys, now_ms=lambda: T0 + 5_000)
    failing = FailingStore(store)
    async with anyio.create_task_group() as tg:
        await tg.start(recorder.run, cast(Store, failing), sink)
        await sink.wait_for(LOADS, 1)
        await store.put(f"{topic}/segments/0/load", load(2.0, T0 + 2))
        revision = await store.put(f"{topic}/segments/0/load", load(3.0, T0 + 3))
        await compact(etcd_server.endpoint, revision)
        failing.fail_reads = True
        failing.release.set()
        await sink.wait_for(LOADS, 2)  # the new snapshot's, after its failed first read
        await store.put(f"{topic}/segments/0/load", load(4.0, T0 + 4))
        await sink.wait_for(LOADS, 3)
        tg.cancel_scope.cancel()
    await sink.flush()
    assert failing.watches >= 2
    assert failing.failed_reads == 1
    assert recorder.rejected == 0
    assert [r["msg_rate_in"] for r in recorded_loads(tmp_path)] == [1.0, 3.0, 4.0]


async def test_a_load_takes_no_range_from_a_layout_no_longer_there(
    store: Store, etcd_prefix: str, tmp_path: Path
) -> None:
    """The recorder kept every range of every layout it had seen, for ever: a segment
    the newest layout no longer names, or a deleted topic's, still had its old range
    (and the map grew with every split, merge and topic)."""
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd/default")
    topic = f"{keys.topics_prefix}{TOPIC}"
    before = layout_to_json(split(initial_layout(1, now_ms=T0), 0, now_ms=T0))
    after = {**before, "segments": {k: v for k, v in before["segments"].items() if k != "0"}}
    sink = WatchedSink(tmp_path)
    recorder = Recorder(keys, now_ms=lambda: T0 + 5_000)
    async with anyio.create_task_group() as tg:
        await tg.start(recorder.run, store, sink)
        await store.put(topic, json.dumps(before).encode())
        await store.put(topic, json.dumps(after).encode())  # the GC dropped segment 0
        await store.put(f"{topic}/segments/0/load", load(1.0, T0))
        await store.put(f"{topic}/segments/1/load", load(2.0, T0))
        await store.delete_prefix(topic)
        await store.put(f"{topic}/segments/1/load", load(3.0, T0))
        await sink.wait_for(LOADS, 3)
        tg.cancel_scope.cancel()
    await sink.flush()
    rows = recorded_loads(tmp_path)
    assert [(r["segment_id"], r["range_start"], r["range_end"]) for r in rows] == [
        (0, None, None),
        (1, 0, 0x7FFF),
        (1, None, None),
    ]


def test_a_write_killed_midway_leaves_the_history_readable(tmp_path: Path) -> None:
    """A process killed while it wrote a Parquet file left it truncated under its final
    name, and every later read of the history failed on it."""
    (table, row), *_ = (r for r in two_table_rows() if r[0] == LOADS)
    write_rows(tmp_path, table, [row])
    script = (
        "import json, resource, signal, sys\n"
        "from controllerd.pipeline.history import LOADS, write_rows\n"
        "row = json.loads(sys.argv[2])\n"
        "rows = [dict(row, mod_revision=i, hash_buckets=[i / 7] * 32) for i in range(50_000)]\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the kernel kills\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (65_536, 65_536))  # a file past 64 KiB\n"
        "write_rows(sys.argv[1], LOADS, rows)\n"
    )
    command = [sys.executable, "-B", "-c", script, str(tmp_path), json.dumps(row)]
    killed = subprocess.run(command, check=False)
    assert killed.returncode == -signal.SIGXFSZ
    assert read_table(tmp_path, LOADS).to_pylist() == [{**row, "hour": hour_of(T0)}]
