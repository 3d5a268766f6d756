"""The follower's load against a real etcd: pages read ahead, failures start it over."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import anyio

from controllerd.adapters import store as store_module
from controllerd.adapters.store import KeyValue, SnapshotCompacted, Store, StoreUnavailable
from controllerd.core.model import TopicName
from controllerd.core.view import Keys, MetadataView
from controllerd.daemon import follower as follower_module
from controllerd.daemon.clock import ManualClock
from controllerd.daemon.follower import Follower
from tests.support.etcd import EtcdServer  # noqa: F401 - fixtures
from tests.support.populate import populate, topic_names


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
