"""End to end: real etcd, real Kafka (tansu), the reference broker, controllerd processes.

Windows and thresholds are scaled down (see ``E2E_CONFIG``) so that each story
takes seconds. Load is real: the client library produces to Kafka, the
reference broker's reporter measures it, the controller replicas decide.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from controllerd import config as config_mod
from controllerd.adapters.broker import BrokerClient
from controllerd.adapters.store import Store
from controllerd.core.layout import violations
from controllerd.core.model import Layout, TopicName, layout_from_json
from controllerd.core.view import Keys
from controllerd.refbroker.client import Producer, open_consumer, open_producer
from controllerd.refbroker.main import BrokerOptions, serve
from tests.support.daemon import Replica, replicas, wait_until
from tests.support.etcd import EtcdServer

TOPIC = TopicName("e2e", "ns", "orders")
SPLIT_MSG_RATE = 100  # msg/s in

# Rates measured over 1-2 s windows of real traffic: beside another test worker the
# producer's pacing jitters and a window reads up to 6x for 3.5x (./dev.sh runs these
# after the parallel part, on their own).
pytestmark = pytest.mark.serial

E2E_CONFIG = f"""
[autoscale]
interval_seconds = 2
# the test's consumers open one after another, each within a fraction of a second
consumer_settle_seconds = 1.0
[gc]
interval_seconds = 1
default_retention_seconds = 2
[load_report]
report_max_interval_seconds = 5
[policy]
split_cooldown_seconds = 3
merge_cooldown_seconds = 2
merge_window_seconds = 3
load_ttl_seconds = 30
min_split_width = 1
[policy.split_thresholds]
msg_rate_in = {SPLIT_MSG_RATE}
byte_rate_in = 100000000
msg_rate_out = 100000
byte_rate_out = 100000000
[policy.merge_thresholds]
msg_rate_in = 5
byte_rate_in = 1000000
msg_rate_out = 1000
byte_rate_out = 1000000
"""


@dataclass
class E2E:
    store: Store
    keys: Keys
    kafka: str
    admin: BrokerClient
    replicas: list[Replica]
    layouts: list[Layout]

    def layout(self) -> Layout:
        return self.layouts[-1]

    def active(self) -> int:
        return len(self.layout().active_segments()) if self.layouts else 0

    async def disable_autoscale(self) -> None:
        await self.store.put(self.keys_policy(), b'{"enabled": false}')

    async def enable_autoscale(self) -> None:
        await self.store.delete(self.keys_policy())

    def keys_policy(self) -> str:
        return self.keys.policy(TOPIC.tenant)

    async def load_at_least(self, segment_id: int, msg_rate: float) -> bool:
        kv = await self.store.get(self.keys.load(TOPIC, segment_id))
        return kv is not None and json.loads(kv.value)["msgRateIn"] >= msg_rate


async def follow_layouts(store: Store, keys: Keys, into: list[Layout]) -> None:
    """Record every version of the layout, checking the invariants of each."""
    kv = await store.get(keys.layout(TOPIC))
    assert kv is not None
    into.append(layout_from_json(json.loads(kv.value)))
    async for batch in store.watch_key(keys.layout(TOPIC), kv.mod_revision + 1):
        for event in batch:
            if event.kind == "put":
                layout = layout_from_json(json.loads(event.value))
                assert violations(layout) == [], violations(layout)
                assert layout.epoch == into[-1].epoch + 1  # one operation per version
                into.append(layout)


@contextlib.asynccontextmanager
async def e2e_cluster(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    store: Store,
    kafka: str,
    tmp: Path,
    *,
    count: int = 2,
    segments: int = 1,
    report_interval: float = 0.5,
) -> AsyncIterator[E2E]:
    cfg_text = f'[etcd]\ncontroller_prefix = "{etcd_prefix}controllerd"\n' + E2E_CONFIG
    cfg = config_mod.load(cfg_text)
    keys = Keys(f"{etcd_prefix}pulsar", cfg.controller_root)
    options = BrokerOptions(
        etcd_server.endpoint,
        kafka,
        "127.0.0.1",
        0,
        keys.metadata_prefix,
        f"{cfg.controller_root}/leader",
        report_interval,
        cfg,
    )
    async with anyio.create_task_group() as tg:
        port = await tg.start(functools.partial(serve, options))
        url = f"http://127.0.0.1:{port}"
        async with BrokerClient(url, profile="reference") as admin:
            await admin.create_topic(TOPIC, segments)
            await admin.create_subscription(TOPIC, "s", "STREAM")
            layouts: list[Layout] = []
            tg.start_soon(follow_layouts, store, keys, layouts)
            async with replicas(
                tmp,
                count,
                etcd=etcd_server.endpoint,
                prefix=etcd_prefix,
                broker_url=url,
                extra=E2E_CONFIG,
            ) as running:
                yield E2E(store, keys, kafka, admin, running, layouts)
        tg.cancel_scope.cancel()


async def produce(
    producer: Producer,
    rate: float,
    seconds: float,
    keys: int = 50,
    counters: dict[bytes, int] | None = None,
    stop: anyio.Event | None = None,
) -> None:
    """``rate`` messages/s for ``seconds`` or until ``stop``; values count per key.

    Stopped by the event, never by cancellation, so that a send in flight is
    either counted and sent or neither.
    """
    counters = counters if counters is not None else defaultdict(int)
    start = anyio.current_time()
    sent = 0
    while (elapsed := anyio.current_time() - start) < seconds:
        if stop is not None and stop.is_set():
            return
        while sent < int(elapsed * rate):
            key = b"k%03d" % (sent % keys)
            await producer.send(key, str(counters[key]).encode())
            counters[key] += 1
            sent += 1
        await anyio.sleep(0.01)


async def test_an_overload_splits_k_ways_at_once_and_keeps_key_order(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str, tmp_path: Path
) -> None:
    async with e2e_cluster(etcd_server, etcd_prefix, store, kafka_broker, tmp_path) as e2e:
        counters: dict[bytes, int] = defaultdict(int)
        async with open_producer(store, e2e.keys, kafka_broker, TOPIC) as producer:
            await e2e.disable_autoscale()  # let the measured rate settle at 3.5x first
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce, producer, 3.5 * SPLIT_MSG_RATE, 1e9, 50, counters, stop)
                await wait_until(lambda: e2e.load_at_least(0, 3.2 * SPLIT_MSG_RATE), within=20)
                await e2e.enable_autoscale()
                await wait_until(lambda: _active(e2e, 4), within=20)
                first_split = e2e.layouts[1]
                # the children the load needs in one step: ceil(3.5) = 4, or 5 when a
                # window read more (a stalled producer catching up) or the 50 keys'
                # hashes pack unevenly (load-aware boundaries); one split, never two
                assert first_split.epoch == 1
                assert len(first_split.active_segments()) in (4, 5)
                await anyio.sleep(1.0)  # keep producing across the split
                stop.set()
        delivered: dict[bytes, list[int]] = defaultdict(list)
        total = sum(counters.values())
        async with open_consumer(store, e2e.keys, kafka_broker, TOPIC, "s", "reader") as c:
            with anyio.fail_after(30):
                async for message in c.messages():
                    assert message.key is not None
                    delivered[message.key].append(int(message.value))
                    if sum(len(v) for v in delivered.values()) == total:
                        break
        for key, count in counters.items():
            assert delivered[key] == list(range(count)), key  # every message once, in order


async def test_a_burst_from_light_traffic_converges_in_one_decision(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str, tmp_path: Path
) -> None:
    """Autoscale on throughout: the first split already has the children the load needs.

    The burst starts inside a report window; that window reads a mixture of the
    two rates, which the reporter holds back until a window lies wholly in the
    burst (reporter.py). Were the mixture written, the first split would be
    sized for it and a second one would follow. Reports come as often as
    evaluations (2 s), as in the demo, so a mixture would be acted on.
    """
    async with e2e_cluster(
        etcd_server, etcd_prefix, store, kafka_broker, tmp_path, report_interval=2.0
    ) as e2e:
        async with open_producer(store, e2e.keys, kafka_broker, TOPIC) as producer:
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce, producer, 0.5 * SPLIT_MSG_RATE, 1e9, 50, None, stop)
                await wait_until(lambda: e2e.load_at_least(0, 0.4 * SPLIT_MSG_RATE), within=20)
                stop.set()
            # half a report window more of light traffic: the burst starts mid-window
            await produce(producer, 0.5 * SPLIT_MSG_RATE, 1.0)
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce, producer, 3.5 * SPLIT_MSG_RATE, 1e9, 50, None, stop)
                await wait_until(lambda: _active(e2e, 2), within=20)
                stop.set()
        first_split = e2e.layouts[1]
        assert first_split.epoch == 1
        # 3.5x the threshold: 4 children, or 5 when the producer ran fast on a busy host
        # (a report of 3.71x once) and the key histogram cannot balance four children
        # under the threshold. A split sized for a mixture of the two rates has fewer.
        assert len(first_split.active_segments()) in (4, 5)


async def _active(e2e: E2E, n: int) -> bool:
    return e2e.active() >= n


async def test_four_consumers_get_four_segments_in_one_decision(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str, tmp_path: Path
) -> None:
    async with e2e_cluster(etcd_server, etcd_prefix, store, kafka_broker, tmp_path) as e2e:
        async with contextlib.AsyncExitStack() as stack:
            consumers = [
                await stack.enter_async_context(
                    open_consumer(store, e2e.keys, kafka_broker, TOPIC, "s", f"c{i}")
                )
                for i in range(4)
            ]
            await wait_until(lambda: _active(e2e, 4), within=20)
            assert len(e2e.layouts[1].active_segments()) == 4  # one decision
            assert e2e.layouts[1].epoch == 1

            async def each_has_a_segment() -> bool:
                return all(len(c.assignment) >= 1 for c in consumers)

            async def drain(consumer: object) -> None:
                async for _ in consumer.messages():  # type: ignore[attr-defined]
                    pass

            async with anyio.create_task_group() as tg:
                for consumer in consumers:
                    tg.start_soon(drain, consumer)
                await wait_until(each_has_a_segment, within=20)
                tg.cancel_scope.cancel()


async def test_cold_pair_merges_and_gc_deletes_only_drained_segments(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str, tmp_path: Path
) -> None:
    async with e2e_cluster(
        etcd_server, etcd_prefix, store, kafka_broker, tmp_path, segments=2
    ) as e2e:
        async with open_producer(store, e2e.keys, kafka_broker, TOPIC) as producer:
            await produce(producer, 20, 1.0)  # leaves backlog for subscription "s"

        async def merged() -> bool:
            return e2e.active() == 1

        await wait_until(merged, within=30)
        parents = [s for s in e2e.layout().segments.values() if not s.active]
        assert {s.segment_id for s in parents} == {0, 1}
        # Past retention, but "s" has not read them: GC must keep them.
        await anyio.sleep(4.0)
        backlog = await e2e.admin.backlog(TOPIC, parents[0].descriptor, "s")
        assert backlog is not None and backlog > 0
        assert {0, 1} <= set(e2e.layout().segments)
        async with open_consumer(store, e2e.keys, kafka_broker, TOPIC, "s", "late") as consumer:
            async with anyio.create_task_group() as tg:

                async def drain() -> None:
                    async for _ in consumer.messages():
                        pass

                tg.start_soon(drain)

                async def pruned() -> bool:
                    return not ({0, 1} & set(e2e.layout().segments))

                await wait_until(pruned, within=30)
                tg.cancel_scope.cancel()

        async def data_deleted() -> bool:  # after the prune, the broker deletes the data
            return all([await e2e.admin.backlog(TOPIC, p.descriptor, "s") is None for p in parents])

        await wait_until(data_deleted, within=15)


async def test_kill_9_of_the_leader_under_load_applies_nothing_twice(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, kafka_broker: str, tmp_path: Path
) -> None:
    async with e2e_cluster(etcd_server, etcd_prefix, store, kafka_broker, tmp_path) as e2e:
        async with open_producer(store, e2e.keys, kafka_broker, TOPIC) as producer:
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce, producer, 3 * SPLIT_MSG_RATE, 1e9)
                await wait_until(lambda: _active(e2e, 2), within=20)
                leader = await _leader(e2e)
                standby = next(r for r in e2e.replicas if r is not leader)
                leader.signal(signal.SIGKILL)
                await wait_until(standby.is_leader, within=15)
                epoch = e2e.layout().epoch
                # More load than the first split was sized for: only the new leader can act.
                tg.start_soon(produce, producer, 6 * SPLIT_MSG_RATE, 1e9)

                async def acted() -> bool:
                    return e2e.layout().epoch > epoch

                await wait_until(acted, within=30)  # the new leader acts on the load
                tg.cancel_scope.cancel()
        # follow_layouts asserted the invariants and one epoch per version throughout
        assert len(e2e.layouts) >= 3


async def _leader(e2e: E2E) -> Replica:
    for replica in e2e.replicas:
        if await replica.is_leader():
            return replica
    raise AssertionError("no replica leads")
