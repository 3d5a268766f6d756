"""The reference broker's load reporter: measures every active segment, writes load records.

Rates come from Kafka: ``msgRateIn`` from the growth of the segment's end
offset, ``msgRateOut`` from the growth of the subscriptions' committed offsets
(summed, as Pulsar sums its dispatch rates), byte rates from those times the
mean size of the segment's newest messages. Whether a record is written is the
core's :func:`controllerd.core.loadreport.should_write` (materiality, threshold
crossings, heartbeat); the last written value is seeded from etcd on a cache
miss so a restarted reporter does not rewrite every record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import structlog

from controllerd.adapters.store import Store, StoreError
from controllerd.core.loadreport import ReportRule, WriteReason, should_write
from controllerd.core.model import (
    LoadSample,
    ModelError,
    Rates,
    TopicName,
    layout_from_json,
    load_sample_from_json,
    load_sample_to_json,
)
from controllerd.core.view import Keys
from controllerd.daemon.clock import Clock
from controllerd.refbroker.kafka import KafkaBackend, KafkaBackendError
from controllerd.refbroker.naming import segment_topic, subscription_group

log = structlog.get_logger("controllerd.refbroker.reporter")


@dataclass(frozen=True, slots=True)
class _Reading:
    end: int
    consumed: int
    at: float


@dataclass(frozen=True, slots=True)
class _Written:
    sample: LoadSample
    at_ms: int


class LoadReporter:
    """Writes ``…/segments/<id>/load`` for every active segment of every topic."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        kafka: KafkaBackend,
        rule: ReportRule,
        clock: Clock,
        interval: float,
    ) -> None:
        self._store, self._keys, self._kafka = store, keys, kafka
        self._rule, self._clock, self._interval = rule, clock, interval
        self._readings: dict[tuple[TopicName, int], _Reading] = {}
        self._written: dict[tuple[TopicName, int], _Written] = {}
        self._sizes: dict[tuple[TopicName, int], float] = {}

    async def run(self) -> None:
        while True:
            try:
                await self.report_once()
            except (StoreError, KafkaBackendError) as exc:
                log.warning("reporter.failed", error=str(exc))
            await self._clock.sleep(self._interval)

    async def report_once(self) -> int:
        """One pass over every topic; returns how many records it wrote."""
        prefix = self._keys.topics_prefix
        kvs, _ = await self._store.get_prefix(prefix)
        layouts = {}
        subscriptions: dict[TopicName, list[str]] = {}
        stored: dict[str, bytes] = {}
        for kv in kvs:
            parts = kv.key[len(prefix) :].split("/")
            try:
                topic = TopicName(*parts[:3])
            except (TypeError, ModelError):
                continue
            if len(parts) == 3:
                try:
                    layouts[topic] = layout_from_json(json.loads(kv.value))
                except (ModelError, ValueError):
                    continue
            elif len(parts) == 5 and parts[3] == "subscriptions":
                subscriptions.setdefault(topic, []).append(parts[4])
            elif len(parts) == 6 and parts[5] == "load":
                stored[kv.key] = kv.value
        written = 0
        for topic, layout in sorted(layouts.items()):
            for seg in layout.active_segments():
                if await self._report(
                    topic, seg.segment_id, seg.descriptor, subscriptions.get(topic, []), stored
                ):
                    written += 1
        return written

    async def _report(
        self, topic: TopicName, sid: int, descriptor: str, subs: list[str], stored: dict[str, bytes]
    ) -> bool:
        name = segment_topic(topic, descriptor)
        end = await self._kafka.end_offset(name)
        consumed = 0
        for sub in subs:
            consumed += await self._kafka.committed(subscription_group(topic, sub), name) or 0
        reading = _Reading(end, consumed, self._clock.monotonic())
        previous = self._readings.get((topic, sid))
        self._readings[(topic, sid)] = reading
        if previous is None or reading.at <= previous.at:
            return False  # a rate needs two readings
        seconds = reading.at - previous.at
        msg_in = max(0, end - previous.end) / seconds
        msg_out = max(0, consumed - previous.consumed) / seconds
        if end > previous.end:
            size = await self._kafka.mean_message_size(name, end)
            if size is not None:
                self._sizes[(topic, sid)] = size
        size = self._sizes.get((topic, sid), 0.0)
        rates = Rates(msg_in, msg_in * size, msg_out, msg_out * size)
        key = self._keys.load(topic, sid)
        now = self._clock.now_ms()
        last = self._written.get((topic, sid)) or self._seed(stored.get(key))
        reason = should_write(
            self._rule,
            last.sample.rates if last else None,
            rates,
            now,
            last.at_ms if last else None,
        )
        if reason is None:
            return False
        changed = last.sample.changed_at_ms if last and reason is WriteReason.HEARTBEAT else now
        sample = LoadSample(
            last.sample.rates if last and reason is WriteReason.HEARTBEAT else rates, changed, now
        )
        await self._store.put(key, json.dumps(load_sample_to_json(sample)).encode())
        self._written[(topic, sid)] = _Written(sample, now)
        log.debug(
            "reporter.wrote",
            topic=str(topic),
            segment=sid,
            reason=reason.value,
            msg_rate_in=round(msg_in, 1),
            msg_rate_out=round(msg_out, 1),
        )
        return True

    @staticmethod
    def _seed(raw: bytes | None) -> _Written | None:
        if raw is None:
            return None
        try:
            sample = load_sample_from_json(json.loads(raw))
        except (ModelError, ValueError):
            return None
        return _Written(sample, sample.sampled_at_ms or sample.changed_at_ms)
