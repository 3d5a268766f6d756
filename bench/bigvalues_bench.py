"""Big values at the default receive limit: a page and a catch-up over 256 MiB.

etcd sizes pages and watch catch-ups by count (1,000 keys, 1,000 revisions), not
bytes, and takes values up to 1.5 MiB, so 1,000 values of 300 KiB make one
300 MB response, over the Store's 256 MiB receive limit. This bench writes such
values into a fresh etcd (one revision each) and times, with a Store as shipped,
a ``get_prefix`` (whose first page is refused and read in halves) and a watch
catching up over all of them (etcd sends it in fragments of about 2 MiB).

Usage: python -m bench.bigvalues_bench [--keys 1000] [--value-kib 300]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from contextlib import aclosing

import anyio

from controllerd.adapters.store import MAX_RECEIVE_BYTES, Store, open_store
from tests.support.etcd import scratch_etcd

PREFIX = "/bench/big/"


async def write(store: Store, keys: int, value_bytes: int) -> int:
    """``keys`` puts of ``value_bytes`` each, 50 at a time; the revision before them."""
    _, before = await store.get_prefix(PREFIX)
    for first in range(0, keys, 50):
        async with anyio.create_task_group() as tg:
            for i in range(first, min(first + 50, keys)):
                tg.start_soon(store.put, f"{PREFIX}{i:06d}", bytes([i % 251]) * value_bytes)
    return before


async def read(store: Store) -> tuple[int, list[int], int, float]:
    """Keys, page sizes and revision of one paged read, and its seconds."""
    started = time.monotonic()
    sizes: list[int] = []
    revisions: set[int] = set()
    async for page, page_revision in store.iter_prefix(PREFIX):
        sizes.append(len(page))
        revisions.add(page_revision)
    (revision,) = revisions  # every page of one read is at one revision
    return sum(sizes), sizes, revision, time.monotonic() - started


async def catch_up(store: Store, start: int, keys: int) -> tuple[int, int, float]:
    """Events and batches of a watch from ``start`` until it has seen ``keys`` events."""
    started = time.monotonic()
    events = batches = 0
    async with aclosing(store.watch_prefix(PREFIX, start)) as watch:
        async for batch in watch:
            events += len(batch)
            batches += 1
            if events >= keys:
                break
    return events, batches, time.monotonic() - started


async def main_async(args: argparse.Namespace) -> None:
    with scratch_etcd("controllerd-bigvalues-") as (_, etcd):
        async with open_store([etcd.endpoint], timeout=120.0, retry_for=30.0) as store:
            value_bytes = args.value_kib * 1024
            started = time.monotonic()
            before = await write(store, args.keys, value_bytes)
            total = args.keys * value_bytes
            print(
                f"{args.keys} values of {args.value_kib} KiB written in "
                f"{time.monotonic() - started:.1f} s: {total / 2**20:.0f} MiB, "
                f"receive limit {MAX_RECEIVE_BYTES / 2**20:.0f} MiB"
            )
            keys, sizes, revision, seconds = await read(store)
            print(
                f"get_prefix: {keys} keys at revision {revision} in {len(sizes)} pages "
                f"of {sorted(set(sizes), reverse=True)} keys, {seconds:.1f} s"
            )
            events, batches, seconds = await catch_up(store, before + 1, args.keys)
            print(f"watch catch-up: {events} events in {batches} batches, {seconds:.1f} s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--value-kib", type=int, default=300)
    anyio.run(main_async, parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
