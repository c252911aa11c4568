"""Calls that may block in the kernel for good, run in order on as few threads as will do.

The disk checks and the read of the ranks' run directory are file system
calls, and on a hung NFS or Lustre mount such a call never returns and cannot
be interrupted. They therefore run on daemon threads (:class:`DaemonPool`),
never in a scrape. But each hand-over to a thread costs a wake-up of that
thread and another of the waiting event loop, a large share of a scrape that
does a few microseconds of actual file system work (bench/RESULTS.md). So:

* calls run in the order they are submitted, on one thread while they return
  promptly: a scrape's disk checks and run directory read cost one hand-over
  together, not one each;
* a call submitted while every thread running calls is in one that has taken
  longer than ``slow_after`` starts a thread of its own, rather than queueing
  behind what may be a hung mount;
* :meth:`BlockingCalls.separate` gives calls still queued a thread each: a
  collector does so when half its deadline is spent, so that only the call
  that hangs is reported ``timeout``, not the ones queued behind it.

The agent starts its collectors inside :meth:`BlockingCalls.batch`, so that a
thread woken for the first call does not finish it and leave before the next
collector submits its own.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from colossalai_exporter.node.daemon_pool import DaemonPool, run_into

T = TypeVar("T")

_Call = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]

#: A call running longer than this may be stuck: later calls do not queue behind it.
SLOW_AFTER_SECONDS = 0.05


class BlockingCalls:
    """Runs calls that may block for good on daemon threads: see the module doc."""

    def __init__(self, name: str, max_threads: int = 8,
                 slow_after: float = SLOW_AFTER_SECONDS) -> None:
        self.slow_after = slow_after
        self._pool = DaemonPool(max_workers=max_threads, name=name)
        self._lock = threading.Lock()
        self._queue: deque[_Call] = deque()
        # Threads taking calls from the queue: when the call each runs started (None between).
        self._runners: dict[object, float | None] = {}
        self._batches = 0  # open batch() blocks: calls wait for the last one to close

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Calls submitted inside start together, on one thread, when the block ends."""
        with self._lock:
            self._batches += 1
        try:
            yield
        finally:
            with self._lock:
                self._batches -= 1
                runner = self._new_runner() if self._batches == 0 and self._queue else None
            if runner is not None:
                self._start(self._run_queue, runner)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` after the calls submitted before it; its future."""
        future: Future[T] = Future()
        with self._lock:
            self._queue.append((future, fn, args))
            runner = None if self._batches else self._new_runner()
        if runner is not None:
            self._start(self._run_queue, runner)
        return future

    def _new_runner(self) -> object | None:
        """A runner to start, unless one that is running calls promptly will take them."""
        now = time.monotonic()
        if any(since is None or now - since < self.slow_after
               for since in self._runners.values()):
            return None
        runner = object()
        self._runners[runner] = None
        return runner

    def separate(self, futures: Iterable[Future[Any]]) -> None:
        """Give each of these calls that has not started yet a thread of its own."""
        wanted = set(futures)
        with self._lock:
            calls = [call for call in self._queue if call[0] in wanted]
            for call in calls:
                self._queue.remove(call)
        for call in calls:
            self._start(run_into, *call)

    def shutdown(self) -> None:
        """Cancel what has not started and let idle threads end; never waits."""
        with self._lock:
            calls, self._queue = list(self._queue), deque()
        for future, _, _ in calls:
            future.cancel()
        self._pool.shutdown()

    def _start(self, fn: Callable[..., Any], *args: Any) -> None:
        # Shut down meanwhile: its calls were cancelled.
        with contextlib.suppress(RuntimeError):
            self._pool.submit(fn, *args)

    def _run_queue(self, runner: object) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    del self._runners[runner]
                    return
                call = self._queue.popleft()
                self._runners[runner] = time.monotonic()
            run_into(*call)
            with self._lock:
                self._runners[runner] = None
