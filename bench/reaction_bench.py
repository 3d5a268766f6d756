"""How fast controllerd reacts, with real etcd, real processes and the test broker.

Prints:

* p50/p99 from the etcd put of a consumer registration that makes a split due
  to the split request arriving at the broker (target p99 <= 100 ms on
  loopback), with the default ``consumer_settle_seconds`` and with 0;
* failover time after ``kill -9`` of the leader process (target <= lease TTL
  + 1 s) and after SIGTERM (target <= 1 s): from the signal until the standby
  reports itself leader on /status.

Usage: python -m bench.reaction_bench [--topics 50] [--rounds 3] [--ttl 10]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import time
from collections.abc import Sequence

import anyio

from controllerd.adapters.store import Store, open_store
from controllerd.core.model import TopicName
from controllerd.core.view import Keys
from tests.support.broker import TestBrokerState, layout_json, mirror_into, serve_test_broker
from tests.support.daemon import Replica, replicas, wait_until
from tests.support.etcd import scratch_etcd


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def reaction(
    store: Store, keys: Keys, state: TestBrokerState, topics: int, tag: str
) -> list[float]:
    """Registration put -> split request at the broker, one fresh topic each time."""
    latencies = []
    for i in range(topics):
        topic = TopicName("bench", tag, f"t{i}")
        layout = state.add_topic(topic, 1)
        await store.put(keys.layout(topic), layout_json(layout))
        await store.put(keys.subscription(topic, "s"), b'{"type": "STREAM"}')
        await store.put(keys.consumer(topic, "s", "c1"), b"{}")
        await anyio.sleep(0.2)  # let the single-consumer evaluation finish first
        start = time.monotonic()
        await store.put(keys.consumer(topic, "s", "c2"), b"{}")
        path = f"/{tag}/t{i}/split/"

        async def arrived(path: str = path) -> bool:
            return any(path in r.path for r in state.requests)

        await wait_until(arrived, within=10, step=0.001)
        at = next(r.at for r in state.requests if path in r.path)
        latencies.append((at - start) * 1000)
    return latencies


async def failover(replica_set: list[Replica], sig: signal.Signals, rounds: int) -> list[float]:
    """Signal the leader, time until a standby leads; restart the victim each round."""
    times = []
    for _ in range(rounds):
        leader = None
        for replica in replica_set:
            if replica.alive() and await replica.is_leader():
                leader = replica
        if leader is None:
            await wait_until(lambda: _anyone_leads(replica_set))
            continue
        others = [r for r in replica_set if r is not leader and r.alive()]
        start = time.monotonic()
        leader.signal(sig)

        async def taken_over(others: list[Replica] = others) -> bool:
            return any([await r.is_leader() for r in others])

        await wait_until(taken_over, within=60, step=0.005)
        times.append((time.monotonic() - start) * 1000)
        await anyio.to_thread.run_sync(leader.wait, 15.0)
        leader.start()
        await wait_until(leader.ready)
    return times


async def _anyone_leads(replica_set: list[Replica]) -> bool:
    return any([await r.is_leader() for r in replica_set if r.alive()])


async def main_async(args: argparse.Namespace) -> None:
    with scratch_etcd("controllerd-bench-") as (root, etcd):
        async with open_store([etcd.endpoint]) as store:
            keys = Keys("/bench/pulsar", "/bench/controllerd/default")
            state = TestBrokerState(profile="reference")

            state.on_layout_change = mirror_into(store, keys)
            async with serve_test_broker(state) as url:
                for settle in (0.05, 0.0):
                    extra = f"[autoscale]\nconsumer_settle_seconds = {settle}\n"
                    async with replicas(
                        root / f"r{settle}",
                        1,
                        etcd=etcd.endpoint,
                        prefix="/bench/",
                        broker_url=url,
                        extra=extra,
                        lease_ttl=args.ttl,
                    ) as (replica,):
                        await wait_until(replica.is_leader)
                        ms = await reaction(
                            store, keys, state, args.topics, f"settle{int(settle * 1000)}"
                        )
                    print(
                        f"registration -> split request (consumer_settle_seconds={settle}): "
                        f"n={len(ms)} p50={statistics.median(ms):.1f} ms "
                        f"p99={percentile(ms, 0.99):.1f} ms max={max(ms):.1f} ms"
                    )
                async with replicas(
                    root / "failover",
                    2,
                    etcd=etcd.endpoint,
                    prefix="/bench-failover/",
                    broker_url=url,
                    lease_ttl=args.ttl,
                ) as replica_set:
                    await wait_until(lambda: _anyone_leads(replica_set))
                    for sig in (signal.SIGKILL, signal.SIGTERM):
                        ms = await failover(replica_set, sig, args.rounds)
                        name = "kill -9" if sig == signal.SIGKILL else "SIGTERM"
                        print(
                            f"failover after {name} of the leader (lease TTL {args.ttl} s): "
                            f"n={len(ms)} median={statistics.median(ms):.0f} ms "
                            f"max={max(ms):.0f} ms"
                        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--topics", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttl", type=int, default=10, help="lease TTL in seconds")
    anyio.run(main_async, parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
