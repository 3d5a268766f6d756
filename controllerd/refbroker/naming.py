"""Names shared by the reference broker and its client (docs/reference-broker.md).

Pure: the Kafka topic of a segment, the consumer group of a subscription, the
etcd key of a seal, and the routing hash. Broker and client must agree on every
one of these, so both import them from here.
"""

from __future__ import annotations

import re
from typing import Final

import mmh3

from controllerd.core.model import TopicName
from controllerd.core.view import Keys

__all__ = ["check_name_part", "key_hash", "seal_key", "segment_topic", "subscription_group"]

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


def subscription_group(topic: TopicName, sub: str) -> str:
    """Kafka consumer group holding a subscription's cursors, e.g. ``sub.acme.ns.orders.s1``."""
    check_name_part(sub)
    return _kafka_name("sub", topic, sub)


def seal_key(keys: Keys, topic: TopicName, segment_id: int) -> str:
    """etcd key of a sealed segment's ``{"endOffset": N}``."""
    return f"{keys.layout(topic)}/segments/{segment_id}/seal"


def key_hash(key: bytes) -> int:
    """Routing hash of a message key: the top 16 bits of unsigned Murmur3-32, seed 0."""
    return mmh3.hash(key, 0, signed=False) >> 16
