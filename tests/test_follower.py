"""The follower's load against a real etcd: pages read ahead, failures start it over."""

from __future__ import annotations

import gc
import random
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, cast

import anyio
import orjson

from controllerd.adapters import store as store_module
from controllerd.adapters.store import (
    KeyValue,
    SnapshotCompacted,
    Store,
    StoreUnavailable,
    open_store,
)
from controllerd.core.layout import initial_layout
from controllerd.core.model import TopicName, layout_to_json
from controllerd.core.view import Change, Keys, MetadataView, Outcome
from controllerd.daemon import follower as follower_module
from controllerd.daemon.clock import ManualClock
from controllerd.daemon.follower import Follower
from tests.support.daemon import wait_until
from tests.support.etcd import EtcdServer
from tests.support.populate import populate, topic_names, topic_puts
from tests.support.proxy import serve_proxy


class FailingOnce:
    """A store whose first load of a prefix fails after ``pages`` pages, with ``error``."""

    def __init__(self, store: Store, pages: int, error: Exception) -> None:
        self._store, self._pages, self._error = store, pages, error
        self.loads = 0

    async def iter_prefix(self, prefix: str) -> AsyncIterator[tuple[list[KeyValue], int]]:
        self.loads += 1
        sent = 0
        async for page in self._store.iter_prefix(prefix):
            if self.loads == 1 and sent == self._pages:
                raise self._error
            yield page
            sent += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def _load(store: Any, keys: Keys) -> tuple[Follower, MetadataView]:
    view = MetadataView(keys)
    follower = Follower(
        cast(Store, store), view, [keys.topics_prefix], lambda _: None, ManualClock()
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(follower.run)
        with anyio.fail_after(30):
            await follower.synced.wait()
        tg.cancel_scope.cancel()
    return follower, view


async def test_a_load_that_fails_midway_starts_over_and_ends_complete(
    store: Store, etcd_prefix: str, monkeypatch: Any
) -> None:
    monkeypatch.setattr(follower_module, "READ_AHEAD_PAGES", 1)
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd/default")
    await populate(store, keys, topic_names(200), segments=4)  # 1,400 keys: two pages
    for error in (SnapshotCompacted("compacted"), StoreUnavailable("etcd went away")):
        failing = FailingOnce(store, pages=1, error=error)
        follower, view = await _load(failing, keys)
        assert failing.loads == 2
        assert len(view.topics) == 200
        assert all(len(state.loads) == 4 for state in view.topics.values())
        assert follower.stats.reloads == (1 if isinstance(error, SnapshotCompacted) else 0)


async def test_a_topic_is_reported_whole_only_once_every_key_it_has_is_in_the_view(
    store: Store, etcd_prefix: str, monkeypatch: Any
) -> None:
    """Pages end inside topics; ``a``'s keys sort after ``a-2``'s and ``a.b``'s."""
    monkeypatch.setattr(store_module, "PAGE_SIZE", 5)
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd/default")
    tricky = [TopicName("tn", "ns", name) for name in ("a", "a-2", "a.b", "ab", "a-")]
    names = tricky + topic_names(12, namespaces=3)
    await populate(store, keys, names, segments=3)  # 6 keys a topic
    view = MetadataView(keys)
    reports: list[list[TopicName] | None] = []

    def on_whole(topics: Sequence[TopicName] | None) -> None:
        reports.append(None if topics is None else list(topics))
        for topic in topics or ():
            state = view.topics[topic]
            assert state.layout is not None, topic
            assert len(state.loads) == 3, topic
            assert state.consumer_counts() == {"sub": 1}, topic

    follower = Follower(
        store,
        view,
        [keys.topics_prefix],
        lambda _: None,
        ManualClock(),
        whole_prefix=keys.topics_prefix,
        on_whole=on_whole,
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(follower.run)
        with anyio.fail_after(30):
            await follower.synced.wait()
        tg.cancel_scope.cancel()
    assert reports[-1] is None and None not in reports[:-1]
    reported = [topic for report in reports[:-1] for topic in report or ()]
    assert len(reported) == len(set(reported))  # once each
    assert len(reported) >= len(names) - 2  # as the pages came, not all at the end
    assert len(reports) > 10


class _Junk:
    """One node of a reference cycle: garbage only the cyclic collector frees."""

    ring: list[_Junk]


def _cyclic_garbage(count: int) -> weakref.ref[_Junk]:
    ring = [_Junk() for _ in range(count)]
    for node in ring:
        node.ring = ring
    return weakref.ref(ring[0])


async def test_the_collector_runs_while_a_load_waits_out_an_etcd_outage(
    etcd_server: EtcdServer, store: Store, etcd_prefix: str
) -> None:
    """The load pauses the cyclic collector; it used to stay paused for a whole etcd
    outage, and the process's garbage of the outage was then frozen with the view."""
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd/default")
    await populate(store, keys, topic_names(20), segments=2)
    async with (
        serve_proxy(etcd_server.endpoint) as proxy,
        open_store([proxy.endpoint], timeout=0.5, retry_for=0.5) as cut_off,
    ):
        await proxy.set_mode("refuse")
        view = MetadataView(keys)
        follower = Follower(cut_off, view, [keys.topics_prefix], lambda _: None, ManualClock())

        async def paused() -> bool:
            return not gc.isenabled()

        async def collecting() -> bool:
            return gc.isenabled()

        async with anyio.create_task_group() as tg:
            tg.start_soon(follower.run)
            await wait_until(paused)  # an attempt is under way
            # Enough to be past the youngest generation's threshold, whatever else is freed.
            garbage = _cyclic_garbage(10 * gc.get_threshold()[0])
            await wait_until(collecting)  # waiting to retry
            await proxy.set_mode("pass")
            with anyio.fail_after(30):
                await follower.synced.wait()
            tg.cancel_scope.cancel()
    assert len(view.topics) == 20
    assert gc.isenabled()
    gc.collect()  # frees nothing frozen
    assert garbage() is None


async def test_a_reload_yields_to_the_loop_while_it_compares_held_keys_with_etcds(
    store: Store, etcd_prefix: str, monkeypatch: Any
) -> None:
    """A reload (after a compaction) lists every key the view holds and forgets the ones
    etcd no longer has. In one go that held the loop ~2 us a key: seconds at 100,000
    topics. Both go in slices of HELD_SLICE keys; here every key the view lists and
    every key it forgets is counted, and the count is read at each yield."""
    monkeypatch.setattr(follower_module, "HELD_SLICE", 10)
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd/default")
    names = topic_names(30)
    await populate(store, keys, names, segments=2)  # 5 keys a topic
    follower, view = await _load(store, keys)
    await store.delete_prefix(keys.layout(names[0]))  # 5 keys etcd no longer has
    listed = 0
    gaps: list[int] = []
    since_yield = 0
    keys_held, apply_delete = view.keys_held_in_slices, view.apply_delete
    checkpoint = anyio.lowlevel.checkpoint

    def counted_keys(prefix: str, size: int) -> Iterator[list[str]]:
        nonlocal listed, since_yield
        for keys in keys_held(prefix, size):
            listed += len(keys)
            since_yield += len(keys)
            yield keys

    def counted_delete(key: str) -> Any:
        nonlocal since_yield
        since_yield += 1
        return apply_delete(key)

    async def counted_checkpoint() -> None:
        nonlocal since_yield
        gaps.append(since_yield)
        since_yield = 0
        await checkpoint()

    monkeypatch.setattr(view, "keys_held_in_slices", counted_keys)
    monkeypatch.setattr(view, "apply_delete", counted_delete)
    monkeypatch.setattr(anyio.lowlevel, "checkpoint", counted_checkpoint)
    await follower._load_once(keys.topics_prefix)
    assert listed == 5 * len(names)
    assert names[0] not in view.topics and len(view.topics) == len(names) - 1
    assert max([*gaps, since_yield]) <= 10


async def test_every_watch_restart_is_reported(
    etcd_server: EtcdServer, store: Store, etcd_prefix: str
) -> None:
    """controllerd_watch_restarts_total is documented and graphed; nothing counted it.
    The store re-establishes a cut watch itself and the follower one that etcd
    compacted or refused: the daemon counts both."""
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd/default")
    await populate(store, keys, topic_names(2), segments=1)
    restarts: list[int] = []
    async with (
        serve_proxy(etcd_server.endpoint) as proxy,
        open_store([proxy.endpoint], timeout=0.5, retry_for=0.5) as cut_off,
    ):
        follower = Follower(
            cut_off,
            MetadataView(keys),
            [keys.topics_prefix],
            lambda _: None,
            ManualClock(),
            on_watch_restart=lambda: restarts.append(1),
        )
        cut_off.on_watch_reconnect = lambda: restarts.append(1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(follower.run)
            with anyio.fail_after(30):
                await follower.synced.wait()
            await proxy.set_mode("refuse")

            async def restarted() -> bool:
                return len(restarts) >= 1

            await wait_until(restarted)
            await proxy.set_mode("pass")
            tg.cancel_scope.cancel()


class _Snapshot:
    """A store whose every prefix holds ``pages`` (etcd's, in key order) at one revision."""

    def __init__(self, pages: list[list[KeyValue]]) -> None:
        self._pages = pages

    async def iter_prefix(self, prefix: str) -> AsyncIterator[tuple[list[KeyValue], int]]:
        for page in self._pages:
            yield page, 1_000


class _Yields:
    """Counts :meth:`worked` calls between two yields of the follower to the loop."""

    def __init__(self, monkeypatch: Any) -> None:
        self.gaps: list[int] = []
        self.since = 0
        checkpoint = anyio.lowlevel.checkpoint

        async def counted() -> None:
            self.gaps.append(self.since)
            self.since = 0
            await checkpoint()

        monkeypatch.setattr(anyio.lowlevel, "checkpoint", counted)

    def worked(self) -> None:
        self.since += 1

    def longest(self) -> int:
        return max([*self.gaps, self.since])


def _view_of(
    keys: Keys, names: list[TopicName]
) -> tuple[MetadataView, dict[TopicName, list[KeyValue]]]:
    """A view holding ``names`` (put in this order), each with 5 keys; and those keys."""
    view = MetadataView(keys)
    layout = orjson.dumps(layout_to_json(initial_layout(2)))
    rng = random.Random(0)
    kvs = {
        name: [
            KeyValue(put.key, put.value, 10, 10, 1, 0)
            for put in topic_puts(keys, name, layout, [0, 1], rng)
        ]
        for name in names
    }
    for kv in (kv for topic in kvs.values() for kv in topic):
        assert isinstance(view.apply_put(kv.key, kv.value, kv.mod_revision, 0), Change)
    return view, kvs


async def test_a_reload_yields_while_it_walks_topics_that_have_no_key_under_the_prefix(
    monkeypatch: Any,
) -> None:
    """A compaction under the controller's prefix reloads it, and the view walks every
    topic for our keys, which few topics have. Counted in keys listed, that walk never
    yielded: 0.1-0.2 s in one go at 100,000 topics. Topics looked at count too."""
    monkeypatch.setattr(follower_module, "HELD_SLICE", 20)
    keys = Keys("/pulsar", "/controllerd/default")
    view, _ = _view_of(keys, topic_names(400))
    yields = _Yields(monkeypatch)
    follower = Follower(
        cast(Store, _Snapshot([])), view, [keys.controller_prefix], lambda _: None, ManualClock()
    )
    await follower._load_once(keys.controller_prefix)
    assert len(yields.gaps) >= 400 // 20
    assert len(view.topics) == 400


async def test_a_reload_forgets_what_etcd_lost_layout_keys_last_a_slice_at_a_time(
    monkeypatch: Any,
) -> None:
    """Keys held but not in etcd any more were deleted while no watch ran. The reload
    deletes them in the view's listing order reversed, where each topic's layout key
    comes after its other keys; sorting them first held the loop 0.8 s at 700,000 keys
    (and keeping them in one set, 80 ms each time it grew)."""
    monkeypatch.setattr(follower_module, "HELD_SLICE", 16)
    monkeypatch.setattr(follower_module, "SLICE", 4)
    keys = Keys("/pulsar", "/controllerd/default")
    names = topic_names(40)[::-1]  # put in an order their keys do not sort in
    view, kvs = _view_of(keys, names)
    lost = set(names[::3])
    single = keys.load(names[1], 0)  # one key of a topic that stays
    left = sorted(
        (kv for name in names if name not in lost for kv in kvs[name] if kv.key != single),
        key=lambda kv: kv.key,
    )
    held = list(view.keys_held(keys.topics_prefix))
    gone = set(held) - {kv.key for kv in left}
    assert len(gone) == 5 * len(lost) + 1
    deleted: list[str] = []
    said: list[Outcome] = []
    yields = _Yields(monkeypatch)
    apply_delete = view.apply_delete

    def counted_delete(key: str) -> Outcome:
        deleted.append(key)
        yields.worked()
        return apply_delete(key)

    monkeypatch.setattr(view, "apply_delete", counted_delete)
    pages = [left[i : i + 50] for i in range(0, len(left), 50)]
    follower = Follower(
        cast(Store, _Snapshot(pages)), view, [keys.topics_prefix], said.append, ManualClock()
    )
    await follower._load_once(keys.topics_prefix)
    assert deleted == [key for key in reversed(held) if key in gone]
    assert set(view.topics) == set(names) - lost
    assert 0 not in view.topics[names[1]].loads
    dropped = [
        o.topic for o in said if isinstance(o, Change) and o == Change("layout", o.topic, False)
    ]
    assert len(dropped) == len(lost) and set(dropped) == lost  # each reported once
    assert yields.longest() <= 4
