"""Fast bulk writes of N scalable topics into a real etcd, for scale tests and the bench.

Each topic gets what a Pulsar broker writes for it (DESIGN §3): its layout
(``segments`` initial segments), one subscription, one consumer registration
and a load record per active segment, shaped as Pulsar's ``SegmentLoadStats``
(four rates, no time stamps). Writing them one put at a time would take
minutes at 100,000 topics (1.9 million keys), so puts go in transactions of at
most :data:`TXN_OPS` (etcd's ``--max-txn-ops`` default), several in flight.

Why hand-written: no library bulk-loads etcd; this is a loop over
:meth:`controllerd.adapters.store.Store.txn`.

Retries: ``Store.txn`` refuses a transaction without compares, because a
retried transaction must not apply twice. Here both branches hold the same
idempotent puts, so whatever the compare says and however often a batch is
retried, the keys end up with these values.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import anyio
import anyio.abc
import orjson

from controllerd.adapters.store import Compare, Put, Store
from controllerd.core.layout import initial_layout
from controllerd.core.model import TopicName, layout_to_json
from controllerd.core.view import Keys

#: Puts per transaction: etcd's default ``--max-txn-ops``.
TXN_OPS: Final = 128
#: Transactions in flight at once: enough to keep etcd's raft batching busy.
CONCURRENCY: Final = 8
#: Pulsar's ``SegmentLoadStats`` field names (SLS:39-44, see tests/support/pulsar.py).
LOAD_FIELDS: Final = ("msgRateIn", "bytesRateIn", "msgRateOut", "bytesRateOut")
#: A balanced segment under the default policy: above every merge threshold on
#: message rates, below every split threshold (nothing to split or merge).
BALANCED_MSG_RATE: Final = (1_500.0, 8_000.0)


def topic_names(count: int, tenant: str = "scale", namespaces: int = 100) -> list[TopicName]:
    """``count`` distinct topic names spread over ``namespaces`` namespaces of ``tenant``."""
    return [TopicName(tenant, f"ns{i % namespaces}", f"t{i}") for i in range(count)]


def load_record(msg_rate: float) -> bytes:
    """A Pulsar-shaped load record (no time stamps: controllerd dates it when first seen)."""
    return orjson.dumps(
        dict(
            zip(
                LOAD_FIELDS,
                (msg_rate, msg_rate * 1_000.0, msg_rate, msg_rate * 1_000.0),
                strict=True,
            )
        )
    )


def balanced_record(rng: random.Random) -> bytes:
    """A load record with a random balanced rate (see :data:`BALANCED_MSG_RATE`)."""
    return load_record(round(rng.uniform(*BALANCED_MSG_RATE), 1))


def topic_puts(
    keys: Keys,
    topic: TopicName,
    layout_value: bytes,
    segment_ids: Sequence[int],
    rng: random.Random,
    *,
    subscription: str = "sub",
    consumers: int = 1,
) -> Iterator[Put]:
    """Every key of one topic: layout, subscription, consumers, one load record a segment."""
    yield Put(keys.layout(topic), layout_value)
    yield Put(keys.subscription(topic, subscription), b'{"type":"STREAM"}')
    for c in range(consumers):
        yield Put(keys.consumer(topic, subscription, f"c{c}"), b"{}")
    for sid in segment_ids:
        yield Put(keys.load(topic, sid), balanced_record(rng))


@dataclass(frozen=True)
class Populated:
    """What :func:`populate` wrote and how long it took."""

    topics: int
    keys: int
    seconds: float
    revision: int


async def put_batch(store: Store, batch: Sequence[Put]) -> int:
    """One transaction of <= :data:`TXN_OPS` puts of distinct keys; its revision.

    The same puts on both branches: idempotent, so safe to retry (module docstring).
    """
    result = await store.txn([Compare.absent(batch[0].key)], batch, batch)
    return result.revision


async def put_all(
    store: Store, puts: Iterable[Put], *, concurrency: int = CONCURRENCY
) -> tuple[int, int]:
    """Write ``puts`` in transactions of <= :data:`TXN_OPS`; (keys written, last revision)."""
    send, receive = anyio.create_memory_object_stream[list[Put]](concurrency)
    written = revision = 0

    async def writer(batches: anyio.abc.ObjectReceiveStream[list[Put]]) -> None:
        nonlocal written, revision
        async with batches:
            async for batch in batches:
                revision = max(revision, await put_batch(store, batch))
                written += len(batch)

    async with anyio.create_task_group() as tg:
        with receive:
            for _ in range(concurrency):
                tg.start_soon(writer, receive.clone())
        async with send:
            batch: list[Put] = []
            held: set[str] = set()
            for put in puts:
                if put.key in held:  # etcd refuses a key twice in one transaction
                    await send.send(batch)
                    batch, held = [], set()
                batch.append(put)
                held.add(put.key)
                if len(batch) == TXN_OPS:
                    await send.send(batch)
                    batch, held = [], set()
            if batch:
                await send.send(batch)
    return written, revision


async def populate(
    store: Store,
    keys: Keys,
    topics: Sequence[TopicName],
    *,
    segments: int = 16,
    consumers: int = 1,
    seed: int = 0,
    now_ms: int | None = None,
) -> Populated:
    """Write ``topics`` (each ``segments`` active segments with load) into etcd."""
    started = time.monotonic()
    layout = initial_layout(segments, int(time.time() * 1000) if now_ms is None else now_ms)
    value = orjson.dumps(layout_to_json(layout))
    ids = sorted(layout.segments)
    rng = random.Random(seed)
    puts = (
        put
        for topic in topics
        for put in topic_puts(keys, topic, value, ids, rng, consumers=consumers)
    )
    written, revision = await put_all(store, puts)
    return Populated(len(topics), written, time.monotonic() - started, revision)
