"""A behaviour model of an Apache Pulsar 5 broker's scalable topics, over real HTTP and etcd.

No Pulsar broker can run here, so this model is the contract controllerd is tested
against, and ``shared/reference/pulsar-compat.md`` is its evidence. It serves Pulsar's
admin REST paths with starlette + uvicorn on a free loopback port inside the caller's
event loop, and keeps Pulsar's metadata where Pulsar keeps it, in a real etcd through
:class:`controllerd.adapters.store.Store`: keys at the etcd root by default (an optional
``prefix`` isolates tests that share one etcd). What Pulsar keeps outside the metadata
store is held in memory: segment topics with their cursors and backlogs (managed
ledgers), topic-level retention (the topic-policies system topic) and the controller's
cooldown clocks.

Every behaviour cites the apache/pulsar source it models, by alias (file versions as in
the compat doc's legend; ``:N`` lines refer to those versions, a ``name()`` to a method
when no line was computed):

* CTL ``pulsar-broker/.../service/scalable/ScalableTopicController.java``
* LAY ``.../service/scalable/SegmentLayout.java``; EBS ``.../EntryBucketSplits.java``
* SVC ``.../service/scalable/ScalableTopicService.java``; SLR ``.../SegmentLoadReporter.java``
* REST ``pulsar-broker/.../admin/v2/ScalableTopics.java``; SEG ``.../admin/v2/Segments.java``
* WEB ``pulsar-broker/.../web/PulsarWebResource.java``; REX ``.../web/RestException.java``
* RES ``pulsar-broker-common/.../resources/ScalableTopicResources.java``;
  NSR ``.../resources/NamespaceResources.java`` and ``BaseResources.java``
* SI ``pulsar-common/.../scalable/SegmentInfo.java``; HR ``.../scalable/HashRange.java``;
  STN ``.../scalable/SegmentTopicName.java``; TN ``.../naming/TopicName.java``;
  CODEC ``.../util/Codec.java``; OMF ``.../util/ObjectMapperFactory.java``
* ASPO ``pulsar-client-admin-api/.../policies/data/AutoScalePolicyOverride.java``;
  POL ``.../policies/data/Policies.java``; ASC ``.../scalable/AutoScaleConfig.java``
* ETCD ``pulsar-metadata/.../impl/EtcdMetadataStore.java``; DOC pulsar-site
  ``docs/admin-api-scalable-topics.md``; JAXRS the Jakarta REST spec §3.2 (a
  ``@PathParam``/``@QueryParam`` that does not convert is a 404).

Deliberate simplifications, each harmless to what controllerd can observe:

* One broker, always the controller leader of every topic: no 307 unless a test sets
  ``redirect_to`` (REST:864-904 redirects non-leaders).
* The controller reads the layout from etcd on every operation instead of keeping an
  in-memory ``currentLayout`` (CTL keeps one and refreshes it only after its own writes,
  compat 5.4). Every Pulsar write is a compare-and-swap on the latest record
  (RES ``updateScalableTopicAsync`` -> ``readModifyUpdate``; ETCD:172-179), and GC
  re-checks each candidate inside that CAS (CTL ``pruneAllAsync``), so the etcd
  outcome is the same; only backlog polls of segments someone else already pruned
  are skipped.
* Serialisation is Jackson's as configured by OMF: unknown fields are dropped on read
  (OMF:131), nulls are left out on write (OMF:133). Whether Jackson also emits the
  records' ``isActive()``-style getters is undetermined (compat "Could not find"); the
  model does not emit them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Literal
from urllib.parse import parse_qs

import anyio
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controllerd.adapters.store import Compare, Put, Store
from controllerd.core.model import (
    PULSAR_PARITY,
    Decision,
    Layout,
    LoadSample,
    Merge,
    NoAction,
    PolicySettings,
    Rates,
    Split,
    TopicName,
    layout_from_json,
)
from controllerd.core.policy import PolicyInvalid, decide, resolve_policy

log = structlog.get_logger(__name__)

MAX_HASH: Final = 0xFFFF
"""HR ``MAX_HASH``: the hash space is ``[0, 0xFFFF]``."""
MAX_ENTRY_BUCKETS: Final = 1024
"""DOC ``scalableTopicEntryBucketMaxPerSegment`` default; CTL ``maxEntryBucketsPerSegment``."""
LEASE_TTL_SECONDS: Final = 600
HANG_LIMIT_SECONDS: Final = 30.0
SubscriptionType = Literal["STREAM", "QUEUE"]
Source = Literal["rest", "manual", "autoscaler", "gc"]
OperationKind = Literal["create", "delete", "split", "merge", "rebucket", "prune"]

# ASPO:47-89 fields with their Java types, plus the PIP-486 pair DOC lists for overrides.
# Kept separate from controllerd.core.pulsar on purpose: the model is the oracle.
_ASPO: Final[Mapping[str, str]] = {
    "enabled": "Boolean",
    "maxSegments": "Integer",
    "minSegments": "Integer",
    "maxDagDepth": "Integer",
    "splitCooldownSeconds": "Long",
    "mergeCooldownSeconds": "Long",
    "mergeWindowSeconds": "Long",
    "splitMsgRateInThreshold": "Double",
    "splitBytesRateInThreshold": "Long",
    "splitMsgRateOutThreshold": "Double",
    "splitBytesRateOutThreshold": "Long",
    "mergeMsgRateInThreshold": "Double",
    "mergeBytesRateInThreshold": "Long",
    "mergeMsgRateOutThreshold": "Double",
    "mergeBytesRateOutThreshold": "Long",
    "rebucketCooldownSeconds": "Long",
    "splitVsRebucketMinMsgRateInThreshold": "Double",
}
_URL_SAFE: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-*_")


# --- names and keys ------------------------------------------------------------------


def java_url_encode(text: str) -> str:
    """CODEC:29-31 ``URLEncoder.encode(s, UTF_8)``: keep ``[A-Za-z0-9.*_-]``, space -> ``+``."""
    out: list[str] = []
    for ch in text:
        if ch in _URL_SAFE:
            out.append(ch)
        elif ch == " ":
            out.append("+")
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    return "".join(out)


def java_url_decode(text: str) -> str:
    """CODEC:33-35 ``URLDecoder.decode(s, UTF_8)``; a bad ``%`` escape raises ValueError."""
    data = bytearray()
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "+":
            data += b" "
        elif ch == "%":
            pair = text[i + 1 : i + 3]
            if len(pair) != 2 or any(c not in "0123456789abcdefABCDEF" for c in pair):
                raise ValueError(
                    f"URLDecoder: Illegal hex characters in escape (%) pattern: {text}"
                )
            data.append(int(pair, 16))
            i += 2
        else:
            data += ch.encode("utf-8")
        i += 1
    return data.decode("utf-8", errors="replace")


def descriptor(segment_id: int, start: int, end: int) -> str:
    """STN:113 ``String.format("%04x-%04x-%d", start, end, segmentId)``."""
    return f"{start:04x}-{end:04x}-{segment_id}"


@dataclass(frozen=True, slots=True)
class PulsarKeys:
    """Where Pulsar keeps each record in the metadata store.

    RES:66-70, 475-502 (``/topics/{tenant}/{ns}/{encodedTopicName}`` and the
    ``subscriptions``, ``consumers``, ``segments/<id>/load`` and ``controller``
    children); the topic name is ``getEncodedLocalName`` (RES:483-484, TN), the
    subscription and consumer names are joined raw (RES ``joinPath``). NSR
    ``BASE_POLICIES_PATH`` for namespace policies (configuration store, the same
    etcd by default). ETCD:90-97 puts keys at the etcd root: ``prefix`` is "" for
    Pulsar and exists only to isolate tests.
    """

    prefix: str = ""

    @property
    def root(self) -> str:
        return self.prefix.rstrip("/")

    @property
    def topics_prefix(self) -> str:
        return f"{self.root}/topics/"

    def namespace_prefix(self, tenant: str, namespace: str) -> str:
        return f"{self.topics_prefix}{tenant}/{namespace}/"

    def topic(self, topic: TopicName) -> str:
        return (
            f"{self.namespace_prefix(topic.tenant, topic.namespace)}{java_url_encode(topic.topic)}"
        )

    def subscriptions_prefix(self, topic: TopicName) -> str:
        return f"{self.topic(topic)}/subscriptions/"

    def subscription(self, topic: TopicName, subscription: str) -> str:
        return f"{self.subscriptions_prefix(topic)}{subscription}"

    def consumers_prefix(self, topic: TopicName, subscription: str) -> str:
        return f"{self.subscription(topic, subscription)}/consumers/"

    def consumer(self, topic: TopicName, subscription: str, name: str) -> str:
        return f"{self.consumers_prefix(topic, subscription)}{name}"

    def load(self, topic: TopicName, segment_id: int) -> str:
        return f"{self.topic(topic)}/segments/{segment_id}/load"

    def controller(self, topic: TopicName) -> str:
        return f"{self.topic(topic)}/controller"

    def namespace_policies(self, tenant: str, namespace: str) -> str:
        return f"{self.root}/admin/policies/{tenant}/{namespace}"


# --- Pulsar's typed records ----------------------------------------------------------


class IllegalArgument(Exception):
    """Java's IllegalArgumentException/IllegalStateException: REST turns it into a 500."""

    java_class: ClassVar[str] = "java.lang.IllegalArgumentException"


class IllegalState(IllegalArgument):
    java_class = "java.lang.IllegalStateException"


class MetadataNotFound(IllegalArgument):
    java_class = "org.apache.pulsar.metadata.api.MetadataStoreException$NotFoundException"


def _java_value(name: str, java: str, value: Any) -> bool | int | float:
    """How Jackson reads one scalar of an ``AutoScalePolicyOverride`` (OMF defaults)."""
    if java == "Boolean":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif not isinstance(value, bool) and isinstance(value, int | float | str):
        try:
            number = float(value)
        except ValueError:
            pass
        else:
            if java == "Double":
                return number
            if math.isfinite(number):
                return int(number)  # Jackson's ACCEPT_FLOAT_AS_INT truncates
    raise ValueError(f"Cannot deserialize value of type `{java}` from {value!r} ({name})")


def aspo(raw: Any) -> dict[str, Any] | None:
    """An ``AutoScalePolicyOverride`` after Jackson: known fields only, no nulls (OMF:131,133)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(f"autoScalePolicy must be an object, got {raw!r}")
    return {
        name: _java_value(name, java, raw[name])
        for name, java in _ASPO.items()
        if raw.get(name) is not None
    }


@dataclass
class SegmentInfo:
    """SI:63-75, the record's components in order; every other JSON field is dropped."""

    segment_id: int
    start: int
    end: int
    state: Literal["ACTIVE", "SEALED"]
    parent_ids: list[int] = field(default_factory=list)
    child_ids: list[int] = field(default_factory=list)
    created_at_epoch: int = 0
    sealed_at_epoch: int = -1
    created_at_ms: int = 0
    sealed_at_ms: int = -1
    legacy_topic_name: str | None = None
    entry_bucket_splits: list[int] = field(default_factory=list)

    @property
    def descriptor(self) -> str:
        return descriptor(self.segment_id, self.start, self.end)

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def bucket_count(self) -> int:
        """SI ``bucketCount()``: ``entryBucketSplits.size() + 1``."""
        return len(self.entry_bucket_splits) + 1

    def sealed(self, epoch: int, now_ms: int, child_ids: list[int]) -> SegmentInfo:
        """SI ``sealed(...)``: state SEALED, children set, seal epoch and time stamped."""
        return dataclasses.replace(
            self,
            state="SEALED",
            child_ids=list(child_ids),
            sealed_at_epoch=epoch,
            sealed_at_ms=now_ms,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "segmentId": self.segment_id,
            "hashRange": {"start": self.start, "end": self.end},
            "state": self.state,
            "parentIds": list(self.parent_ids),
            "childIds": list(self.child_ids),
            "createdAtEpoch": self.created_at_epoch,
            "sealedAtEpoch": self.sealed_at_epoch,
            "createdAtMs": self.created_at_ms,
            "sealedAtMs": self.sealed_at_ms,
        }
        if self.legacy_topic_name is not None:  # OMF:133 NON_NULL
            out["legacyTopicName"] = self.legacy_topic_name
        out["entryBucketSplits"] = list(self.entry_bucket_splits)
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SegmentInfo:
        rng = raw["hashRange"]
        return cls(
            segment_id=int(raw["segmentId"]),
            start=int(rng["start"]),
            end=int(rng["end"]),
            state="ACTIVE" if str(raw["state"]).upper() == "ACTIVE" else "SEALED",
            parent_ids=[int(p) for p in raw.get("parentIds") or []],
            child_ids=[int(c) for c in raw.get("childIds") or []],
            created_at_epoch=int(raw.get("createdAtEpoch", 0)),
            sealed_at_epoch=int(raw.get("sealedAtEpoch", 0)),
            created_at_ms=int(raw.get("createdAtMs", 0)),
            sealed_at_ms=int(raw.get("sealedAtMs", 0)),
            legacy_topic_name=raw.get("legacyTopicName"),
            entry_bucket_splits=[int(b) for b in raw.get("entryBucketSplits") or []],
        )


@dataclass
class TopicMetadata:
    """STM ``ScalableTopicMetadata``: epoch, nextSegmentId, segments, properties, autoScalePolicy.

    ``segments`` keeps insertion order (LAY's ``LinkedHashMap``). Reading drops
    unknown fields everywhere, including unknown ``autoScalePolicy`` keys such as
    ``maxSplitFanout`` (OMF:131 over the typed ASPO); writing leaves out a null policy
    (OMF:133). So every Pulsar write of the record erases what it does not model
    (LAY:333-341 ``toMetadata`` rebuilds it from typed fields).
    """

    epoch: int
    next_segment_id: int
    segments: dict[int, SegmentInfo]
    properties: dict[str, str] = field(default_factory=dict)
    auto_scale_policy: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "epoch": self.epoch,
            "nextSegmentId": self.next_segment_id,
            "segments": {str(sid): seg.to_json() for sid, seg in self.segments.items()},
            "properties": dict(self.properties),
        }
        if self.auto_scale_policy is not None:
            out["autoScalePolicy"] = dict(self.auto_scale_policy)
        return out

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json()).encode()

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> TopicMetadata:
        segments = {
            int(k): SegmentInfo.from_json(v) for k, v in (raw.get("segments") or {}).items()
        }
        return cls(
            epoch=int(raw.get("epoch", 0)),
            next_segment_id=int(raw.get("nextSegmentId", 0)),
            segments=segments,
            properties={str(k): str(v) for k, v in (raw.get("properties") or {}).items()},
            auto_scale_policy=aspo(raw.get("autoScalePolicy")),
        )

    def active(self) -> list[SegmentInfo]:
        return [s for s in self.segments.values() if s.active]

    def copy(self) -> TopicMetadata:
        return TopicMetadata.from_json(self.to_json())


def equal_width_splits(bucket_count: int) -> list[int]:
    """EBS ``equalWidth``: start hashes of buckets 1..N-1 on the 16-bit ring."""
    ring = MAX_HASH + 1
    return [i * ring // bucket_count for i in range(1, bucket_count)]


def buckets_for_budget(budget: int, segment_count: int) -> int:
    """EBS ``bucketsForBudget``: ``max(1, budget / segmentCount)``."""
    return max(1, budget // segment_count)


def initial_metadata(
    num_segments: int, bucket_budget: int, now_ms: int, properties: Mapping[str, str]
) -> TopicMetadata:
    """CTL:1498-1505 ``createInitialMetadata``: equal ranges, the last ends at MAX_HASH."""
    if num_segments < 1:
        raise IllegalArgument("Must have at least 1 segment")
    size = (MAX_HASH + 1) // num_segments
    splits = equal_width_splits(buckets_for_budget(bucket_budget, num_segments))
    segments = {}
    for i in range(num_segments):
        end = MAX_HASH if i == num_segments - 1 else i * size + size - 1
        segments[i] = SegmentInfo(
            i, i * size, end, "ACTIVE", created_at_ms=now_ms, entry_bucket_splits=list(splits)
        )
    return TopicMetadata(0, num_segments, segments, dict(properties))


def migrated_metadata(
    topic: TopicName, partitions: int, bucket_budget: int, now_ms: int
) -> TopicMetadata:
    """CTL:1545-1590 ``createMigratedMetadata`` (PIP-475).

    N sealed full-range legacy parents wrapping the old ``persistent://`` topics, N
    active children tiling the space, every child listing every parent.
    """
    n = max(partitions, 1)
    base = f"persistent://{topic.tenant}/{topic.namespace}/{topic.topic}"
    children = list(range(n, 2 * n))
    parents = list(range(n))
    segments: dict[int, SegmentInfo] = {}
    for k in parents:
        segments[k] = SegmentInfo(
            k,
            0,
            MAX_HASH,
            "SEALED",
            child_ids=list(children),
            sealed_at_epoch=0,
            created_at_ms=now_ms,
            sealed_at_ms=now_ms,
            legacy_topic_name=base if partitions <= 0 else f"{base}-partition-{k}",
        )
    size = (MAX_HASH + 1) // n
    splits = equal_width_splits(buckets_for_budget(bucket_budget, n))
    for j, sid in enumerate(children):
        end = MAX_HASH if j == n - 1 else j * size + size - 1
        segments[sid] = SegmentInfo(
            sid,
            j * size,
            end,
            "ACTIVE",
            parent_ids=list(parents),
            created_at_ms=now_ms,
            entry_bucket_splits=list(splits),
        )
    return TopicMetadata(0, 2 * n, segments)


def split_segment(md: TopicMetadata, segment_id: int, now_ms: int) -> TopicMetadata:
    """LAY ``splitSegment``: midpoint halves (HR:75), epoch + 1 (LAY:175), two new ids.

    Children get half the parent's entry buckets, at least one (PIP-486). A missing or
    sealed segment is an IllegalArgumentException (LAY:168, LAY:171), never a 404/412.
    """
    seg = md.segments.get(segment_id)
    if seg is None:
        raise IllegalArgument(f"Segment not found: {segment_id}")
    if not seg.active:
        raise IllegalArgument(f"Cannot split non-active segment: {segment_id}")
    mid = seg.start + (seg.end - seg.start) // 2  # HR:75
    if mid + 1 > seg.end:
        raise IllegalArgument(f"Invalid hash range: [{mid + 1}, {seg.end}]")
    epoch = md.epoch + 1
    c1, c2 = md.next_segment_id, md.next_segment_id + 1
    splits = equal_width_splits(max(1, seg.bucket_count // 2))
    new = md.copy()
    new.epoch, new.next_segment_id = epoch, md.next_segment_id + 2
    new.segments[segment_id] = seg.sealed(epoch, now_ms, [c1, c2])
    for cid, start, end in ((c1, seg.start, mid), (c2, mid + 1, seg.end)):
        new.segments[cid] = SegmentInfo(
            cid,
            start,
            end,
            "ACTIVE",
            parent_ids=[segment_id],
            created_at_epoch=epoch,
            created_at_ms=now_ms,
            entry_bucket_splits=list(splits),
        )
    return new


def merge_segments(md: TopicMetadata, first: int, second: int, now_ms: int) -> TopicMetadata:
    """LAY ``mergeSegments``: one child, ``parentIds`` in request order, epoch + 1 (LAY:220).

    Errors are IllegalArgumentExceptions (LAY:210, 213, 216), so REST answers 500.
    """
    s1, s2 = md.segments.get(first), md.segments.get(second)
    if s1 is None or s2 is None:
        raise IllegalArgument("Segment not found")
    if not s1.active or not s2.active:
        raise IllegalArgument("Both segments must be active")
    if not (s1.end + 1 == s2.start or s2.end + 1 == s1.start):  # HR:57-59 isAdjacentTo
        raise IllegalArgument(
            f"Segments are not adjacent: [{s1.start}, {s1.end}] and [{s2.start}, {s2.end}]"
        )
    epoch, child = md.epoch + 1, md.next_segment_id
    new = md.copy()
    new.epoch, new.next_segment_id = epoch, child + 1
    new.segments[first] = s1.sealed(epoch, now_ms, [child])
    new.segments[second] = s2.sealed(epoch, now_ms, [child])
    new.segments[child] = SegmentInfo(
        child,
        min(s1.start, s2.start),
        max(s1.end, s2.end),
        "ACTIVE",
        parent_ids=[first, second],
        created_at_epoch=epoch,
        created_at_ms=now_ms,
        entry_bucket_splits=equal_width_splits(s1.bucket_count + s2.bucket_count),
    )
    return new


def rebucket_segment(
    md: TopicMetadata, segment_id: int, splits: list[int], now_ms: int
) -> TopicMetadata:
    """LAY ``rebucketSegment`` (LAY:257-284): seal, one same-range successor (PIP-486)."""
    seg = md.segments.get(segment_id)
    if seg is None:
        raise IllegalArgument(f"Segment not found: {segment_id}")
    if not seg.active:
        raise IllegalArgument(f"Cannot rebucket non-active segment: {segment_id}")
    if splits == seg.entry_bucket_splits:
        raise IllegalArgument(f"Segment {segment_id} already has the requested entry-bucket splits")
    epoch, successor = md.epoch + 1, md.next_segment_id
    new = md.copy()
    new.epoch, new.next_segment_id = epoch, successor + 1
    new.segments[segment_id] = seg.sealed(epoch, now_ms, [successor])
    new.segments[successor] = SegmentInfo(
        successor,
        seg.start,
        seg.end,
        "ACTIVE",
        parent_ids=[segment_id],
        created_at_epoch=epoch,
        created_at_ms=now_ms,
        entry_bucket_splits=list(splits),
    )
    return new


def prune_segment(md: TopicMetadata, segment_id: int) -> TopicMetadata:
    """LAY:291-326 ``pruneSegment``: any sealed segment, in any order, epoch + 1.

    The id leaves its children's ``parentIds`` and its parents' ``childIds``; a sealed
    parent may therefore keep only some (or none) of its children.
    """
    seg = md.segments.get(segment_id)
    if seg is None:
        raise IllegalArgument(f"Segment not found: {segment_id}")
    if seg.active:
        raise IllegalArgument(f"Cannot prune an active segment: {segment_id}")
    new = md.copy()
    del new.segments[segment_id]
    for cid in seg.child_ids:
        if cid in new.segments:
            child = new.segments[cid]
            child.parent_ids = [p for p in child.parent_ids if p != segment_id]
    for pid in seg.parent_ids:
        if pid in new.segments:
            parent = new.segments[pid]
            parent.child_ids = [c for c in parent.child_ids if c != segment_id]
    new.epoch = md.epoch + 1
    return new


# --- what Pulsar keeps outside the metadata store -------------------------------------


@dataclass
class SegmentTopic:
    """A segment's backing ``segment://`` topic (a managed ledger) and its cursors.

    ``cursors`` maps subscription -> read position; backlog = ``entries - position``.
    """

    name: str
    entries: int = 0
    cursors: dict[str, int] = field(default_factory=dict)
    terminated: bool = False
    loaded: bool = True

    def backlog(self, subscription: str) -> int | None:
        position = self.cursors.get(subscription)
        return None if position is None else self.entries - position


@dataclass(frozen=True, slots=True)
class Operation:
    """One layout change the model applied: who asked, on what, when (model clock)."""

    kind: OperationKind
    topic: TopicName
    segments: tuple[int, ...]
    source: Source
    at_ms: int


@dataclass
class PulsarRequest:
    """One HTTP request as it arrived, and what happened to its answer."""

    method: str
    path: str
    raw_path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    """Lower-cased names; the last value wins."""
    at: float
    """``time.monotonic()`` on arrival."""
    status: int | None = None
    """The status the model produced; None while running or when it never answered."""
    delivered: bool = False
    """False when a fault swallowed the answer (``lose_next``, ``hang_next``)."""


@dataclass
class _Stamps:
    """CTL's in-memory ``lastSplitAtMs``/``lastMergeAtMs`` (None = Long.MIN_VALUE)."""

    last_split_ms: int | None = None
    last_merge_ms: int | None = None


class _Rest(Exception):
    """A ``RestException`` with an explicit status (REX ``getResponse``: ``{"reason": ...}``)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _Status(Exception):
    """A response with no Pulsar error body (JAXRS 404s, the authentication filter's 401)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


def _unexpected(exc: IllegalArgument) -> JSONResponse:
    """WEB ``resumeAsyncResponseExceptionally`` wraps a non-web exception in
    ``new RestException(cause)``, which REX answers as 500 with this text."""
    reason = (
        "\n --- An unexpected error occurred in the server --- \n\n"
        f"Message: {exc}\n\nStacktrace:\n\n{exc.java_class}: {exc}\n"
        "\tat org.apache.pulsar.broker.service.scalable (model)\n"
    )
    return JSONResponse({"reason": reason}, status_code=500)


def _parse_java_long(text: str | None, default: int | None = None) -> int:
    """JAXRS conversion of a ``long``/``int`` parameter; failure is a 404."""
    if text is None:
        if default is None:
            raise _Status(404, "Not Found")
        return default
    try:
        return int(text, 10)
    except ValueError:
        raise _Status(404, "Not Found") from None


# --- the model ---------------------------------------------------------------------


class PulsarModel:
    """One Pulsar 5 broker with ``scalableTopicsEnabled=true``, as controllerd sees it.

    Args:
        store: the etcd Pulsar writes to.
        prefix: key prefix; "" (the etcd root) is what Pulsar does (ETCD:90-97).
        superuser_tokens: bearer tokens of ``superUserRoles``.
        tenant_admin_tokens: bearer token -> tenants it administers.
        authentication_enabled: ``authenticationEnabled`` and ``authorizationEnabled``;
            False lets every request through (WEB ``validateSuperUserAccessAsync``).
        auto_scale_enabled: broker ``scalableTopicAutoScaleEnabled`` (controllerd needs
            False; overrides can still switch Pulsar's evaluator on per topic).
        default_retention_minutes: broker ``defaultRetentionTimeInMinutes`` (SCONF: 0).
        entry_bucket_budget: ``scalableTopicEntryBucketBudget`` (DOC: 4).
        load_report_rate_change_threshold: ``scalableTopicLoadReportRateChangeThreshold``.
        clock_ms: wall clock in ms for seal/create stamps, retention and cooldowns.
        gc_interval_seconds: run :meth:`gc_once` this often while serving (CTL:71 uses
            60 s); None = only when the test calls it.
        autoscale_interval_seconds: run :meth:`autoscale_once` on every topic this often
            while serving; None = only when called (or on consumer registration).
        sleep: how the timers wait; a test injects one it drives tick by tick.
    """

    def __init__(
        self,
        store: Store,
        *,
        prefix: str = "",
        broker_id: str = "broker-1:8080",
        superuser_tokens: Iterable[str] = ("superuser-token",),
        tenant_admin_tokens: Mapping[str, Iterable[str]] | None = None,
        authentication_enabled: bool = True,
        auto_scale_enabled: bool = False,
        default_retention_minutes: int = 0,
        entry_bucket_budget: int = 4,
        load_report_rate_change_threshold: float = 0.25,
        clock_ms: Callable[[], int] | None = None,
        gc_interval_seconds: float | None = None,
        autoscale_interval_seconds: float | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.store = store
        self.keys = PulsarKeys(prefix)
        self.broker_id = broker_id
        self.superuser_tokens = frozenset(superuser_tokens)
        self.tenant_admin_tokens = {
            token: frozenset(tenants) for token, tenants in (tenant_admin_tokens or {}).items()
        }
        self.authentication_enabled = authentication_enabled
        self.auto_scale_enabled = auto_scale_enabled
        self.default_retention_minutes = default_retention_minutes
        self.entry_bucket_budget = entry_bucket_budget
        self.load_report_rate_change_threshold = load_report_rate_change_threshold
        self.clock_ms: Callable[[], int] = clock_ms or (lambda: int(time.time() * 1000))
        self.gc_interval_seconds = gc_interval_seconds
        self.autoscale_interval_seconds = autoscale_interval_seconds
        self.sleep = sleep
        self.segment_topics: dict[tuple[TopicName, str], SegmentTopic] = {}
        self.topic_retention_minutes: dict[TopicName, int] = {}
        self.operations: list[Operation] = []
        self.requests: list[PulsarRequest] = []
        self.fail_next: list[int] = []
        self.lose_next = 0
        self.hang_next = 0
        self.redirect_to: str | None = None
        self._stamps: dict[TopicName, _Stamps] = {}
        self._last_load: dict[str, list[float]] = {}
        self._lease: int | None = None

    # -- metadata store ---------------------------------------------------------------

    async def _read(self, topic: TopicName) -> tuple[TopicMetadata, int] | None:
        kv = await self.store.get(self.keys.topic(topic))
        if kv is None:
            return None
        return TopicMetadata.from_json(json.loads(kv.value)), kv.mod_revision

    async def metadata(self, topic: TopicName) -> TopicMetadata | None:
        """The topic's record as Pulsar reads it (typed: unknown fields gone)."""
        read = await self._read(topic)
        return None if read is None else read[0]

    async def layout_json(self, topic: TopicName) -> dict[str, Any] | None:
        """What ``GET /admin/v2/scalable/.../{topic}`` returns (REST:440-478)."""
        md = await self.metadata(topic)
        return None if md is None else md.to_json()

    async def layout(self, topic: TopicName) -> Layout | None:
        """The stored layout parsed by controllerd's own parser (for assertions)."""
        kv = await self.store.get(self.keys.topic(topic))
        return None if kv is None else layout_from_json(json.loads(kv.value))

    async def _update(
        self, topic: TopicName, change: Callable[[TopicMetadata], TopicMetadata]
    ) -> TopicMetadata:
        """RES ``updateScalableTopicAsync`` -> ``readModifyUpdate``: CAS on the key, retried.

        ``change`` returning its argument writes nothing (CTL ``pruneAllAsync``
        ``updated == latest ? md``). The write re-serialises the typed record.
        """
        key = self.keys.topic(topic)
        while True:
            read = await self._read(topic)
            if read is None:
                raise MetadataNotFound(f"{key} does not exist")
            current, revision = read
            updated = change(current)
            if updated is current:
                return current
            result = await self.store.txn(
                [Compare.mod_revision(key, revision)], [Put(key, updated.to_bytes())]
            )
            if result.succeeded:
                return updated

    async def _ensure_controller(self, topic: TopicName) -> None:
        """CTL:141-144, 634-635: the per-topic leader lock; ephemeral, a JSON brokerId string
        (REST:910-913)."""
        if self._lease is None:
            self._lease, _ = await self.store.grant_lease(LEASE_TTL_SECONDS)
        key = self.keys.controller(topic)
        await self.store.txn(
            [Compare.absent(key)], [Put(key, json.dumps(self.broker_id).encode(), self._lease)]
        )

    async def list_topics(
        self, tenant: str | None = None, namespace: str | None = None
    ) -> list[TopicName]:
        """Every scalable topic (RES:282 decodes the key with ``Codec.decode``)."""
        kvs, _ = await self.store.get_prefix(self.keys.topics_prefix)
        found: list[TopicName] = []
        for kv in kvs:
            parts = kv.key[len(self.keys.topics_prefix) :].split("/")
            if len(parts) != 3:
                continue
            t, ns, encoded = parts
            if tenant is not None and (t, ns) != (tenant, namespace):
                continue
            try:
                found.append(TopicName(t, ns, java_url_decode(encoded)))
            except ValueError:  # not a name Pulsar could have written (ModelError too)
                continue
        return found

    async def subscriptions(self, topic: TopicName) -> dict[str, str]:
        """Subscription -> type; ``.../subscriptions/<sub>`` = ``{"type": ...}`` (RES:355-358)."""
        prefix = self.keys.subscriptions_prefix(topic)
        kvs, _ = await self.store.get_prefix(prefix)
        subs: dict[str, str] = {}
        for kv in kvs:
            rest = kv.key[len(prefix) :]
            if "/" not in rest:
                subs[rest] = str(json.loads(kv.value).get("type"))
        return subs

    async def consumers(self, topic: TopicName, subscription: str) -> list[str]:
        prefix = self.keys.consumers_prefix(topic, subscription)
        kvs, _ = await self.store.get_prefix(prefix)
        return sorted(kv.key[len(prefix) :] for kv in kvs)

    async def namespace_policies(self, tenant: str, namespace: str) -> dict[str, Any] | None:
        kv = await self.store.get(self.keys.namespace_policies(tenant, namespace))
        return None if kv is None else dict(json.loads(kv.value))

    # -- segment topics (managed ledgers) ----------------------------------------------

    def _segment_name(self, topic: TopicName, seg: SegmentInfo) -> str:
        """STN ``fromParent``: ``segment://tenant/ns/<local>/<descriptor>``."""
        return f"segment://{topic.tenant}/{topic.namespace}/{topic.topic}/{seg.descriptor}"

    def _create_segment_topic(
        self, topic: TopicName, seg: SegmentInfo, subscriptions: Iterable[str]
    ) -> None:
        """SEG ``createSegment``: get-or-create, cursors at Earliest for the given subs."""
        st = self.segment_topics.setdefault(
            (topic, seg.descriptor), SegmentTopic(self._segment_name(topic, seg))
        )
        for sub in subscriptions:
            st.cursors.setdefault(sub, 0)

    def segment_topic(self, topic: TopicName, segment: int | str) -> SegmentTopic | None:
        """The backing topic by segment id (looked up in the current layout) or descriptor."""
        if isinstance(segment, str):
            return self.segment_topics.get((topic, segment))
        for (t, desc), st in self.segment_topics.items():
            if t == topic and desc.rsplit("-", 1)[1] == str(segment):
                return st
        return None

    def _require_segment_topic(self, topic: TopicName, segment_id: int) -> SegmentTopic:
        st = self.segment_topic(topic, segment_id)
        if st is None:
            raise KeyError(f"no segment topic for segment {segment_id} of {topic}")
        return st

    def publish(self, topic: TopicName, segment_id: int, entries: int = 1) -> None:
        """Producers append ``entries`` to an active segment (a sealed one is terminated)."""
        st = self._require_segment_topic(topic, segment_id)
        if st.terminated:
            raise ValueError(f"{st.name} is terminated (TopicTerminatedException)")
        st.entries += entries

    def set_backlog(
        self, topic: TopicName, segment_id: int, subscription: str, backlog: int
    ) -> None:
        """Place an existing cursor ``backlog`` entries behind the end of the segment."""
        st = self._require_segment_topic(topic, segment_id)
        if subscription not in st.cursors:
            raise KeyError(f"{st.name} has no cursor for {subscription!r}")
        st.entries = max(st.entries, backlog)
        st.cursors[subscription] = st.entries - backlog

    def drain(self, topic: TopicName, subscription: str | None = None) -> None:
        """Consumers read everything: every (or one subscription's) cursor moves to the end."""
        for (t, _), st in self.segment_topics.items():
            if t == topic:
                for sub in st.cursors:
                    if subscription is None or sub == subscription:
                        st.cursors[sub] = st.entries

    def attach_cursor(self, topic: TopicName, segment_id: int, subscription: str) -> None:
        """A consumer subscribing to one segment creates its cursor lazily (at Earliest)."""
        self._require_segment_topic(topic, segment_id).cursors.setdefault(subscription, 0)

    def backlog(self, topic: TopicName, segment_id: int, subscription: str) -> int | None:
        """What the backlog endpoint would say: a number, or None for its 404s."""
        st = self.segment_topic(topic, segment_id)
        if st is None or not st.loaded:
            return None
        return st.backlog(subscription)

    def set_loaded(self, topic: TopicName, segment_id: int, loaded: bool) -> None:
        """Unload (ownership moving) or load a segment topic; unloaded answers 404."""
        self._require_segment_topic(topic, segment_id).loaded = loaded

    # -- admin operations (what REST does after its checks) ------------------------------

    def _record(
        self, kind: OperationKind, topic: TopicName, segments: tuple[int, ...], source: Source
    ) -> None:
        self.operations.append(Operation(kind, topic, segments, source, self.clock_ms()))

    async def create_topic(
        self,
        topic: TopicName,
        num_segments: int = 1,
        properties: Mapping[str, str] | None = None,
        *,
        source: Source = "manual",
    ) -> dict[str, Any]:
        """REST:153-210 create / SVC ``createScalableTopic``: metadata first, then segments.

        Raises:
            IllegalArgument: fewer than one segment.
            FileExistsError: the topic exists (REST answers 409).
        """
        md = initial_metadata(
            num_segments, self.entry_bucket_budget, self.clock_ms(), properties or {}
        )
        key = self.keys.topic(topic)
        created = await self.store.txn([Compare.absent(key)], [Put(key, md.to_bytes())])
        if not created.succeeded:
            raise FileExistsError(f"Scalable topic already exists: topic://{topic}")
        for seg in md.segments.values():
            self._create_segment_topic(topic, seg, ())
        await self._ensure_controller(topic)
        self._record("create", topic, tuple(md.segments), source)
        return md.to_json()

    async def migrate_topic(self, topic: TopicName, partitions: int) -> dict[str, Any]:
        """REST ``migrateToScalable`` (PIP-475): legacy parents plus new child segments.

        Only the children get ``segment://`` topics (REST ``createMigratedChildTopicsAsync``
        skips legacy parents), so the parents' backlog polls answer 404 and Pulsar's GC
        never prunes them while a subscription exists (compat 6.4).
        """
        md = migrated_metadata(topic, partitions, self.entry_bucket_budget, self.clock_ms())
        key = self.keys.topic(topic)
        created = await self.store.txn([Compare.absent(key)], [Put(key, md.to_bytes())])
        if not created.succeeded:
            raise FileExistsError(f"Topic is already scalable: topic://{topic}")
        for seg in md.segments.values():
            if seg.legacy_topic_name is None:
                self._create_segment_topic(topic, seg, ())
        await self._ensure_controller(topic)
        self._record("create", topic, tuple(md.segments), "manual")
        return md.to_json()

    async def delete_topic(self, topic: TopicName, *, source: Source = "manual") -> bool:
        """REST:482-527: the record and everything under it (RES ``deleteRecursive``), then
        the segment topics. False when there was no such topic (REST answers 404)."""
        md = await self.metadata(topic)
        if md is None:
            return False
        key = self.keys.topic(topic)
        await self.store.delete_prefix(f"{key}/")
        await self.store.delete(key)
        for seg in md.segments.values():
            self.segment_topics.pop((topic, seg.descriptor), None)
        self._stamps.pop(topic, None)
        self._record("delete", topic, tuple(md.segments), source)
        return True

    async def _controller(self, topic: TopicName) -> TopicMetadata:
        """SVC ``getOrCreateController``: initialise fails for a missing topic (a 500)."""
        md = await self.metadata(topic)
        if md is None:
            raise IllegalState(
                f"Failed to initialize controller for topic://{topic}: "
                f"Scalable topic not found: topic://{topic}"
            )
        await self._ensure_controller(topic)
        return md

    def _seed_stamps(self, topic: TopicName, md: TopicMetadata) -> _Stamps:
        """CTL:208-221 ``seedAutoScaleCooldownsFromLayout`` on taking leadership."""
        stamps = self._stamps.get(topic)
        if stamps is None:
            splits = [s.created_at_ms for s in md.segments.values() if len(s.parent_ids) == 1]
            merges = [s.created_at_ms for s in md.segments.values() if len(s.parent_ids) >= 2]
            stamps = _Stamps(max(splits, default=None), max(merges, default=None))
            self._stamps[topic] = stamps
        return stamps

    def cooldown_stamps(self, topic: TopicName) -> tuple[int | None, int | None]:
        """Pulsar's own (last split, last merge) clocks for the topic (None = never)."""
        stamps = self._stamps.get(topic)
        return (None, None) if stamps is None else (stamps.last_split_ms, stamps.last_merge_ms)

    async def create_subscription(
        self, topic: TopicName, subscription: str, sub_type: SubscriptionType = "STREAM"
    ) -> None:
        """CTL:901-947 ``createSubscription``: idempotent record, cursors on ACTIVE segments only.

        An existing subscription keeps its type and cursors (AlreadyExists is ignored);
        sealed segments get no cursor (CTL:943-947, DOC "does not create cursors on
        already sealed predecessors").
        """
        md = await self._controller(topic)
        key = self.keys.subscription(topic, subscription)
        await self.store.txn(
            [Compare.absent(key)], [Put(key, json.dumps({"type": sub_type}).encode())]
        )
        for seg in md.active():
            self._create_segment_topic(topic, seg, (subscription,))

    async def delete_subscription(self, topic: TopicName, subscription: str) -> None:
        """CTL ``deleteSubscription``: registrations, then the record (missing is fine), then
        the cursors on every segment (RES ``deleteSubscriptionAsync`` ignores missing)."""
        await self._controller(topic)
        await self.store.delete_prefix(self.keys.consumers_prefix(topic, subscription))
        await self.store.delete(self.keys.subscription(topic, subscription))
        for (t, _), st in self.segment_topics.items():
            if t == topic:
                st.cursors.pop(subscription, None)

    async def register_consumer(self, topic: TopicName, subscription: str, name: str) -> None:
        """RES:408-410: a durable ``{}`` record, no lease (CREG:38); CTL:853 then evaluates."""
        if subscription not in await self.subscriptions(topic):
            raise KeyError(f"{topic} has no subscription {subscription!r}")
        key = self.keys.consumer(topic, subscription, name)
        await self.store.txn([Compare.absent(key)], [Put(key, b"{}")])
        if await self.pulsar_autoscaler_active(topic):
            await self.autoscale_once(topic)

    async def unregister_consumer(self, topic: TopicName, subscription: str, name: str) -> None:
        """RES ``unregisterConsumerAsync`` (explicit leave or grace expiry); missing is fine."""
        await self.store.delete(self.keys.consumer(topic, subscription, name))

    async def split(
        self, topic: TopicName, segment_id: int, *, source: Source = "manual"
    ) -> dict[str, Any]:
        """CTL ``splitSegment``: children (with every subscription's cursor) first, then
        terminate the parent, then the CAS; the cooldown clock starts only on success.

        Raises:
            IllegalArgument: missing topic or segment, or a segment that is not active.
        """
        now = self.clock_ms()
        current = await self._controller(topic)
        preview = split_segment(current, segment_id, now)  # validates on the current layout
        subs = list(await self.subscriptions(topic))
        parent = current.segments[segment_id]
        for cid in preview.segments[segment_id].child_ids:
            self._create_segment_topic(topic, preview.segments[cid], subs)
        self._terminate(topic, parent)
        updated = await self._update(topic, lambda md: split_segment(md, segment_id, now))
        self._seed_stamps(topic, current).last_split_ms = now
        self._record("split", topic, (segment_id,), source)
        return updated.to_json()

    async def merge(
        self, topic: TopicName, first: int, second: int, *, source: Source = "manual"
    ) -> dict[str, Any]:
        """CTL ``mergeSegments``: same ordering as :meth:`split`; stamps the merge clock."""
        now = self.clock_ms()
        current = await self._controller(topic)
        preview = merge_segments(current, first, second, now)
        subs = list(await self.subscriptions(topic))
        self._create_segment_topic(topic, preview.segments[preview.next_segment_id - 1], subs)
        self._terminate(topic, current.segments[first])
        self._terminate(topic, current.segments[second])
        updated = await self._update(topic, lambda md: merge_segments(md, first, second, now))
        self._seed_stamps(topic, current).last_merge_ms = now
        self._record("merge", topic, (first, second), source)
        return updated.to_json()

    async def rebucket(
        self, topic: TopicName, segment_id: int, bucket_count: int, *, source: Source = "manual"
    ) -> dict[str, Any]:
        """CTL ``rebucketSegment`` (PIP-486): bucket count in ``[1, 1024]``, else an IAE."""
        if not 1 <= bucket_count <= MAX_ENTRY_BUCKETS:
            raise IllegalArgument(
                f"bucketCount must be in [1, {MAX_ENTRY_BUCKETS}]: {bucket_count}"
            )
        now = self.clock_ms()
        splits = equal_width_splits(bucket_count)
        current = await self._controller(topic)
        preview = rebucket_segment(current, segment_id, splits, now)
        subs = list(await self.subscriptions(topic))
        self._create_segment_topic(topic, preview.segments[preview.next_segment_id - 1], subs)
        self._terminate(topic, current.segments[segment_id])
        updated = await self._update(
            topic, lambda md: rebucket_segment(md, segment_id, splits, now)
        )
        self._record("rebucket", topic, (segment_id,), source)
        return updated.to_json()

    def _terminate(self, topic: TopicName, seg: SegmentInfo) -> None:
        """SEG ``terminateSegment``: no more publishes; cursors and backlog stay."""
        st = self.segment_topics.get((topic, seg.descriptor))
        if st is not None:
            st.terminated = True

    async def set_auto_scale_policy(
        self, topic: TopicName, override: Mapping[str, Any] | None
    ) -> None:
        """REST ``internalSetAutoScalePolicy``: ``md.setAutoScalePolicy(override)`` (typed)."""
        typed = aspo(override)

        def change(md: TopicMetadata) -> TopicMetadata:
            new = md.copy()
            new.auto_scale_policy = typed
            return new

        await self._update(topic, change)

    async def set_namespace_auto_scale_policy(
        self, tenant: str, namespace: str, override: Mapping[str, Any] | None
    ) -> None:
        """``namespaces().setScalableTopicAutoScalePolicy`` (DOC): the ``Policies`` field
        ``scalableTopicAutoScalePolicy`` (CTL ``resolveAutoScaleConfig``), typed."""
        await self._set_policies(tenant, namespace, "scalableTopicAutoScalePolicy", aspo(override))

    async def set_namespace_retention(
        self, tenant: str, namespace: str, minutes: int | None, size_mb: int = -1
    ) -> None:
        """``namespaces().setRetention``: ``Policies.retention_policies`` (POL)."""
        value = (
            None
            if minutes is None
            else {"retentionTimeInMinutes": minutes, "retentionSizeInMB": size_mb}
        )
        await self._set_policies(tenant, namespace, "retention_policies", value)

    async def _set_policies(self, tenant: str, namespace: str, name: str, value: Any) -> None:
        """NSR ``setPoliciesAsync`` on ``/admin/policies/<tenant>/<ns>``: a whole ``Policies``
        record, nulls left out (OMF:133), most fields irrelevant to scalable topics."""
        key = self.keys.namespace_policies(tenant, namespace)
        while True:
            kv = await self.store.get(key)
            policies: dict[str, Any] = (
                json.loads(kv.value) if kv is not None else _default_policies()
            )
            if value is None:
                policies.pop(name, None)
            else:
                policies[name] = value
            compare = (
                Compare.absent(key) if kv is None else Compare.mod_revision(key, kv.mod_revision)
            )
            if (
                await self.store.txn([compare], [Put(key, json.dumps(policies).encode())])
            ).succeeded:
                return

    def set_topic_retention(self, topic: TopicName, minutes: int | None) -> None:
        """``topicPolicies().setRetention`` on ``topic://``: kept in the topic-policies system
        topic, not the metadata store (CTL ``resolveRetentionMillisAsync``, LOCAL_ONLY)."""
        if minutes is None:
            self.topic_retention_minutes.pop(topic, None)
        else:
            self.topic_retention_minutes[topic] = minutes

    # -- sealed-segment GC ------------------------------------------------------------

    async def retention_ms(self, topic: TopicName) -> int | None:
        """CTL ``resolveRetentionMillisAsync``: topic policy, namespace ``retention_policies``,
        broker default; a negative value (or none at all) means keep forever (None)."""
        minutes: int | None = self.topic_retention_minutes.get(topic)
        if minutes is None:
            policies = await self.namespace_policies(topic.tenant, topic.namespace)
            retention = (policies or {}).get("retention_policies")
            if retention is not None:
                minutes = int(retention.get("retentionTimeInMinutes", 0))
            else:
                minutes = self.default_retention_minutes
        return None if minutes < 0 else minutes * 60_000

    def _drained(self, topic: TopicName, seg: SegmentInfo, subscriptions: Iterable[str]) -> bool:
        """CTL ``prunable``/``isSegmentDrained``: no subscription at all, or for every one
        a loaded segment topic whose cursor has backlog <= 0; a 404 is not drained."""
        subs = list(subscriptions)
        if not subs:
            return True
        st = self.segment_topics.get((topic, seg.descriptor))
        if st is None or not st.loaded:
            return False
        return all((b := st.backlog(sub)) is not None and b <= 0 for sub in subs)

    async def gc_once(self, topic: TopicName | None = None) -> dict[TopicName, list[int]]:
        """One tick of CTL's sealed-segment GC (``runGcTickAsync``) on one or every topic.

        It runs whatever ``scalableTopicAutoScaleEnabled`` says (CTL:190-192; DOC "Sealed-
        segment retention cleanup continues"). Candidates are sealed with ``sealedAtMs > 0``
        and past retention; drained ones are pruned in one CAS, in any order (CTL:1224-1229),
        then their segment topics and load records are deleted. Returns the pruned ids.
        """
        topics = [topic] if topic is not None else await self.list_topics()
        pruned: dict[TopicName, list[int]] = {}
        for t in topics:
            ids = await self._gc_topic(t)
            if ids:
                pruned[t] = ids
        return pruned

    async def _gc_topic(self, topic: TopicName) -> list[int]:
        retention = await self.retention_ms(topic)
        md = await self.metadata(topic)
        if retention is None or md is None:
            return []
        now = self.clock_ms()
        candidates = [
            s
            for s in md.segments.values()
            if not s.active and s.sealed_at_ms > 0 and now - s.sealed_at_ms >= retention
        ]
        if not candidates:
            return []
        subs = list(await self.subscriptions(topic))
        drained = [s for s in candidates if self._drained(topic, s, subs)]
        if not drained:
            return []
        done: list[int] = []

        def prune_all(latest: TopicMetadata) -> TopicMetadata:
            done.clear()
            updated = latest
            for seg in drained:
                if seg.segment_id in updated.segments:  # re-validated inside the CAS
                    updated = prune_segment(updated, seg.segment_id)
                    done.append(seg.segment_id)
            return updated

        try:
            await self._update(topic, prune_all)
        except MetadataNotFound:
            return []
        for seg in drained:
            if seg.segment_id in done:
                # SEG delete with force=true (a missing topic is fine), then the load record.
                self.segment_topics.pop((topic, seg.descriptor), None)
                await self.store.delete(self.keys.load(topic, seg.segment_id))
        if done:
            self._record("prune", topic, tuple(done), "gc")
        return done

    # -- load reporting ---------------------------------------------------------------

    async def report_load(
        self,
        topic: TopicName,
        segment_id: int,
        *,
        msg_rate_in: float = 0.0,
        bytes_rate_in: float = 0.0,
        msg_rate_out: float = 0.0,
        bytes_rate_out: float = 0.0,
    ) -> bool:
        """SLR ``reportIfChanged``: write ``segments/<id>/load`` only on a material change.

        Material: some rate moved by more than the threshold relative to the last
        *written* value, or left zero (SLR:125-139). The baseline is seeded from the
        stored record on a cache miss (SLR:82-102). The record is SLS's four doubles,
        ``bytesRate*`` spelling, no timestamps (SLS:30-44). True when it wrote.
        """
        key = self.keys.load(topic, segment_id)
        current = [
            float(msg_rate_in),
            float(bytes_rate_in),
            float(msg_rate_out),
            float(bytes_rate_out),
        ]
        last = self._last_load.get(key)
        if last is None:
            kv = await self.store.get(key)
            if kv is not None:
                raw = json.loads(kv.value)
                last = self._last_load[key] = [float(raw[k]) for k in _LOAD_FIELDS]
        threshold = self.load_report_rate_change_threshold
        if last is not None and not any(
            (c != 0.0) if old == 0.0 else abs(c - old) / old > threshold
            for old, c in zip(last, current, strict=True)
        ):
            return False
        await self.store.put(
            key, json.dumps(dict(zip(_LOAD_FIELDS, current, strict=True))).encode()
        )
        self._last_load[key] = current
        return True

    # -- Pulsar's own auto split/merge ------------------------------------------------

    def broker_policy(self) -> PolicySettings:
        """Broker defaults (DOC/PIP-483 table) with every controllerd extension switched
        off (``PULSAR_PARITY``), i.e. ``policy.decide`` at PIP-483 parity (compat 4.1: 0
        differences in 20,000 cases); among them the split cooldown holds every split
        of the topic, not only the last split's children (EV483:98-103, compat 4.2)."""
        return dataclasses.replace(
            PolicySettings(enabled=self.auto_scale_enabled, merge_window_seconds=300.0),
            **PULSAR_PARITY,
        )

    async def _resolved_policy(
        self, topic: TopicName, md: TopicMetadata
    ) -> PolicySettings | PolicyInvalid:
        """CTL ``resolveAutoScaleConfig`` / ASC:99-105: broker, namespace, topic; invalid = off."""
        policies = await self.namespace_policies(topic.tenant, topic.namespace) or {}
        namespace = aspo(policies.get("scalableTopicAutoScalePolicy"))
        return resolve_policy(self.broker_policy(), namespace, md.auto_scale_policy)

    async def pulsar_autoscaler_active(self, topic: TopicName) -> bool:
        """Whether Pulsar's own evaluator would act on this topic (two controllers fighting).

        True when ``enabled`` resolves to true through broker, namespace and topic
        (ASC:133-134) and the resolved policy is valid (CTL:426-436).
        """
        md = await self.metadata(topic)
        if md is None:
            return False
        resolved = await self._resolved_policy(topic, md)
        return not isinstance(resolved, PolicyInvalid) and resolved.enabled

    async def autoscale_once(self, topic: TopicName) -> Decision:
        """One run of CTL ``evaluateAndAct`` with ``policy.decide`` at PIP-483 parity.

        Consumers per subscription are the registrations (CTL:480-485); load samples
        take the etcd Stat's modification time, which is 0 on etcd (ETCD:306), as their
        cold-since; the cooldown clocks are the controller's (CTL:711, 812). A decision
        is carried out like a manual operation, with source ``"autoscaler"``.
        """
        md = await self.metadata(topic)
        if md is None:
            return NoAction("no-topic", f"{topic} does not exist")
        resolved = await self._resolved_policy(topic, md)
        if isinstance(resolved, PolicyInvalid) or not resolved.enabled:
            return NoAction("disabled", "Pulsar's auto split/merge is off for this topic")
        layout = layout_from_json(md.to_json())
        loads: dict[int, LoadSample] = {}
        for seg in md.active():
            kv = await self.store.get(self.keys.load(topic, seg.segment_id))
            if kv is not None:
                raw = json.loads(kv.value)
                loads[seg.segment_id] = LoadSample(Rates(*(float(raw[k]) for k in _LOAD_FIELDS)), 0)
        consumers = {
            sub: len(await self.consumers(topic, sub)) for sub in await self.subscriptions(topic)
        }
        stamps = self._seed_stamps(topic, md)
        decision = decide(
            layout,
            loads,
            consumers,
            resolved,
            self.clock_ms(),
            stamps.last_split_ms,
            stamps.last_merge_ms,
        )
        if isinstance(decision, Split):
            await self.split(topic, decision.segment_id, source="autoscaler")
        elif isinstance(decision, Merge):
            await self.merge(topic, decision.a, decision.b, source="autoscaler")
        return decision

    # -- HTTP ------------------------------------------------------------------------

    def app(self) -> Starlette:
        """Pulsar's admin REST paths over this model (see :class:`_Handlers`)."""
        h = _Handlers(self)
        scalable = "/admin/v2/scalable/{tenant}/{namespace}"
        topic = scalable + "/{topic}"
        segment = "/admin/v2/segments/{tenant}/{namespace}/{topic}/{descriptor}"
        routes = [
            Route(scalable, h.endpoint(h.list_topics), methods=["GET"]),
            Route(topic, h.endpoint(h.create_topic), methods=["PUT"]),
            Route(topic, h.endpoint(h.get_layout), methods=["GET"]),
            Route(topic, h.endpoint(h.delete_topic), methods=["DELETE"]),
            Route(topic + "/autoScalePolicy", h.endpoint(h.get_policy), methods=["GET"]),
            Route(topic + "/autoScalePolicy", h.endpoint(h.set_policy), methods=["POST"]),
            Route(topic + "/autoScalePolicy", h.endpoint(h.remove_policy), methods=["DELETE"]),
            Route(
                topic + "/subscriptions/{subscription}",
                h.endpoint(h.create_subscription),
                methods=["PUT"],
            ),
            Route(
                topic + "/subscriptions/{subscription}",
                h.endpoint(h.delete_subscription),
                methods=["DELETE"],
            ),
            Route(topic + "/split/{segment_id}", h.endpoint(h.split), methods=["POST"]),
            Route(topic + "/merge/{first}/{second}", h.endpoint(h.merge), methods=["POST"]),
            Route(topic + "/rebucket/{segment_id}", h.endpoint(h.rebucket), methods=["POST"]),
            Route(
                segment + "/subscription/{subscription}/backlog",
                h.endpoint(h.backlog),
                methods=["GET"],
            ),
            Route(segment, h.endpoint(h.delete_segment), methods=["DELETE"]),
        ]
        app = Starlette(routes=routes)
        app.add_middleware(_Faults, model=self)
        return app

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        """Serve on ``127.0.0.1:<free port>`` in this event loop; yield the base URL.

        Also runs the GC and auto-scale timers when their intervals are set. On exit the
        broker's lease is revoked, so its ephemeral ``controller`` keys vanish, as when a
        broker stops.
        """
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        sock.setblocking(False)
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app(), log_level="warning", lifespan="off", http="h11", timeout_graceful_shutdown=2
        )
        server = _InLoopServer(config)
        tasks = [asyncio.create_task(server.serve(sockets=[sock]), name=f"pulsar-model-{port}")]
        if self.gc_interval_seconds is not None:
            tasks.append(asyncio.create_task(self._every(self.gc_interval_seconds, self.gc_once)))
        if self.autoscale_interval_seconds is not None:
            tasks.append(
                asyncio.create_task(
                    self._every(self.autoscale_interval_seconds, self._autoscale_all)
                )
            )
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            for task in tasks[1:]:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)
                await self.aclose()
            sock.close()

    async def _autoscale_all(self) -> None:
        for topic in await self.list_topics():
            if await self.pulsar_autoscaler_active(topic):
                await self.autoscale_once(topic)

    async def _every(self, seconds: float, tick: Callable[[], Awaitable[object]]) -> None:
        """CTL ``scheduleAtFixedRate``/``runGcTickSafely``: a failing tick is logged, not fatal."""
        while True:
            await self.sleep(seconds)
            try:
                await tick()
            except Exception as exc:  # the next tick retries, as Pulsar's does
                log.warning("pulsar_model_tick_failed", error=str(exc))

    async def aclose(self) -> None:
        """Revoke the broker's lease (its ``controller`` keys go with it)."""
        if self._lease is not None:
            lease, self._lease = self._lease, None
            with contextlib.suppress(Exception):
                await self.store.revoke_lease(lease)


_LOAD_FIELDS: Final = ("msgRateIn", "bytesRateIn", "msgRateOut", "bytesRateOut")
"""SLS:39-44 ``record SegmentLoadStats(double msgRateIn, double bytesRateIn, ...)``."""


def _default_policies() -> dict[str, Any]:
    """A new namespace's ``Policies`` as Pulsar writes it (POL field names, defaults)."""
    return {
        "auth_policies": {
            "namespace_auth": {},
            "destination_auth": {},
            "subscription_auth_roles": {},
        },
        "replication_clusters": [],
        "bundles": {"boundaries": ["0x00000000", "0xffffffff"], "numBundles": 1},
        "backlog_quota_map": {},
        "clusterDispatchRate": {},
        "topicDispatchRate": {},
        "subscriptionDispatchRate": {},
        "replicatorDispatchRate": {},
        "clusterSubscribeRate": {},
        "publishMaxMessageRate": {},
        "latency_stats_sample_rate": {},
        "deleted": False,
        "encryption_required": False,
        "subscription_auth_mode": "None",
        "offload_threshold": -1,
        "schema_auto_update_compatibility_strategy": "Full",
        "schema_compatibility_strategy": "UNDEFINED",
        "schema_validation_enforced": False,
        "subscription_types_enabled": [],
        "properties": {},
    }


class _Handlers:
    """The admin REST endpoints: checks in Pulsar's order, then the model's operations."""

    def __init__(self, model: PulsarModel) -> None:
        self.model = model

    def endpoint(
        self, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                self._authenticate(request)
                return await handler(request)
            except _Rest as exc:
                return JSONResponse({"reason": exc.reason}, status_code=exc.status)
            except _Status as exc:
                return PlainTextResponse(exc.text, status_code=exc.status)
            except IllegalArgument as exc:
                return _unexpected(exc)
            except ValueError as exc:  # a body Jackson cannot read
                return JSONResponse({"reason": str(exc)}, status_code=400)

        return run

    # -- authentication and authorization ---------------------------------------------

    def _token(self, request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        return header[7:] if header.startswith("Bearer ") else None

    def _authenticate(self, request: Request) -> None:
        """AuthenticationFilter: with authentication on, no or an unknown token is a 401."""
        if not self.model.authentication_enabled:
            return
        token = self._token(request)
        if token not in self.model.superuser_tokens and token not in self.model.tenant_admin_tokens:
            raise _Status(401, "Authentication required")

    def _require_superuser(self, request: Request) -> None:
        """WEB ``validateSuperUserAccessAsync`` (REST:764 split, REST:804 merge, SEG:57-62 all
        of ``/segments``): an authenticated non-superuser gets **401** "This operation
        requires super-user access" (``RestException(Status.UNAUTHORIZED, ...)``)."""
        if (
            self.model.authentication_enabled
            and self._token(request) not in self.model.superuser_tokens
        ):
            raise _Rest(401, "This operation requires super-user access")

    def _require_tenant(self, request: Request, tenant: str, operation: str) -> None:
        """WEB ``validateNamespaceOperationAsync``/``validateTopicOperationAsync``: superuser
        or tenant admin, otherwise 403 "Unauthorized to validateNamespaceOperation ..."."""
        if not self.model.authentication_enabled:
            return
        token = self._token(request)
        if token in self.model.superuser_tokens or tenant in self.model.tenant_admin_tokens.get(
            token or "", frozenset()
        ):
            return
        namespace = f"{tenant}/{request.path_params['namespace']}"
        raise _Rest(
            403,
            f"Unauthorized to validateNamespaceOperation for operation [{operation}] "
            f"on namespace [{namespace}]",
        )

    # -- names ---------------------------------------------------------------------------

    @staticmethod
    def _raw_topic(request: Request) -> str:
        """The ``@Encoded`` ``{topic}`` path segment exactly as sent (index 6 of the path)."""
        raw = request.scope.get("raw_path") or request.url.path.encode()
        return bytes(raw).decode("latin-1").split("/")[6]

    def _topic(self, request: Request, *, decode: bool = False) -> TopicName:
        """REST ``TopicName.get(domain, ns, encodedTopic)``: *not* decoded, except on create
        (REST ``createScalableTopic`` calls ``Codec.decode`` first). TN ``get`` concatenates."""
        raw = self._raw_topic(request)
        p = request.path_params
        try:
            return TopicName(p["tenant"], p["namespace"], java_url_decode(raw) if decode else raw)
        except ValueError as exc:  # URLDecoder's IllegalArgumentException, thrown in the resource
            raise IllegalArgument(str(exc)) from None

    # -- /admin/v2/scalable -----------------------------------------------------------

    async def list_topics(self, request: Request) -> Response:
        """REST:91-124 ``getList``: ``topic://`` names, decoded; ``?property=k=v`` filters."""
        tenant, namespace = request.path_params["tenant"], request.path_params["namespace"]
        self._require_tenant(request, tenant, "GET_TOPICS")
        filters: dict[str, str] = {}
        for entry in request.query_params.getlist("property"):
            eq = entry.find("=")
            if eq <= 0 or eq == len(entry) - 1:
                raise _Rest(412, f"property filter must be in the form key=value, got: {entry}")
            filters[entry[:eq]] = entry[eq + 1 :]
        names = []
        for topic in await self.model.list_topics(tenant, namespace):
            if filters:
                md = await self.model.metadata(topic)
                if md is None or any(md.properties.get(k) != v for k, v in filters.items()):
                    continue
            names.append(f"topic://{topic}")
        return JSONResponse(names)

    async def create_topic(self, request: Request) -> Response:
        """REST:153-210: 204; 409 when it exists; 412 below one segment; a body of properties."""
        count = _parse_java_long(request.query_params.get("numInitialSegments"), 1)
        body = await request.body()
        properties = json.loads(body) if body.strip() else None
        if properties is not None and not isinstance(properties, dict):
            raise ValueError(f"Cannot deserialize Map<String, String> from {properties!r}")
        topic = self._topic(request, decode=True)
        self._require_tenant(request, topic.tenant, "CREATE_TOPIC")
        if count < 1:
            raise _Rest(412, "numInitialSegments must be >= 1")
        try:
            await self.model.create_topic(topic, count, properties or {}, source="rest")
        except FileExistsError as exc:
            raise _Rest(409, str(exc)) from None
        return Response(status_code=204)

    async def get_layout(self, request: Request) -> Response:
        """REST:440-478: the typed record from the metadata cache, or 404."""
        topic = self._topic(request)
        self._require_tenant(request, topic.tenant, "GET_METADATA")
        layout = await self.model.layout_json(topic)
        if layout is None:
            raise _Rest(404, f"Scalable topic not found: topic://{topic}")
        return JSONResponse(layout)

    async def delete_topic(self, request: Request) -> Response:
        """REST:482-527: 204, or 404 for a topic that does not exist."""
        topic = self._topic(request)
        self._require_tenant(request, topic.tenant, "DELETE_TOPIC")
        if not await self.model.delete_topic(topic, source="rest"):
            raise _Rest(404, f"Scalable topic not found: topic://{topic}")
        return Response(status_code=204)

    async def get_policy(self, request: Request) -> Response:
        """REST ``getAutoScalePolicy``: the stored override, 204 when none, 404 without topic."""
        topic = self._topic(request)
        self._require_tenant(request, topic.tenant, "SCALABLE_TOPIC_AUTO_SCALE")
        md = await self.model.metadata(topic)
        if md is None:
            raise _Rest(404, f"Scalable topic not found: topic://{topic}")
        if md.auto_scale_policy is None:
            return Response(status_code=204)
        return JSONResponse(md.auto_scale_policy)

    async def set_policy(self, request: Request) -> Response:
        """REST ``setAutoScalePolicy``: 412 when broker + namespace + this override resolve to
        an invalid policy, else the typed override replaces the stored one."""
        topic = self._topic(request)
        self._require_tenant(request, topic.tenant, "SCALABLE_TOPIC_AUTO_SCALE")
        override = aspo(json.loads(await request.body()))
        md = await self.model.metadata(topic)
        if md is None:
            raise _Rest(404, f"Scalable topic not found: topic://{topic}")
        policies = await self.model.namespace_policies(topic.tenant, topic.namespace) or {}
        resolved = resolve_policy(
            self.model.broker_policy(), aspo(policies.get("scalableTopicAutoScalePolicy")), override
        )
        if isinstance(resolved, PolicyInvalid):
            raise _Rest(412, resolved.detail)
        await self.model.set_auto_scale_policy(topic, override)
        return Response(status_code=204)

    async def remove_policy(self, request: Request) -> Response:
        topic = self._topic(request)
        self._require_tenant(request, topic.tenant, "SCALABLE_TOPIC_AUTO_SCALE")
        if await self.model.metadata(topic) is None:
            raise _Rest(404, f"Scalable topic not found: topic://{topic}")
        await self.model.set_auto_scale_policy(topic, None)
        return Response(status_code=204)

    async def create_subscription(self, request: Request) -> Response:
        """REST:567-609: ``?type=STREAM|QUEUE`` (default STREAM; anything else does not
        convert: JAXRS 404); idempotent 204; a missing topic fails controller init (500)."""
        sub_type = request.query_params.get("type", "STREAM")
        if sub_type not in ("STREAM", "QUEUE"):
            raise _Status(404, "Not Found")
        topic = self._topic(request)
        self._require_tenant(request, topic.tenant, "SUBSCRIBE")
        await self.model.create_subscription(topic, request.path_params["subscription"], sub_type)  # type: ignore[arg-type]
        return Response(status_code=204)

    async def delete_subscription(self, request: Request) -> Response:
        """REST:612-650: 204, also for a subscription that does not exist."""
        topic = self._topic(request)
        self._require_tenant(request, topic.tenant, "UNSUBSCRIBE")
        await self.model.delete_subscription(topic, request.path_params["subscription"])
        return Response(status_code=204)

    async def split(self, request: Request) -> Response:
        """REST:743-779: superuser, midpoint only (no ``boundaries`` parameter exists, so one
        sent is ignored, compat 3.8); a missing or sealed segment is a 500 (LAY:168-171)."""
        segment_id = _parse_java_long(request.path_params["segment_id"])
        topic = self._topic(request)
        self._require_superuser(request)
        await self.model.split(topic, segment_id, source="rest")
        return Response(status_code=204)

    async def merge(self, request: Request) -> Response:
        """REST:781-820: superuser; errors are IllegalArgumentExceptions, hence 500."""
        first = _parse_java_long(request.path_params["first"])
        second = _parse_java_long(request.path_params["second"])
        topic = self._topic(request)
        self._require_superuser(request)
        await self.model.merge(topic, first, second, source="rest")
        return Response(status_code=204)

    async def rebucket(self, request: Request) -> Response:
        """REST ``rebucketSegment``: superuser, ``?bucketCount`` (a missing int is 0)."""
        segment_id = _parse_java_long(request.path_params["segment_id"])
        count = _parse_java_long(request.query_params.get("bucketCount"), 0)
        topic = self._topic(request)
        self._require_superuser(request)
        await self.model.rebucket(topic, segment_id, count, source="rest")
        return Response(status_code=204)

    # -- /admin/v2/segments -----------------------------------------------------------

    async def backlog(self, request: Request) -> Response:
        """SEG:286-336: superuser; 404 "Segment topic not loaded" when the topic does not
        exist or is not loaded, 404 "Subscription not found on segment" without a cursor,
        else 200 with a bare number (``getNumberOfEntriesInBacklog``)."""
        self._require_superuser(request)
        topic = self._topic(request)
        desc = request.path_params["descriptor"]
        sub = request.path_params["subscription"]
        st = self.model.segment_topics.get((topic, desc))
        if st is None or not st.loaded:
            raise _Rest(404, f"Segment topic not loaded: segment://{topic}/{desc}")
        backlog = st.backlog(sub)
        if backlog is None:
            raise _Rest(404, f"Subscription not found on segment: {sub}")
        return Response(str(backlog), media_type="application/json")

    async def delete_segment(self, request: Request) -> Response:
        """SEG:469-516: superuser; 204 whether or not the topic exists; no backlog check and
        no layout change (the controller prunes the layout, not this endpoint)."""
        self._require_superuser(request)
        topic = self._topic(request)
        self.model.segment_topics.pop((topic, request.path_params["descriptor"]), None)
        return Response(status_code=204)


class _Faults:
    """ASGI middleware: logs every request with its status, then applies the fault knobs.

    In order: ``fail_next`` (answer those statuses), ``lose_next`` (apply, then drop the
    answer until the client gives up), ``hang_next`` (never answer), ``redirect_to``
    (307 to the same path elsewhere, as REST:894-901 does to reach the controller leader).
    """

    def __init__(self, app: ASGIApp, model: PulsarModel) -> None:
        self.app = app
        self.model = model

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        model = self.model
        query = scope.get("query_string", b"").decode()
        record = PulsarRequest(
            method=scope["method"],
            path=scope["path"],
            raw_path=bytes(scope.get("raw_path") or scope["path"].encode()).decode("latin-1"),
            query=parse_qs(query, keep_blank_values=True),
            headers={k.decode().lower(): v.decode() for k, v in scope["headers"]},
            at=time.monotonic(),
        )
        model.requests.append(record)

        async def recording(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = int(message["status"])
                record.delivered = True
            await send(message)

        async def swallowing(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = int(message["status"])

        if model.fail_next:
            status = model.fail_next.pop(0)
            await JSONResponse({"reason": f"injected HTTP {status}"}, status_code=status)(
                scope, receive, recording
            )
        elif model.lose_next > 0:
            model.lose_next -= 1
            await self.app(scope, receive, swallowing)
            await _wait_for_disconnect(receive)
        elif model.hang_next > 0:
            model.hang_next -= 1
            await _wait_for_disconnect(receive)
        elif model.redirect_to is not None and scope["method"] in ("PUT", "POST", "DELETE"):
            location = (
                model.redirect_to.rstrip("/") + record.raw_path + (f"?{query}" if query else "")
            )
            await Response(status_code=307, headers={"Location": location})(
                scope, receive, recording
            )
        else:
            await self.app(scope, receive, recording)


async def _wait_for_disconnect(receive: Receive) -> None:
    with anyio.move_on_after(HANG_LIMIT_SECONDS):
        while (await receive())["type"] != "http.disconnect":
            pass


class _InLoopServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
