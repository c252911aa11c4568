"""A small thread pool whose threads never hold up the agent's exit.

The disk and ranks collectors hand file system calls to threads because such a
call can block in the kernel for good (a hung NFS or Lustre mount), and no
thread can be interrupted there. ``concurrent.futures.ThreadPoolExecutor``
joins its threads when the interpreter exits, so one stuck ``statvfs`` would
turn a SIGTERM into a hang until the service manager's SIGKILL. These threads
are daemon threads: the process exits, the stuck call dies with it. What the
executor offers beyond that (initializers, ``map``, waiting shutdown) is not
needed, which is why this is written here rather than borrowed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any, TypeVar

T = TypeVar("T")

_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


def run_into(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """``fn(*args)`` into ``future`` (its result or exception), unless it was cancelled."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as exc:  # the caller sees it through the future
        future.set_exception(exc)
    else:
        future.set_result(result)


class DaemonPool:
    """Up to ``max_workers`` daemon threads, started as work arrives, kept for reuse."""

    def __init__(self, max_workers: int, name: str) -> None:
        self._max_workers = max(1, max_workers)
        self._name = name
        self._queue: SimpleQueue[_Task | None] = SimpleQueue()
        self._idle = threading.Semaphore(0)  # one count per thread waiting for work
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self._name} pool is shut down")
            self._queue.put((future, fn, args))
            # An idle thread takes it; else a new one, up to the limit; else it queues.
            if not self._idle.acquire(blocking=False) and \
                    len(self._threads) < self._max_workers:
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{self._name}-{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            run_into(*task)
            del task
            self._idle.release()

    def shutdown(self) -> None:
        """Cancel what has not started and let idle threads end; never waits."""
        with self._lock:
            self._closed = True
            while not self._queue.empty():
                task = self._queue.get_nowait()
                if task is not None:
                    task[0].cancel()
            for _ in self._threads:
                self._queue.put(None)
