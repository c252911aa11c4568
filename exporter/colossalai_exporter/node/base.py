"""What every node collector is: a name, its failure reasons, and a bounded collect().

The agent runs each collector with a deadline, times it, and turns a
:class:`CollectorError` into ``colossalai_exporter_collector_up 0`` with the
error's reason — the collector's series are dropped rather than served stale,
except for the ``families`` the error carries (fresh data that is still true,
such as the GPUs that are visible when fewer than expected are).

Collectors whose work can block for long (NVML, file systems, connects) hand it
to a worker process or thread in ``begin`` and return a :class:`Pending`; the
agent's event loop waits for it without blocking (:meth:`Pending.watch`) and
calls ``collect`` once it is :meth:`Pending.ready`, so a scrape normally runs
entirely on the loop, with no hand-over to a scrape thread. What is not ready
soon is finished by ``collect`` in a thread, where it may wait up to its
deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from prometheus_client.core import Metric as MetricFamily


class CollectorError(Exception):
    """A collector run failed for ``reason`` (one of the collector's ``reasons``)."""

    def __init__(self, reason: str, message: str,
                 families: Sequence[MetricFamily] = ()) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.families = list(families)


class Pending(Protocol):
    """Work a collector's ``begin`` handed to another thread or process."""

    def ready(self) -> bool:
        """True once ``collect`` can finish without waiting for this work. Never blocks."""
        ...

    def watch(self, loop: asyncio.AbstractEventLoop,
              wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``wake`` on ``loop`` when :meth:`ready` may have turned true (spurious
        calls are allowed); returns the function that stops watching."""
        ...


class NodeCollector(Protocol):
    #: the collector's name in ``--no-collector.NAME`` and in the ``collector`` label
    name: str
    #: every reason its CollectorError may carry; pre-created as zero counters
    reasons: tuple[str, ...]

    def collect(self, deadline: float) -> list[MetricFamily]:
        """Fresh families, returning before ``deadline`` (``time.monotonic()``) or raising.

        A collector without ``begin`` is run on the agent's event loop: it must
        not block (reading ``/proc`` is fine; a file system that may hang is not).
        """
        ...

    def close(self) -> None:
        """Release workers and handles when the agent stops."""
        ...


# Optional on a collector, read by the agent's /health (getattr with a default):
#   problems() -> list[dict[str, str]]  what is wrong although the collector works
#                                       (a watched path that is missing or hung)
# A collector whose failure would not be wrong on some node does not fail there
# (the gpu collector without a driver on a node without GPUs serves zero GPUs):
# collector_up, the alerts and /health then agree.


class BegunCollector(NodeCollector, Protocol):
    """A collector that starts its work early (``begin``) and waits for it in ``collect``.

    The agent calls ``begin`` before any collector's ``collect``, so that the work it
    hands over runs while the other collectors do theirs. ``begin`` must not block
    and must not raise; ``collect`` reports any failure.
    """

    def begin(self, deadline: float) -> Pending | None:
        """Start this scrape's work; None when there is nothing to wait for."""
        ...

    def collect(self, deadline: float,
                pending: Pending | None = None) -> list[MetricFamily]:
        """Families from the work ``pending`` stands for (begun now when None);
        waits for it at most until ``deadline``."""
        ...


class _Ready:
    """Pending work that is already done: ``collect`` has all it needs."""

    def ready(self) -> bool:
        return True

    def watch(self, loop: asyncio.AbstractEventLoop,
              wake: Callable[[], None]) -> Callable[[], None]:
        return _nothing


def _nothing() -> None:
    pass


#: What ``begin`` returns when there is nothing to wait for.
READY: Pending = _Ready()


class FuturePending:
    """Pending work that a thread pool is doing: ready once ``future`` is done."""

    future: Future[Any]

    def ready(self) -> bool:
        return self.future.done()

    def watch(self, loop: asyncio.AbstractEventLoop,
              wake: Callable[[], None]) -> Callable[[], None]:
        waker = LoopWaker(loop, wake)
        self.future.add_done_callback(waker)
        return waker.stop


class LoopWaker:
    """A callable that any thread may call to run ``wake`` on ``loop``; inert once stopped.

    For pending work done by threads: their completion callbacks run in the
    thread that finished, and the loop must only be touched through
    ``call_soon_threadsafe``.
    """

    __slots__ = ("_loop", "_stopped", "_wake")

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        self._loop = loop
        self._wake = wake
        self._stopped = False

    def __call__(self, *_: object) -> None:
        if not self._stopped:
            # A loop closed meanwhile (the agent stopping) has nobody left to wake.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        if not self._stopped:
            self._wake()

    def stop(self) -> None:
        self._stopped = True
