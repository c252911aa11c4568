"""Group commit: accepted notifications are stored in shared transactions.

Every 200 the bridge answers waits for an fsync of the SQLite WAL (about a
millisecond on an ordinary disk). Done one request at a time, that fsync and
the lock around it bound the rate. Here requests that reach the commit step
are gathered into a group, the group is stored in one transaction and one
commit (:meth:`Store.ingest_many`) by a writer thread, and all of it is
answered together.

When a group is committed decides the rate (bench/RESULTS.md):

* The group closes once a turn of the event loop has added nothing to it: the
  requests whose bytes arrived meanwhile are parsed and join first, so under
  load a group holds about one request per busy connection and the fsync is
  shared by all of them. A lone request is delayed by one idle turn of the
  loop, microseconds, never by a timer.
* The event loop then waits for the commit, with the GIL released, for up to
  ``inline_wait`` seconds, and answers the group itself. Letting the loop go on
  parsing while the writer commits looks better and is slower: the threads
  then fight over the GIL, the writer gets it back between its SQLite calls
  only when CPython's 5 ms switch interval forces a hand-over, and groups
  shrink to one or two requests, each paying a whole fsync.
* When the disk is slow or hung, the loop stops waiting after ``inline_wait``;
  the writer answers that group through ``call_soon_threadsafe`` when its
  commit returns, and while it is still busy later groups are handed over
  without any wait, so /health and /metrics keep being served. (Committing on
  the loop thread itself would save the hand-over, but a hung disk would then
  stop every connection and SIGTERM could not finish in-flight requests.)

Durability is the same on every path: a request's future is resolved only
after the commit that holds it has returned (``synchronous=FULL``: the WAL is
on disk), and with the error if it failed.

The writer also wakes each target's delivery worker once per group instead of
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
# How long the event loop waits for a group's commit before it lets the writer
# answer later: some tens of ordinary commits, short enough that a hung disk
# delays /health by no more than this once.
INLINE_WAIT_SECONDS = 0.05

Outcome = IngestResult | StoreError


class Wakeable(Protocol):
    """What the committer wakes after a commit: a target's delivery worker."""

    def wake(self) -> None: ...


@dataclass
class _Group:
    """Notifications gathered in one turn of one event loop, committed together."""

    loop: asyncio.AbstractEventLoop
    items: list[IngestItem] = field(default_factory=list)
    futures: list[asyncio.Future[IngestResult]] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    # Set by the loop when it stopped waiting: the writer then answers the group.
    handed_back: bool = False
    counted: int = 0  # items at the last flush attempt
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Stop:
    done: threading.Event = field(default_factory=threading.Event)


class GroupCommitter:
    """Stores notifications for asyncio callers, batching each loop turn into one commit."""

    def __init__(self, store: Store, workers: Mapping[str, Wakeable] | None = None,
                 max_batch: int = MAX_BATCH,
                 inline_wait: float = INLINE_WAIT_SECONDS) -> None:
        self._store = store
        self._workers = dict(workers or {})
        self._max_batch = max_batch
        self._inline_wait = inline_wait
        self._queue: queue.SimpleQueue[_Group | _Stop] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bridge-commit", daemon=True)
        self._gathering: dict[asyncio.AbstractEventLoop, _Group] = {}
        self._behind: _Group | None = None  # the last group the loop stopped waiting for
        self._stopped = False
        self.batches = 0  # for tests and the benchmark: how well requests were grouped
        self.items = 0
        self.handed_back = 0  # groups answered by the writer because the commit was slow

    def start(self) -> None:
        self._thread.start()

    async def ingest(self, item: IngestItem) -> IngestResult:
        """Store ``item``; returns once it is committed, raises StoreError if it was not."""
        if self._stopped:
            raise StoreError("the bridge is shutting down")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[IngestResult] = loop.create_future()
        group = self._gathering.get(loop)
        if group is None or len(group.items) >= self._max_batch:
            group = self._gathering[loop] = _Group(loop)
            loop.call_soon(self._flush, group)
        group.items.append(item)
        group.futures.append(future)
        return await future

    def _flush(self, group: _Group) -> None:
        """On the event loop: once a turn added nothing, hand ``group`` to the writer and wait."""
        if group.counted < len(group.items) < self._max_batch:
            # Another turn: requests whose bytes arrived while this one ran join first.
            group.counted = len(group.items)
            group.loop.call_soon(self._flush, group)
            return
        if self._gathering.get(group.loop) is group:
            del self._gathering[group.loop]
        behind = self._behind is not None and not self._behind.done.is_set()
        self._queue.put(group)
        if not behind:
            group.done.wait(self._inline_wait)
        with group.lock:
            if not group.done.is_set():
                group.handed_back = True
                self._behind = group
                self.handed_back += 1
                return
        _resolve(group)

    def stop(self, timeout: float = 10.0) -> None:
        """Store what is queued, then end the writer (after the HTTP server has stopped)."""
        if not self._thread.is_alive():
            return
        self._stopped = True
        marker = _Stop()
        self._queue.put(marker)
        marker.done.wait(timeout)
        self._thread.join(timeout)
        log.info("group commit stopped", extra={"batches": self.batches, "items": self.items,
                                                "handed_back": self.handed_back})

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            # Anything queued after the stop marker (a request that raced with stop())
            # is refused rather than left waiting: it was not stored, so a 503.
            while True:
                try:
                    late = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(late, _Group):
                    self._finish(late, [StoreError("the bridge is shutting down")]
                                 * len(late.items))

    def _loop(self) -> None:
        while True:
            group = self._queue.get()
            if isinstance(group, _Stop):
                group.done.set()
                return
            self._commit(group)

    def _commit(self, group: _Group) -> None:
        try:
            outcomes: list[Outcome] = self._store.ingest_many(group.items)
        except Exception as exc:  # a bug must not leave requests waiting forever
            log.exception("group commit failed")
            outcomes = [StoreError(f"internal error: {type(exc).__name__}")] * len(group.items)
        self.batches += 1
        self.items += len(group.items)
        self._finish(group, outcomes)
        targets = {t for o in outcomes if isinstance(o, IngestResult) for t in o.queued}
        for target in targets:
            worker = self._workers.get(target)
            if worker is not None:
                worker.wake()

    @staticmethod
    def _finish(group: _Group, outcomes: list[Outcome]) -> None:
        """Record the outcomes; answer the group here if its loop stopped waiting."""
        group.outcomes = outcomes
        with group.lock:
            group.done.set()
            answer_here = group.handed_back
        if answer_here:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                group.loop.call_soon_threadsafe(_resolve, group)


def _resolve(group: _Group) -> None:
    for future, outcome in zip(group.futures, group.outcomes, strict=True):
        if future.done():  # the request was cancelled (client gone, server stopping)
            continue
        if isinstance(outcome, StoreError):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
