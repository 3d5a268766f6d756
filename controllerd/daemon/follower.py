"""Keeps the metadata view in step with etcd, on every replica, leader or not.

The follower loads every key under the metadata prefix and the controller's
own prefix page by page, then follows one watch per prefix from the revision
of its load. Every replica runs one, so a standby's view is warm: when it
wins an election it acts at once instead of reloading (issue #12, hot standby).

Invariants:

* every value goes through :meth:`MetadataView.apply_put`/``apply_delete``,
  the parsing boundary: nothing read from etcd can raise out of here;
* the loop yields between pages and between watch batches, so a 100k-topic
  load never stalls the event loop for more than one page's work; a reload
  compares what the view holds with etcd, and forgets the rest, in slices too
  (:class:`HeldKeys`);
* a compaction under the watch reloads that prefix from scratch; an etcd
  outage only delays (the store's watch resumes from its last event);
* during the first load of the topics prefix, ``on_whole`` hears of each topic
  once every key it can have has been applied (its keys sort between its layout
  key and that key + ``"0"``, the byte after ``/``), and then ``None`` when the
  view is whole: a leader may act on those topics before the load ends.
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel
import structlog
from anyio.streams.memory import MemoryObjectSendStream

from controllerd.adapters import backoff
from controllerd.adapters.store import (
    KeyValue,
    SnapshotCompacted,
    Store,
    StoreError,
    WatchCompacted,
)
from controllerd.core.model import TopicName
from controllerd.core.view import Change, MetadataView, Outcome, TopicState
from controllerd.daemon.clock import Clock
from controllerd.daemon.controller import Controller

log = structlog.get_logger("controllerd.daemon.follower")

#: Keys applied between two yields to the event loop during a load or a catch-up.
SLICE = 200
#: Keys the view lists (or topics it looks at) between two yields when a reload
#: compares what it holds with what etcd has (~2 us a key: 5 s in one go at 100,000
#: topics). 1,024, not more: the sets holding them grow in step (:class:`HeldKeys`), and
#: at 1.6 million keys 4,096 a slice took up to ~45 ms of CPU, 1,024 ~5 ms.
HELD_SLICE = 1024
#: Pages read from etcd ahead of the one being applied during a load.
READ_AHEAD_PAGES = 4
#: Sets a reload spreads the keys the view held over (:class:`HeldKeys`).
HELD_SHARDS = 256


@dataclass
class FollowerStats:
    """What /status and the bench report about the follower."""

    keys_loaded: int = 0
    load_seconds: float | None = None
    events: int = 0
    revision: int = 0
    reloads: int = 0
    prefixes: dict[str, int] = field(default_factory=dict)


class HeldKeys:
    """What the view held when a reload began, less the keys etcd still has.

    The rest were deleted while no watch ran; :meth:`gone` hands them back in the
    view's listing order reversed, in which a topic's layout key comes after its
    other keys (:meth:`MetadataView.keys_held_in_slices`): the layout's deletion
    drops the topic, and a key of a dropped topic would be deleted with no change
    reported. Sorting them instead held the loop 0.8 s at 700,000 keys.

    Every step is small: the keys are kept in the slices the view listed them in,
    and looked up in :data:`HELD_SHARDS` sets chosen by hash, because one set of
    1.6 million keys held the loop ~80 ms each time it grew (a dict, ~250 ms).
    """

    def __init__(self) -> None:
        self._slices: list[list[str]] = []
        self._shards: list[set[str]] = [set() for _ in range(HELD_SHARDS)]

    def add(self, keys: list[str]) -> None:
        """The next slice of the view's listing (its keys are distinct, and new here)."""
        self._slices.append(keys)
        shards = self._shards
        for key in keys:
            shards[hash(key) % HELD_SHARDS].add(key)

    def discard(self, key: str) -> None:
        """``key`` is still in etcd."""
        self._shards[hash(key) % HELD_SHARDS].discard(key)

    def gone(self) -> Iterator[list[str]]:
        """The keys never discarded, last listed first: one list (maybe empty) per slice.

        Empties this as it goes, so what it held is freed a slice at a time: freed all
        at once when the reload returned, 1.6 million keys held the loop ~0.2 s.
        """
        slices, shards = self._slices, self._shards
        while slices:
            keys = slices.pop()
            gone = []
            for key in reversed(keys):
                shard = shards[hash(key) % HELD_SHARDS]
                if key in shard:
                    shard.remove(key)
                    gone.append(key)
            del keys
            yield gone


def feeding(store: Store, controller: Controller, clock: Clock) -> Follower:
    """The follower of ``controller``'s view, wired as the daemon runs it.

    The controller's own state and Pulsar's policies load first, the topics
    last, and each topic is reported whole to the controller as soon as it is
    (``Controller.whole``), so a leader acts on it before the load ends.
    """
    keys = controller.view.keys
    controller.start_partial()
    return Follower(
        store,
        controller.view,
        [keys.controller_prefix, keys.pulsar_policies_prefix, keys.topics_prefix],
        controller.note,
        clock,
        whole_prefix=keys.topics_prefix,
        on_whole=controller.whole,
        on_load=controller.note_load,
        on_watch_restart=controller.watch_restarted,
    )


class Follower:
    """Loads and follows ``prefixes`` into ``view``; calls ``on_outcome`` for each value
    (``on_load``, if given, for a followed load record the view's fast path applied:
    :meth:`MetadataView.apply_events`).

    ``synced`` is set once every prefix is loaded (the view then describes one
    consistent revision per prefix and the watches run). Prefixes load in the
    order given; ``whole_prefix`` (the topics prefix) should come last, so the
    controller-owned state of a topic is in the view before it is reported whole.
    """

    def __init__(
        self,
        store: Store,
        view: MetadataView,
        prefixes: list[str],
        on_outcome: Callable[[Outcome], None],
        clock: Clock,
        *,
        whole_prefix: str | None = None,
        on_whole: Callable[[Sequence[TopicName] | None], None] | None = None,
        on_load: Callable[[TopicState, int], None] | None = None,
        on_watch_restart: Callable[[], None] = lambda: None,
    ) -> None:
        self._store = store
        self._on_watch_restart = on_watch_restart
        self._view = view
        self._prefixes = prefixes
        self._on_outcome = on_outcome
        self._clock = clock
        self._whole_prefix = whole_prefix
        self._on_whole = on_whole
        self._on_load = on_load
        self.synced = anyio.Event()
        self.stats = FollowerStats()

    async def run(self) -> None:
        """Load every prefix, then follow them all until cancelled."""
        started = anyio.current_time()
        revisions = [await self._load(prefix) for prefix in self._prefixes]
        self.stats.load_seconds = anyio.current_time() - started
        log.info(
            "follower.synced",
            keys=self.stats.keys_loaded,
            seconds=round(self.stats.load_seconds, 3),
            topics=len(self._view.topics),
        )
        if self._on_whole is not None:
            self._on_whole(None)
        self.synced.set()
        async with anyio.create_task_group() as tg:
            for prefix, revision in zip(self._prefixes, revisions, strict=True):
                tg.start_soon(self._follow, prefix, revision + 1, name=f"watch:{prefix}")

    async def _load(self, prefix: str) -> int:
        """Every key under ``prefix`` into the view; the revision of that snapshot.

        Python's cyclic garbage collector is paused while loading, and what was
        loaded is then frozen out of its scans (``gc.freeze``): each full
        collection walks every live object, and at 1.9 million keys those walks
        stalled the event loop for up to 0.9 s, longer the more was loaded.
        The view's objects hold no reference cycles, so nothing is left unfreed.

        The pause covers the attempts only, not the waits between them: the
        collector is global, so paused through an etcd outage it would let the
        whole process's garbage pile up, and then freeze it for good.
        """
        failures = 0
        try:
            while True:
                gc.disable()
                try:
                    return await self._load_once(prefix)
                except SnapshotCompacted:
                    self.stats.reloads += 1
                    log.warning(
                        "follower.load.restart", prefix=prefix, why="compacted between pages"
                    )
                except StoreError as exc:
                    gc.enable()
                    delay = backoff.ETCD.delay(failures)
                    failures += 1
                    log.warning(
                        "follower.load.failed", prefix=prefix, error=str(exc), retry_in_s=delay
                    )
                    await anyio.sleep(delay)
        finally:
            gc.enable()
            gc.freeze()

    async def _read_ahead(
        self,
        prefix: str,
        pages: MemoryObjectSendStream[tuple[list[KeyValue], int]],
        failed: list[StoreError],
    ) -> None:
        """Send ``prefix``'s pages; a store error is handed over, not raised in the group."""
        async with pages:
            try:
                async for page in self._store.iter_prefix(prefix):
                    await pages.send(page)
            except StoreError as exc:
                failed.append(exc)

    async def _load_once(self, prefix: str) -> int:
        """Apply every page of ``prefix``; the next pages are read while one is applied,
        so the load takes about the longer of etcd's reading and our parsing, not both."""
        revision = 0
        apply_put, note = self._view.apply_put, self._on_outcome
        held = HeldKeys()  # what the view holds: nothing, on the first load
        for keys in self._view.keys_held_in_slices(prefix, HELD_SLICE):
            held.add(keys)
            await anyio.lowlevel.checkpoint()
        # (bound, topic) for each layout applied and not yet reported whole
        pending: deque[tuple[str, TopicName]] | None = (
            deque()
            if self._on_whole is not None
            and prefix == self._whole_prefix
            and not self.synced.is_set()
            else None
        )
        send, receive = anyio.create_memory_object_stream[tuple[list[KeyValue], int]](
            READ_AHEAD_PAGES
        )
        failed: list[StoreError] = []
        async with anyio.create_task_group() as tg, receive:
            tg.start_soon(self._read_ahead, prefix, send, failed)
            async for page, page_revision in receive:
                revision = page_revision
                now = self._clock.now_ms()
                for start in range(0, len(page), SLICE):
                    for kv in page[start : start + SLICE]:
                        if held:
                            held.discard(kv.key)
                        outcome = apply_put(kv.key, kv.value, kv.mod_revision, now)
                        note(outcome)
                        if (
                            pending is not None
                            and type(outcome) is Change
                            and outcome.kind == "layout"
                            and outcome.topic is not None
                        ):
                            pending.append((kv.key + "0", outcome.topic))
                    await anyio.lowlevel.checkpoint()
                self.stats.keys_loaded += len(page)
                if pending and page:
                    self._report_whole(pending, page[-1].key)
        if failed:
            raise failed[0]
        for gone in held.gone():  # deleted meanwhile; a slice of the listing at a time
            for start in range(0, len(gone), SLICE):
                for key in gone[start : start + SLICE]:
                    note(self._view.apply_delete(key))
                await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()
        self.stats.prefixes[prefix] = revision
        return revision

    def _report_whole(self, pending: deque[tuple[str, TopicName]], last_key: str) -> None:
        """Report the topics whose every possible key sorts at or before ``last_key``.

        Taken in layout-key order, stopping at the first topic not yet whole: a
        topic whose name extends another's with a byte below ``/`` (``a`` and
        ``a-2``) is held back until its elder is whole; later, never wrongly.
        """
        whole: list[TopicName] = []
        while pending and pending[0][0] <= last_key:
            whole.append(pending.popleft()[1])
        if whole and self._on_whole is not None:
            self._on_whole(whole)

    async def _follow(self, prefix: str, revision: int) -> None:
        view, note, note_load = self._view, self._on_outcome, self._on_load
        while True:
            try:
                async for batch in self._store.watch_prefix_raw(prefix, revision):
                    now = self._clock.now_ms()
                    for start in range(0, len(batch), SLICE):
                        view.apply_events(batch[start : start + SLICE], now, note, note_load)
                        if len(batch) > SLICE:
                            await anyio.lowlevel.checkpoint()
                    revision = batch[-1][3] + 1
                    self.stats.events += len(batch)
                    self.stats.revision = revision - 1
                    await anyio.lowlevel.checkpoint()
            except WatchCompacted:
                self.stats.reloads += 1
                self._on_watch_restart()
                log.warning("follower.watch.compacted", prefix=prefix, revision=revision)
                revision = await self._load(prefix) + 1
            except StoreError as exc:
                self._on_watch_restart()
                log.warning("follower.watch.failed", prefix=prefix, error=str(exc))
                await anyio.sleep(backoff.ETCD.delay(3))
