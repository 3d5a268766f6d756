"""The decision audit sink against a real Kafka-compatible broker (tansu), and without one."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import uuid
from pathlib import Path
from types import MappingProxyType
from typing import Any

import anyio
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from controllerd.adapters import audit as audit_mod
from controllerd.adapters.audit import AuditSink, open_audit
from controllerd.config import AuditSettings
from controllerd.core.model import Split, decision_to_json
from controllerd.daemon.metrics import Metrics
from tests.support.kafka import free_port, kafka_broker, run_tansu  # noqa: F401


def _record(topic: str, n: int) -> dict[str, Any]:
    return {
        "ts_ms": 1_760_000_000_000 + n,
        "topic": topic,
        "decision": decision_to_json(Split(3, (0x4000,), "msgRateIn")),
        "inputs": {"active": 2, "msgRateIn": {"3": 25_000.0}},
        "fencing_token": 42,
        "outcome": "ok",
        "replica": "test-1",
    }


def _count(metrics: Metrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "controllerd_audit_messages_total", {"outcome": outcome}
    )
    assert value is not None
    return value


async def _read(bootstrap: str, topic: str, expected: int) -> list[tuple[bytes, Any]]:
    """Keys and decoded values of the first ``expected`` records of partition 0."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False
    )
    await consumer.start()
    try:
        partition = TopicPartition(topic, 0)
        consumer.assign([partition])
        await consumer.seek_to_beginning(partition)
        records: list[tuple[bytes, Any]] = []
        with anyio.fail_after(10):
            while len(records) < expected:
                batch = await consumer.getmany(partition, timeout_ms=500)
                records += [(r.key, json.loads(r.value)) for r in batch.get(partition, [])]
        return records
    finally:
        await consumer.stop()


async def test_records_arrive_as_json(kafka_broker: str) -> None:  # noqa: F811
    topic = f"controllerd.decisions.{uuid.uuid4().hex}"
    settings = AuditSettings(kafka_bootstrap=kafka_broker, topic=topic)
    metrics = Metrics()
    async with open_audit(settings, metrics.audit_messages) as sink:
        for n in range(3):
            sink.publish(_record("t/ns/a", n))
        # Any Mapping is an object; JSON has no infinity, so it becomes a string.
        sink.publish({**_record("t/ns/b", 3), "inputs": MappingProxyType({"ratio": math.inf})})

    assert _count(metrics, "sent") == 4
    assert _count(metrics, "dropped") == 0
    records = await _read(kafka_broker, topic, 4)
    assert [key for key, _ in records] == [b"t/ns/a"] * 3 + [b"t/ns/b"]
    assert [value for _, value in records[:3]] == [_record("t/ns/a", n) for n in range(3)]
    assert records[3][1]["inputs"] == {"ratio": "inf"}


async def test_unserialisable_record_is_an_error_not_an_exception(
    kafka_broker: str,  # noqa: F811
) -> None:
    settings = AuditSettings(kafka_bootstrap=kafka_broker, topic=f"audit.{uuid.uuid4().hex}")
    metrics = Metrics()
    async with open_audit(settings, metrics.audit_messages) as sink:
        sink.publish({"topic": "t/ns/a", "inputs": object()})
    assert _count(metrics, "error") == 1
    assert _count(metrics, "sent") == 0


async def test_kafka_down_never_blocks_publish() -> None:
    settings = AuditSettings(
        kafka_bootstrap=f"127.0.0.1:{free_port()}", topic="decisions", buffer_size=100
    )
    metrics = Metrics()
    # A hang guard, not a timing: the close is bounded by close_timeout (0.5 s) plus
    # the producer's stop; a wall-clock bound on either failed on a loaded CI host.
    with anyio.fail_after(30):
        async with open_audit(settings, metrics.audit_messages, close_timeout=0.5) as sink:
            # publish is plain synchronous code: it cannot wait on the network, and
            # beyond the buffer it drops the oldest rather than wait for room.
            assert not inspect.iscoroutinefunction(sink.publish)
            for n in range(5000):
                sink.publish(_record("t/ns/a", n))
            assert _count(metrics, "dropped") == 4900  # the oldest beyond the buffer
            await anyio.sleep(0.3)  # the sender is failing to connect meanwhile
    assert _count(metrics, "dropped") == 5000  # the buffered 100 at close
    assert _count(metrics, "sent") == 0


async def test_buffered_records_are_delivered_once_kafka_is_up(tmp_path: Path) -> None:
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    topic = f"audit.{uuid.uuid4().hex}"
    metrics = Metrics()
    async with open_audit(
        AuditSettings(kafka_bootstrap=bootstrap, topic=topic), metrics.audit_messages
    ) as sink:
        for n in range(5):
            sink.publish(_record("t/ns/a", n))
        await anyio.sleep(0.5)  # a few failed connection attempts
        with run_tansu(tmp_path / "tansu.log", port):
            records = await _read(bootstrap, topic, 5)
            assert [value["ts_ms"] for _, value in records] == [
                _record("t/ns/a", n)["ts_ms"] for n in range(5)
            ]
    assert _count(metrics, "sent") == 5


async def test_unconfigured_sink_is_a_no_op() -> None:
    metrics = Metrics()
    async with open_audit(AuditSettings(), metrics.audit_messages) as sink:
        assert type(sink) is AuditSink
        sink.publish(_record("t/ns/a", 0))
    for outcome in ("sent", "dropped", "error"):
        assert _count(metrics, outcome) == 0


class _AcksTheFirstOnly:
    """Stands for a broker that acknowledges one record of a batch and hangs on the next
    (a lost response: cannot be made to happen on demand with a real broker, whose
    acknowledgements of one request arrive together)."""

    def __init__(self, **_: object) -> None:
        self.sent = 0

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def send(self, topic: str, value: bytes, key: bytes | None = None) -> Any:
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.sent += 1
        if self.sent == 1:
            future.set_result("acknowledged")
        return future


class _NoAdmin:
    """An admin client whose broker cannot create topics (the sink goes on without)."""

    def __init__(self, **_: object) -> None:
        return None

    async def start(self) -> None:
        raise OSError("no admin here")

    async def close(self) -> None:
        return None


async def test_a_record_sent_before_close_cuts_its_batch_short_is_not_counted_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every record is counted once: the first of a batch is sent, the close's grace runs
    out while the second waits for its acknowledgement, and only that one is dropped."""
    monkeypatch.setattr(audit_mod, "AIOKafkaProducer", _AcksTheFirstOnly)
    monkeypatch.setattr(audit_mod, "AIOKafkaAdminClient", _NoAdmin)
    metrics = Metrics()
    settings = AuditSettings(kafka_bootstrap="127.0.0.1:9", topic="decisions")
    async with open_audit(settings, metrics.audit_messages, close_timeout=0.2) as sink:
        sink.publish(_record("t/ns/a", 0))
        sink.publish(_record("t/ns/a", 1))
        await anyio.sleep(0.2)
    assert (_count(metrics, "sent"), _count(metrics, "dropped")) == (1, 1)
