"""Malformed etcd values of every key kind the daemon reads, as hypothesis strategies.

Shared by ``test_poison.py`` and ``bench/fault_bench.py``. Every value drawn
for a kind is *certain* to be refused by that kind's parser (non-UTF-8 bytes,
text that is not JSON, nesting deeper than 1,024, numbers that overflow a
double, and well-formed JSON of the wrong shape or with out-of-range fields),
except for consumer registrations: their value is never read (the key's
existence is the registration), so any value there must be *accepted*.

Poison goes to topics named ``poison-<n>`` and to the tenant ``poison``, so a
good topic beside them has nothing to do with it but share the process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from hypothesis import strategies as st

from controllerd.core.model import TopicName
from controllerd.core.view import UNKNOWN_TYPE, Keys, MetadataView

#: Rejection kinds (``controllerd_metadata_rejected_total{kind}``) and consumer,
#: whose values are never rejected.
KINDS: Final = (
    "layout",
    "load",
    "subscription",
    "consumer",
    "policy",
    "cooldown",
    "cold_since",
    "pending_delete",
    "pulsar_policy",
)
NEVER_REJECTED: Final = frozenset({"consumer"})
RATE_FIELDS: Final = ("msgRateIn", "byteRateIn", "msgRateOut", "byteRateOut")
LONG_MAX: Final = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Poison:
    """One malformed value and the kind of key it is written at."""

    kind: str
    value: bytes


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


# -- malformed whatever the kind ----------------------------------------------------------

non_utf8 = st.binary(max_size=40).map(lambda b: b"\xff\xfe" + b)
not_json = st.text(max_size=40).map(lambda t: ("x" + t).encode())
too_deep = st.integers(1_025, 100_000).flatmap(
    lambda n: st.sampled_from([b"[" * n, b"[" * n + b"]" * n, b'{"a":' * n + b"1" + b"}" * n])
)
overflowing = st.integers(310, 400).map(lambda digits: b"1" * digits)
"""An integer literal too big even for a double (orjson: "number is infinity")."""
garbage = st.one_of(non_utf8, not_json, too_deep, overflowing)

json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
not_an_object = st.one_of(json_scalar, st.lists(json_scalar, max_size=4)).map(_dumps)
not_a_long = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=10),
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer()),
    st.integers(LONG_MAX + 1, 2**64 - 1),
    st.integers(-(2**64), -LONG_MAX - 2),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    st.lists(st.integers(), max_size=2),
)


def _layout_with(**segment: Any) -> dict[str, Any]:
    """A one-segment layout, well formed but for ``segment``'s fields."""
    return {
        "epoch": 0,
        "nextSegmentId": 1,
        "segments": {
            "0": {
                "segmentId": 0,
                "hashRange": {"start": 0, "end": 65535},
                "state": "ACTIVE",
                "parentIds": [],
                "childIds": [],
                "createdAtEpoch": 0,
                "sealedAtEpoch": -1,
                "createdAtMs": 5,
                "sealedAtMs": -1,
                **segment,
            }
        },
    }


def _shaped(kind: str) -> st.SearchStrategy[bytes]:
    """Well-formed JSON that the parser of ``kind`` must still refuse."""
    if kind == "layout":
        bad_segments = st.one_of(json_scalar, st.lists(json_scalar, min_size=1, max_size=3))
        return st.one_of(
            not_an_object,
            st.just(b"{}"),
            bad_segments.map(lambda s: _dumps({"epoch": 0, "segments": s})),
            # whole, but a stamp beyond 64 bits: it went into the cooldown written after
            # the next split, and that write failed once the broker had split
            st.tuples(
                st.sampled_from(["createdAtMs", "sealedAtMs", "createdAtEpoch"]),
                st.one_of(st.integers(LONG_MAX + 1, 2**64 - 1), st.just(1e20)),
            ).map(lambda fv: _dumps(_layout_with(**{fv[0]: fv[1]}))),
        )
    if kind == "load":
        bad_rate = st.one_of(
            st.none(),
            st.booleans(),
            st.text(max_size=10),
            st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False),
            st.lists(st.integers(), max_size=2),
        )
        return st.one_of(
            not_an_object,
            st.just(b"{}"),
            st.tuples(st.sampled_from(RATE_FIELDS), bad_rate).map(
                lambda fv: _dumps(
                    {**dict.fromkeys(RATE_FIELDS, 1.0), fv[0]: fv[1], "changedAtMs": 1}
                )
            ),
        )
    if kind == "subscription":
        known = {"STREAM", "QUEUE", "CHECKPOINT"}
        return st.one_of(
            st.one_of(json_scalar, st.lists(json_scalar, max_size=3)).map(_dumps),
            st.text(max_size=12)
            .filter(lambda t: t.upper() not in known)
            .map(lambda t: _dumps({"type": t})),
        )
    if kind in ("policy", "pulsar_policy"):
        shaped = not_an_object
        if kind == "pulsar_policy":
            bad = st.one_of(st.booleans(), st.text(max_size=8), st.lists(st.integers(), max_size=2))
            shaped = st.one_of(shaped, bad.map(lambda v: _dumps({"retention_policies": v})))
        return shaped
    if kind == "cooldown":
        return st.one_of(
            not_an_object,
            st.tuples(st.sampled_from(["lastSplitAtMs", "lastMergeAtMs"]), not_a_long).map(
                lambda fv: _dumps({"lastSplitAtMs": 1, "lastMergeAtMs": 1, fv[0]: fv[1]})
            ),
        )
    if kind == "cold_since":
        return st.one_of(
            not_a_long.map(_dumps), st.integers(-LONG_MAX - 1, -1).map(lambda n: str(n).encode())
        )
    if kind == "pending_delete":
        return st.one_of(
            not_an_object,
            not_a_long.map(
                lambda sid: _dumps(
                    {"topic": "acme/ns/gone", "descriptor": "0000-ffff-7", "segmentId": sid}
                )
            ),
            st.integers(0, 2**40)
            .filter(lambda n: n != 7)
            .map(
                lambda sid: _dumps(
                    {"topic": "acme/ns/gone", "descriptor": "0000-ffff-7", "segmentId": sid}
                )
            ),
            st.just(b'{"topic": "acme/ns/gone", "descriptor": "0000-ffff-7", "segmentId": 1e999}'),
        )
    raise ValueError(kind)


def malformed(kind: str) -> st.SearchStrategy[Poison]:
    """A value ``kind``'s parser must refuse (consumers: any value at all)."""
    if kind == "consumer":
        values: st.SearchStrategy[bytes] = st.one_of(garbage, not_an_object, st.binary(max_size=30))
    else:
        values = st.one_of(garbage, _shaped(kind))
    return values.map(lambda value: Poison(kind, value))


poison_values = st.sampled_from(KINDS).flatmap(malformed)
"""A malformed value of any key kind."""


def _poison_topic(n: int) -> TopicName:
    return TopicName("acme", "ns", f"poison-{n}")


def _policy_scope(n: int) -> tuple[str, str | None, str | None]:
    return (("poison", None, None), ("poison", f"ns{n}", None), ("poison", f"ns{n}", f"t{n}"))[
        n % 3
    ]


def poison_key(keys: Keys, kind: str, n: int) -> str:
    """The ``n``-th poison key of ``kind``: no other poison value and no good topic uses it."""
    topic = _poison_topic(n)
    match kind:
        case "layout":
            return keys.layout(topic)
        case "load":
            return keys.load(topic, n % 16)
        case "subscription":
            return keys.subscription(topic, f"s{n}")
        case "consumer":
            return keys.consumer(topic, "s", f"c{n}")
        case "policy":
            return keys.policy(*_policy_scope(n))
        case "cooldown":
            return keys.cooldown(topic)
        case "cold_since":
            return keys.cold_since(topic, n % 16)
        case "pending_delete":
            return keys.pending_delete(topic, f"0000-ffff-{n}")
        case "pulsar_policy":
            return f"{keys.pulsar_policies_prefix}poison/ns{n}"
    raise ValueError(kind)


def held(view: MetadataView, kind: str, n: int) -> bool:
    """Whether ``view`` holds a value for :func:`poison_key` ``(kind, n)``.

    A refused value is never held (never half-applied): the topic has no
    layout, the segment no load, and so on. A refused subscription stays known
    with type ``UNKNOWN`` (GC must still ask for its backlog): its value is not held.
    """
    state = view.topics.get(_poison_topic(n))
    match kind:
        case "layout":
            return state is not None and state.layout is not None
        case "load":
            return state is not None and n % 16 in state.loads
        case "subscription":
            kind_held = state.subscriptions.get(f"s{n}") if state is not None else None
            return kind_held not in (None, UNKNOWN_TYPE)
        case "consumer":
            return state is not None and f"c{n}" in state.consumers.get("s", set())
        case "policy":
            return _policy_scope(n) in view.overrides
        case "cooldown":
            return state is not None and state.cooldown is not None
        case "cold_since":
            return state is not None and n % 16 in state.cold_since
        case "pending_delete":
            return view.keys.pending_delete(_poison_topic(n), f"0000-ffff-{n}") in (
                view.pending_deletes
            )
        case "pulsar_policy":
            return ("poison", f"ns{n}") in view.pulsar_namespaces
    raise ValueError(kind)


#: The issue's named examples (#10, defect 3), one of each kind where it applies.
NAMED: Final = (
    Poison("cold_since", b"{}"),
    Poison("cooldown", b'{"lastSplitAtMs": "soon", "lastMergeAtMs": 1}'),
    Poison(
        "load",
        b'{"msgRateIn": '
        + b"9" * 400
        + b', "byteRateIn": 0, "msgRateOut": 0, "byteRateOut": 0, "changedAtMs": 1}',
    ),
    Poison("layout", b"[" * 100_000),
    Poison(
        "pending_delete",
        b'{"topic": "acme/ns/gone", "descriptor": "0000-ffff-1", "segmentId": 1e999, '
        b'"prunedAtMs": 1}',
    ),
    Poison("subscription", b'\xff\xfe{"type": "STREAM"}'),
    Poison("policy", b"\xc3\x28 not utf-8"),
    Poison("pulsar_policy", b'{"retention_policies": "forever"}'),
    Poison("consumer", b"\xff\xff\xff"),
)
