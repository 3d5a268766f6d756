"""What Apache Pulsar 5 keeps in its metadata store, read the way Pulsar reads it (pure).

controllerd shares etcd with Pulsar's brokers; these helpers interpret Pulsar's
own records without I/O, so the daemon's view and the tests agree on them.
Evidence is cited as ``file:line`` of the apache/pulsar sources listed in
``shared/reference/pulsar-compat.md`` (aliases: RES ScalableTopicResources,
CTL ScalableTopicController, ASPO AutoScalePolicyOverride, ASC AutoScaleConfig,
OMF ObjectMapperFactory, REST admin/v2/ScalableTopics, TN TopicName, CODEC
common/util/Codec, NSR NamespaceResources/BaseResources, POL Policies).

* **Topic names in keys** are ``Codec.encode(localName)`` (RES:483-484
  ``topicPath`` -> TN ``getEncodedLocalName``), i.e. ``java.net.URLEncoder``
  with UTF-8 (CODEC:29-31), and listings decode them with ``Codec.decode``
  (RES:282, CODEC:33-35). Java's encoder differs from :func:`urllib.parse.quote_plus`
  in one character: it escapes ``~``; both keep ``*`` and turn a space into ``+``.
  Hand-written on top of the standard library for that one difference.
* **REST paths** carry the topic as an ``@Encoded`` path parameter. Every
  endpoint but create (get, delete, split, merge, subscriptions) passes the raw
  text to ``TopicName.get`` unchanged (REST ``getScalableTopicMetadata``,
  ``splitSegment``, ...; TN ``get(domain, namespace, topic)`` concatenates
  without decoding), so the path must carry the local name *verbatim*. Create
  decodes it once in the version the compat reference reads
  (``Codec.decode(encodedTopic)``) and not at all in an earlier one (d69fd88).
  Either way a local name is what some path carried: it holds only characters
  a path segment can carry, ``%`` included when an escape follows (a name
  created as ``orders%2520eu``, or by an earlier broker as ``orders%20eu``, is
  the local name ``orders%20eu``, reached as ``.../orders%20eu/split/0``). A
  name with a space or ``?`` cannot be reached (:func:`rest_path_topic` says
  so instead of encoding twice).
* **autoScalePolicy** (layout field and namespace ``scalableTopicAutoScalePolicy``)
  is a typed ``AutoScalePolicyOverride`` (ASPO:47-89) read with unknown fields
  ignored (OMF:131) and written without nulls (OMF:133): every Pulsar write
  erases any other key. :func:`pulsar_override` returns what survives.
* **Pulsar's own evaluator** runs for a topic when broker
  ``scalableTopicAutoScaleEnabled``, then the namespace override, then the
  topic override resolve ``enabled`` to true (ASC:99-105 ``resolve``,
  ASC:133-134; CTL ``resolveAutoScaleConfig``).
* **Namespace policies** live at ``/admin/policies/<tenant>/<namespace>`` in
  the configuration store (NSR ``BASE_POLICIES_PATH = "/admin/policies"``,
  ``getPoliciesAsync``), a JSON ``Policies`` whose public fields are
  ``retention_policies`` (POL, ``RetentionPolicies`` with
  ``retentionTimeInMinutes``) and ``scalableTopicAutoScalePolicy`` (CTL
  ``p.scalableTopicAutoScalePolicy``). Pulsar's sealed-segment GC takes its
  retention from the topic policy, then the namespace policy, then the broker
  default ``defaultRetentionTimeInMinutes`` (0), negative = keep forever
  (CTL ``resolveRetentionMillisAsync``, ``toRetentionMillis``).
"""

from __future__ import annotations

import functools
import json
import math
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from controllerd.core.model import ModelError, TopicName, shown

JavaType = Literal["Boolean", "Integer", "Long", "Double"]

AUTO_SCALE_OVERRIDE_FIELDS: Final[Mapping[str, JavaType]] = {
    # ASPO:47-89 (PIP-483), in declaration order, with their Java types.
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
    # PIP-486 additions, listed by pulsar-site docs/admin-api-scalable-topics.md
    # ("Per-namespace and per-topic overrides"); types inferred from the broker knobs.
    "rebucketCooldownSeconds": "Long",
    "splitVsRebucketMinMsgRateInThreshold": "Double",
}
"""Every field Pulsar keeps in an ``autoScalePolicy``; any other key is erased on its next write."""

NAMESPACE_POLICIES_ROOT: Final = "/admin/policies"
"""NSR ``BASE_POLICIES_PATH``: ``<root>/<tenant>/<namespace>`` holds the namespace ``Policies``."""

_JAVA_RANGES: Final[Mapping[str, tuple[int, int]]] = {
    "Integer": (-(2**31), 2**31 - 1),
    "Long": (-(2**63), 2**63 - 1),
}
# URLEncoder leaves exactly these unescaped (java.net.URLEncoder class doc); ' ' becomes '+'.
_URL_ENCODER_SAFE: Final = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-*_"
)
_MALFORMED_ESCAPE: Final = re.compile(r"%(?![0-9A-Fa-f]{2})")
_ESCAPE: Final = re.compile(r"%[0-9A-Fa-f]{2}")
# RFC 3986 pchar without '%': what a path segment may carry unescaped.
_PCHAR: Final = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&'()*+,;=:@"
)
# Escapes Jetty's default URI compliance refuses as ambiguous (an encoded '/', '%'
# or ';'): refused here too rather than trusted to Pulsar's Jetty configuration.
_AMBIGUOUS_ESCAPE: Final = re.compile(r"%(?:2[Ff]|25|3[Bb])")


# --- topic names ---------------------------------------------------------------------


def encode_topic_name(local_name: str) -> str:
    """``Codec.encode``: the key component Pulsar stores for a topic's local name.

    >>> encode_topic_name("orders eu:1~x")
    'orders+eu%3A1%7Ex'
    """
    return urllib.parse.quote_plus(local_name, safe="*").replace("~", "%7E")


def decode_topic_name(encoded: str) -> str:
    """``Codec.decode``: the local name behind a key component (``+`` is a space).

    Raises:
        ModelError: a ``%`` not followed by two hex digits, which Java's
            ``URLDecoder`` refuses (IllegalArgumentException) too.
    """
    if _MALFORMED_ESCAPE.search(encoded):
        raise ModelError(f"topic key component {shown(encoded)} has a malformed %-escape")
    return urllib.parse.unquote_plus(encoded, encoding="utf-8", errors="replace")


@functools.lru_cache(maxsize=1 << 18)
def topic_from_key(tenant: str, namespace: str, encoded: str) -> TopicName:
    """The topic a ``/topics/<tenant>/<namespace>/<encoded>`` key names (decoded once).

    Cached (``TopicName`` is immutable): every key of a topic names it again,
    and decoding was a sixth of the cost of loading 1.9 million keys.

    Raises:
        ModelError: a malformed escape, or a decoded name that is not a valid
            ``TopicName`` part (empty, or containing ``/``).
    """
    return TopicName(tenant, namespace, decode_topic_name(encoded))


def topic_key_component(topic: TopicName) -> str:
    """The last component of the topic's layout key (``Codec.encode`` of its local name)."""
    return encode_topic_name(topic.topic)


def rest_path_topic(local_name: str) -> str:
    """The topic as Pulsar's scalable-topic REST paths must carry it: verbatim.

    A ``%`` followed by two hex digits is part of the name and goes as it is
    (Pulsar's non-create endpoints never decode the path), except the escapes
    Jetty refuses as ambiguous (``%2F``, ``%25``, ``%3B``).

    Raises:
        ModelError: the name holds a character a URL path segment cannot carry
            (e.g. space, ``?``, ``#``, non-ASCII, a ``%`` not followed by two hex
            digits) or an ambiguous escape. An escaped form would name a
            different topic (encoded twice in the key) and answer 404/500.
    """
    bad = sorted({c for c in _ESCAPE.sub("", local_name) if c not in _PCHAR})
    if not bad and (ambiguous := _AMBIGUOUS_ESCAPE.search(local_name)):
        bad = [ambiguous.group(0)]
    if bad:
        raise ModelError(
            f"topic name {shown(local_name)} contains {shown(bad)}, which a URL path cannot carry "
            "as Pulsar's scalable-topic REST API reads it (verbatim, never decoded except on "
            "create; Jetty refuses %2F, %25 and %3B), so this topic cannot be split or merged "
            "through it"
        )
    return local_name


# --- autoScalePolicy -------------------------------------------------------------------


def _coerce(name: str, java: JavaType, value: Any, where: str) -> bool | int | float:
    """Jackson's default scalar coercion for one override field."""
    if java == "Boolean":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ModelError(f"{where}.{name}: expected a boolean, got {shown(value)}")
    if isinstance(value, bool):
        raise ModelError(f"{where}.{name}: expected a number, got {shown(value)}")
    number: float | int
    if isinstance(value, int | float):
        number = value
    elif isinstance(value, str):
        try:
            number = int(value) if java != "Double" else float(value)
        except ValueError:
            raise ModelError(f"{where}.{name}: expected a number, got {shown(value)}") from None
    else:
        raise ModelError(f"{where}.{name}: expected a number, got {shown(value)}")
    if java == "Double":
        return float(number)
    if isinstance(number, float):
        if not math.isfinite(number):
            raise ModelError(f"{where}.{name}: expected an integer, got {shown(value)}")
        number = int(number)  # ACCEPT_FLOAT_AS_INT: Jackson truncates
    low, high = _JAVA_RANGES[java]
    if not low <= number <= high:
        raise ModelError(f"{where}.{name}: {shown(value)} is out of range of a Java {java}")
    return number


def pulsar_override(raw: Any, where: str = "autoScalePolicy") -> dict[str, Any] | None:
    """The ``AutoScalePolicyOverride`` Pulsar reads from ``raw`` (and writes back).

    Unknown keys are dropped (OMF:131), null fields too (OMF:133), values are
    coerced to their Java types. ``None`` stays ``None`` (no override); an
    object without any known field is an empty override, ``{}``.

    Raises:
        ModelError: ``raw`` is not an object, or a known field has a value
            Jackson cannot coerce (Pulsar would fail to read the whole record).
    """
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ModelError(f"{where}: expected an object or null, got {shown(raw)}")
    kept: dict[str, Any] = {}
    for name, java in AUTO_SCALE_OVERRIDE_FIELDS.items():
        value = raw.get(name)
        if value is not None:
            kept[name] = _coerce(name, java, value, where)
    return kept


def erased_override_keys(raw: Mapping[str, Any] | None) -> list[str]:
    """Keys of ``raw`` that Pulsar's next write of the record will erase (sorted)."""
    if not raw:
        return []
    return sorted(k for k in raw if k not in AUTO_SCALE_OVERRIDE_FIELDS)


def pulsar_autoscaler_enabled(
    namespace_override: Mapping[str, Any] | None,
    topic_override: Mapping[str, Any] | None,
    *,
    broker_enabled: bool = False,
) -> bool:
    """Whether ``enabled`` resolves to true for Pulsar's own auto split/merge evaluator.

    Broker setting, then namespace override, then topic override; a null or
    absent ``enabled`` inherits (ASC:133-134). Pulsar also treats a resolved
    policy that fails validation as disabled (CTL ``resolveAutoScaleConfig``);
    that needs the broker's thresholds, which controllerd cannot read, so this
    answer errs towards "on": a caller that leaves such topics alone never
    fights Pulsar's evaluator.
    """
    enabled = broker_enabled
    for override in (namespace_override, topic_override):
        if override is not None and override.get("enabled") is not None:
            value = override["enabled"]
            enabled = value if isinstance(value, bool) else str(value).lower() == "true"
    return enabled


# --- namespace policies ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NamespacePolicies:
    """The two parts of a Pulsar namespace ``Policies`` record controllerd reads.

    ``auto_scale``: the namespace ``scalableTopicAutoScalePolicy`` as Pulsar
    reads it (:func:`pulsar_override`), None when unset. ``retention_seconds``:
    ``retention_policies.retentionTimeInMinutes`` in seconds, negative = keep
    forever, None when the namespace sets no retention (the broker default
    applies).
    """

    auto_scale: dict[str, Any] | None = None
    retention_seconds: float | None = None


def parse_namespace_policies(value: bytes | str | Mapping[str, Any]) -> NamespacePolicies:
    """Read a ``/admin/policies/<tenant>/<namespace>`` value; other fields are ignored.

    Raises:
        ModelError: not JSON, not an object, or one of the two fields malformed.
    """
    raw: Any = value
    if isinstance(value, bytes | str):
        try:
            raw = json.loads(value)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ModelError(f"namespace policies: not JSON ({exc})") from None
    if not isinstance(raw, Mapping):
        raise ModelError(f"namespace policies: expected an object, got {type(raw).__name__}")
    auto_scale = pulsar_override(
        raw.get("scalableTopicAutoScalePolicy"), "policies.scalableTopicAutoScalePolicy"
    )
    retention = raw.get("retention_policies")
    seconds: float | None = None
    if retention is not None:
        if not isinstance(retention, Mapping):
            raise ModelError(
                f"policies.retention_policies: expected an object, got {shown(retention)}"
            )
        # RetentionPolicies.retentionTimeInMinutes is a Java int: absent reads as 0.
        minutes = retention.get("retentionTimeInMinutes")
        minutes = 0 if minutes is None else minutes
        number = _coerce(
            "retentionTimeInMinutes", "Integer", minutes, "policies.retention_policies"
        )
        seconds = float(number) * 60.0
    return NamespacePolicies(auto_scale, seconds)


def namespace_policies_key(prefix: str, tenant: str, namespace: str) -> str:
    """The key of a namespace's ``Policies`` under ``prefix`` ("" = etcd root)."""
    return f"{prefix.rstrip('/')}{NAMESPACE_POLICIES_ROOT}/{tenant}/{namespace}"


def parse_namespace_policies_key(prefix: str, key: str) -> tuple[str, str] | None:
    """``(tenant, namespace)`` for a namespace policies key, else None.

    Keys deeper than ``<tenant>/<namespace>`` (Pulsar keeps other records under
    the same root) and the tenant records themselves are not namespace policies.
    """
    root = f"{prefix.rstrip('/')}{NAMESPACE_POLICIES_ROOT}/"
    if not key.startswith(root):
        return None
    parts = key[len(root) :].split("/")
    if len(parts) != 2 or not all(parts):
        return None
    return parts[0], parts[1]


def pulsar_retention_seconds(
    namespace: NamespacePolicies | None, broker_default_minutes: int = 0
) -> float:
    """Retention Pulsar's GC applies to a topic without a topic-level policy.

    Namespace ``retention_policies`` first, else the broker's
    ``defaultRetentionTimeInMinutes`` (0 by default). Negative = keep forever.
    Topic-level retention lives in Pulsar's topic-policies system topic, not in
    the metadata store, so controllerd cannot see it.
    """
    if namespace is not None and namespace.retention_seconds is not None:
        return namespace.retention_seconds
    return float(broker_default_minutes) * 60.0
