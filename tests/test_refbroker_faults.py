"""The reference broker under faults and foreign values, over real etcd, tansu and HTTP.

A Kafka that does not answer, a ``sealing`` intent no broker wrote, a subscription
Kafka cannot name, a descriptor that is not the segment's and a split refused as
fenced each ended in a 500 with a traceback, an operation blocked for good, a seal
key deleted under live data, or Kafka topics left behind for good.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import httpx
import pytest
import structlog.testing
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from controllerd.adapters.broker import BrokerClient, BrokerUnavailable
from controllerd.adapters.store import Store
from controllerd.core.layout import prune
from controllerd.core.model import TopicName, layout_from_json
from controllerd.core.view import Keys
from controllerd.daemon.clock import ManualClock
from controllerd.daemon.ops import serve_ops
from controllerd.refbroker.kafka import KafkaBackend, KafkaBackendError
from controllerd.refbroker.naming import seal_key, sealing_key, segment_topic
from controllerd.refbroker.server import RefBroker, make_app
from tests.support.broker import layout_json
from tests.support.etcd import EtcdServer
from tests.support.kafka import _spawn, _stop, _wait_listening, free_port
from tests.test_refbroker import elect, new_topic, open_ref

#: Milliseconds aiokafka waits for a paused Kafka here (its default is 40 s).
PAUSED_KAFKA_TIMEOUT_MS = 500


class PausableKafka:
    """A tansu of its own, which :meth:`pause` stops answering (SIGSTOP): connections
    stay open and requests get no answer, as from a Kafka that hangs."""

    def __init__(self, proc: subprocess.Popen[bytes], bootstrap: str) -> None:
        self.proc, self.bootstrap = proc, bootstrap

    def pause(self) -> None:
        """Returns once every thread of it is stopped: a SIGSTOP takes effect when the
        process is next scheduled, and on a busy host a request sent at once was answered
        (the test below failed once in CI with no timeout)."""
        self.proc.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.proc.pid}/task")
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            states = [_state(stat) for stat in tasks.glob("*/stat")]
            if states and all(state in ("T", "t") for state in states):
                return
            time.sleep(0.01)
        raise TimeoutError("tansu did not stop within 5 s of SIGSTOP")

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


def _state(stat: Path) -> str:
    """A thread's state letter from its /proc stat line ("R", "S", "T" ...), "" if gone."""
    try:
        return stat.read_text(encoding="ascii").rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


@contextlib.contextmanager
def own_kafka(tmp_path: Path) -> Iterator[PausableKafka]:
    port, log = free_port(), tmp_path / "tansu.log"
    proc = _spawn(port, log)
    try:
        _wait_listening(proc, port, log)
        yield PausableKafka(proc, f"127.0.0.1:{port}")
    finally:
        proc.send_signal(signal.SIGCONT)
        _stop(proc)


@contextlib.asynccontextmanager
async def kafka_clients(
    kafka: PausableKafka, request_timeout_ms: int = 40_000
) -> AsyncIterator[tuple[AIOKafkaAdminClient, AIOKafkaConsumer]]:
    """Started admin and reader; stopped after Kafka answers again."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=kafka.bootstrap, request_timeout_ms=request_timeout_ms
    )
    reader = AIOKafkaConsumer(
        bootstrap_servers=kafka.bootstrap,
        enable_auto_commit=False,
        request_timeout_ms=max(request_timeout_ms, 1000),
    )
    await admin.start()
    await reader.start()
    try:
        yield admin, reader
    finally:
        kafka.resume()
        await reader.stop()
        await admin.close()


async def kafka_topics(bootstrap: str, topic: TopicName) -> list[str]:
    """The segment topics of ``topic`` that Kafka lists (a listing creates none)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        prefix = segment_topic(topic, "0000-ffff-0").removesuffix("0000-ffff-0")
        return sorted(t for t in await admin.list_topics() if t.startswith(prefix))
    finally:
        await admin.close()


# --- D1: a Kafka that does not answer ----------------------------------------------------


async def test_a_kafka_that_does_not_answer_is_a_503_with_a_reason(
    store: Store, etcd_prefix: str, tmp_path: Path
) -> None:
    """aiokafka's admin requests raise the builtin TimeoutError, which only KafkaError was
    caught for: split, merge, create and delete of a topic answered a bare 500 with a
    traceback (after aiokafka's 40 s)."""
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd")
    leader_key = f"{keys.controller_root}/leader"
    token = await elect(store, leader_key)
    with own_kafka(tmp_path) as kafka:
        async with (
            kafka_clients(kafka, PAUSED_KAFKA_TIMEOUT_MS) as (admin, reader),
            anyio.create_task_group() as tg,
        ):
            kafka_backend = KafkaBackend(admin, reader)
            broker = RefBroker(store, keys, kafka_backend, ManualClock(), leader_key)
            port = await tg.start(serve_ops, make_app(broker), "127.0.0.1", 0)
            topic, other = new_topic(), new_topic()
            await broker.create_topic(topic, 2)
            kafka.pause()
            base = f"/admin/v2/scalable/{topic.tenant}/{topic.namespace}"
            fenced = {"X-Fencing-Token": str(token)}
            url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=url, timeout=20) as http:
                # a hang guard: 4 requests of at most 5 s each (the backend's bound);
                # before it, each took aiokafka's 40 s
                with anyio.fail_after(60):
                    answers = [
                        await http.post(f"{base}/{topic.topic}/split/0", headers=fenced),
                        await http.post(f"{base}/{topic.topic}/merge/0/1", headers=fenced),
                        await http.put(f"{base}/{other.topic}"),
                        await http.delete(f"{base}/{topic.topic}"),
                    ]
            for got in answers:
                assert got.status_code == 503, (got.request.url, got.text)
                assert "reason" in got.json()
            assert "create topics" in answers[0].json()["reason"]
            # the controller's client takes it for a broker fault, to retry, not for a bug
            async with BrokerClient(url, profile="reference", max_retries=0) as client:
                with pytest.raises(BrokerUnavailable):
                    await client.split(topic, 0, None, fencing_token=token)
            kafka.resume()
            layout, _ = await broker.read_layout(topic)
            assert layout.epoch == 0  # nothing happened, and the topic is still there
            assert await store.get(keys.layout(other)) is None
            tg.cancel_scope.cancel()


async def test_the_backend_bounds_each_admin_request_itself(tmp_path: Path) -> None:
    """Whatever aiokafka's own timeout (40 s by default, more while it waits for a
    connection), a request to a Kafka that hangs ends after ``request_timeout``."""
    with own_kafka(tmp_path) as kafka:
        async with kafka_clients(kafka) as (admin, reader):
            backend = KafkaBackend(admin, reader, request_timeout=0.3)
            name = segment_topic(new_topic(), "0000-ffff-0")
            await backend.create_topics([name])
            kafka.pause()
            with anyio.fail_after(5):
                with pytest.raises(KafkaBackendError, match=r"did not answer within 0\.3s"):
                    await backend.create_topics([name])
                with pytest.raises(KafkaBackendError, match=r"did not answer within 0\.3s"):
                    await backend.delete_topic(name)


# --- D2: a sealing intent no broker wrote ------------------------------------------------


@pytest.mark.parametrize(
    ("value", "leased"),
    [
        pytest.param(b"\x00garbage", False, id="garbage"),
        pytest.param(b'{"segments": [0]}', False, id="no-lease"),
        pytest.param(b'{"segments": "all"}', True, id="leased-garbage"),
    ],
)
async def test_a_sealing_intent_no_broker_wrote_does_not_block_the_topic(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    store: Store,
    kafka_broker: str,
    value: bytes,
    leased: bool,
) -> None:
    """Any intent was waited for: one without a lease never expires, and every split and
    merge of the topic answered 409 "layout kept changing; try again" for good."""
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic, intent = ref.topic, sealing_key(ref.keys, ref.topic)
        await ref.client.create_topic(topic, 2)
        lease = (await ref.store.grant_lease(30))[0] if leased else 0
        for change in ("split", "merge"):
            await ref.store.put(intent, value, lease=lease)
            with structlog.testing.capture_logs() as logs:
                if change == "split":
                    await ref.client.split(topic, 0, None, fencing_token=ref.token)
                else:
                    await ref.client.merge(topic, 3, 1, fencing_token=ref.token)
            stale = [e for e in logs if e["event"] == "refbroker.sealing.stale_deleted"]
            assert [e["key"] for e in stale] == [intent]
        assert (await ref.client.get_layout(topic)).epoch == 2
        assert await ref.store.get(intent) is None


# --- D4: a subscription Kafka cannot name ------------------------------------------------


async def test_a_subscription_kafka_cannot_name_is_unknown_and_drains_nothing(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    """``pulsar.sub`` (the prefix is shared with Pulsar, whose names may hold dots) made
    backlog and DELETE of a segment raise ValueError: a 500 with a traceback."""
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic, token = ref.topic, ref.token
        await ref.client.create_topic(topic, 1)
        await ref.client.create_subscription(topic, "s", "STREAM")
        await ref.produce("0000-ffff-0", 3)
        await ref.client.split(topic, 0, None, fencing_token=token)  # 0 sealed at 3
        await ref.client.split(topic, 1, None, fencing_token=token)  # 1 sealed at 0
        await ref.commit("s", "0000-ffff-0", 3)
        await ref.store.put(ref.keys.subscription(topic, "pulsar.sub"), b'{"type": "STREAM"}')
        segments = f"/admin/v2/segments/{topic.path}"
        async with httpx.AsyncClient(base_url=ref.url) as http:
            backlog = await http.get(f"{segments}/0000-ffff-0/subscription/pulsar.sub/backlog")
            assert backlog.status_code == 404 and backlog.json()["code"] == "no-cursor"
            # the controller's GC: unknown, so never drained
            assert await ref.client.backlog(topic, "0000-ffff-0", "pulsar.sub") is None
            held = await http.delete(
                f"{segments}/0000-ffff-0", headers={"X-Fencing-Token": str(token)}
            )
        assert held.status_code == 409 and held.json()["code"] == "backlog"
        assert "pulsar.sub" in held.json()["reason"]
        assert await ref.store.get(seal_key(ref.keys, topic, 0)) is not None
        # an empty segment has nothing to drain
        assert await ref.client.delete_segment(topic, "0000-7fff-1", fencing_token=token)
        # deleting the subscription releases the segment
        await ref.client.delete_subscription(topic, "pulsar.sub")
        assert await ref.client.delete_segment(topic, "0000-ffff-0", fencing_token=token)


# --- D5: a descriptor that is not the segment's ------------------------------------------


async def test_a_wrong_descriptor_deletes_nothing(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    """Only the id was taken from the descriptor: ``0000-0001-0``, whose Kafka topic does
    not exist, deleted the seal key of sealed, undrained segment ``0000-ffff-0``."""
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic, token = ref.topic, ref.token
        seal = seal_key(ref.keys, topic, 0)
        await ref.client.create_topic(topic, 1)
        await ref.client.create_subscription(topic, "s", "STREAM")
        await ref.produce("0000-ffff-0", 5)
        await ref.client.split(topic, 0, None, fencing_token=token)
        segments = f"/admin/v2/segments/{topic.path}"
        async with httpx.AsyncClient(base_url=ref.url) as http:
            wrong = await http.delete(
                f"{segments}/0000-0001-0", headers={"X-Fencing-Token": str(token)}
            )
            assert wrong.status_code == 409 and wrong.json()["code"] == "descriptor-mismatch"
            assert "0000-ffff-0" in wrong.json()["reason"]
            assert await ref.store.get(seal) is not None
            # GC pruned it: no layout holds the id, but Kafka still has its data
            pruned = prune(layout_from_json(await ref.layout_in_etcd()), [0])
            await ref.store.put(ref.keys.layout(topic), layout_json(pruned))
            gone = await http.delete(
                f"{segments}/0000-0001-0", headers={"X-Fencing-Token": str(token)}
            )
            assert gone.status_code == 404
        assert await ref.store.get(seal) is not None
        assert await ref.client.backlog(topic, "0000-ffff-0", "s") == 5
        await ref.commit("s", "0000-ffff-0", 5)
        assert await ref.client.delete_segment(topic, "0000-ffff-0", fencing_token=token)
        assert await ref.store.get(seal) is None


# --- D6: Kafka topics no layout names ----------------------------------------------------


async def test_a_fenced_split_creates_nothing_and_delete_topic_leaves_nothing(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str
) -> None:
    """A split refused as fenced had created its children's Kafka topics, and deleting the
    topic deleted only its layout's segments: they stayed for good."""
    async with open_ref(etcd_server, etcd_prefix, store, kafka_broker) as ref:
        topic, old = ref.topic, ref.token
        neighbour = TopicName(topic.tenant, topic.namespace, f"{topic.topic}-x")
        await ref.client.create_topic(topic, 1)
        await ref.client.create_topic(neighbour, 1)
        await elect(ref.store, ref.leader_key)  # another replica won since
        async with httpx.AsyncClient(base_url=ref.url) as http:
            for bound in (0x1000, 0x2000):
                refused = await http.post(
                    f"/admin/v2/scalable/{topic.path}/split/0?boundaries={bound}",
                    headers={"X-Fencing-Token": str(old)},
                )
                assert refused.status_code == 409 and refused.json()["code"] == "fenced"
        assert await kafka_topics(ref.kafka, topic) == [segment_topic(topic, "0000-ffff-0")]
        # what a split leaves when its layout write loses a race after creating children
        orphan = segment_topic(topic, "0000-0fff-1")
        admin = AIOKafkaAdminClient(bootstrap_servers=ref.kafka)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(orphan, 1, 1)])
        finally:
            await admin.close()
        await ref.client.delete_topic(topic)
        assert await kafka_topics(ref.kafka, topic) == []
        # the prefix ends with the topic's name: a topic whose name extends it is not touched
        assert await kafka_topics(ref.kafka, neighbour) == [segment_topic(neighbour, "0000-ffff-0")]
        await ref.client.delete_topic(neighbour)
