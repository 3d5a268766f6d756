"""A controllerd cluster wired for fault injection, shared by the fault suite and
``bench/fault_bench.py``.

Real ``controllerd run`` processes, the session's real etcd (directly, or
through a :class:`~tests.support.proxy.TcpProxy` that can cut them off), and
the test broker over real HTTP behind a
:class:`~tests.support.faulty_http.FaultyHttp` that injects storms on the
real admin paths. The test broker mirrors each layout it writes into etcd, as
Pulsar does, so the replicas see their own operations through the watch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from controllerd.adapters import backoff
from controllerd.adapters.store import Store
from controllerd.core.model import Layout, TopicName
from controllerd.core.view import Keys
from tests.support.broker import (
    TestBrokerState,
    layout_json,
    load_json,
    mirror_into,
    serve_test_broker,
)
from tests.support.daemon import Replica, wait_until, write_config
from tests.support.faulty_http import FaultyHttp, serve_faulty_http
from tests.support.kafka import free_port
from tests.support.proxy import TcpProxy, serve_proxy

TOPIC = TopicName("acme", "ns", "orders")
#: The admin API's segment paths: backlog reads (GET) and deletes (DELETE) go under it.
SEGMENTS = "/admin/v2/segments/"
#: Three times the default split threshold (msgRateIn 10,000/s): a 3-way split.
HOT = 30_000.0


def segments_prefix(topic: TopicName) -> str:
    """The admin path prefix of ``topic``'s segments."""
    return f"{SEGMENTS}{topic.tenant}/{topic.namespace}/{topic.topic}/"


@dataclass
class Chaos:
    """The cluster under test and the handles that break it."""

    store: Store
    keys: Keys
    broker: TestBrokerState
    http: FaultyHttp
    tmp: Path
    etcd_endpoint: str
    proxy: TcpProxy | None
    prefix: str
    extra: str
    lease_ttl: int
    env: dict[str, str]
    replicas: list[Replica] = field(default_factory=list)
    #: Replicas the test stopped or killed on purpose (their exit is not a failure).
    stopped: set[str] = field(default_factory=set)

    # -- replicas ---------------------------------------------------------------------------

    async def start_replica(self, *, ready: bool = True) -> Replica:
        """One more ``controllerd run`` process on the same config (its own ops port)."""
        index = len(self.replicas)
        port = free_port()
        endpoint = self.proxy.endpoint if self.proxy is not None else self.etcd_endpoint
        path = write_config(
            self.tmp / f"replica-{index}.toml",
            etcd=endpoint,
            prefix=self.prefix,
            broker_url=self.http.url,
            port=port,
            extra=self.extra,
            lease_ttl=self.lease_ttl,
        )
        replica = Replica(
            f"r{index}", path, port, self.tmp / f"replica-{index}.log", dict(self.env)
        )
        replica.start()
        self.replicas.append(replica)
        if ready:
            await wait_until(replica.ready, within=30)
        return replica

    def alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive()]

    def log_tails(self, chars: int = 4000) -> str:
        """The end of every replica's log, for a test that timed out to print: a wait
        that fails in CI leaves nothing else behind to explain it."""
        return "\n".join(
            f"--- {r.name} ---\n"
            + r.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
            for r in self.replicas
            if r.log_path.exists()
        )

    def assert_alive(self) -> None:
        """Fail at once, with the end of its log, if a replica ended on its own."""
        for replica in self.replicas:
            proc = replica.proc
            if proc is None or proc.poll() is None or replica.name in self.stopped:
                continue
            tail = replica.log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
            raise AssertionError(
                f"replica {replica.name} exited with status {proc.returncode}:\n{tail}"
            )

    async def leader(self, within: float = 30.0) -> Replica:
        """The one live replica that says it leads (waits until exactly one does)."""
        found: list[Replica] = []

        async def one() -> bool:
            self.assert_alive()
            found[:] = [r for r in self.alive() if await r.is_leader()]
            return len(found) == 1

        await wait_until(one, within=within, step=0.05)
        return found[0]

    async def no_leader(self) -> bool:
        return not any([await r.is_leader() for r in self.alive()])

    async def stop_all(self) -> None:
        with anyio.CancelScope(shield=True):
            for replica in self.replicas:
                self.stopped.add(replica.name)
                await replica.stop()

    # -- topics and load ----------------------------------------------------------------------

    async def add_topic(self, topic: TopicName = TOPIC, segments: int = 1) -> Layout:
        layout = self.broker.add_topic(topic, segments)
        await self.store.put(self.keys.layout(topic), layout_json(layout))
        return layout

    async def add_subscription(self, sub: str, topic: TopicName = TOPIC) -> None:
        self.broker.subscriptions.setdefault(topic, {})[sub] = "STREAM"
        await self.store.put(self.keys.subscription(topic, sub), b'{"type": "STREAM"}')

    async def split_with_unknown_backlog(self, topic: TopicName, status: int) -> str:
        """:meth:`split_with_subscription`, but every backlog read of the topic fails:
        answered with ``status``, or never answered when ``status`` is 0."""
        prefix = segments_prefix(topic)
        if status:
            self.http.fail(prefix, status, method="GET")
        else:
            self.http.hang(prefix, method="GET")
        return await self.split_with_subscription(topic)

    async def split_with_subscription(self, topic: TopicName, *, retention: int = 0) -> str:
        """A topic with subscription ``s``, split once by a hot load record (segment 0
        sealed); segment 0's descriptor. ``retention``: the topic's own, in seconds."""
        layout = self.broker.add_topic(topic, 1)
        if retention:
            layout = dataclasses.replace(
                layout, properties={"segmentRetentionSeconds": str(retention)}
            )
            self.broker.topics[topic] = layout
        await self.store.put(self.keys.layout(topic), layout_json(layout))
        await self.add_subscription("s", topic)
        await self.put_load(0, HOT, topic)
        return layout.segments[0].descriptor

    async def put_load(self, segment_id: int, msg_in: float, topic: TopicName = TOPIC) -> None:
        await self.store.put(self.keys.load(topic, segment_id), load_json(msg_in))

    def active(self, topic: TopicName = TOPIC) -> int:
        layout = self.broker.topics.get(topic)
        return 0 if layout is None else len(layout.active_segments())

    def splits_applied(self, topic: TopicName = TOPIC) -> int:
        """Split requests the broker answered 2xx for ``topic``."""
        path = _topic_path(topic) + "/split/"
        return sum(
            1 for s in self.http.seen if path in s.path and s.status is not None and s.status < 300
        )

    async def cooldown_written(self, topic: TopicName = TOPIC) -> bool:
        return await self.store.get(self.keys.cooldown(topic)) is not None

    async def in_flight(self) -> set[str]:
        """Topics some replica is evaluating right now (the per-topic guard is held)."""
        held: set[str] = set()
        for replica in self.alive():
            status = await replica.status()
            if status is not None:
                held.update(status.get("in_flight", []))
        return held

    async def metric(self, replica: Replica, name: str, **labels: str) -> float:
        value = await replica.metric(name, **labels)
        return 0.0 if value is None else value


def _topic_path(topic: TopicName) -> str:
    return f"/admin/v2/scalable/{topic.tenant}/{topic.namespace}/{topic.topic}"


def topic_path(topic: TopicName) -> str:
    """The admin path of a topic, as the faulty server sees it (for rules and counts)."""
    return _topic_path(topic)


#: Gaps between two split requests shorter than this are the broker client's own
#: retry within one operation (its schedule waits at most ``BROKER.first``, plus
#: the layout read that reconciles); longer gaps separate operations.
SAME_OPERATION = 0.3


def operations(arrivals: Sequence[float], per_op: int | None = None) -> list[list[float]]:
    """Request arrival times grouped into operations (one decision's attempts).

    ``per_op``: every operation made exactly this many attempts (a storm of 5xx, each
    retried ``max_retries`` times): consecutive runs of that many, whatever the gaps.
    Gaps alone misgroup on a loaded machine, where the client's own retry (a backoff
    of at most 0.1 s plus a layout read) arrived 0.315 s after its first attempt. The
    caller must check that the runs are operations (none spans a topic backoff): a
    miscount shifts every later run.
    """
    if per_op is not None:
        return [list(arrivals[i : i + per_op]) for i in range(0, len(arrivals), per_op)]
    ops: list[list[float]] = []
    for at in arrivals:
        if ops and at - ops[-1][-1] < SAME_OPERATION:
            ops[-1].append(at)
        else:
            ops.append([at])
    return ops


#: Seconds by which an arrival may be recorded late: the observer is a thread in a
#: process that shares two cores with etcd and the replicas. Below it a gap is a
#: violation; the bug this guards against retried within milliseconds.
OBSERVER_LAG = 0.25


def spanning_backoff(
    ops: Sequence[Sequence[float]], schedule: backoff.Backoff
) -> list[Sequence[float]]:
    """Runs from :func:`operations` (``per_op``) that are not one operation: their
    attempts span at least the topic backoff's shortest wait (half its first
    ceiling), which the broker client's own retry never does. A run holding the end
    of one operation and the start of the next means a miscount shifted the runs."""
    least = schedule.ceiling(0) / 2
    return [op for op in ops if op and op[-1] - op[0] >= least]


def schedule_violations(
    ops: Sequence[Sequence[float]], schedule: backoff.Backoff, max_retries: int, slack: float
) -> list[str]:
    """How a failing topic's operations break the retry schedules (empty: none).

    Within an operation: at most ``max_retries + 1`` requests. Between
    operations: the topic's backoff after ``n`` failures, at least
    ``ceiling(n) / 2`` (less :data:`OBSERVER_LAG`) and at most ``ceiling(n)``
    (plus ``slack`` for a busy machine).
    """
    found: list[str] = []
    for op in ops:
        if len(op) > max_retries + 1:
            found.append(
                f"{len(op)} requests within {op[-1] - op[0]:.3f}s: not spaced by the backoff"
            )
    for failures, (a, b) in enumerate(itertools.pairwise(ops)):
        gap, ceiling = b[0] - a[-1], schedule.ceiling(failures)
        if gap < ceiling / 2 - OBSERVER_LAG:
            found.append(f"retry {failures + 1} after {gap:.3f}s < floor {ceiling / 2}s")
        if gap > ceiling + slack:
            found.append(f"retry {failures + 1} after {gap:.3f}s > cap {ceiling}s")
    return found


@contextlib.asynccontextmanager
async def open_chaos(
    store: Store,
    etcd_endpoint: str,
    prefix: str,
    tmp: Path,
    *,
    count: int = 2,
    extra: str = "",
    lease_ttl: int = 2,
    etcd_proxy: bool = False,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[Chaos]:
    """``count`` running replicas on ``prefix``; each stopped (SIGTERM) at exit.

    ``extra`` is TOML appended to each replica's config (tables other than
    ``[etcd]``, ``[election]``, ``[broker]``, ``[http]``, ``[logging]``, which
    :func:`~tests.support.daemon.write_config` writes); ``env`` adds
    ``CONTROLLERD_<TABLE>__<KEY>`` overrides for those.
    """
    tmp.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before any process
    keys = Keys(f"{prefix}pulsar", f"{prefix}controllerd/default")
    state = TestBrokerState(profile="reference")
    state.on_layout_change = mirror_into(store, keys)
    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_test_broker(state))
        http = await stack.enter_async_context(serve_faulty_http(url))
        proxy = await stack.enter_async_context(serve_proxy(etcd_endpoint)) if etcd_proxy else None
        chaos = Chaos(
            store,
            keys,
            state,
            http,
            tmp,
            etcd_endpoint,
            proxy,
            prefix,
            extra,
            lease_ttl,
            dict(env or {}),
        )
        try:
            for _ in range(count):
                await chaos.start_replica(ready=False)
            for replica in chaos.replicas:
                await wait_until(replica.ready, within=30)
            yield chaos
        finally:
            await chaos.stop_all()
