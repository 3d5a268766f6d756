"""The reference broker over real etcd, real Kafka (tansu) and real HTTP."""

from __future__ import annotations

import contextlib
import functools
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import anyio
import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import OffsetAndMetadata

from controllerd import config as config_mod
from controllerd.adapters.broker import (
    BrokerBug,
    BrokerClient,
    BrokerUnavailable,
    Conflict,
    Fenced,
    NotFound,
    PreconditionFailed,
)
from controllerd.adapters.store import Put, Store, StoreUnavailable, WatchEvent
from controllerd.core.layout import initial_layout, violations
from controllerd.core.loadreport import ReportRule
from controllerd.core.model import TopicName, layout_from_json, layout_to_json
from controllerd.core.shards import shard_name, shard_of
from controllerd.core.view import Keys
from controllerd.daemon.clock import ManualClock
from controllerd.daemon.ops import serve_ops
from controllerd.refbroker.kafka import KafkaBackend, TopicGone, open_kafka
from controllerd.refbroker.main import BrokerOptions, serve
from controllerd.refbroker.naming import seal_key, sealing_key, segment_topic, subscription_group
from controllerd.refbroker.reporter import LoadReporter
from controllerd.refbroker.server import RefBroker, Refused, make_app
from tests.support.broker import layout_json
from tests.support.etcd import EtcdServer

SHARDS = 16


def new_topic() -> TopicName:
    """A topic of its own: the tansu broker is shared by the whole session."""
    return TopicName("acme", "ns", f"t{uuid.uuid4().hex[:12]}")


@dataclass
class Ref:
    client: BrokerClient
    store: Store
    keys: Keys
    kafka: str
    clock: ManualClock
    leader_key: str
    token: int
    url: str
    topic: TopicName

    async def produce(self, descriptor: str, count: int, size: int = 100) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=self.kafka)
        await producer.start()
        try:
            for i in range(count):
                await producer.send_and_wait(
                    segment_topic(self.topic, descriptor),
                    b"x" * (size - 2),
                    key=b"%02d" % (i % 100),
                    partition=0,
                )
        finally:
            await producer.stop()

    async def commit(self, sub: str, descriptor: str, offset: int) -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.kafka,
            group_id=subscription_group(self.topic, sub),
            enable_auto_commit=False,
        )
        await consumer.start()
        try:
            tp = TopicPartition(segment_topic(self.topic, descriptor), 0)
            consumer.assign([tp])
            await consumer.commit({tp: OffsetAndMetadata(offset, "")})
        finally:
            await consumer.stop()

    async def layout_in_etcd(self) -> dict[str, object]:
        kv = await self.store.get(self.keys.layout(self.topic))
        assert kv is not None
        raw: dict[str, object] = json.loads(kv.value)
        return raw

    def shard_key(self, topic: TopicName) -> str:
        return f"{self.keys.controller_root}/shards/{shard_name(shard_of(topic, SHARDS))}"


async def elect(store: Store, key: str) -> int:
    """Put ``key`` afresh (as a winning campaign does); its create revision is the token."""
    await store.delete(key)
    return await store.put(key, b'{"replica": "test"}')


@contextlib.asynccontextmanager
async def open_ref(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    store: Store,
    kafka_broker: str,
    *,
    bearer: str | None = None,
) -> AsyncIterator[Ref]:
    """A running reference broker (its task group lives in the test's own task)."""
    cfg = config_mod.load(f'[etcd]\ncontroller_prefix = "{etcd_prefix}controllerd"\n')
    keys = Keys(f"{etcd_prefix}pulsar", cfg.controller_root)
    leader_key = f"{cfg.controller_root}/leader"
    token = await elect(store, leader_key)
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
        token=bearer,
        shards=SHARDS,
    )
    async with anyio.create_task_group() as tg:
        port = await tg.start(functools.partial(serve, options, clock=clock))
        url = f"http://127.0.0.1:{port}"
        async with BrokerClient(url, profile="reference", max_retries=0, token=bearer) as client:
            yield Ref(client, store, keys, kafka_broker, clock, leader_key, token, url, new_topic())
        tg.cancel_scope.cancel()


async def test_topic_lifecycle_and_k_way_split(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic = ref.topic
        await ref.client.create_topic(topic, 2)
        with pytest.raises(Conflict):
            await ref.client.create_topic(topic, 2)
        layout = await ref.client.get_layout(topic)
        assert [s.descriptor for s in layout.active_segments()] == ["0000-7fff-0", "8000-ffff-1"]
        assert str(topic) in await ref.client.list_topics("acme", "ns")  # client strips topic://
        await ref.produce("0000-7fff-0", 5)
        await ref.client.split(topic, 0, (0x2000, 0x4000, 0x6000), fencing_token=ref.token)
        stored = layout_from_json(await ref.layout_in_etcd())
        assert violations(stored) == []
        assert [s.segment_id for s in stored.active_segments()] == [2, 3, 4, 5, 1]
        seal = await ref.store.get(seal_key(ref.keys, topic, 0))
        assert seal is not None and json.loads(seal.value) == {"endOffset": 5}
        await ref.client.merge(topic, 5, 1, fencing_token=ref.token)
        stored = layout_from_json(await ref.layout_in_etcd())
        assert stored.segments[6].parent_ids == (5, 1) and stored.epoch == 2
        with pytest.raises(PreconditionFailed):
            await ref.client.merge(topic, 2, 4, fencing_token=ref.token)  # not adjacent
        with pytest.raises(NotFound):
            await ref.client.split(topic, 99, None, fencing_token=ref.token)
        await ref.client.delete_topic(topic)
        with pytest.raises(NotFound):
            await ref.client.get_layout(topic)


async def test_a_stale_fencing_token_cannot_change_the_layout(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        await ref.client.create_topic(ref.topic, 1)
        old = ref.token
        new = await elect(ref.store, ref.leader_key)  # another replica won since
        with pytest.raises(Fenced):
            await ref.client.split(ref.topic, 0, None, fencing_token=old)
        assert (await ref.client.get_layout(ref.topic)).epoch == 0
        await ref.client.split(ref.topic, 0, None, fencing_token=new)
        assert (await ref.client.get_layout(ref.topic)).epoch == 1


async def test_unfenced_mutations_are_refused_with_428(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic = ref.topic
        await ref.client.create_topic(topic, 2)  # topics and subscriptions stay unfenced
        await ref.client.create_subscription(topic, "s", "STREAM")
        async with httpx.AsyncClient(base_url=ref.url) as http:
            base = f"/admin/v2/scalable/{topic.tenant}/{topic.namespace}/{topic.topic}"
            segment = f"/admin/v2/segments/{topic.tenant}/{topic.namespace}/{topic.topic}"
            for method, path in [
                ("POST", f"{base}/split/0"),
                ("POST", f"{base}/merge/0/1"),
                ("DELETE", f"{segment}/0000-7fff-0"),
            ]:
                response = await http.request(method, path)
                assert response.status_code == 428, (method, path, response.text)
                assert response.json()["code"] == "fencing-required"
        assert (await ref.client.get_layout(topic)).epoch == 0
        await ref.client.delete_subscription(topic, "s")
        await ref.client.delete_topic(topic)


async def test_bearer_token_is_required_when_configured(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    secret = uuid.uuid4().hex
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker, bearer=secret) as ref:
        topic = ref.topic
        path = f"/admin/v2/scalable/{topic.tenant}/{topic.namespace}/{topic.topic}"
        async with httpx.AsyncClient(base_url=ref.url) as http:
            missing = await http.put(path)
            assert missing.status_code == 401
            assert missing.json()["code"] == "unauthenticated"
            assert missing.headers["www-authenticate"].startswith("Bearer")
            basic = await http.put(path, headers={"Authorization": f"Basic {secret}"})
            assert basic.status_code == 401
            wrong = await http.put(path, headers={"Authorization": "Bearer not-the-token"})
            assert wrong.status_code == 403 and wrong.json()["code"] == "forbidden"
            # authentication comes before fencing: no token, no 428 hint either
            split = await http.post(f"{path}/split/0")
            assert split.status_code == 401
        with pytest.raises(NotFound):
            await ref.client.get_layout(topic)  # nothing was created by the refused PUTs
        await ref.client.create_topic(topic, 1)  # the client library sends the token
        await ref.client.split(topic, 0, None, fencing_token=ref.token)
        assert (await ref.client.get_layout(topic)).epoch == 1
        async with BrokerClient(ref.url, profile="reference", max_retries=0) as anonymous:
            with pytest.raises(BrokerBug) as refused:
                await anonymous.get_layout(topic)
            assert refused.value.status == 401


async def test_shard_fencing_keys(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic, other = ref.topic, new_topic()
        while shard_of(other, SHARDS) == shard_of(topic, SHARDS):
            other = new_topic()
        await ref.client.create_topic(topic, 1)
        own = ref.shard_key(topic)
        own_token = await elect(ref.store, own)
        foreign = ref.shard_key(other)
        foreign_token = await elect(ref.store, foreign)
        base = f"/admin/v2/scalable/{topic.tenant}/{topic.namespace}/{topic.topic}"

        async def split(segment: int, key: str | None, token: int) -> httpx.Response:
            headers = {"X-Fencing-Token": str(token)}
            if key is not None:
                headers["X-Fencing-Key"] = key
            async with httpx.AsyncClient(base_url=ref.url) as http:
                return await http.post(f"{base}/split/{segment}", headers=headers)

        # another shard's key (even with its valid token) cannot fence this topic
        refused = await split(0, foreign, foreign_token)
        assert refused.status_code == 400 and refused.json()["code"] == "bad-fencing-key"
        refused = await split(0, f"{ref.keys.controller_root}/cooldowns/x", own_token)
        assert refused.status_code == 400 and refused.json()["code"] == "bad-fencing-key"
        # the leader key's token does not hold for the shard key
        stale = await split(0, own, ref.token)
        assert stale.status_code == 409 and stale.json()["code"] == "fenced"
        assert (await ref.client.get_layout(topic)).epoch == 0
        # this topic's shard key with its token: applied
        assert (await split(0, own, own_token)).status_code == 204
        assert (await ref.client.get_layout(topic)).epoch == 1
        # a new owner of the shard: the old owner's token is fenced, in the layout txn
        new_token = await elect(ref.store, own)
        stale = await split(1, own, own_token)
        assert stale.status_code == 409 and stale.json()["code"] == "fenced"
        assert (await split(1, own, new_token)).status_code == 204
        # no X-Fencing-Key: the leader key, as before sharding
        assert (await split(2, None, ref.token)).status_code == 204
        assert (await ref.client.get_layout(topic)).epoch == 3


async def test_backlog_and_delete_refuse_until_drained(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic, token = ref.topic, ref.token
        await ref.client.create_topic(topic, 1)
        await ref.client.create_subscription(topic, "s", "STREAM")
        await ref.produce("0000-ffff-0", 10)
        assert await ref.client.backlog(topic, "0000-ffff-0", "s") == 10
        assert await ref.client.backlog(topic, "0000-ffff-0", "nobody") is None
        with pytest.raises(PreconditionFailed):
            await ref.client.delete_segment(topic, "0000-ffff-0", fencing_token=token)  # active
        await ref.client.split(topic, 0, None, fencing_token=token)
        await ref.commit("s", "0000-ffff-0", 4)
        assert await ref.client.backlog(topic, "0000-ffff-0", "s") == 6
        with pytest.raises(Conflict) as refused:
            await ref.client.delete_segment(topic, "0000-ffff-0", fencing_token=token)
        assert refused.value.code == "backlog"
        await ref.commit("s", "0000-ffff-0", 10)
        with pytest.raises(Fenced):
            await ref.client.delete_segment(topic, "0000-ffff-0", fencing_token=token - 1)
        assert await ref.client.delete_segment(topic, "0000-ffff-0", fencing_token=token) is True
        assert await ref.client.delete_segment(topic, "0000-ffff-0", fencing_token=token) is False
        assert await ref.store.get(seal_key(ref.keys, topic, 0)) is None


async def test_the_load_reporter_measures_rates_from_kafka(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic = ref.topic
        await ref.client.create_topic(topic, 1)
        await ref.client.create_subscription(topic, "s", "STREAM")
        cfg = config_mod.Config()
        rule = ReportRule(cfg.policy.split_thresholds, cfg.policy.merge_thresholds)
        async with open_kafka(ref.kafka) as kafka:
            reporter = LoadReporter(ref.store, ref.keys, kafka, rule, ref.clock, 10.0)
            assert await reporter.report_once() == 0  # one reading is no rate yet
            await ref.produce("0000-ffff-0", 50, size=200)
            await ref.commit("s", "0000-ffff-0", 20)
            await ref.clock.advance(10.0)
            assert await reporter.report_once() == 1
            kv = await ref.store.get(ref.keys.load(topic, 0))
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


async def test_a_name_kafka_cannot_have_is_skipped_not_the_end_of_the_reporter(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    """The topics prefix is shared with Pulsar, whose names may hold dots; Kafka names
    here may not. Such a topic or subscription raised out of report_once, ending the
    reporter and the broker with it (and again after every restart)."""
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic = ref.topic
        await ref.client.create_topic(topic, 1)
        dotted = TopicName("acme.eu", "ns", "orders")
        await ref.store.put(ref.keys.subscription(topic, "my.sub"), b'{"type": "STREAM"}')
        cfg = config_mod.Config()
        rule = ReportRule(cfg.policy.split_thresholds, cfg.policy.merge_thresholds)
        async with open_kafka(ref.kafka) as kafka:
            reporter = LoadReporter(ref.store, ref.keys, kafka, rule, ref.clock, 10.0)
            await ref.store.put(ref.keys.layout(dotted), layout_json(initial_layout(1)))
            assert await reporter.report_once() == 0
            await ref.produce("0000-ffff-0", 50, size=200)
            await ref.clock.advance(10.0)
            assert await reporter.report_once() == 1  # the good topic is still measured
            assert reporter.unnamed == {str(dotted), f"{topic}/subscriptions/my.sub"}


@contextlib.asynccontextmanager
async def direct_broker(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> AsyncIterator[tuple[RefBroker, int]]:
    """The broker's operations called directly (no HTTP) on ``store``, which a test may
    wrap to inject an etcd fault, with the leader's fencing token."""
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd")
    leader_key = f"{keys.controller_root}/leader"
    token = await elect(store, leader_key)
    async with open_kafka(kafka_broker) as kafka:
        yield RefBroker(store, keys, kafka, ManualClock(), leader_key), token


class LostAnswers:
    """A store whose next transaction after :meth:`arm` etcd applies twice, returning
    the second answer: what the store's own retry sees after etcd applied the first
    attempt and its answer was lost (a timeout or a dropped connection)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def txn(self, compares: Any, success: Any, failure: Any = ()) -> Any:
        result = await self._store.txn(compares, success, failure)
        if self.armed and any(isinstance(op, Put) for op in success):
            self.armed = False
            result = await self._store.txn(compares, success, failure)
        return result


async def test_an_applied_split_or_create_whose_etcd_answer_was_lost_is_answered_done(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    """The retried transaction's compare fails on our own write; the broker answered 412
    (split: the segment is no longer active) or 409 (create: it exists) for an
    operation it did, and the controller recorded a failure and retried."""
    lossy = LostAnswers(store)
    async with direct_broker(cast(Store, lossy), etcd_prefix, kafka_broker) as (broker, token):
        topic = new_topic()
        lossy.armed = True
        await broker.create_topic(topic, 1)
        lossy.armed = True  # the seal's final transaction: layout, seal keys, intent
        layout = await broker.split(topic, 0, None, broker.fence(topic, token, None))
        assert [s.segment_id for s in layout.active_segments()] == [1, 2]
        stored, _ = await broker.read_layout(topic)
        assert stored == layout and await broker.seal_end(topic, 0) == 0


async def test_bad_names_and_unusable_stored_values_are_refused_with_a_reason(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    """Each of these answered a bare 500 (an unhandled ValueError) instead."""
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic = ref.topic
        await ref.client.create_topic(topic, 1)
        async with httpx.AsyncClient(base_url=ref.url) as http:
            base = f"/admin/v2/scalable/{topic.tenant}/{topic.namespace}"
            sub = await http.put(f"{base}/{topic.topic}/subscriptions/my.sub")
            assert sub.status_code == 400 and "my.sub" in sub.json()["reason"]
            long = await http.put(f"{base}/{'t' * 240}")
            assert long.status_code == 400 and "249" in long.json()["reason"]
            await ref.store.put(ref.keys.layout(topic), b"{not json")
            segment = f"/admin/v2/segments/{topic.tenant}/{topic.namespace}/{topic.topic}"
            gone = await http.delete(
                f"{segment}/0000-ffff-0", headers={"X-Fencing-Token": str(ref.token)}
            )
            assert gone.status_code == 500 and "unusable" in gone.json()["reason"]


def _stored_layout(**change: object) -> bytes:
    """A valid layout's JSON with top-level fields set (as text: ``change`` may hold
    what no encoder writes)."""
    text = json.dumps(layout_to_json(initial_layout(1)))
    for field, raw in change.items():
        text = text[:-1] + f', "{field}": {raw}}}'
    return text.encode()


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(_stored_layout(properties='{"k": "\\ud800"}'), id="lone-surrogate"),
        pytest.param(_stored_layout(extra="NaN"), id="nan"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deep"),
        # strict JSON, but the core's error message shows the value: RecursionError
        pytest.param(b'{"segments": ' + b"[" * 1000 + b"]" * 1000 + b"}", id="deep-in-message"),
        # strict JSON and a valid layout, but nested too deep to answer or write back
        pytest.param(_stored_layout(extra="[" * 990 + "]" * 990), id="deep-field"),
    ],
)
async def test_a_stored_layout_no_encoder_can_write_is_a_500_with_a_reason(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str, value: bytes
) -> None:
    """Stdlib json took a lone surrogate or NaN, which the answer's encoder refused, and
    raised RecursionError on a deep value: a bare 500 with a traceback each."""
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic = ref.topic
        await ref.client.create_topic(topic, 1)
        await ref.store.put(ref.keys.layout(topic), value)
        async with httpx.AsyncClient(base_url=ref.url) as http:
            got = await http.get(f"/admin/v2/scalable/{topic.path}")
        assert got.status_code == 500
        reason = got.json()["reason"]
        assert f"stored layout of {topic} is unusable" in reason and len(reason) <= 300


async def test_a_stored_layout_kafka_cannot_name_is_a_500_with_a_reason(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    """A hash range beyond 16 bits parsed, and deleting the topic raised ValueError out
    of segment_topic (a bare 500 with a traceback)."""
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic = ref.topic
        await ref.client.create_topic(topic, 1)
        wide = layout_to_json(initial_layout(1))
        wide["segments"]["0"]["hashRange"]["end"] = 0x1FFFF
        await ref.store.put(ref.keys.layout(topic), json.dumps(wide).encode())
        async with httpx.AsyncClient(base_url=ref.url) as http:
            for method in ("DELETE", "GET"):
                got = await http.request(method, f"/admin/v2/scalable/{topic.path}")
                assert got.status_code == 500
                assert "'0000-1ffff-0' is not a segment descriptor" in got.json()["reason"]
        assert await ref.store.get(ref.keys.layout(topic)) is not None  # nothing deleted


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(b'{"endOffset": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", id="deep"),
        pytest.param(b'{"endOffset": Infinity}', id="infinity"),  # int() raised OverflowError
    ],
)
async def test_an_unusable_stored_seal_is_a_500_with_a_reason(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str, value: bytes
) -> None:
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic = ref.topic
        await ref.client.create_topic(topic, 1)
        await ref.client.create_subscription(topic, "s", "STREAM")
        await ref.store.put(seal_key(ref.keys, topic, 0), value)
        path = f"/admin/v2/segments/{topic.path}/0000-ffff-0/subscription/s/backlog"
        async with httpx.AsyncClient(base_url=ref.url) as http:
            got = await http.get(path)
        assert got.status_code == 500
        assert f"stored seal of {topic} segment 0 is unusable" in got.json()["reason"]


async def test_a_descriptor_with_a_digit_kafka_cannot_name_is_not_a_segment(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    """``\\d`` took "٣" (Arabic-Indic three) as segment id 3; segment_topic then raised
    ValueError: a bare 500 with a traceback."""
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic = ref.topic
        await ref.client.create_topic(topic, 1)
        await ref.client.create_subscription(topic, "s", "STREAM")
        segment = f"/admin/v2/segments/{topic.path}/0000-ffff-\u0663"
        async with httpx.AsyncClient(base_url=ref.url) as http:
            backlog = await http.get(f"{segment}/subscription/s/backlog")
            delete = await http.delete(segment, headers={"X-Fencing-Token": str(ref.token)})
        for got in (backlog, delete):
            assert got.status_code == 404 and "not a segment descriptor" in got.json()["reason"]


async def test_a_repeated_create_never_brings_back_a_segment_gc_deleted(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    """A second PUT of a topic created its segments' Kafka topics before finding that the
    topic exists: a sealed segment GC had deleted came back, in no layout, for good."""
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic = ref.topic
        await ref.client.create_topic(topic, 1)
        await ref.client.split(topic, 0, None, fencing_token=ref.token)
        assert await ref.client.delete_segment(topic, "0000-ffff-0", fencing_token=ref.token)
        with pytest.raises(Conflict):
            await ref.client.create_topic(topic, 1)
        async with open_kafka(ref.kafka) as kafka:
            assert not await kafka.exists(segment_topic(topic, "0000-ffff-0"))


class SealKeyOutage:
    """A store that fails the first delete of a seal key (etcd down at that moment)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.failed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def delete(self, key: str) -> bool:
        if not self.failed and key.endswith("/seal"):
            self.failed = True
            raise StoreUnavailable("KV.DeleteRange: etcd unavailable")
        return await self._store.delete(key)


async def test_a_segment_delete_retried_after_etcd_failed_still_deletes_its_seal_key(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    """The Kafka topic went, the seal key's delete failed (503); the retry found the
    topic gone and answered 404 before the seal key, which stayed until the topic did."""
    outage = SealKeyOutage(store)
    async with direct_broker(cast(Store, outage), etcd_prefix, kafka_broker) as (broker, token):
        keys = broker.keys
        topic = new_topic()
        await broker.create_topic(topic, 1)
        fence = broker.fence(topic, token, None)
        await broker.split(topic, 0, None, fence)
        with pytest.raises(StoreUnavailable):
            await broker.delete_segment(topic, "0000-ffff-0", fence)
        assert await store.get(seal_key(keys, topic, 0)) is not None
        with pytest.raises(Refused) as retried:
            await broker.delete_segment(topic, "0000-ffff-0", fence)
        assert retried.value.status == 404
        assert await store.get(seal_key(keys, topic, 0)) is None


# --- atomic seal -------------------------------------------------------------------------------


async def test_the_seal_is_written_in_the_layout_transaction(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    """The sealed layout, every seal key and the end of the intent share one etcd revision."""
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic = ref.topic
        await ref.client.create_topic(topic, 2)
        await ref.produce("0000-7fff-0", 7)
        await ref.produce("8000-ffff-1", 3)
        start = await ref.store.get(ref.keys.layout(topic))
        assert start is not None
        events: list[WatchEvent] = []

        async def record() -> None:
            async for batch in ref.store.watch_prefix(
                ref.keys.layout(topic), start.mod_revision + 1
            ):
                events.extend(batch)

        async with anyio.create_task_group() as tg:
            tg.start_soon(record)
            await ref.client.merge(topic, 0, 1, fencing_token=ref.token)
            layout_kv = await ref.store.get(ref.keys.layout(topic))
            assert layout_kv is not None
            sealed_at = layout_kv.mod_revision

            def seen_layout() -> bool:
                return any(e.key == ref.keys.layout(topic) for e in events)

            with anyio.fail_after(5):
                while not seen_layout():  # noqa: ASYNC110 - the watch is another stream
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        intent = sealing_key(ref.keys, topic)
        seals = {seal_key(ref.keys, topic, 0): 7, seal_key(ref.keys, topic, 1): 3}
        put_intent = [e for e in events if e.key == intent and e.kind == "put"]
        assert len(put_intent) == 1
        assert json.loads(put_intent[0].value) == {"segments": [0, 1]}
        final = [e for e in events if e.mod_revision == sealed_at]
        assert {(e.key, e.kind) for e in final} == {
            (ref.keys.layout(topic), "put"),
            *((k, "put") for k in seals),
            (intent, "delete"),
        }
        assert {e.key: json.loads(e.value)["endOffset"] for e in final if e.key in seals} == seals
        assert put_intent[0].mod_revision < sealed_at  # the intent first, then the ends
        assert await ref.store.get(intent) is None


async def test_a_failed_seal_writes_nothing(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    """Kafka fails between the intent and the layout: no sealed layout, no seal, no intent."""
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic = ref.topic
        await ref.client.create_topic(topic, 1)
        await ref.produce("0000-ffff-0", 4)
        before = await ref.store.get(ref.keys.layout(topic))
        admin = AIOKafkaAdminClient(bootstrap_servers=ref.kafka)
        await admin.start()
        try:  # the parent's data vanishes behind the broker's back: its end cannot be read
            await admin.delete_topics([segment_topic(topic, "0000-ffff-0")])
        finally:
            await admin.close()
        async with BrokerClient(ref.url, profile="reference", max_retries=0) as client:
            with pytest.raises(BrokerUnavailable) as failed:
                await client.split(topic, 0, None, fencing_token=ref.token)
        assert failed.value.status == 503
        after = await ref.store.get(ref.keys.layout(topic))
        assert before is not None and after is not None
        assert after.mod_revision == before.mod_revision  # layout untouched: still active
        assert await ref.store.get(seal_key(ref.keys, topic, 0)) is None
        assert await ref.store.get(sealing_key(ref.keys, topic)) is None  # intent revoked


async def test_a_seal_in_progress_elsewhere_holds_a_split_back(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    """Another broker's live intent: no second seal; once it is gone the split goes through."""
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic = ref.topic
        await ref.client.create_topic(topic, 1)
        lease, _ = await ref.store.grant_lease(30)
        await ref.store.put(sealing_key(ref.keys, topic), b'{"segments": [0]}', lease=lease)
        with pytest.raises(Conflict) as refused:
            await ref.client.split(topic, 0, None, fencing_token=ref.token)
        assert refused.value.code == "conflict"
        assert (await ref.client.get_layout(topic)).epoch == 0
        await ref.store.revoke_lease(lease)  # that broker died: its lease ends the intent
        await ref.client.split(topic, 0, None, fencing_token=ref.token)
        assert (await ref.client.get_layout(topic)).epoch == 1


# --- deleted stays deleted -----------------------------------------------------------------


async def test_a_deleted_segment_is_not_recreated_by_a_metadata_refresh(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    cfg = config_mod.load(f'[etcd]\ncontroller_prefix = "{etcd_prefix}controllerd"\n')
    keys = Keys(f"{etcd_prefix}pulsar", cfg.controller_root)
    leader_key = f"{cfg.controller_root}/leader"
    token = await elect(store, leader_key)
    topic = new_topic()
    parent = segment_topic(topic, "0000-ffff-0")
    rule = ReportRule(cfg.policy.split_thresholds, cfg.policy.merge_thresholds)
    clock = ManualClock()
    async with open_kafka(kafka_broker) as kafka, anyio.create_task_group() as tg:
        broker = RefBroker(store, keys, kafka, clock, leader_key)
        reporter = LoadReporter(store, keys, kafka, rule, clock, 1.0)
        port = await tg.start(serve_ops, make_app(broker), "127.0.0.1", 0)
        async with BrokerClient(f"http://127.0.0.1:{port}", profile="reference") as client:
            await client.create_topic(topic, 1)
            await client.create_subscription(topic, "s", "STREAM")
            producer = AIOKafkaProducer(bootstrap_servers=kafka_broker)
            await producer.start()
            try:
                for i in range(5):
                    await producer.send_and_wait(parent, b"v", key=b"k%d" % i, partition=0)
            finally:
                await producer.stop()
            await reporter.report_once()  # measures the parent: end offset and a sample
            await clock.advance(1.0)
            assert await reporter.report_once() == 1
            await client.split(topic, 0, None, fencing_token=token)  # reads the parent's end
            assert await client.backlog(topic, "0000-ffff-0", "s") == 5
            consumer = AIOKafkaConsumer(
                bootstrap_servers=kafka_broker,
                group_id=subscription_group(topic, "s"),
                enable_auto_commit=False,
            )
            await consumer.start()
            try:
                tp = TopicPartition(parent, 0)
                consumer.assign([tp])
                await consumer.commit({tp: OffsetAndMetadata(5, "")})
            finally:
                await consumer.stop()
            assert await client.delete_segment(topic, "0000-ffff-0", fencing_token=token)
            await clock.advance(1.0)
            await reporter.report_once()  # measures the children, not the deleted parent
            await kafka.refresh_metadata()  # what the periodic refresh would do, now
            await kafka.end_offset(segment_topic(topic, "0000-7fff-1"))  # a new topic: a forced one
            assert not await kafka.exists(parent)
            admin = AIOKafkaAdminClient(bootstrap_servers=kafka_broker)
            await admin.start()
            try:
                assert parent not in await admin.list_topics()
            finally:
                await admin.close()
        tg.cancel_scope.cancel()


class DeletionLag:
    """An admin client whose listings still show the topics it deleted until :meth:`done`:
    Kafka deletes a topic asynchronously, after its DeleteTopics answer."""

    def __init__(self, admin: AIOKafkaAdminClient) -> None:
        self._admin = admin
        self.deleting: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._admin, name)

    async def delete_topics(self, names: list[str]) -> Any:
        answer = await self._admin.delete_topics(names)
        self.deleting.update(names)
        return answer

    async def list_topics(self) -> list[str]:
        return [*await self._admin.list_topics(), *self.deleting]

    def done(self) -> None:
        self.deleting.clear()


async def test_the_backend_forgets_a_deleted_segment_once_kafka_no_longer_lists_it(
    kafka_broker: str,
) -> None:
    """Every deleted name stayed in ``_deleted`` for the process's life (a name left only
    if created again, and segment names never repeat): GC churn grew it without bound."""
    topic = new_topic()
    names = [segment_topic(topic, f"0000-ffff-{sid}") for sid in range(20)]
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_broker)
    reader = AIOKafkaConsumer(bootstrap_servers=kafka_broker, enable_auto_commit=False)
    await admin.start()
    await reader.start()
    try:
        lag = DeletionLag(admin)
        kafka = KafkaBackend(cast(AIOKafkaAdminClient, lag), reader)
        await kafka.create_topics(names)
        for name in names:
            assert await kafka.delete_topic(name)
            # Still listed while Kafka deletes it: refused without naming it to the reader.
            with pytest.raises(TopicGone, match="was deleted"):
                await kafka.end_offset(name)
        assert kafka._deleted == set(names)  # no public view of it
        lag.done()
        assert not await kafka.exists(names[0])  # a listing that shows every delete done
        assert kafka._deleted == set()
        for name in names:  # refused now because no listing shows it
            with pytest.raises(TopicGone, match="does not exist"):
                await kafka.end_offset(name)
        await kafka.refresh_metadata()
        assert not set(names) & set(await admin.list_topics())  # none came back
    finally:
        await reader.stop()
        await admin.close()
