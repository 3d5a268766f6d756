"""Value types shared by the pure core, the daemon, the CLI and the backtest.

Everything here is frozen and I/O-free. JSON (de)serialisation of the Pulsar
wire shapes lives next to the types so that every caller parses the same way:
leniently (unknown fields are kept for round-trips, never interpreted) and
with a :class:`ModelError` naming the offending field when a value is unusable.
"""

from __future__ import annotations

import enum
import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Final

import msgspec

HASH_MIN: Final = 0x0000
HASH_MAX: Final = 0xFFFF
HASH_SPACE: Final = HASH_MAX + 1

RATE_NAMES: Final = ("msgRateIn", "byteRateIn", "msgRateOut", "byteRateOut")
#: Subscription types a subscription key may name (upper case); QUEUE consumers do
#: not count towards the consumer-count split (DESIGN §6).
SUBSCRIPTION_TYPES: Final = ("STREAM", "QUEUE", "CHECKPOINT")
"""Canonical names of the four load rates, in Pulsar's evaluation order."""


class ModelError(ValueError):
    """A JSON document does not describe a usable value; the message names the field."""


@dataclass(frozen=True, slots=True, order=True)
class TopicName:
    """``tenant/namespace/topic``; no part may be empty or contain ``/``."""

    tenant: str
    namespace: str
    topic: str
    #: The hash, computed once: names key every per-topic map, a handful of lookups
    #: per followed record (issue #12). String hashes differ between processes, so
    #: ``__reduce__`` rebuilds a name instead of copying this.
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for part in (self.tenant, self.namespace, self.topic):
            if not part or "/" in part:
                raise ModelError(f"invalid topic name part {shown(part)} in {self.path}")
        object.__setattr__(self, "_hash", hash((self.tenant, self.namespace, self.topic)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[TopicName], tuple[str, str, str]]:
        return TopicName, (self.tenant, self.namespace, self.topic)

    @property
    def path(self) -> str:
        return f"{self.tenant}/{self.namespace}/{self.topic}"

    def __str__(self) -> str:
        return self.path

    @classmethod
    def parse(cls, text: str) -> TopicName:
        parts = text.strip("/").split("/")
        if len(parts) != 3:
            raise ModelError(f"topic name {shown(text)} is not tenant/namespace/topic")
        return cls(*parts)


class SegmentState(enum.StrEnum):
    ACTIVE = "ACTIVE"
    SEALED = "SEALED"


@dataclass(frozen=True, slots=True)
class HashRange:
    """Inclusive range ``[start, end]`` of the 16-bit hash space."""

    start: int
    end: int

    @property
    def width(self) -> int:
        return self.end - self.start + 1


@dataclass(frozen=True, slots=True)
class Segment:
    """Pulsar's ``SegmentInfo``. ``sealed_at_*`` are -1 while the segment is active."""

    segment_id: int
    hash_range: HashRange
    state: SegmentState
    parent_ids: tuple[int, ...] = ()
    child_ids: tuple[int, ...] = ()
    created_at_epoch: int = 0
    sealed_at_epoch: int = -1
    created_at_ms: int = 0
    sealed_at_ms: int = -1
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def active(self) -> bool:
        return self.state is SegmentState.ACTIVE

    @property
    def descriptor(self) -> str:
        """Segment topic name suffix, ``%04x-%04x-%d`` as Pulsar names it."""
        return f"{self.hash_range.start:04x}-{self.hash_range.end:04x}-{self.segment_id}"

    def sealed(self, epoch: int, now_ms: int, child_ids: tuple[int, ...]) -> Segment:
        """This segment sealed at ``epoch`` and ``now_ms`` with these children: built
        directly, not with ``dataclasses.replace``, whose field introspection was most of
        a split's, a merge's and a GC's cost (a test keeps it equal to ``replace``)."""
        return Segment(
            self.segment_id,
            self.hash_range,
            SegmentState.SEALED,
            self.parent_ids,
            child_ids,
            self.created_at_epoch,
            epoch,
            self.created_at_ms,
            now_ms,
            self.extra,
        )

    def relinked(self, parent_ids: tuple[int, ...], child_ids: tuple[int, ...]) -> Segment:
        """This segment with these parents and children (see :meth:`sealed`)."""
        return Segment(
            self.segment_id,
            self.hash_range,
            self.state,
            parent_ids,
            child_ids,
            self.created_at_epoch,
            self.sealed_at_epoch,
            self.created_at_ms,
            self.sealed_at_ms,
            self.extra,
        )


@dataclass(frozen=True, slots=True)
class Layout:
    """Pulsar's ``ScalableTopicMetadata``.

    ``segments`` is keyed by segment id and must never be mutated: layout
    operations build a new mapping. ``auto_scale_policy`` is the raw per-topic
    override (camelCase keys); it is resolved against the configured policy by
    :func:`controllerd.core.policy.resolve_policy`.
    """

    epoch: int
    next_segment_id: int
    segments: Mapping[int, Segment]
    properties: Mapping[str, str] = field(default_factory=dict)
    auto_scale_policy: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    _active: tuple[Segment, ...] | None = field(default=None, init=False, compare=False, repr=False)

    def succeeded(self, segments: Mapping[int, Segment], next_segment_id: int) -> Layout:
        """The next epoch of this layout, with these segments (built directly, as
        :meth:`Segment.sealed` is)."""
        return Layout(
            self.epoch + 1,
            next_segment_id,
            segments,
            self.properties,
            self.auto_scale_policy,
            self.extra,
        )

    def active_segments(self) -> tuple[Segment, ...]:
        """Active segments in hash order (ascending range start); computed once."""
        if self._active is None:
            active = [s for s in self.segments.values() if s.state is SegmentState.ACTIVE]
            active.sort(key=_range_start)
            # A cache on a frozen value: the layout never changes, so neither does this.
            object.__setattr__(self, "_active", tuple(active))
        assert self._active is not None
        return self._active


def _range_start(segment: Segment) -> int:
    return segment.hash_range.start


@dataclass(frozen=True, slots=True)
class Rates:
    """The four load rates (per second). Also used for thresholds."""

    msg_rate_in: float
    byte_rate_in: float
    msg_rate_out: float
    byte_rate_out: float

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.msg_rate_in, self.byte_rate_in, self.msg_rate_out, self.byte_rate_out)


@dataclass(frozen=True, slots=True)
class LoadSample:
    """One segment's load record as the policy sees it (DESIGN §4).

    ``changed_at_ms`` is when the record last changed materially (Pulsar's
    cold-since). ``sampled_at_ms`` is when a reporter last vouched for it
    (None: unknown, e.g. plain Pulsar; the daemon substitutes the time it first
    saw the record). ``cold_since_ms`` is our DESIGN §8.1 extension: when the
    segment last became continuously cold; it supersedes ``changed_at_ms`` for
    the merge window when present. The fields after it are ours too; each has a
    neutral default, so a plain Pulsar record decides exactly as PIP-483 does.
    """

    rates: Rates
    changed_at_ms: int
    sampled_at_ms: int | None = None
    cold_since_ms: int | None = None
    #: the reporter's load histogram over the segment's hash range (``hashBuckets``):
    #: n slices of equal width (1 <= n <= 32), msg/s in per slice; only proportions
    #: are used. None = unknown (Pulsar publishes none): the load is taken as uniform.
    hash_buckets: tuple[float, ...] | None = None
    #: ours, kept by the caller (:class:`controllerd.core.policy.TopicHistory`): the
    #: per-rate maximum of this range's records within ``policy.peak_window_seconds``.
    #: None = unknown: merges are judged on ``rates`` alone.
    peak_rates: Rates | None = None
    #: ours, kept by the caller: how many times this range flip-flopped (a merge
    #: undone by a split within the merge window, or a split undone by a merge)
    #: and when it last did; ``policy.merge_backoff_*`` lengthens its merge window.
    flipflops: int = 0
    last_flipflop_ms: int | None = None
    #: ours, kept by the caller: the largest rise of this range's load between two of
    #: its records, in split thresholds (the split score's units), halved every
    #: ``policy.merge_headroom_half_life_seconds`` since; a merge leaves room for it.
    rise: float = 0.0
    #: ours, kept by the caller: how many segments the merges of the last
    #: ``policy.merge_undo_seconds`` folded into this range (0 or 1: none); a split of
    #: it gets at least that many children.
    merged: int = 0

    def with_cold_since(self, cold_since_ms: int) -> LoadSample:
        """This sample with ``cold_since_ms`` set: ``dataclasses.replace``, built
        directly (an evaluation of a cold 16-segment topic spent a third of its time
        in ``replace``'s field introspection)."""
        return LoadSample(
            self.rates,
            self.changed_at_ms,
            self.sampled_at_ms,
            cold_since_ms,
            self.hash_buckets,
            self.peak_rates,
            self.flipflops,
            self.last_flipflop_ms,
            self.rise,
            self.merged,
        )

    def with_history(
        self,
        peak_rates: Rates | None,
        flipflops: int,
        last_flipflop_ms: int | None,
        rise: float,
        merged: int,
    ) -> LoadSample:
        """This sample with the fields :class:`~controllerd.core.policy.TopicHistory`
        keeps, built directly like :meth:`with_cold_since` (``replace`` was a twentieth
        of a backtest of history-aware variants)."""
        return LoadSample(
            self.rates,
            self.changed_at_ms,
            self.sampled_at_ms,
            self.cold_since_ms,
            self.hash_buckets,
            peak_rates,
            flipflops,
            last_flipflop_ms,
            rise,
            merged,
        )


# --- decisions -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Split:
    """Split ``segment_id`` into ``len(boundaries) + 1`` children.

    ``boundaries`` are the children's start values after the first, ascending,
    strictly inside the segment's range. ``reason`` is a stable code (metric
    label, CLI field); ``detail`` is the human-readable explanation.
    """

    segment_id: int
    boundaries: tuple[int, ...]
    reason: str
    detail: str = ""

    action = "split"


@dataclass(frozen=True, slots=True)
class Merge:
    """Merge two adjacent active segments; ``a`` is the lower hash range."""

    a: int
    b: int
    reason: str
    detail: str = ""

    action = "merge"


@dataclass(frozen=True, slots=True)
class NoAction:
    reason: str
    detail: str = ""

    action = "none"


Decision = Split | Merge | NoAction


def decision_to_json(decision: Decision) -> dict[str, Any]:
    """The ``controllerd decide`` output object (a scripted contract)."""
    if isinstance(decision, Split):
        segments, boundaries = [decision.segment_id], list(decision.boundaries)
    elif isinstance(decision, Merge):
        segments, boundaries = [decision.a, decision.b], []
    else:
        segments, boundaries = [], []
    return {
        "action": decision.action,
        "segments": segments,
        "boundaries": boundaries,
        "reason": decision.reason,
        "detail": decision.detail,
    }


# --- policy settings (the [policy] table; resolved per topic) ---------------


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """Auto split/merge policy. Defaults are Pulsar's (PIP-483) unless marked ours.

    Durations are in seconds. A value of 0 for ``load_ttl_seconds`` disables the
    staleness check (Pulsar behaviour). :data:`PULSAR_PARITY` lists the values of
    our settings that together reproduce Pulsar exactly.
    """

    enabled: bool = True
    min_segments: int = 1
    max_segments: int = 64
    max_dag_depth: int = 10
    #: ours: children per split; 2 = Pulsar's binary midpoint split.
    max_split_fanout: int = 8
    split_cooldown_seconds: float = 60.0
    merge_cooldown_seconds: float = 300.0
    #: ours: Pulsar's is 300 s. Chosen by ``controllerd tune`` over the nab + aws traces
    #: (docs/backtest.md): bursty traffic comes in clusters, and a short window merges
    #: between bursts and splits again at the next one (flip-flops). Measured from
    #: cold-since (DESIGN §8.1), so noisy low traffic still merges.
    merge_window_seconds: float = 7200.0
    #: ours: a record whose sampledAtMs is older than this never justifies a merge.
    load_ttl_seconds: float = 900.0
    #: ours: a split must leave every child at least this many hash values wide,
    #: so a single hot key cannot make the controller split forever (DESIGN §8.7).
    min_split_width: int = 256
    #: ours: a merge is refused when the pair's combined rate reaches this
    #: fraction of the split threshold (it would re-split at once).
    merge_combined_max_ratio: float = 0.8
    #: ours: seconds of load history a merge is judged on. A pair merges only if
    #: the sum of each side's *peak* over this window stays below
    #: ``merge_combined_max_ratio`` of the split thresholds (Kubernetes HPA's
    #: scale-down stabilisation): a range that burst an hour ago keeps its
    #: segments through the lull. 0 = judge the current load only (Pulsar). Needs
    #: the caller to supply ``LoadSample.peak_rates`` (``TopicHistory`` does).
    peak_window_seconds: float = 0.0
    #: ours: each recent flip-flop of a range multiplies its merge window by this
    #: (at most ``MAX_BACKOFF_STEPS`` times), so a range that merged too early
    #: waits longer next time. 1 = off (Pulsar). Needs ``LoadSample.flipflops``.
    #: 2 is what ``controllerd tune`` chose on the nab + aws traces (docs/backtest.md):
    #: AWS disk-write bursts recur at irregular gaps that no fixed window fits.
    merge_backoff_factor: float = 2.0
    #: ours: seconds of calm (no flip-flop) after which one flip-flop is forgotten.
    merge_backoff_decay_seconds: float = 86_400.0
    #: ours: for ``merge_backoff_factor``, a merged range split again within this
    #: many seconds of its merge counts as a flip-flop even after its merge window:
    #: the merge did not last long enough to pay for its two operations (a daily
    #: cycle's midday dip). 0 = only a split within the merge window counts.
    #: Inert when the backoff is off. ``controllerd tune`` kept 0 on nab + aws.
    merge_regret_seconds: float = 0.0
    #: ours: 0 = off. A pair merges only if its combined load plus the largest rise
    #: either range made between two of its records (in split thresholds, halved
    #: every this many seconds since) stays under ``merge_combined_max_ratio``: a
    #: range that jumped lately keeps room to jump again (headroom from recent
    #: volatility). About 170 bytes a range in ``TopicHistory``, not a queue of records.
    merge_headroom_half_life_seconds: float = 0.0
    #: ours: a range made by merges within this many seconds that turns hot splits
    #: back at once into as many children as the segments those merges replaced (as
    #: far as the fanout cap allows), not one threshold's worth at a time: the load
    #: that left has come back, and a cascade of merges undone split by split costs an
    #: operation (and a flip-flop) per level. The count is history the caller keeps
    #: (``LoadSample.merged``, from ``TopicHistory``), not read from the layout: Pulsar's
    #: GC prunes drained sealed parents within a minute. 0 = off (Pulsar). 1800: the
    #: backtest's flip-flop window (docs/backtest.md, "What each setting buys").
    merge_undo_seconds: float = 1800.0
    #: ours: true = the split cooldown holds back only the children of a recent
    #: split (whose first records are the noisiest); any other range over its
    #: threshold splits at once. false = one split per topic per cooldown (Pulsar).
    #: Chosen by ``controllerd tune``: when two ranges are hot at once the second no
    #: longer waits a minute (less excess load at no cost).
    range_split_cooldown: bool = True
    #: ours: true = a traffic split gets enough children for the range's peak
    #: within ``peak_window_seconds``, not just its current load (headroom for a
    #: range whose load swings). false = for the current load (Pulsar's score).
    split_to_peak: bool = False
    #: ours: true = split boundaries equalise the children's load when the record
    #: carries ``hashBuckets``, isolate a hot key into the narrowest allowed range
    #: and refuse a split that would not relieve it (``hot-key``). Without
    #: hashBuckets (Pulsar) boundaries are equal-width either way.
    load_aware_splits: bool = True
    split_thresholds: Rates = Rates(10_000.0, 50e6, 50_000.0, 250e6)
    merge_thresholds: Rates = Rates(1_000.0, 5e6, 5_000.0, 25e6)

    def errors(self, prefix: str = "policy") -> list[str]:
        """Every violated validation rule, each naming its field (empty = valid)."""
        errs: list[str] = []

        def bad(name: str, rule: str, value: object) -> None:
            errs.append(f"{prefix}.{name}: must be {rule} (got {shown(value)})")

        if self.min_segments < 1:
            bad("min_segments", ">= 1", self.min_segments)
        if self.max_segments < self.min_segments:
            bad("max_segments", f">= min_segments ({self.min_segments})", self.max_segments)
        if self.max_dag_depth < 0:
            bad("max_dag_depth", ">= 0", self.max_dag_depth)
        if self.max_split_fanout < 2:
            bad("max_split_fanout", ">= 2", self.max_split_fanout)
        if not 1 <= self.min_split_width <= HASH_SPACE // 2:
            bad("min_split_width", f"between 1 and {HASH_SPACE // 2}", self.min_split_width)
        for name in (
            "split_cooldown_seconds",
            "merge_cooldown_seconds",
            "merge_window_seconds",
            "load_ttl_seconds",
            "peak_window_seconds",
            "merge_regret_seconds",
            "merge_headroom_half_life_seconds",
            "merge_undo_seconds",
        ):
            value = getattr(self, name)
            if not 0 <= value <= MAX_POLICY_SECONDS:  # also NaN
                bad(name, f"between 0 and {MAX_POLICY_SECONDS:,} (ten years)", value)
        if not self.merge_combined_max_ratio > 0:
            bad("merge_combined_max_ratio", "> 0", self.merge_combined_max_ratio)
        if not 1 <= self.merge_backoff_factor <= MAX_BACKOFF_FACTOR:  # also NaN
            bad(
                "merge_backoff_factor",
                f"between 1 and {MAX_BACKOFF_FACTOR:g}",
                self.merge_backoff_factor,
            )
        decay = self.merge_backoff_decay_seconds
        if not 0 < decay <= MAX_POLICY_SECONDS:
            bad("merge_backoff_decay_seconds", f"> 0 and at most {MAX_POLICY_SECONDS:,}", decay)
        split, merge = self.split_thresholds, self.merge_thresholds
        for attr in ("msg_rate_in", "byte_rate_in", "msg_rate_out", "byte_rate_out"):
            s, m = getattr(split, attr), getattr(merge, attr)
            if not (s > 0 and math.isfinite(s)):
                bad(f"split_thresholds.{attr}", "a finite number > 0", s)
            if not (m >= 0 and math.isfinite(m)):
                bad(f"merge_thresholds.{attr}", "a finite number >= 0", m)
            elif s > 0 and not s > m:
                bad(f"split_thresholds.{attr}", f"> merge_thresholds.{attr} ({shown(m)})", s)
        return errs


MAX_POLICY_SECONDS: Final = 315_360_000
"""Ten years: a longer policy duration is a typo, and in milliseconds it still fits an int64."""

MAX_BACKOFF_STEPS: Final = 6
"""At most this many flip-flops lengthen a merge window (factor ** 6 at most)."""

MAX_BACKOFF_FACTOR: Final = 100.0
"""Largest ``merge_backoff_factor``: 100 ** 6 times a ten-year window is still a finite
number of ms (a factor of 1e60 overflowed the window's float, and decide raised)."""

PULSAR_PARITY: Final[Mapping[str, Any]] = {
    "max_split_fanout": 2,
    "min_split_width": 1,
    "merge_combined_max_ratio": math.inf,
    "load_ttl_seconds": 0.0,
    "peak_window_seconds": 0.0,
    "merge_backoff_factor": 1.0,
    "merge_regret_seconds": 0.0,
    "merge_headroom_half_life_seconds": 0.0,
    "merge_undo_seconds": 0.0,
    "range_split_cooldown": False,
    "split_to_peak": False,
}
"""Our settings at the values that make ``decide`` PIP-483's evaluator, rule for rule
(with samples that carry no ``cold_since_ms``). ``load_aware_splits`` needs no entry:
Pulsar publishes no ``hashBuckets``, and without them boundaries are equal-width."""


# --- JSON wire shapes (Pulsar field names) ----------------------------------

_SEGMENT_FIELDS = frozenset(
    {
        "segmentId",
        "hashRange",
        "state",
        "parentIds",
        "childIds",
        "createdAtEpoch",
        "sealedAtEpoch",
        "createdAtMs",
        "sealedAtMs",
    }
)
_LAYOUT_FIELDS = frozenset({"epoch", "nextSegmentId", "segments", "properties", "autoScalePolicy"})
# Accepted spellings of each rate, canonical first (DESIGN §4: bytesRate* and byteRate*).
_RATE_SPELLINGS: Final = (
    ("msgRateIn",),
    ("byteRateIn", "bytesRateIn"),
    ("msgRateOut",),
    ("byteRateOut", "bytesRateOut"),
)


def _bounded_repr() -> reprlib.Repr:
    limits = reprlib.Repr()  # Python 3.11's takes no keyword arguments
    limits.maxlevel, limits.maxdict, limits.maxlist = 3, 4, 6
    limits.maxstring = limits.maxother = 60
    return limits


_SHOWN: Final = _bounded_repr()


def shown(value: object) -> str:
    """``value`` as a message shows a value it refuses: a bounded repr. A plain repr of
    JSON nested 1,000 deep (orjson reads up to 1,024) raised RecursionError while the
    message was being built, and a long one filled the log line."""
    return _SHOWN.repr(value)


#: Largest int taken as a float without a range check (orjson's ints are 64-bit), and
#: the bound of every stored integer (a signed 64-bit long).
_FLOAT_INT_MAX: Final = 2**63
_STATES: Final = {state.value: state for state in SegmentState}


def _int(obj: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    """An integer that fits a signed 64-bit long: one beyond it (``1e20``) would be
    written back into etcd (a cooldown stamp, a pruned layout) and fail there (orjson)."""
    value = obj.get(key, default)
    if type(value) is int and -_FLOAT_INT_MAX <= value < _FLOAT_INT_MAX:  # the common case
        return value
    if value is None:
        raise ModelError(f"{where}.{key}: missing")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelError(f"{where}.{key}: expected an integer, got {shown(value)}")
    if isinstance(value, float) and not value.is_integer():
        raise ModelError(f"{where}.{key}: expected an integer, got {shown(value)}")
    number = int(value)
    if not -_FLOAT_INT_MAX <= number < _FLOAT_INT_MAX:
        raise ModelError(f"{where}.{key}: out of the 64-bit range, got {shown(value)}")
    return number


def _number(obj: Mapping[str, Any], keys: tuple[str, ...], where: str) -> float:
    for key in keys:
        if key in obj:
            value = obj[key]
            kind = type(value)
            if kind is float and 0.0 <= value < math.inf:  # the common case first; NaN fails
                return value  # type: ignore[no-any-return]
            if kind is int and 0 <= value <= _FLOAT_INT_MAX:
                return float(value)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ModelError(f"{where}.{key}: expected a number, got {shown(value)}")
            number = float(value)
            if not math.isfinite(number) or number < 0:
                raise ModelError(f"{where}.{key}: must be a finite number >= 0, got {shown(value)}")
            return number
    raise ModelError(f"{where}.{keys[0]}: missing")


def _id_list(obj: Mapping[str, Any], key: str, where: str) -> tuple[int, ...]:
    value = obj.get(key)
    if not value:
        return ()
    if not isinstance(value, list):
        raise ModelError(f"{where}.{key}: expected a list of segment ids, got {shown(value)}")
    if all(type(v) is int for v in value):
        return tuple(value)
    return tuple(_int({key: v}, key, where) for v in value)


def _segment_fast(obj: Any) -> Segment | None:
    """A well-formed segment without the checks' bookkeeping; None sends it to the full parse.

    Loading 100,000 layouts spends most of its time here, so the common shape
    (every field of its exact type) is taken in one pass; anything else,
    including every malformed value, goes through :func:`segment_from_json`.
    """
    if type(obj) is not dict:
        return None
    hash_range, state = obj.get("hashRange"), obj.get("state")
    if type(hash_range) is not dict or type(state) is not str:
        return None
    seg_state = _STATES.get(state)
    sid, start, end = obj.get("segmentId"), hash_range.get("start"), hash_range.get("end")
    created_epoch, sealed_epoch = obj.get("createdAtEpoch", 0), obj.get("sealedAtEpoch", -1)
    created_ms, sealed_ms = obj.get("createdAtMs", 0), obj.get("sealedAtMs", -1)
    parents, children = obj.get("parentIds") or [], obj.get("childIds") or []
    if (
        seg_state is None
        or type(sid) is not int
        or type(start) is not int
        or type(end) is not int
        or type(created_epoch) is not int
        or type(sealed_epoch) is not int
        or type(created_ms) is not int
        or type(sealed_ms) is not int
        or type(parents) is not list
        or type(children) is not list
        or not all(type(v) is int for v in parents)
        or not all(type(v) is int for v in children)
        # 64-bit, as _int: orjson reads integers up to 2**64 - 1
        or max(sid, created_epoch, sealed_epoch, created_ms, sealed_ms) >= _FLOAT_INT_MAX
        or min(created_epoch, sealed_epoch, created_ms, sealed_ms) < -_FLOAT_INT_MAX
    ):
        return None
    return Segment(
        sid,
        HashRange(start, end),
        seg_state,
        tuple(parents),
        tuple(children),
        created_epoch,
        sealed_epoch,
        created_ms,
        sealed_ms,
        {k: v for k, v in obj.items() if k not in _SEGMENT_FIELDS},
    )


def segment_from_json(obj: Any, where: str = "segment") -> Segment:
    if not isinstance(obj, Mapping):
        raise ModelError(f"{where}: expected an object, got {shown(obj)}")
    hash_range = obj.get("hashRange")
    if not isinstance(hash_range, Mapping):
        raise ModelError(
            f"{where}.hashRange: expected an object {{start, end}}, got {shown(hash_range)}"
        )
    state = obj.get("state")
    seg_state = _STATES.get(state) if type(state) is str else None
    if seg_state is None:
        try:
            seg_state = SegmentState(str(state).upper())
        except ValueError:
            raise ModelError(
                f"{where}.state: expected ACTIVE or SEALED, got {shown(state)}"
            ) from None
    return Segment(
        segment_id=_int(obj, "segmentId", where),
        hash_range=HashRange(
            _int(hash_range, "start", f"{where}.hashRange"),
            _int(hash_range, "end", f"{where}.hashRange"),
        ),
        state=seg_state,
        parent_ids=_id_list(obj, "parentIds", where),
        child_ids=_id_list(obj, "childIds", where),
        created_at_epoch=_int(obj, "createdAtEpoch", where, 0),
        sealed_at_epoch=_int(obj, "sealedAtEpoch", where, -1),
        created_at_ms=_int(obj, "createdAtMs", where, 0),
        sealed_at_ms=_int(obj, "sealedAtMs", where, -1),
        extra={k: v for k, v in obj.items() if k not in _SEGMENT_FIELDS},
    )


def segment_to_json(segment: Segment) -> dict[str, Any]:
    return {
        **segment.extra,
        "segmentId": segment.segment_id,
        "hashRange": {"start": segment.hash_range.start, "end": segment.hash_range.end},
        "state": segment.state.value,
        "parentIds": list(segment.parent_ids),
        "childIds": list(segment.child_ids),
        "createdAtEpoch": segment.created_at_epoch,
        "sealedAtEpoch": segment.sealed_at_epoch,
        "createdAtMs": segment.created_at_ms,
        "sealedAtMs": segment.sealed_at_ms,
    }


def layout_from_json(obj: Any) -> Layout:
    """Parse ``ScalableTopicMetadata``; unknown fields are kept, never interpreted.

    Does not check the layout invariants: call :func:`controllerd.core.layout.violations`.
    """
    if not isinstance(obj, Mapping):
        raise ModelError(f"layout: expected an object, got {type(obj).__name__}")
    raw_segments = obj.get("segments")
    if isinstance(raw_segments, Mapping):
        items = list(raw_segments.items())
    elif isinstance(raw_segments, list):
        items = [(None, s) for s in raw_segments]
    else:
        raise ModelError(
            f"layout.segments: expected an object keyed by id, got {shown(raw_segments)}"
        )
    segments: dict[int, Segment] = {}
    for key, raw in items:
        seg = _segment_fast(raw) or segment_from_json(
            raw, f"layout.segments[{key if key is not None else '?'}]"
        )
        if key is not None and str(seg.segment_id) != str(key):
            raise ModelError(f"layout.segments[{key}].segmentId: {seg.segment_id} != map key {key}")
        if seg.segment_id in segments:
            raise ModelError(f"layout.segments: duplicate segment id {seg.segment_id}")
        segments[seg.segment_id] = seg
    properties = obj.get("properties") or {}
    if not isinstance(properties, Mapping):
        raise ModelError(f"layout.properties: expected an object, got {shown(properties)}")
    policy = obj.get("autoScalePolicy")
    if policy is not None and not isinstance(policy, Mapping):
        raise ModelError(f"layout.autoScalePolicy: expected an object or null, got {shown(policy)}")
    default_next = max(segments, default=-1) + 1
    return Layout(
        epoch=_int(obj, "epoch", "layout", 0),
        next_segment_id=_int(obj, "nextSegmentId", "layout", default_next),
        segments=segments,
        properties={str(k): str(v) for k, v in properties.items()},
        auto_scale_policy=dict(policy) if policy is not None else None,
        extra={k: v for k, v in obj.items() if k not in _LAYOUT_FIELDS},
    )


def layout_to_json(layout: Layout) -> dict[str, Any]:
    return {
        **layout.extra,
        "epoch": layout.epoch,
        "nextSegmentId": layout.next_segment_id,
        "segments": {
            str(sid): segment_to_json(layout.segments[sid]) for sid in sorted(layout.segments)
        },
        "properties": dict(layout.properties),
        "autoScalePolicy": dict(layout.auto_scale_policy)
        if layout.auto_scale_policy is not None
        else None,
    }


def rates_from_json(obj: Any, where: str = "load") -> Rates:
    if not isinstance(obj, Mapping):
        raise ModelError(f"{where}: expected an object, got {shown(obj)}")
    values = [_number(obj, spellings, where) for spellings in _RATE_SPELLINGS]
    return Rates(*values)


def load_sample_from_json(
    obj: Any, where: str = "load", seen_at_ms: int | None = None
) -> LoadSample:
    """Parse a load record (DESIGN §4).

    A record without timestamps (plain Pulsar) takes ``seen_at_ms``, the time
    the caller first saw this version of it; without that it is an error.
    ``changedAtMs`` defaults to ``sampledAtMs``.
    """
    rates = rates_from_json(obj, where)
    sampled = _int(obj, "sampledAtMs", where) if obj.get("sampledAtMs") is not None else None
    if obj.get("changedAtMs") is not None:
        changed = _int(obj, "changedAtMs", where)
    elif sampled is not None:
        changed = sampled
    elif seen_at_ms is not None:
        changed = seen_at_ms
    else:
        raise ModelError(f"{where}.changedAtMs: missing (and no sampledAtMs)")
    cold = _int(obj, "coldSinceMs", where) if obj.get("coldSinceMs") is not None else None
    peak = obj.get("peakRates")
    flipflops = _int(obj, "flipflops", where, 0)
    if flipflops < 0:
        raise ModelError(f"{where}.flipflops: must be >= 0, got {shown(flipflops)}")
    merged = _int(obj, "merged", where, 0)
    if merged < 0:
        raise ModelError(f"{where}.merged: must be >= 0, got {shown(merged)}")
    return LoadSample(
        rates,
        changed,
        sampled,
        cold,
        hash_buckets=hash_buckets_from_json(obj.get("hashBuckets")),
        peak_rates=rates_from_json(peak, f"{where}.peakRates") if peak is not None else None,
        flipflops=flipflops,
        last_flipflop_ms=_int(obj, "lastFlipflopMs", where)
        if obj.get("lastFlipflopMs") is not None
        else None,
        rise=_number(obj, ("rise",), where) if obj.get("rise") is not None else 0.0,
        merged=merged,
    )


PlainLoad = tuple[float, float, float, float, int, int | None]
"""msg in, byte in, msg out, byte out, changed ms, sampled ms (None: unknown)."""


#: A rate of a plain record: a finite number >= 0 (JSON has no NaN or infinity, and
#: a literal beyond a double's range fails the decode).
_PlainRate = Annotated[float, msgspec.Meta(ge=0.0)]
#: A time stamp of a plain record: a signed 64-bit integer, which orjson reads as one
#: too (it turns a longer one into a float, which the full parse reads its own way).
_PlainStamp = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class _PlainRecord(msgspec.Struct, forbid_unknown_fields=True):
    """The common load record's only keys; any other key (an extension, or one we
    do not know) fails the decode, and the record takes the full parse."""

    msgRateIn: _PlainRate | msgspec.UnsetType = msgspec.UNSET
    byteRateIn: _PlainRate | msgspec.UnsetType = msgspec.UNSET
    bytesRateIn: _PlainRate | msgspec.UnsetType = msgspec.UNSET
    msgRateOut: _PlainRate | msgspec.UnsetType = msgspec.UNSET
    byteRateOut: _PlainRate | msgspec.UnsetType = msgspec.UNSET
    bytesRateOut: _PlainRate | msgspec.UnsetType = msgspec.UNSET
    sampledAtMs: _PlainStamp | msgspec.UnsetType | None = msgspec.UNSET
    changedAtMs: _PlainStamp | msgspec.UnsetType | None = msgspec.UNSET


_decode_plain: Final = msgspec.json.Decoder(_PlainRecord).decode
_UNSET: Final = msgspec.UNSET


def plain_load_json(value: bytes, seen_at_ms: int) -> PlainLoad | None:
    """The common load record (four rates, optional time stamps, nothing else)
    read straight from its bytes, parsed and checked in C by msgspec with no
    dict built: 0.6 us against 1.7 us for ``orjson.loads`` and a check in
    Python (issue #12: a follower applies tens of thousands a second).

    Invariant: when it returns a row, ``load_sample_from_json(orjson.loads(value),
    seen_at_ms=seen_at_ms)`` gives a sample with those fields and no extension;
    None only means "not the common shape", never "invalid", so the caller
    parses the record the full way, which also names what is wrong.
    """
    try:
        record = _decode_plain(value)
    except Exception:  # any failure only means "not plain": the full parse names it
        return None
    a, c = record.msgRateIn, record.msgRateOut
    b = record.byteRateIn
    if b is _UNSET:
        b = record.bytesRateIn
    d = record.byteRateOut
    if d is _UNSET:
        d = record.bytesRateOut
    if a is _UNSET or b is _UNSET or c is _UNSET or d is _UNSET:
        return None
    sampled = record.sampledAtMs
    changed = record.changedAtMs
    if sampled is _UNSET:
        sampled = None
    if changed is _UNSET or changed is None:
        changed = seen_at_ms if sampled is None else sampled
    return a, b, c, d, changed, sampled


MAX_HASH_BUCKETS: Final = 32
"""Most slices a ``hashBuckets`` histogram may have (the wire format's limit)."""


def hash_buckets_from_json(value: Any) -> tuple[float, ...] | None:
    """A ``hashBuckets`` array, or None when absent or malformed.

    The wire format: 1 to 32 finite numbers >= 0; slice i of n covers hashes
    ``[start + (i*W)//n, start + ((i+1)*W)//n - 1]`` of the segment's range.
    A malformed histogram is dropped on its own and never rejects the record:
    it only refines split boundaries, and without it they are equal-width.
    """
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_HASH_BUCKETS:
        return None
    out: list[float] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | float):
            return None
        if isinstance(item, int) and not 0 <= item <= _FLOAT_INT_MAX:
            return None  # float() of an integer beyond a double raises OverflowError
        number = float(item)
        if not (math.isfinite(number) and number >= 0):
            return None
        out.append(number)
    return tuple(out)


def load_sample_to_json(sample: LoadSample) -> dict[str, Any]:
    r = sample.rates
    out: dict[str, Any] = {
        "msgRateIn": r.msg_rate_in,
        "byteRateIn": r.byte_rate_in,
        "msgRateOut": r.msg_rate_out,
        "byteRateOut": r.byte_rate_out,
        "changedAtMs": sample.changed_at_ms,
    }
    if sample.sampled_at_ms is not None:
        out["sampledAtMs"] = sample.sampled_at_ms
    if sample.cold_since_ms is not None:
        out["coldSinceMs"] = sample.cold_since_ms
    if sample.hash_buckets is not None:
        out["hashBuckets"] = list(sample.hash_buckets)
    if sample.peak_rates is not None:
        p = sample.peak_rates
        out["peakRates"] = {
            "msgRateIn": p.msg_rate_in,
            "byteRateIn": p.byte_rate_in,
            "msgRateOut": p.msg_rate_out,
            "byteRateOut": p.byte_rate_out,
        }
    if sample.flipflops:
        out["flipflops"] = sample.flipflops
    if sample.last_flipflop_ms is not None:
        out["lastFlipflopMs"] = sample.last_flipflop_ms
    if sample.rise:
        out["rise"] = sample.rise
    if sample.merged:
        out["merged"] = sample.merged
    return out
