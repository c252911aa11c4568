"""When a rank's snapshot is published: a thread of its own, and the few moments
another thread must publish at once.

The thread publishes once per interval and at once when woken (a phase change),
never more than about once an interval otherwise. Other threads publish
through :meth:`Publisher.publish` (finish, fail, close: they may wait) or
:meth:`Publisher.publish_now` (an error or a signal on the training thread:
it must not wait behind a publish stuck on a hung run directory, so after a
second it wakes the thread instead). What a publish does is the monitor's
(``publish(periodic)``); this module only decides when, and keeps two
publishes from running at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# How long publish_now waits for a publish in progress before handing over to the thread.
NOW_WAIT_SECONDS = 1.0


class Publisher:
    def __init__(self, publish: Callable[[bool], None], interval: float) -> None:
        """``publish(periodic)``: one publish; ``periodic`` for the thread's regular ones."""
        self._publish = publish
        self._interval = interval
        # Reentrant: a signal's handler runs in the main thread between two bytecodes,
        # possibly of a publish of that same thread, and publishes at once.
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="colossalai-monitor",
                                        daemon=True)
        self._wake.set()  # the first snapshot at once: the node agent sees the rank start
        self._thread.start()

    def wake(self) -> None:
        """Publish from the thread soon, without waiting for the interval."""
        self._wake.set()

    def publish(self) -> None:
        """Publish from the calling thread, waiting for one in progress."""
        with self._lock:
            self._publish(False)

    def publish_now(self, wait: float = NOW_WAIT_SECONDS) -> None:
        """Publish from the calling thread, unless a publish in progress outlasts ``wait``
        seconds (stuck on a hung run directory: then wake the thread instead)."""
        # A publisher blocked on a hung run directory must not hang the caller too.
        if self._lock.acquire(timeout=wait):
            try:
                self._publish(False)
            finally:
                self._lock.release()
        else:
            self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        last_write = 0.0
        while not self._stop.is_set():
            # Wake on a phase change, else once per interval; never write more than
            # about once an interval unless the phase changed.
            changed = self._wake.wait(self._interval)
            if self._stop.is_set():
                return
            now = time.perf_counter()
            if changed or now - last_write >= self._interval:
                self._wake.clear()
                with self._lock:
                    self._publish(True)
                last_write = now
