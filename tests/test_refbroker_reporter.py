"""The reference broker's load reporter on real etcd and real Kafka (tansu).

Time is a :class:`ManualClock`: a test produces a window's messages, advances
the clock by the window and runs one pass, so rates are exact.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import structlog
from aiokafka import AIOKafkaProducer

from controllerd import config as config_mod
from controllerd.adapters.store import Store
from controllerd.core.layout import initial_layout
from controllerd.core.loadreport import ReportRule
from controllerd.core.model import (
    HashRange,
    Layout,
    Rates,
    Segment,
    SegmentState,
    TopicName,
    layout_to_json,
)
from controllerd.core.view import Keys
from controllerd.daemon.clock import ManualClock
from controllerd.refbroker.kafka import Sampled, open_kafka
from controllerd.refbroker.naming import key_hash, segment_topic, slice_starts
from controllerd.refbroker.reporter import LoadReporter, hash_buckets
from controllerd.refbroker.server import RefBroker


@dataclass
class Bench:
    broker: RefBroker
    reporter: LoadReporter
    clock: ManualClock
    store: Store
    keys: Keys
    bootstrap: str
    topic: TopicName

    async def produce(self, descriptor: str, keys: Sequence[bytes | None]) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=5)
        await producer.start()
        try:
            name = segment_topic(self.topic, descriptor)
            futures = [await producer.send(name, b"v" * 20, key=k, partition=0) for k in keys]
            for future in futures:
                await future
        finally:
            await producer.stop()

    async def record(self, segment_id: int) -> dict[str, Any] | None:
        kv = await self.store.get(self.keys.load(self.topic, segment_id))
        return None if kv is None else dict(json.loads(kv.value))

    async def window(self, seconds: float, descriptor: str, keys: Sequence[bytes | None]) -> int:
        """``keys`` produced during a window of ``seconds``; then one pass."""
        await self.produce(descriptor, keys)
        await self.clock.advance(seconds)
        return await self.reporter.report_once()


@contextlib.asynccontextmanager
async def bench(
    store: Store, etcd_prefix: str, bootstrap: str, *, split_msg_rate: float = 1000.0
) -> AsyncIterator[Bench]:
    cfg = config_mod.Config()
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd")
    split_at = Rates(split_msg_rate, 1e12, 1e12, 1e12)
    rule = ReportRule(split_at, cfg.policy.merge_thresholds)
    clock = ManualClock()
    async with open_kafka(bootstrap) as kafka:
        broker = RefBroker(store, keys, kafka, clock)  # unfenced: the test seals by hand
        reporter = LoadReporter(store, keys, kafka, rule, clock, 10.0, confirm_interval=5.0)
        topic = TopicName("acme", "ns", f"t{uuid.uuid4().hex[:12]}")
        yield Bench(broker, reporter, clock, store, keys, bootstrap, topic)


def keys_in(start: int, end: int, count: int, prefix: str = "k") -> list[bytes]:
    """``count`` distinct keys whose routing hash lies in ``[start, end]``."""
    found = []
    for i in itertools.count():
        key = f"{prefix}{i}".encode()
        if start <= key_hash(key) <= end:
            found.append(key)
            if len(found) == count:
                return found
    raise AssertionError("unreachable")


def test_slices_follow_the_wire_format() -> None:
    """Slice i is [start + (i*W)//n, start + ((i+1)*W)//n - 1], n = min(32, W)."""
    for start, end in [(0, 0xFFFF), (0x8000, 0xFFFF), (5, 20), (7, 7), (100, 1100)]:
        width = end - start + 1
        n = min(32, width)
        starts = slice_starts(start, end)
        assert len(starts) == n
        assert starts == [start + (i * width) // n for i in range(n)]
        rng = HashRange(start, end)
        for h in {start, end, (start + end) // 2, *starts}:
            key = keys_in(h, h, 1, prefix=f"x{h}-")[0] if width <= 64 else None
            if key is None:
                continue
            buckets = hash_buckets(rng, [Sampled(key, 1)], 10.0)
            assert buckets is not None
            i = buckets.index(10.0)
            assert start + (i * width) // n <= h <= start + ((i + 1) * width) // n - 1


async def test_a_hot_key_shows_in_its_slice(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    async with bench(store, etcd_prefix, kafka_broker) as b:
        await b.broker.create_topic(b.topic, 2)
        upper = "8000-ffff-1"
        hot = keys_in(0x8000, 0xFFFF, 1, prefix="hot")[0]
        cold = keys_in(0x8000, 0xFFFF, 50, prefix="cold")
        skewed = [hot] * 400 + cold * 2  # 80% on one key
        assert await b.reporter.report_once() == 0
        assert await b.window(10.0, upper, skewed) == 2  # first records: written at once
        record = await b.record(1)
        assert record is not None
        assert record["msgRateIn"] == pytest.approx(50.0)
        buckets = record["hashBuckets"]
        assert len(buckets) == 32 and all(v >= 0 for v in buckets)
        assert sum(buckets) == pytest.approx(50.0, abs=0.01)  # every message had a key
        starts = slice_starts(0x8000, 0xFFFF)
        hot_slice = max(i for i, s in enumerate(starts) if s <= key_hash(hot))
        assert buckets.index(max(buckets)) == hot_slice
        assert buckets[hot_slice] >= 0.8 * 50.0
        idle = await b.record(0)
        assert idle is not None and idle["msgRateIn"] == 0.0
        assert "hashBuckets" not in idle  # no keyed traffic, no histogram


async def test_a_narrow_segment_has_one_slice_per_hash(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    async with bench(store, etcd_prefix, kafka_broker) as b:
        await b.broker.create_topic(b.topic, 1)
        await b.broker.split(b.topic, 0, [0x10, 0x20], None)  # child 1 is [0x0, 0xf]
        narrow = "0000-000f-1"
        keys = keys_in(0x3, 0x3, 3) + keys_in(0xC, 0xC, 1)
        await b.reporter.report_once()
        await b.window(10.0, narrow, [keys[0], keys[1], keys[2], keys[3]] * 5)
        record = await b.record(1)
        assert record is not None
        assert record["hashBuckets"] == pytest.approx(
            [0.0, 0.0, 0.0, 1.5] + [0.0] * 8 + [0.5] + [0.0] * 3
        )


async def test_keyless_traffic_publishes_no_histogram(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    async with bench(store, etcd_prefix, kafka_broker) as b:
        await b.broker.create_topic(b.topic, 1)
        await b.reporter.report_once()
        await b.window(10.0, "0000-ffff-0", [None] * 30)
        record = await b.record(0)
        assert record is not None and record["msgRateIn"] == pytest.approx(3.0)
        assert "hashBuckets" not in record


async def test_a_change_is_written_once_a_window_lies_wholly_in_it(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    """A burst that starts inside a window is not reported as the mixture it reads."""
    async with bench(store, etcd_prefix, kafka_broker, split_msg_rate=200.0) as b:
        await b.broker.create_topic(b.topic, 1)
        seg = "0000-ffff-0"
        keys = keys_in(0, 0xFFFF, 100)
        await b.reporter.report_once()
        assert await b.window(10.0, seg, keys[:50]) == 1  # 5 msg/s: the first record
        first = await b.record(0)
        assert first is not None and first["msgRateIn"] == pytest.approx(5.0)
        # the burst (70 msg/s) starts 4.3 s before the end of a 10 s window: reads 30 msg/s
        assert await b.window(10.0, seg, (keys * 3)[:300]) == 0
        assert b.reporter.held and b.reporter.next_interval() == 5.0
        assert await b.record(0) == first  # the mixture is never written
        # the next, shorter window lies wholly in the burst
        assert await b.window(5.0, seg, (keys * 4)[:350]) == 1
        burst = await b.record(0)
        assert burst is not None and burst["msgRateIn"] == pytest.approx(70.0)
        assert not b.reporter.held and b.reporter.next_interval() == 10.0
        # a spike that does not last is never written
        assert await b.window(10.0, seg, (keys * 20)[:2000]) == 0  # 200 msg/s
        assert b.reporter.held
        assert await b.window(5.0, seg, (keys * 4)[:350]) == 0  # back to 70 msg/s
        assert not b.reporter.held
        assert await b.record(0) == burst


def _layout_bytes(layout: Layout) -> bytes:
    return json.dumps(layout_to_json(layout)).encode()


def _unusable_layout(case: str) -> bytes:
    """Layout values another writer may leave in the shared prefix; each ended the
    reporter (and the broker with it, again after every restart)."""
    if case == "deep":  # RecursionError out of json.loads
        return b"[" * 100_000 + b"]" * 100_000
    if case == "deep-in-message":  # strict JSON, but the core's error message shows it
        return b'{"segments": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    if case == "wide":  # parses; segment_topic refuses "0000-1ffff-0"
        wide = layout_to_json(initial_layout(1))
        wide["segments"]["0"]["hashRange"]["end"] = 0x1FFFF
        return json.dumps(wide).encode()
    assert case == "negative"  # holds every invariant, but "0000-ffff--1" is no segment topic
    segment = Segment(-1, HashRange(0, 0xFFFF), SegmentState.ACTIVE)
    return _layout_bytes(Layout(epoch=0, next_segment_id=0, segments={-1: segment}))


@pytest.mark.parametrize("case", ["deep", "deep-in-message", "wide", "negative"])
async def test_an_unusable_layout_is_skipped_counted_and_said_once(
    store: Store, etcd_prefix: str, kafka_broker: str, case: str
) -> None:
    """The reporter goes on measuring every usable topic; a repaired layout is used again."""
    async with bench(store, etcd_prefix, kafka_broker) as b:
        await b.broker.create_topic(b.topic, 1)
        bad = b.keys.layout(TopicName("acme", "ns", f"{b.topic.topic}-{case}"))
        await store.put(bad, _unusable_layout(case))
        with structlog.testing.capture_logs() as logs:
            assert await b.reporter.report_once() == 0
            assert await b.window(10.0, "0000-ffff-0", keys_in(0, 0xFFFF, 10)) == 1
        record = await b.record(0)
        assert record is not None and record["msgRateIn"] == pytest.approx(1.0)
        assert b.reporter.skipped == {"layout": 2}
        assert b.reporter.unusable == {bad}
        said = [e for e in logs if e["event"] == "reporter.value_skipped"]
        assert [(e["kind"], e["key"]) for e in said] == [("layout", bad)]
        await store.put(bad, _layout_bytes(initial_layout(1)))
        await b.reporter.report_once()  # its segment topic does not exist: skipped as gone
        assert b.reporter.unusable == set() and b.reporter.skipped == {"layout": 2}


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deep"),  # RecursionError
        pytest.param(b'{"msgRateIn": 1' + b"0" * 400 + b', "changedAtMs": 1}', id="overflow"),
    ],
)
async def test_an_unusable_stored_load_record_is_counted_and_replaced(
    store: Store, etcd_prefix: str, kafka_broker: str, value: bytes
) -> None:
    """The record read to seed the last written one raised out of report_once (stdlib
    json parsed the overflow, and the core's float() of it raised OverflowError)."""
    async with bench(store, etcd_prefix, kafka_broker) as b:
        await b.broker.create_topic(b.topic, 1)
        key = b.keys.load(b.topic, 0)
        await store.put(key, value)
        with structlog.testing.capture_logs() as logs:
            assert await b.reporter.report_once() == 0
            assert await b.window(10.0, "0000-ffff-0", keys_in(0, 0xFFFF, 10)) == 1
        record = await b.record(0)
        assert record is not None and record["msgRateIn"] == pytest.approx(1.0)
        assert b.reporter.skipped == {"load": 1}
        assert b.reporter.unusable == set()  # the write replaced it
        said = [e for e in logs if e["event"] == "reporter.value_skipped"]
        assert [(e["kind"], e["key"]) for e in said] == [("load", key)]


async def test_a_name_kafka_cannot_have_is_forgotten_once_its_keys_are_gone(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    """``unnamed`` kept every such name ever seen (unlike ``unusable``, which keeps only
    keys still present): Pulsar topics with dots that came and went grew it for good."""
    async with bench(store, etcd_prefix, kafka_broker) as b:
        await b.broker.create_topic(b.topic, 1)
        stays = TopicName("acme", "ns", f"{b.topic.topic}.stays")
        await store.put(b.keys.layout(stays), _layout_bytes(initial_layout(1)))
        with structlog.testing.capture_logs() as logs:
            for i in range(20):
                dotted = TopicName("acme", "ns", f"{b.topic.topic}.v{i}")
                sub = b.keys.subscription(b.topic, f"s.{i}")
                await store.put(b.keys.layout(dotted), _layout_bytes(initial_layout(1)))
                await store.put(sub, b'{"type": "STREAM"}')
                await b.reporter.report_once()
                await b.reporter.report_once()  # said once while it stays
                assert {str(dotted), f"{b.topic}/subscriptions/s.{i}"} <= b.reporter.unnamed
                await store.delete(b.keys.layout(dotted))
                await store.delete(sub)
            assert await b.window(10.0, "0000-ffff-0", keys_in(0, 0xFFFF, 10)) == 1
            assert b.reporter.unnamed == {str(stays)}
            await store.delete(b.keys.layout(stays))
            await b.reporter.report_once()
            assert b.reporter.unnamed == set()
            await store.put(b.keys.layout(stays), _layout_bytes(initial_layout(1)))
            await b.reporter.report_once()  # back again: said again
            assert b.reporter.unnamed == {str(stays)}
        said = Counter(e["name"] for e in logs if e["event"] == "reporter.name_skipped")
        churned = [f"{b.topic.topic}.v{i}" for i in range(20)]
        expected = Counter({str(stays): 2})
        expected.update(str(TopicName("acme", "ns", name)) for name in churned)
        expected.update(f"{b.topic}/subscriptions/s.{i}" for i in range(20))
        assert said == expected
