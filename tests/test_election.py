"""Leader election against a real etcd: one leader, handover, failover, fencing, loss."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import anyio
import pytest
import structlog

from controllerd.adapters.election import Leadership, current_leader, fenced, lead, wait_for_turn
from controllerd.adapters.store import LeaseKeepAliveClient, Put, Store, open_store
from tests.support.etcd import (  # noqa: F401 - fixtures
    EtcdServer,
    etcd_prefix_fixture,
    etcd_server_fixture,
    store_fixture,
)


class Logs:
    """A structlog processor that records events, so tests wait on them instead of sleeping."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self._changed = anyio.Event()

    def __call__(self, _logger: Any, level: str, event: MutableMapping[str, Any]) -> Any:
        self.entries.append({**event, "level": level})
        self._changed.set()
        self._changed = anyio.Event()
        raise structlog.DropEvent

    def find(self, event: str, **fields: Any) -> dict[str, Any] | None:
        for entry in self.entries:
            if entry["event"] == event and all(entry.get(k) == v for k, v in fields.items()):
                return entry
        return None

    async def wait_for(self, event: str, **fields: Any) -> dict[str, Any]:
        with anyio.fail_after(10):
            while (entry := self.find(event, **fields)) is None:
                await self._changed.wait()
        return entry


@pytest.fixture
def logs() -> Iterator[Logs]:
    recorder = Logs()
    previous = structlog.get_config()["processors"]
    structlog.configure(processors=[recorder])
    try:
        yield recorder
    finally:
        structlog.configure(processors=previous)


class Replica:
    """One controllerd replica: campaigns, holds leadership until released."""

    def __init__(self, store: Store, key: str, name: str, ttl: int = 10) -> None:
        self.store, self.key, self.name, self.ttl = store, key, name, ttl
        self.won = anyio.Event()
        self.release = anyio.Event()
        self.exited = anyio.Event()
        self.won_at = 0.0
        self._leadership: Leadership | None = None

    @property
    def leadership(self) -> Leadership:
        assert self._leadership is not None
        return self._leadership

    async def run(self) -> None:
        try:
            async with lead(self.store, self.key, {"name": self.name}, ttl=self.ttl) as won:
                self._leadership = won
                self.won_at = anyio.current_time()
                self.won.set()
                await self.release.wait()
        finally:
            self.exited.set()


async def test_one_leader_then_graceful_handover(
    store: Store, etcd_server: EtcdServer, etcd_prefix: str, logs: Logs
) -> None:
    key = etcd_prefix + "leader"
    async with open_store([etcd_server.endpoint]) as store_b, anyio.create_task_group() as tg:
        a, b = Replica(store, key, "a"), Replica(store_b, key, "b")
        tg.start_soon(a.run)
        with anyio.fail_after(10):
            await a.won.wait()
        tg.start_soon(b.run)
        await logs.wait_for("election.standby", leader={"name": "a"})

        assert not b.won.is_set()
        assert await current_leader(store, key) == ({"name": "a"}, a.leadership.token)
        assert a.leadership.is_leader()

        released_at = anyio.current_time()
        a.release.set()
        with anyio.fail_after(10):
            await b.won.wait()
        print(f"graceful handover: {b.won_at - released_at:.3f}s (lease ttl 10 s)")

        # Handed over by the resignation, not by waiting out A's lease: A
        # deleted its key and revoked its lease, and B won on that deletion.
        # A logs its resignation after the revoke, so B may have won before it.
        assert await logs.wait_for("election.resigned", token=a.leadership.token, deleted_key=True)
        assert (await logs.wait_for("election.won", identity={"name": "b"}))["after"] == (
            "key-deleted"
        )
        assert await store.keepalive_once(a.leadership.lease_id, timeout=2.0) <= 0
        assert a.leadership.lost.is_set()
        assert not a.leadership.is_leader()
        assert b.leadership.token > a.leadership.token
        assert await current_leader(store, key) == ({"name": "b"}, b.leadership.token)
        b.release.set()
    assert await current_leader(store, key) is None


async def test_dead_leader_is_replaced_and_fenced_out(
    store: Store, etcd_server: EtcdServer, etcd_prefix: str, logs: Logs
) -> None:
    key = etcd_prefix + "leader"
    guarded = etcd_prefix + "layout"
    async with open_store([etcd_server.endpoint]) as store_b, anyio.create_task_group() as tg:
        a, b = Replica(store, key, "a"), Replica(store_b, key, "b")
        tg.start_soon(a.run)
        with anyio.fail_after(10):
            await a.won.wait()
        tg.start_soon(b.run)
        await logs.wait_for("election.standby", leader={"name": "a"})
        old = a.leadership

        # A "dies": its lease goes away as if it had expired.
        revoked_at = anyio.current_time()
        await store.revoke_lease(old.lease_id)
        with anyio.fail_after(10):
            await b.won.wait()
            await old.lost.wait()
        print(f"failover after lease loss: {b.won_at - revoked_at:.3f}s")

        new = b.leadership
        assert new.token > old.token
        assert not old.is_leader()
        assert new.is_leader()
        lost = await logs.wait_for("election.lost", token=old.token)
        assert lost["reason"] in {"key-deleted", "lease-expired"}
        # The deposed leader's fenced write fails; the new leader's succeeds.
        stale = await store.txn([old.fenced()], [Put(guarded, b"from a")])
        fresh = await store_b.txn([fenced(key, new.token)], [Put(guarded, b"from b")])
        assert (stale.succeeded, fresh.succeeded) == (False, True)
        kv = await store.get(guarded)
        assert kv is not None
        assert kv.value == b"from b"

        # A's resignation must not delete B's key.
        a.release.set()
        with anyio.fail_after(10):
            await a.exited.wait()
        assert logs.find("election.resigned", token=old.token, deleted_key=False)
        assert await current_leader(store, key) == ({"name": "b"}, new.token)
        b.release.set()


async def test_lost_when_keepalives_fail_and_resign_survives_etcd_down(
    store: Store, etcd_server: EtcdServer, etcd_prefix: str, logs: Logs
) -> None:
    key = etcd_prefix + "leader"
    with anyio.fail_after(15):
        async with lead(store, key, {"name": "a"}, ttl=2, resign_timeout=1.0) as leadership:
            assert leadership.is_leader()
            stopped_at = anyio.current_time()
            await anyio.to_thread.run_sync(etcd_server.stop)
            await leadership.lost.wait()
            print(
                f"lost {anyio.current_time() - stopped_at:.3f}s after etcd stopped "
                "(ttl 2 s, margin 1 s)"
            )
            assert not leadership.is_leader()
        # Leaving resigned against a dead etcd: bounded, and nothing raised.
    assert (await logs.wait_for("election.lost", token=leadership.token))["reason"] == (
        "keepalive-timeout"
    )
    assert logs.find("election.resign_failed", token=leadership.token)
    await anyio.to_thread.run_sync(etcd_server.start)


class _CrashingKeepAlive:
    """The real keep-alive client, except that its first renewal raises what no etcd
    answer can: a bug, or grpc misused."""

    def __init__(self, client: LeaseKeepAliveClient) -> None:
        self.client = client
        self.calls = 0

    def keepalive_once(self, lease_id: int, timeout: float) -> int:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected: not an etcd answer")
        return self.client.keepalive_once(lease_id, timeout)

    def close(self) -> None:
        self.client.close()


async def test_a_keepalive_thread_that_crashes_gives_up_leadership_at_once(
    store: Store, etcd_prefix: str, logs: Logs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The renewing thread caught only StoreError: anything else ended it silently, and
    the leader led on, unrenewed, until its lease's deadline (here 9 s), and never
    set ``lost``."""
    real = store.keepalive_client
    monkeypatch.setattr(store, "keepalive_client", lambda: _CrashingKeepAlive(real()))
    key = etcd_prefix + "leader"
    async with lead(store, key, {"name": "a"}, ttl=12) as leadership:
        with anyio.fail_after(7):  # the first renewal, 4 s in, crashes
            await leadership.lost.wait()
        assert not leadership.is_leader()
    assert (await logs.wait_for("election.lost", token=leadership.token))["reason"] == (
        "keepalive-crashed"
    )
    assert logs.find("election.keepalive_crashed")


async def test_cancellation_and_errors_resign_and_propagate_unwrapped(
    store: Store, etcd_prefix: str
) -> None:
    key = etcd_prefix + "leader"
    with anyio.fail_after(10):
        with anyio.CancelScope() as scope:
            async with lead(store, key, {"name": "a"}) as leadership:
                assert leadership.fenced() == fenced(key, leadership.token)
                scope.cancel()
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert await current_leader(store, key) is None
        assert await store.keepalive_once(leadership.lease_id, timeout=2.0) <= 0

        with pytest.raises(KeyError):
            async with lead(store, key, {"name": "a"}):
                raise KeyError("the body's own error, not an ExceptionGroup")
        assert await current_leader(store, key) is None


async def test_standby_is_cancellable_and_ttl_is_validated(
    store: Store, etcd_prefix: str, logs: Logs
) -> None:
    key = etcd_prefix + "leader"
    with pytest.raises(ValueError, match="ttl"):
        async with lead(store, key, {}, ttl=1):
            pass
    async with anyio.create_task_group() as tg:
        a = Replica(store, key, "a")
        tg.start_soon(a.run)
        with anyio.fail_after(10):
            await a.won.wait()
        b = Replica(store, key, "b")
        async with anyio.create_task_group() as standby:
            standby.start_soon(b.run)
            entry = await logs.wait_for("election.standby", leader={"name": "a"})
            standby.cancel_scope.cancel()
        assert b.exited.is_set()
        assert not b.won.is_set()
        a.release.set()
    # The standby's lease was revoked on the way out; A's key was deleted.
    assert await store.keepalive_once(entry["lease"], timeout=2.0) <= 0
    assert await current_leader(store, key) is None


async def test_a_loading_replica_defers_to_a_leader_and_campaigns_after_a_lasting_vacancy(
    store: Store, etcd_prefix: str
) -> None:
    key = f"{etcd_prefix}leader"
    ready = anyio.Event()
    async with lead(store, key, {"replica": "warm"}, ttl=5):
        with anyio.move_on_after(1.0) as waited:  # a leader: 10 grace periods pass, no turn
            await wait_for_turn(store, key, ready, grace=0.1, poll=0.02)
        assert waited.cancelled_caught
    started = anyio.current_time()  # resigned: vacant from now on
    with anyio.fail_after(5):
        await wait_for_turn(store, key, ready, grace=0.3, poll=0.02)
    assert anyio.current_time() - started >= 0.3
    async with lead(store, key, {"replica": "warm"}, ttl=5):
        ready.set()  # the view is whole: its turn, leader or not (lead() then waits)
        with anyio.fail_after(1):
            await wait_for_turn(store, key, ready, grace=60, poll=60)
