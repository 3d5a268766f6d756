"""The Pulsar 5 behaviour model (tests/support/pulsar.py) against real etcd over real HTTP.

The model is the contract controllerd's Pulsar profile is tested against, so each
behaviour it claims from the Pulsar sources is pinned here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from controllerd.adapters.store import Store
from controllerd.core.layout import check, violations
from controllerd.core.model import Merge, NoAction, Split, TopicName, layout_from_json
from controllerd.core.pulsar import (
    NamespacePolicies,
    decode_topic_name,
    parse_namespace_policies,
    rest_path_topic,
)
from controllerd.core.view import Keys, MetadataView, Rejected
from tests.support.pulsar import PulsarModel, java_url_decode, java_url_encode

SU, TA = "su-token", "ta-token"
TOPIC = TopicName("acme", "ns", "orders")
BASE = "/admin/v2/scalable/acme/ns"


class Clock:
    """The model's wall clock in ms, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_700_000_000_000

    def __call__(self) -> int:
        return self.now


class Ticker:
    """An injected ``sleep`` for the model's timers: each :meth:`tick` runs one tick."""

    def __init__(self) -> None:
        self._go: asyncio.Queue[None] = asyncio.Queue()
        self._parked = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self._parked.set()
        await self._go.get()
        self._parked.clear()

    async def tick(self) -> None:
        """Let the timer fire once and return when its tick is done (it parks again)."""
        with anyio.fail_after(10):
            await self._parked.wait()
            self._parked.clear()
            self._go.put_nowait(None)
            await self._parked.wait()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def model(store: Store, etcd_prefix: str, clock: Clock) -> AsyncIterator[PulsarModel]:
    pulsar = PulsarModel(
        store,
        prefix=etcd_prefix,
        superuser_tokens=[SU],
        tenant_admin_tokens={TA: ["acme"]},
        clock_ms=clock,
    )
    yield pulsar
    await pulsar.aclose()


@pytest.fixture
async def url(model: PulsarModel) -> AsyncIterator[str]:
    async with model.serve() as base:
        yield base


def client(url: str, token: str | None = SU, timeout: float = 10.0) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout)


async def stored(store: Store, model: PulsarModel, topic: TopicName = TOPIC) -> dict[str, Any]:
    kv = await store.get(model.keys.topic(topic))
    assert kv is not None
    raw: dict[str, Any] = json.loads(kv.value)
    return raw


# --- keys and names ------------------------------------------------------------------


async def test_keys_live_at_the_etcd_root_by_default(store: Store, etcd_prefix: str) -> None:
    tenant = "root-" + etcd_prefix.strip("/").replace("/", "-")
    topic = TopicName(tenant, "ns", "orders")
    root = PulsarModel(store)
    try:
        await root.create_topic(topic)
        await root.set_namespace_retention(tenant, "ns", 5)
        assert await store.get(f"/topics/{tenant}/ns/orders") is not None
        assert await store.get(f"/admin/policies/{tenant}/ns") is not None
        controller = await store.get(f"/topics/{tenant}/ns/orders/controller")
        assert controller is not None and controller.lease != 0  # ephemeral (ETCD:211-212)
        assert json.loads(controller.value) == "broker-1:8080"
        await root.aclose()  # the broker stops: its lease and the lock go
        assert await store.get(f"/topics/{tenant}/ns/orders/controller") is None
        assert await store.get(f"/topics/{tenant}/ns/orders") is not None
    finally:
        await root.aclose()
        await store.delete_prefix(f"/topics/{tenant}/")
        await store.delete_prefix(f"/admin/policies/{tenant}/")


def test_model_codec_is_javas() -> None:
    assert java_url_encode("orders:eu 1~*") == "orders%3Aeu+1%7E*"
    assert java_url_decode("orders%3Aeu+1%7E*") == "orders:eu 1~*"
    assert decode_topic_name(java_url_encode("naïve/é")) == "naïve/é"
    with pytest.raises(ValueError):
        java_url_decode("50%")


async def test_create_decodes_the_name_but_other_endpoints_do_not(
    model: PulsarModel, url: str, store: Store
) -> None:
    async with client(url) as http:
        assert (await http.put(f"{BASE}/orders%3Aeu+1")).status_code == 204
        assert (await http.put(f"{BASE}/{rest_path_topic('a:b')}")).status_code == 204
        listing = (await http.get(BASE)).json()
        assert sorted(listing) == ["topic://acme/ns/a:b", "topic://acme/ns/orders:eu 1"]
        # Stored once-encoded (RES:483-484), never twice.
        assert await store.get(model.keys.namespace_prefix("acme", "ns") + "orders%3Aeu+1")
        assert await store.get(model.keys.namespace_prefix("acme", "ns") + "a%3Ab")
        # GET does not decode (REST getScalableTopicMetadata): the escaped form names
        # another topic; the unescaped one works.
        assert (await http.get(f"{BASE}/orders%3Aeu+1")).status_code == 404
        assert (await http.get(f"{BASE}/a:b")).status_code == 200
        assert model.requests[-1].raw_path == f"{BASE}/a:b"


# --- admin REST ----------------------------------------------------------------------


async def test_create_get_list_delete(model: PulsarModel, url: str, store: Store) -> None:
    async with client(url) as http:
        resp = await http.put(f"{BASE}/orders", params={"numInitialSegments": 3})
        assert resp.status_code == 204
        raw = await stored(store, model)
        assert raw["epoch"] == 0 and raw["nextSegmentId"] == 3 and raw["properties"] == {}
        assert "autoScalePolicy" not in raw  # null is left out (OMF:133)
        segments = raw["segments"]
        assert [s["hashRange"] for s in segments.values()] == [
            {"start": 0, "end": 21844},
            {"start": 21845, "end": 43689},
            {"start": 43690, "end": 0xFFFF},
        ]
        assert segments["0"]["sealedAtMs"] == -1 and segments["0"]["entryBucketSplits"] == []
        check(layout_from_json(raw))
        assert (await http.get(f"{BASE}/orders")).json() == raw
        assert (await http.put(f"{BASE}/orders")).status_code == 409
        assert (await http.put(f"{BASE}/x", params={"numInitialSegments": 0})).status_code == 412
        assert (
            await http.put(f"{BASE}/x", params={"numInitialSegments": "two"})
        ).status_code == 404
        assert (await http.get(BASE)).json() == ["topic://acme/ns/orders"]
        await model.create_topic(TopicName("acme", "ns", "orders2"))
        await model.create_subscription(TOPIC, "s")
        await model.register_consumer(TOPIC, "s", "c1")
        await model.report_load(TOPIC, 0, msg_rate_in=5.0)
        assert (await http.delete(f"{BASE}/orders")).status_code == 204
        assert (await http.delete(f"{BASE}/orders")).status_code == 404
        assert (await http.get(f"{BASE}/orders")).status_code == 404
    kvs, _ = await store.get_prefix(model.keys.namespace_prefix("acme", "ns"))
    other = model.keys.topic(TopicName("acme", "ns", "orders2"))
    assert [kv.key for kv in kvs] == [other, f"{other}/controller"]  # a name prefix survives
    assert model.segment_topic(TOPIC, 0) is None


async def test_split_is_midpoint_only_and_a_retry_is_a_500(
    model: PulsarModel, url: str, store: Store
) -> None:
    await model.create_topic(TOPIC)
    async with client(url) as http:
        resp = await http.post(f"{BASE}/orders/split/0", params={"boundaries": "100,200,300"})
        assert resp.status_code == 204  # no such parameter in REST:751-762: ignored
        layout = check(layout_from_json(await stored(store, model)))
        assert [(s.hash_range.start, s.hash_range.end) for s in layout.active_segments()] == [
            (0, 0x7FFF),
            (0x8000, 0xFFFF),
        ]
        assert layout.segments[0].child_ids == (1, 2) and layout.epoch == 1
        again = await http.post(f"{BASE}/orders/split/0")  # e.g. our retry after a lost answer
        assert again.status_code == 500
        assert "Cannot split non-active segment: 0" in again.json()["reason"]
        missing = await http.post(f"{BASE}/orders/split/99")
        assert missing.status_code == 500 and "Segment not found: 99" in missing.json()["reason"]
        no_topic = await http.post(f"{BASE}/nope/split/0")
        assert no_topic.status_code == 500
        assert (await http.post(f"{BASE}/orders/split/zero")).status_code == 404
    assert [op.kind for op in model.operations] == ["create", "split"]


async def test_merge_keeps_request_order_and_errors_are_500s(
    model: PulsarModel, url: str, store: Store
) -> None:
    await model.create_topic(TOPIC, 3)
    async with client(url) as http:
        assert (await http.post(f"{BASE}/orders/merge/1/0")).status_code == 204
        raw = await stored(store, model)
        child = raw["segments"]["3"]
        assert child["parentIds"] == [1, 0] and child["hashRange"] == {"start": 0, "end": 43689}
        # PIP-486: the merged child recovers both parents' buckets (4 // 3 = 1 each).
        assert child["entryBucketSplits"] == [32768]
        check(layout_from_json(raw))
        again = await http.post(f"{BASE}/orders/merge/1/0")
        assert again.status_code == 500 and "Both segments must be active" in again.text
        apart = await http.post(f"{BASE}/orders/merge/3/3")
        assert apart.status_code == 500 and "not adjacent" in apart.json()["reason"]


async def test_superuser_is_needed_for_split_merge_and_segments(
    model: PulsarModel, url: str
) -> None:
    await model.create_topic(TOPIC, 2)
    await model.create_subscription(TOPIC, "s")
    desc = "/admin/v2/segments/acme/ns/orders/0000-7fff-0"
    async with client(url, None) as anonymous:
        assert (await anonymous.get(BASE)).status_code == 401
        assert (await anonymous.post(f"{BASE}/orders/split/0")).status_code == 401
    async with client(url, "forged") as forged:
        assert (await forged.get(BASE)).status_code == 401
    async with client(url, TA) as admin:
        assert (await admin.get(BASE)).status_code == 200
        assert (await admin.get(f"{BASE}/orders")).status_code == 200
        assert (await admin.put(f"{BASE}/orders/subscriptions/t")).status_code == 204
        for resp in (
            await admin.post(f"{BASE}/orders/split/0"),
            await admin.post(f"{BASE}/orders/merge/0/1"),
            await admin.get(f"{desc}/subscription/s/backlog"),
            await admin.delete(desc),
        ):
            # WEB validateSuperUserAccessAsync: RestException(Status.UNAUTHORIZED, ...)
            assert resp.status_code == 401
            assert resp.json()["reason"] == "This operation requires super-user access"
        other = await admin.get("/admin/v2/scalable/globex/ns")
        assert other.status_code == 403 and "Unauthorized" in other.json()["reason"]
    async with client(url) as su:
        assert (await su.get(f"{desc}/subscription/s/backlog")).status_code == 200
    assert [op.kind for op in model.operations] == ["create"]


async def test_subscriptions_get_cursors_on_active_segments_only(
    model: PulsarModel, url: str, store: Store
) -> None:
    await model.create_topic(TOPIC)
    await model.split(TOPIC, 0)
    seg = "/admin/v2/segments/acme/ns/orders"
    async with client(url) as http:
        assert (await http.put(f"{BASE}/orders/subscriptions/late")).status_code == 204
        sealed = await http.get(f"{seg}/0000-ffff-0/subscription/late/backlog")
        assert sealed.status_code == 404
        assert sealed.json()["reason"] == "Subscription not found on segment: late"
        active = await http.get(f"{seg}/0000-7fff-1/subscription/late/backlog")
        assert active.status_code == 200 and active.text == "0"
        # Idempotent, and the type of an existing subscription does not change.
        assert (await http.put(f"{BASE}/orders/subscriptions/late?type=QUEUE")).status_code == 204
        assert (await http.put(f"{BASE}/orders/subscriptions/q?type=CHECKPOINT")).status_code == 404
        sub = await store.get(model.keys.subscription(TOPIC, "late"))
        assert sub is not None and json.loads(sub.value) == {"type": "STREAM"}
        await model.register_consumer(TOPIC, "late", "c-1")
        reg = await store.get(model.keys.consumer(TOPIC, "late", "c-1"))
        assert reg is not None and reg.value == b"{}" and reg.lease == 0  # durable (CREG:38)
        assert (await http.delete(f"{BASE}/orders/subscriptions/late")).status_code == 204
        assert (await http.delete(f"{BASE}/orders/subscriptions/late")).status_code == 204
        assert await store.get(model.keys.consumer(TOPIC, "late", "c-1")) is None
        assert await model.subscriptions(TOPIC) == {}
        gone = await http.put(f"{BASE}/nope/subscriptions/s")
        assert gone.status_code == 500  # the controller of a missing topic fails to start


async def test_backlog_is_a_bare_number_or_404_and_segment_delete_is_always_204(
    model: PulsarModel, url: str, store: Store
) -> None:
    await model.create_topic(TOPIC)
    await model.create_subscription(TOPIC, "s")
    model.publish(TOPIC, 0, 5)
    path = "/admin/v2/segments/acme/ns/orders/0000-ffff-0"
    async with client(url) as http:
        resp = await http.get(f"{path}/subscription/s/backlog")
        assert resp.status_code == 200 and resp.json() == 5 and resp.text == "5"
        model.set_loaded(TOPIC, 0, False)
        unloaded = await http.get(f"{path}/subscription/s/backlog")
        assert unloaded.status_code == 404
        assert unloaded.json()["reason"].startswith("Segment topic not loaded")
        model.set_loaded(TOPIC, 0, True)
        before = await stored(store, model)
        assert (await http.delete(path)).status_code == 204  # backlog 5: no check (SEG)
        assert (await http.delete(path)).status_code == 204  # missing: still 204
        assert model.segment_topic(TOPIC, 0) is None
        assert await stored(store, model) == before  # the layout is the controller's job
        assert (await http.get(f"{path}/subscription/s/backlog")).status_code == 404


# --- Pulsar's own GC ----------------------------------------------------------------


async def test_gc_prunes_in_any_order_and_the_layout_stays_valid(
    model: PulsarModel, store: Store
) -> None:
    """pulsar-compat.md 2.7 reproduced: 0 -> 1, 2; 1 -> 3, 4; Pulsar prunes 1, 0 stays."""
    await model.create_topic(TOPIC)
    await model.create_subscription(TOPIC, "early")
    model.publish(TOPIC, 0, 10)
    await model.split(TOPIC, 0)
    await model.create_subscription(TOPIC, "late")  # no cursor on sealed 0 (CTL:943-947)
    await model.split(TOPIC, 1)
    await model.report_load(TOPIC, 1, msg_rate_in=3.0)
    model.drain(TOPIC)
    assert await model.gc_once() == {TOPIC: [1]}
    raw = await stored(store, model)
    layout = layout_from_json(raw)
    assert violations(layout) == [] and check(layout) is layout
    assert sorted(layout.segments) == [0, 2, 3, 4]
    assert layout.segments[0].child_ids == (2,)  # sealed 0 only half covered now
    assert layout.segments[3].parent_ids == () and layout.segments[4].parent_ids == ()
    assert layout.epoch == 3
    assert await store.get(model.keys.load(TOPIC, 1)) is None
    assert model.segment_topic(TOPIC, 1) is None and model.segment_topic(TOPIC, 0) is not None
    assert model.operations[-1].kind == "prune" and model.operations[-1].source == "gc"
    assert await model.gc_once() == {}  # 0 never drains for "late": it has no cursor there


async def test_gc_retention_comes_from_topic_then_namespace_then_broker(
    model: PulsarModel, clock: Clock
) -> None:
    await model.create_topic(TOPIC)
    await model.split(TOPIC, 0)
    await model.set_namespace_retention("acme", "ns", 10)
    clock.now += 9 * 60_000
    assert await model.gc_once(TOPIC) == {}
    model.set_topic_retention(TOPIC, -1)  # topic policy wins: keep forever
    clock.now += 60 * 60_000
    assert await model.gc_once(TOPIC) == {}
    model.set_topic_retention(TOPIC, None)
    await model.set_namespace_retention("acme", "ns", None)
    model.default_retention_minutes = -1
    assert await model.gc_once(TOPIC) == {}
    model.default_retention_minutes = 0  # the broker default: no subscription, prunable now
    assert await model.gc_once(TOPIC) == {TOPIC: [0]}


async def test_gc_keeps_migrated_legacy_parents_while_a_subscription_exists(
    model: PulsarModel, store: Store
) -> None:
    migrated = await model.migrate_topic(TOPIC, 2)
    layout = layout_from_json(migrated)
    assert violations(layout) == []
    assert migrated["segments"]["0"]["legacyTopicName"] == "persistent://acme/ns/orders-partition-0"
    await model.create_subscription(TOPIC, "s")
    assert await model.gc_once() == {}  # legacy backlogs are 404: never drained (compat 6.4)
    await model.delete_subscription(TOPIC, "s")
    assert await model.gc_once() == {TOPIC: [0, 1]}
    assert violations(layout_from_json(await stored(store, model))) == []


async def test_gc_timer_runs_while_serving(store: Store, etcd_prefix: str, clock: Clock) -> None:
    ticker = Ticker()
    model = PulsarModel(
        store, prefix=etcd_prefix, clock_ms=clock, gc_interval_seconds=60, sleep=ticker
    )
    await model.create_topic(TOPIC)
    await model.split(TOPIC, 0)
    async with model.serve():
        await ticker.tick()
    assert [op.kind for op in model.operations] == ["create", "split", "prune"]
    assert sorted((await stored(store, model))["segments"]) == ["1", "2"]


# --- what Pulsar's writes do to the record ----------------------------------------------


async def test_every_pulsar_write_erases_fields_it_does_not_model(
    model: PulsarModel, url: str, store: Store
) -> None:
    await model.create_topic(TOPIC, 2)
    raw = await stored(store, model)
    raw["autoScalePolicy"] = {
        "enabled": False,
        "splitMsgRateInThreshold": 20000,
        "maxSplitFanout": 4,
        "loadTtlSeconds": 60,
        "minSplitWidth": 512,
        "mergeCombinedMaxRatio": 0.5,
    }
    raw["ours"] = {"x": 1}
    raw["segments"]["0"]["brokerHint"] = "b-1"
    await store.put(model.keys.topic(TOPIC), json.dumps(raw).encode())
    async with client(url) as http:
        assert (await http.post(f"{BASE}/orders/split/0")).status_code == 204
    after = await stored(store, model)
    assert after["autoScalePolicy"] == {"enabled": False, "splitMsgRateInThreshold": 20000.0}
    assert "ours" not in after and "brokerHint" not in after["segments"]["0"]
    await model.set_auto_scale_policy(TOPIC, None)
    assert "autoScalePolicy" not in await stored(store, model)


async def test_manual_operations_are_performed_and_stamp_pulsars_cooldown(
    model: PulsarModel, url: str, clock: Clock
) -> None:
    await model.create_topic(TOPIC, 2)
    assert model.cooldown_stamps(TOPIC) == (None, None)
    await model.split(TOPIC, 0)  # e.g. pulsar-admin scalable-topics split-segment
    split_at = clock.now
    clock.now += 1000
    async with client(url) as http:
        assert (await http.post(f"{BASE}/orders/merge/2/3")).status_code == 204
    assert model.cooldown_stamps(TOPIC) == (split_at, clock.now)
    assert [(op.kind, op.source) for op in model.operations] == [
        ("create", "manual"),
        ("split", "manual"),
        ("merge", "rest"),
    ]
    rebucketed = await model.rebucket(TOPIC, 1, 8)
    successor = rebucketed["segments"]["5"]
    assert successor["hashRange"] == {"start": 0x8000, "end": 0xFFFF}
    assert successor["entryBucketSplits"] == [8192 * i for i in range(1, 8)]
    assert violations(layout_from_json(rebucketed)) == []


# --- Pulsar's own auto-scaler ----------------------------------------------------------


async def test_pulsar_autoscaler_flag_follows_broker_namespace_topic(
    model: PulsarModel, url: str
) -> None:
    await model.create_topic(TOPIC)
    assert not await model.pulsar_autoscaler_active(TOPIC)
    async with client(url, TA) as admin:
        resp = await admin.post(f"{BASE}/orders/autoScalePolicy", json={"enabled": True})
        assert resp.status_code == 204
        assert await model.pulsar_autoscaler_active(TOPIC)
        bad = await admin.post(
            f"{BASE}/orders/autoScalePolicy", json={"minSegments": 9, "maxSegments": 2}
        )
        assert bad.status_code == 412
        assert (await admin.delete(f"{BASE}/orders/autoScalePolicy")).status_code == 204
        assert (await admin.get(f"{BASE}/orders/autoScalePolicy")).status_code == 204
    await model.set_namespace_auto_scale_policy("acme", "ns", {"enabled": True})
    assert await model.pulsar_autoscaler_active(TOPIC)
    await model.set_auto_scale_policy(TOPIC, {"enabled": False})
    assert not await model.pulsar_autoscaler_active(TOPIC)


async def test_pulsar_autoscaler_acts_only_when_switched_on(model: PulsarModel) -> None:
    await model.create_topic(TOPIC)
    assert await model.report_load(TOPIC, 0, msg_rate_in=20_000.0)
    off = await model.autoscale_once(TOPIC)
    assert isinstance(off, NoAction) and off.reason == "disabled"
    await model.set_auto_scale_policy(TOPIC, {"enabled": True, "maxSplitFanout": 8})
    decision = await model.autoscale_once(TOPIC)
    assert isinstance(decision, Split) and decision.segment_id == 0
    assert decision.boundaries == (0x8000,)  # PIP-483 parity: binary midpoint
    assert model.operations[-1].source == "autoscaler"
    layout = await model.layout(TOPIC)
    assert layout is not None and len(layout.active_segments()) == 2


async def test_pulsar_autoscalers_split_cooldown_holds_every_split_of_the_topic(
    model: PulsarModel, clock: Clock
) -> None:
    """EV483:98-103 (compat 4.2): inside the split cooldown PIP-483 splits no segment of
    the topic, not only the last split's children (controllerd's range_split_cooldown,
    which the model's evaluator must leave off)."""
    await model.create_topic(TOPIC, 2)
    await model.set_auto_scale_policy(TOPIC, {"enabled": True})
    clock.now += 3_600_000  # segment 1 is an hour old: no split made it
    assert await model.report_load(TOPIC, 0, msg_rate_in=20_000.0)
    assert isinstance(await model.autoscale_once(TOPIC), Split)
    assert await model.report_load(TOPIC, 1, msg_rate_in=20_000.0)
    held = await model.autoscale_once(TOPIC)
    assert isinstance(held, NoAction) and held.reason == "split-cooldown"


async def test_pulsar_autoscaler_follows_consumer_registrations(model: PulsarModel) -> None:
    await model.create_topic(TOPIC)
    await model.set_auto_scale_policy(TOPIC, {"enabled": True, "splitCooldownSeconds": 0})
    await model.create_subscription(TOPIC, "s")
    await model.register_consumer(TOPIC, "s", "c1")
    await model.register_consumer(TOPIC, "s", "c2")  # CTL:853 evaluates at once
    layout = await model.layout(TOPIC)
    assert layout is not None and len(layout.active_segments()) == 2
    for sid in (1, 2):  # cold, and etcd's modification time is 0 (ETCD:306): mergeable
        await model.report_load(TOPIC, sid, msg_rate_in=1.0)
    await model.unregister_consumer(TOPIC, "s", "c2")
    await model.set_auto_scale_policy(TOPIC, {"enabled": True, "mergeCooldownSeconds": 0})
    assert isinstance(await model.autoscale_once(TOPIC), Merge)


# --- load reports and namespace policies -----------------------------------------------


async def test_load_reports_follow_the_materiality_rule(
    model: PulsarModel, store: Store, etcd_prefix: str
) -> None:
    key = model.keys.load(TOPIC, 0)
    assert await model.report_load(TOPIC, 0, msg_rate_in=1000.0, bytes_rate_in=1e6)
    first = await store.get(key)
    assert first is not None
    assert json.loads(first.value) == {
        "msgRateIn": 1000.0,
        "bytesRateIn": 1e6,
        "msgRateOut": 0.0,
        "bytesRateOut": 0.0,
    }  # SLS: bytesRate* spelling, no timestamps
    assert not await model.report_load(TOPIC, 0, msg_rate_in=1200.0, bytes_rate_in=1e6)
    assert not await model.report_load(TOPIC, 0, msg_rate_in=1250.0, bytes_rate_in=1e6)
    same = await store.get(key)
    assert same is not None and same.mod_revision == first.mod_revision
    assert await model.report_load(TOPIC, 0, msg_rate_in=1300.0, bytes_rate_in=1e6)
    assert await model.report_load(TOPIC, 0, msg_rate_in=1300.0, bytes_rate_in=1e6, msg_rate_out=1)
    # A broker that takes the segment over seeds its baseline from the store (SLR:82-102).
    other = PulsarModel(store, prefix=etcd_prefix)
    assert not await other.report_load(
        TOPIC, 0, msg_rate_in=1300.0, bytes_rate_in=1e6, msg_rate_out=1
    )


async def test_namespace_policies_are_where_pulsar_keeps_them(
    model: PulsarModel, store: Store, etcd_prefix: str
) -> None:
    await model.set_namespace_retention("acme", "ns", 90)
    await model.set_namespace_auto_scale_policy("acme", "ns", {"enabled": False, "ours": 1})
    kv = await store.get(f"{etcd_prefix.rstrip('/')}/admin/policies/acme/ns")
    assert kv is not None
    raw = json.loads(kv.value)
    assert raw["retention_policies"] == {"retentionTimeInMinutes": 90, "retentionSizeInMB": -1}
    assert raw["scalableTopicAutoScalePolicy"] == {"enabled": False}
    assert raw["replication_clusters"] == [] and raw["deleted"] is False
    assert parse_namespace_policies(kv.value) == NamespacePolicies({"enabled": False}, 5400.0)
    await model.set_namespace_auto_scale_policy("acme", "ns", None)
    await model.set_namespace_retention("acme", "ns", None)
    cleared = await store.get(f"{etcd_prefix.rstrip('/')}/admin/policies/acme/ns")
    assert cleared is not None
    assert parse_namespace_policies(cleared.value) == NamespacePolicies(None, None)


# --- request log and faults ----------------------------------------------------------


async def test_a_lost_answer_is_applied_logged_and_its_retry_is_a_500(
    model: PulsarModel, url: str
) -> None:
    await model.create_topic(TOPIC)
    model.lose_next = 1
    async with client(url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{BASE}/orders/split/0")
        retry = await http.post(f"{BASE}/orders/split/0")
    assert retry.status_code == 500
    splits = [r for r in model.requests if r.method == "POST" and r.path.endswith("/split/0")]
    assert [(r.status, r.delivered) for r in splits] == [(204, False), (500, True)]
    assert splits[0].headers["authorization"] == f"Bearer {SU}"
    assert [op.kind for op in model.operations].count("split") == 1


async def test_injected_statuses_and_redirects(model: PulsarModel, url: str) -> None:
    await model.create_topic(TOPIC)
    model.fail_next = [503]
    model.redirect_to = "http://leader.example:8080"
    async with client(url) as http:
        assert (await http.get(f"{BASE}/orders")).status_code == 503
        assert (await http.get(f"{BASE}/orders")).status_code == 200  # reads are not redirected
        moved = await http.post(f"{BASE}/orders/split/0?x=1")
        assert moved.status_code == 307
        assert (
            moved.headers["location"] == "http://leader.example:8080" + f"{BASE}/orders/split/0?x=1"
        )
    assert [r.status for r in model.requests] == [503, 200, 307]


async def test_controllerd_view_accepts_every_key_the_model_writes(
    model: PulsarModel, store: Store, etcd_prefix: str
) -> None:
    """Issue 11 #1: after Pulsar's out-of-order prune the view keeps managing the topic."""
    await model.create_topic(TOPIC)
    await model.create_subscription(TOPIC, "early")
    await model.split(TOPIC, 0)
    await model.create_subscription(TOPIC, "late", "QUEUE")
    await model.register_consumer(TOPIC, "early", "c1")
    await model.split(TOPIC, 1)
    for sid in (2, 3, 4):
        await model.report_load(TOPIC, sid, msg_rate_in=10.0, bytes_rate_in=100.0)
    model.drain(TOPIC)
    assert await model.gc_once() == {TOPIC: [1]}
    view = MetadataView(Keys(metadata_prefix=etcd_prefix.rstrip("/"), controller_root="/c"))
    kvs, _ = await store.get_prefix(etcd_prefix)
    outcomes = [view.apply_put(kv.key, kv.value, kv.mod_revision, 0) for kv in kvs]
    assert not [o for o in outcomes if isinstance(o, Rejected)]
    state = view.topics[TOPIC]
    assert state.layout is not None and state.layout_error is None
    assert sorted(state.layout.segments) == [0, 2, 3, 4]
    assert state.subscriptions == {"early": "STREAM", "late": "QUEUE"}
    assert state.consumer_counts() == {"early": 1}
    assert state.loads[3].rates.byte_rate_in == 100.0
