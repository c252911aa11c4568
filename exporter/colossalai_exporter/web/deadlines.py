"""Deadlines for reading request bodies: one timer per event loop, not one per request.

``asyncio.timeout`` around every body read arms and cancels a timer for each
request: about 5 µs, a sixth of what the whole HTTP stack costs per request on
the 2-core CI VM, on the bridge's ingest route where almost every body has
arrived with its head and the read returns at once. Here a read registers its
task and deadline in a dict, and a sweep that runs every :data:`tick` seconds,
only while some read is registered, cancels the tasks past their deadline.
A read is therefore cut off between ``seconds`` and ``seconds + tick`` after it
began, which is all a defence against slow clients needs.
"""

from __future__ import annotations

import asyncio
import sys


class ReadDeadlines:
    """Cancels body reads that run past ``seconds``; see :meth:`start` and :meth:`finish`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        # Sweep often enough that a deadline is late by at most a tenth of itself
        # (and at most a second), and no more often than 20 times a second.
        self.tick = min(1.0, max(0.05, seconds / 10))
        self._reading: dict[asyncio.AbstractEventLoop, dict[asyncio.Task[object], float]] = {}
        self._expired: set[asyncio.Task[object]] = set()

    def start(self, task: asyncio.Task[object], loop: asyncio.AbstractEventLoop) -> None:
        """``task`` begins a read; call :meth:`finish` when it ends, however it ends."""
        reading = self._reading.get(loop)
        if reading is None:
            reading = self._reading[loop] = {}
            loop.call_later(self.tick, self._sweep, loop)
        reading[task] = loop.time() + self.seconds

    def finish(self, task: asyncio.Task[object], loop: asyncio.AbstractEventLoop) -> bool:
        """End ``task``'s read; True if its deadline cancelled it (the read then raised
        CancelledError, which the caller turns into its timeout answer)."""
        reading = self._reading.get(loop)
        if reading is not None:
            reading.pop(task, None)
        if task not in self._expired:
            return False
        self._expired.discard(task)
        if sys.version_info >= (3, 11):
            task.uncancel()  # our cancel, handled: the task is not being cancelled
        return True

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        reading = self._reading.get(loop)
        if not reading:
            # Nothing to watch: stop until the next read starts a sweep again.
            self._reading.pop(loop, None)
            return
        now = loop.time()
        for task, deadline in list(reading.items()):
            if deadline <= now:
                del reading[task]
                self._expired.add(task)
                task.cancel()
        loop.call_later(self.tick, self._sweep, loop)
