"""Group commit: one writer thread stores accepted notifications in shared transactions.

Every 200 the bridge answers waits for an fsync of the SQLite WAL. Done one
request at a time, that fsync (0.5-1 ms on an ordinary disk) and the lock
around it bound the rate and make concurrent requests queue on the lock, each
waiting for its own sync. Here requests hand their notification to one writer
thread and wait; the writer takes everything that is waiting, stores it in one
transaction and one commit (:meth:`Store.ingest_many`), then answers all of
them. While it syncs, the next requests gather, so batches grow with the load
and a lone request is not delayed by any timer. Durability is unchanged: a
request's future is resolved only after the commit that holds it has returned
(``synchronous=FULL``: the WAL is on disk), and with the error if it failed.

The writer also wakes each target's delivery worker once per batch instead of
once per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from colossalai_exporter.bridge.store import IngestItem, IngestResult, Store, StoreError

log = logging.getLogger(__name__)
MAX_BATCH = 256  # bounds one transaction's size (and so its commit's latency)


class Wakeable(Protocol):
    """What the committer wakes after a commit: a target's delivery worker."""

    def wake(self) -> None: ...


@dataclass
class _Pending:
    item: IngestItem
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[IngestResult]


@dataclass
class _Stop:
    done: threading.Event = field(default_factory=threading.Event)


class GroupCommitter:
    """Stores notifications for asyncio callers, batching whatever waits into one commit."""

    def __init__(self, store: Store, workers: Mapping[str, Wakeable] | None = None,
                 max_batch: int = MAX_BATCH) -> None:
        self._store = store
        self._workers = dict(workers or {})
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[_Pending | _Stop] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bridge-commit", daemon=True)
        self._stopped = False
        self.batches = 0  # for tests and the benchmark: how well requests were grouped
        self.items = 0

    def start(self) -> None:
        self._thread.start()

    async def ingest(self, item: IngestItem) -> IngestResult:
        """Store ``item``; returns once it is committed, raises StoreError if it was not."""
        if self._stopped:
            raise StoreError("the bridge is shutting down")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[IngestResult] = loop.create_future()
        self._queue.put(_Pending(item, loop, future))
        return await future

    def stop(self, timeout: float = 10.0) -> None:
        """Store what is queued, then end the writer (after the HTTP server has stopped)."""
        if not self._thread.is_alive():
            return
        self._stopped = True
        marker = _Stop()
        self._queue.put(marker)
        marker.done.wait(timeout)
        self._thread.join(timeout)
        log.info("group commit stopped", extra={"batches": self.batches, "items": self.items})

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            # Anything queued after the stop marker (a request that raced with stop())
            # is refused rather than left waiting: it was not stored, so a 503.
            late: list[_Pending] = []
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Pending):
                    late.append(item)
            if late:
                self._answer(late, [StoreError("the bridge is shutting down")] * len(late))

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if isinstance(first, _Stop):
                first.done.set()
                return
            batch = [first]
            stop: _Stop | None = None
            while len(batch) < self._max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(more, _Stop):
                    stop = more
                    break
                batch.append(more)
            self._commit(batch)
            if stop is not None:
                stop.done.set()
                return

    def _commit(self, batch: list[_Pending]) -> None:
        try:
            results: list[IngestResult | StoreError] = self._store.ingest_many(
                [p.item for p in batch])
        except Exception as exc:  # a bug must not leave requests waiting forever
            log.exception("group commit failed")
            results = [StoreError(f"internal error: {type(exc).__name__}")] * len(batch)
        self.batches += 1
        self.items += len(batch)
        self._answer(batch, results)

    def _answer(self, batch: list[_Pending], results: list[IngestResult | StoreError]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[IngestResult],
                                                             IngestResult | StoreError]]] = {}
        targets: set[str] = set()
        for pending, result in zip(batch, results, strict=True):
            by_loop.setdefault(pending.loop, []).append((pending.future, result))
            if isinstance(result, IngestResult):
                targets.update(result.queued)
        # One hop per event loop for the whole batch, not one per request.
        for loop, answers in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(_resolve, answers)
        for target in targets:
            worker = self._workers.get(target)
            if worker is not None:
                worker.wake()


def _resolve(answers: list[tuple[asyncio.Future[IngestResult], IngestResult | StoreError]],
             ) -> None:
    for future, result in answers:
        if future.done():  # the request was cancelled (client gone, server stopping)
            continue
        if isinstance(result, StoreError):
            future.set_exception(result)
        else:
            future.set_result(result)

