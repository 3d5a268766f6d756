"""Where the event loop is while it is blocked: a thread that samples its stack.

The loop monitor learns of a stall only once it is over; by then the code that
held the loop has returned. This thread watches a heartbeat the monitor beats
on every wake-up; when the heartbeat is older than ``threshold`` seconds it
takes the loop thread's stack (``sys._current_frames``) once per stall and
hands it to ``report``. Python switches threads every 5 ms, so the sample is
taken while the loop is still held (or descheduled: ``on_cpu`` in the stall
warning tells the two apart).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType

#: Frames of the loop thread's stack kept in a report, innermost last.
DEPTH = 12


class BlockWatch:
    """Samples ``thread_id``'s stack when :meth:`beat` has not been called for a while."""

    def __init__(
        self,
        report: Callable[[float, list[str]], None],
        *,
        threshold: float = 0.1,
        poll: float = 0.02,
        thread_id: int | None = None,
    ) -> None:
        self._report = report
        self._threshold = threshold
        self._poll = poll
        self._thread_id = thread_id if thread_id is not None else threading.get_ident()
        self._beat = time.monotonic()
        self._reported = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="blockwatch", daemon=True)

    def beat(self) -> None:
        """The loop is alive: a new stall may be reported."""
        self._beat = time.monotonic()
        self._reported = False

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            age = time.monotonic() - self._beat
            if age < self._threshold or self._reported:
                continue
            frame = sys._current_frames().get(self._thread_id)
            if frame is None:
                continue
            self._reported = True
            stack = [line.strip() for line in traceback.format_stack(frame)[-DEPTH:]]
            self._report(age, stack)

    def __enter__(self) -> BlockWatch:
        self.beat()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
