"""The reference broker's Kafka side: segment topics, end offsets, cursors, message sizes.

A thin adapter over aiokafka so the admin API and the load reporter speak in
segment topics and subscription groups, never in aiokafka types. Every
segment topic has one partition.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError, UnknownTopicOrPartitionError

#: How many of a segment's newest messages the load reporter reads for their size.
SIZE_SAMPLE = 50


class KafkaBackendError(Exception):
    """Kafka did not do what the broker asked."""


class KafkaBackend:
    """Segment topics in Kafka. Methods are safe to call concurrently."""

    def __init__(
        self, admin: AIOKafkaAdminClient, offsets: AIOKafkaConsumer, tail: AIOKafkaConsumer
    ) -> None:
        self._admin = admin
        self._offsets = offsets
        self._tail = tail
        self._tail_lock = anyio.Lock()

    async def create_topics(self, names: list[str]) -> None:
        """Create one-partition topics; existing ones are fine (the call is retried)."""
        if not names:
            return
        try:
            response = await self._admin.create_topics(
                [NewTopic(name, num_partitions=1, replication_factor=1) for name in names]
            )
        except TopicAlreadyExistsError:
            return
        except KafkaError as exc:
            raise KafkaBackendError(f"create topics {names}: {exc}") from exc
        for name, code, *_ in getattr(response, "topic_errors", []):
            if code not in (0, TopicAlreadyExistsError.errno):
                raise KafkaBackendError(f"create topic {name}: error code {code}")

    async def delete_topic(self, name: str) -> bool:
        """Delete a segment topic; False when it did not exist."""
        if not await self.exists(name):
            return False
        try:
            await self._admin.delete_topics([name])
        except UnknownTopicOrPartitionError:
            return False
        except KafkaError as exc:
            raise KafkaBackendError(f"delete topic {name}: {exc}") from exc
        return True

    async def exists(self, name: str) -> bool:
        try:
            return name in await self._admin.list_topics()
        except KafkaError as exc:
            raise KafkaBackendError(f"list topics: {exc}") from exc

    async def end_offset(self, name: str) -> int:
        """The offset after the topic's last record.

        tansu 0.6 answers ListOffsets(latest) with the last *batch's* base offset
        + 1, so the answer is checked by fetching from just before it: the fetch
        returns that record's whole batch (on Kafka, the record alone), and its
        last offset + 1 is the end on both.
        """
        tp = TopicPartition(name, 0)
        try:
            listed = int((await self._offsets.end_offsets([tp]))[tp])
            if listed == 0:
                return 0
            async with self._tail_lock:
                self._tail.assign([tp])
                self._tail.seek(tp, listed - 1)
                with anyio.fail_after(10):
                    while not (records := (await self._tail.getmany(tp, timeout_ms=200)).get(tp)):
                        pass
        except (KafkaError, TimeoutError) as exc:
            raise KafkaBackendError(f"end offset of {name}: {exc}") from exc
        return int(records[-1].offset) + 1

    async def committed(self, group: str, name: str) -> int | None:
        """The group's committed offset on a segment topic; None when it never committed."""
        tp = TopicPartition(name, 0)
        try:
            offsets = await self._admin.list_consumer_group_offsets(group, partitions=[tp])
        except KafkaError as exc:
            raise KafkaBackendError(f"committed offset of {group} on {name}: {exc}") from exc
        meta = offsets.get(tp)
        if meta is None or meta.offset < 0:
            return None
        return int(meta.offset)

    async def mean_message_size(self, name: str, end: int) -> float | None:
        """Mean key+value bytes of the newest messages before ``end``; None if none."""
        if end <= 0:
            return None
        tp = TopicPartition(name, 0)
        start = max(0, end - SIZE_SAMPLE)
        sizes: list[int] = []
        async with self._tail_lock:
            self._tail.assign([tp])
            self._tail.seek(tp, start)
            with anyio.move_on_after(2.0):
                last = start - 1
                while last < end - 1:
                    batch = await self._tail.getmany(tp, timeout_ms=200, max_records=SIZE_SAMPLE)
                    for record in batch.get(tp, []):
                        if start <= record.offset < end:
                            sizes.append(len(record.key or b"") + len(record.value or b""))
                        last = max(last, record.offset)
        return sum(sizes) / len(sizes) if sizes else None


@contextlib.asynccontextmanager
async def open_kafka(bootstrap: str) -> AsyncIterator[KafkaBackend]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    offsets = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    tail = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await admin.start()
    try:
        await offsets.start()
        try:
            await tail.start()
            try:
                yield KafkaBackend(admin, offsets, tail)
            finally:
                await tail.stop()
        finally:
            await offsets.stop()
    finally:
        await admin.close()
