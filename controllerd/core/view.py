"""The controller's in-memory mirror of etcd: key layout and parsed topic state.

Pure (no I/O): the daemon feeds it the initial listing and then every watch
event; it answers what changed and whether that change should trigger an
evaluation. A value that does not parse is *rejected* (returned, so the caller
logs and counts it) and never raises; a topic whose layout is malformed or
breaks the invariants has no layout until a valid one arrives, so nothing
acts on it.

Keys (DESIGN §3), ``M`` = metadata prefix, ``C`` = controller root::

    M/topics/<t>/<ns>/<topic>                                  layout JSON
    M/topics/<t>/<ns>/<topic>/subscriptions/<sub>              {"type": ...}
    M/topics/<t>/<ns>/<topic>/subscriptions/<sub>/consumers/<c> registration
    M/topics/<t>/<ns>/<topic>/segments/<id>/load               load record
    C/leader  C/cooldowns/<topic>  C/policies/<t>[/<ns>]
    C/cold-since/<topic>/<id>  C/pending-deletes/<topic>/<descriptor>
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from controllerd.core.layout import LayoutError, check
from controllerd.core.model import (
    Layout,
    LoadSample,
    ModelError,
    TopicName,
    layout_from_json,
    load_sample_from_json,
)

ChangeKind = Literal["layout", "subscription", "consumer", "load", "policy", "cooldown", "cold"]


@dataclass(frozen=True, slots=True)
class Keys:
    """Builds and parses every etcd key controllerd reads or writes."""

    metadata_prefix: str
    controller_root: str

    @property
    def topics_prefix(self) -> str:
        return f"{self.metadata_prefix}/topics/"

    def layout(self, topic: TopicName) -> str:
        return f"{self.topics_prefix}{topic.path}"

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
        return f"{self.controller_root}/cooldowns/{topic.path}"

    def policy(self, tenant: str, namespace: str | None = None) -> str:
        suffix = f"/{namespace}" if namespace else ""
        return f"{self.controller_root}/policies/{tenant}{suffix}"

    def cold_since(self, topic: TopicName, segment_id: int) -> str:
        return f"{self.controller_root}/cold-since/{topic.path}/{segment_id}"

    @property
    def pending_deletes_prefix(self) -> str:
        return f"{self.controller_root}/pending-deletes/"

    def pending_delete(self, topic: TopicName, descriptor: str) -> str:
        return f"{self.pending_deletes_prefix}{topic.path}/{descriptor}"


@dataclass(frozen=True, slots=True)
class Cooldown:
    """When the last split/merge the broker confirmed happened (-1: never)."""

    last_split_ms: int = -1
    last_merge_ms: int = -1

    def to_json(self) -> dict[str, int]:
        return {"lastSplitAtMs": self.last_split_ms, "lastMergeAtMs": self.last_merge_ms}


def seeded_cooldown(layout: Layout) -> Cooldown:
    """Cooldown stamps derived from a layout, for topics with none persisted.

    A split child has one parent and a merge child two; the newest of each
    kind still in the layout dates the last operation of that kind.
    """
    last_split = last_merge = -1
    for seg in layout.segments.values():
        if len(seg.parent_ids) == 1:
            last_split = max(last_split, seg.created_at_ms)
        elif len(seg.parent_ids) >= 2:
            last_merge = max(last_merge, seg.created_at_ms)
    return Cooldown(last_split, last_merge)


@dataclass
class TopicState:
    """Everything known about one topic. Mutated only by :class:`MetadataView`."""

    name: TopicName
    layout: Layout | None = None
    layout_revision: int = 0
    layout_error: str | None = None
    subscriptions: dict[str, str] = field(default_factory=dict)
    consumers: dict[str, set[str]] = field(default_factory=dict)
    loads: dict[int, LoadSample] = field(default_factory=dict)
    # segment id -> (mod revision, ms when first seen): the fallback timestamp of
    # records without one (plain Pulsar, DESIGN §4).
    load_seen: dict[int, tuple[int, int]] = field(default_factory=dict)
    cooldown: Cooldown | None = None
    cold_since: dict[int, int] = field(default_factory=dict)

    def consumer_counts(self) -> dict[str, int]:
        """Consumers per STREAM/CHECKPOINT subscription (QUEUE ones never split)."""
        return {
            sub: len(names)
            for sub, names in self.consumers.items()
            if self.subscriptions.get(sub, "STREAM") != "QUEUE"
        }

    def effective_cooldown(self) -> Cooldown:
        if self.cooldown is not None:
            return self.cooldown
        return seeded_cooldown(self.layout) if self.layout is not None else Cooldown()


@dataclass(frozen=True, slots=True)
class Change:
    """A watch event that mattered; ``trigger`` asks for an evaluation of ``topic`` now."""

    kind: ChangeKind
    topic: TopicName | None
    trigger: bool


@dataclass(frozen=True, slots=True)
class Rejected:
    """A value that was skipped; ``kind`` is the metric label (layout, load, ...)."""

    key: str
    kind: str
    reason: str


Outcome = Change | Rejected | None


def _json(value: bytes) -> Any:
    return json.loads(value.decode("utf-8"))


class MetadataView:
    """All topics under the metadata prefix, plus controller-owned state."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.topics: dict[TopicName, TopicState] = {}
        self.overrides: dict[tuple[str, str | None], Mapping[str, Any]] = {}

    def topic(self, name: TopicName) -> TopicState:
        state = self.topics.get(name)
        if state is None:
            state = self.topics[name] = TopicState(name)
        return state

    def overrides_for(self, topic: TopicName) -> tuple[Mapping[str, Any] | None, ...]:
        """Tenant then namespace override, broadest first."""
        return (
            self.overrides.get((topic.tenant, None)),
            self.overrides.get((topic.tenant, topic.namespace)),
        )

    # -- events --------------------------------------------------------------------------

    def apply_put(self, key: str, value: bytes, mod_revision: int, now_ms: int) -> Outcome:
        try:
            if key.startswith(self.keys.topics_prefix):
                return self._put_metadata(key, value, mod_revision, now_ms)
            if key.startswith(self.keys.controller_prefix):
                return self._put_controller(key, value)
        except (ModelError, LayoutError, ValueError, UnicodeDecodeError) as exc:
            kind = self._kind_of(key)
            if kind == "layout":
                self._drop_layout(key, str(exc))
            return Rejected(key, kind, str(exc))
        return None

    def apply_delete(self, key: str) -> Outcome:
        try:
            if key.startswith(self.keys.topics_prefix):
                return self._delete_metadata(key)
            if key.startswith(self.keys.controller_prefix):
                return self._delete_controller(key)
        except (ModelError, ValueError) as exc:
            return Rejected(key, self._kind_of(key), str(exc))
        return None

    # -- metadata prefix -----------------------------------------------------------------

    def _split_metadata(self, key: str) -> tuple[TopicName, list[str]] | None:
        parts = key[len(self.keys.topics_prefix) :].split("/")
        if len(parts) < 3:
            return None
        try:
            return TopicName(*parts[:3]), parts[3:]
        except ModelError:
            return None

    def _kind_of(self, key: str) -> str:
        parsed = self._split_metadata(key) if key.startswith(self.keys.topics_prefix) else None
        if parsed is None:
            return "policy" if "/policies/" in key else "controller"
        rest = parsed[1]
        if not rest:
            return "layout"
        if rest[0] == "segments":
            return "load"
        return "consumer" if len(rest) == 4 else "subscription"

    def _drop_layout(self, key: str, error: str) -> None:
        parsed = self._split_metadata(key)
        if parsed is not None and not parsed[1]:
            state = self.topic(parsed[0])
            state.layout, state.layout_error = None, error

    def _put_metadata(self, key: str, value: bytes, mod_revision: int, now_ms: int) -> Outcome:
        parsed = self._split_metadata(key)
        if parsed is None:
            return None
        name, rest = parsed
        match rest:
            case []:
                layout = check(layout_from_json(_json(value)))
                state = self.topic(name)
                state.layout, state.layout_revision, state.layout_error = layout, mod_revision, None
                for sid in [s for s in state.loads if s not in layout.segments]:
                    del state.loads[sid]
                    state.load_seen.pop(sid, None)
                for sid in [s for s in state.cold_since if s not in layout.segments]:
                    del state.cold_since[sid]
                return Change("layout", name, True)
            case ["subscriptions", sub]:
                raw = _json(value) if value.strip() else {}
                kind = str(raw.get("type", "STREAM")).upper() if isinstance(raw, dict) else ""
                if kind not in ("STREAM", "QUEUE", "CHECKPOINT"):
                    raise ModelError(f"subscription type {raw!r} is not STREAM|QUEUE|CHECKPOINT")
                state = self.topic(name)
                changed = state.subscriptions.get(sub) != kind
                state.subscriptions[sub] = kind
                return Change("subscription", name, changed)
            case ["subscriptions", sub, "consumers", consumer]:
                names = self.topic(name).consumers.setdefault(sub, set())
                new = consumer not in names
                names.add(consumer)
                return Change("consumer", name, new)
            case ["segments", sid_text, "load"]:
                sid = int(sid_text)
                state = self.topic(name)
                seen = state.load_seen.get(sid)
                first_seen = seen[1] if seen is not None and seen[0] == mod_revision else now_ms
                sample = load_sample_from_json(_json(value), f"load[{sid}]", seen_at_ms=first_seen)
                state.loads[sid] = sample
                state.load_seen[sid] = (mod_revision, first_seen)
                return Change("load", name, True)
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
                return Change("layout", name, False)
            case ["subscriptions", sub]:
                state.subscriptions.pop(sub, None)
                state.consumers.pop(sub, None)
                return Change("subscription", name, True)
            case ["subscriptions", sub, "consumers", consumer]:
                names = state.consumers.get(sub, set())
                gone = consumer in names
                names.discard(consumer)
                return Change("consumer", name, gone)
            case ["segments", sid_text, "load"]:
                sid = int(sid_text)
                state.loads.pop(sid, None)
                state.load_seen.pop(sid, None)
                return Change("load", name, False)
        return None

    # -- controller prefix ---------------------------------------------------------------

    def _controller_parts(self, key: str) -> list[str]:
        return key[len(self.keys.controller_prefix) :].split("/")

    def _put_controller(self, key: str, value: bytes) -> Outcome:
        match self._controller_parts(key):
            case ["policies", tenant, *ns] if len(ns) <= 1:
                raw = _json(value)
                if not isinstance(raw, dict):
                    raise ModelError("policy override must be a JSON object")
                self.overrides[(tenant, ns[0] if ns else None)] = raw
                return Change("policy", None, True)
            case ["cooldowns", t, n, topic]:
                raw = _json(value)
                if not isinstance(raw, dict):
                    raise ModelError("cooldown must be a JSON object")
                self.topic(TopicName(t, n, topic)).cooldown = Cooldown(
                    int(raw.get("lastSplitAtMs", -1)), int(raw.get("lastMergeAtMs", -1))
                )
                return Change("cooldown", TopicName(t, n, topic), False)
            case ["cold-since", t, n, topic, sid]:
                self.topic(TopicName(t, n, topic)).cold_since[int(sid)] = int(_json(value))
                return Change("cold", TopicName(t, n, topic), False)
        return None

    def _delete_controller(self, key: str) -> Outcome:
        match self._controller_parts(key):
            case ["policies", tenant, *ns] if len(ns) <= 1:
                self.overrides.pop((tenant, ns[0] if ns else None), None)
                return Change("policy", None, True)
            case ["cooldowns", t, n, topic]:
                state = self.topics.get(TopicName(t, n, topic))
                if state is not None:
                    state.cooldown = None
                return Change("cooldown", TopicName(t, n, topic), False)
            case ["cold-since", t, n, topic, sid]:
                state = self.topics.get(TopicName(t, n, topic))
                if state is not None:
                    state.cold_since.pop(int(sid), None)
                return Change("cold", TopicName(t, n, topic), False)
        return None
