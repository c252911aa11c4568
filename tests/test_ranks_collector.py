"""The node agent's ranks collector on real rank processes: alive, SIGSTOPped, SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric as MetricFamily

from colossalai_exporter.node.ranks import RanksCollector
from colossalai_exporter.rankstate.files import read_snapshot
from colossalai_exporter.rankstate.schema import ERROR_REASONS
from conftest import cli_env, require, require_binary, wait_until

# Budgets a loaded 2-core machine meets while the ranks are healthy: a rank that is
# not scheduled for a second or two must still count as stepping and up. The stale
# limit is min(STALE_AFTER, 2 publish intervals + 2 s): 5 s with a 1.5 s interval.
STEP_TIMEOUT = 5.0
PUBLISH_INTERVAL = 1.5
STALE_AFTER = 5.0

# A rank: a plain Python loop with the monitor (the snapshots are the same as under
# torchrun; the ColossalAI job in test_training_colossalai.py shows that).
RANK_SCRIPT = textwrap.dedent(f"""
    import os, sys, time
    from colossalai_exporter import TrainingMonitor
    monitor = TrainingMonitor(serve="none", run_dir=sys.argv[1], step_timeout={STEP_TIMEOUT},
                              publish_interval={PUBLISH_INTERVAL})
    while True:
        with monitor.step(samples=1) as step:
            time.sleep(0.01)
            step.loss = 0.5
""")


class Adapter:
    """Runs a node collector the way the agent does, for a prometheus_client registry."""

    def __init__(self, collector: RanksCollector) -> None:
        self.collector = collector

    def collect(self) -> list[MetricFamily]:
        return self.collector.collect(time.monotonic() + 5)


def start_rank(run_dir: Path, rank: int) -> subprocess.Popen[bytes]:
    env = cli_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    return subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(run_dir)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [start_rank(tmp_path, 0), start_rank(tmp_path, 1)]
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(10)


def test_ranks_seen_from_outside(tmp_path: Path, ranks: list[subprocess.Popen[bytes]]) -> None:
    registry = CollectorRegistry()
    collector = RanksCollector(tmp_path, stale_after=STALE_AFTER)
    registry.register(Adapter(collector))

    def value(name: str, rank: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"rank": rank, **labels})

    wait_until(lambda: all((value("colossalai_training_steps_total", r) or 0) >= 3
                           for r in ("0", "1")), timeout=20, what="both ranks stepping")
    for rank in ("0", "1"):
        assert value("colossalai_rank_up", rank) == 1
        assert value("colossalai_training_stalled", rank) == 0
        assert value("colossalai_training_phase", rank, phase="training") == 1
        assert value("colossalai_training_loss", rank) is None  # in-process only
        assert (value("colossalai_rank_snapshot_age_seconds", rank) or 99) < STALE_AFTER
    # What the nccl collector learns of the node's live ranks: pids, run, world size.
    assert sorted(collector.local_pids().values()) == [0, 1]
    run, world_size = collector.local_world() or ("?", 0)
    assert world_size == 2 and run, (run, world_size)

    # Frozen (SIGSTOP): the process exists, but its snapshot ages and the stall shows.
    frozen, killed = ranks
    os.kill(frozen.pid, signal.SIGSTOP)
    wait_until(lambda: value("colossalai_training_stalled", "0") == 1, timeout=30,
               what="stall judged from outside")
    assert value("colossalai_rank_process_stopped", "0") == 1
    wait_until(lambda: value("colossalai_rank_up", "0") == 0, timeout=30,
               what="stale snapshot: rank down")
    assert (value("colossalai_rank_snapshot_age_seconds", "0") or 0) > STALE_AFTER
    assert value("colossalai_rank_up", "1") == 1  # the other rank is unaffected

    # Killed (SIGKILL, as the kernel's OOM killer does): down at once, series kept.
    killed.kill()
    killed.wait(10)
    wait_until(lambda: value("colossalai_rank_up", "1") == 0, timeout=5, what="dead rank")
    assert value("colossalai_rank_process_stopped", "1") == 0
    assert (value("colossalai_training_steps_total", "1") or 0) >= 3

    os.kill(frozen.pid, signal.SIGCONT)
    wait_until(lambda: value("colossalai_rank_up", "0") == 1, timeout=30, what="thawed")


def test_two_runs_writing_one_run_directory_are_told(tmp_path: Path) -> None:
    """Two jobs on one node, both publishing into the same run directory (the default
    one): their rank 0s write the same file in turn. Counted as "shared" (an alert says
    so); a rank restarted in its place is a new writer, not a second run."""
    registry = CollectorRegistry()
    registry.register(Adapter(RanksCollector(tmp_path, stale_after=STALE_AFTER)))

    def shared() -> float:
        return registry.get_sample_value("colossalai_rank_snapshot_errors_total",
                                         {"reason": "shared"}) or 0.0

    def writer() -> int:
        return read_snapshot(tmp_path / "rank-0.json").pid

    def start(run: str) -> subprocess.Popen[bytes]:
        env = cli_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2",
                      COLOSSALAI_EXPORTER_RUN_ID=run)
        return subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(tmp_path)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    first = start("job-a")
    try:
        wait_until(lambda: (tmp_path / "rank-0.json").exists() and writer() == first.pid,
                   timeout=30, what="the first run's rank 0 publishing")
        assert shared() == 0
        first.kill()  # a restart: the next writer takes its place for good
        first.wait(10)
        restarted = start("job-a")
        try:
            wait_until(lambda: writer() == restarted.pid and shared() == 0, timeout=30,
                       what="the restarted rank's snapshot read")
            second = start("job-b")  # another job, in the same directory
            try:
                wait_until(lambda: shared() >= 1, timeout=60, interval=0.05,
                           what="the two runs' writers told apart")
            finally:
                second.kill()
                second.wait(10)
        finally:
            restarted.kill()
            restarted.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)


def test_missing_dir_and_garbage_files(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    collector = RanksCollector(tmp_path / "nothing-yet")
    registry.register(Adapter(collector))
    for reason in (*ERROR_REASONS, "shared"):  # pre-created at zero
        assert registry.get_sample_value("colossalai_rank_snapshot_errors_total",
                                         {"reason": reason}) == 0
    (tmp_path / "nothing-yet").mkdir()
    (tmp_path / "nothing-yet" / "rank-0.json").write_text("{half a file")
    assert registry.get_sample_value("colossalai_rank_snapshot_errors_total",
                                     {"reason": "malformed"}) == 1
    assert registry.get_sample_value("colossalai_rank_up", {"rank": "0"}) is None


def test_a_bad_snapshot_costs_only_its_rank(tmp_path: Path) -> None:
    """Issue 18: one rank-N.json missing a key hid every rank on the node."""
    from colossalai_exporter import TrainingMonitor

    TrainingMonitor(serve="none", run_dir=tmp_path, rank=1, start=False).close()
    good = json.loads((tmp_path / "rank-1.json").read_text())
    missing = {k: v for k, v in good.items() if k != "phase"}  # an older or broken writer
    (tmp_path / "rank-0.json").write_text(json.dumps({**missing, "rank": 0}))
    (tmp_path / "rank-2.json").write_text(json.dumps({**good, "rank": 2, "version": 99}))
    (tmp_path / "rank-3.json").write_text(json.dumps({**good, "rank": 3})[:200])  # truncated
    (tmp_path / "rank-4.json").write_text(json.dumps({**good, "rank": 4, "steps": "many"}))
    collector = RanksCollector(tmp_path)
    try:
        families = collector.collect(time.monotonic() + 5)  # one scrape: each file read once
    finally:
        collector.close()
    assert samples_of(families, "colossalai_rank_up") == {"1": 1.0}
    errors = {s.labels["reason"]: s.value for f in families for s in f.samples
              if s.name == "colossalai_rank_snapshot_errors_total"}
    assert errors == {"malformed": 1, "invalid": 2, "version": 1, "unreadable": 0,
                      "shared": 0}


def test_a_version_1_snapshot_from_an_older_monitor_is_read(tmp_path: Path) -> None:
    from colossalai_exporter import TrainingMonitor

    TrainingMonitor(serve="none", run_dir=tmp_path, rank=1, start=False).close()
    old = json.loads((tmp_path / "rank-1.json").read_text())
    for key in ("kernel_failures", "last_error"):  # fields version 2 added
        del old[key]
    (tmp_path / "rank-1.json").write_text(json.dumps({**old, "version": 1}))
    snap = read_snapshot(tmp_path / "rank-1.json")
    assert (snap.kernel_failures, snap.last_error) == (0, None)
    registry = CollectorRegistry()
    registry.register(Adapter(RanksCollector(tmp_path)))
    assert registry.get_sample_value("colossalai_rank_up", {"rank": "1"}) == 1


def test_old_snapshots_of_dead_processes_are_forgotten(tmp_path: Path) -> None:
    from colossalai_exporter import TrainingMonitor

    monitor = TrainingMonitor(serve="none", run_dir=tmp_path, rank=5, start=False)
    monitor.close()  # writes one snapshot of this (live) process
    snap_file = tmp_path / "rank-5.json"
    text = snap_file.read_text().replace(f'"pid":{os.getpid()}', '"pid":999999999')
    snap_file.write_text(text)
    now = time.time()
    fresh = RanksCollector(tmp_path, clock=lambda: now)
    later = RanksCollector(tmp_path, forget_after=60, clock=lambda: now + 120)
    up = [f for f in fresh.collect(time.monotonic() + 5) if f.name == "colossalai_rank_up"]
    assert [s.value for s in up[0].samples] == [0.0]  # dead pid: down
    up = [f for f in later.collect(time.monotonic() + 5) if f.name == "colossalai_rank_up"]
    assert up[0].samples == []


def samples_of(families: list[MetricFamily], name: str) -> dict[str, float]:
    """Sample ``name``'s value by rank."""
    return {s.labels["rank"]: s.value for f in families for s in f.samples if s.name == name}


def test_a_snapshot_from_another_pid_namespace_is_judged_by_its_age(tmp_path: Path) -> None:
    """Its pid means nothing here (a pod without hostPID): never judged dead by it."""
    from colossalai_exporter import TrainingMonitor

    monitor = TrainingMonitor(serve="none", run_dir=tmp_path, rank=3, start=False)
    monitor.close()
    snap_file = tmp_path / "rank-3.json"
    text = snap_file.read_text()
    assert f'"pid":{os.getpid()}' in text and '"pid_ns":' in text
    # pid 1 of the pod's namespace, and a namespace that is not ours.
    text = text.replace(f'"pid":{os.getpid()}', '"pid":1')
    text = text.replace('"pid_ns":', '"pid_ns":1').replace('"pid_ns":1null', '"pid_ns":1')
    snap_file.write_text(text)
    now = time.time()
    fresh = RanksCollector(tmp_path, stale_after=30, clock=lambda: now).collect(
        time.monotonic() + 5)
    assert samples_of(fresh, "colossalai_rank_up") == {"3": 1.0}
    assert samples_of(fresh, "colossalai_rank_process_stopped") == {}  # unknowable here
    stale = RanksCollector(tmp_path, stale_after=30, clock=lambda: now + 31).collect(
        time.monotonic() + 5)
    assert samples_of(stale, "colossalai_rank_up") == {"3": 0.0}


def test_a_real_rank_in_its_own_pid_namespace(tmp_path: Path) -> None:
    """A rank under ``unshare --pid`` (as in a pod without hostPID): up while it publishes,
    down once its snapshot is stale after a SIGKILL, never judged by its foreign pid."""
    unshare = require_binary("unshare")
    probe = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, text=True, timeout=10, check=False)
    require(probe.returncode == 0, f"unshare --pid (root, CAP_SYS_ADMIN): {probe.stderr.strip()}")
    proc = subprocess.Popen(
        [unshare, "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-c",
         RANK_SCRIPT, str(tmp_path)],
        env=cli_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        collector = RanksCollector(tmp_path, stale_after=STALE_AFTER)

        def up() -> float | None:
            return samples_of(collector.collect(time.monotonic() + 5),
                              "colossalai_rank_up").get("0")

        wait_until(lambda: up() == 1.0, timeout=30, what="the namespaced rank to be up")
        snap = read_snapshot(tmp_path / "rank-0.json")
        assert snap.pid != proc.pid and snap.pid <= 3, snap.pid  # its own pid space
        families = wait_until(
            lambda: (f := collector.collect(time.monotonic() + 5))
            and samples_of(f, "colossalai_training_steps_total").get("0", 0) > 0 and f,
            timeout=15, what="the rank's steps, re-served by the agent")
        assert samples_of(families, "colossalai_rank_process_stopped") == {}
        rank = psutil.Process(proc.pid).children(recursive=True)[-1]  # the Python rank
        rank.kill()
        rank.wait(10)
        wait_until(lambda: up() == 0.0, timeout=30, what="the killed rank to go down")
    finally:
        proc.kill()
        proc.wait(10)


def ranks_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("ranks-")]


def test_a_hung_run_directory_fails_the_collector_in_time(tmp_path: Path) -> None:
    """A snapshot whose open() never returns (a FIFO with no writer blocks in the
    kernel as a file on a hung mount does): the scrape fails ``timeout`` within
    the collector's deadline, later scrapes wait for the same read instead of
    starting another, and once the read returns the ranks are served again."""
    from colossalai_exporter.node.base import CollectorError

    before = len(ranks_threads())
    fifo = tmp_path / "rank-0.json"
    os.mkfifo(fifo)
    collector = RanksCollector(tmp_path, timeout=0.3)
    try:
        for _ in range(3):
            started = time.monotonic()
            pending = collector.begin(started + 5)
            with pytest.raises(CollectorError) as info:
                collector.collect(started + 5, pending)
            assert time.monotonic() - started < 0.3 + 0.5
            assert info.value.reason == "timeout"
            assert str(tmp_path) in info.value.message
        assert len(ranks_threads()) == before + 1  # one stuck reader, not one per scrape

        from colossalai_exporter import TrainingMonitor

        (tmp_path / "real").mkdir()
        TrainingMonitor(serve="none", run_dir=tmp_path / "real", rank=0, start=False).close()
        snap = (tmp_path / "real" / "rank-0.json").read_text()  # this live process's
        with open(fifo, "w") as writer:  # the hung open() returns; the read gets this
            writer.write(snap)
        wait_until(lambda: collector._reading is not None and collector._reading.done(), 5,
                   what="the stuck read to return")
        os.unlink(fifo)
        (tmp_path / "rank-0.json").write_text(snap)
        families = {f.name: f for f in collector.collect(time.monotonic() + 5)}
        assert [s.value for s in families["colossalai_rank_up"].samples] == [1.0]
    finally:
        collector.close()


def test_a_hung_read_does_not_hold_up_the_agents_exit(tmp_path: Path) -> None:
    # Worker threads of concurrent.futures are joined at interpreter exit: a read
    # stuck in the kernel would turn SIGTERM into a hang. Ours are daemon threads.
    os.mkfifo(tmp_path / "rank-0.json")
    (tmp_path / "watched").mkdir()
    program = textwrap.dedent("""
        import sys, time
        from colossalai_exporter.node import disk
        from colossalai_exporter.node.base import CollectorError
        from colossalai_exporter.node.ranks import RanksCollector
        collector = RanksCollector(sys.argv[1], timeout=0.2)
        try:
            collector.collect(time.monotonic() + 1)
        except CollectorError as exc:
            print(exc.reason, flush=True)
        # A disk check stuck the same way: statvfs on a hung mount, here a sleep.
        release = disk.check_path
        disk.check_path = lambda watched: time.sleep(3600)
        paths = disk.DiskCollector([disk.WatchedPath("ckpt", sys.argv[2])], timeout=0.2)
        paths.collect(time.monotonic() + 1)
        print("disk timed out", flush=True)
        # return from the program normally: the interpreter's own exit must not wait
    """)
    result = subprocess.run([sys.executable, "-c", program, str(tmp_path),
                             str(tmp_path / "watched")], capture_output=True, text=True,
                            timeout=30, env=cli_env(), check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["timeout", "disk timed out"]


def test_process_state_reads_the_kernels_view_of_a_pid() -> None:
    """One read of /proc/<pid>/stat: alive, stopped, zombie, gone, or a reused pid."""
    from colossalai_exporter.node.ranks import process_state

    # A command name with a space and parentheses, as /proc/<pid>/stat quotes it.
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        open("/proc/self/comm", "w").write("r 1) (x")
        print("ready", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        started = psutil.Process(child.pid).create_time()
        assert process_state(child.pid, started) == (True, False)
        assert process_state(child.pid, None) == (True, False)
        # the same pid with another start time: another process now
        assert process_state(child.pid, started - 60) == (False, False)
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: process_state(child.pid, started) == (True, True), timeout=10,
                   what="the stopped state")
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        # killed and not yet reaped: a zombie, which is not alive
        wait_until(lambda: process_state(child.pid, started) == (False, False), timeout=10,
                   what="the zombie")
    finally:
        child.kill()
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
    assert process_state(child.pid, started) == (False, False)  # reaped: gone
