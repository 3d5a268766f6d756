"""Store against a real etcd: keys, transactions, leases, watches, retries and restarts."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AbstractAsyncContextManager, aclosing
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from etcd3aio import Etcd3Client, PermissionType
from etcd3aio._protobuf import WatchResponse
from hypothesis import given, settings
from hypothesis import strategies as st

from controllerd.adapters import store as store_module
from controllerd.adapters.store import (
    Compare,
    Delete,
    KeyValue,
    LeaseNotFound,
    Put,
    Store,
    StoreError,
    StoreUnavailable,
    WatchCompacted,
    WatchEvent,
    _skip_fields,
    open_store,
)
from tests.support.etcd import (  # noqa: F401 - fixtures
    EtcdServer,
    compact,
    etcd_prefix_fixture,
    etcd_server_fixture,
    make_pki,
    store_fixture,
)


async def _put_many(store: Store, keys: list[str], value: bytes = b"v") -> None:
    """One revision per key, written 100 at a time."""
    for i in range(0, len(keys), 100):
        async with anyio.create_task_group() as tg:
            for key in keys[i : i + 100]:
                tg.start_soon(store.put, key, value)


async def _pump(
    watch: AsyncIterator[list[WatchEvent]], send: MemoryObjectSendStream[WatchEvent]
) -> None:
    async with send:
        async for batch in watch:
            for event in batch:
                await send.send(event)


async def _receive(events: MemoryObjectReceiveStream[WatchEvent], n: int) -> list[WatchEvent]:
    with anyio.fail_after(10):
        return [await events.receive() for _ in range(n)]


def _start_watch(
    tg: TaskGroup, store: Store, prefix: str, revision: int
) -> MemoryObjectReceiveStream[WatchEvent]:
    send, receive = anyio.create_memory_object_stream[WatchEvent](10_000)
    tg.start_soon(_pump, store.watch_prefix(prefix, revision), send)
    return receive


# -- keys -------------------------------------------------------------------------------


async def test_put_get_delete(store: Store, etcd_prefix: str) -> None:
    key = etcd_prefix + "k"
    assert await store.get(key) is None
    rev1 = await store.put(key, b"one")
    rev2 = await store.put(key, b"two")
    assert rev2 > rev1
    assert await store.get(key) == KeyValue(key, b"two", rev1, rev2, 2, 0)
    assert await store.delete(key) is True
    assert await store.delete(key) is False
    assert await store.get(key) is None


@pytest.mark.parametrize("scan_keys", [64_000, 1_500], ids=["one-listing", "listings"])
async def test_get_prefix_paginates_one_snapshot(
    store: Store, etcd_prefix: str, scan_keys: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "SCAN_KEYS", scan_keys)
    keys = [f"{etcd_prefix}p/{i:05d}" for i in range(2345)]
    await _put_many(store, keys)
    await store.put(etcd_prefix + "p0", b"outside: shares the text but not the '/'")
    last = await store.put(etcd_prefix + "q", b"after")

    kvs, revision = await store.get_prefix(etcd_prefix + "p/")

    assert [kv.key for kv in kvs] == keys  # all pages, in key order, nothing else
    assert revision >= last

    seen: list[str] = []
    revisions: set[int] = set()
    async for page, page_revision in store.iter_prefix(etcd_prefix + "p/"):
        if not seen:  # written after the snapshot: in no page
            await store.put(keys[-1], b"changed")
            await store.put(etcd_prefix + "p/99999", b"new")
        assert len(page) <= store_module.PAGE_SIZE
        assert all(kv.value == b"v" for kv in page)
        revisions.add(page_revision)
        seen.extend(kv.key for kv in page)
    assert seen == keys
    assert len(revisions) == 1
    await store.delete(etcd_prefix + "p/99999")
    assert await store.delete_prefix(etcd_prefix + "p/") == len(keys)
    after = await store.put(etcd_prefix + "r", b"")
    assert await store.get_prefix(etcd_prefix + "p/") == ([], after)
    assert await store.get(etcd_prefix + "p0") is not None


async def test_empty_prefix_is_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="empty prefix"):
        await store.delete_prefix("")


# -- transactions -----------------------------------------------------------------------


async def test_txn_each_compare_kind(store: Store, etcd_prefix: str) -> None:
    key, other = etcd_prefix + "k", etcd_prefix + "other"
    created = await store.put(key, b"a")
    modified = await store.put(key, b"b")  # version 2
    cases: list[tuple[Compare, bool]] = [
        (Compare.value(key, b"b"), True),
        (Compare.value(key, b"a"), False),
        (Compare(key, "value", "!=", b"a"), True),
        (Compare.create_revision(key, created), True),
        (Compare.create_revision(key, modified), False),
        (Compare.mod_revision(key, modified), True),
        (Compare.mod_revision(key, created), False),
        (Compare(key, "mod", ">", created), True),
        (Compare(key, "mod", "<", created), False),
        (Compare.version(key, 2), True),
        (Compare(key, "version", "<", 2), False),
        (Compare.absent(other), True),
        (Compare.absent(key), False),
    ]
    for compare, holds in cases:
        result = await store.txn([compare], [Put(other, b"yes")], [Put(other, b"no")])
        assert result.succeeded is holds, compare
        stored = await store.get(other)
        assert stored is not None
        assert stored.value == (b"yes" if holds else b"no"), compare
        assert stored.mod_revision == result.revision
        await store.delete(other)


async def test_txn_is_atomic_with_deletes_and_refuses_no_compares(
    store: Store, etcd_prefix: str
) -> None:
    await _put_many(store, [etcd_prefix + "d/1", etcd_prefix + "d/2"])
    result = await store.txn(
        [Compare.absent(etcd_prefix + "marker")],
        [Delete(etcd_prefix + "d/", prefix=True), Put(etcd_prefix + "marker", b"1")],
    )
    assert result.succeeded
    assert (await store.get_prefix(etcd_prefix + "d/"))[0] == []
    marker = await store.get(etcd_prefix + "marker")
    assert marker is not None
    assert marker.mod_revision == result.revision
    with pytest.raises(ValueError, match="compares"):
        await store.txn([], [Put(etcd_prefix + "x", b"")])
    with pytest.raises(TypeError):
        Compare(etcd_prefix + "x", "mod", "==", b"1")


async def test_txn_compare_over_a_prefix(store: Store, etcd_prefix: str) -> None:
    """``Compare.unchanged_under`` holds while no key under the prefix was created or
    modified after the revision: every key in the range is compared, a key beside the
    range is not, an empty range holds, and a deleted key no longer counts."""
    prefix, flag = etcd_prefix + "subs/", etcd_prefix + "flag"

    async def holds(compare: Compare) -> bool:
        result = await store.txn([compare], [Put(flag, b"yes")], [Put(flag, b"no")])
        stored = await store.get(flag)
        assert stored is not None and stored.value == (b"yes" if result.succeeded else b"no")
        return result.succeeded

    empty = await store.put(etcd_prefix + "other", b"")
    assert await holds(Compare.unchanged_under(prefix, empty))  # nothing under it
    first = await store.put(prefix + "a", b"")
    assert await holds(Compare.unchanged_under(prefix, first))
    assert not await holds(Compare.unchanged_under(prefix, first - 1))  # created after
    assert await holds(Compare.unchanged_under(prefix, first))
    await store.put(etcd_prefix + "subs", b"")  # beside the range: not compared
    await store.put(etcd_prefix + "subs0", b"")
    assert await holds(Compare.unchanged_under(prefix, first))
    later = await store.put(prefix + "b/consumers/c", b"")
    assert not await holds(Compare.unchanged_under(prefix, first))
    assert await holds(Compare.unchanged_under(prefix, later))
    modified = await store.put(prefix + "a", b"changed")
    assert not await holds(Compare.unchanged_under(prefix, later))
    await store.delete(prefix + "a")
    await store.delete(prefix + "b/consumers/c")
    assert modified > later
    assert await holds(Compare.unchanged_under(prefix, first))  # deleted keys do not count
    with pytest.raises(ValueError, match="empty prefix"):
        Compare.unchanged_under("", 1)


# -- leases -----------------------------------------------------------------------------


async def test_lease_grant_keepalive_revoke(store: Store, etcd_prefix: str) -> None:
    lease, ttl = await store.grant_lease(5)
    assert ttl == 5
    key = etcd_prefix + "ephemeral"
    await store.put(key, b"x", lease=lease)
    assert await store.keepalive_once(lease, timeout=2.0) == 5
    stored = await store.get(key)
    assert stored is not None
    assert stored.lease == lease

    await store.revoke_lease(lease)

    assert await store.get(key) is None
    assert await store.keepalive_once(lease, timeout=2.0) <= 0
    await store.revoke_lease(lease)  # unknown lease is fine
    with pytest.raises(LeaseNotFound):
        await store.txn([Compare.absent(key)], [Put(key, b"x", lease=lease)])


# -- watches ----------------------------------------------------------------------------


async def test_watch_yields_puts_and_deletes_in_order(store: Store, etcd_prefix: str) -> None:
    _, revision = await store.get_prefix(etcd_prefix)
    async with aclosing(store.watch_prefix(etcd_prefix, revision + 1)) as watch:
        await store.put(etcd_prefix + "a", b"1")
        await store.put(etcd_prefix + "b", b"2")
        await store.delete(etcd_prefix + "a")
        both = await store.txn(
            [Compare.absent(etcd_prefix + "c")],
            [Put(etcd_prefix + "c", b"3"), Delete(etcd_prefix + "b")],
        )
        await store.put(etcd_prefix.rstrip("/") + "-sibling", b"not under the prefix")
        seen: list[list[WatchEvent]] = []
        with anyio.fail_after(10):
            async for batch in watch:
                seen.append(batch)
                if batch[-1].mod_revision == both.revision:
                    break
    events = [e for batch in seen for e in batch]
    assert [(e.kind, e.key.removeprefix(etcd_prefix), e.value) for e in events] == [
        ("put", "a", b"1"),
        ("put", "b", b"2"),
        ("delete", "a", b""),
        ("put", "c", b"3"),
        ("delete", "b", b""),
    ]
    async with aclosing(store.watch_prefix_raw(etcd_prefix, revision + 1)) as raw_watch:
        raw = []
        with anyio.fail_after(10):
            async for raw_batch in raw_watch:
                raw.extend(raw_batch)
                if raw_batch[-1][3] == both.revision:
                    break
    assert raw == [(e.kind == "put", e.key.encode(), e.value, e.mod_revision) for e in events]
    batch_of = {e.mod_revision: i for i, batch in enumerate(seen) for e in batch}
    assert all(batch_of[e.mod_revision] == i for i, batch in enumerate(seen) for e in batch)
    revisions = [e.mod_revision for e in events]
    assert revisions == sorted(revisions)


async def test_watch_resumes_across_restart_without_loss(
    store: Store, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    first = await store.put(etcd_prefix + "before", b"0")
    async with anyio.create_task_group() as tg:
        with _start_watch(tg, store, etcd_prefix, first) as events:
            assert (await _receive(events, 1))[0].key == etcd_prefix + "before"

            await anyio.to_thread.run_sync(etcd_server.stop)
            await anyio.to_thread.run_sync(etcd_server.start)
            # Written while the watch is still reconnecting (its backoff runs from
            # the moment etcd went away), so they are history when it resumes.
            keys = [f"{etcd_prefix}after/{i}" for i in range(5)]
            for key in keys:
                await store.put(key, b"1")

            got = await _receive(events, len(keys))
            await store.put(etcd_prefix + "sentinel", b"")
            (next_event,) = await _receive(events, 1)
            tg.cancel_scope.cancel()
    assert [e.key for e in got] == keys
    assert next_event.key == etcd_prefix + "sentinel"  # nothing lost, nothing twice


async def test_watch_resumes_mid_catch_up_from_its_last_event(
    store: Store, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    # A catching-up watch gets 1000 revisions per response, each stamped with
    # the *current* revision. etcd3aio resumes from that stamp and so skipped
    # revisions 1002..2501 in the same situation; we must not.
    keys = [f"{etcd_prefix}{i:05d}" for i in range(1500)]
    _, start = await store.get_prefix(etcd_prefix)
    await _put_many(store, keys)
    got: list[WatchEvent] = []
    with anyio.fail_after(20):
        async with aclosing(store.watch_prefix(etcd_prefix, start + 1)) as watch:
            async for batch in watch:
                if not got:
                    assert len(batch) < len(keys)
                    await anyio.to_thread.run_sync(etcd_server.kill)
                    await anyio.to_thread.run_sync(etcd_server.start)
                got.extend(batch)
                if len(got) >= len(keys):
                    break
    assert sorted(e.key for e in got) == keys
    assert len({e.mod_revision for e in got}) == len(keys)


async def test_watch_from_compacted_revision_raises(
    store: Store, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    old = await store.put(etcd_prefix + "k", b"1")
    now = await store.put(etcd_prefix + "k", b"2")
    await compact(etcd_server.endpoint, now)
    with anyio.fail_after(10), pytest.raises(WatchCompacted) as raised:
        async for _ in store.watch_prefix(etcd_prefix, old):
            pass
    assert raised.value.revision == now


# -- failures ---------------------------------------------------------------------------


async def test_unary_call_retries_through_a_restart(
    store: Store, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    await store.put(etcd_prefix + "k", b"v")
    await anyio.to_thread.run_sync(etcd_server.stop)
    result: list[KeyValue | None] = []
    async with anyio.create_task_group() as tg:

        async def read() -> None:
            result.append(await store.get(etcd_prefix + "k"))

        tg.start_soon(read)  # issued while etcd is down; retry_for is 5 s
        await anyio.to_thread.run_sync(etcd_server.start)
    assert result[0] is not None
    assert result[0].value == b"v"
    # and right after a restart:
    await anyio.to_thread.run_sync(etcd_server.stop)
    await anyio.to_thread.run_sync(etcd_server.start)
    assert await store.put(etcd_prefix + "k", b"w") > 0


async def test_store_unavailable_when_etcd_stays_down(etcd_server: EtcdServer) -> None:
    async with open_store([etcd_server.endpoint], timeout=0.5, retry_for=0.5) as short:
        await short.get("/probe")
        await anyio.to_thread.run_sync(etcd_server.stop)
        started = anyio.current_time()
        with pytest.raises(StoreUnavailable):
            await short.get("/probe")
        with pytest.raises(StoreUnavailable):
            await short.keepalive_once(1, timeout=0.5)
        print(f"gave up after {anyio.current_time() - started:.2f}s (retry_for 0.5 s)")


async def test_non_transient_error_is_not_retried(etcd_server: EtcdServer) -> None:
    async with open_store([etcd_server.endpoint], retry_for=60.0) as patient:
        with anyio.fail_after(5), pytest.raises(LeaseNotFound):
            await patient.put("/t/no-such-lease", b"x", lease=0x7FFF_FFFF)


async def test_endpoints_are_validated() -> None:
    for bad in (
        ["127.0.0.1:2379"],
        ["ftp://h:1"],
        ["http://a:1", "http://b:1"],
        ["http://127.0.0.1:1", "https://127.0.0.1:2"],
        [],
    ):
        with pytest.raises(ValueError):
            async with open_store(bad):
                pass


async def test_mutual_tls(tmp_path: Path) -> None:
    pki = await anyio.to_thread.run_sync(make_pki, tmp_path / "pki")
    server = EtcdServer(tmp_path / "data", pki)
    await anyio.to_thread.run_sync(server.start)
    try:
        assert server.endpoint.startswith("https://")
        async with open_store(
            [server.endpoint],
            ca_file=str(pki.ca),
            cert_file=str(pki.client_cert),
            key_file=str(pki.client_key),
        ) as secure:
            await secure.put("/tls/k", b"v")
            kv = await secure.get("/tls/k")
            assert kv is not None
            assert kv.value == b"v"
        # Without a client certificate the handshake fails, which grpc reports
        # as UNAVAILABLE: indistinguishable from a down etcd.
        async with open_store([server.endpoint], ca_file=str(pki.ca), retry_for=0.3) as anon:
            with pytest.raises(StoreUnavailable):
                await anon.get("/tls/k")
    finally:
        server.close()


async def test_authentication_survives_a_restart(tmp_path: Path) -> None:
    """Simple tokens die with etcd; the store re-authenticates by itself."""
    server = EtcdServer(tmp_path / "data")
    await anyio.to_thread.run_sync(server.start)
    try:
        async with Etcd3Client([server.endpoint.removeprefix("http://")]) as admin:
            assert admin.auth is not None
            await admin.auth.user_add("root", "rootpw")
            await admin.auth.role_add("root")
            await admin.auth.user_grant_role("root", "root")
            await admin.auth.user_add("ctl", "secret")
            await admin.auth.role_add("ctl")
            await admin.auth.role_grant_permission(
                "ctl", "/ctl/", b"/ctl0", perm_type=PermissionType.READWRITE
            )
            await admin.auth.user_grant_role("ctl", "ctl")
            await admin.auth.auth_enable()

        async with open_store([server.endpoint], username="ctl", password="secret") as authed:
            await authed.put("/ctl/k", b"1")
            with pytest.raises(StoreError, match=r"(?i)permission"):
                await authed.put("/elsewhere", b"1")
            await anyio.to_thread.run_sync(server.stop)
            await anyio.to_thread.run_sync(server.start)
            await authed.put("/ctl/k", b"2")
            kv = await authed.get("/ctl/k")
            assert kv is not None
            assert kv.value == b"2"
        async with open_store([server.endpoint]) as anonymous:
            with pytest.raises(StoreError):
                await anonymous.get("/ctl/k")
        with pytest.raises(StoreError):
            async with open_store([server.endpoint], username="ctl", password="wrong"):
                pass
    finally:
        server.close()


async def test_a_large_watch_response_comes_in_batches_that_end_between_revisions(
    store: Store, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A catch-up response of many transactions is handed over in pieces (the loop
    stays responsive), never splitting one transaction's events."""
    monkeypatch.setattr(store_module, "WATCH_BATCH", 100)
    decoded: list[int] = []  # bytes per decode: a slice of the response, never all of it

    class Recording:
        @staticmethod
        def FromString(raw: bytes) -> Any:
            decoded.append(len(raw))
            return WatchResponse.FromString(raw)

    monkeypatch.setattr(store_module, "WatchResponse", Recording)
    _, start = await store.get_prefix(etcd_prefix)
    expected = [f"{etcd_prefix}{t:02d}/{i:02d}" for t in range(20) for i in range(30)]
    for t in range(20):  # 20 transactions of 30 puts: 600 events, 20 revisions
        puts = [Put(key, b"v") for key in expected[t * 30 : (t + 1) * 30]]
        await store.txn([Compare.absent(puts[0].key)], puts)
    batches = await _first_batches(store.watch_prefix(etcd_prefix, start + 1), 600)
    got = [event for batch in batches for event in batch]
    assert [e.key for e in got] == [
        f"{etcd_prefix}{t:02d}/{i:02d}" for t in range(20) for i in range(30)
    ]
    assert len(batches) > 1
    assert all(len(batch) % 30 == 0 and len(batch) <= 120 for batch in batches)
    # 600 events of ~100 bytes came in one or a few responses, decoded 100 events at a time
    assert decoded and max(decoded) * 5 < sum(decoded)
    # the raw form the follower reads: the same events in the same batches
    raw = await _first_batches(store.watch_prefix_raw(etcd_prefix, start + 1), 600)
    assert raw == [
        [(e.kind == "put", e.key.encode(), e.value, e.mod_revision) for e in batch]
        for batch in batches
    ]


_T = TypeVar("_T")


async def _first_batches(watch: AsyncGenerator[list[_T], None], events: int) -> list[list[_T]]:
    """The batches of ``watch`` until they hold ``events`` events."""
    batches: list[list[_T]] = []
    with anyio.fail_after(20):
        async with aclosing(watch):
            async for batch in watch:
                batches.append(batch)
                if sum(map(len, batches)) >= events:
                    break
    return batches


def _response(events: list[tuple[int, bytes, bytes, int]], **head: Any) -> WatchResponse:
    resp = WatchResponse(**head)
    for kind, key, value, revision in events:
        event = resp.events.add()
        event.type = kind
        event.kv.key, event.kv.value, event.kv.mod_revision = key, value, revision
    return resp


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(
            st.sampled_from([0, 1]),
            st.binary(min_size=1, max_size=40),
            st.binary(max_size=300),
            st.integers(min_value=1, max_value=2**62),
        ),
        max_size=40,
    ),
    watch_id=st.integers(min_value=0, max_value=2**62),
    compact=st.integers(min_value=0, max_value=2**62),
    reason=st.text(max_size=20),
    revision=st.integers(min_value=0, max_value=2**62),
    step=st.integers(min_value=1, max_value=7),
)
def test_slices_of_whole_fields_decode_to_the_response(
    events: list[tuple[int, bytes, bytes, int]],
    watch_id: int,
    compact: int,
    reason: str,
    revision: int,
    step: int,
) -> None:
    """What the watch decodes a slice at a time equals protobuf's decoding of the whole."""
    whole = _response(
        events,
        watch_id=watch_id,
        compact_revision=compact,
        cancel_reason=reason,
        canceled=bool(reason),
        header={"revision": revision, "cluster_id": 7},
    )
    raw = whole.SerializeToString()
    pos = _skip_fields(raw, 0, len(raw), until_events=True)
    head = WatchResponse.FromString(raw[:pos])
    assert not head.events
    head.events.extend(whole.events)
    assert head == whole
    got: list[Any] = []
    while pos < len(raw):
        end = _skip_fields(raw, pos, step)
        part = WatchResponse.FromString(raw[pos:end]).events
        assert 0 < len(part) <= step
        got.extend(part)
        pos = end
    assert got == list(whole.events)


def test_a_response_cut_inside_a_field_is_refused() -> None:
    raw = _response([(0, b"k", b"v" * 200, 5)], watch_id=3).SerializeToString()
    with pytest.raises(IndexError):
        _skip_fields(raw[:-10], 0, len(raw))
    with pytest.raises(ValueError, match="wire type 7"):
        _skip_fields(bytes([0x0F, 0]), 0, 1)


# -- responses over the receive limit -----------------------------------------------------
#
# etcd sizes nothing by bytes: a page is 1,000 keys and a catch-up 1,000 revisions,
# and values may be 1.5 MiB, so either can exceed any receive limit. These tests
# shrink the limit instead of writing hundreds of megabytes (bench/bigvalues_bench.py
# does that at the default limit).

KIB = 1024
MIB = 1024 * KIB


def _limited_store(etcd_server: EtcdServer, limit: int) -> AbstractAsyncContextManager[Store]:
    """A store that refuses any response over ``limit`` bytes, as grpc does."""
    return open_store([etcd_server.endpoint], timeout=5.0, retry_for=5.0, max_receive_bytes=limit)


@pytest.mark.parametrize("big", ["values", "keys"])
async def test_get_prefix_reads_a_page_too_large_to_receive_in_smaller_pages(
    store: Store, etcd_server: EtcdServer, etcd_prefix: str, big: str
) -> None:
    """Halved pages (or listings, for big keys) give exactly the unpaged read."""
    prefix = etcd_prefix + "p/"
    pad = "k" * (60 * KIB) if big == "keys" else ""
    value = b"v" * (100 * KIB) if big == "values" else b"v"
    small = [f"{prefix}a{i:02d}" for i in range(30)] + [f"{prefix}c{i:02d}" for i in range(30)]
    large = [f"{prefix}b{i:02d}{pad}" for i in range(40)]  # 4 MiB or a 2.4 MiB listing
    await _put_many(store, small)
    await _put_many(store, large, value)
    await store.put(etcd_prefix + "q", value)  # outside the prefix

    unpaged, revision = await store.get_prefix(prefix)  # one page: 4 MiB is under 256 MiB
    assert [kv.key for kv in unpaged] == sorted(small + large)

    async with _limited_store(etcd_server, MIB) as limited:
        assert await limited.get_prefix(prefix) == (unpaged, revision)
        pages: list[list[KeyValue]] = []
        async for page, page_revision in limited.iter_prefix(prefix):
            assert page_revision == revision
            pages.append(page)
    assert [kv for page in pages for kv in page] == unpaged
    assert 4 <= len(pages) < len(unpaged)  # halved where needed, not one key a page


async def test_get_prefix_refuses_one_key_over_the_receive_limit(
    store: Store, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """Halving stops at one key: a value over the limit is an error, not a loop."""
    await store.put(etcd_prefix + "a", b"small")
    await store.put(etcd_prefix + "b", b"v" * (1200 * KIB))  # etcd takes up to 1.5 MiB
    async with _limited_store(etcd_server, MIB) as limited:
        with anyio.fail_after(5), pytest.raises(StoreError, match="one key's page exceeds"):
            await limited.get_prefix(etcd_prefix)


def _split_revisions(batches: list[list[WatchEvent]]) -> set[int]:
    """Revisions whose events are in more than one batch."""
    batch_of: dict[int, int] = {}
    return {
        event.mod_revision
        for i, batch in enumerate(batches)
        for event in batch
        if batch_of.setdefault(event.mod_revision, i) != i
    }


async def test_watch_catches_up_over_more_than_the_receive_limit(
    store: Store, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """12 MiB of history comes as one catch-up response, which etcd fragments for us."""
    _, start = await store.get_prefix(etcd_prefix)
    keys = [f"{etcd_prefix}{i:02d}" for i in range(12)]
    for i, key in enumerate(keys):
        await store.put(key, bytes([65 + i]) * MIB)
    async with _limited_store(etcd_server, 3 * MIB) as limited:
        batches = await _first_batches(limited.watch_prefix(etcd_prefix, start + 1), len(keys))
    events = [event for batch in batches for event in batch]
    assert [(e.key, e.value) for e in events] == [
        (key, bytes([65 + i]) * MIB) for i, key in enumerate(keys)
    ]
    assert [e.mod_revision for e in events] == list(range(start + 1, start + 1 + len(keys)))


async def test_watch_never_splits_a_transaction_that_etcd_fragments(
    store: Store, etcd_server: EtcdServer, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd cuts fragments between events, inside transactions; batches stay whole."""
    responses: list[tuple[bool, list[int]]] = []  # per response: fragment flag, revisions

    class Recording:
        @staticmethod
        def FromString(raw: bytes) -> Any:
            decoded = WatchResponse.FromString(raw)
            if decoded.events:  # a slice of a response's events
                responses[-1][1].extend(e.kv.mod_revision for e in decoded.events)
            else:  # a response's other fields: a new response
                responses.append((decoded.fragment, []))
            return decoded

    monkeypatch.setattr(store_module, "WatchResponse", Recording)
    _, start = await store.get_prefix(etcd_prefix)
    expected: list[str] = []
    for t in range(8):  # 3 x 400 KiB a transaction, 5 events a 2 MiB fragment: 9.6 MiB
        puts = [Put(f"{etcd_prefix}{t}/{i}", b"v" * (400 * KIB)) for i in range(3)]
        await store.txn([Compare.absent(puts[0].key)], puts)
        expected.extend(put.key for put in puts)
    reconnects: list[None] = []
    batches: list[list[WatchEvent]] = []
    async with _limited_store(etcd_server, 3 * MIB) as limited:
        limited.on_watch_reconnect = lambda: reconnects.append(None)
        with anyio.fail_after(10):
            async with aclosing(limited.watch_prefix(etcd_prefix, start + 1)) as watch:
                async for batch in watch:
                    if not batches:  # the stream breaks with part of a revision carried
                        await anyio.to_thread.run_sync(etcd_server.kill)
                        await anyio.to_thread.run_sync(etcd_server.start)
                    batches.append(batch)
                    if sum(map(len, batches)) >= len(expected):
                        break
    assert reconnects  # the kill did cut the stream short (the revision was re-sent)
    assert [e.key for batch in batches for e in batch] == expected
    assert not _split_revisions(batches)
    # etcd did split transactions: a fragment ended inside a revision the next went on with
    assert any(
        fragment and revisions and after and revisions[-1] == after[0]
        for (fragment, revisions), (_, after) in pairwise(responses)
    )
