"""The node collectors' thread pool: results, errors, reuse, limits and shutdown."""

from __future__ import annotations

import threading
import time

import pytest

from colossalai_exporter.node.daemon_pool import DaemonPool


def pool_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"{name}-")]


def test_results_and_exceptions_come_back_through_the_future() -> None:
    pool = DaemonPool(2, "t-results")
    try:
        assert pool.submit(lambda a, b: a + b, 2, 3).result(5) == 5
        failing = pool.submit(int, "not a number")
        with pytest.raises(ValueError, match="invalid literal"):
            failing.result(5)
        assert all(t.daemon for t in pool_threads("t-results"))
    finally:
        pool.shutdown()


def test_an_idle_thread_is_reused_and_the_limit_holds() -> None:
    pool = DaemonPool(2, "t-limit")
    try:
        for _ in range(20):  # one after another: one thread does them all
            pool.submit(time.sleep, 0).result(5)
        assert len(pool_threads("t-limit")) == 1
        gate = threading.Event()
        blocked = [pool.submit(gate.wait, 10) for _ in range(2)]
        queued = pool.submit(lambda: "ran later")
        time.sleep(0.2)
        assert len(pool_threads("t-limit")) == 2 and not queued.done()
        gate.set()
        assert queued.result(5) == "ran later"
        assert all(f.result(5) for f in blocked)
    finally:
        pool.shutdown()


def test_shutdown_cancels_what_has_not_started_and_refuses_more() -> None:
    pool = DaemonPool(1, "t-shutdown")
    gate = threading.Event()
    running = pool.submit(gate.wait, 10)
    waiting = pool.submit(lambda: "never")
    time.sleep(0.1)
    pool.shutdown()  # does not wait for the running task
    assert waiting.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)
    gate.set()
    assert running.result(5) is True
    threads = pool_threads("t-shutdown")
    for thread in threads:
        thread.join(5)
    assert not any(t.is_alive() for t in threads)
