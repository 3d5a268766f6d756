"""controllerd against Pulsar 5 as it really behaves (issue #11): two ``controllerd run``
replicas with ``profile = "pulsar"`` drive the Pulsar behaviour model
(tests/support/pulsar.py) over real HTTP, with Pulsar's keys in real etcd and
Pulsar's own sealed-segment GC pruning, in any order, throughout.

Every test ends by checking the model's record of operations: no segment split or
merged twice, no answer 500 (a split of a segment that is no longer active is
Pulsar's 500), and every topic still managed.
"""

from __future__ import annotations

import collections
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from controllerd.adapters.store import Store
from controllerd.core.model import TopicName
from tests.support.daemon import DEFAULT_PREFIX, Replica, replicas, wait_until
from tests.support.etcd import EtcdServer
from tests.support.pulsar import PulsarModel

SUPERUSER, TENANT_ADMIN = "pulsar-superuser", "acme-admin"
ROOT = "keys at the etcd root, default config"
T1 = TopicName("acme", "ns", "orders")
T2 = TopicName("acme", "ns", "payments")
POLICY = """
[autoscale]
interval_seconds = 1
consumer_settle_seconds = 0.2
[policy]
split_cooldown_seconds = 3
merge_cooldown_seconds = 1
merge_window_seconds = 2
[policy.split_thresholds]
msg_rate_in = 1000
[policy.merge_thresholds]
msg_rate_in = 100
"""


@dataclass
class PulsarCluster:
    model: PulsarModel
    replicas: list[Replica]

    async def leader(self) -> Replica:
        async def one() -> bool:
            return sum([await r.is_leader() for r in self.replicas if r.alive()]) == 1

        await wait_until(one, within=20)
        for replica in self.replicas:
            if await replica.is_leader():
                return replica
        raise AssertionError("no leader")

    def ops(self, kind: str, source: str = "rest") -> list[tuple[TopicName, tuple[int, ...]]]:
        return [
            (o.topic, o.segments)
            for o in self.model.operations
            if o.kind == kind and o.source == source
        ]

    def assert_no_double_operations(self) -> None:
        """Every segment is sealed by at most one operation, and Pulsar never said 500."""
        sealed = collections.Counter(
            (topic, sid)
            for kind in ("split", "merge")
            for topic, segments in self.ops(kind) + self.ops(kind, "manual")
            for sid in segments
        )
        assert [k for k, n in sealed.items() if n > 1] == []
        errors = [r for r in self.model.requests if (r.status or 0) >= 500]
        assert errors == [], [(r.method, r.path, r.status) for r in errors]


@pytest.fixture
async def pulsar(
    store: Store,
    etcd_server: EtcdServer,
    etcd_prefix: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> AsyncIterator[PulsarCluster]:
    param = getattr(request, "param", SUPERUSER)
    token = SUPERUSER if param == ROOT else param
    model_prefix = "" if param == ROOT else f"{etcd_prefix}root"
    model = PulsarModel(
        store,
        prefix=model_prefix,
        superuser_tokens=[SUPERUSER],
        tenant_admin_tokens={TENANT_ADMIN: ["acme"]},
        gc_interval_seconds=0.5,  # Pulsar's own GC, retention 0: it never stops
    )
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n", encoding="utf-8")
    async with (
        model.serve() as url,
        replicas(
            tmp_path / "replicas",
            2,
            etcd=etcd_server.endpoint,
            prefix=etcd_prefix,
            broker_url=url,
            profile="pulsar",
            metadata_prefix=DEFAULT_PREFIX if param == ROOT else model_prefix,
            token_file=token_file,
            extra=POLICY,
        ) as running,
    ):
        yield PulsarCluster(model, running)
    await model.aclose()


async def _report_all(model: PulsarModel, topic: TopicName, *, msg_rate_in: float) -> None:
    layout = await model.layout(topic)
    assert layout is not None
    for seg in layout.active_segments():
        await model.report_load(topic, seg.segment_id, msg_rate_in=msg_rate_in)


async def _active(model: PulsarModel, topic: TopicName) -> int:
    layout = await model.layout(topic)
    return len(layout.active_segments()) if layout is not None else 0


async def test_consumers_and_traffic_split_cold_pairs_merge_beside_pulsars_gc(
    pulsar: PulsarCluster,
) -> None:
    model = pulsar.model
    await pulsar.leader()
    await model.create_topic(T1)
    await model.create_subscription(T1, "s")
    for i in range(4):  # a consumer burst: one decision, carried out as midpoint splits
        await model.register_consumer(T1, "s", f"c{i}")

    async def four() -> bool:
        # The model commits a split's layout before it records the operation: wait for both.
        return await _active(model, T1) == 4 and len(pulsar.ops("split")) >= 3

    await wait_until(four, within=20)
    assert len(pulsar.ops("split")) == 3  # 4 segments from 1 by binary splits only
    model.drain(T1)  # cursors at the end: Pulsar's GC prunes the sealed parents

    async def pruned() -> bool:
        layout = await model.layout(T1)
        return layout is not None and all(s.active for s in layout.segments.values())

    await wait_until(pruned, within=10)

    # a traffic burst on one of them
    layout = await model.layout(T1)
    assert layout is not None
    hot = layout.active_segments()[0].segment_id
    await model.report_load(T1, hot, msg_rate_in=5_000.0)

    async def five() -> bool:
        return await _active(model, T1) >= 5

    await wait_until(five, within=20)

    # every consumer leaves, traffic stops: cold pairs merge (our window, not Pulsar's)
    for i in range(4):
        await model.unregister_consumer(T1, "s", f"c{i}")

    async def merged() -> bool:
        # Pulsar's reporter writes a record for each segment it serves, new ones too.
        await _report_all(model, T1, msg_rate_in=1.0)
        return len(pulsar.ops("merge")) >= 2

    await wait_until(merged, within=40)
    pulsar.assert_no_double_operations()
    assert await _active(model, T1) >= 1


async def test_a_lost_split_answer_is_never_split_twice(pulsar: PulsarCluster) -> None:
    model = pulsar.model
    await pulsar.leader()
    await model.create_topic(T1)
    model.lose_next = 1  # Pulsar splits, the answer never arrives
    await model.report_load(T1, 0, msg_rate_in=1_500.0)

    async def two() -> bool:
        return await _active(model, T1) == 2

    await wait_until(two, within=20)
    await anyio.sleep(3)  # retries, if any, would come now (backoff is below a second)
    assert pulsar.ops("split") == [(T1, (0,))]
    # the reconciled split counted as done: the cooldown was stamped
    leader = await pulsar.leader()
    assert await leader.metric("controllerd_operations_total", op="split", outcome="ok") == 1
    pulsar.assert_no_double_operations()


async def test_a_manual_split_starts_the_cooldown(pulsar: PulsarCluster) -> None:
    model = pulsar.model
    leader = await pulsar.leader()
    await model.create_topic(T1)
    await model.split(T1, 0, source="manual")  # an operator with pulsar-admin
    layout = await model.layout(T1)
    assert layout is not None
    for seg in layout.active_segments():
        await model.report_load(T1, seg.segment_id, msg_rate_in=3_000.0)

    async def held_back() -> bool:
        value = await leader.metric(
            "controllerd_decisions_total", action="none", reason="split-cooldown"
        )
        return (value or 0) >= 1

    await wait_until(held_back, within=15)
    assert pulsar.ops("split") == []
    # ... and exactly one follow-up when the 3 s cooldown ends: both halves split

    async def both() -> bool:
        return len(pulsar.ops("split")) == 2

    await wait_until(both, within=20)
    pulsar.assert_no_double_operations()


async def test_a_topic_pulsar_scales_itself_is_left_alone(pulsar: PulsarCluster) -> None:
    model = pulsar.model
    leader = await pulsar.leader()
    await model.create_topic(T1)
    await model.create_topic(T2)
    await model.set_auto_scale_policy(T2, {"enabled": True})
    for topic in (T1, T2):
        await model.report_load(topic, 0, msg_rate_in=5_000.0)

    async def t1_split() -> bool:
        return any(t == T1 for t, _ in pulsar.ops("split"))

    await wait_until(t1_split, within=20)

    async def left_alone() -> bool:
        value = await leader.metric(
            "controllerd_decisions_total", action="none", reason="pulsar-autoscaler"
        )
        return (value or 0) >= 1

    await wait_until(left_alone, within=15)
    assert all(t != T2 for t, _ in pulsar.ops("split"))


async def test_a_deleted_topic_leaves_the_others_managed(pulsar: PulsarCluster) -> None:
    model = pulsar.model
    leader = await pulsar.leader()
    await model.create_topic(T1)
    await model.create_topic(T2)

    async def two_topics() -> bool:
        return (await leader.metric("controllerd_topics")) == 2

    await wait_until(two_topics, within=10)
    await model.delete_topic(T1)

    async def one_topic() -> bool:
        return (await leader.metric("controllerd_topics")) == 1

    await wait_until(one_topic, within=10)
    await model.report_load(T2, 0, msg_rate_in=5_000.0)

    async def t2_split() -> bool:
        return await _active(model, T2) >= 2

    await wait_until(t2_split, within=20)
    assert all(r.alive() for r in pulsar.replicas)
    pulsar.assert_no_double_operations()


@pytest.mark.parametrize("pulsar", [TENANT_ADMIN], indirect=True)
async def test_a_tenant_admin_token_is_an_operator_error(pulsar: PulsarCluster) -> None:
    model = pulsar.model
    leader = await pulsar.leader()
    await model.create_topic(T1)
    await model.report_load(T1, 0, msg_rate_in=5_000.0)

    async def refused() -> bool:
        response = await leader.get("/readyz")
        return response is not None and response.status_code == 503

    await wait_until(refused, within=20)
    response = await leader.get("/readyz")
    assert response is not None and "refuses our token" in response.json()["reason"]
    assert (await leader.metric("controllerd_operator_errors_total", kind="broker-auth") or 0) >= 1
    assert await _active(model, T1) == 1
    # A reload that leaves the token as it was does not make the leader ready again.
    reloads = len([e for e in leader.log_events() if e.get("event") == "config.reloaded"])
    leader.signal(signal.SIGHUP)

    async def reloaded() -> bool:
        events = leader.log_events()
        return len([e for e in events if e.get("event") == "config.reloaded"]) > reloads

    await wait_until(reloaded, within=10)
    response = await leader.get("/readyz")
    assert response is not None and response.status_code == 503
    assert "refuses our token" in response.json()["reason"]
    assert all(r.alive() for r in pulsar.replicas)


@pytest.mark.parametrize("pulsar", [ROOT], indirect=True)
async def test_the_default_config_finds_pulsars_topics_at_the_etcd_root(
    pulsar: PulsarCluster, etcd_prefix: str
) -> None:
    """Pulsar's etcd store writes /topics/... at the root; the default prefix is the root.
    A replica whose prefix holds no topic says so loudly at start."""
    leader = await pulsar.leader()
    empty = [e for e in leader.log_events() if e.get("event") == "metadata.prefix_empty"]
    assert empty and empty[0]["prefix"] == "/topics/"
    # a tenant of this test only: other tests' keys may sit at the root too
    topic = TopicName("root" + etcd_prefix.strip("/").split("-")[0].replace("/", ""), "ns", "x")
    await pulsar.model.create_topic(topic)
    await pulsar.model.report_load(topic, 0, msg_rate_in=5_000.0)

    async def split() -> bool:
        return await _active(pulsar.model, topic) >= 2

    await wait_until(split, within=20)
    # Checked before the clean-up: a split of a child may be in flight, and Pulsar
    # answers 500 to an operation on a topic deleted under it.
    pulsar.assert_no_double_operations()
    await pulsar.model.delete_topic(topic)


async def test_our_knobs_live_under_our_own_key(pulsar: PulsarCluster, store: Store) -> None:
    """Pulsar erases unknown autoScalePolicy fields on its next write; ours are read
    from <controller root>/policies/<tenant>/<ns>/<topic>."""
    model = pulsar.model
    leader = await pulsar.leader()
    root = pulsar.replicas[0].config.read_text().split('controller_prefix = "')[1].split('"')[0]
    await store.put(f"{root}/default/policies/acme/ns/orders", b'{"maxSegments": 2}')
    await model.create_topic(T1)
    await model.report_load(T1, 0, msg_rate_in=8_000.0)  # 8x: an 8-way split, capped at 2

    async def capped() -> bool:
        value = await leader.metric(
            "controllerd_decisions_total", action="none", reason="max-segments"
        )
        return (value or 0) >= 1 or await _active(model, T1) > 2

    await _report_until(model, T1, capped, msg_rate_in=8_000.0)
    assert await _active(model, T1) == 2


async def test_enabled_false_in_pulsars_namespace_policy_stops_controllerd(
    pulsar: PulsarCluster,
) -> None:
    model = pulsar.model
    leader = await pulsar.leader()
    await model.set_namespace_auto_scale_policy("acme", "ns", {"enabled": False})
    await model.create_topic(T1)
    await model.report_load(T1, 0, msg_rate_in=5_000.0)

    async def disabled() -> bool:
        value = await leader.metric("controllerd_decisions_total", action="none", reason="disabled")
        return (value or 0) >= 1

    await wait_until(disabled, within=15)
    assert pulsar.ops("split") == []
    await model.set_namespace_auto_scale_policy("acme", "ns", None)  # and back on

    async def split() -> bool:
        # >= 2: a 5-way split is four midpoint splits on Pulsar, so exactly 2 active
        # segments is a moment a slow poll can miss.
        return await _active(model, T1) >= 2

    await wait_until(split, within=20)


async def test_writes_follow_a_307_to_the_controller_leader_broker(
    pulsar: PulsarCluster, store: Store
) -> None:
    """A broker that is not the topic's controller leader redirects writes (REST:864-904)."""
    first = pulsar.model
    leader_broker = PulsarModel(store, prefix=first.keys.prefix, superuser_tokens=[SUPERUSER])
    async with leader_broker.serve() as url:
        first.redirect_to = url
        await pulsar.leader()
        await first.create_topic(T1)
        await first.report_load(T1, 0, msg_rate_in=1_500.0)

        async def split_by_the_leader_broker() -> bool:
            return any(o.kind == "split" for o in leader_broker.operations)

        await wait_until(split_by_the_leader_broker, within=20)
        assert any(r.status == 307 for r in first.requests)
        assert await _active(first, T1) == 2
    await leader_broker.aclose()


async def test_a_name_pulsar_cannot_address_is_reported_once(pulsar: PulsarCluster) -> None:
    """Pulsar decodes the topic path only on create: 'orders eu' can never be split
    through REST. It is said once and never retried; the other topics go on."""
    model = pulsar.model
    leader = await pulsar.leader()
    odd = TopicName("acme", "ns", "orders eu")
    colon = TopicName("acme", "ns", "orders:eu")  # stored as orders%3Aeu, split as orders:eu
    for topic in (odd, colon, T2):
        await model.create_topic(topic)
        await model.report_load(topic, 0, msg_rate_in=5_000.0)

    async def t2_split() -> bool:
        return await _active(model, T2) >= 2 and await _active(model, colon) >= 2

    await wait_until(t2_split, within=20)
    await anyio.sleep(2.5)  # a tick or two: nothing more is tried
    said = [e for e in leader.log_events() if e.get("event") == "topic.unaddressable"]
    assert len(said) == 1 and said[0]["topic"] == "acme/ns/orders eu"
    assert not any("orders eu" in r.path or "orders%20eu" in r.path for r in model.requests)


async def test_a_name_holding_escapes_is_split_through_its_verbatim_path(
    pulsar: PulsarCluster,
) -> None:
    """A local name holding ``%20`` (created as ``orders%2520eu``, decoded once; or by
    an earlier broker that decoded nothing) is reached by sending it back verbatim:
    Pulsar decodes no path but create's. controllerd refused it as unaddressable."""
    model = pulsar.model
    leader = await pulsar.leader()
    escaped = TopicName("acme", "ns", "orders%20eu")  # key component orders%2520eu
    await model.create_topic(escaped)
    await model.report_load(escaped, 0, msg_rate_in=5_000.0)

    async def split() -> bool:
        return await _active(model, escaped) >= 2

    await wait_until(split, within=20)
    assert not [e for e in leader.log_events() if e.get("event") == "topic.unaddressable"]


async def _report_until(
    model: PulsarModel,
    topic: TopicName,
    done: Callable[[], Awaitable[bool]],
    *,
    msg_rate_in: float,
) -> None:
    """Keep reporting every active segment's load (as Pulsar's reporter does) until done."""

    async def check() -> bool:
        await _report_all(model, topic, msg_rate_in=msg_rate_in)
        return await done()

    await wait_until(check, within=20)
