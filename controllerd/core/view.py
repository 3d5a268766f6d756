"""The controller's in-memory mirror of etcd: key layout, parsed topic state, triggers.

Pure (no I/O): the daemon feeds it every key of the initial load and then every
watch event; it answers what changed and whether that change asks for an
evaluation. Every replica keeps one, leader or not (a hot standby acts at once).

**One parsing boundary.** Every value read from etcd goes through
:meth:`MetadataView.apply_put`, which turns *any* failure to use it (bad JSON,
wrong types, overflowing numbers, deep nesting, an invariant broken) into a
:class:`Rejected` naming the key kind and the reason, never an exception: one
poison value must not stop the load, the watch, or the other topics (issue #10).
A rejected value is forgotten, never half-applied: a topic whose layout is
rejected has no layout (nothing acts on it) until a valid one arrives; a
rejected load record leaves the segment without load (never cold, never hot);
a rejected cooldown falls back to the one seeded from the layout.

Topic names appear in keys as Pulsar writes them, ``Codec.encode``-d (URL
encoding), and are decoded exactly once when a key is read, so a name like
``orders:eu`` is never encoded twice on its way to a REST path.

Keys (DESIGN §3), ``M`` = metadata prefix, ``C`` = controller root::

    M/topics/<t>/<ns>/<topic>                                  layout JSON
    M/topics/<t>/<ns>/<topic>/subscriptions/<sub>              {"type": ...}
    M/topics/<t>/<ns>/<topic>/subscriptions/<sub>/consumers/<c> registration
    M/topics/<t>/<ns>/<topic>/segments/<id>/load               load record
    M/admin/policies/<t>/<ns>                                  Pulsar namespace policies
    C/leader  C/cooldowns/<topic>  C/policies/<t>[/<ns>[/<topic>]]
    C/cold-since/<topic>/<id>  C/pending-deletes/<topic>/<descriptor>
    C/history/<topic>                                          flip-flops, peaks, rises
    C/members/<replica>  C/shards/<nnnn>                       (sharded mode)
"""

from __future__ import annotations

import math
import operator
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

import orjson

from controllerd.core.layout import check
from controllerd.core.model import (
    SUBSCRIPTION_TYPES,
    Layout,
    LoadSample,
    ModelError,
    PlainLoad,
    Rates,
    TopicName,
    layout_from_json,
    load_sample_from_json,
    plain_load_json,
)
from controllerd.core.policy import TopicHistory
from controllerd.core.pulsar import (
    NAMESPACE_POLICIES_ROOT,
    NamespacePolicies,
    encode_topic_name,
    parse_namespace_policies,
    topic_from_key,
)

ChangeKind = Literal[
    "layout",
    "subscription",
    "consumer",
    "load",
    "policy",
    "cooldown",
    "cold",
    "pending-delete",
    "history",
]

KEY_KINDS: Final = (
    "layout",
    "load",
    "subscription",
    "consumer",
    "policy",
    "cooldown",
    "cold_since",
    "pending_delete",
    "history",
    "pulsar_policy",
    "member",
    "other",
)
"""Label values of the rejection counter: every kind of key we parse."""

#: Longest reason kept in a Rejected (a reason can quote the value).
REASON_LIMIT: Final = 300
#: The type of a subscription whose value the view could not read (a rejection): kept
#: so GC still asks for its backlog; its consumers count as a stream's.
UNKNOWN_TYPE: Final = "UNKNOWN"
#: Largest integer accepted for a time stamp or id (Java's long, as Pulsar writes them).
_LONG_MAX: Final = 2**63 - 1
_DESCRIPTOR: Final = re.compile(r"[0-9a-f]{4}-[0-9a-f]{4}-\d{1,19}")


@dataclass(frozen=True, slots=True)
class Keys:
    """Builds and parses every etcd key controllerd reads or writes."""

    metadata_prefix: str
    controller_root: str

    @property
    def topics_prefix(self) -> str:
        return f"{self.metadata_prefix}/topics/"

    @property
    def pulsar_policies_prefix(self) -> str:
        """Pulsar's namespace policies (``Policies`` records), beside its topics."""
        return f"{self.metadata_prefix}{NAMESPACE_POLICIES_ROOT}/"

    def layout(self, topic: TopicName) -> str:
        return f"{self.topics_prefix}{key_path(topic)}"

    def subscription(self, topic: TopicName, sub: str) -> str:
        return f"{self.layout(topic)}/subscriptions/{sub}"

    def consumer(self, topic: TopicName, sub: str, name: str) -> str:
        return f"{self.subscription(topic, sub)}/consumers/{name}"

    def load(self, topic: TopicName, segment_id: int) -> str:
        return f"{self.layout(topic)}/segments/{segment_id}/load"

    @property
    def leader(self) -> str:
        return f"{self.controller_root}/leader"

    @property
    def controller_prefix(self) -> str:
        return f"{self.controller_root}/"

    def cooldown(self, topic: TopicName) -> str:
        return f"{self.controller_root}/cooldowns/{key_path(topic)}"

    def policy(self, tenant: str, namespace: str | None = None, topic: str | None = None) -> str:
        """Our override for a tenant, a namespace or (with ``topic``) one topic."""
        suffix = f"/{namespace}" if namespace else ""
        if topic:
            suffix += f"/{encode_topic_name(topic)}"
        return f"{self.controller_root}/policies/{tenant}{suffix}"

    def cold_since(self, topic: TopicName, segment_id: int) -> str:
        return f"{self.cold_since_prefix(topic)}{segment_id}"

    def cold_since_prefix(self, topic: TopicName) -> str:
        """Every cold-since key of ``topic`` starts with this (and no other topic's)."""
        return f"{self.controller_root}/cold-since/{key_path(topic)}/"

    def history(self, topic: TopicName) -> str:
        """The topic's :class:`~controllerd.core.policy.TopicHistory` (flip-flops, peaks)."""
        return f"{self.controller_root}/history/{key_path(topic)}"

    @property
    def pending_deletes_prefix(self) -> str:
        return f"{self.controller_root}/pending-deletes/"

    def pending_delete(self, topic: TopicName, descriptor: str) -> str:
        return f"{self.pending_deletes_prefix}{key_path(topic)}/{descriptor}"

    @property
    def members_prefix(self) -> str:
        return f"{self.controller_root}/members/"

    def member(self, replica: str) -> str:
        return f"{self.members_prefix}{replica}"

    @property
    def shards_prefix(self) -> str:
        return f"{self.controller_root}/shards/"

    def shard(self, name: str) -> str:
        """The leader key of one shard (``name``: see ``core.shards.shard_name``)."""
        return f"{self.shards_prefix}{name}"


def key_path(topic: TopicName) -> str:
    """``tenant/namespace/<encoded topic>``: a topic as every key names it."""
    return f"{topic.tenant}/{topic.namespace}/{encode_topic_name(topic.topic)}"


@dataclass(frozen=True, slots=True)
class Cooldown:
    """When the last split/merge the broker confirmed happened (-1: never)."""

    last_split_ms: int = -1
    last_merge_ms: int = -1

    def to_json(self) -> dict[str, int]:
        return {"lastSplitAtMs": self.last_split_ms, "lastMergeAtMs": self.last_merge_ms}

    def no_later_than(self, cap_ms: int | None) -> Cooldown:
        """Each stamp, but at most ``cap_ms`` (None: as is)."""
        if cap_ms is None or (self.last_split_ms <= cap_ms and self.last_merge_ms <= cap_ms):
            return self
        return Cooldown(min(self.last_split_ms, cap_ms), min(self.last_merge_ms, cap_ms))

    def newest(self, other: Cooldown) -> Cooldown:
        """Field by field, the later stamp of the two."""
        return Cooldown(
            max(self.last_split_ms, other.last_split_ms),
            max(self.last_merge_ms, other.last_merge_ms),
        )


def seeded_cooldown(layout: Layout) -> Cooldown:
    """Cooldown stamps derived from a layout.

    A split child has one parent and a merge child two; the newest of each
    kind still in the layout dates the last operation of that kind, whoever
    did it (us, or an operator with ``pulsar-admin``).
    """
    last_split = last_merge = -1
    for seg in layout.segments.values():
        if len(seg.parent_ids) == 1:
            last_split = max(last_split, seg.created_at_ms)
        elif len(seg.parent_ids) >= 2:
            last_merge = max(last_merge, seg.created_at_ms)
    return Cooldown(last_split, last_merge)


@dataclass(frozen=True, slots=True)
class PendingDelete:
    """A segment our GC pruned from the layout whose data is not yet deleted."""

    topic: TopicName
    descriptor: str
    segment_id: int
    pruned_at_ms: int


_NAN: Final = math.nan
_STRIDE: Final = 7
"""Doubles per segment row: msg in, byte in, msg out, byte out, changed ms, sampled ms,
and the cold-since the controller holds in memory for the segment (NaN: none)."""
_COLD: Final = 6
_INDEX_AT: Final = 64
"""Rows past which a :class:`LoadTable` keeps its ids in a dict (id -> slot) instead
of an array, so a lookup stops scanning them. Topics have 1 to 64 segments and keep
the array (8 bytes an id); a topic past it holds records for ids its layout does not
have, kept until its next layout (tens of thousands took 42 s to load, scanned)."""


Peek = tuple[tuple[float, float, float, float], int, int | None, int | None]
"""The four rates, changed ms, sampled ms and held cold-since ms of one record."""


class _Index(dict[int, int]):
    """A large :class:`LoadTable`'s ids: id -> slot, in ascending slot order. It
    answers what the small tables' ``array('q')`` of ids answers (``index``,
    ``tolist``), so a lookup takes no branch on the form and costs a small table
    nothing more than it did."""

    __slots__ = ()

    def index(self, segment_id: int) -> int:
        """The slot of ``segment_id``; ValueError without one, as ``array.index``."""
        slot = self.get(segment_id, -1)
        if slot < 0:
            raise ValueError(segment_id)
        return slot

    def tolist(self) -> list[int]:
        return list(self)

    def slots(self) -> Iterator[tuple[int, int]]:
        """(slot, id) of every live row, in slot order (as ``enumerate`` of an array)."""
        return zip(self.values(), self, strict=True)


class LoadTable(Mapping[int, LoadSample]):
    """A topic's load records, packed into arrays: one row of doubles per segment.

    About 70 bytes a segment instead of about 400 as objects (issue #12:
    100,000 topics x 16 segments must fit in 1.5 GB). Time stamps are whole
    milliseconds, exact in a double up to 2**53. ``revisions`` holds each
    record's etcd mod revision, for the first-seen fallback of records
    without time stamps. Rare extras (a record's own ``coldSinceMs``) live
    in a small dict. Reading a row builds a :class:`LoadSample`.

    Each row also carries the cold-since the controller derived for the
    segment and holds in memory (:meth:`cold`, :meth:`set_cold`); a new
    record for the segment keeps it.

    The ids take one of two forms, and every public behaviour is the same in both:

    * at most :data:`_INDEX_AT` rows: an ``array('q')`` holding the id of slot ``i``
      at ``i`` (8 bytes a row, no dict: a lookup scans it);
    * more: a dict id -> slot, whose order is ascending slot order (a lookup is
      O(1)). A removed row stays in the arrays, unreferenced, until the dead rows
      outnumber the live ones; they are then compacted away in one pass, live
      rows kept in order, back into the array form at or under :data:`_INDEX_AT`
      rows. So dead rows never outnumber live ones, a dict-form table holds more
      than half :data:`_INDEX_AT` live rows, and each operation is O(1) amortised.

    Either way ids iterate in slot order: the order they were first put since they
    were last removed.
    """

    __slots__ = ("_extra", "_ids", "_revisions", "_rows")

    def __init__(self) -> None:
        self._ids: array[int] | _Index = array("q")
        self._rows = array("d")
        self._revisions = array("q")
        self._extra: dict[int, LoadSample] | None = None

    def _slot(self, segment_id: int) -> int:
        try:
            return self._ids.index(segment_id)
        except ValueError:
            return -1

    def revision(self, segment_id: int) -> int | None:
        slot = self._slot(segment_id)
        return None if slot < 0 else self._revisions[slot]

    def put(self, segment_id: int, sample: LoadSample, revision: int) -> None:
        r = sample.rates
        self.put_plain(
            segment_id,
            (
                r.msg_rate_in,
                r.byte_rate_in,
                r.msg_rate_out,
                r.byte_rate_out,
                sample.changed_at_ms,
                sample.sampled_at_ms,
            ),
            revision,
        )
        if _needs_extra(sample):
            if self._extra is None:
                self._extra = {}
            self._extra[segment_id] = sample

    def put_plain(self, segment_id: int, load: PlainLoad, revision: int) -> None:
        """Store a record with no extension (:func:`plain_load_json`); keeps the held cold-since."""
        self._store_at(self._slot(segment_id), segment_id, load, revision)

    def _store_at(self, slot: int, segment_id: int, load: PlainLoad, revision: int) -> None:
        """Write ``load`` into row ``slot`` (-1: a new row). Every value is converted
        before any is written, so a failure never leaves a row half written."""
        a, b, c, d, changed, sampled = load
        changed_at, sampled_at = float(changed), _NAN if sampled is None else float(sampled)
        if slot < 0:
            ids = self._ids
            if isinstance(ids, _Index):
                key, slot = _as_id(segment_id), len(self._revisions)
                self._rows.extend((a, b, c, d, changed_at, sampled_at, _NAN))
                self._revisions.append(revision)
                ids[key] = slot
            else:
                ids.append(segment_id)
                self._rows.extend((a, b, c, d, changed_at, sampled_at, _NAN))
                self._revisions.append(revision)
                if len(ids) > _INDEX_AT:
                    self._ids = _Index(zip(ids, range(len(ids)), strict=True))
        else:
            rows, base = self._rows, slot * _STRIDE
            rows[base] = a
            rows[base + 1] = b
            rows[base + 2] = c
            rows[base + 3] = d
            rows[base + 4] = changed_at
            rows[base + 5] = sampled_at
            self._revisions[slot] = revision
        if self._extra is not None:
            self._extra.pop(segment_id, None)

    def put_json(self, segment_id: int, value: bytes, revision: int, now_ms: int) -> bool:
        """Store a plain record straight from its bytes (:func:`plain_load_json`), as
        the view's full path would; False, changing nothing, for a segment without a
        row or a record that is not plain: the caller takes the full path.

        The same version again (a reload) keeps the time it was first seen.
        """
        try:
            slot = self._ids.index(segment_id)
        except ValueError:
            return False
        seen = int(self._rows[slot * _STRIDE + 4]) if self._revisions[slot] == revision else now_ms
        load = plain_load_json(value, seen)
        if load is None:
            return False
        self._store_at(slot, segment_id, load, revision)
        return True

    def peek(self, segment_id: int) -> Peek | None:
        """A record's rates, stamps and held cold-since without building a
        :class:`LoadSample` (the follower's per-record gate); None without a record."""
        slot = self._slot(segment_id)
        if slot < 0:
            return None
        rows, base = self._rows, slot * _STRIDE
        held = rows[base + _COLD]
        cold = None if math.isnan(held) else int(held)
        sample = self._extra.get(segment_id) if self._extra is not None else None
        if sample is not None:
            return sample.rates.as_tuple(), sample.changed_at_ms, sample.sampled_at_ms, cold
        sampled = rows[base + 5]
        return (
            (rows[base], rows[base + 1], rows[base + 2], rows[base + 3]),
            int(rows[base + 4]),
            None if math.isnan(sampled) else int(sampled),
            cold,
        )

    def remove(self, segment_id: int) -> None:
        """Forget a segment's record; later slots shift down (array form), or its row is
        left dead until :meth:`_compact` (dict form: no shifting, no rewritten index)."""
        ids = self._ids
        if isinstance(ids, _Index):
            if ids.pop(segment_id, -1) < 0:
                return
            if 2 * len(ids) < len(self._revisions):  # dead rows outnumber live ones
                self._compact(ids)
        else:
            slot = self._slot(segment_id)
            if slot < 0:
                return
            del ids[slot]
            del self._rows[slot * _STRIDE : (slot + 1) * _STRIDE]
            del self._revisions[slot]
        if self._extra is not None:
            self._extra.pop(segment_id, None)

    def _compact(self, ids: _Index) -> None:
        """Drop the dead rows of a dict-form table, keeping the live ones in slot order;
        back to the array form when the live rows fit it."""
        rows, revisions = self._rows, self._revisions
        kept_rows, kept_revisions = array("d"), array("q")
        for slot in ids.values():  # ascending: the dict's order is slot order
            base = slot * _STRIDE
            kept_rows.extend(rows[base : base + _STRIDE])
            kept_revisions.append(revisions[slot])
        self._rows, self._revisions = kept_rows, kept_revisions
        if len(ids) > _INDEX_AT:
            self._ids = _Index(zip(ids, range(len(ids)), strict=True))
        else:
            self._ids = array("q", ids)

    def __getitem__(self, segment_id: int) -> LoadSample:
        slot = self._slot(segment_id)
        if slot < 0:
            raise KeyError(segment_id)
        if self._extra is not None and segment_id in self._extra:
            return self._extra[segment_id]
        return self._row(slot)

    def _row(self, slot: int) -> LoadSample:
        """The plain sample packed at ``slot`` (the extras are the caller's)."""
        base = slot * _STRIDE
        a, b, c, d, changed, sampled, _ = self._rows[base : base + _STRIDE]
        return LoadSample(
            Rates(a, b, c, d), int(changed), None if math.isnan(sampled) else int(sampled)
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids.tolist())  # a copy: the caller may remove as it goes

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, segment_id: object) -> bool:
        return isinstance(segment_id, int) and self._slot(segment_id) >= 0

    def cold(self, segment_id: int) -> int | None:
        """The cold-since held in memory for the segment, if any."""
        slot = self._slot(segment_id)
        if slot < 0:
            return None
        value = self._rows[slot * _STRIDE + _COLD]
        return None if math.isnan(value) else int(value)

    def set_cold(self, segment_id: int, since_ms: int | None) -> None:
        """Hold (or, with None, forget) a segment's cold-since; no-op without a record."""
        slot = self._slot(segment_id)
        if slot >= 0:
            self._rows[slot * _STRIDE + _COLD] = _NAN if since_ms is None else float(since_ms)

    def samples(self) -> dict[int, LoadSample]:
        """Every record as a :class:`LoadSample`, built once (for one evaluation), in one
        pass over the rows (an evaluation's hottest read)."""
        extra, ids = self._extra, self._ids
        return {
            sid: extra[sid] if extra is not None and sid in extra else self._row(slot)
            for slot, sid in (ids.slots() if isinstance(ids, _Index) else enumerate(ids))
        }

    def colds(self) -> dict[int, int]:
        """Every cold-since held in memory, by segment (see :meth:`cold`), in one pass."""
        rows, ids = self._rows, self._ids
        out: dict[int, int] = {}
        for slot, sid in ids.slots() if isinstance(ids, _Index) else enumerate(ids):
            value = rows[slot * _STRIDE + _COLD]
            if not math.isnan(value):
                out[sid] = int(value)
        return out


def _as_id(segment_id: int) -> int:
    """``segment_id`` as an ``array('q')`` stores it (``True`` is 1): the dict form
    refuses (TypeError, OverflowError) what the array form refuses."""
    key = operator.index(segment_id)
    if not -_LONG_MAX - 1 <= key <= _LONG_MAX:
        raise OverflowError(f"segment id {key} does not fit in 64 bits")
    return key


def _needs_extra(sample: LoadSample) -> bool:
    """Whether a sample holds more than a row can (kept as the object itself)."""
    return (
        sample.cold_since_ms is not None
        or sample.hash_buckets is not None
        or sample.peak_rates is not None
        or sample.flipflops != 0
        or sample.last_flipflop_ms is not None
        or sample.rise != 0
        or sample.merged != 0
    )


@dataclass(slots=True)
class TopicState:
    """Everything known about one topic. Mutated only by :class:`MetadataView`."""

    name: TopicName
    layout: Layout | None = None
    layout_revision: int = 0
    layout_error: str | None = None
    subscriptions: dict[str, str] = field(default_factory=dict)
    consumers: dict[str, set[str]] = field(default_factory=dict)
    loads: LoadTable = field(default_factory=LoadTable)
    cooldown: Cooldown | None = None
    #: Our clock when the layout and the cooldown value were applied (None: not through
    #: the view): a stamp from a clock running ahead of ours counts as of then.
    layout_seen_ms: int | None = None
    cooldown_seen_ms: int | None = None
    cold_since: dict[int, int] = field(default_factory=dict)
    #: Flip-flops and peaks the history-based rules need; None while there are none.
    history: TopicHistory | None = None
    #: Bumped by every value applied to (or rejected for) the topic: equal versions mean
    #: equal inputs, so an evaluation that found nothing to do need not be repeated.
    version: int = 0
    #: Set when the topic is deleted from the view: its state is then no one's.
    dropped: bool = False
    #: The controller's cache of what it derived from this state (its resolved policy,
    #: with the stamps it holds for); the view never reads it. Kept here because the
    #: state is already in the CPU's cache when a followed record reaches the controller.
    policy_memo: tuple[Any, ...] | None = None

    def consumer_counts(self) -> dict[str, int]:
        """Consumers per STREAM/CHECKPOINT subscription (QUEUE ones never split)."""
        return {
            sub: len(names)
            for sub, names in self.consumers.items()
            if self.subscriptions.get(sub, "STREAM") != "QUEUE"
        }

    def effective_cooldown(self) -> Cooldown:
        """Our persisted stamps, made newer by what the layout shows.

        The layout's newest children date operations we did not do ourselves
        (an operator's ``pulsar-admin`` split or merge, issue #11), and the
        persisted stamps survive GC pruning the segments that would date ours.

        Each stamp counts at most as of when this replica applied its value: a broker (or
        an earlier leader) whose clock ran a year ahead stamped children a year ahead,
        and taken as is they held merges (or, topic-wide, splits) back for that year.
        Capped, a skewed clock costs at most one cooldown from when the value came.
        """
        seeded = seeded_cooldown(self.layout) if self.layout is not None else Cooldown()
        seeded = seeded.no_later_than(self.layout_seen_ms)
        if self.cooldown is None:
            return seeded
        return self.cooldown.no_later_than(self.cooldown_seen_ms).newest(seeded)


class Change(NamedTuple):
    """A value that mattered; ``trigger`` asks for an evaluation of ``topic`` now.

    ``segment`` names the segment of a load change (None otherwise), so the
    caller can tell whether that one record can change a decision. A named
    tuple, not a frozen dataclass: one is built per followed record, and a
    frozen dataclass took twice as long to build (1.1 us, issue #12).
    """

    kind: ChangeKind
    topic: TopicName | None
    trigger: bool
    segment: int | None = None


#: Why a value was skipped, in a few words fit for a metric label: not JSON at all
#: (or not UTF-8), or JSON that breaks the schema or an invariant of its kind.
REJECT_CAUSES: Final = ("unparsable", "invalid")


@dataclass(frozen=True, slots=True)
class Rejected:
    """A value that was skipped; ``kind`` is one of :data:`KEY_KINDS` and ``cause`` one
    of :data:`REJECT_CAUSES` (metric labels); ``reason`` says what exactly (a log field)."""

    key: str
    kind: str
    reason: str
    cause: str = "invalid"


Outcome = Change | Rejected | None

RawEvent = tuple[bool, bytes, bytes, int]
"""One watched change as the store hands it over: (a put?, key, value, mod revision).
Keys stay bytes, so a load record of a key seen before is applied without decoding it."""

#: Most distinct ``<id>/load`` key tails remembered for the fast path; segment ids
#: are shared by every topic, so a few hundred cover a whole cluster.
_TAILS_MAX: Final = 65_536


def orphaned(state: TopicState) -> bool:
    """Whether only controllerd's own keys hold ``state``: no layout (nor a malformed
    one) and nothing the broker wrote. Our keys outlived the topic."""
    return (
        state.layout is None
        and state.layout_error is None
        and not state.subscriptions
        and not state.consumers
        and not state.loads
    )


def _predates(layout: Layout, segment_id: int, cold_since_ms: int) -> bool:
    """Whether a cold-since predates its segment in a layout no split or merge has
    changed (epoch 0: no segment inherited one): a deleted topic's, left behind, now
    naming a segment of a topic created again under the name."""
    seg = layout.segments.get(segment_id)
    return layout.epoch == 0 and seg is not None and cold_since_ms < seg.created_at_ms


def has_own_state(state: TopicState) -> bool:
    """Whether etcd holds any of controllerd's own keys for the topic."""
    return state.cooldown is not None or state.history is not None or bool(state.cold_since)


def parse_json(value: bytes) -> Any:
    """JSON from etcd bytes: orjson rejects non-UTF-8, depth > 1024 and numbers that
    overflow a double or a 64-bit integer, all as ValueError (never RecursionError)."""
    return orjson.loads(value)


def _long(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"{what}: expected an integer, got {_show(value)}")
    if not -_LONG_MAX - 1 <= value <= _LONG_MAX:
        raise ModelError(f"{what}: {value} is out of range")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _cause(exc: BaseException) -> str:
    return "unparsable" if isinstance(exc, orjson.JSONDecodeError) else "invalid"


def _reason(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ModelError) else str(exc)
    return text if len(text) <= REASON_LIMIT else text[: REASON_LIMIT - 3] + "..."


def _nobody(topic: TopicName) -> bool:
    return False


class MetadataView:
    """All topics under the metadata prefix, plus the controller-owned state."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.topics: dict[TopicName, TopicState] = {}
        self.overrides: dict[tuple[str, str | None, str | None], Mapping[str, Any]] = {}
        self.pending_deletes: dict[str, PendingDelete] = {}
        #: Pulsar's namespace policies (auto-scale override, retention), by (tenant, ns).
        self.pulsar_namespaces: dict[tuple[str, str], NamespacePolicies] = {}
        #: Bumped on every override change, so cached resolved policies expire.
        self.overrides_generation = 0
        #: Whether the caller writes ``name``'s history and cold-since keys (it leads
        #: the topic): a stored value is then its own write coming back, written behind
        #: and possibly older than the one it holds, so the view keeps the held one
        #: (else a merge right after another would lose the first one's range until
        #: the next echo, and a segment warm again would briefly get back the
        #: cold-since it had, an old start for its next cold window).
        self.writes_state: Callable[[TopicName], bool] = _nobody
        self._topics_prefix = keys.topics_prefix
        self._controller_prefix = keys.controller_prefix
        self._pulsar_policies_prefix = keys.pulsar_policies_prefix
        #: The fast path of :meth:`apply_events`: for load keys applied before, the
        #: bytes before ``/segments/`` -> their topic's state, and ``<id>/load`` -> id.
        self._heads: dict[bytes, TopicState] = {}
        self._tails: dict[bytes, int] = {}

    def topic(self, name: TopicName) -> TopicState:
        state = self.topics.get(name)
        if state is None:
            state = self.topics[name] = TopicState(name)
        return state

    def overrides_for(self, topic: TopicName) -> tuple[Mapping[str, Any] | None, ...]:
        """Our overrides for this topic, broadest first: tenant, namespace, topic."""
        return (
            self.overrides.get((topic.tenant, None, None)),
            self.overrides.get((topic.tenant, topic.namespace, None)),
            self.overrides.get((topic.tenant, topic.namespace, topic.topic)),
        )

    def keys_held(self, prefix: str) -> Iterator[str]:
        """Every key under ``prefix`` whose value the view holds: the keys of
        :meth:`keys_held_in_slices`, in its order, without the slices."""
        for keys in self.keys_held_in_slices(prefix, 4096):
            yield from keys

    def keys_held_in_slices(self, prefix: str, size: int) -> Iterator[list[str]]:
        """Every key under ``prefix`` whose value the view holds, in slices of ``size`` steps.

        After a reload that follows a compaction, keys held but not seen again
        were deleted while we were not watching: the caller deletes them. A step
        is a topic looked at or a key listed, and a slice ends once it took
        ``size`` steps (it may list no key at all), so a caller that yields to the
        loop after each slice never walks more than ``size`` topics, nor lists
        more than ``size`` keys plus one topic's, between two yields, whatever the
        topics hold: 100,000 topics walked for the controller's keys, which few
        of them have, took 0.2 s with not one key listed. Lazy (a topic costs
        ~1 us, a key ~2 us); the topics are those held when the listing starts,
        less those dropped before their turn.

        Order: topic by topic, a topic's layout key before its other keys. So,
        taken in reverse, every topic's other keys come before its layout key,
        whose deletion drops the topic (a key of a topic already dropped would
        be deleted with no change to report).
        """
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        chunk: list[str] = []
        steps = 0
        for keys in self._held_groups(prefix):
            chunk.extend(keys)
            steps += 1 + len(keys)
            if steps >= size:
                yield chunk
                chunk, steps = [], 0
        if steps:
            yield chunk

    def _held_groups(self, prefix: str) -> Iterator[list[str]]:
        """The keys of :meth:`keys_held_in_slices`, one list per topic or other key."""
        k = self.keys
        topics = self.topics
        names = list(topics)  # not its items: a tuple each, 20 ms at 100,000 topics
        if k.topics_prefix.startswith(prefix) or prefix.startswith(k.topics_prefix):
            for name in names:
                state = topics.get(name)
                if state is None:  # dropped since the listing started
                    continue
                held = [k.layout(name)]  # first: see keys_held_in_slices
                held.extend(k.subscription(name, sub) for sub in state.subscriptions)
                for sub, consumers in state.consumers.items():
                    held.extend(k.consumer(name, sub, c) for c in consumers)
                held.extend(k.load(name, sid) for sid in state.loads)
                yield [key for key in held if key.startswith(prefix)]
        if k.controller_prefix.startswith(prefix) or prefix.startswith(k.controller_prefix):
            for name in names:
                state = topics.get(name)
                if state is None:
                    continue
                held = [k.cold_since(name, sid) for sid in state.cold_since]
                if state.cooldown is not None:
                    held.append(k.cooldown(name))
                if state.history is not None:
                    held.append(k.history(name))
                yield [key for key in held if key.startswith(prefix)]
            others = [k.policy(t, ns, topic) for t, ns, topic in self.overrides]
            others.extend(self.pending_deletes)
            yield from ([key] for key in others if key.startswith(prefix))
        root = self.keys.pulsar_policies_prefix
        if root.startswith(prefix) or prefix.startswith(root):
            namespaces = [f"{root}{t}/{ns}" for t, ns in self.pulsar_namespaces]
            yield from ([key] for key in namespaces if key.startswith(prefix))

    # -- the parsing boundary -------------------------------------------------------------

    def apply_put(self, key: str, value: bytes, mod_revision: int, now_ms: int) -> Outcome:
        """Apply one key's new value; never raises (see the module docstring)."""
        outcome = self._apply_put(key, value, mod_revision, now_ms)
        self._touch(key, outcome)
        return outcome

    def apply_events(
        self,
        events: Iterable[RawEvent],
        now_ms: int,
        note: Callable[[Outcome], None],
        note_load: Callable[[TopicState, int], None] | None = None,
    ) -> None:
        """Apply watched events in order, handing each outcome to ``note``.

        The same as :meth:`apply_put`/:meth:`apply_delete` of each event (a
        property test holds it to that), but a plain load record under a key
        whose topic and segment were applied before is written straight into
        its row: no key decoded or split, no dict built (issue #12: a standby
        must follow etcd nearly as fast as a bare watcher). Only a key the full
        path parsed as that topic's load record teaches the fast path, and a
        topic deleted since (its state ``dropped``) unteaches it.

        ``note_load(state, segment)``, if given, hears of such a record instead of
        ``note(Change("load", state.name, True, segment))``: the same news, with the
        state it changed (a live one: never ``dropped``), so no lookup by name follows.
        """
        heads, tails = self._heads, self._tails
        for put, key, value, revision in events:
            if put:
                head, _, tail = key.rpartition(b"/segments/")
                state = heads.get(head)
                if state is not None:
                    sid = tails.get(tail)
                    if (
                        sid is not None
                        and not state.dropped
                        and state.loads.put_json(sid, value, revision, now_ms)
                    ):
                        state.version += 1
                        if note_load is None:
                            note(Change("load", state.name, True, sid))
                        else:
                            note_load(state, sid)
                        continue
                note(self.apply_put(key.decode(errors="replace"), value, revision, now_ms))
            else:
                note(self.apply_delete(key.decode(errors="replace")))

    def _learn_load_key(self, key: str, state: TopicState, segment_id: int) -> None:
        """Teach :meth:`apply_events` a load key the full path just applied."""
        head, _, tail = key.encode().rpartition(b"/segments/")
        self._heads[head] = state
        if tail in self._tails or len(self._tails) < _TAILS_MAX:
            self._tails[tail] = segment_id

    def apply_delete(self, key: str) -> Outcome:
        """Apply one key's deletion; never raises."""
        outcome = self._apply_delete(key)
        self._touch(key, outcome)
        return outcome

    def _touch(self, key: str, outcome: Outcome) -> None:
        """Bump the version of the topic an applied or rejected value belongs to."""
        if outcome is None:
            return
        topic = outcome.topic if isinstance(outcome, Change) else None
        if isinstance(outcome, Rejected) and key.startswith(self._topics_prefix):
            parsed = self._split_metadata(key)
            topic = parsed[0] if parsed is not None else None
        state = self.topics.get(topic) if topic is not None else None
        if state is not None:
            state.version += 1

    def _apply_put(self, key: str, value: bytes, mod_revision: int, now_ms: int) -> Outcome:
        try:
            if key.startswith(self._topics_prefix):
                return self._put_metadata(key, value, mod_revision, now_ms)
            if key.startswith(self._controller_prefix):
                return self._put_controller(key, value, now_ms)
            if key.startswith(self._pulsar_policies_prefix):
                return self._put_pulsar_policies(key, value)
        except Exception as exc:  # the boundary: any failure is a rejection
            kind = self.kind_of(key)
            if kind == "layout":
                self._drop_layout(key, _reason(exc))
            elif kind == "load":
                self._drop_load(key)
            elif kind == "subscription":
                self._keep_subscription(key)
            elif kind == "cooldown":
                self._drop_controller_value(key)
            return Rejected(key, kind, _reason(exc), _cause(exc))
        return None

    def _apply_delete(self, key: str) -> Outcome:
        try:
            if key.startswith(self._topics_prefix):
                return self._delete_metadata(key)
            if key.startswith(self._controller_prefix):
                return self._delete_controller(key)
            if key.startswith(self._pulsar_policies_prefix):
                return self._delete_pulsar_policies(key)
        except Exception as exc:  # the boundary, as for puts
            return Rejected(key, self.kind_of(key), _reason(exc), _cause(exc))
        return None

    def kind_of(self, key: str) -> str:
        """The :data:`KEY_KINDS` label of a key (for counting rejections)."""
        if key.startswith(self._topics_prefix):
            parsed = self._split_metadata(key)
            if parsed is None:
                return "other"
            rest = parsed[1]
            if not rest:
                return "layout"
            if rest[0] == "segments":
                return "load"
            if rest[0] == "subscriptions":
                return "consumer" if len(rest) == 4 else "subscription"
            return "other"
        if key.startswith(self._pulsar_policies_prefix):
            return "pulsar_policy"
        parts = key[len(self._controller_prefix) :].split("/", 1)
        return {
            "policies": "policy",
            "cooldowns": "cooldown",
            "cold-since": "cold_since",
            "pending-deletes": "pending_delete",
            "history": "history",
        }.get(parts[0], "other")

    # -- metadata prefix ------------------------------------------------------------------

    def _split_metadata(self, key: str) -> tuple[TopicName, list[str]] | None:
        parts = key[len(self._topics_prefix) :].split("/")
        if len(parts) < 3:
            return None
        try:
            return topic_from_key(parts[0], parts[1], parts[2]), parts[3:]
        except ModelError:
            return None

    def _drop_layout(self, key: str, error: str) -> None:
        parsed = self._split_metadata(key)
        if parsed is not None and not parsed[1]:
            state = self.topic(parsed[0])
            state.layout, state.layout_error = None, error

    def _keep_subscription(self, key: str) -> None:
        """A subscription whose value cannot be read still exists: GC must keep asking
        the broker for its backlog (an unknown subscription would make a segment look
        drained). Its last readable type stays; a new one's is :data:`UNKNOWN_TYPE`."""
        parsed = self._split_metadata(key)
        if parsed is not None and len(parsed[1]) == 2:
            self.topic(parsed[0]).subscriptions.setdefault(parsed[1][1], UNKNOWN_TYPE)

    def _drop_load(self, key: str) -> None:
        parsed = self._split_metadata(key)
        if parsed is None:
            return
        state = self.topics.get(parsed[0])
        rest = parsed[1]
        if state is not None and len(rest) == 3 and rest[1].isdigit():
            state.loads.remove(int(rest[1]))

    def _put_metadata(self, key: str, value: bytes, mod_revision: int, now_ms: int) -> Outcome:
        parsed = self._split_metadata(key)
        if parsed is None:
            return None
        name, rest = parsed
        match rest:
            case ["segments", sid_text, "load"]:  # first: nearly every write is one
                sid = _long(_segment_id(sid_text), "segment id")
                held = self.topics.get(name)
                first_seen = now_ms
                if held is not None and held.loads.revision(sid) == mod_revision:
                    first_seen = held.loads[sid].changed_at_ms  # a reload: keep its time
                plain = plain_load_json(value, first_seen)
                if plain is not None:
                    state = self.topic(name)
                    state.loads.put_plain(sid, plain, mod_revision)
                else:
                    # Parsed before the topic is made: a refused value must not leave
                    # a topic behind that no later delete would remove.
                    obj = parse_json(value)
                    sample = load_sample_from_json(obj, f"load[{sid}]", seen_at_ms=first_seen)
                    state = self.topic(name)
                    state.loads.put(sid, sample, mod_revision)
                self._learn_load_key(key, state, sid)
                return Change("load", name, True, sid)
            case []:
                layout = check(layout_from_json(parse_json(value)))
                state = self.topic(name)
                state.layout, state.layout_revision, state.layout_error = layout, mod_revision, None
                state.layout_seen_ms = now_ms
                for sid in [s for s in state.loads if s not in layout.segments]:
                    state.loads.remove(sid)
                for sid in [s for s in state.cold_since if s not in layout.segments]:
                    del state.cold_since[sid]
                for sid in [s for s, at in state.cold_since.items() if _predates(layout, s, at)]:
                    del state.cold_since[sid]
                return Change("layout", name, True)
            case ["subscriptions", sub]:
                raw = parse_json(value) if value.strip() else {}
                kind = raw.get("type", "STREAM") if isinstance(raw, dict) else None
                kind = kind.upper() if isinstance(kind, str) else kind
                if kind not in SUBSCRIPTION_TYPES:
                    raise ModelError(
                        f"subscription type {_show(kind)} is not one of "
                        + ", ".join(SUBSCRIPTION_TYPES)
                    )
                state = self.topic(name)
                changed = state.subscriptions.get(sub) != kind
                state.subscriptions[sub] = kind
                return Change("subscription", name, changed)
            case ["subscriptions", sub, "consumers", consumer]:
                # The key's existence is the registration (Pulsar writes {}); the value
                # is never read, so no value can make a consumer invisible.
                names = self.topic(name).consumers.setdefault(sub, set())
                new = consumer not in names
                names.add(consumer)
                return Change("consumer", name, new)
        return None

    def _delete_metadata(self, key: str) -> Outcome:
        parsed = self._split_metadata(key)
        if parsed is None:
            return None
        name, rest = parsed
        state = self.topics.get(name)
        if state is None:
            return None
        match rest:
            case []:
                del self.topics[name]
                state.dropped = True
                self._heads.pop(key.encode(), None)  # its load keys' head is this key
                return Change("layout", name, False)
            case ["subscriptions", sub]:
                state.subscriptions.pop(sub, None)
                state.consumers.pop(sub, None)
                return self._unless_gone(state, Change("subscription", name, True))
            case ["subscriptions", sub, "consumers", consumer]:
                names = state.consumers.get(sub, set())
                gone = consumer in names
                names.discard(consumer)
                if not names:
                    # No set is kept empty: a subscription with consumers but no key of
                    # its own is known through them, and once they left, GC asked its
                    # backlog (404: unknown, never drained) and kept every segment.
                    state.consumers.pop(sub, None)
                return self._unless_gone(state, Change("consumer", name, gone))
            case ["segments", sid_text, "load"]:
                state.loads.remove(_segment_id(sid_text))
                return self._unless_gone(state, Change("load", name, False))
        return None

    # -- controller prefix ----------------------------------------------------------------

    def _controller_parts(self, key: str) -> list[str]:
        return key[len(self._controller_prefix) :].split("/")

    def _put_controller(self, key: str, value: bytes, now_ms: int) -> Outcome:
        match self._controller_parts(key):
            case ["policies", tenant, *scope] if len(scope) <= 2:
                raw = parse_json(value)
                if not isinstance(raw, dict):
                    raise ModelError("policy override must be a JSON object")
                self.overrides[_scope(tenant, scope)] = raw
                self.overrides_generation += 1
                return Change("policy", None, True)
            case ["cooldowns", t, n, topic]:
                name = topic_from_key(t, n, topic)
                state = self.topic(name)
                state.cooldown, state.cooldown_seen_ms = parse_cooldown(parse_json(value)), now_ms
                return Change("cooldown", name, False)
            case ["cold-since", t, n, topic, sid]:
                name = topic_from_key(t, n, topic)
                since = _long(parse_json(value), "cold-since")
                if since < 0:
                    raise ModelError(f"cold-since: must be >= 0, got {since}")
                state = self.topic(name)
                segment_id = _segment_id(sid)
                stale = state.layout is not None and _predates(state.layout, segment_id, since)
                if not self.writes_state(name) and not stale:
                    state.cold_since[segment_id] = since
                return Change("cold", name, False)
            case ["history", t, n, topic]:
                name = topic_from_key(t, n, topic)
                raw = parse_json(value)
                if not isinstance(raw, dict):
                    raise ModelError(f"history: expected a JSON object, got {_show(raw)}")
                if not self.writes_state(name):
                    self.topic(name).history = TopicHistory.from_json(raw)
                return Change("history", name, False)
            case ["pending-deletes", t, n, topic, descriptor]:
                marker = parse_pending_delete(parse_json(value))
                if marker.topic != topic_from_key(t, n, topic) or marker.descriptor != descriptor:
                    raise ModelError(
                        f"pending delete for {marker.topic} {marker.descriptor} "
                        "is stored under another key"
                    )
                self.pending_deletes[key] = marker
                return Change("pending-delete", marker.topic, False)
        return None

    def _drop_controller_value(self, key: str) -> None:
        match self._controller_parts(key):
            case ["cooldowns", t, n, topic]:
                state = self.topics.get(topic_from_key(t, n, topic))
                if state is not None:
                    state.cooldown = None

    def _delete_controller(self, key: str) -> Outcome:
        match self._controller_parts(key):
            case ["policies", tenant, *scope] if len(scope) <= 2:
                self.overrides.pop(_scope(tenant, scope), None)
                self.overrides_generation += 1
                return Change("policy", None, True)
            case ["cooldowns", t, n, topic]:
                name = topic_from_key(t, n, topic)
                state = self.topics.get(name)
                if state is not None:
                    state.cooldown = None
                return self._unless_gone(state, Change("cooldown", name, False))
            case ["cold-since", t, n, topic, sid]:
                name = topic_from_key(t, n, topic)
                state = self.topics.get(name)
                if state is not None and not self.writes_state(name):
                    state.cold_since.pop(_segment_id(sid), None)
                return self._unless_gone(state, Change("cold", name, False))
            case ["history", t, n, topic]:
                name = topic_from_key(t, n, topic)
                state = self.topics.get(name)
                if state is not None and not self.writes_state(name):
                    state.history = None
                return self._unless_gone(state, Change("history", name, False))
            case ["pending-deletes", *_]:
                marker = self.pending_deletes.pop(key, None)
                return Change("pending-delete", marker.topic if marker else None, False)
        return None

    def _unless_gone(self, state: TopicState | None, change: Change) -> Outcome:
        """``change``, or the topic's deletion once nothing of it is left: a topic held
        only by our keys (its layout deleted while no one led it) goes with them."""
        if state is None or not orphaned(state) or has_own_state(state):
            return change
        del self.topics[state.name]
        state.dropped = True
        self._heads.pop(self.keys.layout(state.name).encode(), None)
        return Change("layout", state.name, False)

    # -- Pulsar's namespace policies --------------------------------------------------------

    def _put_pulsar_policies(self, key: str, value: bytes) -> Outcome:
        parts = key[len(self._pulsar_policies_prefix) :].split("/")
        if len(parts) != 2 or not all(parts):
            return None  # tenant records and deeper keys share the root
        self.pulsar_namespaces[(parts[0], parts[1])] = parse_namespace_policies(parse_json(value))
        self.overrides_generation += 1
        return Change("policy", None, True)

    def _delete_pulsar_policies(self, key: str) -> Outcome:
        parts = key[len(self._pulsar_policies_prefix) :].split("/")
        if len(parts) != 2 or self.pulsar_namespaces.pop((parts[0], parts[1]), None) is None:
            return None
        self.overrides_generation += 1
        return Change("policy", None, True)

    def pulsar_namespace(self, topic: TopicName) -> NamespacePolicies | None:
        return self.pulsar_namespaces.get((topic.tenant, topic.namespace))


def _scope(tenant: str, scope: list[str]) -> tuple[str, str | None, str | None]:
    if len(scope) > 1:
        return (tenant, scope[0], topic_from_key(tenant, scope[0], scope[1]).topic)
    return (tenant, scope[0] if scope else None, None)


def _segment_id(text: str) -> int:
    if not text.isascii() or not text.isdigit() or len(text) > 19:
        raise ModelError(f"segment id {_show(text)} is not a non-negative integer")
    return int(text)


def parse_cooldown(raw: Any) -> Cooldown:
    """A persisted cooldown stamp: ``{"lastSplitAtMs": int, "lastMergeAtMs": int}``."""
    if not isinstance(raw, dict):
        raise ModelError(f"cooldown: expected a JSON object, got {_show(raw)}")
    return Cooldown(
        _long(raw.get("lastSplitAtMs", -1), "cooldown.lastSplitAtMs"),
        _long(raw.get("lastMergeAtMs", -1), "cooldown.lastMergeAtMs"),
    )


def parse_pending_delete(raw: Any) -> PendingDelete:
    """A pending-delete marker written by our GC's prune transaction."""
    if not isinstance(raw, dict):
        raise ModelError(f"pending delete: expected a JSON object, got {_show(raw)}")
    topic, descriptor = raw.get("topic"), raw.get("descriptor")
    if not isinstance(topic, str) or not isinstance(descriptor, str):
        raise ModelError("pending delete: topic and descriptor must be strings")
    if _DESCRIPTOR.fullmatch(descriptor) is None:
        raise ModelError(f"pending delete: {_show(descriptor)} is not a segment descriptor")
    segment_id = _long(raw.get("segmentId"), "pending delete.segmentId")
    if segment_id < 0 or not descriptor.endswith(f"-{segment_id}"):
        raise ModelError(f"pending delete: segmentId {segment_id} does not match {descriptor}")
    pruned = _long(raw.get("prunedAtMs", 0), "pending delete.prunedAtMs")
    return PendingDelete(TopicName.parse(topic), descriptor, segment_id, pruned)
