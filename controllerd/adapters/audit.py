"""Decision audit log: every decision, with its inputs, to a Kafka topic.

Auditing must never slow or stop control, so :meth:`AuditSink.publish` is
synchronous and O(1): it serialises the record into a bounded buffer and
returns. A background task (``audit-sender``) owns the Kafka producer and
drains the buffer; while Kafka is unreachable it keeps retrying on the shared
backoff schedule and the buffer absorbs up to ``AuditSettings.buffer_size``
records, after which the *oldest* are dropped (recent decisions matter most).
On close it flushes for a short deadline, then drops what is left. Every record
ends up counted once in ``controllerd_audit_messages_total{outcome}``: ``sent``
(acknowledged, acks=1), ``dropped`` (evicted by overflow, or unconfirmed at
close) or ``error`` (rejected permanently: not JSON-serialisable, too large).
Delivery is at least once: a batch retried after a failure may repeat records.

Record schema (JSON object, UTF-8; Kafka key = the scalable topic's name).
The caller builds it; the sink only serialises:

``ts_ms``
    Decision time, ms since the Unix epoch.
``topic``
    Scalable topic name, ``tenant/namespace/topic``.
``decision``
    :func:`controllerd.core.model.decision_to_json` of the decision.
``inputs``
    Summary of what the policy saw (active segments and their load, consumer
    counts, cooldown stamps, the resolved policy), enough to replay ``decide()``.
``fencing_token``
    The leader's fencing token when the decision was made (null if not leader).
``outcome``
    What became of it: ``ok``, ``error``, ``conflict``, ``fenced``, ``dry-run``...
``replica``
    Identity of the deciding controllerd replica.

Non-finite floats (which JSON cannot carry) are written as strings
(``"inf"``, ``"nan"``) rather than losing the record.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final, NamedTuple

import anyio
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAlreadyExistsError,
)
from prometheus_client import Counter

from controllerd.adapters import backoff
from controllerd.config import AuditSettings

log = structlog.get_logger(__name__)

#: Default seconds :func:`open_audit` spends flushing at close before dropping the rest.
CLOSE_TIMEOUT: Final = 2.0
#: Seconds granted to stopping the producer (and its connections) after the flush.
_STOP_TIMEOUT: Final = 1.0
#: Records handed to the producer at once.
_BATCH: Final = 100
#: Per-request timeout, which is also how long aiokafka retries a send internally.
_REQUEST_TIMEOUT_MS: Final = 10_000
_CLIENT_ID: Final = "controllerd-audit"
#: Errors that no retry can fix: the record is counted as an error and skipped.
_PERMANENT: Final = (MessageSizeTooLargeError, RecordListTooLargeError, RecordTooLargeError)


class AuditSink:
    """Destination of audit records. This base class discards them (audit disabled)."""

    def publish(self, record: Mapping[str, Any]) -> None:
        """Queue ``record`` for the audit topic. Never blocks, never raises.

        Must be called from the event loop's thread.
        """


class _Item(NamedTuple):
    key: bytes | None
    value: bytes


class _KafkaSink(AuditSink):
    """Bounded buffer drained into Kafka by :meth:`run`.

    Invariant: ``len(_buffer) + len(_inflight) <= capacity``. ``_inflight`` is the
    batch the sender is delivering; it stays there until acknowledged, so a
    failure retries it before anything newer (order is kept).
    """

    def __init__(self, settings: AuditSettings, bootstrap: str, outcomes: Counter) -> None:
        self._bootstrap = bootstrap
        self._topic = settings.topic
        self._capacity = settings.buffer_size
        self._buffer: deque[_Item] = deque()
        self._inflight: list[_Item] = []
        #: positions in ``_inflight`` whose outcome is counted already (sent or rejected):
        #: a close that cancels the batch midway must not count them again as dropped
        self._counted: set[int] = set()
        self._wakeup = asyncio.Event()  # set: the buffer may be non-empty, or closing
        self._closing = asyncio.Event()
        self._drained = asyncio.Event()  # set by the sender: closing and nothing left
        self._topic_checked = False
        self._sent = outcomes.labels(outcome="sent")
        self._dropped = outcomes.labels(outcome="dropped")
        self._error = outcomes.labels(outcome="error")

    # --- producer side (the controller) ------------------------------------

    def publish(self, record: Mapping[str, Any]) -> None:
        value = _serialise(record)
        if value is None:
            self._error.inc()
            log.error("audit.unserialisable", topic=str(record.get("topic")))
            return
        if self._closing.is_set():
            self._dropped.inc()
            return
        if len(self._buffer) + len(self._inflight) >= self._capacity:
            if not self._buffer:  # everything held is in flight: drop the newest
                self._dropped.inc()
                return
            self._buffer.popleft()
            self._dropped.inc()
        topic = record.get("topic")
        self._buffer.append(_Item(str(topic).encode() if topic is not None else None, value))
        self._wakeup.set()

    # --- consumer side (the background task) -------------------------------

    async def run(self) -> None:
        """Deliver until closed and drained; cancelled by :func:`open_audit` at its deadline."""
        failures = 0
        failing = False
        while True:
            producer = AIOKafkaProducer(
                bootstrap_servers=self._bootstrap,
                client_id=_CLIENT_ID,
                acks=1,
                enable_idempotence=False,  # tansu lacks it; duplicates are tolerable here
                request_timeout_ms=_REQUEST_TIMEOUT_MS,
                linger_ms=5,
            )
            try:
                await producer.start()
                await self._ensure_topic()
                if failing:
                    log.info("audit.connected", bootstrap=self._bootstrap)
                    failing = False
                while await self._send_batch(producer):
                    failures = 0
                return
            except Exception as exc:  # any failure: reconnect after a pause, never die
                delay = backoff.KAFKA.delay(failures)
                failures += 1
                report = log.debug if failing else log.warning
                failing = True
                report(
                    "audit.unavailable",
                    bootstrap=self._bootstrap,
                    error=repr(exc),
                    retry_in_s=delay,
                    buffered=len(self._buffer) + len(self._inflight),
                )
            finally:
                with anyio.move_on_after(_STOP_TIMEOUT, shield=True):
                    await producer.stop()
            await self._pause(delay)

    async def _pause(self, delay: float) -> None:
        """Back off; a close request cuts the wait short once, for a last attempt."""
        if self._closing.is_set():
            await anyio.sleep(delay)
            return
        with anyio.move_on_after(delay):
            await self._closing.wait()

    async def _send_batch(self, producer: AIOKafkaProducer) -> bool:
        """Deliver the in-flight batch (taking a new one when empty); False once drained.

        Acknowledged and permanently rejected records leave ``_inflight``; on a
        retriable failure the rest stay and the error propagates.
        """
        if not self._inflight:
            while not self._buffer:
                if self._closing.is_set():
                    self._drained.set()
                    return False
                self._wakeup.clear()
                await self._wakeup.wait()
            count = min(len(self._buffer), _BATCH)
            self._inflight = [self._buffer.popleft() for _ in range(count)]

        handed: list[tuple[int, Any]] = []
        keep: list[int] = []
        failure: KafkaError | None = None
        for index, item in enumerate(self._inflight):
            if failure is not None:
                keep.append(index)
                continue
            try:
                handed.append((index, await producer.send(self._topic, item.value, key=item.key)))
            except _PERMANENT as exc:
                self._reject(exc)
                self._counted.add(index)
            except KafkaError as exc:
                failure = exc
                keep.append(index)
        for index, future in handed:
            try:
                await future
            except _PERMANENT as exc:
                self._reject(exc)
                self._counted.add(index)
            except KafkaError as exc:
                failure = failure or exc
                keep.append(index)
            else:
                self._sent.inc()
                self._counted.add(index)
        self._inflight = [self._inflight[i] for i in sorted(keep)]
        self._counted = set()
        if failure is not None:
            raise failure
        return True

    def _reject(self, exc: KafkaError) -> None:
        self._error.inc()
        log.error("audit.rejected", topic=self._topic, error=repr(exc))

    async def _ensure_topic(self) -> None:
        """Create the topic (1 partition: decisions stay totally ordered) if missing.

        Best effort, tried once per sink, right after the producer connected: a
        broker that refuses (no ACL, no CreateTopics) still gets records, through
        its auto-creation or a topic created by operators.
        """
        if self._topic_checked:
            return
        admin = AIOKafkaAdminClient(
            bootstrap_servers=self._bootstrap,
            client_id=_CLIENT_ID,
            request_timeout_ms=_REQUEST_TIMEOUT_MS,
        )
        try:
            await admin.start()
            brokers = (await admin.describe_cluster())["brokers"]
            replication = max(1, min(3, len(brokers)))
            response = await admin.create_topics([NewTopic(self._topic, 1, replication)])
            for topic_error in response.topic_errors:
                code = topic_error[1]
                if code == 0:
                    log.info("audit.topic_created", topic=self._topic, replication=replication)
                elif code != TopicAlreadyExistsError.errno:
                    message = topic_error[2] if len(topic_error) > 2 else None
                    log.warning(
                        "audit.topic_not_created", topic=self._topic, code=code, error=message
                    )
        except Exception as exc:  # the producer just connected: rely on auto-creation
            log.warning("audit.topic_not_created", topic=self._topic, error=repr(exc))
        finally:
            self._topic_checked = True
            with anyio.move_on_after(_STOP_TIMEOUT, shield=True):
                await admin.close()

    # --- shutdown -----------------------------------------------------------

    async def flush(self, grace: float) -> None:
        """Stop accepting records; wait up to ``grace`` seconds for the sender to drain."""
        self._closing.set()
        self._wakeup.set()
        if not self._buffer and not self._inflight:
            return
        with anyio.move_on_after(grace, shield=True):
            await self._drained.wait()

    def drop_remaining(self) -> None:
        """Count what the sender did not confirm (it has stopped) as dropped."""
        left = len(self._buffer) + len(self._inflight) - len(self._counted)
        self._buffer.clear()
        self._inflight = []
        self._counted = set()
        if left:
            self._dropped.inc(left)
            log.warning("audit.dropped_at_close", records=left, topic=self._topic)


@asynccontextmanager
async def open_audit(
    settings: AuditSettings, outcomes: Counter, *, close_timeout: float = CLOSE_TIMEOUT
) -> AsyncIterator[AuditSink]:
    """The audit sink for ``settings``; a no-op sink when ``kafka_bootstrap`` is None.

    Entering never waits for Kafka (it may be down). Leaving, even by
    cancellation, flushes for at most ``close_timeout`` seconds plus up to 1 s
    to close the connection, then drops and counts what is left.
    """
    if settings.kafka_bootstrap is None:
        yield AuditSink()
        return
    sink = _KafkaSink(settings, settings.kafka_bootstrap, outcomes)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(sink.run, name="audit-sender")
            try:
                yield sink
            finally:
                await sink.flush(close_timeout)
                tg.cancel_scope.cancel()
    finally:
        sink.drop_remaining()


def _serialise(record: Mapping[str, Any]) -> bytes | None:
    """Compact JSON of ``record``; None when it holds values JSON cannot express."""
    try:
        try:
            text = _dumps(record)
        except ValueError:  # a non-finite float: keep the record, stringify the value
            text = _dumps(_finite(record))
    except (TypeError, ValueError):
        return None
    return text.encode()


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False, default=_mapping)


def _mapping(value: Any) -> dict[Any, Any]:
    """JSON fallback: any Mapping (not only dict) is an object."""
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
