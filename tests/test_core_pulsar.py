"""controllerd.core.pulsar: Pulsar's metadata read the way Pulsar reads it."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controllerd.core.model import ModelError, TopicName
from controllerd.core.pulsar import (
    AUTO_SCALE_OVERRIDE_FIELDS,
    NamespacePolicies,
    decode_topic_name,
    encode_topic_name,
    erased_override_keys,
    namespace_policies_key,
    parse_namespace_policies,
    parse_namespace_policies_key,
    pulsar_autoscaler_enabled,
    pulsar_override,
    pulsar_retention_seconds,
    rest_path_topic,
    topic_from_key,
    topic_key_component,
)


def java_url_encode(text: str) -> str:
    """java.net.URLEncoder.encode(text, UTF_8) by its class documentation, byte by byte.

    Alphanumerics and ``.-*_`` stay, space becomes ``+``, every other byte of
    the UTF-8 form becomes ``%XY`` with upper-case hex. Written independently
    of the module under test (which builds on ``quote_plus``).
    """
    safe = set(string.ascii_letters + string.digits + ".-*_")
    out = []
    for ch in text:
        if ch in safe:
            out.append(ch)
        elif ch == " ":
            out.append("+")
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    return "".join(out)


@pytest.mark.parametrize(
    ("local", "encoded"),
    [
        ("orders", "orders"),
        ("orders-eu_1.v2", "orders-eu_1.v2"),
        ("a b", "a+b"),
        ("a:b", "a%3Ab"),
        ("50%", "50%25"),
        ("x~y*z", "x%7Ey*z"),  # Java escapes '~' (quote_plus would not) and keeps '*'
        ("a+b", "a%2Bb"),
        ("é", "%C3%A9"),
    ],
)
def test_topic_names_are_encoded_like_codec_encode(local: str, encoded: str) -> None:
    assert encode_topic_name(local) == encoded
    assert decode_topic_name(encoded) == local


@given(st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=30))
def test_encoding_matches_java_and_round_trips(local: str) -> None:
    assert encode_topic_name(local) == java_url_encode(local)
    assert decode_topic_name(encode_topic_name(local)) == local


@pytest.mark.parametrize("bad", ["50%", "a%4", "a%G1"])
def test_malformed_escapes_are_refused_like_url_decoder(bad: str) -> None:
    with pytest.raises(ModelError, match="malformed"):
        decode_topic_name(bad)


def test_keys_decode_once_into_topic_names() -> None:
    topic = topic_from_key("acme", "ns", "orders%3Aeu+1")
    assert topic == TopicName("acme", "ns", "orders:eu 1")
    assert topic_key_component(topic) == "orders%3Aeu+1"
    # Never encoded twice: the key component of a decoded name is the key we read.
    assert topic_key_component(topic_from_key("acme", "ns", "50%25")) == "50%25"
    with pytest.raises(ModelError):
        topic_from_key("acme", "ns", "a%2Fb")  # decodes to a name with '/'


def test_rest_paths_carry_names_verbatim_or_refuse() -> None:
    assert rest_path_topic("orders:eu@1") == "orders:eu@1"
    # a local name with escapes is what a path carried: it goes back as it is
    # (it was refused, and such a topic was never split)
    assert rest_path_topic("orders%20eu") == "orders%20eu"
    assert rest_path_topic("a%3Ab%7e") == "a%3Ab%7e"
    for name in ("a b", "50%", "5%2", "%zz", "what?", "é", "a%2Fb", "a%25b", "a%3bb"):
        with pytest.raises(ModelError, match="cannot carry"):
            rest_path_topic(name)


def test_override_keeps_only_pulsar_fields_with_java_types() -> None:
    raw = {
        "enabled": False,
        "maxSegments": 12.0,
        "splitCooldownSeconds": "30",
        "splitMsgRateInThreshold": 20_000,
        "splitBytesRateInThreshold": 5e7,
        "mergeWindowSeconds": None,
        "maxSplitFanout": 4,
        "loadTtlSeconds": 60,
        "minSplitWidth": 512,
        "mergeCombinedMaxRatio": 0.5,
    }
    assert pulsar_override(raw) == {
        "enabled": False,
        "maxSegments": 12,
        "splitCooldownSeconds": 30,
        "splitMsgRateInThreshold": 20_000.0,
        "splitBytesRateInThreshold": 50_000_000,
    }
    assert erased_override_keys(raw) == [
        "loadTtlSeconds",
        "maxSplitFanout",
        "mergeCombinedMaxRatio",
        "minSplitWidth",
    ]
    assert pulsar_override(None) is None
    assert pulsar_override({"ours": 1}) == {}
    assert erased_override_keys(None) == []


def test_override_field_list_is_aspo_plus_pip486() -> None:
    # AutoScalePolicyOverride.java:47-89, then the two PIP-486 fields the docs list.
    assert list(AUTO_SCALE_OVERRIDE_FIELDS) == [
        "enabled",
        "maxSegments",
        "minSegments",
        "maxDagDepth",
        "splitCooldownSeconds",
        "mergeCooldownSeconds",
        "mergeWindowSeconds",
        "splitMsgRateInThreshold",
        "splitBytesRateInThreshold",
        "splitMsgRateOutThreshold",
        "splitBytesRateOutThreshold",
        "mergeMsgRateInThreshold",
        "mergeBytesRateInThreshold",
        "mergeMsgRateOutThreshold",
        "mergeBytesRateOutThreshold",
        "rebucketCooldownSeconds",
        "splitVsRebucketMinMsgRateInThreshold",
    ]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"enabled": "maybe"}, "enabled"),
        ({"maxSegments": True}, "maxSegments"),
        ({"maxSegments": 2**31}, "maxSegments"),
        ({"mergeWindowSeconds": [1]}, "mergeWindowSeconds"),
        ({"splitMsgRateInThreshold": "lots"}, "splitMsgRateInThreshold"),
    ],
)
def test_override_values_jackson_cannot_read_name_the_field(
    raw: dict[str, object], field: str
) -> None:
    with pytest.raises(ModelError, match=field):
        pulsar_override(raw, "layout.autoScalePolicy")
    with pytest.raises(ModelError, match="expected an object"):
        pulsar_override([1, 2])


@pytest.mark.parametrize(
    ("broker", "namespace", "topic", "expected"),
    [
        (False, None, None, False),
        (False, None, {"enabled": True}, True),
        (False, {"enabled": True}, None, True),
        (False, {"enabled": True}, {"enabled": False}, False),
        (False, {"enabled": True}, {"enabled": None, "maxSegments": 3}, True),
        (True, None, None, True),
        (True, {"enabled": False}, None, False),
        (True, {"enabled": False}, {"enabled": True}, True),
        (False, None, {"maxSplitFanout": 4}, False),
        (False, None, {"enabled": "true"}, True),
    ],
)
def test_pulsar_autoscaler_resolves_broker_namespace_topic(
    broker: bool,
    namespace: dict[str, object] | None,
    topic: dict[str, object] | None,
    expected: bool,
) -> None:
    assert pulsar_autoscaler_enabled(namespace, topic, broker_enabled=broker) is expected


def _policies(**fields: object) -> bytes:
    """A namespace Policies record as Pulsar writes it: many fields we ignore."""
    base: dict[str, object] = {
        "auth_policies": {
            "namespace_auth": {},
            "destination_auth": {},
            "subscription_auth_roles": {},
        },
        "replication_clusters": ["standalone"],
        "bundles": {"boundaries": ["0x00000000", "0xffffffff"], "numBundles": 1},
        "backlog_quota_map": {},
        "deleted": False,
        "encryption_required": False,
        "subscription_auth_mode": "None",
        "offload_threshold": -1,
        "schema_compatibility_strategy": "UNDEFINED",
        "properties": {},
    }
    base.update(fields)
    return json.dumps(base).encode()


def test_namespace_policies_give_override_and_retention() -> None:
    parsed = parse_namespace_policies(
        _policies(
            retention_policies={"retentionTimeInMinutes": 90, "retentionSizeInMB": -1},
            scalableTopicAutoScalePolicy={"enabled": False, "maxSegments": 8, "ours": 1},
        )
    )
    assert parsed == NamespacePolicies({"enabled": False, "maxSegments": 8}, 5400.0)
    assert parse_namespace_policies(_policies()) == NamespacePolicies(None, None)
    forever = parse_namespace_policies(
        _policies(retention_policies={"retentionTimeInMinutes": -1, "retentionSizeInMB": -1})
    )
    assert forever.retention_seconds == -60.0
    # RetentionPolicies.retentionTimeInMinutes is a primitive int: absent is 0.
    assert parse_namespace_policies({"retention_policies": {}}).retention_seconds == 0.0


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (b"not json", "not JSON"),
        (b"[1]", "expected an object"),
        (_policies(retention_policies=5), "retention_policies"),
        (
            _policies(retention_policies={"retentionTimeInMinutes": "soon"}),
            "retentionTimeInMinutes",
        ),
        (_policies(scalableTopicAutoScalePolicy={"minSegments": "x"}), "minSegments"),
    ],
)
def test_malformed_namespace_policies_name_the_field(value: bytes, needle: str) -> None:
    with pytest.raises(ModelError, match=needle):
        parse_namespace_policies(value)


def test_retention_falls_back_to_the_broker_default() -> None:
    assert pulsar_retention_seconds(None) == 0.0
    assert (
        pulsar_retention_seconds(NamespacePolicies(None, None), broker_default_minutes=5) == 300.0
    )
    assert (
        pulsar_retention_seconds(NamespacePolicies(None, 120.0), broker_default_minutes=5) == 120.0
    )
    assert pulsar_retention_seconds(NamespacePolicies(None, -60.0)) < 0
    assert pulsar_retention_seconds(None, broker_default_minutes=-1) < 0


def test_namespace_policies_keys_at_root_or_under_a_prefix() -> None:
    assert namespace_policies_key("", "acme", "ns") == "/admin/policies/acme/ns"
    assert namespace_policies_key("/t/1/", "acme", "ns") == "/t/1/admin/policies/acme/ns"
    assert parse_namespace_policies_key("", "/admin/policies/acme/ns") == ("acme", "ns")
    assert parse_namespace_policies_key("/t/1", "/t/1/admin/policies/acme/ns") == ("acme", "ns")
    assert parse_namespace_policies_key("", "/admin/policies/acme") is None  # the tenant
    assert parse_namespace_policies_key("", "/admin/policies/acme/ns/extra") is None
    assert parse_namespace_policies_key("", "/topics/acme/ns/orders") is None
