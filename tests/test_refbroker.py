"""The reference broker over real etcd, real Kafka (tansu) and real HTTP."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from controllerd import config as config_mod
from controllerd.adapters.broker import BrokerClient, Conflict, Fenced, NotFound, PreconditionFailed
from controllerd.adapters.store import Store
from controllerd.core.layout import violations
from controllerd.core.model import TopicName, layout_from_json
from controllerd.core.view import Keys
from controllerd.daemon.clock import ManualClock
from controllerd.refbroker.main import BrokerOptions, serve
from controllerd.refbroker.naming import seal_key, segment_topic, subscription_group
from controllerd.refbroker.reporter import LoadReporter
from tests.support.etcd import EtcdServer

TOPIC = TopicName("acme", "ns", "orders")


@dataclass
class Ref:
    client: BrokerClient
    store: Store
    keys: Keys
    kafka: str
    clock: ManualClock
    leader_key: str

    async def produce(self, descriptor: str, count: int, size: int = 100) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=self.kafka)
        await producer.start()
        try:
            for i in range(count):
                await producer.send_and_wait(
                    segment_topic(TOPIC, descriptor), b"x" * (size - 2), key=b"%02d" % (i % 100)
                )
        finally:
            await producer.stop()

    async def commit(self, sub: str, descriptor: str, offset: int) -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.kafka,
            group_id=subscription_group(TOPIC, sub),
            enable_auto_commit=False,
        )
        await consumer.start()
        try:
            tp = TopicPartition(segment_topic(TOPIC, descriptor), 0)
            consumer.assign([tp])
            await consumer.commit({tp: OffsetAndMetadata(offset, "")})
        finally:
            await consumer.stop()

    async def layout_in_etcd(self) -> dict[str, object]:
        kv = await self.store.get(self.keys.layout(TOPIC))
        assert kv is not None
        raw: dict[str, object] = json.loads(kv.value)
        return raw


@contextlib.asynccontextmanager
async def open_ref(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> AsyncIterator[Ref]:
    """A running reference broker (its task group lives in the test's own task)."""
    cfg = config_mod.load(f'[etcd]\ncontroller_prefix = "{etcd_prefix}controllerd"\n')
    keys = Keys(f"{etcd_prefix}pulsar", cfg.controller_root)
    leader_key = f"{cfg.controller_root}/leader"
    clock = ManualClock()
    options = BrokerOptions(
        etcd_server.endpoint,
        kafka_broker,
        "127.0.0.1",
        0,
        keys.metadata_prefix,
        leader_key,
        3600.0,
        cfg,
    )
    async with anyio.create_task_group() as tg:
        port = await tg.start(functools.partial(serve, options, clock=clock))
        async with BrokerClient(
            f"http://127.0.0.1:{port}", profile="reference", max_retries=0
        ) as client:
            yield Ref(client, store, keys, kafka_broker, clock, leader_key)
        tg.cancel_scope.cancel()


async def test_topic_lifecycle_and_k_way_split(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        await ref.client.create_topic(TOPIC, 2)
        with pytest.raises(Conflict):
            await ref.client.create_topic(TOPIC, 2)
        layout = await ref.client.get_layout(TOPIC)
        assert [s.descriptor for s in layout.active_segments()] == ["0000-7fff-0", "8000-ffff-1"]
        assert str(TOPIC) in await ref.client.list_topics("acme", "ns")  # client strips topic://
        await ref.produce("0000-7fff-0", 5)
        await ref.client.split(TOPIC, 0, (0x2000, 0x4000, 0x6000), fencing_token=None)
        stored = layout_from_json(await ref.layout_in_etcd())
        assert violations(stored) == []
        assert [s.segment_id for s in stored.active_segments()] == [2, 3, 4, 5, 1]
        seal = await ref.store.get(seal_key(ref.keys, TOPIC, 0))
        assert seal is not None and json.loads(seal.value) == {"endOffset": 5}
        await ref.client.merge(TOPIC, 5, 1, fencing_token=None)
        stored = layout_from_json(await ref.layout_in_etcd())
        assert stored.segments[6].parent_ids == (5, 1) and stored.epoch == 2
        with pytest.raises(PreconditionFailed):
            await ref.client.merge(TOPIC, 2, 4, fencing_token=None)  # not adjacent
        with pytest.raises(NotFound):
            await ref.client.split(TOPIC, 99, None, fencing_token=None)
        await ref.client.delete_topic(TOPIC)
        with pytest.raises(NotFound):
            await ref.client.get_layout(TOPIC)


async def test_a_stale_fencing_token_cannot_change_the_layout(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        await ref.client.create_topic(TOPIC, 1)
        await ref.store.put(ref.leader_key, b'{"replica": "a"}')
        old = await ref.store.get(ref.leader_key)
        assert old is not None
        await ref.store.delete(ref.leader_key)
        await ref.store.put(ref.leader_key, b'{"replica": "b"}')
        new = await ref.store.get(ref.leader_key)
        assert new is not None
        with pytest.raises(Fenced):
            await ref.client.split(TOPIC, 0, None, fencing_token=old.create_revision)
        assert (await ref.client.get_layout(TOPIC)).epoch == 0
        await ref.client.split(TOPIC, 0, None, fencing_token=new.create_revision)
        assert (await ref.client.get_layout(TOPIC)).epoch == 1


async def test_backlog_and_delete_refuse_until_drained(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        await ref.client.create_topic(TOPIC, 1)
        await ref.client.create_subscription(TOPIC, "s", "STREAM")
        await ref.produce("0000-ffff-0", 10)
        assert await ref.client.backlog(TOPIC, "0000-ffff-0", "s") == 10
        assert await ref.client.backlog(TOPIC, "0000-ffff-0", "nobody") is None
        with pytest.raises(PreconditionFailed):
            await ref.client.delete_segment(TOPIC, "0000-ffff-0", fencing_token=None)  # active
        await ref.client.split(TOPIC, 0, None, fencing_token=None)
        await ref.commit("s", "0000-ffff-0", 4)
        assert await ref.client.backlog(TOPIC, "0000-ffff-0", "s") == 6
        with pytest.raises(Conflict) as refused:
            await ref.client.delete_segment(TOPIC, "0000-ffff-0", fencing_token=None)
        assert refused.value.code == "backlog"
        await ref.commit("s", "0000-ffff-0", 10)
        assert await ref.client.delete_segment(TOPIC, "0000-ffff-0", fencing_token=None) is True
        assert await ref.client.delete_segment(TOPIC, "0000-ffff-0", fencing_token=None) is False
        assert await ref.store.get(seal_key(ref.keys, TOPIC, 0)) is None


async def test_the_load_reporter_measures_rates_from_kafka(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        await ref.client.create_topic(TOPIC, 1)
        await ref.client.create_subscription(TOPIC, "s", "STREAM")
        cfg = config_mod.Config()
        from controllerd.core.loadreport import ReportRule
        from controllerd.refbroker.kafka import open_kafka

        rule = ReportRule(cfg.policy.split_thresholds, cfg.policy.merge_thresholds)
        async with open_kafka(ref.kafka) as kafka:
            reporter = LoadReporter(ref.store, ref.keys, kafka, rule, ref.clock, 10.0)
            assert await reporter.report_once() == 0  # one reading is no rate yet
            await ref.produce("0000-ffff-0", 50, size=200)
            await ref.commit("s", "0000-ffff-0", 20)
            await ref.clock.advance(10.0)
            assert await reporter.report_once() == 1
            kv = await ref.store.get(ref.keys.load(TOPIC, 0))
            assert kv is not None
            record = json.loads(kv.value)
            assert record["msgRateIn"] == pytest.approx(5.0)
            assert record["msgRateOut"] == pytest.approx(2.0)
            assert record["byteRateIn"] == pytest.approx(5.0 * 200)
            assert record["sampledAtMs"] == record["changedAtMs"] == ref.clock.now_ms()
            # nothing moved: the dead-band rule keeps quiet until the heartbeat is due
            await ref.clock.advance(10.0)
            await ref.produce("0000-ffff-0", 50, size=200)
            await ref.commit("s", "0000-ffff-0", 40)
            assert await reporter.report_once() == 0
