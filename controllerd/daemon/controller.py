"""Observe the view, decide with the pure core, act through the broker.

One :class:`Controller` lives as long as the process. It acts only on the
topics whose *scope* this replica leads: the whole cluster in single mode
(scope ``None``), or one shard per scope in sharded mode. Leadership of a
scope is granted and revoked by the runtime; the view is kept warm by the
:class:`~controllerd.daemon.follower.Follower` whether we lead or not.

Invariants:

* per topic at most one evaluation runs at a time; a trigger that arrives
  meanwhile is remembered and the topic is evaluated exactly once more
  afterwards, so no trigger is lost and a burst costs one re-run;
* triggers are coalesced in a de-duplicated queue served by a fixed pool of
  workers (urgent events before background ticks), never a task per trigger;
  timers (settling, retries, cooldown follow-ups) share one heap and one task;
* nothing acts unless the topic's scope is led *at that instant*
  (:meth:`Leadership.is_leader` reads the lease deadline), and every mutation
  carries the scope's fencing key and token; GC's prune and every write of
  our own state is an etcd transaction fenced on that key;
* a cooldown is stamped only after the broker confirmed the operation (or
  the layout proves an unanswered request was applied); a broker failure
  releases the guard, stamps nothing and retries on the shared backoff;
* a held-back decision (split or merge cooldown, whoever stamped it)
  schedules exactly one follow-up evaluation when the cooldown ends;
* loops over all topics run in slices and yield, so the event loop never
  stalls on 100,000 topics;
* while the first load runs (:meth:`start_partial`), a topic counts as led
  only once the follower reported every key it can have as loaded
  (:meth:`whole`): at 100,000 topics a leader acts on the first topics
  seconds after it starts instead of after the whole load, and never on a
  topic it has seen only part of. GC waits for the whole view.
"""

from __future__ import annotations

import collections
import dataclasses
import gc as collector
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import anyio
import anyio.abc
import anyio.lowlevel
import orjson
import structlog

from controllerd.adapters import backoff
from controllerd.adapters.audit import AuditSink
from controllerd.adapters.broker import (
    BrokerClient,
    BrokerError,
    Fenced,
    Known,
    Unaddressable,
    Unauthorized,
)
from controllerd.adapters.election import Leadership
from controllerd.adapters.store import Compare, Delete, KeyValue, Put, Store, StoreError
from controllerd.config import Config
from controllerd.core import gc
from controllerd.core.layout import prune
from controllerd.core.model import (
    Decision,
    HashRange,
    Layout,
    LoadSample,
    Merge,
    ModelError,
    NoAction,
    PolicySettings,
    Rates,
    Segment,
    Split,
    TopicName,
    decision_to_json,
    layout_from_json,
    layout_to_json,
)
from controllerd.core.policy import (
    PolicyInvalid,
    TopicHistory,
    below,
    decide,
    inherited_cold_since,
    is_stale,
    observes_records,
    resolve_policy,
)
from controllerd.core.pulsar import (
    erased_override_keys,
    pulsar_autoscaler_enabled,
    pulsar_override,
    rest_path_topic,
)
from controllerd.core.shards import shard_of
from controllerd.core.view import (
    Change,
    Cooldown,
    MetadataView,
    Outcome,
    Peek,
    PendingDelete,
    Rejected,
    TopicState,
    has_own_state,
    orphaned,
    parse_json,
    parse_pending_delete,
)
from controllerd.daemon.clock import Clock
from controllerd.daemon.metrics import Metrics
from controllerd.daemon.pacer import Pacer

log = structlog.get_logger("controllerd.daemon.controller")

#: How long to wait for the broker's new layout to show up in etcd after an
#: operation before evaluating the topic on the old one again.
LAYOUT_CATCH_UP_SECONDS: Final = 5.0
#: Evaluations (and so admin calls) in flight at once across topics: the workers.
MAX_CONCURRENT_EVALUATIONS: Final = 16
#: Backlog calls one topic's GC has in flight at once. With the evaluation workers'
#: calls that is at most 32 of the broker client's 100 pooled connections (httpx's
#: default), so GC never makes a split or merge wait for a connection (the wait counts
#: against that call's timeout), and 16 fit within the pool's 20 kept-alive ones.
GC_BACKLOG_CALLS: Final = 16
#: Topics handled between two yields to the event loop in loops over all topics.
SLICE: Final = 500
#: The share of the event loop background work may take (the tick's pass, a term's
#: first pass, the GC round), and its longest run between two waits; the rest stays
#: with the follower and urgent evaluations (see :mod:`controllerd.daemon.pacer`).
BACKGROUND_SHARE: Final = 0.5
BACKGROUND_BURST: Final = 0.005
#: The loop counts as contended (background work is paced) while the follower applied
#: a value this recently, or urgent evaluations are queued.
CONTENDED_SECONDS: Final = 0.05
#: How long a change seen while another replica led is remembered, so a new leader
#: evaluates it before the rest of its topics (the leaderless gap is at most a TTL).
MISSED_WINDOW_SECONDS: Final = 60.0
#: Every this many ticks evaluate every led topic, quiet ones included (see ``_quiet``).
FULL_PASS_EVERY: Final = 10
#: Most puts/deletes of our own state in one fenced transaction (etcd allows 128).
WRITE_BATCH: Final = 100
#: Seconds our own state writes may wait to be batched.
WRITE_DELAY: Final = 0.05
#: Why a topic is left alone: its own ``enabled: true`` turned Pulsar's evaluator back on.
PULSAR_OWNS: Final = (
    "Pulsar's own auto-scaler is on for this topic (autoScalePolicy.enabled = true in the "
    "topic or namespace policy): controllerd leaves it to Pulsar rather than fight it"
)
#: The pending-delete marker's field with the layout revision its prune was computed on:
#: a layout key created after it belongs to a topic created again under the name.
PRUNED_FROM: Final = "layoutRevision"
#: Follow-up reasons that wait for a cooldown to end.
_HELD_BACK: Final = {"split-cooldown": "split", "merge-cooldown": "merge"}

Scope = int | None
"""``None``: every topic (single mode); an int: one shard (sharded mode)."""
_Queued = tuple[bytes | None, Scope]
"""A write of our own state queued: its value (None: delete the key) and its scope."""
_Batches = dict[Scope, list[tuple[str, _Queued]]]
"""A flush's batches being filled, a scope's at most one: (key, queued) pairs."""


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """What /status shows of a recent decision."""

    ts_ms: int
    topic: str
    decision: dict[str, Any]
    outcome: str


@dataclass(slots=True)
class _Attempt:
    """The last operation we attempted on a topic, how many times in a row it failed,
    and the clock's monotonic time before which its backoff forbids another attempt."""

    decision: dict[str, Any]
    failures: int
    retry_at: float = 0.0


class Controller:
    """The control loop for every topic of every scope this replica leads."""

    def __init__(
        self,
        *,
        config: Callable[[], Config],
        store: Store,
        broker: BrokerClient,
        view: MetadataView,
        metrics: Metrics,
        audit: AuditSink,
        clock: Clock,
        replica: str,
        history: collections.deque[DecisionRecord] | None = None,
        shards: int | None = None,
        on_operator_error: Callable[[str, str], None] | None = None,
    ) -> None:
        self._config = config
        self._store = store
        self._broker = broker
        self.view = view
        view.writes_state = self._writes_state
        self._metrics = metrics
        self._audit = audit
        self._clock = clock
        self._replica = replica
        self._shards = shards
        self._on_operator_error = on_operator_error
        self.history = history if history is not None else collections.deque(maxlen=100)
        self._keys = view.keys
        self._scopes: dict[Scope, Leadership] = {}
        self._scope_cache: dict[TopicName, int] = {}
        self._by_shard: dict[int, set[TopicName]] = {}
        self._granted: set[Scope] = set()  # scopes whose topics still need a first evaluation
        # Topics whose change would have triggered an evaluation had we led them, with
        # when (ms), oldest first: a new leader evaluates these first, since the old
        # leader may have died before it acted on them.
        self._missed: dict[TopicName, int] = {}
        # Topics whose last evaluation found them quiet (balanced, nothing hot, nothing
        # that could merge), with the view version and policy it saw: until either
        # changes, time alone cannot change that answer, so ticks skip them (issue #12:
        # a tick evaluating 100,000 topics took 16 s of CPU).
        self._quiet: dict[TopicName, _QuietMark] = {}
        self._ticks = 0
        # The tickers' sleeps until their next tick: a reload cancels them, so a lowered
        # interval applies now, not once the old one ran out (600 s lowered to 1 s by
        # SIGHUP: the next tick came up to 600 s later).
        self._tick_sleeps: set[anyio.CancelScope] = set()
        self._scan = anyio.Event()
        # The work queue. Urgent topics go straight to the workers; background ones
        # (ticks, first passes) wait in _background until the feeder, paced, moves them
        # to _released. A topic is queued while in _queued; entries of other deques
        # for it are stale and skipped.
        self._urgent: collections.deque[TopicName] = collections.deque()
        self._background: collections.deque[TopicName] = collections.deque()
        self._released: collections.deque[TopicName] = collections.deque()
        self._background_items = anyio.Semaphore(0)
        self._last_applied = -math.inf  # when (the pacer's time) the follower last applied
        self._pacer = Pacer(
            BACKGROUND_SHARE,
            BACKGROUND_BURST,
            on_wait=metrics.background_paced.inc,
            contended=self._contended,
        )
        self._queued: set[TopicName] = set()
        self._in_flight: dict[TopicName, anyio.CancelScope] = {}
        self._again: set[TopicName] = set()
        self._items = anyio.Semaphore(0)
        # timers: (due monotonic, seq, topic, why)
        self._timers: list[tuple[float, int, TopicName, str]] = []
        self._timer_seq = itertools.count()
        self._timer_scope: anyio.CancelScope | None = None
        self._settling: set[TopicName] = set()
        self._followups: dict[TopicName, float] = {}
        # per-topic memory
        self._awaiting: dict[TopicName, tuple[int, float]] = {}
        self._attempts: dict[TopicName, _Attempt] = {}
        self._unaddressable: set[TopicName] = set()
        # operations done whose new layout we wait for, to carry the history over
        self._applied: dict[
            TopicName,
            tuple[Layout, Split | Merge, PolicySettings, Mapping[int, LoadSample], int],
        ] = {}
        # topic -> the leadership token under which we last wrote its history or cold-since
        self._state_term: dict[TopicName, int] = {}
        self._config_generation = 0
        self._shared: dict[tuple[int, ...], PolicySettings | PolicyInvalid] = {}
        self._shared_generation = (-1, -1)
        self._config_seen: Config | None = None
        # our own state, written behind in fenced batches: key -> (value or None, scope)
        self._writes: dict[str, tuple[bytes | None, Scope]] = {}
        # topics gone from etcd whose keys of ours the writer deletes: topic -> scope
        self._forgotten: dict[TopicName, Scope] = {}
        #: pending-delete markers refused at the last GC round, key -> mod revision: the
        #: same version is not parsed, counted and logged again every round
        self._bad_markers: dict[str, int] = {}
        # topics only our keys named at the first load (deleted while no one led): their
        # keys go once we lead them
        self._orphans: set[TopicName] = set()
        self._write_wake = anyio.Event()
        self._running = False
        # While the first load runs: the topics whose keys are all in the view, the
        # only ones we may act on. None once the view is whole (or never partial).
        self._whole: set[TopicName] | None = None
        # Led topics this term has not evaluated yet: the first pass's progress after a
        # grant, in /status (complete only once the scanner and the load are done).
        self._first_pass: set[TopicName] = set()
        # The same by shard (sharded mode): a revoke removes its shard's topics without
        # a walk over the whole first pass (128 revokes at 100,000 topics held the loop 14 s).
        self._first_pass_of: dict[int, set[TopicName]] = {}
        self._scanning = 0
        self.ready = anyio.Event()

    # -- scopes ---------------------------------------------------------------------------

    def scope_of(self, topic: TopicName) -> Scope:
        if self._shards is None:
            return None
        shard = self._scope_cache.get(topic)
        if shard is None:
            shard = self._scope_cache[topic] = shard_of(topic, self._shards)
        return shard

    def leadership_for(self, topic: TopicName) -> Leadership | None:
        """The leadership to act on ``topic`` with, only while it is valid (and the
        topic is whole in the view)."""
        if self._whole is not None and topic not in self._whole:
            return None
        leadership = self._scopes.get(self.scope_of(topic))
        return leadership if leadership is not None and leadership.is_leader() else None

    def leads(self, topic: TopicName) -> bool:
        return self.leadership_for(topic) is not None

    def _writes_state(self, topic: TopicName) -> bool:
        """Whether ``topic``'s stored history and cold-since keys are ours, written this
        term: the view then keeps what we hold (see ``MetadataView.writes_state``). A
        value from before our term (a predecessor's, or the first load) is applied as ever."""
        leadership = self.leadership_for(topic)
        return leadership is not None and self._state_term.get(topic) == leadership.token

    @property
    def scopes(self) -> Mapping[Scope, Leadership]:
        return self._scopes

    def start_partial(self) -> None:
        """The view is about to be loaded: act on no topic until :meth:`whole` says so."""
        self._whole = set()

    def whole(self, topics: Iterable[TopicName] | None) -> None:
        """``topics`` are now whole in the view (``None``: every topic, for good);
        queue the ones we lead for a first evaluation."""
        if self._whole is None:
            return
        if topics is None:
            newly = [t for t in self.view.topics if t not in self._whole]
            self._whole = None
        else:
            newly = list(topics)
            self._whole.update(newly)
        for topic in newly:
            if self.leads(topic):
                self._first_evaluation(topic, urgent=False)
        if self._whole is None:
            self._forget_orphans()

    def _first_evaluation(self, topic: TopicName, *, urgent: bool) -> None:
        """Queue a led topic's first evaluation of this term, counted in /status until done."""
        self._first_pass.add(topic)
        shard = self.scope_of(topic)
        if shard is not None:
            self._first_pass_of.setdefault(shard, set()).add(topic)
        self.trigger(topic, urgent=urgent)

    def _first_pass_done(self, topic: TopicName, shard: Scope) -> None:
        """``topic`` (of ``shard``) needs no first evaluation any more."""
        self._first_pass.discard(topic)
        if shard is not None:
            of_shard = self._first_pass_of.get(shard)
            if of_shard is not None:
                of_shard.discard(topic)
                if not of_shard:
                    del self._first_pass_of[shard]

    @property
    def partial(self) -> bool:
        """Whether the first load still runs (only whole topics are acted on)."""
        return self._whole is not None

    @property
    def first_pass_remaining(self) -> int | None:
        """Led topics not evaluated yet since we began to lead; None while still unknown
        (the view loading, or the topics of a grant being queued)."""
        if self.partial or self._scanning or self._granted:
            return None
        return len(self._first_pass)

    def grant(self, scope: Scope, leadership: Leadership) -> None:
        """We now lead ``scope``: evaluate every topic in it (in the background).

        Grants arriving together (a replica claiming 128 shards) share one pass
        over the topics, made by the ``scanner`` in slices.
        """
        self._scopes[scope] = leadership
        self._granted.add(scope)
        self._scan.set()
        self._forget_orphans()
        self._metrics.shards_owned.set(sum(1 for s in self._scopes if s is not None))

    def revoke(self, scope: Scope) -> None:
        """We no longer lead ``scope``: stop every evaluation in it at once."""
        self._scopes.pop(scope, None)
        self._granted.discard(scope)
        if scope is None:
            self._first_pass.clear()
            self._first_pass_of.clear()
        else:
            self._first_pass.difference_update(self._first_pass_of.pop(scope, ()))
        self._metrics.shards_owned.set(sum(1 for s in self._scopes if s is not None))
        for topic, cancel in list(self._in_flight.items()):
            if scope is None or self.scope_of(topic) == scope:
                cancel.cancel()

    async def _scanner(self) -> None:
        """Queue every topic of newly granted scopes, one sliced pass per batch of grants."""
        while True:
            await self._scan.wait()
            self._scan = anyio.Event()
            granted, self._granted = self._granted, set()
            self._forget_missed()
            self._scanning += 1
            try:
                mark = self._pacer.now()
                for i, topic in enumerate(reversed(list(self._missed))):  # most recent first
                    if self.scope_of(topic) in granted and self.leads(topic):
                        self._first_evaluation(topic, urgent=True)
                    if i % SLICE == SLICE - 1:
                        await anyio.lowlevel.checkpoint()
                for i, topic in enumerate(self._topics_in(granted)):
                    if self.leads(topic):
                        self._first_evaluation(topic, urgent=False)
                    if i % SLICE == SLICE - 1:
                        mark = await self._pacer.pause(mark)
            finally:
                self._scanning -= 1

    # -- lifecycle ------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve triggers, timers, ticks and GC until cancelled."""
        self._running = True
        try:
            async with anyio.create_task_group() as tg:
                for i in range(MAX_CONCURRENT_EVALUATIONS):
                    tg.start_soon(self._worker, name=f"evaluator-{i}")
                tg.start_soon(self._feeder, name="background-feeder")
                tg.start_soon(self._timer_loop, name="timers")
                tg.start_soon(self._ticker, name="ticker")
                tg.start_soon(self._gc_ticker, name="gc")
                tg.start_soon(self._writer, name="state-writer")
                tg.start_soon(self._scanner, name="scanner")
                self.ready.set()
        finally:
            self._running = False

    # -- events ---------------------------------------------------------------------------

    def watch_restarted(self) -> None:
        """The follower re-established a metadata watch (after an error or a compaction)."""
        self._metrics.watch_restarts.inc()

    def note(self, outcome: Outcome) -> None:
        """One applied etcd value (from the follower): count rejections, trigger work."""
        self._last_applied = self._pacer.now()
        if outcome is None:
            return
        if isinstance(outcome, Rejected):
            self._metrics.metadata_rejected.labels(kind=outcome.kind).inc()
            if outcome.kind == "load":
                self._metrics.load_records_rejected.labels(reason=outcome.cause).inc()
            elif outcome.kind == "layout":
                self._metrics.layouts_rejected.labels(reason=outcome.cause).inc()
            log.warning(
                "metadata.rejected",
                key=outcome.key,
                kind=outcome.kind,
                cause=outcome.cause,
                reason=outcome.reason,
            )
            return
        if outcome.kind == "layout" and outcome.topic is not None:
            self._layout_arrived(outcome.topic)
            self._index(outcome.topic)
            self._carry_history(outcome.topic)
            if outcome.topic not in self.view.topics:  # deleted: forget what we kept
                # First: _forget asks the topic's scope, which caches it again.
                self._forget(outcome.topic)
                self._first_pass_done(outcome.topic, self.scope_of(outcome.topic))
                for memory in (
                    self._scope_cache,
                    self._attempts,
                    self._awaiting,
                    self._applied,
                    self._state_term,
                    self._missed,
                    self._quiet,
                ):
                    memory.pop(outcome.topic, None)
                self._unaddressable.discard(outcome.topic)
            self._metrics.topics.set(len(self.view.topics))
        if outcome.kind == "policy":
            self._config_generation += 1  # every topic's resolved policy is stale
        if not outcome.trigger or not self._running:
            return
        if outcome.topic is None:
            self._granted.update(self._scopes)  # an override changed: every led topic again
            self._scan.set()
        elif not self.leads(outcome.topic):
            self._note_missed(outcome)
        elif outcome.kind == "consumer":
            self._settle(outcome.topic)
        elif outcome.kind == "load":
            if self._load_matters(outcome):
                self.trigger(outcome.topic)
            else:
                self._still_quiet(outcome.topic)
        else:
            self.trigger(outcome.topic)

    def _still_quiet(self, topic: TopicName) -> None:
        """A load record that cannot change a decision keeps a quiet topic quiet.

        Quiet means nothing over a split threshold and nothing under the merge
        thresholds; :meth:`_load_matters` lets through exactly the records that
        cross either, so the others need no tick's evaluation. Without this, a
        storm of balanced records made every topic due at every tick (10,000
        evaluations at once, and the watch fell behind meanwhile).
        """
        seen = self._quiet.get(topic)
        state = self.view.topics.get(topic)
        if seen is not None and state is not None and seen.version == state.version - 1:
            seen.version = state.version

    def _note_missed(self, change: Change) -> None:
        """Remember a change that another replica's leadership covers (see ``_missed``)."""
        assert change.topic is not None
        if self._whole is not None:
            # The first load: every topic is evaluated once it is whole, so there is no
            # change to remember (1.9 million keys each moved an entry here, and a
            # takeover then walked them all at once); only the peak a record feeds is kept.
            if change.kind == "load":
                self._observe_load(change)
            return
        if change.kind == "load" and not self._load_matters(change):
            return
        self._remember_missed(change.topic)

    def note_load(self, state: TopicState, segment: int) -> None:
        """:meth:`note` of ``Change("load", state.name, True, segment)``, for a record the
        view wrote straight into the row of ``state`` (its follower fast path).

        A replica that leads nothing (a standby, once loaded) gates it without looking
        the topic up by name: that lookup missed the CPU's cache on nearly every record
        (issue #12, a standby following a backlog). Anything else takes :meth:`note`.
        """
        if self._scopes or not self._running or self._whole is not None:
            self.note(Change("load", state.name, True, segment))
            return
        self._last_applied = self._pacer.now()
        if self._matters(state, segment):
            self._remember_missed(state.name)

    def _remember_missed(self, topic: TopicName) -> None:
        self._missed.pop(topic, None)
        self._missed[topic] = self._clock.now_ms()
        self._forget_missed()

    def _forget_missed(self) -> None:
        horizon = self._clock.now_ms() - int(MISSED_WINDOW_SECONDS * 1000)
        while self._missed:
            oldest = next(iter(self._missed))
            if self._missed[oldest] >= horizon:
                return
            del self._missed[oldest]

    def _observe_load(self, change: Change) -> tuple[PolicySettings, Peek] | None:
        """The policy and record of a new load change, after feeding the window's peak or
        the range's rise (history ``decide`` needs) when the policy keeps one. None:
        nothing to decide."""
        assert change.topic is not None and change.segment is not None
        state = self.view.topics.get(change.topic)
        return None if state is None else self._observe(state, change.segment)

    def _observe(self, state: TopicState, segment: int) -> tuple[PolicySettings, Peek] | None:
        """:meth:`_observe_load` of ``segment``'s new record, given its topic's state."""
        if state.layout is None:
            return None
        record = state.loads.peek(segment)
        if record is None:
            return None
        policy = self.resolved_policy(state)
        if not isinstance(policy, PolicySettings):
            return None
        if observes_records(policy):
            history = state.history if state.history is not None else TopicHistory()
            history.observe(segment, Rates(*record[0]), self._clock.now_ms(), policy)
            state.history = history
        return policy, record

    def _load_matters(self, change: Change) -> bool:
        """Whether one new load record can change a decision or our cold bookkeeping.

        The gate that lets a replica follow thousands of load writes a second:
        most records are neither over a split threshold, nor crossing a merge
        threshold, nor due a persisted cold-since. Windows that expire with
        time are the ticker's and the timers' job. It reads the packed row
        (:meth:`LoadTable.peek`): building a sample cost more than the rest.
        """
        assert change.topic is not None and change.segment is not None
        state = self.view.topics.get(change.topic)
        return state is not None and self._matters(state, change.segment)

    def _matters(self, state: TopicState, segment: int) -> bool:
        """:meth:`_load_matters` of ``segment``'s new record, given its topic's state."""
        observed = self._observe(state, segment)
        if observed is None:
            return False
        policy, (rates, changed_ms, sampled_ms, held) = observed
        if _over(rates, policy.split_thresholds):
            return True
        cold = _under(rates, policy.merge_thresholds)
        persisted = state.cold_since.get(segment)
        if cold != (held is not None or persisted is not None):
            return True  # a cold/warm transition
        # cold all along, but the record changed: the window must now be persisted
        return (
            cold
            and persisted is None
            and held is not None
            and (held < changed_ms or sampled_ms is None)
        )

    def _carry_history(self, topic: TopicName) -> None:
        """Once the layout shows our split or merge, carry the topic's history over to the
        new segments (a flip-flop counts), persist it if it changed, and forget segments
        that are gone."""
        state = self.view.topics.get(topic)
        after = state.layout if state is not None else None
        if state is None or after is None:
            return
        history = state.history
        was = history.to_json() if history is not None else {}
        applied = self._applied.get(topic)
        if applied is not None:
            before, decision, policy, loads, when = applied
            sealed = _sealed_by(decision)
            segments = [after.segments.get(sid) for sid in sealed]
            if all(s is not None and not s.active and s.child_ids for s in segments):
                del self._applied[topic]
                history = history if history is not None else TopicHistory()
                try:
                    if history.applied(before, decision, after, when, policy, loads):
                        log.info("topic.flipflop", topic=str(topic), op=decision.action)
                except KeyError:  # the layout moved on in between: history is advice
                    pass
            elif after.epoch > before.epoch + 1 or any(s is None for s in segments):
                del self._applied[topic]  # someone else changed it first (or GC pruned)
        elif topic in self._in_flight:
            # Our own split or merge can show in the layout before its request returns;
            # forgetting its sealed parents now would lose what the evaluation, once
            # it returns, must carry over to their children (flip-flops, peaks, rises).
            return
        if history is None:
            return
        history.forget(s.segment_id for s in after.active_segments())
        body = history.to_json()
        state.history = history if body else None
        if body != was and self.leads(topic):
            self._write(self._keys.history(topic), orjson.dumps(body) if body else None, state)

    def _index(self, topic: TopicName) -> None:
        """Keep the per-shard topic index (sharded mode) in step with the view."""
        if self._shards is None:
            return
        shard = self.scope_of(topic)
        assert shard is not None
        if topic in self.view.topics:
            self._by_shard.setdefault(shard, set()).add(topic)
        else:
            self._by_shard.get(shard, set()).discard(topic)

    def _settle(self, topic: TopicName) -> None:
        """Evaluate after ``consumer_settle_seconds`` so a burst of registrations is one."""
        settle = self._config().autoscale.consumer_settle_seconds
        if settle <= 0:
            self.trigger(topic)
        elif topic not in self._settling:
            self._settling.add(topic)
            self._after(settle, topic, "settle")

    def _layout_arrived(self, topic: TopicName) -> None:
        awaited = self._awaiting.get(topic)
        state = self.view.topics.get(topic)
        if awaited is not None and (
            state is None or state.layout is None or state.layout.epoch > awaited[0]
        ):
            del self._awaiting[topic]

    # -- the work queue -------------------------------------------------------------------

    def _contended(self) -> bool:
        """Whether anything but background work wants the loop (see :class:`Pacer`)."""
        recent = self._pacer.now() - self._last_applied < CONTENDED_SECONDS
        return recent or bool(self._urgent)

    def trigger(self, topic: TopicName, *, urgent: bool = True) -> None:
        """Ask for an evaluation of ``topic``; coalesces while one is queued or in flight.

        A topic whose consumers are settling waits for its settle timer, which
        triggers it: a tick or a load record inside the window would otherwise
        split for the consumers registered so far, and again for the rest.
        """
        if topic in self._settling:
            return
        if topic in self._in_flight:
            self._again.add(topic)
            return
        if topic in self._queued:
            if urgent and topic not in self._urgent:
                self._urgent.append(topic)  # promoted; the background entry is skipped
                self._items.release()
            return
        self._queued.add(topic)
        if urgent:
            self._urgent.append(topic)
            self._items.release()
        else:
            self._background.append(topic)
            self._background_items.release()

    async def _feeder(self) -> None:
        """Hands background topics to the workers, one per turn of the pacer."""
        while True:
            await self._background_items.acquire()
            await self._pacer.turn()
            while self._background:
                topic = self._background.popleft()
                if topic in self._queued:
                    self._released.append(topic)
                    self._items.release()
                    break

    def _next(self) -> tuple[TopicName, bool] | None:
        """The next topic to evaluate, urgent ones first, and whether it is paced."""
        while self._urgent or self._released:
            paced = not self._urgent
            topic = self._released.popleft() if paced else self._urgent.popleft()
            if topic in self._queued:
                self._queued.discard(topic)
                return topic, paced
        return None

    async def _worker(self) -> None:
        while True:
            await self._items.acquire()
            item = self._next()
            if item is None:
                continue
            topic, paced = item
            cancel = anyio.CancelScope()
            self._in_flight[topic] = cancel
            try:
                with cancel:
                    while True:
                        self._again.discard(topic)
                        started = self._pacer.now()
                        try:
                            await self.evaluate(topic)
                        except Exception:
                            # One topic's bug must not stop the others; the next trigger retries.
                            log.exception("evaluation.failed", topic=str(topic))
                        took = self._pacer.now() - started
                        self._metrics.evaluation_duration.observe(took)
                        if paced:  # at most one burst: waiting for the broker held no loop
                            self._pacer.charge(min(took, self._pacer.burst))
                        if topic not in self._again:
                            break
            finally:
                del self._in_flight[topic]
                self._again.discard(topic)

    # -- timers ---------------------------------------------------------------------------

    def _after(self, seconds: float, topic: TopicName, why: str) -> None:
        """Evaluate ``topic`` again after ``seconds`` of clock time."""
        due = self._clock.monotonic() + max(0.0, seconds)
        entry = (due, next(self._timer_seq), topic, why)
        heapq.heappush(self._timers, entry)
        if self._timers[0] is entry and self._timer_scope is not None:
            self._timer_scope.cancel()  # the sleeper waits for a later timer: wake it

    def _follow_up(self, topic: TopicName, seconds: float, why: str) -> None:
        """At most one pending follow-up per topic: the earliest wins."""
        due = self._clock.monotonic() + seconds
        pending = self._followups.get(topic)
        if pending is not None and pending <= due + 1e-6:
            return
        self._followups[topic] = due
        self._after(seconds, topic, why)

    async def _timer_loop(self) -> None:
        while True:
            now = self._clock.monotonic()
            while self._timers and self._timers[0][0] <= now:
                _, _, topic, why = heapq.heappop(self._timers)
                self._fire(topic, why)
            delay = self._timers[0][0] - now if self._timers else math.inf
            with anyio.CancelScope() as scope:
                self._timer_scope = scope
                if math.isinf(delay):
                    await anyio.sleep_forever()
                await self._clock.sleep(delay)
            self._timer_scope = None
            await anyio.lowlevel.checkpoint()

    def _fire(self, topic: TopicName, why: str) -> None:
        log.debug("evaluation.timer", topic=str(topic), why=why)
        if why == "settle":
            self._settling.discard(topic)
        elif why in _HELD_BACK or why == "split-cooldown-expired":
            due = self._followups.get(topic)
            if due is not None and due <= self._clock.monotonic() + 1e-6:
                del self._followups[topic]
        if topic in self.view.topics and self.leads(topic):
            self.trigger(topic)

    def reconfigured(self) -> None:
        """A new config is in force (a SIGHUP reload): the tickers measure again.

        The next tick (and GC round) is due its new interval after the last one
        ended (or the controller started), at once if that is already past. Without
        this call a ticker reads a new interval only once its old one ran out.
        """
        for sleep in list(self._tick_sleeps):
            sleep.cancel()

    async def _next_tick(self, since: float, interval: Callable[[Config], float]) -> None:
        """Sleep until ``interval`` of the config in force has passed ``since``, on the
        clock; a reload (:meth:`reconfigured`) wakes the sleep to measure it again."""
        while (remaining := since + interval(self._config()) - self._clock.monotonic()) > 0:
            with anyio.CancelScope() as sleep:
                self._tick_sleeps.add(sleep)
                try:
                    await self._clock.sleep(remaining)
                finally:
                    self._tick_sleeps.discard(sleep)
            if not sleep.cancelled_caught:
                return

    async def _ticker(self) -> None:
        """The safety net: every topic we lead, evaluated every interval, in slices."""
        since = self._clock.monotonic()
        while True:
            await self._next_tick(since, lambda config: config.autoscale.interval_seconds)
            full = self._ticks % FULL_PASS_EVERY == 0
            self._ticks += 1
            led = pulsar_owned = quiet = 0
            mark = self._pacer.now()
            for i, topic in enumerate(self._topics_in(self._scopes)):
                if self.leads(topic):
                    led += 1
                    state = self.view.topics.get(topic)
                    policy = self.resolved_policy(state) if state is not None else None
                    if isinstance(policy, PolicyInvalid) and policy.detail == PULSAR_OWNS:
                        pulsar_owned += 1
                    if not full and state is not None and self._is_quiet(state, policy):
                        quiet += 1
                    else:
                        self.trigger(topic, urgent=False)
                if i % SLICE == SLICE - 1:
                    mark = await self._pacer.pause(mark)
            self._metrics.topics_owned.set(led)
            self._metrics.pulsar_autoscaler_topics.set(pulsar_owned)
            log.debug("tick", led=led, evaluated=led - quiet, quiet=quiet, full_pass=full)
            since = self._clock.monotonic()

    def _is_quiet(self, state: TopicState, policy: object) -> bool:
        """Whether the topic was quiet at its last evaluation, on these inputs and ``policy``
        (the topic's :meth:`resolved_policy`)."""
        seen = self._quiet.get(state.name)
        return seen is not None and seen.version == state.version and seen.policy is policy

    def _note_quiet(
        self,
        state: TopicState,
        decision: Decision,
        policy: PolicySettings | PolicyInvalid,
        samples: Mapping[int, LoadSample],
    ) -> None:
        """Remember (or forget) that the topic is quiet: time alone cannot change its answer.

        Quiet: decided ``balanced``; no active segment over a split threshold; and
        with two or more active segments, none below the merge thresholds (merge
        windows, peaks and staleness are about time). Cooldowns only hold back
        decisions that are not ``balanced``.
        """
        layout = state.layout
        quiet = (
            isinstance(decision, NoAction)
            and decision.reason == "balanced"
            and isinstance(policy, PolicySettings)
            and layout is not None
        )
        if quiet:
            assert isinstance(policy, PolicySettings) and layout is not None
            active = layout.active_segments()
            for seg in active:
                sample = samples.get(seg.segment_id)
                if sample is None:
                    continue
                rates = sample.rates.as_tuple()
                if _over(rates, policy.split_thresholds) or (
                    len(active) > 1 and _under(rates, policy.merge_thresholds)
                ):
                    quiet = False
                    break
        seen = self._quiet.get(state.name)
        if not quiet:
            self._quiet.pop(state.name, None)
        elif seen is None:
            self._quiet[state.name] = _QuietMark(state.version, policy)
        else:
            seen.version, seen.policy = state.version, policy

    # -- evaluation -----------------------------------------------------------------------

    def resolved_policy(self, state: TopicState) -> PolicySettings | PolicyInvalid:
        """The topic's policy, cached until its layout, an override or the config changes.

        Only ``[policy]`` and ``broker.profile`` enter it, so a reload that changes
        neither keeps the cache: resolving every topic again after each SIGHUP slowed
        reactions under a write storm for seconds (issue #12's bench, 10k topics).
        The cache is the state's ``policy_memo``, stamped with this controller: the
        per-record gate asks for it on every followed record, and a map of its own
        cost a cache miss each time (2-3 us a record at 10k topics).
        """
        config = self._config()
        if config is not self._config_seen:
            seen = self._config_seen
            if seen is None or (seen.policy, seen.broker.profile) != (
                config.policy,
                config.broker.profile,
            ):
                self._config_generation += 1
            self._config_seen = config
        memo = state.policy_memo
        if (
            memo is not None
            and memo[0] is self
            and memo[1] == self._config_generation
            and memo[2] == self.view.overrides_generation
            and memo[3] == state.layout_revision
        ):
            resolved: PolicySettings | PolicyInvalid = memo[4]
            return resolved
        resolved = self._resolve(config, state)
        state.policy_memo = (
            self,
            self._config_generation,
            self.view.overrides_generation,
            state.layout_revision,
            resolved,
        )
        return resolved

    def _resolve(self, config: Config, state: TopicState) -> PolicySettings | PolicyInvalid:
        """Overrides field by field, broadest first: our tenant and namespace keys, then
        (Pulsar) its namespace policy and the layout's ``autoScalePolicy`` as Pulsar reads
        them, then our own per-topic key (our knobs live there, since Pulsar erases
        unknown fields of its record; issue #11).

        On Pulsar, ``enabled`` in Pulsar's records is about Pulsar's own evaluator:
        ``true`` hands the topic to it (we stand back, never two controllers), ``false``
        means no auto-scaling at all; either way we do not act.
        """
        ours = self.view.overrides_for(state.name)
        layout_policy = state.layout.auto_scale_policy if state.layout is not None else None
        if config.broker.profile != "pulsar":
            return self._resolve_shared(
                config, ours[0], ours[1], layout_policy, ours[2], memo=layout_policy is None
            )
        namespace = self.view.pulsar_namespace(state.name)
        try:
            pulsar_ns = namespace.auto_scale if namespace is not None else None
            pulsar_topic = pulsar_override(layout_policy)
        except ModelError as exc:
            return PolicyInvalid(f"Pulsar's autoScalePolicy: {exc}")
        if pulsar_autoscaler_enabled(pulsar_ns, pulsar_topic):
            return PolicyInvalid(PULSAR_OWNS)
        erased = erased_override_keys(layout_policy)
        if erased:
            log.warning(
                "policy.keys_erased_by_pulsar",
                topic=str(state.name),
                keys=erased,
                fix="put controllerd's own knobs under its own key: "
                f"{self._keys.policy(state.name.tenant, state.name.namespace, state.name.topic)}",
            )
        return self._resolve_shared(
            config, ours[0], ours[1], pulsar_ns, pulsar_topic, ours[2], memo=pulsar_topic is None
        )

    def _resolve_shared(
        self, config: Config, *overrides: Mapping[str, Any] | None, memo: bool
    ) -> PolicySettings | PolicyInvalid:
        """:func:`resolve_policy`, shared by the topics that have the same override objects.

        Most topics have no override of their own, so 100,000 topics in 100 namespaces
        resolve 100 times, not 100,000 (a first evaluation spent ~40 us here). The
        objects are the view's, alive for the generation the memo is kept for, so
        their ids are stable keys. Without ``memo`` (the topic's layout carries a
        policy of its own, an object per layout) nothing is kept.
        """
        generation = (self._config_generation, self.view.overrides_generation)
        if generation != self._shared_generation:
            self._shared.clear()
            self._shared_generation = generation
        if not memo:
            return resolve_policy(config.policy, *overrides)
        key = tuple(id(o) if o is not None else 0 for o in overrides)
        shared = self._shared.get(key)
        if shared is None:
            shared = self._shared[key] = resolve_policy(config.policy, *overrides)
        return shared

    async def evaluate(self, topic: TopicName) -> Decision | None:
        """Decide one topic and act on the decision; None when there was nothing to decide."""
        state = self.view.topics.get(topic)
        leadership = self.leadership_for(topic)
        if leadership is None:
            return None
        if topic in self._settling:
            # Queued or in flight before the window began: its settle timer triggers it
            # when the window closes (else it would split for the consumers seen so far).
            return None
        first = topic in self._first_pass
        if first:
            self._first_pass_done(topic, self.scope_of(topic))
            if self.first_pass_remaining == 0:
                _freeze_survivors()
        if state is None or state.layout is None:
            return None
        if topic in self._unaddressable:
            return None  # its name cannot reach the broker: logged once, never retried
        awaited = self._awaiting.get(topic)
        if awaited is not None:
            if self._clock.monotonic() < awaited[1]:
                return None
            del self._awaiting[topic]
        now = self._clock.now_ms()
        policy = self.resolved_policy(state)
        samples = state.loads.samples()
        if isinstance(policy, PolicySettings):
            self._track_cold(state, samples, policy, now, rediscovered=first)
        held = state.loads.colds()
        loads = {
            sid: sample.with_cold_since(since)
            if (since := state.cold_since.get(sid, held.get(sid))) is not None
            else sample
            for sid, sample in samples.items()
        }
        history = state.history
        if history is not None and isinstance(policy, PolicySettings):
            loads = {sid: history.annotate(sid, s, now, policy) for sid, s in loads.items()}
        layout, revision = state.layout, state.layout_revision
        cooldown = state.effective_cooldown()
        decision: Decision
        if isinstance(policy, PolicyInvalid) and policy.detail == PULSAR_OWNS:
            decision = NoAction("pulsar-autoscaler", PULSAR_OWNS)
        else:
            decision = decide(
                layout,
                loads,
                state.consumer_counts(),
                policy,
                now,
                cooldown.last_split_ms,
                cooldown.last_merge_ms,
            )
        if not isinstance(decision, NoAction) and self._backing_off(topic):
            # A failed operation's backoff holds: its retry timer comes back for the
            # topic. Other triggers (load records, ticks) must not shortcut it. Not
            # counted: the decision is made, and counted, when the retry comes.
            log.debug(
                "decision.deferred",
                topic=str(topic),
                action=decision.action,
                reason=decision.reason,
                retry_in_s=round(self._attempts[topic].retry_at - self._clock.monotonic(), 3),
            )
            return None
        self._count(topic, decision)
        self._note_quiet(state, decision, policy, samples)
        fields = {
            "topic": str(topic),
            "action": decision.action,
            "reason": decision.reason,
            "detail": decision.detail,
            "epoch": layout.epoch,
            "token": leadership.token,
        }
        if isinstance(decision, NoAction):
            (log.debug if decision.reason == "balanced" else log.info)("decision", **fields)
            if isinstance(policy, PolicySettings):
                self._hold_back(topic, decision, cooldown, policy, now)
            return decision
        log.info("decision", **fields)
        outcome = await self._act(
            topic, state, leadership, (layout, revision), decision, policy, now
        )
        if outcome == "ok" and isinstance(policy, PolicySettings):
            self._applied[topic] = (layout, decision, policy, loads, now)
            self._carry_history(topic)  # the new layout may be here already
        self._record(topic, decision, outcome, now, state, leadership)
        return decision

    def _backing_off(self, topic: TopicName) -> bool:
        """Whether the topic's last operation failed and its retry is not due yet."""
        attempt = self._attempts.get(topic)
        return attempt is not None and self._clock.monotonic() < attempt.retry_at

    def _count(self, topic: TopicName, decision: Decision) -> None:
        """A decision is counted once; deciding the same failed operation again is a retry."""
        attempt = self._attempts.get(topic)
        if attempt is not None and attempt.decision == decision_to_json(decision):
            self._metrics.topic_retries.inc()
            return
        self._metrics.decisions.labels(action=decision.action, reason=decision.reason).inc()

    def _hold_back(
        self,
        topic: TopicName,
        decision: NoAction,
        cooldown: Cooldown,
        policy: PolicySettings,
        now: int,
    ) -> None:
        """A decision held back by a cooldown comes back exactly once when it ends."""
        kind = _HELD_BACK.get(decision.reason)
        if kind is None:
            return
        last, length = (
            (cooldown.last_split_ms, policy.split_cooldown_seconds)
            if kind == "split"
            else (cooldown.last_merge_ms, policy.merge_cooldown_seconds)
        )
        remaining = (last + length * 1000.0 - now) / 1000.0
        if remaining > 0:
            self._follow_up(topic, remaining + 0.001, decision.reason)

    def _track_cold(
        self,
        state: TopicState,
        samples: Mapping[int, LoadSample],
        policy: PolicySettings,
        now: int,
        *,
        rediscovered: bool = False,
    ) -> None:
        """Keep each active segment's cold-since (DESIGN §8.1), persisting it only when
        a new leader could not derive it.

        ``rediscovered``: the term's first evaluation of the topic, where a cold
        segment was most likely cold before this leader began; it is logged at debug
        (at info, a new leader of 100,000 idle topics wrote 1.6 million lines, and
        spent ~1.6 ms of each evaluation on them).

        A new leader derives cold-since from the record's ``changedAtMs`` (or a
        merge child's parents) when the record carries its own time stamps.
        Only when a cold segment's record is rewritten while it stays cold
        (noisy low traffic), a merge child inherits its parents' window, or the
        record has no time stamps (Pulsar's: its "changed at" is when this
        replica first saw it) does the value need etcd; writing it at every
        transition would cost 1.6M writes at start on 100,000 cold topics.
        """
        layout = state.layout
        assert layout is not None
        table = state.loads
        for seg in layout.active_segments():
            sid = seg.segment_id
            sample = samples.get(sid)
            if sample is None or is_stale(sample, policy, now):
                continue
            persisted = state.cold_since.get(sid)
            held = table.cold(sid)
            if below(sample.rates, policy.merge_thresholds):
                since = held if held is not None else persisted
                if since is None:
                    inherited = inherited_cold_since(layout, sid, _ColdOf(state))
                    # within [0, now]: a broker's clock may run ahead, or stamp before 1970
                    # (the cold-since key refuses a negative time: written, it was rejected)
                    since = (
                        inherited
                        if inherited is not None
                        else max(0, min(sample.changed_at_ms, now))
                    )
                    (log.debug if rediscovered else log.info)(
                        "segment.cold", topic=str(state.name), segment=sid, since_ms=since
                    )
                if since != held:
                    table.set_cold(sid, since)
                # Derivable by a successor only from a record that carries its own time
                # stamps; Pulsar's carry none (changed_at is when *we* first saw it).
                derivable = sample.sampled_at_ms is not None and since >= min(
                    sample.changed_at_ms, now
                )
                if persisted is None and not derivable:
                    self._write(self._keys.cold_since(state.name, sid), str(since).encode(), state)
                    state.cold_since[sid] = since
            else:
                if held is not None or persisted is not None:
                    log.info("segment.warm", topic=str(state.name), segment=sid)
                if held is not None:
                    table.set_cold(sid, None)
                if persisted is not None:
                    del state.cold_since[sid]
                    self._write(self._keys.cold_since(state.name, sid), None, state)

    # -- acting ---------------------------------------------------------------------------

    async def _act(
        self,
        topic: TopicName,
        state: TopicState,
        leadership: Leadership,
        decided: tuple[Layout, int],
        decision: Split | Merge,
        policy: PolicySettings | PolicyInvalid,
        now: int,
    ) -> str:
        op = decision.action
        layout, revision = decided
        decided_epoch = layout.epoch
        if not leadership.is_leader():
            return "not-leader"
        try:
            # One read to prove the view is not behind etcd for this topic: a new
            # leader or shard owner may not yet have seen its predecessor's last
            # operation, and must not decide on the layout before it.
            stored = await self._store.get(self._keys.layout(topic))
        except StoreError as exc:
            return self._failed(topic, decision, op, exc)
        if stored is None or stored.mod_revision != revision:
            log.info("operation.skipped", topic=str(topic), op=op, why="view behind etcd")
            self._awaiting[topic] = (
                decided_epoch,
                self._clock.monotonic() + LAYOUT_CATCH_UP_SECONDS,
            )
            self._after(LAYOUT_CATCH_UP_SECONDS, topic, "stale-view")
            return "stale-view"
        if not leadership.is_leader():
            return "not-leader"
        try:
            if isinstance(decision, Split):
                await self._broker.split(
                    topic,
                    decision.segment_id,
                    decision.boundaries,
                    fencing_token=leadership.token,
                    fencing_key=leadership.key,
                    known=Known(
                        layout.segments[decision.segment_id].hash_range, layout.next_segment_id
                    ),
                )
            else:
                joint = HashRange(
                    layout.segments[decision.a].hash_range.start,
                    layout.segments[decision.b].hash_range.end,
                )
                await self._broker.merge(
                    topic,
                    decision.a,
                    decision.b,
                    fencing_token=leadership.token,
                    fencing_key=leadership.key,
                    known=Known(joint, layout.next_segment_id),
                )
        except Fenced as exc:
            self._metrics.operations.labels(op=op, outcome=exc.outcome).inc()
            log.error(
                "operation.fenced",
                topic=str(topic),
                op=op,
                token=leadership.token,
                error=str(exc),
                action="stepping down: a newer leader exists",
            )
            leadership.lost.set()
            return exc.outcome
        except Unaddressable as exc:
            self._metrics.operations.labels(op=op, outcome=exc.outcome).inc()
            if topic not in self._unaddressable:  # said once per topic; retrying cannot help
                self._unaddressable.add(topic)
                log.error("topic.unaddressable", topic=str(topic), error=str(exc))
            return exc.outcome
        except BrokerError as exc:
            return self._failed(topic, decision, op, exc)
        self._attempts.pop(topic, None)
        self._metrics.operations.labels(op=op, outcome="ok").inc()
        old = state.effective_cooldown()
        stamp = (
            Cooldown(now, old.last_merge_ms) if op == "split" else Cooldown(old.last_split_ms, now)
        )
        state.cooldown, state.cooldown_seen_ms = stamp, now  # ours: of our clock
        try:
            await self._fenced_write(
                leadership, [Put(self._keys.cooldown(topic), orjson.dumps(stamp.to_json()))]
            )
        except StoreError as exc:
            # The broker acted; the stamp also dates the children in the layout.
            log.warning("cooldown.persist_failed", topic=str(topic), error=str(exc))
        current = state.layout
        if current is not None and current.epoch <= decided_epoch:
            # The broker's new layout has not reached us yet: do not decide on the old one.
            self._awaiting[topic] = (
                decided_epoch,
                self._clock.monotonic() + LAYOUT_CATCH_UP_SECONDS,
            )
        if isinstance(decision, Split) and isinstance(policy, PolicySettings):
            self._follow_up(topic, policy.split_cooldown_seconds, "split-cooldown-expired")
        log.info("operation.done", topic=str(topic), op=op, token=leadership.token)
        return "ok"

    def _failed(
        self, topic: TopicName, decision: Decision, op: str, exc: BrokerError | StoreError
    ) -> str:
        outcome = exc.outcome if isinstance(exc, BrokerError) else "etcd-unavailable"
        self._metrics.operations.labels(op=op, outcome=outcome).inc()
        body = decision_to_json(decision)
        attempt = self._attempts.get(topic)
        # The backoff grows with the topic's consecutive failures, whatever was decided
        # each time: a load record that changes the decision must not reset it.
        failures = attempt.failures + 1 if attempt is not None else 1
        self._attempts[topic] = _Attempt(body, failures)
        if isinstance(exc, Unauthorized):
            # Not a retry on the backoff: only an operator can fix it. The next tick
            # tries again, so a token fixed with a SIGHUP works without a restart.
            self._operator_error("broker-auth", str(exc))
            log.warning(
                "operation.failed", topic=str(topic), op=op, outcome=outcome, error=str(exc)
            )
            return outcome
        schedule = backoff.TOPIC_RETRY.capped_at(self._config().autoscale.interval_seconds)
        retry_in = schedule.delay(failures - 1)
        self._attempts[topic].retry_at = self._clock.monotonic() + retry_in
        log.warning(
            "operation.failed",
            topic=str(topic),
            op=op,
            outcome=outcome,
            error=str(exc),
            failures=failures,
            retry_in_s=round(retry_in, 3),
        )
        self._after(retry_in, topic, "retry")
        return outcome

    def _operator_error(self, kind: str, detail: str) -> None:
        self._metrics.operator_errors.labels(kind=kind).inc()
        if self._on_operator_error is not None:
            self._on_operator_error(kind, detail)

    def _record(
        self,
        topic: TopicName,
        decision: Decision,
        outcome: str,
        now: int,
        state: TopicState,
        leadership: Leadership,
    ) -> None:
        body = decision_to_json(decision)
        self.history.append(DecisionRecord(now, str(topic), body, outcome))
        layout = state.layout
        self._audit.publish(
            {
                "ts_ms": now,
                "topic": str(topic),
                "decision": body,
                "inputs": {
                    "epoch": layout.epoch if layout is not None else None,
                    "active_segments": len(layout.active_segments()) if layout is not None else 0,
                    "consumers": state.consumer_counts(),
                    "loads": {
                        str(sid): dataclasses.asdict(s.rates) for sid, s in state.loads.items()
                    },
                },
                "fencing_token": leadership.token,
                "outcome": outcome,
                "replica": self._replica,
            }
        )

    # -- our own state, written behind and fenced ------------------------------------------

    def _write(self, key: str, value: bytes | None, state: TopicState) -> None:
        """Queue a put (or delete, for None) of our own state, fenced on the topic's scope.

        From then on, this term, the view ignores the topic's stored history and
        cold-since: they are our writes coming back, possibly older than what we hold."""
        leadership = self.leadership_for(state.name)
        if leadership is not None:
            self._state_term[state.name] = leadership.token
        self._writes[key] = (value, self.scope_of(state.name))
        if len(self._writes) >= WRITE_BATCH:
            self._write_wake.set()

    def _forget(self, topic: TopicName) -> None:
        """Queue deleting our keys of a topic that is gone (cooldown, history,
        cold-since), if we lead it; queued values of them are dropped. Kept, a topic
        created again under the name would inherit them: its segment ids start at 0
        again, so an old cold-since would merge a new segment at once. Its pending
        deletes stay: each still deletes its pruned segment, unless the topic was
        created again first (:meth:`_retry_marker` tells the two apart)."""
        if self.leadership_for(topic) is None:
            if self.partial:  # found by the first load: forgotten once we lead it
                self._orphans.add(topic)
            return  # otherwise its leader forgets it
        own = (self._keys.cooldown(topic), self._keys.history(topic))
        prefix = self._keys.cold_since_prefix(topic)
        for key in [k for k in self._writes if k in own or k.startswith(prefix)]:
            del self._writes[key]
        self._forgotten[topic] = self.scope_of(topic)

    def _forget_orphans(self) -> None:
        """Forget the orphans we now lead (a topic since created again keeps its keys)."""
        for topic in [t for t in self._orphans if t in self.view.topics or self.leads(t)]:
            self._orphans.discard(topic)
            if topic not in self.view.topics:
                self._forget(topic)

    async def _writer(self) -> None:
        while True:
            with anyio.move_on_after(WRITE_DELAY):
                await self._write_wake.wait()
            self._write_wake = anyio.Event()
            await self.flush_writes()

    async def flush_writes(self) -> None:
        """Write every queued value, in fenced transactions per scope; drop what we no
        longer lead (the new leader derives it again).

        A batch etcd did not take (an outage longer than the store's retries) is
        queued again, with every value not yet written, except keys given a newer
        value meanwhile: dropped, a successor would read older history and
        cold-since than the leader held. The flush stops at that first failure, so
        an outage costs one round of the store's retries per flush, not one per
        batch (cold Pulsar records queue a write per segment at start).

        The work between two yields is one batch, whatever the queue holds: the
        batches are taken from the queue as they are written, and a failure puts
        the queue's unwritten remainder back whole, not value by value (1.6 million
        queued values, all built into operations before the first write, held the
        event loop 3 s). The order the values are written in is not the order they
        were queued in: each key is written once, in a transaction of its own scope.
        """
        if self._forgotten and not await self._flush_forgotten():
            return
        if not self._writes:
            return
        pending, self._writes = self._writes, {}
        batches: _Batches = {}
        while pending:
            for _ in range(min(WRITE_BATCH, len(pending))):
                key, entry = pending.popitem()  # the last: O(1), and leaves no hole
                batch = batches.setdefault(entry[1], [])
                batch.append((key, entry))
                if len(batch) == WRITE_BATCH:
                    if not await self._write_batch(entry[1], batch):
                        self._queue_again(pending, batches)
                        return
                    del batches[entry[1]]
                    break
            await anyio.lowlevel.checkpoint()
        for scope, batch in list(batches.items()):  # the scopes' last, partial batches
            if not await self._write_batch(scope, batch):
                self._queue_again(pending, batches)
                return
            del batches[scope]
            await anyio.lowlevel.checkpoint()

    async def _write_batch(self, scope: Scope, batch: list[tuple[str, _Queued]]) -> bool:
        """Write one batch of queued values of ``scope``, fenced; False if etcd refused
        it. A batch of a scope we no longer lead is dropped (True)."""
        leadership = self._scopes.get(scope)
        if leadership is None or not leadership.is_leader():
            return True
        ops: list[Put | Delete] = [
            Put(key, value) if value is not None else Delete(key) for key, (value, _) in batch
        ]
        return await self._state_written(leadership, ops)

    def _queue_again(self, pending: dict[str, _Queued], batches: _Batches) -> None:
        """Queue again what a refused flush did not write: the values still ``pending``
        and the ``batches`` taken from it, unwritten. A value queued since is newer: it
        stays. Only the batches (one per scope at most) and the values queued since
        cost a step each; the remainder goes back as the dict it already is."""
        for batch in batches.values():
            pending.update(batch)
        pending.update(self._writes)
        self._writes = pending

    async def _flush_forgotten(self) -> bool:
        """Delete the keys of the topics :meth:`_forget` queued, a fenced transaction a
        topic, before any queued value (which is then the new topic's). False if etcd
        refused one: it and the rest stay queued, as a refused batch does."""
        forgotten, self._forgotten = self._forgotten, {}
        failed = False
        for topic, scope in forgotten.items():
            leadership = self._scopes.get(scope)
            if leadership is None or not leadership.is_leader():
                continue
            if not failed:
                ops: list[Put | Delete] = [
                    Delete(self._keys.cooldown(topic)),
                    Delete(self._keys.history(topic)),
                    Delete(self._keys.cold_since_prefix(topic), prefix=True),
                ]
                if await self._state_written(leadership, ops):
                    log.info("topic.state_deleted", topic=str(topic), token=leadership.token)
                    continue
                failed = True
            self._forgotten.setdefault(topic, scope)
        return not failed

    async def _state_written(self, leadership: Leadership, ops: list[Put | Delete]) -> bool:
        """One fenced write of our own state; False (counted, logged) if etcd refused
        it, for the caller to queue it again."""
        try:
            await self._fenced_write(leadership, ops)
        except StoreError as exc:
            self._metrics.state_write_failures.inc()
            log.warning("state.write_failed", ops=len(ops), error=str(exc))
            return False
        return True

    async def _fenced_write(self, leadership: Leadership, ops: list[Put | Delete]) -> bool:
        """Apply ``ops`` only while ``leadership`` holds (idempotent puts/deletes)."""
        result = await self._store.txn([leadership.fenced()], ops)
        if not result.succeeded:
            log.warning("state.write_fenced", token=leadership.token, key=leadership.key)
        return result.succeeded

    # -- GC -------------------------------------------------------------------------------

    async def gc_round(self) -> None:
        """Finish deletes left behind, then prune every led topic's drained sealed segments."""
        if not self._config().gc_enabled or not self._scopes or self.partial:
            return
        # The markers are GC's durable to-do list: read them afresh (not from the watch,
        # which may lag), each through the same parsing boundary as every etcd value.
        try:
            kvs, _ = await self._store.get_prefix(self._keys.pending_deletes_prefix)
        except StoreError as exc:
            log.warning("gc.markers.unreadable", error=str(exc))
            return
        self._metrics.gc_pending_deletes.set(len(kvs))
        bad = self._bad_markers
        self._bad_markers = {}
        for i, kv in enumerate(kvs):
            if i % SLICE == SLICE - 1:  # 50,000 bad markers held the loop ~5 s a round
                await anyio.lowlevel.checkpoint()
            if bad.get(kv.key) == kv.mod_revision:
                self._bad_markers[kv.key] = kv.mod_revision  # refused and said before
                continue
            try:
                raw = parse_json(kv.value)
                marker = parse_pending_delete(raw)
            except Exception as exc:  # the parsing boundary: one bad marker stops nothing
                self.note(Rejected(kv.key, "pending_delete", str(exc)[:300]))
                self._bad_markers[kv.key] = kv.mod_revision
                continue
            leadership = self.leadership_for(marker.topic)
            if leadership is not None and self._addressable(marker.topic, "delete_segment"):
                pruned_from = raw.get(PRUNED_FROM)
                if not isinstance(pruned_from, int) or isinstance(pruned_from, bool):
                    pruned_from = None  # written before the field was
                await self._retry_marker(leadership, kv, marker, pruned_from)
        # Charged per topic, at most one burst each: a topic's wait for the broker and
        # etcd held no loop (billed as loop time, it parked GC and the feeder for as long
        # again as the calls took).
        spent = 0.0
        for i, topic in enumerate(self._topics_in(self._scopes)):
            if i % SLICE == SLICE - 1:
                self._pacer.charge(spent)
                spent = 0.0
                await self._pacer.turn()
            started = self._pacer.now()
            leadership = self.leadership_for(topic)
            state = self.view.topics.get(topic)
            if leadership is None or state is None or state.layout is None:
                if state is not None and orphaned(state) and has_own_state(state):
                    self._forget(topic)  # our keys outlived the topic (deleted unled)
                continue
            try:
                await self._gc_topic(state, leadership)
            except (StoreError, ValueError, TypeError) as exc:
                log.warning("gc.topic.failed", topic=str(topic), error=str(exc))
            spent += min(self._pacer.now() - started, self._pacer.burst)

    async def _gc_ticker(self) -> None:
        since = self._clock.monotonic()
        while True:
            await self._next_tick(since, lambda config: config.gc.interval_seconds)
            await self.gc_round()
            since = self._clock.monotonic()

    async def _gc_topic(self, state: TopicState, leadership: Leadership) -> None:
        # The layout and its revision are read together, before any await: the prune is
        # computed on this layout, so it must apply only if it is still the stored one
        # (a split or merge landing during the backlog calls must not be overwritten).
        layout, revision = state.layout, state.layout_revision
        assert layout is not None
        topic, now = state.name, self._clock.now_ms()
        retention = self._retention(state)
        segments = gc.candidates(layout, now, retention)
        if not segments or not self._addressable(topic, "prune"):
            return  # unaddressable: pruned, its segments could never be deleted
        # The subscriptions, read afresh with the revision they are as of: the prune
        # applies only if no subscription (or consumer, whose subscription counts even
        # before or without its own key) was created or changed after it, so one created
        # during the backlog calls, which none of them asked about, holds the prune back.
        # Every candidate is asked about the same ones.
        subscriptions_prefix = f"{self._keys.layout(topic)}/subscriptions/"
        kvs, subscriptions_read = await self._store.get_prefix(subscriptions_prefix)
        subscriptions = _subscription_names(kvs, len(subscriptions_prefix))
        backlogs = await self._gc_backlogs(topic, segments, subscriptions)
        verdicts: dict[int, gc.Verdict] = {}
        for seg in segments:
            verdict = gc.prunable(seg, now, retention, backlogs[seg.segment_id])
            verdicts[seg.segment_id] = verdict
            log.debug(
                "gc.verdict",
                topic=str(topic),
                segment=seg.segment_id,
                prunable=verdict.prunable,
                reason=verdict.reason,
                detail=verdict.detail,
            )
        chosen = gc.select(layout, verdicts)
        if not chosen or not leadership.is_leader():
            return
        pruned = prune(layout, chosen)
        markers = [
            Put(
                self._keys.pending_delete(topic, layout.segments[sid].descriptor),
                orjson.dumps(
                    {
                        "topic": str(topic),
                        "descriptor": layout.segments[sid].descriptor,
                        "segmentId": sid,
                        "prunedAtMs": now,
                        PRUNED_FROM: revision,
                    }
                ),
            )
            for sid in chosen
        ]
        result = await self._store.txn(
            [
                Compare.mod_revision(self._keys.layout(topic), revision),
                Compare.unchanged_under(subscriptions_prefix, subscriptions_read),
                leadership.fenced(),
            ],
            [Put(self._keys.layout(topic), orjson.dumps(layout_to_json(pruned))), *markers],
        )
        if not result.succeeded:
            self._metrics.operations.labels(op="prune", outcome="conflict").inc()
            log.warning(
                "gc.prune.refused",
                topic=str(topic),
                segments=chosen,
                token=leadership.token,
                why="the layout or a subscription changed during the round, or this replica "
                "was deposed (fencing); the next round decides again",
            )
            return
        self._metrics.operations.labels(op="prune", outcome="ok").inc()
        self._metrics.gc_pruned_segments.inc(len(chosen))
        log.info(
            "gc.pruned",
            topic=str(topic),
            segments=chosen,
            retention_s=retention,
            token=leadership.token,
        )
        for sid in chosen:
            await self._finish_delete(leadership, topic, layout.segments[sid].descriptor, sid)

    async def _gc_backlogs(
        self, topic: TopicName, segments: list[Segment], subscriptions: list[str]
    ) -> dict[int, dict[str, int | None]]:
        """Every subscription's backlog on every segment, by segment id; None = unknown.

        At most :data:`GC_BACKLOG_CALLS` calls are in flight: that many workers take
        the calls in the sequential order (segment, then subscription). A
        :class:`BrokerError` makes that one backlog unknown, which is never drained.
        Any other exception stops the other calls and is raised as itself, not in an
        exception group, as when the calls ran one after another (``gc_round``
        handles it per topic). Cancelling the caller cancels the calls in flight.
        """
        backlogs: dict[int, dict[str, int | None]] = {s.segment_id: {} for s in segments}
        calls = itertools.product(segments, subscriptions)  # lazy: one pair per call
        workers = min(GC_BACKLOG_CALLS, len(segments) * len(subscriptions))
        failures: list[Exception] = []

        async def worker(scope: anyio.CancelScope) -> None:
            for seg, sub in calls:  # shared: each call is taken by exactly one worker
                try:
                    backlogs[seg.segment_id][sub] = await self._gc_backlog(topic, seg, sub)
                except Exception as exc:  # not a BrokerError: see the docstring
                    failures.append(exc)
                    scope.cancel()
                    return

        if not workers:
            return backlogs  # nothing to ask: no await, as before
        async with anyio.create_task_group() as tg:
            for _ in range(workers):
                tg.start_soon(worker, tg.cancel_scope)
        if failures:
            raise failures[0]  # the first; the calls it cancelled have no answer to give
        return backlogs

    async def _gc_backlog(self, topic: TopicName, seg: Segment, sub: str) -> int | None:
        """One subscription's backlog on one segment; None if the broker did not say."""
        try:
            return await self._broker.backlog(topic, seg.descriptor, sub)
        except BrokerError as exc:
            if isinstance(exc, Unauthorized):
                self._operator_error("broker-auth", str(exc))
            log.warning(
                "gc.backlog.failed",
                topic=str(topic),
                segment=seg.segment_id,
                subscription=sub,
                error=str(exc),
            )
            return None  # unknown is never drained

    def _retention(self, state: TopicState) -> float:
        """Seconds a sealed segment of this topic is kept (negative: forever).

        On Pulsar, where Pulsar keeps it: the namespace's ``retention_policies``,
        else ``gc.default_retention_seconds`` (set it to the broker's
        ``defaultRetentionTimeInMinutes``); topic-level retention lives in a
        Pulsar system topic we cannot read. Otherwise: the layout property, then
        our overrides, then the default.
        """
        config = self._config()
        default = config.gc.default_retention_seconds
        if config.broker.profile == "pulsar":
            namespace = self.view.pulsar_namespace(state.name)
            if namespace is not None and namespace.retention_seconds is not None:
                return namespace.retention_seconds
            return default
        return gc.resolve_retention(default, state.layout, *self.view.overrides_for(state.name))

    def _addressable(self, topic: TopicName, op: str) -> bool:
        """Whether the broker's REST paths can carry ``topic``'s name (see
        ``BrokerClient._local_name``), checked before GC prunes anything of it: a pruned
        segment of a topic no path can reach is never deleted. Said once per topic,
        as a split's or merge's :class:`Unaddressable` is."""
        if topic in self._unaddressable:
            return False
        if self._broker.profile != "pulsar":
            return True
        try:
            rest_path_topic(topic.topic)
        except ModelError as exc:
            self._unaddressable.add(topic)
            self._metrics.operations.labels(op=op, outcome="unaddressable").inc()
            log.error("topic.unaddressable", topic=str(topic), error=str(exc))
            return False
        return True

    async def _retry_marker(
        self,
        leadership: Leadership,
        kv: KeyValue,
        marker: PendingDelete,
        pruned_from: int | None,
    ) -> None:
        """Finish the delete a marker stands for, unless its topic was deleted and
        created again since the prune: segment ids restart at 0, so the descriptor
        now names a segment of the new topic, which GC never judged. That marker is
        dropped: the new layout key was created after the revision the prune was
        computed on (``pruned_from``), or, for a marker without it, the current layout
        holds the segment, which a prune removed for good."""
        topic = marker.topic
        try:
            current = await self._store.get(self._keys.layout(topic))
        except StoreError as exc:
            log.warning("gc.marker.unchecked", topic=str(topic), error=str(exc))
            return
        try:
            why = None if current is None else _marker_outlived(current, marker, pruned_from)
        except (ValueError, TypeError) as exc:  # an unreadable layout: whose marker is it?
            log.warning("gc.marker.unchecked", topic=str(topic), error=str(exc)[:300])
            return
        if why is None:
            await self._finish_delete(leadership, topic, marker.descriptor, marker.segment_id)
            return
        try:
            result = await self._store.txn(
                [leadership.fenced(), Compare.mod_revision(kv.key, kv.mod_revision)],
                [Delete(kv.key)],
            )
        except StoreError as exc:
            log.warning("gc.marker.clear_failed", topic=str(topic), error=str(exc))
            return
        log.warning(
            "gc.marker.outlived",
            topic=str(topic),
            descriptor=marker.descriptor,
            why=why,
            dropped=result.succeeded,
        )

    async def _finish_delete(
        self, leadership: Leadership, topic: TopicName, descriptor: str, segment_id: int
    ) -> None:
        """Delete a pruned segment's data, then its load record, then its marker."""
        try:
            existed = await self._broker.delete_segment(
                topic, descriptor, fencing_token=leadership.token, fencing_key=leadership.key
            )
        except BrokerError as exc:
            self._metrics.operations.labels(op="delete_segment", outcome=exc.outcome).inc()
            if isinstance(exc, Unauthorized):
                self._operator_error("broker-auth", str(exc))
            log.warning(
                "gc.delete.failed",
                topic=str(topic),
                descriptor=descriptor,
                error=str(exc),
                retry="next gc tick",
            )
            return
        self._metrics.operations.labels(op="delete_segment", outcome="ok").inc()
        try:
            await self._fenced_write(
                leadership,
                [
                    Delete(self._keys.load(topic, segment_id)),
                    Delete(self._keys.cold_since(topic, segment_id)),
                    Delete(self._keys.pending_delete(topic, descriptor)),
                ],
            )
        except StoreError as exc:
            # The data is gone; the marker stays, and the next tick deletes again (a
            # delete of a missing segment succeeds) and then clears it.
            log.warning(
                "gc.marker.clear_failed",
                topic=str(topic),
                descriptor=descriptor,
                error=str(exc),
                retry="next gc tick",
            )
        self._metrics.gc_deleted_segments.inc()
        log.info("gc.deleted", topic=str(topic), descriptor=descriptor, existed=existed)

    # -- status ---------------------------------------------------------------------------

    def status(self) -> Mapping[str, Any]:
        return {
            "topics": len(self.view.topics),
            "topics_led": (
                len(self.view.topics)
                if None in self._scopes
                else sum(len(self._by_shard.get(s, ())) for s in self._scopes if s is not None)
            ),
            "in_flight": sorted(str(t) for t in self._in_flight),
            "queued": len(self._queued),
            "first_pass_remaining": self.first_pass_remaining,
            "last_decisions": [dataclasses.asdict(r) for r in list(self.history)[-20:]],
        }

    def _topics_in(self, scopes: Iterable[Scope]) -> list[TopicName]:
        """A snapshot of the topics in ``scopes`` (every topic for scope ``None``).

        In sharded mode from the per-shard index, so a replica owning 1/N of the
        shards walks 1/N of the topics.
        """
        wanted = set(scopes)
        if None in wanted or self._shards is None:
            return list(self.view.topics) if wanted else []
        return [t for s in wanted if s is not None for t in self._by_shard.get(s, ())]


def _subscription_names(kvs: Iterable[KeyValue], start: int) -> list[str]:
    """The subscriptions a topic's subscription and consumer keys name (``start``: where
    the name begins in each key), as the view reads them."""
    names = set()
    for kv in kvs:
        parts = kv.key[start:].split("/")
        if len(parts) == 1 or (len(parts) == 3 and parts[1] == "consumers"):
            names.add(parts[0])
    return sorted(names)


def _marker_outlived(
    current: KeyValue, marker: PendingDelete, pruned_from: int | None
) -> str | None:
    """Why a pending-delete marker belongs to an earlier topic of the name than the
    layout ``current`` (None: it is this topic's; its segment may be deleted).

    Raises:
        ValueError, TypeError: a marker without ``pruned_from`` and a layout that
            cannot be read: nothing tells whose the marker is (it is kept).
    """
    if pruned_from is not None and current.create_revision > pruned_from:
        return f"the topic was created again at revision {current.create_revision}"
    try:
        held = layout_from_json(parse_json(current.value)).segments.get(marker.segment_id)
    except (ValueError, TypeError):
        if pruned_from is not None:
            return None  # the same topic: its revision says so
        raise
    if held is not None and held.descriptor == marker.descriptor:
        return "the topic's layout holds the segment, which a prune removed for good"
    return None


def _sealed_by(decision: Split | Merge) -> tuple[int, ...]:
    return (decision.segment_id,) if isinstance(decision, Split) else (decision.a, decision.b)


@dataclass(slots=True)
class _QuietMark:
    """The view version and policy a topic was last found quiet on (see ``_quiet``).

    Updated in place: a storm of balanced records moves every mark, and a new object
    per record would each be walked by the collector's full scans until replaced.
    """

    version: int
    policy: PolicySettings | PolicyInvalid


def _freeze_survivors() -> None:
    """Keep what a first pass leaves behind out of the collector's full scans.

    A first pass leaves a cached policy and a quiet mark per topic, objects the
    collector tracks; every full collection walked them again (29-40 ms in process
    at 100,000 topics, and a leader under a write storm stalled 106 ms with the
    collector running 110 ms of it). They hold no cycles, so frozen ones that are
    replaced are still freed by reference counting. A young collection first frees
    young cyclic garbage, so that is not frozen with them.
    """
    collector.collect(1)
    collector.freeze()


def _over(rates: tuple[float, float, float, float], limits: Rates) -> bool:
    """Any rate strictly above its limit (``policy``'s test, on a packed row)."""
    a, b, c, d = rates
    return (
        a > limits.msg_rate_in
        or b > limits.byte_rate_in
        or c > limits.msg_rate_out
        or d > limits.byte_rate_out
    )


def _under(rates: tuple[float, float, float, float], limits: Rates) -> bool:
    """All rates strictly below their limits (:func:`policy.below`, on a packed row)."""
    a, b, c, d = rates
    return (
        a < limits.msg_rate_in
        and b < limits.byte_rate_in
        and c < limits.msg_rate_out
        and d < limits.byte_rate_out
    )


class _ColdOf(Mapping[int, int]):
    """A topic's cold-since by segment: persisted, else held in memory (for inheritance)."""

    def __init__(self, state: TopicState) -> None:
        self._state = state

    def __getitem__(self, segment_id: int) -> int:
        value = self._state.cold_since.get(segment_id, self._state.loads.cold(segment_id))
        if value is None:
            raise KeyError(segment_id)
        return value

    def __iter__(self) -> Iterator[int]:
        return iter({*self._state.cold_since, *self._state.loads})

    def __len__(self) -> int:
        return sum(1 for _ in self)
