"""Broker storms on the real admin paths, under a real ``controllerd run`` (issue #10, 11).

A fault-injecting HTTP server stands in front of the test broker and answers
split requests with 503 or 500 storms, 409 or 412, or accepts them and never
answers. For each: the per-topic guard is released (the topic is evaluated
again, nothing stays in flight), no cooldown is burned (no cooldown key while
every operation failed), the retries follow the one retry schedule
(``controllerd.adapters.backoff``: the broker client's own retry, then the
topic's capped, jittered backoff, never faster than its floor and never in
lockstep across topics), and once the broker heals the split happens by
itself.

Hot load records keep arriving during the storm, as they do from a real
reporter: they are triggers too, and must not shortcut the backoff.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import pytest

from controllerd.adapters import backoff
from controllerd.adapters.store import Store
from controllerd.core.model import TopicName
from tests.faults.chaos import (
    Chaos,
    open_chaos,
    operations,
    schedule_violations,
    spanning_backoff,
    topic_path,
)
from tests.support.daemon import wait_until
from tests.support.etcd import EtcdServer
from tests.support.faulty_http import Seen

#: autoscale.interval_seconds: also the cap of the topic retry schedule, so the
#: cap is reached within a short storm.
INTERVAL = 2.0
SCHEDULE = backoff.TOPIC_RETRY.capped_at(INTERVAL)
#: broker.max_retries in the replicas' config (tests/support/daemon.write_config).
MAX_RETRIES = 1
#: Scheduling slack on a shared 2-core machine, added to upper bounds only.
SLACK = 1.0
STORM_SECONDS = 7.0
CONFIG = f"[autoscale]\ninterval_seconds = {INTERVAL}\nconsumer_settle_seconds = 0\n"
#: broker.timeout_seconds: how long the client waits for a request that is never
#: answered; short, so a storm of hung requests fits in a few seconds.
TIMEOUT = 0.5


@pytest.fixture
async def chaos(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, tmp_path: Path
) -> AsyncIterator[Chaos]:
    async with open_chaos(
        store,
        etcd_server.endpoint,
        etcd_prefix,
        tmp_path,
        count=1,
        extra=CONFIG,
        env={"CONTROLLERD_BROKER__TIMEOUT_SECONDS": str(TIMEOUT)},
    ) as running:
        await running.leader()
        yield running


def check_schedule(name: str, ops: list[list[float]], at_least: int = 4) -> list[float]:
    """Assert the retries follow the schedule; the gaps between operations."""
    assert schedule_violations(ops, SCHEDULE, MAX_RETRIES, SLACK) == [], name
    assert len(ops) >= at_least, f"{name}: not evaluated again ({len(ops)} operations)"
    return [b[0] - a[-1] for a, b in itertools.pairwise(ops)]


async def keep_hot(chaos: Chaos, topics: Sequence[TopicName], seconds: float) -> None:
    """Hot load records every half second, as a reporter under real load writes them."""
    rng = random.Random(10)
    with anyio.move_on_after(seconds):
        while True:
            for topic in topics:
                await chaos.put_load(0, rng.uniform(24_000.0, 30_000.0), topic)
            await anyio.sleep(0.5)


async def storm_then_heal(chaos: Chaos, topics: Sequence[TopicName]) -> None:
    """The storm: hot topics, no cooldown burned, the guard released between attempts."""
    for topic in topics:
        await chaos.add_topic(topic)
    async with anyio.create_task_group() as tg:
        tg.start_soon(keep_hot, chaos, topics, STORM_SECONDS)

        async def retried() -> bool:  # every topic failed and was evaluated again
            chaos.assert_alive()
            return all(len(operations([s.at for s in split_posts(chaos, t)])) >= 2 for t in topics)

        async def idle() -> bool:  # between two attempts nothing is held in flight
            chaos.assert_alive()
            return not await chaos.in_flight()

        await wait_until(retried, within=STORM_SECONDS)
        await wait_until(idle, within=STORM_SECONDS)
    for topic in topics:
        assert not await chaos.cooldown_written(topic), f"{topic}: cooldown burned by a failure"
        assert chaos.active(topic) == 1
    chaos.http.heal()
    await chaos.put_load(0, 27_000.0, topics[0])

    async def recovered() -> bool:  # split, and the cooldown stamped after the broker's 2xx
        chaos.assert_alive()
        return all([chaos.active(t) == 3 and await chaos.cooldown_written(t) for t in topics])

    await wait_until(recovered, within=SCHEDULE.cap + 10)
    for topic in topics:
        assert chaos.splits_applied(topic) == 1


def split_posts(chaos: Chaos, topic: TopicName) -> list[Seen]:
    return chaos.http.requests(topic_path(topic) + "/split/", method="POST")


async def test_503_and_500_storms_back_off_bounded_jittered_and_recover(chaos: Chaos) -> None:
    topics = [TopicName("acme", "storm", f"{kind}-{i}") for kind in ("503", "500") for i in (1, 2)]
    for topic in topics:
        chaos.http.fail(topic_path(topic) + "/split/", int(topic.topic[:3]))
    await storm_then_heal(chaos, topics)
    gaps: dict[str, list[float]] = {}
    for topic in topics:
        failed = [s for s in split_posts(chaos, topic) if s.injected]
        ops = operations([s.at for s in failed], per_op=MAX_RETRIES + 1)
        # The runs must be operations (an operation of one attempt, or three, would shift
        # every later run so that one spans a topic backoff).
        assert spanning_backoff(ops, SCHEDULE) == [], (topic.topic, ops)
        gaps[topic.topic] = check_schedule(topic.topic, ops)
    for kind in ("503", "500"):
        first, second = gaps[f"{kind}-1"], gaps[f"{kind}-2"]
        assert any(abs(a - b) > 0.02 for a, b in zip(first, second, strict=False)), (
            f"{kind}: two topics failing together retry in lockstep: {first} {second}"
        )
    every = [g for topic_gaps in gaps.values() for g in topic_gaps[1:]]
    assert max(every) - min(every) > 0.05, f"no jitter: {every}"


async def test_409_and_412_answers_back_off_and_recover(chaos: Chaos) -> None:
    topics = [TopicName("acme", "refused", kind) for kind in ("409", "412")]
    for topic in topics:
        chaos.http.fail(topic_path(topic) + "/split/", int(topic.topic))
    await storm_then_heal(chaos, topics)
    for topic in topics:
        failed = [s for s in split_posts(chaos, topic) if s.injected]
        ops = operations([s.at for s in failed])
        assert all(len(op) == 1 for op in ops), f"{topic}: a 4xx was retried by the client"
        check_schedule(topic.topic, ops)


async def test_a_socket_that_never_answers_releases_the_guard_and_recovers(
    chaos: Chaos,
) -> None:
    topic = TopicName("acme", "hung", "orders")
    chaos.http.hang(topic_path(topic) + "/split/")
    await storm_then_heal(chaos, [topic])
    assert chaos.http.holding == 0, "a hung request outlived the client's timeout"
    # Each attempt waits out the client's timeout before it fails, and the schedule
    # runs from there: from when the client gave up (its connection closed), which
    # on a loaded host comes later than arrival + timeout (taking back exactly the
    # timeout once made a retry look 0.63 s early, in a CI run).
    arrivals = [s.at for s in split_posts(chaos, topic) if s.injected]
    released = chaos.http.released
    assert all(at in released for at in arrivals), "a hung request was never released"
    ops = operations(arrivals, per_op=MAX_RETRIES + 1)  # a timeout is retried once
    # The runs must be operations: the client's own retry follows a released attempt
    # within BROKER's short wait, never within the topic backoff's shortest.
    least = SCHEDULE.ceiling(0) / 2
    assert all(b - released[a] < least for op in ops for a, b in itertools.pairwise(op)), ops
    # Each operation as (first arrival, ..., when its last attempt was given up).
    check_schedule("no answer", [[*op[:-1], released[op[-1]]] for op in ops], at_least=3)
