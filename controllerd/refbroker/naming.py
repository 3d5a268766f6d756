"""Names shared by the reference broker and its client (docs/reference-broker.md).

Pure: the Kafka topic of a segment, the consumer group of a subscription, the
etcd keys of a seal and of a seal in progress, the routing hash and the
hash-range slices of a load histogram. Broker and client must agree on every
one of these, so both import them from here.
"""

from __future__ import annotations

import re
from typing import Final

import mmh3

from controllerd.core.model import TopicName
from controllerd.core.view import Keys

__all__ = [
    "HISTOGRAM_SLICES",
    "check_name_part",
    "key_hash",
    "seal_key",
    "sealing_key",
    "segment_topic",
    "segment_topic_prefix",
    "slice_starts",
    "subscription_group",
]

_NAME_PART: Final = re.compile(r"[A-Za-z0-9_-]+")
_DESCRIPTOR: Final = re.compile(r"[0-9a-f]{4}-[0-9a-f]{4}-[0-9]+")
#: Kafka refuses longer topic names.
_KAFKA_NAME_MAX: Final = 249


def check_name_part(s: str) -> None:
    """Refuse a tenant, namespace, topic or subscription name that is not Kafka-safe.

    Raises:
        ValueError: ``s`` is empty or has a character outside ``[A-Za-z0-9_-]``.
    """
    if not _NAME_PART.fullmatch(s):
        raise ValueError(f"name {s!r} must match [A-Za-z0-9_-]+")


def _kafka_name(kind: str, topic: TopicName, last: str) -> str:
    for part in (topic.tenant, topic.namespace, topic.topic):
        check_name_part(part)
    name = f"{kind}.{topic.tenant}.{topic.namespace}.{topic.topic}.{last}"
    if len(name) > _KAFKA_NAME_MAX:
        raise ValueError(f"{name!r} is longer than Kafka's {_KAFKA_NAME_MAX} characters")
    return name


def segment_topic(topic: TopicName, descriptor: str) -> str:
    """Kafka topic holding one segment, e.g. ``seg.acme.ns.orders.0000-7fff-1``.

    Raises:
        ValueError: a name part is not Kafka-safe or ``descriptor`` is not ``%04x-%04x-%d``.
    """
    if not _DESCRIPTOR.fullmatch(descriptor):
        raise ValueError(f"{descriptor!r} is not a segment descriptor (%04x-%04x-%d)")
    return _kafka_name("seg", topic, descriptor)


def segment_topic_prefix(topic: TopicName) -> str:
    """What every segment topic of ``topic`` starts with, e.g. ``seg.acme.ns.orders.``.

    No other topic's segment topic starts with it: a name part holds no dot
    (:func:`check_name_part`), so the prefix's dots fix tenant, namespace and
    topic, and the last one ends the topic's name (``orders`` vs ``orders-eu``).

    Raises:
        ValueError: a name part is not Kafka-safe.
    """
    return _kafka_name("seg", topic, "")


def subscription_group(topic: TopicName, sub: str) -> str:
    """Kafka consumer group holding a subscription's cursors, e.g. ``sub.acme.ns.orders.s1``."""
    check_name_part(sub)
    return _kafka_name("sub", topic, sub)


def seal_key(keys: Keys, topic: TopicName, segment_id: int) -> str:
    """etcd key of a sealed segment's ``{"endOffset": N}``."""
    return f"{keys.layout(topic)}/segments/{segment_id}/seal"


def sealing_key(keys: Keys, topic: TopicName) -> str:
    """etcd key of a seal in progress: ``{"segments": [ids]}`` on the broker's lease.

    While it exists, the segments it names may be sealed at any offset the broker
    reads after it appeared; clients treat them as possibly sealed.
    """
    return f"{keys.layout(topic)}/sealing"


#: Most slices in a segment's load histogram (``hashBuckets``).
HISTOGRAM_SLICES: Final = 32


def slice_starts(start: int, end: int, slices: int = HISTOGRAM_SLICES) -> list[int]:
    """First hash of each slice of ``[start, end]``: ``start + (i * W) // n``, W = width.

    ``n = min(slices, W)``, so no slice is empty; slice ``i`` ends where slice
    ``i + 1`` starts, the last at ``end`` (the ``hashBuckets`` wire format).

    Raises:
        ValueError: ``end < start`` or ``slices < 1``.
    """
    if end < start or slices < 1:
        raise ValueError(f"bad range [{start}, {end}] or slice count {slices}")
    width = end - start + 1
    n = min(slices, width)
    return [start + (i * width) // n for i in range(n)]


def key_hash(key: bytes) -> int:
    """Routing hash of a message key: the top 16 bits of unsigned Murmur3-32, seed 0."""
    return mmh3.hash(key, 0, signed=False) >> 16
