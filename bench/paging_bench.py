"""Reading a large prefix from a real etcd: page ranges found by a listing, against ``limit``.

etcd walks a range's whole index on every request whatever its ``limit``, so
reading N keys 1,000 at a time over the open range costs N^2/2000 index steps.
``Store.iter_prefix`` lists up to ``SCAN_KEYS`` keys per keys-only request and
reads each page over a range that holds exactly it. This bench populates N
topics (19 keys each: ``tests/support/populate.py``) into a fresh etcd and times
a full ``iter_prefix`` both ways: as shipped, and with ``SCAN_KEYS`` set to the
page size, which makes every page a ``limit`` request over the rest of the
prefix (the old way), cut off after ``--old-timeout`` seconds.

Usage: python -m bench.paging_bench [--topics 10000] [--old-timeout 120]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

import anyio

from controllerd.adapters import store as store_module
from controllerd.adapters.store import Store, open_store
from controllerd.core.view import Keys
from tests.support.etcd import scratch_etcd
from tests.support.populate import populate, topic_names


async def read_all(store: Store, prefix: str, limit_s: float) -> tuple[int, int, float | None]:
    """Keys and pages read, and the seconds it took (None: cut off after ``limit_s``)."""
    keys = pages = 0
    started = time.monotonic()
    with anyio.move_on_after(limit_s):
        async for page, _ in store.iter_prefix(prefix):
            keys += len(page)
            pages += 1
        return keys, pages, time.monotonic() - started
    return keys, pages, None


async def main_async(args: argparse.Namespace) -> None:
    os.environ["ETCD_QUOTA_BACKEND_BYTES"] = str(8 << 30)  # etcd reads its flags from env
    with scratch_etcd("controllerd-paging-") as (_, etcd):
        async with open_store([etcd.endpoint], timeout=60.0, retry_for=30.0) as store:
            keys = Keys("/bench/pulsar", "/bench/controllerd/default")
            done = await populate(store, keys, topic_names(args.topics))
            print(f"{args.topics} topics: {done.keys} keys written in {done.seconds:.1f} s")
            shipped = store_module.SCAN_KEYS
            for label, scan, timeout in (
                ("listing + exact ranges", shipped, 3600.0),
                ("limit over the open range (old)", store_module.PAGE_SIZE, args.old_timeout),
            ):
                store_module.SCAN_KEYS = scan
                n, pages, seconds = await read_all(store, keys.topics_prefix, timeout)
                took = f"{seconds:.2f} s" if seconds is not None else f"> {timeout:.0f} s (cut off)"
                print(f"{label:34} {n:>9} keys {pages:>6} pages  {took}")
            store_module.SCAN_KEYS = shipped


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--topics", type=int, default=10_000)
    parser.add_argument("--old-timeout", type=float, default=120.0)
    anyio.run(main_async, parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
