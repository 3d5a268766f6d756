"""A small controllerd cluster on real processes: N ``controllerd run`` replicas, the
session's real etcd and the test broker over real HTTP, which mirrors every layout
it writes into etcd as a Pulsar broker does."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controllerd.adapters.store import Store
from controllerd.core.model import Layout, TopicName
from controllerd.core.shards import DEFAULT_SHARDS
from controllerd.core.view import Keys
from tests.support.broker import (
    EtcdFence,
    TestBrokerState,
    layout_json,
    load_json,
    mirror_into,
    serve_test_broker,
)
from tests.support.daemon import Replica, replicas, wait_until

TOPIC = TopicName("acme", "ns", "orders")


@dataclass
class Cluster:
    replicas: list[Replica]
    broker: TestBrokerState
    store: Store
    keys: Keys
    tmp: Path
    broker_url: str = ""

    async def leader(self, within: float = 20.0) -> Replica:
        """The one replica that says it leads (waits until exactly one does)."""
        await wait_until(self._one_leads, within=within)
        for replica in self.replicas:
            if replica.alive() and await replica.is_leader():
                return replica
        raise AssertionError("the leader stepped down while we looked")

    async def _one_leads(self) -> bool:
        return sum([await r.is_leader() for r in self.replicas if r.alive()]) == 1

    def requests(self, fragment: str) -> int:
        return sum(1 for r in self.broker.requests if fragment in r.path)

    def splits(self) -> int:
        return self.requests("/split/")

    async def add_topic(self, topic: TopicName = TOPIC, segments: int = 1) -> Layout:
        layout = self.broker.add_topic(topic, segments)
        await self.store.put(self.keys.layout(topic), layout_json(layout))
        return layout

    async def put_load(self, segment_id: int, msg_in: float, topic: TopicName = TOPIC) -> None:
        await self.store.put(self.keys.load(topic, segment_id), load_json(msg_in))


@contextlib.asynccontextmanager
async def open_cluster(
    store: Store,
    etcd_endpoint: str,
    prefix: str,
    tmp: Path,
    count: int = 2,
    **config: Any,
) -> AsyncIterator[Cluster]:
    """``count`` running replicas of ``controllerd run`` on ``prefix``; stopped at exit.

    The broker fences every mutation against etcd as the reference broker does
    (the leader key, or with ``shards=N`` the topic's shard key) and records it.
    """
    keys = Keys(f"{prefix}pulsar", f"{prefix}controllerd/default")
    state = TestBrokerState(profile="reference")
    state.fence = EtcdFence(store, keys.controller_root, config.get("shards") or DEFAULT_SHARDS)
    state.on_layout_change = mirror_into(store, keys)
    async with (
        serve_test_broker(state) as url,
        replicas(
            tmp, count, etcd=etcd_endpoint, prefix=prefix, broker_url=url, **config
        ) as running,
    ):
        yield Cluster(running, state, store, keys, tmp, url)
