"""The reference broker's client library against real etcd and a real tansu Kafka.

No broker server runs: :class:`SimBroker` does what docs/reference-broker.md says
the broker does (create the segment topics, put the ``sealing`` intent, read the
sealed parents' end offsets, write the layout with every ``seal`` key and drop
the intent in one transaction), step by step, so a test can stop between the
steps. ``write_layout`` and ``seal`` on their own are the older, non-atomic
order (layout, then seal), which the client still copes with.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final, cast

import anyio
import pytest
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import UnknownTopicOrPartitionError
from anyio.abc import TaskStatus

from controllerd.adapters.store import (
    Compare,
    Delete,
    Put,
    Store,
)
from controllerd.core.layout import initial_layout, merge, prune, split
from controllerd.core.model import (
    HashRange,
    Layout,
    Segment,
    SegmentState,
    TopicName,
    layout_to_json,
)
from controllerd.core.view import Keys
from controllerd.refbroker import client as client_module
from controllerd.refbroker.client import (
    Consumer,
    Message,
    SendFailed,
    SendResult,
    deal,
    open_consumer,
    open_producer,
    readable_segments,
)
from controllerd.refbroker.kafka import KafkaBackend, open_kafka
from controllerd.refbroker.naming import (
    check_name_part,
    key_hash,
    seal_key,
    sealing_key,
    segment_topic,
    subscription_group,
)
from tests.support.etcd import EtcdServer, FailingStore, compact


async def eventually(predicate: Callable[[], bool], within: float = 10.0) -> None:
    """Wait until ``predicate()`` holds: an outcome of real I/O, not a clock tick.

    Polls because the outcomes (a consumer's assignment, records in Kafka) come
    from background tasks and other processes that expose no event to wait on.
    """
    with anyio.fail_after(within):
        while not predicate():  # noqa: ASYNC110 - see above
            await anyio.sleep(0.01)


async def eventually_equal(
    read: Callable[[], Awaitable[object]], expected: object, within: float = 10.0
) -> None:
    """Wait until ``await read()`` equals ``expected`` (state held by Kafka)."""
    with anyio.fail_after(within):
        while await read() != expected:  # noqa: ASYNC110 - another process; no event to await
            await anyio.sleep(0.05)


@dataclass
class SimBroker:
    """The broker's side of the protocol, one step per method."""

    store: Store
    keys: Keys
    topic: TopicName
    bootstrap: str
    admin: Any
    reader: Any
    kafka: KafkaBackend
    layout: Layout

    def kafka_topic(self, sid: int) -> str:
        return segment_topic(self.topic, self.layout.segments[sid].descriptor)

    async def write_layout(self, layout: Layout) -> None:
        """Steps 1 and 2: create the new segments' topics, then write the layout."""
        new = [s for sid, s in layout.segments.items() if sid not in self.layout.segments]
        if new:
            await self.admin.create_topics(
                [NewTopic(segment_topic(self.topic, s.descriptor), 1, 1) for s in new]
            )
        self.layout = layout
        await self.store.put(
            self.keys.layout(self.topic), json.dumps(layout_to_json(layout)).encode()
        )

    async def end_offset(self, sid: int) -> int:
        """Offset after the segment's last record, read as the broker reads it."""
        return await self.kafka.end_offset(self.kafka_topic(sid))

    async def seal(self, sid: int, end: int | None = None) -> None:
        """Step 3: the sealed segment's end offset (``end`` overrides what Kafka says)."""
        end = await self.end_offset(sid) if end is None else end
        await self.store.put(
            seal_key(self.keys, self.topic, sid), json.dumps({"endOffset": end}).encode()
        )

    async def begin_seal(self, sids: list[int]) -> int:
        """Atomic step 2: the ``sealing`` intent on a lease; returns the lease."""
        lease, _ = await self.store.grant_lease(30)
        await self.store.put(
            sealing_key(self.keys, self.topic),
            json.dumps({"segments": sids}).encode(),
            lease=lease,
        )
        return lease

    async def commit_seal(self, layout: Layout, ends: dict[int, int]) -> None:
        """Atomic step 4: layout, every seal key and the end of the intent, one transaction."""
        new = [s for sid, s in layout.segments.items() if sid not in self.layout.segments]
        if new:
            await self.admin.create_topics(
                [NewTopic(segment_topic(self.topic, s.descriptor), 1, 1) for s in new]
            )
        key = self.keys.layout(self.topic)
        current = await self.store.get(key)
        assert current is not None
        result = await self.store.txn(
            [Compare.mod_revision(key, current.mod_revision)],
            [
                Put(key, json.dumps(layout_to_json(layout)).encode()),
                *(
                    Put(seal_key(self.keys, self.topic, sid), json.dumps({"endOffset": e}).encode())
                    for sid, e in ends.items()
                ),
                Delete(sealing_key(self.keys, self.topic)),
            ],
        )
        assert result.succeeded
        self.layout = layout

    async def seal_atomically(self, layout: Layout, sids: list[int]) -> None:
        """What the broker does: intent, end offsets read after it, one transaction."""
        lease = await self.begin_seal(sids)
        try:
            ends = {sid: await self.end_offset(sid) for sid in sids}
            await self.commit_seal(layout, ends)
        finally:
            await self.store.revoke_lease(lease)

    async def split(self, sid: int) -> None:
        await self.seal_atomically(split(self.layout, sid, now_ms=1), [sid])

    async def merge(self, a: int, b: int) -> None:
        await self.seal_atomically(merge(self.layout, a, b, now_ms=2), [a, b])

    async def records(self, sid: int) -> list[Any]:
        """Every record of a segment's topic, in offset order."""
        tp = TopicPartition(self.kafka_topic(sid), 0)
        end = await self.end_offset(sid)
        self.reader.assign([tp])
        try:
            await self.reader.seek_to_beginning(tp)
            out: list[Any] = []
            with anyio.fail_after(10):
                while len(out) < end:
                    batch = await self.reader.getmany(tp, timeout_ms=200)
                    out += batch.get(tp, [])
            return out
        finally:
            self.reader.assign([])  # track no topic: a refresh would re-create a deleted one

    async def committed(self, sub: str) -> dict[int, int]:
        """The subscription group's committed offset per segment (as the broker reads it)."""
        tps = {TopicPartition(self.kafka_topic(sid), 0): sid for sid in self.layout.segments}
        answer = await self.admin.list_consumer_group_offsets(
            subscription_group(self.topic, sub), partitions=list(tps)
        )
        return {tps[tp]: meta.offset for tp, meta in answer.items() if meta.offset >= 0}


@asynccontextmanager
async def sim_broker(
    store: Store, prefix: str, bootstrap: str, segments: int
) -> AsyncIterator[SimBroker]:
    keys = Keys(metadata_prefix=f"{prefix}pulsar", controller_root=f"{prefix}controllerd")
    topic = TopicName("acme", "ns", f"t{uuid.uuid4().hex[:12]}")
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    reader = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, fetch_max_wait_ms=50
    )
    await admin.start()
    await reader.start()
    try:
        async with open_kafka(bootstrap) as kafka:
            empty = Layout(epoch=0, next_segment_id=0, segments={})
            sim = SimBroker(store, keys, topic, bootstrap, admin, reader, kafka, empty)
            await sim.write_layout(initial_layout(segments))
            yield sim
    finally:
        await reader.stop()
        await admin.close()


class KafkaSeam:
    """The real AIOKafkaProducer, with the test's hook where its ``send`` may wait or fail.

    Stands for what aiokafka 0.14's ``AIOKafkaProducer.send`` does before it returns
    the message's future: it awaits a metadata round trip for a topic it has not
    sent to (raising UnknownTopicOrPartitionError if that metadata does not come
    within ``request_timeout_ms``) and room in a full batch buffer (raising
    KafkaTimeoutError if none frees up in time). ``before_send`` runs there and
    may await (the layout moves on meanwhile) or raise (that failure); the message
    then goes to the real producer. ``client.set_topics`` is recorded in ``named``.
    """

    def __init__(self, real: Any) -> None:
        self.real = real
        self.before_send: Callable[[str], Awaitable[None]] | None = None
        self.named: list[set[str]] = []
        self.client = self._Client(self)

    class _Client:
        def __init__(self, seam: KafkaSeam) -> None:
            self._seam = seam

        def set_topics(self, topics: list[str]) -> Any:
            self._seam.named.append(set(topics))
            return self._seam.real.client.set_topics(topics)

    async def start(self) -> None:
        await self.real.start()

    async def stop(self) -> None:
        await self.real.stop()

    async def send(self, topic: str, value: bytes, *, key: bytes | None, partition: int) -> Any:
        if self.before_send is not None:
            await self.before_send(topic)
        return await self.real.send(topic, value, key=key, partition=partition)


@pytest.fixture
def kafka_seams(monkeypatch: pytest.MonkeyPatch) -> list[KafkaSeam]:
    """Every producer ``open_producer`` opens from now on goes through a :class:`KafkaSeam`."""
    seams: list[KafkaSeam] = []

    def make(**kwargs: Any) -> KafkaSeam:
        seams.append(KafkaSeam(AIOKafkaProducer(**kwargs)))
        return seams[-1]

    monkeypatch.setattr(client_module, "AIOKafkaProducer", make)
    return seams


def kv(key: str, round_: int) -> tuple[bytes, bytes]:
    return key.encode(), f"{key}:{round_}".encode()


def split_between(a: Consumer, b: Consumer) -> tuple[set[int], set[int]]:
    return set(a.assignment), set(b.assignment)


def per_key(messages: list[Message]) -> dict[bytes, list[int]]:
    rounds: dict[bytes, list[int]] = defaultdict(list)
    for m in messages:
        assert m.key is not None
        rounds[m.key].append(int(m.value.decode().rsplit(":", 1)[1]))
    return rounds


# --- pure parts ----------------------------------------------------------------------------


def test_names_and_hash() -> None:
    topic = TopicName("acme", "ns", "orders")
    assert segment_topic(topic, "0000-7fff-1") == "seg.acme.ns.orders.0000-7fff-1"
    assert subscription_group(topic, "s_1") == "sub.acme.ns.orders.s_1"
    # Murmur3-32 of "hello", seed 0, is 0x248bfa47: the route is its top 16 bits.
    assert key_hash(b"hello") == 0x248B
    assert key_hash(b"") == 0
    for bad in ("", "a.b", "a/b", "ä", "x\n"):
        with pytest.raises(ValueError, match="must match"):
            check_name_part(bad)
    with pytest.raises(ValueError, match="descriptor"):
        segment_topic(topic, "0000-7FFF-1")
    with pytest.raises(ValueError, match="must match"):
        subscription_group(TopicName("acme", "ns", "or.ders"), "s")


def test_readable_segments_wait_for_every_parent_still_in_the_layout() -> None:
    layout = merge(split(initial_layout(2), 0, now_ms=1), 3, 1, now_ms=2)
    # 0 -> 2, 3; 3 + 1 -> 4
    assert readable_segments(layout, {}, {}) == [0, 1]
    # 3 is sealed empty (end 0): finished without a commit.
    assert readable_segments(layout, {0: 5, 1: 7, 3: 0}, {0: 5}) == [1, 2]
    assert readable_segments(layout, {0: 5, 1: 7, 3: 0}, {0: 5, 1: 7}) == [2, 4]
    pruned = Layout(
        epoch=9,
        next_segment_id=5,
        segments={4: Segment(4, HashRange(0, 0xFFFF), SegmentState.ACTIVE, parent_ids=(3, 1))},
    )
    assert readable_segments(pruned, {}, {}) == [4]
    assert deal([5, 1, 3], ["b", "a"]) == {"a": [1, 5], "b": [3]}
    assert deal([1], []) == {}


# --- producer --------------------------------------------------------------------------------


async def test_producer_routes_by_key_hash(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    async with sim_broker(store, etcd_prefix, kafka_broker, 4) as sim:
        async with open_producer(
            store, sim.keys, kafka_broker, sim.topic, retain_limit=50
        ) as producer:
            sent = [kv(f"key-{i}", 0) for i in range(200)]
            # Concurrent sends, 50 at a time: a trim forgets only what Kafka has already
            # acknowledged, and on a busy host none of 200 sends at once may be by the time
            # the limit is reached. A batch is acknowledged before the next begins, so the
            # trims during the later batches must forget it.
            results = []
            for first in range(0, len(sent), 50):
                batch = sent[first : first + 50]
                results += await asyncio.gather(*(producer.send(k, v) for k, v in batch))
            keyless = await producer.send(None, b"no key")
            assert producer.retained <= 200 - 50  # trimmed: etcd still shows every segment active
            await producer.flush()
            assert producer.retained == 0
        for (key, _), result in zip(sent, results, strict=True):
            rng = sim.layout.segments[result.segment_id].hash_range
            assert rng.start <= key_hash(key) <= rng.end
        stored: list[tuple[int, bytes | None]] = []
        for sid, seg in sim.layout.segments.items():
            for record in await sim.records(sid):
                stored.append((sid, record.key))
                if record.key is not None:
                    assert seg.hash_range.start <= key_hash(record.key) <= seg.hash_range.end
        assert sorted(k for _, k in stored if k is not None) == sorted(k for k, _ in sent)
        assert (keyless.segment_id, None) in stored
        assert sum(s.messages for s in producer.stats.values()) == 201
        assert len({r.segment_id for r in results}) == 4


async def test_producer_resends_what_landed_beyond_the_seal(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    async with sim_broker(store, etcd_prefix, kafka_broker, 1) as sim:
        names = [f"k{i}" for i in range(10)]
        async with open_producer(store, sim.keys, kafka_broker, sim.topic) as producer:
            for i, name in enumerate(names):
                assert await producer.send(*kv(name, 0)) == SendResult(0, i)
            await sim.write_layout(split(sim.layout, 0, now_ms=1))  # children 1, 2
            await eventually(lambda: producer.pending_seals == {0})
            async with anyio.create_task_group() as tg:

                async def send_new() -> None:
                    for name in names:
                        result = await producer.send(*kv(name, 1))
                        assert result.segment_id in (1, 2)

                tg.start_soon(send_new)
                # No seal yet: the producer cannot know what to re-send, so it sends nothing.
                with anyio.move_on_after(0.3):
                    await eventually(lambda: sum(s.messages for s in producer.stats.values()) > 10)
                assert sum(s.messages for s in producer.stats.values()) == 10
                # The race, made deterministic: the broker says the segment ended at 6,
                # as if offsets 6..9 had landed after it read the end offset.
                await sim.seal(0, end=6)
            assert producer.stats[0].resent == 4
            assert producer.pending_seals == frozenset()

        assert [r.value for r in await sim.records(0)] == [kv(n, 0)[1] for n in names]
        for child in (1, 2):
            rng = sim.layout.segments[child].hash_range
            mine = [n for n in names if rng.start <= key_hash(n.encode()) <= rng.end]
            resent = [kv(n, 0)[1] for n in mine if int(n[1:]) >= 6]
            expected = resent + [kv(n, 1)[1] for n in mine]
            assert [r.value for r in await sim.records(child)] == expected

        # A consumer reads the parent only up to its seal: offsets 6..9 come from the children.
        got: list[Message] = []
        async with open_consumer(store, sim.keys, kafka_broker, sim.topic, "s", "c") as consumer:
            with anyio.fail_after(10):
                async for message in consumer.messages():
                    got.append(message)
                    if len(got) == 20:
                        break
        assert [m.offset for m in got if m.segment_id == 0] == list(range(6))
        assert per_key(got) == {n.encode(): [0, 1] for n in names}


async def test_producer_routes_one_segments_resends_by_one_layout(
    store: Store, etcd_prefix: str, kafka_broker: str, kafka_seams: list[KafkaSeam]
) -> None:
    """The layout moves on while a re-send waits in aiokafka: the next re-send must not see it.

    Re-sent by the newer layout, m2 would go straight to grandchild 3 while m1 sat
    in child 1, sealed meanwhile, and m1's own re-send would then follow m2 there.
    """
    key = next(k for k in (f"k{i}" for i in range(1000)) if key_hash(k.encode()) < 0x4000)
    async with sim_broker(store, etcd_prefix, kafka_broker, 1) as sim:
        async with open_producer(store, sim.keys, kafka_broker, sim.topic) as producer:
            (seam,) = kafka_seams
            for round_ in (1, 2):
                assert await producer.send(*kv(key, round_)) == SendResult(0, round_ - 1)
            await sim.write_layout(split(sim.layout, 0, now_ms=1))  # 0 -> 1 [0, 7fff], 2
            child = sim.kafka_topic(1)
            moved = anyio.Event()

            async def layout_moves_on(topic: str) -> None:
                """m1's re-send waits for the new child's metadata: 1 -> 3 [0, 3fff], 4."""
                if topic != child or moved.is_set():
                    return
                moved.set()
                await sim.write_layout(split(sim.layout, 1, now_ms=2))
                await sim.seal(1, end=0)
                follower = producer._follower  # no public view of what the watch applied
                await eventually(lambda: follower.layout == sim.layout and 1 in follower.seals)

            seam.before_send = layout_moves_on
            await sim.seal(0, end=0)  # m1 and m2 landed beyond it
            with anyio.fail_after(20):
                await moved.wait()
                await producer.flush()
        in_order = [kv(key, 1)[1], kv(key, 2)[1]]
        assert [r.value for r in await sim.records(3)] == in_order
        assert [r.value for r in await sim.records(1)] == in_order
        assert (producer.stats[0].resent, producer.stats[1].resent) == (2, 2)


async def test_producer_keeps_resends_that_kafka_refused_and_retries_them(
    store: Store, etcd_prefix: str, kafka_broker: str, kafka_seams: list[KafkaSeam]
) -> None:
    """aiokafka's send raises on the third re-send: the sealer backs off and re-sends the rest."""
    names = [f"k{i}" for i in range(6)]
    async with sim_broker(store, etcd_prefix, kafka_broker, 1) as sim:
        async with open_producer(store, sim.keys, kafka_broker, sim.topic) as producer:
            (seam,) = kafka_seams
            for name in names:
                await producer.send(*kv(name, 0))
            await sim.write_layout(split(sim.layout, 0, now_ms=1))  # children 1, 2
            resends = 0

            async def refuse_the_third(topic: str) -> None:
                nonlocal resends
                resends += 1
                if resends == 3:
                    raise UnknownTopicOrPartitionError()  # the metadata did not come in time

            seam.before_send = refuse_the_third
            await sim.seal(0, end=0)  # every message landed beyond it
            with anyio.fail_after(20):
                await eventually(lambda: resends > len(names))  # every re-send, one retried
                for name in names:
                    assert (await producer.send(*kv(name, 1))).segment_id in (1, 2)
                await producer.flush()
            assert producer.stats[0].resent == len(names)
            assert producer.retained == 0
        for child in (1, 2):
            rng = sim.layout.segments[child].hash_range
            mine = [n for n in names if rng.start <= key_hash(n.encode()) <= rng.end]
            expected = [kv(n, 0)[1] for n in mine] + [kv(n, 1)[1] for n in mine]
            assert [r.value for r in await sim.records(child)] == expected


async def test_a_send_that_meets_a_refused_resend_fails_unsent_and_the_resends_stay(
    store: Store, etcd_prefix: str, kafka_broker: str, kafka_seams: list[KafkaSeam]
) -> None:
    """A send that gets the gate before the sealer settles the seal itself; when Kafka
    refuses a re-send there, that send fails with SendFailed and sends nothing, and the
    re-sends stay pending (for the sealer, in order) rather than being lost.

    Made deterministic with the gate's FIFO order: ``a`` holds the gate (its own send
    waits in aiokafka), ``b`` queues behind it, and only then does the split arrive, so
    the sealer queues behind ``b``."""
    key = "k0"
    async with sim_broker(store, etcd_prefix, kafka_broker, 1) as sim:
        async with open_producer(store, sim.keys, kafka_broker, sim.topic) as producer:
            (seam,) = kafka_seams
            assert await producer.send(*kv(key, 0)) == SendResult(0, 0)
            parent = sim.kafka_topic(0)
            hold_a, a_waits = anyio.Event(), anyio.Event()
            refusing = True
            refused = 0

            async def seam_hook(topic: str) -> None:
                nonlocal refused
                if topic == parent and not a_waits.is_set():
                    a_waits.set()
                    await hold_a.wait()  # ``a`` holds the gate meanwhile
                elif topic != parent and refusing:
                    refused += 1
                    raise UnknownTopicOrPartitionError()

            seam.before_send = seam_hook
            failed: list[BaseException] = []

            async def send_b() -> None:
                try:
                    await producer.send(*kv(key, 2))
                except SendFailed as exc:
                    failed.append(exc)

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(producer.send, *kv(key, 1))
                    await a_waits.wait()
                    tg.start_soon(send_b)
                    await eventually(lambda: producer._gate.statistics().tasks_waiting == 1)
                    await sim.write_layout(split(sim.layout, 0, now_ms=1))  # children 1, 2
                    await sim.seal(0, end=0)  # every message landed beyond it
                    follower = producer._follower  # no public view of what the watch applied
                    await eventually(lambda: follower.layout == sim.layout and 0 in follower.seals)
                    hold_a.set()
                assert len(failed) == 1 and "re-send before this message" in str(failed[0])
                assert refused >= 1
                assert producer.pending_seals == {0}  # nothing settled, nothing lost
                refusing = False
                await producer.flush()
            assert producer.stats[0].resent == 2
        child = next(
            c
            for c in (1, 2)
            if sim.layout.segments[c].hash_range.start
            <= key_hash(key.encode())
            <= sim.layout.segments[c].hash_range.end
        )
        # m0 and m1 re-sent in order; m2 was never sent.
        assert [r.value for r in await sim.records(child)] == [kv(key, 0)[1], kv(key, 1)[1]]


async def test_producer_keeps_naming_a_merged_parent_it_has_not_settled(
    store: Store, etcd_prefix: str, kafka_broker: str, kafka_seams: list[KafkaSeam]
) -> None:
    """A merge seals 0 and 1 at once: settling 0 must not drop 1 from aiokafka's metadata.

    A topic aiokafka stops naming has no leader after the next refresh, so batches
    queued for it would sit until they expire (``request_timeout_ms``).
    """
    names = [f"key-{i}" for i in range(20)]
    async with sim_broker(store, etcd_prefix, kafka_broker, 2) as sim:
        async with open_producer(store, sim.keys, kafka_broker, sim.topic) as producer:
            (seam,) = kafka_seams
            sent = {(await producer.send(*kv(n, 0))).segment_id for n in names}
            assert sent == {0, 1}
            await sim.merge(0, 1)  # -> 2
            with anyio.fail_after(20):
                await producer.flush()
            parents = {sim.kafka_topic(0), sim.kafka_topic(1)}
            merged = sim.kafka_topic(2)
            assert seam.named == [{sim.kafka_topic(1), merged}, {merged}]
            assert not parents & seam.named[-1]  # a deleted parent must not come back
            assert {(await producer.send(*kv(n, 1))).segment_id for n in names} == {2}


# --- consumer --------------------------------------------------------------------------------


async def test_consumer_reads_across_split_and_merge_once_in_key_order(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    keys_n, rounds = 200, 20
    names = [f"key-{i}" for i in range(keys_n)]
    async with (
        sim_broker(store, etcd_prefix, kafka_broker, 2) as sim,
        open_producer(store, sim.keys, kafka_broker, sim.topic) as producer,
        open_consumer(store, sim.keys, kafka_broker, sim.topic, "s", "c1") as consumer,
    ):
        got: list[Message] = []

        async def consume() -> None:
            async for message in consumer.messages():
                got.append(message)
                if len(got) == keys_n * rounds:
                    return

        async def send_round(r: int) -> None:
            await asyncio.gather(*(producer.send(*kv(n, r)) for n in names))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                for r in range(rounds):
                    async with anyio.create_task_group() as race:
                        race.start_soon(send_round, r)
                        if r == 7:  # split while a round is in flight: 0 -> 2, 3
                            race.start_soon(sim.split, 0)
                        if r == 14:  # merge while a round is in flight: 3 + 1 -> 4
                            race.start_soon(sim.merge, 3, 1)

    assert len(got) == keys_n * rounds
    assert per_key(got) == {n.encode(): list(range(rounds)) for n in names}
    assert {m.segment_id for m in got} == {0, 1, 2, 3, 4}


async def test_two_consumers_share_segments_and_hand_over(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    names = [f"key-{i}" for i in range(200)]
    async with (
        sim_broker(store, etcd_prefix, kafka_broker, 4) as sim,
        open_producer(store, sim.keys, kafka_broker, sim.topic) as producer,
    ):
        got: list[tuple[str, Message]] = []  # in delivery order, across both consumers
        b_scope = anyio.CancelScope()
        b_closed = anyio.Event()

        async def run(
            name: str,
            scope: anyio.CancelScope,
            *,
            task_status: TaskStatus[Consumer] = anyio.TASK_STATUS_IGNORED,
        ) -> None:
            with scope:
                async with open_consumer(
                    store, sim.keys, kafka_broker, sim.topic, "s", name
                ) as consumer:
                    task_status.started(consumer)
                    async for message in consumer.messages():
                        got.append((name, message))
            b_closed.set()

        async def send_round(r: int) -> list[SendResult]:
            return await asyncio.gather(*(producer.send(*kv(n, r)) for n in names))

        def delivered(by: str | None = None) -> list[Message]:
            return [m for name, m in got if by in (None, name)]

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                a: Consumer = await tg.start(run, "a", anyio.CancelScope())
                b: Consumer = await tg.start(run, "b", b_scope)
                await eventually(
                    lambda: (a.assignment, b.assignment) == (frozenset({0, 2}), frozenset({1, 3}))
                )

                results = [*await send_round(0), *await send_round(1)]
                await eventually(lambda: len(delivered()) == 400)
                assert {m.segment_id for m in delivered("a")} == {0, 2}
                assert {m.segment_id for m in delivered("b")} == {1, 3}
                ends = Counter(r.segment_id for r in results)
                await eventually_equal(lambda: sim.committed("s"), dict(ends))

                # Segment 0 is finished at once (a committed it): 1..5 are readable.
                await sim.split(0)
                await eventually(
                    lambda: (
                        (a.assignment, b.assignment) == (frozenset({1, 3, 5}), frozenset({2, 4}))
                    )
                )
                await send_round(2)
                await send_round(3)
                await eventually(lambda: len(delivered()) == 800)

                b_scope.cancel()
                await b_closed.wait()
                await eventually(lambda: a.assignment == {1, 2, 3, 4, 5})
                await send_round(4)
                await eventually(lambda: len(delivered()) == 1000)
                tg.cancel_scope.cancel()

    assert per_key(delivered()) == {n.encode(): [0, 1, 2, 3, 4] for n in names}
    assert Counter((m.segment_id, m.offset) for m in delivered()).most_common(1)[0][1] == 1


# --- the sealing intent --------------------------------------------------------------------


async def test_consumer_holds_back_a_segment_while_it_is_being_sealed(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    names = [f"k{i}" for i in range(10)]
    async with (
        sim_broker(store, etcd_prefix, kafka_broker, 1) as sim,
        open_producer(store, sim.keys, kafka_broker, sim.topic) as producer,
        open_consumer(store, sim.keys, kafka_broker, sim.topic, "s", "c") as consumer,
    ):
        got: list[Message] = []

        async def consume() -> None:
            async for message in consumer.messages():
                got.append(message)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                for name in names:
                    await producer.send(*kv(name, 0))  # offsets 0..9
                await eventually(lambda: len(got) == 10)
                lease = await sim.begin_seal([0])
                # The layout still shows 0 active, and a producer may still write to it:
                # the broker reads the end only after the intent. Nothing of it is
                # delivered until the seal says where the segment ends.
                for name in names:
                    await producer.send(*kv(name, 1))  # offsets 10..19
                with anyio.move_on_after(0.5):
                    await eventually(lambda: len(got) > 10)
                assert len(got) == 10
                # The broker read the end as 15: 15..19 landed after its read.
                await sim.commit_seal(split(sim.layout, 0, now_ms=1), {0: 15})
                await store.revoke_lease(lease)
                await eventually(lambda: len(got) == 20)
                with anyio.move_on_after(0.3):
                    await eventually(lambda: len(got) > 20)
                tg.cancel_scope.cancel()
    assert [m.offset for m in got if m.segment_id == 0] == list(range(15))
    assert per_key(got) == {n.encode(): [0, 1] for n in names}  # once each, in order
    assert producer.stats[0].resent == 5


async def test_consumer_resumes_when_an_abandoned_intent_expires(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    async with (
        sim_broker(store, etcd_prefix, kafka_broker, 1) as sim,
        open_producer(store, sim.keys, kafka_broker, sim.topic) as producer,
        open_consumer(store, sim.keys, kafka_broker, sim.topic, "s", "c") as consumer,
    ):
        got: list[Message] = []

        async def consume() -> None:
            async for message in consumer.messages():
                got.append(message)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                lease = await sim.begin_seal([0])
                for i in range(5):
                    await producer.send(*kv(f"k{i}", 0))
                with anyio.move_on_after(0.5):
                    await eventually(lambda: len(got) > 0)
                assert got == []
                await store.revoke_lease(lease)  # the broker died: its lease ends the intent
                await eventually(lambda: len(got) == 5)
                tg.cancel_scope.cancel()
    assert [m.offset for m in got] == list(range(5))


async def test_producer_forgets_nothing_of_a_segment_being_sealed(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    names = [f"k{i}" for i in range(10)]
    async with sim_broker(store, etcd_prefix, kafka_broker, 1) as sim:
        async with open_producer(store, sim.keys, kafka_broker, sim.topic) as producer:
            for name in names:
                await producer.send(*kv(name, 0))
            lease = await sim.begin_seal([0])
            flushed = anyio.Event()
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:

                    async def flush() -> None:
                        await producer.flush()
                        flushed.set()

                    tg.start_soon(flush)
                    # While the intent stands a seal may come at any offset: keep everything.
                    with anyio.move_on_after(0.5):
                        await flushed.wait()
                    assert not flushed.is_set()
                    assert producer.retained == 10
                    await sim.commit_seal(split(sim.layout, 0, now_ms=1), {0: 6})
                    await flushed.wait()
            await store.revoke_lease(lease)
            assert producer.stats[0].resent == 4
            assert producer.retained == 0
        for child in (1, 2):
            rng = sim.layout.segments[child].hash_range
            mine = [n for n in names if rng.start <= key_hash(n.encode()) <= rng.end]
            resent = [kv(n, 0)[1] for n in mine if int(n[1:]) >= 6]
            assert [r.value for r in await sim.records(child)] == resent


async def test_producer_does_not_bring_back_a_deleted_segment(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    """A producer's later metadata refresh must not name (and so re-create) a deleted parent."""
    names = [f"k{i}" for i in range(40)]
    async with sim_broker(store, etcd_prefix, kafka_broker, 1) as sim:
        async with open_producer(store, sim.keys, kafka_broker, sim.topic) as producer:

            async def send_all(round_: int) -> set[int]:
                return {(await producer.send(*kv(n, round_))).segment_id for n in names}

            assert await send_all(0) == {0}
            await sim.split(0)  # children 1, 2: topics the producer looks up by name
            assert await send_all(1) == {1, 2}
            await sim.split(1)  # children 3, 4
            assert await send_all(2) == {3, 4, 2}
            parents = [sim.kafka_topic(0), sim.kafka_topic(1)]
            await sim.admin.delete_topics(parents)  # GC deleted the drained parents
            await sim.split(2)  # children 5, 6: new topics, looked up with a metadata refresh
            assert await send_all(3) == {3, 4, 5, 6}
        listed = await sim.admin.list_topics()
        assert [p for p in parents if p in listed] == []


# --- garbage in etcd ---------------------------------------------------------------------------


_DEEP: Final = b"[" * 100_000 + b"]" * 100_000


def _garbage(sim: SimBroker, case: str) -> tuple[str, bytes]:
    """A key of the topic's subtree and a value another writer may leave there."""
    if case == "layout-deep":  # RecursionError out of json.loads
        return sim.keys.layout(sim.topic), _DEEP
    if case == "layout-deep-in-message":  # strict JSON; the core's error message shows it
        return sim.keys.layout(sim.topic), b'{"segments": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    if case == "layout-negative-id":  # every invariant holds; "0000-ffff--1" has no topic
        segment = Segment(-1, HashRange(0, 0xFFFF), SegmentState.ACTIVE)
        negative = Layout(epoch=1, next_segment_id=0, segments={-1: segment})
        return sim.keys.layout(sim.topic), json.dumps(layout_to_json(negative)).encode()
    if case == "sealing":
        return sealing_key(sim.keys, sim.topic), _DEEP
    if case == "seal":
        return seal_key(sim.keys, sim.topic, 0), _DEEP
    assert case == "registration"
    return sim.keys.consumer(sim.topic, "s", "ghost"), _DEEP


@pytest.mark.parametrize(
    "case",
    [
        "layout-deep",
        "layout-deep-in-message",
        "layout-negative-id",
        "sealing",
        "seal",
        "registration",
    ],
)
async def test_garbage_in_the_topic_subtree_ends_neither_producer_nor_consumer(
    store: Store, etcd_prefix: str, kafka_broker: str, case: str
) -> None:
    """Each value raised out of the watch (RecursionError where only ValueError was
    caught; ValueError out of segment_topic for the negative id), which ended the
    producer or consumer. Now an unusable layout is ignored, the last usable one stays
    and delivery waits for a usable one; an unreadable intent holds every segment back
    until it is gone; an unreadable seal or registration is ignored."""
    async with (
        sim_broker(store, etcd_prefix, kafka_broker, 1) as sim,
        # retain_limit 1: every send's trim reads the layout afresh
        open_producer(store, sim.keys, kafka_broker, sim.topic, retain_limit=1) as producer,
        open_consumer(store, sim.keys, kafka_broker, sim.topic, "s", "c") as consumer,
    ):
        got: list[Message] = []

        async def consume() -> None:
            async for message in consumer.messages():
                got.append(message)

        followers = (producer._follower, consumer._follower)  # no public view of the watch
        with structlog.testing.capture_logs() as logs, anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await producer.send(*kv("k", 0))
                await eventually(lambda: len(got) == 1)
                key, value = _garbage(sim, case)
                revision = await store.put(key, value)
                await eventually(lambda: all(f.revision >= revision for f in followers))
                assert all(f.layout == sim.layout for f in followers)
                assert (await producer.send(*kv("k", 1))).segment_id == 0
                if case.startswith("layout"):
                    # the consumer's fresh read of the layout found it unusable
                    await eventually(
                        lambda: any(e["event"] == "refclient.consumer.end_unknown" for e in logs)
                    )
                    await sim.write_layout(sim.layout)  # repaired
                elif case == "sealing":
                    await store.delete(key)  # the broker's lease ended it
                await eventually(lambda: len(got) == 2)
                tg.cancel_scope.cancel()
    assert [(m.segment_id, m.offset) for m in got] == [(0, 0), (0, 1)]
    if case.startswith("layout"):
        assert any(e["event"] == "refclient.layout.invalid" for e in logs)


# --- state that must not grow with the topic's history -----------------------------------------


async def gc(sim: SimBroker, sids: list[int]) -> None:
    """What GC does to drained sealed segments: prune them from the layout, then the broker
    deletes each one's data and seal key."""
    await sim.write_layout(prune(sim.layout, sids))
    for sid in sids:
        await sim.store.delete(seal_key(sim.keys, sim.topic, sid))


async def test_a_follower_keeps_a_deleted_seal_only_while_something_needs_it(
    store: Store, etcd_prefix: str
) -> None:
    """``seals`` only grew: GC deletes every seal key it wrote, so split/merge churn left
    one entry per segment the topic ever sealed."""
    keys = Keys(metadata_prefix=f"{etcd_prefix}pulsar", controller_root=f"{etcd_prefix}ctl")
    topic = TopicName("acme", "ns", f"t{uuid.uuid4().hex[:12]}")
    follower = client_module._TopicFollower(store, keys, topic, client_module._Signal(), None)
    layout = initial_layout(1)
    revision = 0

    async def write(new: Layout, seals: dict[int, int], deleted: list[int]) -> None:
        """One transaction, as the broker's; then wait for the watch to apply it."""
        nonlocal layout, revision
        layout = new
        result = await store.txn(
            [Compare.mod_revision(keys.layout(topic), revision)],
            [
                Put(keys.layout(topic), json.dumps(layout_to_json(new)).encode()),
                *(
                    Put(seal_key(keys, topic, sid), json.dumps({"endOffset": end}).encode())
                    for sid, end in seals.items()
                ),
                *(Delete(seal_key(keys, topic, sid)) for sid in deleted),
            ],
        )
        assert result.succeeded
        revision = result.revision
        await eventually(lambda: follower.revision >= revision)

    await follower.load()
    async with anyio.create_task_group() as tg:
        tg.start_soon(follower.run)
        await write(layout, {}, [])
        for _ in range(30):
            (a,) = [s.segment_id for s in layout.active_segments()]
            await write(split(layout, a, now_ms=1), {a: 5}, [])
            b, c = layout.segments[a].child_ids
            await write(merge(layout, b, c, now_ms=2), {b: 1, c: 2}, [])
            # The seal keys go first (a broker's delete): the layout still shows the segments,
            # and a consumer tells by their ends whether the merged child is readable.
            await write(layout, {}, [a, b, c])
            assert {a: 5, b: 1, c: 2}.items() <= follower.seals.items()
            (d,) = [s.segment_id for s in layout.active_segments()]
            assert readable_segments(layout, follower.seals, {a: 5, b: 1, c: 2}) == [d]
            await write(prune(layout, [a, b, c]), {}, [])
            assert follower.seals == {}
        # A seal the owner still needs stays after GC, until the owner lets it go.
        (a,) = [s.segment_id for s in layout.active_segments()]
        await write(split(layout, a, now_ms=1), {a: 7}, [])
        held = {a}
        follower.holds = held.__contains__
        await write(prune(layout, [a]), {}, [a])
        assert follower.seals == {a: 7}
        held.clear()
        follower.drop_unneeded_seals()
        assert follower.seals == {}
        tg.cancel_scope.cancel()


async def test_a_follower_rides_out_a_failed_watch_and_a_failed_reload(
    etcd_server: EtcdServer, store: Store, etcd_prefix: str
) -> None:
    """A watch etcd ended with an error, or a reload after a compaction that found
    etcd unreachable, ended the follower and with it the producer or consumer. Now
    each is retried; here the watch fails while the layout changes and etcd
    compacts, and the reload's first read fails too."""
    keys = Keys(metadata_prefix=f"{etcd_prefix}pulsar", controller_root=f"{etcd_prefix}ctl")
    topic = TopicName("acme", "ns", f"t{uuid.uuid4().hex[:12]}")
    layout = initial_layout(1)
    revision = await store.put(keys.layout(topic), json.dumps(layout_to_json(layout)).encode())
    failing = FailingStore(store)
    follower = client_module._TopicFollower(
        cast(Store, failing), keys, topic, client_module._Signal(), None
    )
    await follower.load()
    async with anyio.create_task_group() as tg:
        tg.start_soon(follower.run)
        for _ in range(3):
            (a,) = [s.segment_id for s in layout.active_segments()]
            layout = split(layout, a, now_ms=1)
            b, c = layout.segments[a].child_ids
            layout = merge(layout, b, c, now_ms=2)
            revision = await store.put(
                keys.layout(topic), json.dumps(layout_to_json(layout)).encode()
            )
        await compact(etcd_server.endpoint, revision)
        failing.fail_reads = True
        failing.release.set()
        await eventually(lambda: follower.revision >= revision)
        assert follower.layout == layout
        assert failing.watches >= 3  # failed; compacted; the one after the reload
        assert failing.failed_reads == 1
        tg.cancel_scope.cancel()


async def test_a_settle_retried_after_gc_still_finds_its_seal_and_then_forgets_it(
    store: Store, etcd_prefix: str, kafka_broker: str, kafka_seams: list[KafkaSeam]
) -> None:
    """GC may prune a segment whose re-sends Kafka refused: the retry needs the seal (the
    producer's follower keeps it while tracked); once settled, the segment is forgotten."""
    names = [f"k{i}" for i in range(6)]
    async with sim_broker(store, etcd_prefix, kafka_broker, 1) as sim:
        async with open_producer(store, sim.keys, kafka_broker, sim.topic) as producer:
            (seam,) = kafka_seams
            follower = producer._follower  # no public view of what the watch applied
            for name in names:
                await producer.send(*kv(name, 0))
            refused = False

            async def gc_then_refuse(topic: str) -> None:
                """The first re-send: GC prunes the parent and deletes its seal, Kafka refuses."""
                nonlocal refused
                if refused:
                    return
                refused = True
                await gc(sim, [0])
                await eventually(lambda: follower.layout == sim.layout)
                raise UnknownTopicOrPartitionError()

            seam.before_send = gc_then_refuse
            await sim.write_layout(split(sim.layout, 0, now_ms=1))  # children 1, 2
            await sim.seal(0, end=0)  # every message landed beyond it
            with anyio.fail_after(20):
                await eventually(lambda: refused)
                assert follower.seals == {0: 0}  # its key is gone, but 0 is still tracked
                await producer.flush()
            assert producer.retained == 0
            assert follower.seals == {}
            assert set(producer.stats) == {1, 2}  # 0 is gone from the layout and settled
        for child in (1, 2):
            rng = sim.layout.segments[child].hash_range
            mine = [n for n in names if rng.start <= key_hash(n.encode()) <= rng.end]
            assert [r.value for r in await sim.records(child)] == [kv(n, 0)[1] for n in mine]


async def test_producer_state_stays_bounded_under_split_merge_and_gc(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    """``stats`` and the follower's ``seals`` kept an entry per segment the producer ever
    sent to or saw sealed, long after GC deleted it."""
    names = [f"k{i}" for i in range(8)]
    async with sim_broker(store, etcd_prefix, kafka_broker, 1) as sim:
        async with open_producer(store, sim.keys, kafka_broker, sim.topic) as producer:
            follower = producer._follower  # no public view of what the watch applied
            with anyio.fail_after(60):
                for round_ in range(8):
                    (a,) = [s.segment_id for s in sim.layout.active_segments()]
                    for name in names:
                        assert (await producer.send(*kv(name, round_))).segment_id == a
                    await sim.split(a)
                    b, c = sim.layout.segments[a].child_ids
                    # Until its watch brings the split, the producer may still write to a
                    # (and resend at the seal): route only once it knows the children.
                    await eventually(lambda: follower.layout == sim.layout)
                    routed = {(await producer.send(*kv(n, round_))).segment_id for n in names}
                    assert routed == {b, c}
                    await sim.merge(b, c)
                    await producer.flush()
                    assert producer.stats[a].messages == len(names)  # still in the layout
                    await gc(sim, [a, b, c])
                    await eventually(lambda: follower.layout == sim.layout)
                    assert len(follower.seals) <= 3
                    assert len(producer.stats) <= 4  # the last settle's segments, until the next
            # gc() deletes the seal keys after its layout write: the watch may be between
            await eventually(lambda: follower.seals == {})


async def test_consumer_state_stays_bounded_under_split_merge_and_gc(
    store: Store, etcd_prefix: str, kafka_broker: str
) -> None:
    """The consumer's commits per segment (and its follower's seals) kept every segment it
    ever read, after GC deleted it."""
    names = [f"k{i}" for i in range(8)]
    rounds = 6
    async with (
        sim_broker(store, etcd_prefix, kafka_broker, 1) as sim,
        open_producer(store, sim.keys, kafka_broker, sim.topic) as producer,
        open_consumer(store, sim.keys, kafka_broker, sim.topic, "s", "c") as consumer,
    ):
        got: list[Message] = []

        async def consume() -> None:
            async for message in consumer.messages():
                got.append(message)

        committed = consumer._committed  # no public view of either
        seals = consumer._follower.seals

        async def churn(round_: int) -> None:
            """Split the active segment, merge its children, and GC the three once read."""
            (a,) = [s.segment_id for s in sim.layout.active_segments()]
            for name in names:
                await producer.send(*kv(name, 3 * round_))
            await sim.split(a)
            b, c = sim.layout.segments[a].child_ids
            for name in names:
                await producer.send(*kv(name, 3 * round_ + 1))
            await sim.merge(b, c)
            (d,) = [s.segment_id for s in sim.layout.active_segments()]
            for name in names:
                await producer.send(*kv(name, 3 * round_ + 2))
            await producer.flush()
            await eventually(lambda: len(got) == 3 * len(names) * (round_ + 1))
            await eventually(lambda: consumer.assignment == {d})  # a, b, c finished
            await gc(sim, [a, b, c])
            await eventually(lambda: set(committed) <= {d} and set(seals) == set())

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                for round_ in range(rounds):
                    await churn(round_)
                tg.cancel_scope.cancel()
    assert per_key(got) == {n.encode(): list(range(3 * rounds)) for n in names}
