"""``controllerd record`` against a real etcd (and tansu for the audit topic)."""

from __future__ import annotations

import functools
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiokafka import AIOKafkaProducer

from controllerd import config as config_mod
from controllerd.adapters.store import Store
from controllerd.core.layout import initial_layout, split
from controllerd.core.model import layout_to_json
from controllerd.core.view import Keys
from controllerd.pipeline.history import DECISIONS, LAYOUTS, LOADS, read_table
from controllerd.pipeline.load import Skew, source_for
from controllerd.pipeline.recorder import ParquetSink, Recorder, follow_audit, record_from_config
from controllerd.pipeline.simulate import simulate
from controllerd.pipeline.traces import TraceOptions, import_history
from controllerd.pipeline.variants import REFERENCE_THRESHOLDS, controllerd
from tests.support.etcd import EtcdServer

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
    loads = read_table(tmp_path, LOADS).sort_by("mod_revision").to_pylist()
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
    async with anyio.create_task_group() as tg:
        follow = functools.partial(
            follow_audit,
            group_id=f"recorder-{uuid.uuid4().hex}",
            consumer_options={"session_timeout_ms": 2000, "heartbeat_interval_ms": 500},
        )
        await tg.start(follow, kafka_broker, topic, sink)
        await sink.wait_for(DECISIONS, 1)
        tg.cancel_scope.cancel()
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
    sink = ParquetSink(tmp_path)
    recorder = Recorder(keys, now_ms=lambda: T0 + 5_000)
    async with anyio.create_task_group() as tg:
        await tg.start(recorder.run, store, sink)
        tg.cancel_scope.cancel()
    await sink.flush()
    assert recorder.rejected == 3
    assert sink.counts == {LOADS: 1, LAYOUTS: 1, DECISIONS: 0}
    assert read_table(tmp_path, LOADS).column("segment_id").to_pylist() == [0]
