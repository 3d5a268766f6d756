"""The metadata view: key parsing, triggers, and malformed values skipped, never fatal."""

from __future__ import annotations

import dataclasses
import json
from array import array
from typing import cast

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from controllerd.core.layout import initial_layout, merge, split
from controllerd.core.model import (
    LoadSample,
    PlainLoad,
    Rates,
    TopicName,
    layout_to_json,
    load_sample_from_json,
    plain_load_json,
)
from controllerd.core.policy import TopicHistory
from controllerd.core.view import (
    _INDEX_AT,
    UNKNOWN_TYPE,
    Change,
    Cooldown,
    Keys,
    LoadTable,
    MetadataView,
    Rejected,
    TopicState,
    seeded_cooldown,
)

KEYS = Keys("/pulsar", "/controllerd/default")
T = TopicName("acme", "ns", "orders")
NOW = 1_760_000_000_000


def layout_bytes(n: int = 2) -> bytes:
    return json.dumps(layout_to_json(initial_layout(n))).encode()


def load_bytes(msg_in: float = 5.0, **extra: int) -> bytes:
    return json.dumps(
        {"msgRateIn": msg_in, "byteRateIn": 1, "msgRateOut": 1, "byteRateOut": 1, **extra}
    ).encode()


def fresh() -> MetadataView:
    view = MetadataView(KEYS)
    assert view.apply_put(KEYS.layout(T), layout_bytes(), 10, NOW) == Change("layout", T, True)
    return view


def test_keys_follow_the_design() -> None:
    assert KEYS.layout(T) == "/pulsar/topics/acme/ns/orders"
    assert (
        KEYS.consumer(T, "s", "c1") == "/pulsar/topics/acme/ns/orders/subscriptions/s/consumers/c1"
    )
    assert KEYS.load(T, 3) == "/pulsar/topics/acme/ns/orders/segments/3/load"
    assert KEYS.leader == "/controllerd/default/leader"
    assert KEYS.cooldown(T) == "/controllerd/default/cooldowns/acme/ns/orders"
    assert KEYS.cold_since(T, 4) == "/controllerd/default/cold-since/acme/ns/orders/4"
    assert KEYS.policy("acme", "ns") == "/controllerd/default/policies/acme/ns"
    assert KEYS.pending_delete(T, "0000-7fff-1") == (
        "/controllerd/default/pending-deletes/acme/ns/orders/0000-7fff-1"
    )


def test_consumer_registration_triggers_and_counts_per_subscription() -> None:
    view = fresh()
    view.apply_put(KEYS.subscription(T, "s"), b'{"type": "STREAM"}', 11, NOW)
    view.apply_put(KEYS.subscription(T, "q"), b'{"type": "QUEUE"}', 12, NOW)
    out = view.apply_put(KEYS.consumer(T, "s", "c1"), b"{}", 13, NOW)
    assert out == Change("consumer", T, True)
    # the same registration again (lease refresh) is not a new consumer
    assert view.apply_put(KEYS.consumer(T, "s", "c1"), b"{}", 14, NOW) == Change(
        "consumer", T, False
    )
    view.apply_put(KEYS.consumer(T, "s", "c2"), b"", 15, NOW)
    for i in range(5):
        view.apply_put(KEYS.consumer(T, "q", f"w{i}"), b"", 16 + i, NOW)
    # a consumer of a subscription whose key we have not seen counts as STREAM
    view.apply_put(KEYS.consumer(T, "unknown", "c"), b"", 30, NOW)
    assert view.topics[T].consumer_counts() == {"s": 2, "unknown": 1}
    assert view.apply_delete(KEYS.consumer(T, "s", "c1")) == Change("consumer", T, True)
    assert view.topics[T].consumer_counts()["s"] == 1


def test_consumers_that_came_and_went_leave_no_subscription_behind() -> None:
    """A subscription without a key of its own is known through its consumers; once
    they left, an empty set stayed for ever, and GC kept asking that subscription's
    backlog (404: unknown, never drained) and kept every segment of the topic."""
    view = fresh()
    view.apply_put(KEYS.subscription(T, "s"), b'{"type": "STREAM"}', 11, NOW)
    for n, sub in enumerate(("s", "keyless", "keyless")):
        view.apply_put(KEYS.consumer(T, sub, f"c{n}"), b"{}", 12 + n, NOW)
    for n, sub in enumerate(("s", "keyless", "keyless")):
        view.apply_delete(KEYS.consumer(T, sub, f"c{n}"))
    state = view.topics[T]
    assert state.consumers == {}
    assert set(state.subscriptions) == {"s"}  # its own key keeps it
    assert state.consumer_counts() == {}


def test_a_topic_whose_last_key_goes_leaves_nothing_behind() -> None:
    """A topic is made by any of its keys; only a layout's delete removed it. A load
    record written after its layout's delete (a reporter's late write), or a
    registration, kept a topic in the view for ever once deleted too, and a refused
    load record made one that no delete could remove."""
    view = fresh()
    view.apply_delete(KEYS.layout(T))
    assert T not in view.topics
    view.apply_events([(True, KEYS.load(T, 0).encode(), load_bytes(), 30)], NOW, lambda _: None)
    view.apply_put(KEYS.consumer(T, "s", "c1"), b"{}", 31, NOW)
    assert T in view.topics
    assert view.apply_delete(KEYS.load(T, 0)) == Change("load", T, False)  # c1 still holds it
    assert view.apply_delete(KEYS.consumer(T, "s", "c1")) == Change("layout", T, False)
    assert T not in view.topics
    assert KEYS.layout(T).encode() not in view._heads
    other = TopicName("acme", "ns", "never")
    assert isinstance(
        view.apply_put(KEYS.load(other, 0), b'{"msgRateIn": "hot"}', 40, NOW), Rejected
    )
    assert other not in view.topics
    # what still holds a topic without a layout keeps it: our own keys, a bad layout
    view.apply_put(KEYS.load(T, 0), load_bytes(), 41, NOW)
    view.apply_put(KEYS.cooldown(T), orjson.dumps({"lastSplitMs": 1}), 42, NOW)
    assert view.apply_delete(KEYS.load(T, 0)) == Change("load", T, False)
    assert T in view.topics


def test_load_records_parse_and_fall_back_to_first_seen() -> None:
    view = fresh()
    assert view.apply_put(KEYS.load(T, 0), load_bytes(changedAtMs=5), 20, NOW) == Change(
        "load", T, True, 0
    )
    assert view.topics[T].loads[0].changed_at_ms == 5
    # plain Pulsar record without timestamps: first time this mod revision was seen
    view.apply_put(KEYS.load(T, 1), load_bytes(), 21, NOW + 1)
    view.apply_put(KEYS.load(T, 1), load_bytes(), 21, NOW + 99)  # same revision, replayed
    assert view.topics[T].loads[1].changed_at_ms == NOW + 1
    view.apply_put(KEYS.load(T, 1), load_bytes(), 22, NOW + 500)
    assert view.topics[T].loads[1].changed_at_ms == NOW + 500


def test_malformed_values_are_rejected_not_raised() -> None:
    view = fresh()
    bad_load = view.apply_put(KEYS.load(T, 0), b'{"msgRateIn": "hot"}', 21, NOW)
    assert isinstance(bad_load, Rejected) and bad_load.kind == "load"
    assert isinstance(view.apply_put(KEYS.load(T, 0), b"\xff\xfe", 22, NOW), Rejected)
    assert isinstance(view.apply_put(KEYS.load(T, 0) + "x", b"{}", 22, NOW), type(None))
    bad_sub = view.apply_put(KEYS.subscription(T, "s"), b'{"type": "FANOUT"}', 23, NOW)
    assert isinstance(bad_sub, Rejected) and bad_sub.kind == "subscription"
    assert isinstance(view.apply_put(KEYS.policy("acme"), b"[1]", 24, NOW), Rejected)
    assert isinstance(view.apply_put(KEYS.cooldown(T), b"nope", 25, NOW), Rejected)
    # keys that are not ours or do not parse are ignored
    assert view.apply_put("/pulsar/topics/onlytwo/parts", b"{}", 26, NOW) is None
    assert view.apply_put("/elsewhere/x", b"{}", 27, NOW) is None


def test_a_subscription_whose_value_is_malformed_stays_known() -> None:
    """GC asks the broker for the backlog of every subscription the view knows; one
    whose value cannot be read must not vanish (a topic without subscriptions counts
    as drained). A later good value replaces the unknown type; a bad one keeps the last
    good type."""
    view = fresh()
    assert isinstance(view.apply_put(KEYS.subscription(T, "s"), b"{nope", 40, NOW), Rejected)
    assert view.topics[T].subscriptions == {"s": UNKNOWN_TYPE}
    view.apply_put(KEYS.subscription(T, "s"), b'{"type": "QUEUE"}', 41, NOW)
    bad = view.apply_put(KEYS.subscription(T, "s"), b'{"type": "KEY_SHARED"}', 42, NOW)
    assert isinstance(bad, Rejected)
    assert view.topics[T].subscriptions == {"s": "QUEUE"}
    assert KEYS.subscription(T, "s") in view.keys_held(KEYS.topics_prefix)
    view.apply_delete(KEYS.subscription(T, "s"))
    assert view.topics[T].subscriptions == {}


def test_a_cold_since_older_than_its_unchanged_topic_is_a_deleted_topics_and_ignored() -> None:
    """A topic deleted while no controllerd ran leaves its cold-since keys; created again
    under the name, its segment ids start at 0 again. In a layout no split or merge has
    changed no segment inherited a cold-since, so one older than its segment is that
    leftover (kept, it would merge the new segment at once), whichever key loads first."""
    week_ago = NOW - 7 * 86_400_000
    layout = json.dumps(layout_to_json(initial_layout(2, now_ms=NOW))).encode()
    view = fresh()
    view.apply_put(KEYS.cold_since(T, 0), str(week_ago).encode(), 50, NOW)
    view.apply_put(KEYS.cold_since(T, 1), str(NOW + 5).encode(), 51, NOW)
    view.apply_put(KEYS.layout(T), layout, 52, NOW)
    assert view.topics[T].cold_since == {1: NOW + 5}
    view.apply_put(KEYS.cold_since(T, 0), str(week_ago).encode(), 53, NOW)
    assert view.topics[T].cold_since == {1: NOW + 5}
    view.apply_put(KEYS.cold_since(T, 0), str(NOW).encode(), 54, NOW)
    assert view.topics[T].cold_since == {0: NOW, 1: NOW + 5}


def test_malformed_or_invalid_layout_disables_the_topic_until_fixed() -> None:
    view = fresh()
    out = view.apply_put(KEYS.layout(T), b"{not json", 30, NOW)
    assert isinstance(out, Rejected) and out.kind == "layout"
    assert view.topics[T].layout is None and view.topics[T].layout_error
    broken = layout_to_json(initial_layout(2))
    broken["segments"]["1"]["hashRange"]["end"] = 0xFFFE  # leaves a gap
    out = view.apply_put(KEYS.layout(T), json.dumps(broken).encode(), 31, NOW)
    assert isinstance(out, Rejected) and "tile" in out.reason
    view.apply_put(KEYS.layout(T), layout_bytes(), 32, NOW)
    assert view.topics[T].layout is not None and view.topics[T].layout_revision == 32


def test_layout_update_forgets_loads_and_cold_since_of_pruned_segments() -> None:
    view = fresh()
    view.apply_put(KEYS.load(T, 0), load_bytes(changedAtMs=1), 40, NOW)
    view.apply_put(KEYS.cold_since(T, 0), b"1", 41, NOW)
    assert view.topics[T].cold_since == {0: 1}
    lay = split(initial_layout(2), 0, now_ms=5)
    pruned = {**layout_to_json(lay)}
    del pruned["segments"]["0"]
    for child in ("2", "3"):
        pruned["segments"][child]["parentIds"] = []
    view.apply_put(KEYS.layout(T), json.dumps(pruned).encode(), 42, NOW)
    assert 0 not in view.topics[T].loads and 0 not in view.topics[T].cold_since


def test_overrides_cooldowns_and_deletes() -> None:
    view = fresh()
    assert view.apply_put(KEYS.policy("acme"), b'{"maxSegments": 8}', 50, NOW) == Change(
        "policy", None, True
    )
    view.apply_put(KEYS.policy("acme", "ns"), b'{"maxSegments": 4}', 51, NOW)
    assert view.overrides_for(T) == ({"maxSegments": 8}, {"maxSegments": 4}, None)
    view.apply_put(KEYS.policy("acme", "ns", "orders"), b'{"maxSplitFanout": 2}', 51, NOW)
    assert view.overrides_for(T)[2] == {"maxSplitFanout": 2}
    view.apply_put(KEYS.cooldown(T), b'{"lastSplitAtMs": 7, "lastMergeAtMs": -1}', 52, NOW)
    assert view.topics[T].effective_cooldown() == Cooldown(7, -1)
    view.apply_delete(KEYS.cooldown(T))
    assert view.topics[T].cooldown is None
    view.apply_delete(KEYS.policy("acme"))
    assert view.overrides_for(T) == (None, {"maxSegments": 4}, {"maxSplitFanout": 2})
    assert view.apply_delete(KEYS.layout(T)) == Change("layout", T, False)
    assert T not in view.topics


def test_cooldown_seeded_from_the_layout() -> None:
    lay = split(initial_layout(2), 0, now_ms=1_000)
    assert seeded_cooldown(lay) == Cooldown(1_000, -1)
    view = fresh()
    assert view.topics[T].effective_cooldown() == Cooldown(-1, -1)


def test_stamps_from_a_clock_ahead_of_ours_count_as_of_when_they_came() -> None:
    """A broker a year ahead stamps its children a year ahead; taken as is, the merge
    cooldown held for that year. Each stamp counts at most as of when the value was
    applied (and a later leader's persisted stamp likewise)."""
    year = 365 * 86_400_000
    merged = merge(split(initial_layout(1), 0, now_ms=NOW - 1_000), 1, 2, now_ms=NOW + year)
    view = fresh()
    view.apply_put(KEYS.layout(T), orjson.dumps(layout_to_json(merged)), 60, NOW)
    assert view.topics[T].effective_cooldown() == Cooldown(NOW - 1_000, NOW)
    later = NOW + 5_000
    stamp = b'{"lastSplitAtMs": %d, "lastMergeAtMs": %d}' % (NOW + year, NOW + year)
    view.apply_put(KEYS.cooldown(T), stamp, 61, later)
    assert view.topics[T].effective_cooldown() == Cooldown(later, later)


_rates = st.builds(Rates, *[st.floats(0, 1e12, allow_nan=False)] * 4)
_ms = st.integers(0, 2**52)
_samples = st.builds(
    LoadSample,
    _rates,
    _ms,
    st.none() | _ms,
    st.none() | _ms,
    st.none() | st.tuples(st.floats(0, 1e6, allow_nan=False)),
    st.none() | _rates,
    st.integers(0, 100),
    st.none() | _ms,
)


@given(st.lists(st.tuples(st.integers(0, 40), _samples), max_size=20))
def test_a_load_table_gives_back_every_sample_it_holds(puts: list[tuple[int, LoadSample]]) -> None:
    table, expected = LoadTable(), {}
    for revision, (sid, sample) in enumerate(puts):
        table.put(sid, sample, revision)
        expected[sid] = sample
    assert table.samples() == expected


_table_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 20), _samples),
        st.tuples(st.just("remove"), st.integers(0, 20), st.none()),
        st.tuples(st.just("cold"), st.integers(0, 20), st.none() | _ms),
    ),
    max_size=40,
)


@given(_table_ops)
def test_a_load_table_reads_in_bulk_what_it_reads_one_by_one(
    ops: list[tuple[str, int, object]],
) -> None:
    """``samples`` and ``colds`` (one pass, for each evaluation) agree with a plain dict
    through puts, removals and cold-since changes, which a new record keeps."""
    table = LoadTable()
    samples: dict[int, LoadSample] = {}
    colds: dict[int, int] = {}
    for revision, (op, sid, arg) in enumerate(ops):
        if op == "put":
            assert isinstance(arg, LoadSample)
            table.put(sid, arg, revision)
            samples[sid] = arg
        elif op == "remove":
            table.remove(sid)
            samples.pop(sid, None)
            colds.pop(sid, None)
        else:
            assert arg is None or isinstance(arg, int)
            table.set_cold(sid, arg)
            if sid in samples and arg is not None:
                colds[sid] = arg
            else:
                colds.pop(sid, None)
    assert table.samples() == samples == {sid: table[sid] for sid in table}
    assert table.colds() == colds
    assert {sid: table.peek(sid) for sid in table} == {
        sid: (s.rates.as_tuple(), s.changed_at_ms, s.sampled_at_ms, colds.get(sid))
        for sid, s in samples.items()
    }
    assert {sid: table.cold(sid) for sid in samples if table.cold(sid) is not None} == colds


def test_a_plain_pulsar_record_is_packed_not_kept_as_an_object() -> None:
    """The point of the table (issue #12's memory budget): no object per plain record."""
    assert set(LoadSample.__slots__) == {  # a new field must be taught to _needs_extra
        "rates",
        "changed_at_ms",
        "sampled_at_ms",
        "cold_since_ms",
        "hash_buckets",
        "peak_rates",
        "flipflops",
        "last_flipflop_ms",
        "rise",
        "merged",
    }
    table = LoadTable()
    for sid in range(16):
        table.put(sid, LoadSample(Rates(1.0, 2.0, 3.0, 4.0), 5, None), sid)
    assert table._extra is None
    table.put(3, LoadSample(Rates(1.0, 2.0, 3.0, 4.0), 5, None, flipflops=1), 99)
    assert table._extra is not None and list(table._extra) == [3]
    table.put(5, LoadSample(Rates(1.0, 2.0, 3.0, 4.0), 5, None, rise=0.5), 100)
    assert table[5].rise == 0.5 and list(table._extra) == [3, 5]
    table.put(7, LoadSample(Rates(1.0, 2.0, 3.0, 4.0), 5, None, merged=4), 101)
    assert table[7].merged == 4 and list(table._extra) == [3, 5, 7]


# -- the table's two forms of ids: an array while small, a dict id -> slot past _INDEX_AT

_SPAN = 2 * _INDEX_AT + 40
"""Ids the model test draws from: enough rows to cross _INDEX_AT both ways."""
_rate = st.floats(0, 1e12, allow_nan=False)
_plain_loads = st.tuples(_rate, _rate, _rate, _rate, _ms, st.none() | _ms)
_JSON_VALUES = (
    load_bytes(1.0),  # plain, unstamped: changed when first seen
    load_bytes(2.0, sampledAtMs=NOW - 5),
    load_bytes(3.0, changedAtMs=NOW - 9, sampledAtMs=NOW - 2),
    load_bytes(4.0, flipflops=2),  # an extension: not plain, put_json declines it
    b"{",
)
_run = st.tuples(st.integers(_INDEX_AT // 4, _INDEX_AT + 40), st.integers(1, 3))  # count, step
_model_ops = st.lists(
    st.tuples(
        st.one_of(
            st.tuples(st.just("put"), _samples),
            st.tuples(st.just("put_plain"), _plain_loads),
            st.tuples(st.just("put_json"), st.sampled_from(_JSON_VALUES)),
            st.tuples(st.just("fill"), _run),  # put_plain over a run of ids
            st.tuples(st.just("fill"), _run),  # (twice: runs and relayouts are the point)
            st.tuples(st.just("drain"), _run),  # remove a run of ids
            st.tuples(st.just("relayout"), st.integers(0, _INDEX_AT)),  # keeps ids below it
            st.tuples(st.just("relayout"), st.integers(0, _INDEX_AT)),
            st.tuples(st.just("remove"), st.none()),
            st.tuples(st.just("set_cold"), st.none() | _ms),
            st.tuples(st.just("read"), st.none()),
        ),
        st.integers(0, _SPAN - 1),
        st.integers(0, 3),  # a revision: often the same one again, as a reload replays it
    ),
    min_size=5,
    max_size=60,
)


@dataclasses.dataclass
class _Record:
    """The model's row: what the table must give back for one segment."""

    sample: LoadSample
    revision: int
    cold: int | None = None


def _plain_sample(load: PlainLoad) -> LoadSample:
    a, b, c, d, changed, sampled = load
    return LoadSample(Rates(a, b, c, d), changed, sampled)


def _check_reads(table: LoadTable, model: dict[int, _Record], sid: int) -> None:
    """Every one-segment read of the table agrees with the model."""
    record = model.get(sid)
    assert (sid in table) is (record is not None)
    if record is None:
        assert table.revision(sid) is None and table.cold(sid) is None
        assert table.peek(sid) is None
        assert table.get(sid) is None  # Mapping.get: table[sid] raised KeyError
        return
    s = record.sample
    assert table.revision(sid) == record.revision and table.cold(sid) == record.cold
    assert table.peek(sid) == (s.rates.as_tuple(), s.changed_at_ms, s.sampled_at_ms, record.cold)
    assert table[sid] == s


def _check_form(table: LoadTable) -> None:
    """The invariants of the two forms of ids (see LoadTable's docstring)."""
    ids, rows = table._ids, len(table._revisions)
    assert len(table._rows) == rows * 7
    if isinstance(ids, dict):
        slots = list(ids.values())
        assert slots == sorted(set(slots)) and slots[-1] < rows  # distinct, in slot order
        assert len(ids) > _INDEX_AT // 2 and rows - len(ids) <= len(ids)
    else:
        assert len(ids) == rows <= _INDEX_AT


def _apply(
    table: LoadTable, model: dict[int, _Record], op: tuple[str, object], sid: int, rev: int
) -> None:
    """One operation on both the table and the model; checks what it answers."""
    name, arg = op
    if name == "put":
        assert isinstance(arg, LoadSample)
        table.put(sid, arg, rev)
        cold = model[sid].cold if sid in model else None
        model[sid] = _Record(arg, rev, cold)
    elif name in ("put_plain", "fill"):
        assert isinstance(arg, tuple)
        load: PlainLoad = (1.0, 2.0, 3.0, float(sid), NOW, None)
        sids = range(sid, sid + 1)
        if name == "fill":
            count, step = arg
            sids = range(sid, sid + count * step, step)
        else:
            load = cast(PlainLoad, arg)
        for each in sids:
            table.put_plain(each, load, rev)
            cold = model[each].cold if each in model else None
            model[each] = _Record(_plain_sample(load), rev, cold)
    elif name == "put_json":
        assert isinstance(arg, bytes)
        now = NOW + 1_000 * rev
        record = model.get(sid)
        plain = None
        if record is not None:
            seen = record.sample.changed_at_ms if record.revision == rev else now
            plain = plain_load_json(arg, seen)
        assert table.put_json(sid, arg, rev, now) is (plain is not None)
        if record is not None and plain is not None:
            model[sid] = _Record(_plain_sample(plain), rev, record.cold)
    elif name == "relayout":  # as a new layout drops the records of ids it lacks
        assert isinstance(arg, int)
        for each in [s for s in table if s >= arg]:
            table.remove(each)
        for each in [s for s in model if s >= arg]:
            del model[each]
    elif name in ("remove", "drain"):
        count, step = arg if isinstance(arg, tuple) else (1, 1)
        for each in range(sid, sid + count * step, step):
            table.remove(each)
            model.pop(each, None)
    elif name == "set_cold":
        assert arg is None or isinstance(arg, int)
        table.set_cold(sid, arg)
        if sid in model:
            model[sid].cold = arg
    _check_reads(table, model, sid)
    _check_form(table)
    assert len(table) == len(model) and list(table) == list(model)  # the same order


@given(_model_ops)
@example(  # up into a dict, compacted into a smaller dict, then into an array
    [
        (("fill", (104, 1)), 0, 1),
        (("set_cold", NOW - 7), 150, 1),
        (("fill", (104, 1)), 104, 2),
        (("drain", (104, 1)), 0, 3),
        (("put_json", _JSON_VALUES[1]), 150, 2),
        (("drain", (3, 1)), 104, 3),
        (("read", None), 150, 0),
        (("relayout", 10), 0, 0),
        (("read", None), 150, 0),
    ]
)
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
def test_a_load_table_of_any_size_agrees_with_a_dict(
    ops: list[tuple[tuple[str, object], int, int]],
) -> None:
    """Through any puts (full, plain, from bytes), removals and cold-since changes, the
    table answers every read as a dict of records would, in the dict's order, while
    runs of ids take it past _INDEX_AT rows (ids into a dict) and back (an array)."""
    table = LoadTable()
    model: dict[int, _Record] = {}
    for op, sid, rev in ops:
        _apply(table, model, op, sid, rev)
    for sid in range(_SPAN + 3 * (_INDEX_AT + 40)):
        _check_reads(table, model, sid)
    assert table.samples() == {sid: r.sample for sid, r in model.items()}
    assert list(table.samples()) == list(model)
    assert table.colds() == {sid: r.cold for sid, r in model.items() if r.cold is not None}
    assert list(table.items()) == [(sid, r.sample) for sid, r in model.items()]


def test_a_table_indexes_its_ids_only_past_the_threshold_and_drops_them_back() -> None:
    """A topic's usual table stays as compact as ever (issue #12); one holding records
    for unknown ids gets the dict, leaves dead rows behind its removals (no shifting,
    no index rewritten), and compacts them once they outnumber the live ones."""
    table = LoadTable()
    for sid in range(_INDEX_AT):
        table.put_plain(sid, (1.0, 2.0, 3.0, 4.0, NOW, None), sid)
    assert isinstance(table._ids, array)
    table.put_plain(1_000, (1.0, 2.0, 3.0, 4.0, NOW, None), 7)
    assert isinstance(table._ids, dict) and table._ids[1_000] == _INDEX_AT
    table.set_cold(1_000, NOW - 1)
    for sid in range(0, _INDEX_AT, 2):  # half of them: dead rows stay
        table.remove(sid)
    assert isinstance(table._ids, dict) and len(table._revisions) == _INDEX_AT + 1
    assert table.cold(1_000) == NOW - 1 and table.revision(1_000) == 7
    table.remove(1)  # now dead ones outnumber live ones: compacted, back to an array
    assert isinstance(table._ids, array) and len(table._revisions) == len(table) == _INDEX_AT // 2
    assert list(table) == [*range(3, _INDEX_AT, 2), 1_000]
    assert table.cold(1_000) == NOW - 1 and table.peek(1_000) is not None
    assert table.revision(1_000) == 7 and table.colds() == {1_000: NOW - 1}


def test_a_table_in_either_form_refuses_an_id_past_64_bits() -> None:
    """The dict form refuses (and normalises) ids as the array form does."""
    small, large = LoadTable(), LoadTable()
    for sid in range(100, 101 + _INDEX_AT):
        large.put_plain(sid, (1.0, 2.0, 3.0, 4.0, NOW, None), sid)
    assert isinstance(large._ids, dict)
    for table in (small, large):
        before = list(table)
        for bad in (2**63, -(2**63) - 1):
            with pytest.raises(OverflowError):
                table.put_plain(bad, (1.0, 2.0, 3.0, 4.0, NOW, None), 1)
        with pytest.raises(TypeError):
            table.put_plain(1.5, (1.0, 2.0, 3.0, 4.0, NOW, None), 1)  # type: ignore[arg-type]
        assert list(table) == before
        table.put_plain(True, (1.0, 2.0, 3.0, 4.0, NOW, None), 1)  # stored as 1
        assert list(table) == [*before, 1] and type(list(table)[-1]) is int


_RECORD_KEYS = (
    "msgRateIn",
    "byteRateIn",
    "bytesRateIn",
    "msgRateOut",
    "byteRateOut",
    "bytesRateOut",
    "sampledAtMs",
    "changedAtMs",
    "coldSinceMs",
    "flipflops",
    "rise",
    "hashBuckets",
    "brokerName",
)
_json_scalars = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(0, 1e9),
    st.integers(-(2**63), 2**63 - 1),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)


def _agrees_with_the_full_parse(value: bytes, seen: int) -> bool:
    """``plain_load_json`` reads ``value`` exactly as the full parse does, or leaves it
    to it: never a different value, never a record the full parse rejects. True when
    it read it."""
    row = plain_load_json(value, seen)
    if row is None:
        return False
    sample = load_sample_from_json(orjson.loads(value), seen_at_ms=seen)
    assert (sample.cold_since_ms, sample.hash_buckets, sample.flipflops) == (None, None, 0)
    assert (sample.peak_rates, sample.last_flipflop_ms) == (None, None)
    assert row == (*sample.rates.as_tuple(), sample.changed_at_ms, sample.sampled_at_ms)
    assert all(type(rate) is float for rate in row[:4])
    return True


_numbers = st.one_of(
    st.floats(0, 1e12), st.integers(0, 2**64), st.floats(), st.integers(-5, 5), st.booleans()
)
_stamps = st.one_of(st.integers(-(2**63), 2**64), st.floats(0, 2**53), st.none())
#: Records close to the common shape, so that many take the fast read.
_plausible = st.fixed_dictionaries(
    {name: _numbers for name in ("msgRateIn", "bytesRateIn", "msgRateOut", "bytesRateOut")},
    optional={
        "byteRateIn": _numbers,
        "byteRateOut": _numbers,
        "sampledAtMs": _stamps,
        "changedAtMs": _stamps,
        "coldSinceMs": _stamps,
        "flipflops": _stamps,
    },
)


@given(st.dictionaries(st.sampled_from(_RECORD_KEYS), _json_scalars) | _plausible, _ms)
def test_the_fast_read_of_a_load_record_agrees_with_the_full_parse(
    record: dict[str, object], seen: int
) -> None:
    try:
        value = orjson.dumps(record)
    except orjson.JSONEncodeError:  # NaN and infinities: JSON has none
        value = json.dumps(record).encode()
    _agrees_with_the_full_parse(value, seen)


@given(
    st.lists(
        st.tuples(
            st.sampled_from([k.encode() for k in _RECORD_KEYS] + [b"x\xff", b"\xc0\xaf"]),
            st.sampled_from(
                [
                    "1" + "0" * 309,
                    "-9223372036854775809",
                    "1",
                    "1.5",
                    "-0.0",
                    "0",
                    "1e308",
                    "1e309",
                    "18446744073709551616",
                    "100000000000000000000000000000",
                    "9007199254740993",
                    "true",
                    "null",
                    '"1"',
                    "[]",
                    "{}",
                    "NaN",
                    "-1",
                    "1.0e2",
                    "5.0",
                ]
            ),
        ),
        max_size=10,
    ),
    st.sampled_from(["", " ", "\n", "x", ",", "\ufeff"]),
    _ms,
)
def test_the_fast_read_agrees_on_raw_json_text(
    members: list[tuple[bytes, str]], around: str, seen: int
) -> None:
    """Text orjson.dumps never writes: repeated keys, keys that are not UTF-8, big and
    odd literals, stray bytes."""
    text = b"{" + b",".join(b'"' + k + b'":' + v.encode() for k, v in members) + b"}"
    for value in (text, around.encode() + text, text + around.encode()):
        try:
            orjson.loads(value)
        except orjson.JSONDecodeError:
            assert plain_load_json(value, seen) is None
            continue
        _agrees_with_the_full_parse(value, seen)


def test_pulsar_and_reporter_records_take_the_fast_read() -> None:
    rates = {"msgRateIn": 1.5, "bytesRateIn": 2.0, "msgRateOut": 0.0, "bytesRateOut": 4.0}
    assert plain_load_json(orjson.dumps(rates), 7) == (1.5, 2.0, 0.0, 4.0, 7, None)
    stamped = {**rates, "byteRateIn": 3.0, "sampledAtMs": 9, "changedAtMs": 8}
    assert plain_load_json(orjson.dumps(stamped), 7) == (1.5, 3.0, 0.0, 4.0, 8, 9)
    assert plain_load_json(b'{"msgRateIn":1,"x\xff":1}', 7) is None  # not UTF-8
    with_ints = {**rates, "msgRateIn": 2}  # what json.dumps of a Java double 2.0 is not
    assert plain_load_json(orjson.dumps(with_ints), 7) == (2.0, 2.0, 0.0, 4.0, 7, None)
    assert plain_load_json(orjson.dumps({**rates, "flipflops": 0}), 7) is None  # extension
    assert plain_load_json(orjson.dumps({**rates, "brokerName": "b"}), 7) is None  # unknown
    view = fresh()
    view.apply_put(KEYS.load(T, 0), orjson.dumps(stamped), 11, NOW)
    assert view.topics[T].loads[0] == load_sample_from_json(stamped)
    assert view.topics[T].loads._extra is None


def test_with_cold_since_and_with_history_are_replace_on_every_field() -> None:
    """The evaluation's fast path must keep every field, including any added later."""
    full = LoadSample(
        Rates(1.0, 2.0, 3.0, 4.0),
        changed_at_ms=5,
        sampled_at_ms=6,
        cold_since_ms=7,
        hash_buckets=(0.25, 0.75),
        peak_rates=Rates(8.0, 9.0, 10.0, 11.0),
        flipflops=12,
        last_flipflop_ms=13,
        rise=14.0,
        merged=15,
    )
    defaults = LoadSample(Rates(1.0, 2.0, 3.0, 4.0), changed_at_ms=5)
    for fields_set, sample in (("all", full), ("defaults", defaults)):
        assert sample.with_cold_since(99) == dataclasses.replace(sample, cold_since_ms=99), (
            fields_set
        )
        peak = Rates(20.0, 21.0, 22.0, 23.0)
        assert sample.with_history(peak, 24, 25, 26.0, 27) == dataclasses.replace(
            sample, peak_rates=peak, flipflops=24, last_flipflop_ms=25, rise=26.0, merged=27
        ), fields_set
    assert all(getattr(full, f.name) != f.default for f in dataclasses.fields(LoadSample)), (
        "give every field a non-default value above"
    )


_HEAD = "/pulsar/topics/acme/ns/"
#: Layout keys, among them names that make ``/segments/`` and decoding tricky: a topic
#: called ``segments``, a percent-encoded one, another spelling of it, and bytes
#: that are not UTF-8.
_TOPIC_KEYS = (
    f"{_HEAD}orders".encode(),
    f"{_HEAD}segments".encode(),
    f"{_HEAD}a%3Ab".encode(),
    f"{_HEAD}a:b".encode(),
    f"{_HEAD}bad\xff".encode("latin-1"),
)
_TAILS = ("/segments/0/load", "/segments/1/load", "/segments/01/load", "/segments/x/load", "")
_EVENT_VALUES = (
    load_bytes(1.0),
    load_bytes(9_000.0),
    orjson.dumps({"msgRateIn": 2.0, "bytesRateIn": 1.0, "msgRateOut": 0.5, "bytesRateOut": 3.0}),
    load_bytes(3.0, flipflops=2),
    load_bytes(4.0, sampledAtMs=NOW - 5),
    b'{"msgRateIn": -1.0}',
    b"{",
    layout_bytes(2),
    layout_bytes(4),
)
_events = st.lists(
    st.tuples(
        st.booleans() | st.just(True),
        st.sampled_from(_TOPIC_KEYS),
        st.sampled_from(_TAILS),
        st.sampled_from(_EVENT_VALUES),
        st.integers(0, 3),
    ),
    max_size=40,
)


def _view_state(view: MetadataView) -> dict[TopicName, object]:
    return {
        name: (
            state.layout,
            state.layout_revision,
            state.layout_error,
            state.subscriptions,
            state.consumers,
            {sid: (state.loads[sid], state.loads.revision(sid)) for sid in state.loads},
            state.loads._extra,
            state.version,
        )
        for name, state in view.topics.items()
    }


@given(_events, st.integers(1, 7))
def test_applying_watched_events_in_bulk_is_applying_them_one_by_one(
    steps: list[tuple[bool, bytes, str, bytes, int]], chunk: int
) -> None:
    """``apply_events`` (bytes keys, the load fast path) ends in the same view and says
    the same outcomes as ``apply_put``/``apply_delete`` of each decoded key; with
    ``note_load``, that one hears the fast path's load changes, with their live state."""
    events: list[tuple[bool, bytes, bytes, int]] = []
    revision = 10
    for put, head, tail, value, bump in steps:
        revision += bump  # 0: the same revision again, as a reload replays it
        events.append((put, head + tail.encode(), value if put else b"", revision))
    bulk, single, hooked = MetadataView(KEYS), MetadataView(KEYS), MetadataView(KEYS)
    said: list[object] = []
    heard: list[object] = []

    def note_load(state: TopicState, segment: int) -> None:
        assert hooked.topics.get(state.name) is state and not state.dropped
        heard.append(Change("load", state.name, True, segment))

    for start in range(0, len(events), chunk):
        bulk.apply_events(events[start : start + chunk], NOW + start, said.append)
        hooked.apply_events(events[start : start + chunk], NOW + start, heard.append, note_load)
    expected: list[object] = []
    for i, (put, key, value, rev) in enumerate(events):
        text = key.decode(errors="replace")
        now = NOW + i // chunk * chunk
        expected.append(
            single.apply_put(text, value, rev, now) if put else single.apply_delete(text)
        )
    assert said == expected
    assert heard == expected
    assert _view_state(bulk) == _view_state(single) == _view_state(hooked)


def test_a_load_key_applied_before_takes_the_fast_path_until_its_topic_is_deleted() -> None:
    view = fresh()
    key = KEYS.load(T, 1).encode()
    full: list[str] = []
    apply_put = view.apply_put

    def counted(k: str, value: bytes, revision: int, now_ms: int) -> object:
        full.append(k)
        return apply_put(k, value, revision, now_ms)

    view.apply_put = counted  # type: ignore[method-assign,assignment]
    said: list[object] = []
    view.apply_events([(True, key, load_bytes(1.0), 11)], NOW, said.append)
    view.apply_events([(True, key, load_bytes(2.0), 12)], NOW, said.append)
    assert full == [KEYS.load(T, 1)]  # the second one never reached the full path
    assert said == [Change("load", T, True, 1)] * 2
    assert view.topics[T].loads[1].rates.msg_rate_in == 2.0
    view.apply_events([(False, KEYS.layout(T).encode(), b"", 13)], NOW, said.append)
    view.apply_events([(True, key, load_bytes(3.0), 14)], NOW, said.append)
    assert full[-1] == KEYS.load(T, 1)  # a deleted topic's keys take the full path again
    assert view.topics[T].loads[1].rates.msg_rate_in == 3.0


def test_a_deleted_topic_is_not_written_through_another_spelling_of_its_key() -> None:
    """``a%3Ab`` and ``a:b`` name one topic; deleting it by one spelling leaves the
    other's fast-path entry behind, and that entry must not feed the dropped state."""
    view = MetadataView(KEYS)
    encoded, plain = (f"{_HEAD}{name}" for name in ("a%3Ab", "a:b"))
    view.apply_put(encoded, layout_bytes(), 10, NOW)
    first = (True, f"{plain}/segments/0/load".encode(), load_bytes(1.0), 11)
    view.apply_events([first], NOW, lambda _: None)
    (name,) = view.topics
    dropped = view.topics[name]
    view.apply_delete(encoded)
    said: list[object] = []
    view.apply_events(
        [(True, f"{plain}/segments/0/load".encode(), load_bytes(2.0), 12)], NOW, said.append
    )
    assert dropped.loads[0].rates.msg_rate_in == 1.0
    assert view.topics[name] is not dropped
    assert view.topics[name].loads[0].rates.msg_rate_in == 2.0
    assert said == [Change("load", name, True, 0)]


def test_a_bad_record_on_the_fast_path_is_rejected_as_on_the_full_path() -> None:
    """Values msgspec fails on otherwise than orjson (a key that is not UTF-8, a time
    stamp that overflows a double) once escaped ``apply_events``, and one left the
    row half written: now they take the full path and are rejected there."""
    key = KEYS.load(T, 1)
    rates = b'"msgRateIn":5.0,"byteRateIn":1.0,"msgRateOut":1.0,"byteRateOut":1.0'
    for bad in (
        b"{" + rates + b',"x\xff":1}',
        b"{" + rates + b',"changedAtMs":1' + b"0" * 309 + b"}",
    ):
        bulk, single = fresh(), fresh()
        said: list[object] = []
        bulk.apply_events([(True, key.encode(), load_bytes(1.0), 11)], NOW, said.append)
        single.apply_put(key, load_bytes(1.0), 11, NOW)
        bulk.apply_events([(True, key.encode(), bad, 12)], NOW, said.append)
        expected = single.apply_put(key, bad, 12, NOW)
        assert isinstance(expected, Rejected) and said[-1] == expected
        assert 1 not in bulk.topics[T].loads and 1 not in single.topics[T].loads
        assert _view_state(bulk) == _view_state(single)


def test_a_history_the_caller_writes_comes_back_without_replacing_the_one_it_holds() -> None:
    """The leader writes history behind: an echo of an older write must not undo a newer
    range it holds (a second merge's); a history it does not write is applied."""
    view = fresh()
    old = json.dumps({"4": {"flipflops": 0, "merged": 2, "mergedMs": NOW}}).encode()
    held = {"4": {"merged": 2}, "5": {"merged": 2}}
    view.apply_put(KEYS.history(T), old, 11, NOW)
    state = view.topics[T]
    assert state.history is not None and set(state.history.to_json()) == {"4"}
    view.writes_state = lambda topic: topic == T
    mine = TopicHistory.from_json({k: {**v, "mergedMs": NOW} for k, v in held.items()})
    state.history = mine
    assert view.apply_put(KEYS.history(T), old, 12, NOW) == Change("history", T, False)
    assert state.history is mine and set(mine.to_json()) == {"4", "5"}
    assert view.apply_delete(KEYS.history(T)) == Change("history", T, False)
    assert state.history is mine
    view.writes_state = lambda topic: False
    view.apply_put(KEYS.history(T), old, 14, NOW)
    assert state.history is not mine and set(state.history.to_json()) == {"4"}
    view.apply_delete(KEYS.history(T))
    assert state.history is None


def test_a_cold_since_the_caller_writes_comes_back_without_undoing_what_it_holds() -> None:
    """A segment cold, then warm again, before the put's echo arrives: the echo must not
    bring back the old start of its cold window (the next cold spell would count from
    it); a cold-since the caller does not write (a predecessor's) is applied."""
    view = fresh()
    view.writes_state = lambda topic: topic == T
    state = view.topic(T)
    assert view.apply_put(KEYS.cold_since(T, 4), b"1000", 11, NOW) == Change("cold", T, False)
    assert state.cold_since == {}
    state.cold_since[5] = 2000
    assert view.apply_delete(KEYS.cold_since(T, 5)) == Change("cold", T, False)
    assert state.cold_since == {5: 2000}
    view.writes_state = lambda topic: False
    view.apply_put(KEYS.cold_since(T, 4), b"1000", 13, NOW)
    assert state.cold_since == {4: 1000, 5: 2000}
    view.apply_delete(KEYS.cold_since(T, 5))
    assert state.cold_since == {4: 1000}


def _held_view() -> MetadataView:
    """Topics put in an order their keys do not sort in, each with every kind of key;
    one known only through our keys, one only through a load; overrides and a pending
    delete."""
    view = MetadataView(KEYS)
    cooldown = b'{"lastSplitAtMs": 1, "lastMergeAtMs": -1}'
    history = json.dumps({"1": {"flipflops": 0, "merged": 2, "mergedMs": NOW}}).encode()
    revision = 10
    for name in ("zeta", "orders", "a-2", "a", "mid"):
        topic = TopicName("acme", "ns", name)
        for key, value in (
            (KEYS.layout(topic), layout_bytes()),
            (KEYS.subscription(topic, "s"), b'{"type": "STREAM"}'),
            (KEYS.consumer(topic, "s", "c2"), b"{}"),
            (KEYS.consumer(topic, "s", "c1"), b"{}"),
            (KEYS.load(topic, 1), load_bytes()),
            (KEYS.load(topic, 0), load_bytes()),
            (KEYS.cooldown(topic), cooldown),
            (KEYS.cold_since(topic, 1), str(NOW).encode()),
            (KEYS.history(topic), history),
        ):
            revision += 1
            assert isinstance(view.apply_put(key, value, revision, NOW), Change), key
    ours = TopicName("acme", "ns", "ours-only")
    view.apply_put(KEYS.cold_since(ours, 0), str(NOW).encode(), 100, NOW)
    view.apply_put(KEYS.cooldown(ours), cooldown, 101, NOW)
    view.apply_put(KEYS.history(ours), history, 102, NOW)
    view.apply_put(KEYS.load(TopicName("acme", "ns", "load-only"), 0), load_bytes(), 103, NOW)
    view.apply_put(KEYS.policy("acme", "ns"), b'{"min_segments": 1}', 104, NOW)
    view.apply_put(KEYS.policy("acme"), b"{}", 105, NOW)
    marker = {"topic": str(T), "descriptor": "0000-7fff-3", "segmentId": 3, "prunedAtMs": NOW}
    pending = KEYS.pending_delete(T, "0000-7fff-3")
    assert isinstance(view.apply_put(pending, json.dumps(marker).encode(), 106, NOW), Change)
    return view


def _held_state(view: MetadataView) -> object:
    own = {
        name: (
            state.cooldown,
            state.cold_since,
            None if state.history is None else state.history.to_json(),
            state.dropped,
        )
        for name, state in view.topics.items()
    }
    return _view_state(view), own, view.overrides, view.pending_deletes


def test_the_held_keys_come_in_slices_of_bounded_work_whatever_the_topics_hold() -> None:
    """A reload lists what the view holds and yields to the loop between slices. Counted
    in keys, a walk of 100,000 topics for the controller's own keys, which few have,
    listed none and never yielded (0.2 s in one go): a topic looked at counts too."""
    view = MetadataView(KEYS)
    for i in range(1000):
        view.apply_put(KEYS.layout(TopicName("acme", "ns", f"t{i}")), layout_bytes(), i + 1, NOW)
    slices = list(view.keys_held_in_slices(KEYS.controller_prefix, 50))
    assert len(slices) >= 1000 // 50
    assert not any(slices)
    slices = list(view.keys_held_in_slices(KEYS.topics_prefix, 50))
    assert len(slices) >= 1000 * 2 // 50  # a topic looked at and its layout key listed
    assert all(len(keys) <= 50 for keys in slices)
    listed = [key for keys in slices for key in keys]
    assert listed == list(view.keys_held(KEYS.topics_prefix))
    assert len(set(listed)) == 1000
    with pytest.raises(ValueError, match="size"):
        next(view.keys_held_in_slices(KEYS.topics_prefix, 0))


def test_in_the_held_listing_reversed_a_topics_layout_key_comes_after_its_other_keys() -> None:
    """The reload deletes what etcd lost in the listing's order reversed (it used to sort
    them: 0.8 s at 700,000 keys, in one go); a layout's deletion drops its topic."""
    view = _held_view()
    backwards = list(view.keys_held(KEYS.topics_prefix))[::-1]
    # five whole topics; ours-only and load-only: a layout key (not held), and the load
    assert len(backwards) == 5 * 6 + 1 + 2
    for name in view.topics:
        layout = KEYS.layout(name)
        children = [i for i, key in enumerate(backwards) if key.startswith(layout + "/")]
        assert max(children, default=-1) < backwards.index(layout), name
    everything = list(view.keys_held("/"))
    assert len(everything) == len(set(everything)) == len(backwards) + 6 * 3 + 2 + 1


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_deleting_held_keys_in_the_listing_reversed_is_deleting_them_sorted_backwards(
    data: st.DataObject,
) -> None:
    """Whatever etcd lost, the listing's order reversed ends in the view the old order
    (the keys sorted, backwards) ended in, with the same changes reported."""
    for prefix in (KEYS.topics_prefix, KEYS.controller_prefix):
        listed = list(_held_view().keys_held(prefix))
        gone = data.draw(st.sets(st.sampled_from(listed)), label=prefix)
        reversed_view, sorted_view = _held_view(), _held_view()
        said = [reversed_view.apply_delete(key) for key in reversed(listed) if key in gone]
        expected = [sorted_view.apply_delete(key) for key in sorted(gone, reverse=True)]
        assert sorted(map(repr, said)) == sorted(map(repr, expected))
        assert _held_state(reversed_view) == _held_state(sorted_view)
