"""The group committer against a real SQLite store, and when delivery workers are woken.

What matters about the committer: requests that are ready together share one
commit and keep their order; a slow or hung disk never stalls the event loop
for more than ``inline_wait`` (the bridge must keep answering /health); a
failure reaches every request of the group as a StoreError (a 503).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from bridge_payloads import alert, body
from colossalai_exporter.bridge import workers
from colossalai_exporter.bridge.committer import GroupCommitter
from colossalai_exporter.bridge.config import RetryPolicy, validate
from colossalai_exporter.bridge.metrics import BridgeStats
from colossalai_exporter.bridge.store import (
    Enqueue,
    IngestItem,
    IngestResult,
    Store,
    StoreError,
)
from colossalai_exporter.bridge.workers import TargetWorker
from conftest import loop_gaps, wait_until


def _item(n: int) -> IngestItem:
    return IngestItem(f'{{"n": {n}}}'.encode(), (Enqueue("hook", "webhook"),), (), float(n))


class _Wakes:
    def __init__(self) -> None:
        self.count = 0

    def wake(self) -> None:
        self.count += 1


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    store = Store(tmp_path / "state")
    yield store
    store.close()


def test_requests_ready_together_share_one_commit_in_order(store: Store) -> None:
    wakes = _Wakes()
    committer = GroupCommitter(store, {"hook": wakes})
    committer.start()

    async def main() -> list[IngestResult]:
        return await asyncio.gather(*(committer.ingest(_item(n)) for n in range(20)))

    try:
        results = asyncio.run(main())
    finally:
        committer.stop()
    assert committer.batches == 1 and committer.items == 20
    assert [r.notification_id for r in results] == list(range(1, 21))
    assert all(r.queued == ("hook",) for r in results)
    assert wakes.count == 1  # once per group, not per request
    assert store.queue_stats()["hook"].depth == 20


def test_requests_arriving_over_a_few_turns_join_the_same_group(store: Store) -> None:
    """Requests whose bytes arrive while earlier ones are parsed join their group."""
    committer = GroupCommitter(store)
    committer.start()

    async def late(n: int, turns: int) -> IngestResult:
        for _ in range(turns):
            await asyncio.sleep(0)  # a request parsed a loop turn later
        return await committer.ingest(_item(n))

    async def main() -> list[IngestResult]:
        return await asyncio.gather(*(late(n, n % 3) for n in range(9)))

    try:
        results = asyncio.run(main())
    finally:
        committer.stop()
    assert committer.batches == 1
    assert len({r.notification_id for r in results}) == 9


def test_a_slow_disk_does_not_stall_the_event_loop(store: Store) -> None:
    """A commit that takes 0.6 s holds the loop for inline_wait (0.05 s) at most, once;
    the requests behind it are queued without any wait and all are answered in order."""
    real = store.ingest_many
    release = threading.Event()
    calls: list[int] = []

    def slow_first(items: Sequence[IngestItem]) -> list[IngestResult | StoreError]:
        calls.append(len(items))
        if len(calls) == 1:
            release.wait(0.6)  # a disk that takes its time over one fsync
        return real(items)

    store.ingest_many = slow_first  # type: ignore[method-assign]
    committer = GroupCommitter(store, inline_wait=0.05)
    committer.start()

    async def main() -> tuple[list[IngestResult], float]:
        async with loop_gaps(0.01) as gaps:
            await asyncio.sleep(0.05)
            first = asyncio.gather(*(committer.ingest(_item(n)) for n in range(3)))
            await asyncio.sleep(0.1)  # the first group's commit is still running
            second = asyncio.gather(*(committer.ingest(_item(n)) for n in range(3, 6)))
            results = [*await first, *await second]
        return results, max(gaps)

    try:
        results, worst_gap = asyncio.run(main())
    finally:
        committer.stop()
    assert worst_gap < 0.3, f"the event loop stalled for {worst_gap:.3f}s"
    assert calls == [3, 3]
    assert committer.handed_back == 2
    assert [r.notification_id for r in results] == [1, 2, 3, 4, 5, 6]


def test_a_failed_commit_reaches_every_request_of_the_group(store: Store) -> None:
    def broken(items: Sequence[IngestItem]) -> list[IngestResult | StoreError]:
        raise RuntimeError("a bug in the store")

    store.ingest_many = broken  # type: ignore[method-assign]
    committer = GroupCommitter(store)
    committer.start()

    async def main() -> list[BaseException | IngestResult]:
        return await asyncio.gather(*(committer.ingest(_item(n)) for n in range(4)),
                                    return_exceptions=True)

    try:
        outcomes = asyncio.run(main())
    finally:
        committer.stop()
    assert all(isinstance(o, StoreError) and "internal error" in str(o) for o in outcomes)


def test_after_stop_requests_are_refused(store: Store) -> None:
    committer = GroupCommitter(store)
    committer.start()
    committer.stop()
    with pytest.raises(StoreError, match="shutting down"):
        asyncio.run(committer.ingest(_item(1)))


def _webhook_worker(store: Store, url: str) -> TargetWorker:
    config, problems = validate({"state_dir": str(store.path.parent), "targets": [
        {"name": "hook", "type": "webhook", "url": url, "timeout": "2s"}],
        "delivery": {"initial_backoff": "1h", "max_backoff": "1h"}})
    assert problems == [] and config is not None
    return TargetWorker(config.targets[0], store, RetryPolicy(initial_backoff=3600,
                                                           max_backoff=3600), BridgeStats())


def test_an_idle_worker_is_woken_at_once(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    from fake_vigilmon import fake_vigilmon

    # An idle poll far longer than any delivery on a loaded machine: only the wake can
    # deliver within the bound below.
    monkeypatch.setattr(workers, "IDLE_POLL_SECONDS", 60.0)
    empty = threading.Event()
    real = store.next_delivery

    def watched(target: str):  # type: ignore[no-untyped-def]
        delivery = real(target)
        if delivery is None:
            empty.set()
        return delivery

    store.next_delivery = watched  # type: ignore[method-assign]
    with fake_vigilmon() as vigilmon:
        worker = _webhook_worker(store, vigilmon.url + "/hook")
        worker.start()
        try:
            # The worker found an empty outbox and waits for its poll.
            assert empty.wait(30), "the worker never looked at the outbox"
            store.ingest(body(alert("TrainingStalled")), [Enqueue("hook", "webhook")])
            started = time.monotonic()
            worker.wake()
            vigilmon.wait_for("/hook", 1, timeout=30)
            took = time.monotonic() - started
        finally:
            worker.stop()
            worker.join(5)
    # The idle poll is 60 s: a wake that was ignored would show as about that.
    assert took < 30


def test_a_webhook_worker_waiting_for_a_retry_is_not_woken(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """New deliveries queue behind the one waiting for its retry, so waking the
    worker for them would only cost an outbox query per group commit."""
    import socket

    with socket.socket() as sock:  # a port that refuses: the first attempt fails
        sock.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{sock.getsockname()[1]}/hook"
    store.ingest(body(alert("TrainingStalled")), [Enqueue("hook", "webhook")])
    worker = _webhook_worker(store, refused)
    queries: list[str] = []
    real = store.next_delivery

    def counted(target: str):  # type: ignore[no-untyped-def]
        queries.append(target)
        return real(target)

    store.next_delivery = counted  # type: ignore[method-assign]
    # No idle poll within the test: every query the worker makes is one a wake caused.
    monkeypatch.setattr(workers, "IDLE_POLL_SECONDS", 3600.0)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while (delivery := real("hook")) is None or delivery.attempts == 0:
            assert time.monotonic() < deadline, "the first attempt was never made"
            time.sleep(0.02)
        # The worker's second query found that delivery waiting for its retry (and the
        # worker no longer idle): from here it waits for the retry, an hour away.
        wait_until(lambda: len(queries) >= 2 and not worker._idle, 30,
                   what="the worker to wait for the retry")
        before = len(queries)
        for _ in range(50):
            store.ingest(body(alert("TrainingStalled")), [Enqueue("hook", "webhook")])
            worker.wake()
            time.sleep(0.002)
        after = len(queries)
    finally:
        worker.stop()
        worker.join(5)
    # 50 wakes add nothing.
    assert after - before == 0, f"the worker queried the outbox {after - before} times"
