"""The reference broker's Kafka side: segment topics, end offsets, cursors, message samples.

A thin adapter over aiokafka so the admin API and the load reporter speak in
segment topics and subscription groups, never in aiokafka types. Every
segment topic has one partition.

Deleted stays deleted. Kafka (and tansu) create a topic that a metadata
request *names* (``auto.create.topics.enable``; tansu cannot turn it off), and
an aiokafka client names, in every metadata refresh for the rest of its life,
each topic it was ever asked about. A long-lived client that once measured a
segment would therefore re-create it after GC deleted it. So:

* the one long-lived reading consumer tracks no topic between calls: each
  call names its topic only while it holds ``_lock`` and resets the tracked
  set (``assign([])``, so refreshes ask for *all* topics, which creates none)
  before releasing it;
* a topic is named only after it was seen to exist (cached all-topic
  metadata, else a fresh listing) and never after this process deleted it
  (``_deleted``), and deleting takes the same lock, so no read of a topic can
  overlap its deletion. Kafka deletes asynchronously, so a listing may still
  show a topic after its delete returned; ``_deleted`` covers exactly that
  window. A name leaves it once a listing requested after the delete no longer
  shows the topic (from then on the listing itself refuses it), or when this
  process creates the topic again: it holds only deletions still in progress,
  however many segments GC deletes over a long run;
* the admin client only lists all topics, creates, deletes and reads group
  offsets, none of which names a topic in a metadata request.

Kafka failing is normal: every admin request is bounded by ``request_timeout``
(:data:`REQUEST_TIMEOUT`), and whatever aiokafka raises for a Kafka that is
down, paused or unreachable (its own errors, but also the builtin
``TimeoutError`` of a request that got no answer, and ``OSError``) comes out as
:class:`KafkaBackendError`, which the admin API answers 503.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError, UnknownTopicOrPartitionError

from controllerd.adapters import backoff
from controllerd.errors import EXIT_UNAVAILABLE, OperatorError

log = structlog.get_logger("controllerd.refbroker.kafka")

#: How many of a segment's newest messages the load reporter reads at most per pass.
SAMPLE_LIMIT = 2000
#: Seconds one read of a segment's tail may take (tansu answers in milliseconds).
READ_TIMEOUT = 10.0
#: Seconds one admin request (list, create, delete topics; read a group's offsets) may
#: take. aiokafka's default is 40 s, and more for a request that first waits for a
#: connection; half the daemon's ``[broker] timeout_seconds`` (10) instead, so that a
#: Kafka that does not answer is a 503 the controller receives, not its own timeout.
REQUEST_TIMEOUT = 5.0

_T = TypeVar("_T")


class KafkaBackendError(Exception):
    """Kafka did not do what the broker asked."""


class TopicGone(KafkaBackendError):
    """The segment topic does not exist (never created, or deleted)."""


@dataclass(frozen=True, slots=True)
class Sampled:
    """A message read back for the load reporter: its key and its key+value size."""

    key: bytes | None
    size: int


class KafkaBackend:
    """Segment topics in Kafka. Methods are safe to call concurrently."""

    def __init__(
        self,
        admin: AIOKafkaAdminClient,
        reader: AIOKafkaConsumer,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        # aiokafka logs every assignment at info; the reader assigns twice per call.
        logging.getLogger("aiokafka.consumer.subscription_state").setLevel(logging.WARNING)
        self._admin = admin
        self._reader = reader
        self._request_timeout = request_timeout
        self._lock = anyio.Lock()  # the reader serves one topic at a time
        #: names this process deleted that a listing may still show (see the module docstring)
        self._deleted: set[str] = set()

    async def create_topics(self, names: list[str]) -> None:
        """Create one-partition topics; existing ones are fine (the call is retried)."""
        if not names:
            return
        new = [NewTopic(name, num_partitions=1, replication_factor=1) for name in names]
        async with self._lock:
            self._deleted.difference_update(names)
            try:
                response = await self._ask(
                    f"create topics {names}", lambda: self._admin.create_topics(new)
                )
            except TopicAlreadyExistsError:
                return
        for name, code, *_ in getattr(response, "topic_errors", []):
            if code not in (0, TopicAlreadyExistsError.errno):
                raise KafkaBackendError(f"create topic {name}: error code {code}")

    async def delete_topic(self, name: str) -> bool:
        """Delete a segment topic; False when it did not exist. Nothing here names it again."""
        async with self._lock:
            self._deleted.add(name)
            if not await self.exists(name):
                return False
            try:
                await self._ask(f"delete topic {name}", lambda: self._admin.delete_topics([name]))
            except UnknownTopicOrPartitionError:
                return False
            return True

    async def topics(self, prefix: str) -> list[str]:
        """Every topic whose name starts with ``prefix``, from a fresh listing, sorted.

        Topics this process deleted are not among them, even while a listing still
        shows them (Kafka deletes asynchronously).
        """
        listed = await self._listing()
        return sorted(n for n in listed if n.startswith(prefix) and n not in self._deleted)

    async def exists(self, name: str) -> bool:
        """Whether the topic exists, from a listing of all topics (which creates none).

        The listing also ends the memory of every deletion it shows complete. Only
        names deleted before it was requested count: an earlier answer may miss a
        topic that was created, and then deleted, while it was on its way.
        """
        return name in await self._listing()

    async def _listing(self) -> set[str]:
        """Every topic, from a listing (which creates none); see :meth:`exists`."""
        deleting = set(self._deleted)
        listed = set(await self._ask("list topics", self._admin.list_topics))
        self._deleted.difference_update(deleting - listed)
        return listed

    async def _ask(self, what: str, request: Callable[[], Awaitable[_T]]) -> _T:
        """One admin request, bounded by ``request_timeout``.

        Raises:
            TopicAlreadyExistsError, UnknownTopicOrPartitionError: Kafka's answer
                about the topic, for the caller to judge.
            KafkaBackendError: anything else Kafka or the connection raised, the
                builtin TimeoutError of a request without an answer included.
        """
        try:
            with anyio.move_on_after(self._request_timeout):
                return await request()
        except (TopicAlreadyExistsError, UnknownTopicOrPartitionError):
            raise
        except (KafkaError, OSError) as exc:  # OSError: also aiokafka's own TimeoutError
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise KafkaBackendError(f"{what}: {detail}") from exc
        raise KafkaBackendError(f"{what}: Kafka did not answer within {self._request_timeout:g}s")

    async def end_offset(self, name: str) -> int:
        """The offset after the topic's last record.

        tansu 0.6 answers ListOffsets(latest) with the last *batch's* base offset
        + 1, so the answer is checked by fetching from just before it: the fetch
        returns that record's whole batch (on Kafka, the record alone), and its
        last offset + 1 is the end on both.

        Raises:
            TopicGone: the topic does not exist.
            KafkaBackendError: Kafka failed or did not answer in time.
        """
        async with self._lock, self._reading(name) as tp:
            listed = int((await self._reader.end_offsets([tp]))[tp])
            if listed == 0:
                return 0
            self._reader.assign([tp])
            self._reader.seek(tp, listed - 1)
            while not (records := (await self._reader.getmany(tp, timeout_ms=200)).get(tp)):
                pass
            return int(records[-1].offset) + 1

    async def sample(
        self, name: str, start: int, end: int, limit: int = SAMPLE_LIMIT
    ) -> list[Sampled]:
        """Key and size of the messages in ``[max(start, end - limit), end)``, oldest first.

        Best effort: whatever arrived within the read timeout (the load reporter
        uses proportions and means, so a short sample only adds noise).
        """
        first = max(0, start, end - limit)
        if end <= first:
            return []
        out: list[Sampled] = []
        with contextlib.suppress(TopicGone):
            async with self._lock, self._reading(name, bounded=False) as tp:
                self._reader.assign([tp])
                self._reader.seek(tp, first)
                with anyio.move_on_after(2.0):
                    last = first - 1
                    while last < end - 1:
                        batch = await self._reader.getmany(tp, timeout_ms=200, max_records=limit)
                        for record in batch.get(tp, []):
                            if first <= record.offset < end:
                                size = len(record.key or b"") + len(record.value or b"")
                                out.append(Sampled(record.key, size))
                            last = max(last, record.offset)
        return out

    @contextlib.asynccontextmanager
    async def _reading(self, name: str, bounded: bool = True) -> AsyncIterator[TopicPartition]:
        """Name ``name`` to the reader for one call; caller holds ``_lock``.

        Refuses a topic that this process deleted or that a fresh listing does
        not show (a cached one may be stale, and asking for the offsets of a
        topic the reader thinks exists makes aiokafka name it in a refresh), and
        leaves the reader tracking no topic (see the module docstring).
        """
        if name in self._deleted:
            raise TopicGone(f"segment topic {name} was deleted")
        try:
            if not await self.exists(name):
                raise TopicGone(f"segment topic {name} does not exist")
            with anyio.fail_after(READ_TIMEOUT) if bounded else contextlib.nullcontext():
                yield TopicPartition(name, 0)
        except (KafkaError, OSError) as exc:  # TimeoutError is an OSError
            raise KafkaBackendError(f"read {name}: {exc!r}") from exc
        finally:
            self._reader.assign([])

    async def committed(self, group: str, name: str) -> int | None:
        """The group's committed offset on a segment topic; None when it never committed."""
        tp = TopicPartition(name, 0)
        offsets = await self._ask(
            f"committed offset of {group} on {name}",
            lambda: self._admin.list_consumer_group_offsets(group, partitions=[tp]),
        )
        meta = offsets.get(tp)
        if meta is None or meta.offset < 0:
            return None
        return int(meta.offset)

    async def refresh_metadata(self) -> None:
        """Run the reader's periodic metadata refresh now (tests use it).

        aiokafka exposes no public call for it; this is the refresh that would
        re-create a topic the reader still tracked.
        """
        await self._reader._client.force_metadata_update()


async def _close(client: Any) -> None:
    """Stop an aiokafka client that may or may not have started, without a warning."""
    with anyio.move_on_after(5, shield=True), contextlib.suppress(KafkaError, OSError):
        if isinstance(client, AIOKafkaAdminClient):
            await client.close()
        else:
            await client.stop()


@contextlib.contextmanager
def _quiet_aiokafka() -> Iterator[None]:
    """Mute aiokafka's own error per failed connection; our retry line says it once."""
    library = logging.getLogger("aiokafka")
    level = library.level
    library.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        library.setLevel(level)


@contextlib.asynccontextmanager
async def open_kafka(
    bootstrap: str, connect_timeout: float = 30.0, request_timeout: float = REQUEST_TIMEOUT
) -> AsyncIterator[KafkaBackend]:
    """Connect to Kafka, retrying on the shared schedule for up to ``connect_timeout`` seconds.

    ``request_timeout`` bounds each admin request of the backend (:data:`REQUEST_TIMEOUT`).

    Every client is stopped on the way out, also after a failed attempt, so
    aiokafka never warns about an unclosed client.

    Raises:
        OperatorError: Kafka did not answer within ``connect_timeout`` (EXIT_UNAVAILABLE).
    """
    deadline = anyio.current_time() + connect_timeout
    attempt = 0
    while True:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=bootstrap, request_timeout_ms=int(request_timeout * 1000)
        )
        reader = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        try:
            with _quiet_aiokafka():
                await admin.start()
                await reader.start()
        except (KafkaError, OSError) as exc:
            await _close(reader)
            await _close(admin)
            delay = backoff.KAFKA.delay(attempt)
            attempt += 1
            if anyio.current_time() + delay > deadline:
                raise OperatorError(
                    f"Kafka at {bootstrap} did not answer within {connect_timeout:g}s "
                    f"({attempt} attempts): {exc}",
                    exit_code=EXIT_UNAVAILABLE,
                    setting="--kafka",
                ) from None
            log.warning(
                "refbroker.kafka.retry",
                bootstrap=bootstrap,
                attempt=attempt,
                delay=round(delay, 3),
                error=str(exc),
            )
            await anyio.sleep(delay)
            continue
        break
    try:
        yield KafkaBackend(admin, reader, request_timeout)
    finally:
        await _close(reader)
        await _close(admin)
