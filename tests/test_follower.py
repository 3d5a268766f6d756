"""The follower's load against a real etcd: pages read ahead, failures start it over."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import anyio

from controllerd.adapters.store import KeyValue, SnapshotCompacted, Store, StoreUnavailable
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
