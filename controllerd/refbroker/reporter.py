"""The reference broker's load reporter: measures every active segment, writes load records.

Rates come from Kafka: ``msgRateIn`` from the growth of the segment's end
offset, ``msgRateOut`` from the growth of the subscriptions' committed offsets
(summed, as Pulsar sums its dispatch rates), byte rates from those times the
mean size of the messages read back in the window.

Whether a record is written is the core's
:func:`controllerd.core.loadreport.should_write` (materiality, threshold
crossings, heartbeat); the last written value is seeded from etcd on a cache
miss so a restarted reporter does not rewrite every record.

A window in which the traffic changed is a mixture of the old and the new
regime: a burst from 50 to 700 msg/s that starts inside a window reads, say,
424 msg/s, and a controller that splits for 424 must split again once 700
shows up. So a change is written only once a window lies wholly inside the new
regime: a reading that would write for a material change, a zero crossing or a
threshold crossing is held, the next window (``confirm_interval`` later,
shorter than the regular interval) is measured, and that reading is judged and
written. A change that does not last is never written. First records and
heartbeats are written at once.

Each record also carries ``hashBuckets`` when the window had keyed messages:
the msg/s in of each of ``n = min(32, W)`` equal slices of the segment's hash
range (``naming.slice_starts``), from the keys of the messages read back
(``KafkaBackend.sample``), so a controller can split where the load is. The
histogram never decides whether a record is written.

Values in etcd may be garbage (the topics prefix is shared with Pulsar and any
other writer): a layout that is not strict JSON (orjson), breaks a layout
invariant or names a segment Kafka cannot have, and a stored load record that
does not parse, are skipped, counted (:attr:`LoadReporter.skipped`) and logged
once per key. They never end the reporter: that would end the broker with it,
and again after every restart.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import structlog

from controllerd.adapters.store import Store, StoreError
from controllerd.core.layout import check
from controllerd.core.loadreport import ReportRule, WriteReason, should_write
from controllerd.core.model import (
    HashRange,
    Layout,
    LoadSample,
    ModelError,
    Rates,
    Segment,
    TopicName,
    layout_from_json,
    load_sample_from_json,
    load_sample_to_json,
)
from controllerd.core.view import Keys, parse_json
from controllerd.daemon.clock import Clock
from controllerd.refbroker.kafka import KafkaBackend, KafkaBackendError, Sampled, TopicGone
from controllerd.refbroker.naming import key_hash, segment_topic, slice_starts, subscription_group

log = structlog.get_logger("controllerd.refbroker.reporter")

#: Write reasons that may come from a window straddling a change: confirmed first.
_CONFIRMED: Final = frozenset(
    {WriteReason.MATERIAL_CHANGE, WriteReason.ZERO_CROSSING, WriteReason.THRESHOLD_CROSSING}
)
#: Characters of a parse error a log line keeps (a garbage value may be megabytes).
_ERROR_CHARS: Final = 300
#: What parsing a value from etcd raises on garbage: ValueError (orjson's JSONDecodeError,
#: ModelError, LayoutError, a name Kafka cannot have) or RecursionError (the core's error
#: message shows the value, and orjson lets one nest 1024 deep, past Python's repr).
_UNUSABLE: Final = (ValueError, RecursionError)


@dataclass(frozen=True, slots=True)
class _Reading:
    end: int
    consumed: int
    at: float


@dataclass(frozen=True, slots=True)
class _Written:
    sample: LoadSample
    at_ms: int


def hash_buckets(
    hash_range: HashRange, sampled: Sequence[Sampled], msg_rate_in: float
) -> list[float] | None:
    """msg/s in per slice of ``hash_range`` (the ``hashBuckets`` field); None without keys.

    Each slice gets ``msg_rate_in`` times its share of the sampled messages;
    keyless messages (routed at random) count in no slice.
    """
    starts = slice_starts(hash_range.start, hash_range.end)
    counts = [0] * len(starts)
    keyed = 0
    for message in sampled:
        if message.key is None:
            continue
        h = key_hash(message.key)
        if not hash_range.start <= h <= hash_range.end:
            continue
        counts[bisect_right(starts, h) - 1] += 1
        keyed += 1
    if keyed == 0:
        return None
    scale = msg_rate_in / len(sampled)
    return [round(c * scale, 3) for c in counts]


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
        confirm_interval: float | None = None,
    ) -> None:
        self._store, self._keys, self._kafka = store, keys, kafka
        self._rule, self._clock, self._interval = rule, clock, interval
        self._confirm_interval = interval / 2 if confirm_interval is None else confirm_interval
        self._readings: dict[tuple[TopicName, int], _Reading] = {}
        self._written: dict[tuple[TopicName, int], _Written] = {}
        self._sizes: dict[tuple[TopicName, int], float] = {}
        self._held: set[tuple[TopicName, int]] = set()
        #: names no Kafka topic or group can have (said once while their key stays, then skipped)
        self.unnamed: set[str] = set()
        #: etcd keys whose value is unusable now (said once while it stays so, then skipped)
        self.unusable: set[str] = set()
        #: unusable values skipped, by kind (``layout``, ``load``); each pass counts
        self.skipped: Counter[str] = Counter()

    @property
    def held(self) -> frozenset[tuple[TopicName, int]]:
        """Segments whose change waits for a confirming window."""
        return frozenset(self._held)

    def next_interval(self) -> float:
        """Seconds until the next pass: sooner while a change waits for confirmation."""
        return self._confirm_interval if self._held else self._interval

    async def run(self) -> None:
        while True:
            try:
                await self.report_once()
            except (StoreError, KafkaBackendError) as exc:
                log.warning("reporter.failed", error=str(exc))
            await self._clock.sleep(self.next_interval())

    async def report_once(self) -> int:
        """One pass over every topic; returns how many records it wrote."""
        prefix = self._keys.topics_prefix
        kvs, _ = await self._store.get_prefix(prefix)
        layouts: dict[TopicName, Layout] = {}
        subscriptions: dict[TopicName, list[str]] = {}
        stored: dict[str, bytes] = {}
        unnamed: set[str] = set()
        for kv in kvs:
            parts = kv.key[len(prefix) :].split("/")
            try:
                topic = TopicName(*parts[:3])
            except (TypeError, ModelError):
                continue
            if len(parts) == 3:
                if self._kafka_safe(unnamed, topic):
                    layout = self._usable_layout(topic, kv.key, kv.value)
                    if layout is not None:
                        layouts[topic] = layout
            elif len(parts) == 5 and parts[3] == "subscriptions":
                if self._kafka_safe(unnamed, topic, parts[4]):
                    subscriptions.setdefault(topic, []).append(parts[4])
            elif len(parts) == 6 and parts[5] == "load":
                stored[kv.key] = kv.value
        # A name whose keys are gone is forgotten (and said again if it comes back).
        self.unnamed.intersection_update(unnamed)
        written = 0
        measured: set[tuple[TopicName, int]] = set()
        for topic, layout in sorted(layouts.items()):
            for seg in layout.active_segments():
                measured.add((topic, seg.segment_id))
                try:
                    if await self._report(topic, seg, subscriptions.get(topic, []), stored):
                        written += 1
                except TopicGone:
                    continue  # deleted since the layout was read
                except KafkaBackendError as exc:
                    log.warning(
                        "reporter.segment_failed",
                        topic=str(topic),
                        segment=seg.segment_id,
                        error=str(exc),
                    )
        for gone in [k for k in self._readings if k not in measured]:
            self._forget(gone)
        if self.unusable:  # a deleted key is said again if it comes back unusable
            self.unusable.intersection_update(kv.key for kv in kvs)
        return written

    def _kafka_safe(self, seen: set[str], topic: TopicName, sub: str | None = None) -> bool:
        """Whether the topic (and ``sub``) can be named in Kafka; a key in the shared
        prefix that cannot (Pulsar allows dots, Kafka names here do not) is skipped,
        with one warning, instead of ending the reporter and the broker with it.

        An unnameable name is added to ``seen``, this pass's set of them.
        """
        try:
            segment_topic(topic, "0000-ffff-0")
            if sub is not None:
                subscription_group(topic, sub)
        except ValueError as exc:
            name = str(topic) if sub is None else f"{topic}/subscriptions/{sub}"
            seen.add(name)
            if name not in self.unnamed:
                self.unnamed.add(name)
                log.warning("reporter.name_skipped", name=name, error=str(exc))
            return False
        return True

    def _usable_layout(self, topic: TopicName, key: str, value: bytes) -> Layout | None:
        """The layout in ``value``, or None (skipped, counted, said once) if it is unusable.

        Usable: strict JSON (orjson: no depth beyond 1024, NaN or lone surrogate, all
        ValueError), a layout holding every invariant (a hash range beyond 16 bits
        would name a segment topic :func:`segment_topic` refuses) and a Kafka name for
        every active segment (a negative or endless segment id has none).
        """
        try:
            layout = check(layout_from_json(parse_json(value)))
            for seg in layout.active_segments():
                segment_topic(topic, seg.descriptor)
        except _UNUSABLE as exc:
            self._skip("layout", key, exc)
            return None
        self.unusable.discard(key)
        return layout

    def _skip(self, kind: str, key: str, exc: Exception) -> None:
        """Count an unusable value; say so once per key until it is usable again."""
        self.skipped[kind] += 1
        if key not in self.unusable:
            self.unusable.add(key)
            log.warning("reporter.value_skipped", kind=kind, key=key, error=str(exc)[:_ERROR_CHARS])

    def _forget(self, key: tuple[TopicName, int]) -> None:
        self._readings.pop(key, None)
        self._written.pop(key, None)
        self._sizes.pop(key, None)
        self._held.discard(key)

    async def _report(
        self, topic: TopicName, seg: Segment, subs: list[str], stored: dict[str, bytes]
    ) -> bool:
        sid = seg.segment_id
        ident = (topic, sid)
        name = segment_topic(topic, seg.descriptor)
        end = await self._kafka.end_offset(name)
        at = self._clock.monotonic()  # paired with the end offset: a short window needs it
        consumed = 0
        for sub in subs:
            consumed += await self._kafka.committed(subscription_group(topic, sub), name) or 0
        reading = _Reading(end, consumed, at)
        previous = self._readings.get(ident)
        self._readings[ident] = reading
        if previous is None or reading.at <= previous.at:
            return False  # a rate needs two readings
        seconds = reading.at - previous.at
        msg_in = max(0, end - previous.end) / seconds
        msg_out = max(0, consumed - previous.consumed) / seconds
        sampled = await self._kafka.sample(name, previous.end, end) if end > previous.end else []
        if sampled:
            self._sizes[ident] = sum(m.size for m in sampled) / len(sampled)
        size = self._sizes.get(ident, 0.0)
        rates = Rates(msg_in, msg_in * size, msg_out, msg_out * size)
        key = self._keys.load(topic, sid)
        now = self._clock.now_ms()
        last = self._written.get(ident) or self._seed(key, stored.get(key))
        reason = should_write(
            self._rule,
            last.sample.rates if last else None,
            rates,
            now,
            last.at_ms if last else None,
        )
        if reason in _CONFIRMED and ident not in self._held:
            self._held.add(ident)
            log.debug(
                "reporter.confirming",
                topic=str(topic),
                segment=sid,
                reason=reason.value if reason else None,
                msg_rate_in=round(msg_in, 1),
            )
            return False
        self._held.discard(ident)
        if reason is None:
            return False
        heartbeat = last is not None and reason is WriteReason.HEARTBEAT
        published = last.sample.rates if last is not None and heartbeat else rates
        changed = last.sample.changed_at_ms if last is not None and heartbeat else now
        sample = LoadSample(published, changed, now)
        record = load_sample_to_json(sample)
        buckets = hash_buckets(seg.hash_range, sampled, published.msg_rate_in)
        if buckets is not None:
            record["hashBuckets"] = buckets
        await self._store.put(key, json.dumps(record).encode())
        self._written[ident] = _Written(sample, now)
        self.unusable.discard(key)  # an unusable record it replaced
        log.debug(
            "reporter.wrote",
            topic=str(topic),
            segment=sid,
            reason=reason.value,
            msg_rate_in=round(msg_in, 1),
            msg_rate_out=round(msg_out, 1),
        )
        return True

    def _seed(self, key: str, raw: bytes | None) -> _Written | None:
        """The record stored at ``key`` as the last written; None if absent or unusable.

        An unusable record (strict JSON, as for layouts) is skipped and counted; the
        next write replaces it.
        """
        if raw is None:
            return None
        try:
            sample = load_sample_from_json(parse_json(raw))
        except _UNUSABLE as exc:
            self._skip("load", key, exc)
            return None
        self.unusable.discard(key)
        return _Written(sample, sample.sampled_at_ms or sample.changed_at_ms)
