"""The agent's scrape on the event loop: no thread when all is well, never a blocked loop.

Each test runs ``Agent.collect_async`` on a real event loop beside a ticker
coroutine that records the longest gap between its ticks: a collector that
blocked the loop (a hung mount, a stuck NVML call, a dropped SYN) would show
as a gap as long as the hang.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from colossalai_exporter.node import agent as agent_module
from colossalai_exporter.node import disk
from colossalai_exporter.node.agent import LOOP_WAIT_SECONDS, Agent
from colossalai_exporter.node.blocking import BlockingCalls
from colossalai_exporter.node.gpu import GpuCollector
from colossalai_exporter.node.host import HostCollector
from colossalai_exporter.node.ranks import RanksCollector
from colossalai_exporter.node.rendezvous import Endpoint, RendezvousCollector
from conftest import loop_gaps, syn_dropping_port, wait_until
from gpu_helpers import Scenario, gpu, use_fake_nvml

# How long each hang (or slow call) simulated here holds its collector: the gap a
# blocked loop would show. Long, so that LOOP_GAP_LIMIT can be generous.
HANG = 3.0
# The longest a healthy event loop may go without running the ticker: what a loaded
# 2-core CI machine's scheduling allows, and well under HANG, so a loop that waited
# for a hang still fails.
LOOP_GAP_LIMIT = 1.0


@pytest.fixture
def patient_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop waits up to 5 s (not 0.1 s) for begun work before handing it to a
    thread: a healthy collector's answer (from the NVML worker process, the runner's
    thread, the resolver's pool) comes within that on a loaded machine, so a scrape
    thread used anyway says the healthy path does not stay on the loop."""
    monkeypatch.setattr(agent_module, "LOOP_WAIT_SECONDS", 5.0)


def scrape_beside_a_ticker(agent: Agent, executor_calls: list[Any] | None = None) -> tuple[
        list[Any], float, float]:
    """(families, seconds the scrape took, longest gap between the ticker's ticks)."""

    async def main() -> tuple[list[Any], float, float]:
        loop = asyncio.get_running_loop()
        if executor_calls is not None:
            real = loop.run_in_executor

            def counting(*args: Any) -> Any:
                executor_calls.append(args)
                return real(*args)

            loop.run_in_executor = counting  # type: ignore[method-assign]
        async with loop_gaps(0.005) as gaps:
            await asyncio.sleep(0.02)
            start = time.monotonic()
            families = await agent.collect_async()
            took = time.monotonic() - start
        return families, took, max(gaps)

    return asyncio.run(main())


def by_name(families: list[Any]) -> dict[str, Any]:
    return {f.name: f for f in families}


@pytest.fixture
def listener() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield int(sock.getsockname()[1])


def test_a_healthy_scrape_runs_on_the_loop_without_a_thread(
        tmp_path: Path, listener: int, monkeypatch: pytest.MonkeyPatch,
        patient_loop: None) -> None:
    scenario = Scenario(tmp_path / "nvml.json").write(gpus=[gpu(0), gpu(1)])
    use_fake_nvml(monkeypatch, scenario.path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fs_calls = BlockingCalls("t-fs")
    agent = Agent([GpuCollector(timeout=5), HostCollector(),
                   disk.DiskCollector([disk.WatchedPath("ckpt", str(tmp_path)),
                                       disk.WatchedPath("root", "/")], calls=fs_calls),
                   RendezvousCollector([Endpoint("127.0.0.1", listener)]),
                   RanksCollector(run_dir, calls=fs_calls)])
    try:
        wait_until(lambda: list(agent.collect()) and agent.states["gpu"].up, 30,
                   what="the NVML worker to answer")
        calls: list[Any] = []
        families, _, gap = scrape_beside_a_ticker(agent, calls)
    finally:
        agent.close()
    assert calls == []  # nothing was handed to a scrape thread
    assert gap < LOOP_GAP_LIMIT
    assert all(state.up for state in agent.states.values()), agent.states
    fams = by_name(families)
    assert [s.value for s in fams["colossalai_gpu_devices"].samples] == [2]
    assert [s.value for s in fams["colossalai_nccl_up"].samples] == [1.0]
    assert [s.value for s in fams["colossalai_disk_path_ok"].samples] == [1.0, 1.0]
    # Families keep the collectors' order, then the agent's own.
    names = [f.name for f in families]
    firsts = ["colossalai_gpu_devices", "colossalai_host_memory_total_bytes",
              "colossalai_disk_free_bytes", "colossalai_nccl_up", "colossalai_rank_up",
              "colossalai_exporter_collector_up"]
    assert sorted(firsts, key=names.index) == firsts


def test_a_hung_mount_is_finished_in_a_thread_and_never_blocks_the_loop(
        hung_disk_path: threading.Event) -> None:
    agent = Agent([HostCollector(),
                   disk.DiskCollector([disk.WatchedPath("hung", "/"), disk.WatchedPath("ok", "/")],
                                      timeout=HANG)])
    try:
        calls: list[Any] = []
        families, took, gap = scrape_beside_a_ticker(agent, calls)
    finally:
        hung_disk_path.set()
        agent.close()
    assert len(calls) == 1  # what was not ready went to a thread, once
    assert gap < LOOP_GAP_LIMIT
    assert LOOP_WAIT_SECONDS < took < HANG + 1.5
    failure = by_name(families)["colossalai_disk_path_failure"]
    assert {s.labels["name"]: s.labels["reason"] for s in failure.samples} == {"hung": "timeout"}
    ok = by_name(families)["colossalai_disk_path_ok"]
    assert {s.labels["name"]: s.value for s in ok.samples} == {"hung": 0.0, "ok": 1.0}
    assert agent.states["host"].up


def test_a_hung_nvml_call_times_out_without_blocking_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = Scenario(tmp_path / "nvml.json").write(gpus=[gpu(0)])
    use_fake_nvml(monkeypatch, scenario.path)
    collector = GpuCollector(timeout=HANG)
    agent = Agent([collector, HostCollector()])
    try:
        # The worker is a fresh interpreter: wait (30 s) until it has started and answered.
        wait_until(lambda: list(agent.collect()) and agent.states["gpu"].up, 30,
                   what="the NVML worker to answer")
        scenario.update(hang="nvmlDeviceGetMemoryInfo")
        _, took, gap = scrape_beside_a_ticker(agent)
    finally:
        agent.close()
    assert gap < LOOP_GAP_LIMIT
    assert took < HANG + LOOP_WAIT_SECONDS + 1.5
    assert agent.states["gpu"].reason == "timeout"
    assert agent.states["host"].up


def test_a_dropped_syn_is_a_timeout_without_blocking_the_loop() -> None:
    """A SYN that is dropped, as a firewall drops packets: the non-blocking connect
    stays in progress until its budget ends."""
    with syn_dropping_port() as port:
        agent = Agent([RendezvousCollector([Endpoint("127.0.0.1", port)], timeout=HANG)])
        try:
            families, took, gap = scrape_beside_a_ticker(agent)
        finally:
            agent.close()
    assert gap < LOOP_GAP_LIMIT
    assert HANG - 0.05 < took < HANG + 1.5
    failure = by_name(families)["colossalai_nccl_failure"]
    assert [s.labels["reason"] for s in failure.samples] == ["timeout"]


def test_a_refused_and_an_accepted_connect_finish_on_the_loop(listener: int,
                                                              patient_loop: None) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused = closed.getsockname()[1]
    agent = Agent([RendezvousCollector([Endpoint("127.0.0.1", listener),
                                        Endpoint("127.0.0.1", refused),
                                        Endpoint("localhost", listener)])])
    try:
        calls: list[Any] = []
        families, _, _ = scrape_beside_a_ticker(agent, calls)
    finally:
        agent.close()
    up = {s.labels["target"]: s.value for s in by_name(families)["colossalai_nccl_up"].samples}
    assert up == {f"127.0.0.1:{listener}": 1.0, f"127.0.0.1:{refused}": 0.0,
                  f"localhost:{listener}": 1.0}
    failure = by_name(families)["colossalai_nccl_failure"]
    assert [s.labels["reason"] for s in failure.samples] == ["refused"]
    assert calls == []  # the name was resolved in the collector's pool, not a scrape thread


def test_a_scrape_thread_and_the_loop_share_one_nvml_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scrape from another thread (the start-up report, a registry) that has asked the
    worker does not make the loop's scrape wait for its own round trip."""
    scenario = Scenario(tmp_path / "nvml.json").write(gpus=[gpu(0)])
    use_fake_nvml(monkeypatch, scenario.path)
    collector = GpuCollector(timeout=5)
    agent = Agent([collector])
    try:
        wait_until(lambda: list(agent.collect()) and agent.states["gpu"].up, 30,
                   what="the NVML worker to answer")
        scenario.update(slow={"nvmlDeviceGetMemoryInfo": HANG})
        worker = collector._worker
        assert worker is not None
        asked = worker._next_id
        thread = threading.Thread(target=lambda: list(agent.collect()))
        thread.start()
        wait_until(lambda: worker._next_id == asked + 1, 5, what="the thread's request")
        _, took, gap = scrape_beside_a_ticker(agent)
        thread.join(5)
    finally:
        agent.close()
    assert worker._next_id == asked + 1  # one request served both
    assert took < HANG + 1.0  # its own round trip would add another HANG
    assert gap < LOOP_GAP_LIMIT
    assert agent.states["gpu"].up
