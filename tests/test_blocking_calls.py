"""The runner of file system calls: in order on one thread, never queued behind a hang."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from colossalai_exporter.node import disk
from colossalai_exporter.node.base import CollectorError
from colossalai_exporter.node.blocking import BlockingCalls
from colossalai_exporter.node.ranks import RanksCollector


def current_thread_name() -> str:
    return threading.current_thread().name


def test_prompt_calls_run_in_order_on_one_thread() -> None:
    calls = BlockingCalls("t-order")
    try:
        gate = threading.Event()
        order: list[int] = []
        first = calls.submit(gate.wait, 5)  # holds the runner until the rest are queued
        futures = [calls.submit(lambda i=i: (order.append(i), current_thread_name())[1])
                   for i in range(5)]
        gate.set()
        assert first.result(5) is True
        names = {future.result(5) for future in futures}
        assert order == [0, 1, 2, 3, 4]
        assert len(names) == 1
    finally:
        calls.shutdown()


def test_a_call_submitted_behind_a_slow_one_gets_a_thread_of_its_own() -> None:
    calls = BlockingCalls("t-slow", slow_after=0.05)
    release = threading.Event()
    running = threading.Event()

    def hang() -> bool:
        running.set()
        return release.wait(10)

    try:
        hung = calls.submit(hang)
        assert running.wait(10), "the runner never started the call"
        time.sleep(0.1)  # past slow_after since it started: slow now, maybe a hung mount
        start = time.monotonic()
        assert calls.submit(lambda: "done").result(2) == "done"
        assert time.monotonic() - start < 1
        assert not hung.done()
    finally:
        release.set()
        calls.shutdown()


def test_separate_frees_calls_queued_behind_a_hang_and_each_runs_once() -> None:
    calls = BlockingCalls("t-separate", slow_after=10)  # never judged slow: only separate helps
    release = threading.Event()
    runs: list[str] = []
    try:
        hung = calls.submit(release.wait, 10)
        queued = [calls.submit(runs.append, name) for name in ("a", "b")]
        time.sleep(0.1)
        assert not any(f.done() for f in queued)
        calls.separate(queued)
        for future in queued:
            future.result(2)
        assert sorted(runs) == ["a", "b"]
        release.set()
        hung.result(2)
        time.sleep(0.1)  # the first runner goes on through the queue: nothing left to run
        assert sorted(runs) == ["a", "b"]
    finally:
        release.set()
        calls.shutdown()


def test_errors_come_back_and_shutdown_cancels_what_has_not_started() -> None:
    calls = BlockingCalls("t-errors", slow_after=10)
    release = threading.Event()
    try:
        with pytest.raises(ValueError, match="invalid literal"):
            calls.submit(int, "x").result(2)
        calls.submit(release.wait, 10)
        waiting = calls.submit(lambda: "never")
        time.sleep(0.05)
        calls.shutdown()
        assert waiting.cancelled()
    finally:
        release.set()


# The collectors' deadline in the hang tests below: one a loaded 2-core machine meets
# (the call queued behind the hang gets its thread at half of it, and must return within
# the other half), as in test_node_agent's hung path test.
TIMEOUT = 3.0


def test_a_hung_disk_check_does_not_hold_up_the_ranks_read_behind_it(
        tmp_path: Path, hung_disk_path: threading.Event) -> None:
    """Disk checks and the run directory's read share the agent's runner; a hang in
    one must cost the other at most half its deadline, never the whole scrape."""
    calls = BlockingCalls("t-shared", slow_after=10)  # queue strictly behind the hang
    disks = disk.DiskCollector([disk.WatchedPath("hung", "/")], timeout=TIMEOUT, calls=calls)
    ranks = RanksCollector(tmp_path, timeout=TIMEOUT, calls=calls)
    try:
        start = time.monotonic()
        disk_pending = disks.begin(start + 5)
        ranks_pending = ranks.begin(start + 5)
        families = {f.name: f for f in ranks.collect(start + 5, ranks_pending)}
        assert time.monotonic() - start < TIMEOUT
        assert "colossalai_rank_up" in families  # read in time: no ranks yet, no failure
        failure = {f.name: f for f in disks.collect(start + 5, disk_pending)}[
            "colossalai_disk_path_failure"]
        assert [s.labels["reason"] for s in failure.samples] == ["timeout"]
    finally:
        hung_disk_path.set()
        calls.shutdown()


def test_a_hung_run_directory_does_not_hold_up_the_disk_checks_behind_it(
        tmp_path: Path) -> None:
    fifo = tmp_path / "rank-0.json"
    os.mkfifo(fifo)  # open() blocks until a writer comes, as on a hung mount
    calls = BlockingCalls("t-shared2", slow_after=10)
    ranks = RanksCollector(tmp_path, timeout=TIMEOUT, calls=calls)
    disks = disk.DiskCollector([disk.WatchedPath("ok", str(tmp_path))], timeout=TIMEOUT,
                               calls=calls)
    try:
        start = time.monotonic()
        ranks_pending = ranks.begin(start + 5)
        disk_pending = disks.begin(start + 5)
        ok = {f.name: f for f in disks.collect(start + 5, disk_pending)}[
            "colossalai_disk_path_ok"]
        assert [s.value for s in ok.samples] == [1.0]
        assert time.monotonic() - start < TIMEOUT
        with pytest.raises(CollectorError) as info:
            ranks.collect(start + 5, ranks_pending)
        assert info.value.reason == "timeout"
    finally:
        with open(fifo, "w") as writer:  # let the stuck open() return
            writer.write("{}")
        calls.shutdown()


def test_calls_submitted_in_a_batch_start_together_on_one_thread() -> None:
    calls = BlockingCalls("t-batch")
    try:
        with calls.batch():
            first = calls.submit(current_thread_name)
            time.sleep(0.05)  # unbatched, a thread would have run it by now and gone idle
            assert not first.done()
            second = calls.submit(current_thread_name)
        assert first.result(2) == second.result(2)
        assert len([t for t in threading.enumerate() if t.name.startswith("t-batch-")]) == 1
    finally:
        calls.shutdown()
