"""Leader-only work: observe etcd, decide with the pure core, act through the broker.

One :class:`Controller` lives for one term of leadership and is cancelled the
moment leadership is lost. Invariants it keeps:

* per topic at most one evaluation runs at a time (the in-flight guard); a
  trigger that arrives meanwhile sets a flag and the topic is evaluated exactly
  once more afterwards, so no trigger is lost and a burst costs one re-run;
* a cooldown is stamped only after the broker confirmed the operation, and a
  broker failure always releases the guard (``finally``) and stamps nothing;
* every mutation carries the fencing token; GC's prune is an etcd transaction
  that also compares the leader key's create revision with it;
* segment cold-since times are persisted on cold/warm transitions so the next
  leader keeps them (DESIGN §8.1); missing or stale load is never cold.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import structlog

from controllerd.adapters import backoff
from controllerd.adapters.audit import AuditSink
from controllerd.adapters.broker import BrokerClient, BrokerError, Fenced
from controllerd.adapters.election import Leadership
from controllerd.adapters.store import Compare, Put, Store, WatchCompacted
from controllerd.config import Config
from controllerd.core import gc
from controllerd.core.layout import prune
from controllerd.core.model import (
    Decision,
    Merge,
    NoAction,
    PolicySettings,
    Split,
    TopicName,
    decision_to_json,
    layout_to_json,
)
from controllerd.core.policy import (
    PolicyInvalid,
    below,
    decide,
    inherited_cold_since,
    is_stale,
    resolve_policy,
)
from controllerd.core.view import Change, Cooldown, MetadataView, Rejected, TopicState
from controllerd.daemon.clock import Clock
from controllerd.daemon.metrics import Metrics

log = structlog.get_logger("controllerd.daemon.controller")

#: How long to wait for the broker's new layout to show up in etcd after an
#: operation before evaluating the topic on the old one again.
LAYOUT_CATCH_UP_SECONDS = 5.0
#: Most evaluations (and so admin calls) in flight at once across topics.
MAX_CONCURRENT_EVALUATIONS = 16


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """What /status shows of a recent decision."""

    ts_ms: int
    topic: str
    decision: dict[str, Any]
    outcome: str


class Controller:
    """The leader's control loop for every topic under the metadata prefix."""

    def __init__(
        self,
        *,
        config: Callable[[], Config],
        store: Store,
        broker: BrokerClient,
        view: MetadataView,
        leadership: Leadership,
        metrics: Metrics,
        audit: AuditSink,
        clock: Clock,
        replica: str,
        history: collections.deque[DecisionRecord] | None = None,
    ) -> None:
        self._config = config
        self._store = store
        self._broker = broker
        self.view = view
        self._leadership = leadership
        self._metrics = metrics
        self._audit = audit
        self._clock = clock
        self._replica = replica
        self.history = history if history is not None else collections.deque(maxlen=100)
        self._keys = view.keys
        self._in_flight: set[TopicName] = set()
        self._again: set[TopicName] = set()
        self._settling: set[TopicName] = set()
        self._awaiting: dict[TopicName, tuple[int, float]] = {}
        self._failures: dict[TopicName, int] = {}
        self._limiter = anyio.Semaphore(MAX_CONCURRENT_EVALUATIONS)
        self._tg: anyio.abc.TaskGroup | None = None
        self.ready = anyio.Event()

    @property
    def token(self) -> int:
        return self._leadership.token

    # -- lifecycle -----------------------------------------------------------------------

    async def run(self) -> None:
        """Load everything, then follow the watches and tick until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            meta_rev = await self._load_prefix(self._keys.topics_prefix)
            ctl_rev = await self._load_prefix(self._keys.controller_prefix)
            self._metrics.topics.set(len(self.view.topics))
            log.info("controller.started", topics=len(self.view.topics), token=self.token)
            tg.start_soon(self._watch, self._keys.topics_prefix, meta_rev + 1, name="watcher")
            tg.start_soon(
                self._watch, self._keys.controller_prefix, ctl_rev + 1, name="watcher-ctl"
            )
            tg.start_soon(self._ticker, name="ticker")
            tg.start_soon(self._gc_ticker, name="gc")
            for topic in sorted(self.view.topics):
                self.trigger(topic)
            self.ready.set()

    async def _load_prefix(self, prefix: str) -> int:
        kvs, revision = await self._store.get_prefix(prefix)
        now = self._clock.now_ms()
        for kv in kvs:
            self._note(self.view.apply_put(kv.key, kv.value, kv.mod_revision, now))
        return revision

    async def _watch(self, prefix: str, start_revision: int) -> None:
        revision = start_revision
        while True:
            try:
                async for batch in self._store.watch_prefix(prefix, revision):
                    now = self._clock.now_ms()
                    for event in batch:
                        revision = max(revision, event.mod_revision + 1)
                        if event.kind == "put":
                            outcome = self.view.apply_put(
                                event.key, event.value, event.mod_revision, now
                            )
                        else:
                            outcome = self.view.apply_delete(event.key)
                        self._note(outcome)
                return
            except WatchCompacted:
                self._metrics.watch_restarts.inc()
                log.warning("watch.compacted", prefix=prefix, revision=revision)
                revision = await self._load_prefix(prefix) + 1

    def _note(self, outcome: Change | Rejected | None) -> None:
        """Count rejections; trigger evaluations for changes that ask for one."""
        if isinstance(outcome, Rejected):
            counter = (
                self._metrics.load_records_rejected
                if outcome.kind == "load"
                else self._metrics.layouts_rejected
            )
            counter.labels(reason=outcome.kind).inc()
            log.warning(
                "metadata.rejected", key=outcome.key, kind=outcome.kind, reason=outcome.reason
            )
            return
        if outcome is None:
            return
        self._metrics.topics.set(len(self.view.topics))
        if outcome.kind == "layout" and outcome.topic is not None:
            self._layout_arrived(outcome.topic)
        if not outcome.trigger or self._tg is None:
            return
        if outcome.topic is None:
            for topic in sorted(self.view.topics):
                self.trigger(topic)
        elif outcome.kind == "consumer":
            self._settle(outcome.topic)
        else:
            self.trigger(outcome.topic)

    def _settle(self, topic: TopicName) -> None:
        """Evaluate after ``consumer_settle_seconds`` so a burst of registrations is one."""
        settle = self._config().autoscale.consumer_settle_seconds
        if settle <= 0:
            self.trigger(topic)
        elif topic not in self._settling:
            self._settling.add(topic)

            async def settled() -> None:
                try:
                    await self._clock.sleep(settle)
                finally:
                    self._settling.discard(topic)
                self.trigger(topic)

            assert self._tg is not None
            self._tg.start_soon(settled, name=f"settle:{topic}")

    def _layout_arrived(self, topic: TopicName) -> None:
        awaited = self._awaiting.get(topic)
        state = self.view.topics.get(topic)
        if awaited is not None and (
            state is None or state.layout is None or state.layout.epoch > awaited[0]
        ):
            del self._awaiting[topic]

    async def _ticker(self) -> None:
        while True:
            await self._clock.sleep(self._config().autoscale.interval_seconds)
            for topic in sorted(self.view.topics):
                self.trigger(topic)

    async def _gc_ticker(self) -> None:
        while True:
            await self._clock.sleep(self._config().gc.interval_seconds)
            await self.gc_round()

    def _after(self, seconds: float, topic: TopicName, why: str) -> None:
        """Evaluate ``topic`` again after ``seconds`` of clock time."""

        async def timer() -> None:
            await self._clock.sleep(seconds)
            log.debug("evaluation.timer", topic=str(topic), why=why)
            self.trigger(topic)

        assert self._tg is not None
        self._tg.start_soon(timer, name=f"timer:{topic}")

    # -- evaluation ----------------------------------------------------------------------

    def trigger(self, topic: TopicName) -> None:
        """Ask for an evaluation of ``topic``; coalesces while one is in flight."""
        if topic in self._in_flight:
            self._again.add(topic)
            return
        self._in_flight.add(topic)
        assert self._tg is not None
        self._tg.start_soon(self._evaluate_loop, topic, name=f"evaluate:{topic}")

    async def _evaluate_loop(self, topic: TopicName) -> None:
        try:
            while True:
                self._again.discard(topic)
                async with self._limiter:
                    started = anyio.current_time()
                    try:
                        await self.evaluate(topic)
                    except Exception:
                        # One topic's bug must not stop the others; the next trigger retries.
                        log.exception("evaluation.failed", topic=str(topic))
                    self._metrics.evaluation_duration.observe(anyio.current_time() - started)
                if topic not in self._again:
                    return
        finally:
            self._in_flight.discard(topic)
            self._again.discard(topic)

    def resolved_policy(self, state: TopicState) -> PolicySettings | PolicyInvalid:
        layout = state.layout
        return resolve_policy(
            self._config().policy,
            *self.view.overrides_for(state.name),
            layout.auto_scale_policy if layout is not None else None,
        )

    async def evaluate(self, topic: TopicName) -> Decision | None:
        """Decide one topic and act on the decision; None when there was nothing to decide."""
        state = self.view.topics.get(topic)
        if state is None or state.layout is None or self._leadership.lost.is_set():
            return None
        awaited = self._awaiting.get(topic)
        if awaited is not None:
            if self._clock.monotonic() < awaited[1]:
                return None
            del self._awaiting[topic]
        now = self._clock.now_ms()
        policy = self.resolved_policy(state)
        if isinstance(policy, PolicySettings):
            await self._track_cold(state, policy, now)
        layout = state.layout  # read after the awaits above: decide on the newest
        if layout is None:
            return None
        loads = {
            sid: dataclasses.replace(sample, cold_since_ms=state.cold_since.get(sid))
            for sid, sample in state.loads.items()
        }
        cooldown = state.effective_cooldown()
        decision = decide(
            layout,
            loads,
            state.consumer_counts(),
            policy,
            now,
            cooldown.last_split_ms,
            cooldown.last_merge_ms,
        )
        self._metrics.decisions.labels(action=decision.action, reason=decision.reason).inc()
        fields = {
            "topic": str(topic),
            "action": decision.action,
            "reason": decision.reason,
            "detail": decision.detail,
            "epoch": layout.epoch,
            "token": self.token,
        }
        if isinstance(decision, NoAction):
            if decision.reason == "balanced":
                log.debug("decision", **fields)
            else:
                log.info("decision", **fields)
            return decision
        log.info("decision", **fields)
        outcome = await self._act(topic, state, layout.epoch, decision, policy, now)
        self._record(topic, decision, outcome, now, state)
        return decision

    async def _track_cold(self, state: TopicState, policy: PolicySettings, now: int) -> None:
        """Persist cold/warm transitions of active segments (DESIGN §8.1)."""
        assert state.layout is not None
        for seg in state.layout.active_segments():
            sid = seg.segment_id
            sample = state.loads.get(sid)
            if sample is None or is_stale(sample, policy, now):
                continue
            cold = below(sample.rates, policy.merge_thresholds)
            if cold and sid not in state.cold_since:
                inherited = inherited_cold_since(state.layout, sid, state.cold_since)
                since = inherited if inherited is not None else min(sample.changed_at_ms, now)
                state.cold_since[sid] = since
                await self._store.put(self._keys.cold_since(state.name, sid), str(since).encode())
                log.info("segment.cold", topic=str(state.name), segment=sid, since_ms=since)
            elif not cold and sid in state.cold_since:
                del state.cold_since[sid]
                await self._store.delete(self._keys.cold_since(state.name, sid))
                log.info("segment.warm", topic=str(state.name), segment=sid)

    async def _act(
        self,
        topic: TopicName,
        state: TopicState,
        decided_epoch: int,
        decision: Split | Merge,
        policy: PolicySettings | PolicyInvalid,
        now: int,
    ) -> str:
        op = decision.action
        if self._leadership.lost.is_set():
            return "not-leader"
        try:
            if isinstance(decision, Split):
                await self._broker.split(
                    topic, decision.segment_id, decision.boundaries, fencing_token=self.token
                )
            else:
                await self._broker.merge(topic, decision.a, decision.b, fencing_token=self.token)
        except Fenced as exc:
            self._metrics.operations.labels(op=op, outcome=exc.outcome).inc()
            log.error(
                "operation.fenced",
                topic=str(topic),
                op=op,
                token=self.token,
                error=str(exc),
                action="stepping down: a newer leader exists",
            )
            self._leadership.lost.set()
            return exc.outcome
        except BrokerError as exc:
            outcome = exc.outcome
            self._metrics.operations.labels(op=op, outcome=outcome).inc()
            failures = self._failures.get(topic, 0) + 1
            self._failures[topic] = failures
            retry_in = backoff.TOPIC_RETRY.capped_at(
                self._config().autoscale.interval_seconds
            ).delay(failures - 1)
            log.warning(
                "operation.failed",
                topic=str(topic),
                op=op,
                outcome=outcome,
                error=str(exc),
                retry_in_s=retry_in,
            )
            self._after(retry_in, topic, "retry")
            return outcome
        self._failures.pop(topic, None)
        self._metrics.operations.labels(op=op, outcome="ok").inc()
        old = state.effective_cooldown()
        stamp = (
            Cooldown(now, old.last_merge_ms) if op == "split" else Cooldown(old.last_split_ms, now)
        )
        state.cooldown = stamp
        await self._store.put(self._keys.cooldown(topic), json.dumps(stamp.to_json()).encode())
        current = state.layout
        if current is not None and current.epoch <= decided_epoch:
            # The broker's new layout has not reached us yet: do not decide on the old one.
            self._awaiting[topic] = (
                decided_epoch,
                self._clock.monotonic() + LAYOUT_CATCH_UP_SECONDS,
            )
        if isinstance(decision, Split) and isinstance(policy, PolicySettings):
            self._after(policy.split_cooldown_seconds, topic, "split-cooldown-expired")
        log.info("operation.done", topic=str(topic), op=op, token=self.token)
        return "ok"

    def _record(
        self, topic: TopicName, decision: Decision, outcome: str, now: int, state: TopicState
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
                "fencing_token": self.token,
                "outcome": outcome,
                "replica": self._replica,
            }
        )

    # -- GC ------------------------------------------------------------------------------

    async def gc_round(self) -> None:
        """Finish deletes left behind, then prune every topic's drained sealed segments."""
        if self._leadership.lost.is_set():
            return
        kvs, _ = await self._store.get_prefix(self._keys.pending_deletes_prefix)
        self._metrics.gc_pending_deletes.set(len(kvs))
        for kv in kvs:
            try:
                marker = json.loads(kv.value)
                topic = TopicName.parse(marker["topic"])
                await self._finish_delete(
                    topic, str(marker["descriptor"]), int(marker["segmentId"])
                )
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("gc.marker.malformed", key=kv.key, error=str(exc))
        for topic in sorted(self.view.topics):
            if self._leadership.lost.is_set():
                return
            state = self.view.topics.get(topic)
            if state is not None and state.layout is not None:
                await self._gc_topic(state)

    async def _gc_topic(self, state: TopicState) -> None:
        layout = state.layout
        assert layout is not None
        topic, now = state.name, self._clock.now_ms()
        retention = gc.resolve_retention(
            self._config().gc.default_retention_seconds, layout, *self.view.overrides_for(topic)
        )
        verdicts: dict[int, gc.Verdict] = {}
        for seg in gc.candidates(layout, now, retention):
            backlogs: dict[str, int | None] = {}
            for sub in sorted(state.subscriptions):
                try:
                    backlogs[sub] = await self._broker.backlog(topic, seg.descriptor, sub)
                except BrokerError as exc:
                    log.warning(
                        "gc.backlog.failed",
                        topic=str(topic),
                        segment=seg.segment_id,
                        subscription=sub,
                        error=str(exc),
                    )
                    backlogs[sub] = None
            verdict = gc.prunable(seg, now, retention, backlogs)
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
        if not chosen or self._leadership.lost.is_set():
            return
        pruned = prune(layout, chosen)
        markers = [
            Put(
                self._keys.pending_delete(topic, layout.segments[sid].descriptor),
                json.dumps(
                    {
                        "topic": str(topic),
                        "descriptor": layout.segments[sid].descriptor,
                        "segmentId": sid,
                        "prunedAtMs": now,
                    }
                ).encode(),
            )
            for sid in chosen
        ]
        result = await self._store.txn(
            [
                Compare.mod_revision(self._keys.layout(topic), state.layout_revision),
                Compare.create_revision(self._keys.leader, self.token),
            ],
            [Put(self._keys.layout(topic), json.dumps(layout_to_json(pruned)).encode()), *markers],
        )
        if not result.succeeded:
            self._metrics.operations.labels(op="prune", outcome="conflict").inc()
            log.warning(
                "gc.prune.refused",
                topic=str(topic),
                segments=chosen,
                token=self.token,
                why="layout changed or this replica was deposed (fencing)",
            )
            return
        self._metrics.operations.labels(op="prune", outcome="ok").inc()
        self._metrics.gc_pruned_segments.inc(len(chosen))
        log.info(
            "gc.pruned", topic=str(topic), segments=chosen, retention_s=retention, token=self.token
        )
        for sid in chosen:
            await self._finish_delete(topic, layout.segments[sid].descriptor, sid)

    async def _finish_delete(self, topic: TopicName, descriptor: str, segment_id: int) -> None:
        """Delete a pruned segment's data, then its load record, then its marker."""
        try:
            existed = await self._broker.delete_segment(topic, descriptor, fencing_token=self.token)
        except BrokerError as exc:
            self._metrics.operations.labels(op="delete_segment", outcome=exc.outcome).inc()
            log.warning(
                "gc.delete.failed",
                topic=str(topic),
                descriptor=descriptor,
                error=str(exc),
                retry="next gc tick",
            )
            return
        self._metrics.operations.labels(op="delete_segment", outcome="ok").inc()
        await self._store.delete(self._keys.load(topic, segment_id))
        await self._store.delete(self._keys.cold_since(topic, segment_id))
        await self._store.delete(self._keys.pending_delete(topic, descriptor))
        self._metrics.gc_deleted_segments.inc()
        log.info("gc.deleted", topic=str(topic), descriptor=descriptor, existed=existed)

    # -- status --------------------------------------------------------------------------

    def status(self) -> Mapping[str, Any]:
        return {
            "topics": len(self.view.topics),
            "in_flight": sorted(str(t) for t in self._in_flight),
            "last_decisions": [dataclasses.asdict(r) for r in list(self.history)[-20:]],
        }
