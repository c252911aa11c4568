"""How a rank ended, judged from outside (node/exits.py), and what the rank records for it
(training/signals.py, training/errors.py): real rank processes ending every way a
rank ends, and the OOM-kill evidence on fake kernel logs and cgroup trees."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from colossalai_exporter.node.exits import ExitJudge
from colossalai_exporter.node.oom import KernelLog
from colossalai_exporter.node.ranks import RanksCollector
from colossalai_exporter.rankstate.crash import Crash, parse_crash_report
from colossalai_exporter.rankstate.files import read_snapshot, snapshot_path
from colossalai_exporter.rankstate.schema import (
    Activity,
    GroupProgress,
    Interruption,
    PendingCollective,
    Snapshot,
)
from colossalai_exporter.training.errors import error_record, is_peer_failure
from colossalai_exporter.training.state import STEP_BUCKETS
from conftest import cli_env, wait_until

# One rank that ends as MODE says, once the test has seen it train (a file appears).
RANK = textwrap.dedent("""
    import ctypes, faulthandler, os, signal, sys, threading, time
    from pathlib import Path
    from colossalai_exporter import TrainingMonitor

    # Every thread's stack on SIGUSR2 (to stderr): what a rank that does not end was doing.
    faulthandler.register(signal.SIGUSR2, all_threads=True)

    run_dir, mode = sys.argv[1], sys.argv[2]
    stopped = []
    if mode == "own_handler":
        # the script's own SIGTERM handler, installed before the monitor: it must still run
        signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    monitor = TrainingMonitor(serve="none", run_dir=run_dir, step_timeout=30.0,
                              publish_interval=10.0)  # the publisher stays out of the way
    if mode == "slow_publish":
        # Every publish takes 0.3 s: the handler and the watcher both see the signal,
        # and the one that does not write the record must wait for the other's write.
        monitor.add_poller(lambda state: time.sleep(0.3))
    if mode == "held_publish":
        # The publisher's own publishes each hold the snapshot for 1.5 s (the stall's
        # evidence written on a loaded machine): the signal's record must wait them out.
        def held(state):
            if threading.current_thread().name == "colossalai-monitor":
                Path(run_dir, "holding").touch()
                time.sleep(1.5)
        monitor.add_poller(held)
        monitor._publisher._interval = 0.2
    if mode == "handler_after":
        # ... or after it (a checkpoint-on-preemption handler): it decides, not the monitor
        signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    for _ in range(3):
        with monitor.step():
            pass
    Path(run_dir, f"ready-{monitor.rank}").touch()
    if mode == "finish":
        monitor.finish()
        sys.exit(0)
    if mode == "exit_unfinished":
        sys.exit(0)  # the script's end, without monitor.finish()
    if mode == "exit_when_told":
        while not Path(run_dir, "go").exists():
            time.sleep(0.01)
        sys.exit(0)  # as exit_unfinished, once the test has looked
    if mode == "caught_then_exit":
        try:
            with monitor.step():
                raise ValueError("batch 17 has 0 samples")
        except ValueError:
            sys.exit(1)  # the script's own handling: a message, then a failed exit
    if mode == "own_error":
        with monitor.step():
            raise ValueError("batch 17 has 0 samples")
    if mode == "peer_error":
        with monitor.step():
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                               "Connection closed by peer [10.0.0.2]:8089")
    if mode == "blocked":
        # The main thread waits in C for ever (as in a collective that never completes):
        # pthread_join restarts after a signal and never returns to Python.
        forever = threading.Thread(target=time.sleep, args=(3600,), daemon=True)
        forever.start()
        ctypes.CDLL(None).pthread_join(ctypes.c_ulong(forever.ident), None)
    if mode == "segfault":
        def forward():
            ctypes.string_at(0)  # a read of address 0 in native code: SIGSEGV
        with monitor.step():
            forward()
    if mode == "abort":
        with monitor.step():
            os.abort()  # what C++'s std::terminate does: SIGABRT
    if mode == "child_segfault":
        # A forked helper (a DataLoader worker) that crashes: its report is not the rank's.
        child = os.fork()
        if child == 0:
            ctypes.string_at(0)
        os.waitpid(child, 0)
        Path(run_dir, "forked").touch()
    if mode == "fork":
        # A forked helper (a DataLoader worker) that gets SIGTERM: the helper's, not ours.
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        os.kill(child, signal.SIGTERM)
        os.waitpid(child, 0)
        Path(run_dir, "forked").touch()
    while not stopped:
        with monitor.step():
            time.sleep(0.01)
    for _ in range(3):  # steps after the signal, as long as real ones: it ended nothing
        with monitor.step():
            time.sleep(0.1)
    monitor.close()
    sys.exit(0)
""")


def start(run_dir: Path, rank: int, mode: str) -> subprocess.Popen[bytes]:
    env = cli_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="8")
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(run_dir), mode], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_until(lambda: (run_dir / f"ready-{rank}").exists() or proc.poll() is not None,
               timeout=60, interval=0.05, what=f"rank {rank} ({mode}) training")
    return proc


def ended(proc: subprocess.Popen[bytes], timeout: float = 60) -> int:
    """The rank's exit status, once it ends. Recording a signal may wait, bounded, for a
    publish in progress and for the other path's record (training/signals.py: 5 s and
    6 s), then close the monitor: seconds, which a loaded machine stretches. A rank
    still running after ``timeout`` is asked for its threads' stacks, which the failure
    shows."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR2)
        time.sleep(2)
        proc.kill()
        _, stderr = proc.communicate(timeout=10)
        said = stderr.decode(errors="replace")[-6000:]
        raise AssertionError(f"rank still running after {timeout} s; its stderr, with "
                             f"every thread's stack:\n{said}") from None


@pytest.fixture
def ranks() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def test_each_way_a_rank_ends_is_told_apart(tmp_path: Path,
                                            ranks: list[subprocess.Popen[bytes]]) -> None:
    """Killed, finished, failed of its own error, failed of a peer's, stopped by SIGTERM
    (also while its main thread waits in C), a script's own SIGTERM handler that lets
    it train on, a script that ends without finish(), and one that catches an error and
    exits 1: each rank's exit_info as the node agent serves it."""
    run_dir = tmp_path / "run"
    kernel_log = tmp_path / "kmsg"
    kernel_log.write_text("")  # a readable kernel log without OOM kills
    modes = ["kill", "finish", "own_error", "peer_error", "term", "blocked", "own_handler",
             "handler_after", "exit_unfinished", "caught_then_exit"]
    for rank, mode in enumerate(modes):
        ranks.append(start(run_dir, rank, mode))
    kill, finish, own, peer, term, blocked, handler, handler_after, unfinished, caught = ranks
    collector = RanksCollector(run_dir, exits=ExitJudge(KernelLog(str(kernel_log))))
    collector.collect(time.monotonic() + 5)  # every rank seen alive first

    kill.kill()
    assert ended(kill) == -signal.SIGKILL
    assert ended(finish) == 0
    assert ended(own) == 1
    assert ended(peer) == 1
    assert ended(unfinished) == 0
    assert ended(caught) == 1
    for proc in (term, blocked, handler, handler_after):
        proc.send_signal(signal.SIGTERM)
    # The default action is kept: the process ends by the signal, promptly, even with its
    # main thread blocked in C where no Python handler could run.
    assert ended(term, 10) == -signal.SIGTERM
    assert ended(blocked, 10) == -signal.SIGTERM
    assert ended(handler, 10) == 0  # its own handler ran; it trained on and exited
    assert ended(handler_after, 10) == 0  # idem, with its handler installed after ours

    families = collector.collect(time.monotonic() + 5)
    exits = {s.labels["rank"]: (s.labels["reason"], s.labels["detail"])
             for f in families if f.name == "colossalai_rank_exit" for s in f.samples}
    assert exits["0"] == ("killed", "its process vanished with no error, no signal recorded "
                                    "and no OOM kill in the kernel log: SIGKILL from outside, "
                                    "or a crash in native code")
    assert exits["1"] == ("finished", "called monitor.finish() after step 3")
    assert exits["2"] == ("failed", "ValueError: batch 17 has 0 samples")
    assert exits["3"][0] == "peer_failed" and "Connection closed by peer" in exits["3"][1]
    assert exits["4"] == ("interrupted", "received SIGTERM")
    assert exits["5"] == ("interrupted", "received SIGTERM")
    # It received SIGTERM and kept training: the signal ended nothing; it then exited
    # normally without finish(): its run ended there (interpreter exit, training/fatal.py).
    at_exit = ("without calling monitor.finish() (the end of its script, or sys.exit())")
    for rank in "67":
        assert exits[rank][0] == "finished" and exits[rank][1].endswith(at_exit)
    assert exits["8"] == ("finished", f"exited normally after step 3 {at_exit}")
    # An error recorded after its last step, then a normal exit: the error ended it.
    assert exits["9"] == ("failed", "ValueError: batch 17 has 0 samples")
    assert read_snapshot(snapshot_path(run_dir, 6)).interruption is None
    assert all(s.labels["run"] for f in families if f.name == "colossalai_rank_exit"
               for s in f.samples)


def test_a_crash_in_native_code_is_named_with_its_signal_and_line(
        tmp_path: Path, ranks: list[subprocess.Popen[bytes]]) -> None:
    """A segmentation fault and an abort each end a rank with no error recorded: the
    verdict names the signal and the script's line from the rank's crash report, where
    it said only "SIGKILL from outside, or a crash in native code". A forked helper's
    crash is not the rank's: the rank, SIGKILLed after it, is judged as before."""
    run_dir = tmp_path / "run"
    kernel_log = tmp_path / "kmsg"
    kernel_log.write_text("")
    for rank, mode in enumerate(("segfault", "abort", "child_segfault")):
        ranks.append(start(run_dir, rank, mode))
    segfault, abort, forked = ranks
    collector = RanksCollector(run_dir, exits=ExitJudge(KernelLog(str(kernel_log))))
    collector.collect(time.monotonic() + 5)
    assert ended(segfault) == -signal.SIGSEGV
    assert ended(abort) == -signal.SIGABRT
    wait_until((run_dir / "forked").exists, timeout=60, interval=0.05,
               what="the helper's crash")
    forked.kill()
    assert ended(forked) == -signal.SIGKILL

    families = collector.collect(time.monotonic() + 5)
    exits = {s.labels["rank"]: (s.labels["reason"], s.labels["detail"])
             for f in families if f.name == "colossalai_rank_exit" for s in f.samples}
    pids = {rank: proc.pid for rank, proc in enumerate(ranks)}
    # The script's own line first (a -c script's file is "<string>"), then ctypes' frame.
    assert exits["0"][0] == "killed"
    assert exits["0"][1].startswith(
        "SIGSEGV (Segmentation fault), a crash in native code, at <string>:"), exits["0"]
    assert " in forward (__init__.py:" in exits["0"][1]
    assert exits["0"][1].endswith(f"in string_at); every thread's Python stack is in "
                                  f"crash-rank0-{pids[0]}.txt in the node's run directory")
    assert exits["1"][0] == "killed"
    assert exits["1"][1].startswith(
        "SIGABRT (Aborted), a crash in native code, at <string>:"), exits["1"]
    assert exits["2"] == ("killed", "its process vanished with no error, no signal recorded "
                                    "and no OOM kill in the kernel log: SIGKILL from outside, "
                                    "or a crash in native code")


def test_a_closed_monitor_leaves_no_crash_report(tmp_path: Path,
                                                 ranks: list[subprocess.Popen[bytes]]) -> None:
    """The report's file is the process's while it trains, and gone once the monitor
    closes or the interpreter exits (a run directory of many runs would otherwise fill
    with them)."""
    closes, exits = start(tmp_path, 0, "own_handler"), start(tmp_path, 1, "exit_when_told")
    ranks.extend((closes, exits))
    reports = [tmp_path / f"crash-rank{rank}-{proc.pid}.txt"
               for rank, proc in enumerate(ranks)]
    for rank, report in enumerate(reports):
        assert report.read_text().startswith(
            f"# colossalai-exporter crash report, rank {rank}, pid ")
    closes.send_signal(signal.SIGTERM)  # its own handler: it trains on, then close()
    (tmp_path / "go").touch()  # sys.exit() without close(): the interpreter's exit
    assert ended(closes) == 0 and ended(exits) == 0
    assert not reports[0].exists()
    assert not reports[1].exists()


@pytest.mark.parametrize("attempt", range(3))
def test_a_slow_record_is_written_before_the_signal_takes_effect(
        tmp_path: Path, ranks: list, attempt: int) -> None:
    """SIGTERM seen by the main thread's handler and the watcher thread at once: whichever
    records, the process ends by SIGTERM only after the snapshot says so (a rank stopped
    by torchrun was paged as killed when the loser of that race ended it first)."""
    proc = start(tmp_path, 0, "slow_publish")
    ranks.append(proc)
    proc.send_signal(signal.SIGTERM)
    assert ended(proc) == -signal.SIGTERM
    snap = read_snapshot(snapshot_path(tmp_path, 0))
    assert snap.interruption is not None and snap.interruption.signal == "SIGTERM"


def test_a_signal_waits_for_a_slow_publish_in_progress_to_record(
        tmp_path: Path, ranks: list) -> None:
    """SIGTERM while the publisher's thread is in a publish that takes longer than the
    one second a training thread's error waits: the rank still ends by SIGTERM with the
    record on disk (it was paged as killed when the record gave up after a second and
    the signal ended the rank first, once in a loaded CI run)."""
    proc = start(tmp_path, 0, "held_publish")
    ranks.append(proc)
    holding = tmp_path / "holding"
    holding.unlink(missing_ok=True)
    wait_until(holding.exists, timeout=30, interval=0.01, what="a publish in progress")
    proc.send_signal(signal.SIGTERM)
    assert ended(proc) == -signal.SIGTERM
    snap = read_snapshot(snapshot_path(tmp_path, 0))
    assert snap.interruption is not None and snap.interruption.signal == "SIGTERM"


def test_sigint_still_raises_keyboard_interrupt_and_is_recorded(tmp_path: Path,
                                                                 ranks: list) -> None:
    proc = start(tmp_path, 0, "term")
    ranks.append(proc)
    proc.send_signal(signal.SIGINT)
    # KeyboardInterrupt, as without the monitor (Python then ends by SIGINT itself). The
    # deadline is the default's: the handler and the watcher may each wait for the other's
    # write (seconds, bounded), which a loaded CI machine stretched past a 10 s deadline.
    assert ended(proc) == -signal.SIGINT
    stderr = proc.stderr.read() if proc.stderr else b""
    assert b"KeyboardInterrupt" in stderr, stderr
    snap = read_snapshot(snapshot_path(tmp_path, 0))
    assert snap.interruption is not None and snap.interruption.signal == "SIGINT"


def test_a_forked_helpers_sigterm_is_not_the_ranks(tmp_path: Path, ranks: list) -> None:
    """A DataLoader worker forked from the rank inherits its handlers and wakeup
    descriptor; its own SIGTERM must neither be recorded as the rank's nor end the rank."""
    proc = start(tmp_path, 0, "fork")
    ranks.append(proc)
    wait_until((tmp_path / "forked").exists, timeout=30, what="the forked helper ended")
    time.sleep(0.5)  # the rank's watcher would have acted on a stray byte by now
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    assert read_snapshot(snapshot_path(tmp_path, 0)).interruption is None


# -- the evidence of an OOM kill, without a real one (tests/test_oom_evidence.py has one)

def snapshot(pid: int, rank: int = 1, phase: str = "training", created: float = 1000.0,
             **fields: object) -> Snapshot:
    return Snapshot(rank=rank, local_rank=rank, world_size=2, pid=pid, created=created,
                    written=created + 10, phase=phase, phase_start=created,
                    step_buckets=list(STEP_BUCKETS), step_hist=[0] * (len(STEP_BUCKETS) + 1),
                    timeout=60.0, progress=created, info={"run": "job-1"}, **fields)


OOM_RECORDS = (
    "6,740,2000000000,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,"
    "mems_allowed=0,oom_memcg=/slurm_job_4242,task_memcg=/slurm_job_4242,task=python3,"
    "pid={pid},uid=0\n"
    "3,741,2000000010,-;Memory cgroup out of memory: Killed process {pid} (python3) "
    "total-vm:426168kB, anon-rss:101888kB, file-rss:6376kB, shmem-rss:0kB, UID:0 "
    "pgtables:260kB oom_score_adj:0\n")


def fake_cgroups(tmp_path: Path, pids: dict[int, str]) -> tuple[Path, Path]:
    """A /proc with each pid's cgroup (v1 memory) and vmstat, and /sys/fs/cgroup."""
    proc, sys_root = tmp_path / "proc", tmp_path / "cgroup"
    for pid, cgroup in pids.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"4:memory:{cgroup}\n0::/\n")
        (sys_root / "memory" / cgroup.strip("/")).mkdir(parents=True, exist_ok=True)
        set_oom_kills(sys_root, cgroup, 0)
    (proc / "vmstat").write_text("oom_kill 5\n")
    return proc, sys_root


def set_oom_kills(sys_root: Path, cgroup: str, kills: int) -> None:
    (sys_root / "memory" / cgroup.strip("/") / "memory.oom_control").write_text(
        f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")


def judge(judge_: ExitJudge, alive: list[Snapshot], gone: list[Snapshot],
          crashes: dict[int, Crash] | None = None) -> dict[int, tuple]:
    exits = judge_.scrape(alive, gone, crashes or {}, lambda snap: True)
    return {rank: (e.reason, e.detail) for rank, e in exits.items()}


def test_the_kernel_log_names_the_victim(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text(OOM_RECORDS.format(pid=4242))
    exits = ExitJudge(KernelLog(str(log), boot_time=0.0), clock=lambda: 2500.0)
    victim, other = snapshot(4242, rank=1), snapshot(4243, rank=0)
    verdicts = judge(exits, [], [victim, other])
    assert verdicts[1][0] == "oom_killed"
    assert "memory cgroup /slurm_job_4242" in verdicts[1][1]
    assert "99.5 MiB" in verdicts[1][1] and verdicts[1][1].endswith("from the kernel log")
    assert verdicts[0][0] == "killed"  # no record of its pid


@pytest.mark.parametrize("message", [
    "DataLoader worker (pid 4250) is killed by signal: Killed. ",
    "DataLoader worker (pid(s) 4251, 4250) exited unexpectedly",
])
def test_a_dataloader_worker_the_oom_killer_ended_is_the_ranks_oom_kill(
        tmp_path: Path, message: str) -> None:
    log = tmp_path / "kmsg"
    log.write_text(OOM_RECORDS.format(pid=4250))  # the worker's pid, at 2000 s
    exits = ExitJudge(KernelLog(str(log), boot_time=0.0), clock=lambda: 2500.0)
    error = error_record(RuntimeError(message), "run", None, 2001.0)
    failed = snapshot(4242, phase="failed", last_error=error)
    reason, detail = judge(exits, [], [failed])[1]
    assert reason == "oom_killed"
    assert detail == ("in its DataLoader worker, pid 4250: memory cgroup /slurm_job_4242 at "
                      "its limit, anon-rss 99.5 MiB; from the kernel log; the rank then raised "
                      f"RuntimeError: {message.strip()}")


def test_without_the_kernel_log_a_workers_oom_kill_is_counted_by_the_cgroup(
        tmp_path: Path) -> None:
    proc, sys_root = fake_cgroups(tmp_path, {10: "/job"})
    exits = ExitJudge(KernelLog(str(tmp_path / "no-kmsg")), proc_root=str(proc),
                      sys_root=str(sys_root))
    rank = snapshot(10)
    assert judge(exits, [rank], []) == {}
    set_oom_kills(sys_root, "/job", 1)  # the worker, in the rank's cgroup
    error = error_record(RuntimeError("DataLoader worker (pid 4250) is killed by signal: "
                                      "Killed. "), "run", None, 1005.0)
    reason, detail = judge(exits, [], [snapshot(10, phase="failed", last_error=error)])[1]
    assert reason == "oom_killed"
    assert detail.startswith("in its DataLoader worker: memory cgroup /job counted an OOM "
                             "kill as its DataLoader worker (pid 4250) died (the kernel "
                             "log, which names the victim, cannot be read: ")
    assert detail.endswith("; the rank then raised RuntimeError: DataLoader worker (pid "
                           "4250) is killed by signal: Killed.")


def test_a_dataloader_worker_that_died_otherwise_is_the_ranks_own_error(
        tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text(OOM_RECORDS.format(pid=4999))  # another process's kill
    exits = ExitJudge(KernelLog(str(log), boot_time=0.0), clock=lambda: 2500.0)
    error = error_record(RuntimeError("DataLoader worker (pid 4250) is killed by signal: "
                                      "Segmentation fault. "), "run", None, 2001.0)
    assert judge(exits, [], [snapshot(4242, phase="failed", last_error=error)])[1][0] == \
        "failed"


def test_a_kill_logged_before_the_process_started_is_another_process(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text(OOM_RECORDS.format(pid=4242))  # at 2000 s
    exits = ExitJudge(KernelLog(str(log), boot_time=0.0), clock=lambda: 2500.0)
    assert judge(exits, [], [snapshot(4242, created=3000.0)])[1][0] == "killed"


def test_a_recorded_end_is_believed_before_the_cgroup_count(tmp_path: Path) -> None:
    """Rank 1 OOM-killed, rank 0 (same cgroup) failed on its closed connection: the
    cgroup's count rose for both, but rank 0 said why it died."""
    proc, sys_root = fake_cgroups(tmp_path, {10: "/job", 11: "/job"})
    exits = ExitJudge(KernelLog(str(tmp_path / "no-kmsg")), proc_root=str(proc),
                      sys_root=str(sys_root))
    rank0, rank1 = snapshot(10, rank=0), snapshot(11, rank=1)
    assert judge(exits, [rank0, rank1], []) == {}
    set_oom_kills(sys_root, "/job", 1)
    peer = error_record(RuntimeError("Connection reset by peer"), "step", None, 1005.0)
    rank0_failed = snapshot(10, rank=0, phase="failed", last_error=peer)
    verdicts = judge(exits, [], [rank0_failed, rank1])
    assert verdicts[0] == ("peer_failed", "RuntimeError: Connection reset by peer")
    assert verdicts[1][0] == "oom_killed"
    assert verdicts[1][1].startswith("memory cgroup /job counted an OOM kill as the rank "
                                     "vanished (the kernel log, which names the victim, "
                                     "cannot be read: ")


def test_without_the_kernel_log_the_cgroup_then_the_node_count(tmp_path: Path) -> None:
    proc, sys_root = fake_cgroups(tmp_path, {10: "/a", 11: "/b", 12: "/c"})
    exits = ExitJudge(KernelLog(str(tmp_path / "no-kmsg")), proc_root=str(proc),
                      sys_root=str(sys_root))
    a, b, c = snapshot(10, rank=0), snapshot(11, rank=1), snapshot(12, rank=2)
    judge(exits, [a, b, c], [])
    # a's cgroup killed every process of it; the node counted one more kill; c: nothing
    (sys_root / "memory" / "a" / "memory.oom_control").write_text("oom_kill 3\n")
    verdicts = judge(exits, [b, c], [a])
    assert verdicts[0][0] == "oom_killed" and "/a counted an OOM kill" in verdicts[0][1]
    (proc / "vmstat").write_text("oom_kill 6\n")
    assert judge(exits, [c], [a, b])[1] == (
        "oom_killed", "the node's OOM-kill count (/proc/vmstat) rose as the rank vanished; "
                      "neither the kernel log nor the rank's memory cgroup could say more")
    verdicts = judge(exits, [], [a, b, c])
    assert verdicts[2][0] == "killed"
    assert "or an OOM kill nothing on this node could show" in verdicts[2][1]
    # Each verdict is kept: a later rise of a's cgroup count is nobody's new evidence.
    set_oom_kills(sys_root, "/c", 1)
    assert judge(exits, [], [a, b, c])[2][0] == "killed"


def test_a_group_kill_is_named_as_one(tmp_path: Path) -> None:
    proc, sys_root = fake_cgroups(tmp_path, {10: "/pod", 11: "/pod"})
    (sys_root / "memory").rename(tmp_path / "v1")  # a cgroup v2 host instead
    for pid in (10, 11):
        (proc / str(pid) / "cgroup").write_text("0::/pod\n")
    (sys_root / "pod").mkdir(parents=True)
    (sys_root / "pod" / "memory.events").write_text("oom 0\noom_kill 0\noom_group_kill 0\n")
    exits = ExitJudge(KernelLog(str(tmp_path / "no-kmsg")), proc_root=str(proc),
                      sys_root=str(sys_root))
    ranks = [snapshot(10, rank=0), snapshot(11, rank=1)]
    judge(exits, ranks, [])
    (sys_root / "pod" / "memory.events").write_text("oom 1\noom_kill 2\noom_group_kill 1\n")
    verdicts = judge(exits, [], ranks)
    assert {v[0] for v in verdicts.values()} == {"oom_killed"}
    assert "killed every process of it (memory.oom.group)" in verdicts[0][1]


def test_a_rank_in_another_pid_namespace_is_not_matched_by_pid(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text(OOM_RECORDS.format(pid=4242))
    exits = ExitJudge(KernelLog(str(log), boot_time=0.0), clock=lambda: 2500.0)
    verdicts = exits.scrape([], [snapshot(4242)], {}, lambda snap: False)
    assert verdicts[1].reason == "killed" and "another PID namespace" in verdicts[1].detail


def test_a_crash_report_names_the_crash_of_a_rank_in_another_pid_namespace() -> None:
    """A training pod without hostPID: its crash report says the process ended (it is
    not only frozen) and how."""
    crash = parse_crash_report("Fatal Python error: Segmentation fault\n\n"
                               "Current thread 0x00007f3a3d8e5740 (most recent call first):\n"
                               '  File "/job/train.py", line 88 in forward\n',
                               "crash-rank1-4242.txt")
    assert crash is not None
    verdicts = ExitJudge(None).scrape([], [snapshot(4242)], {1: crash}, lambda snap: False)
    assert verdicts[1].reason == "killed"
    assert verdicts[1].detail.startswith(
        "SIGSEGV (Segmentation fault), a crash in native code, at train.py:88 in forward; ")


# -- after a hang: the rank the others waited for, and the ranks that waited

IN_COMPUTE = Activity(kind="compute", frame="train.py:285 in step")
IN_BACKWARD = Activity(kind="backward", frame="__init__.py:347 in backward")
# Where a rank that waits for an NCCL collective blocks: a CUDA sync in its own code.
IN_SYNC = Activity(kind="compute", frame="train.py:290 in step")


def hung_at(at: float, activity: Activity | None, pid: int = 4242, rank: int = 1,
            **fields: object) -> Snapshot:
    """A rank whose last step was at 1000 s (budget 60 s), written at ``at``; stalled
    (the writer's verdict) from 1060 s on."""
    snap = snapshot(pid, rank=rank, activity=activity, stalled=at > 1060.0, **fields)
    snap.written = at
    return snap


def waiter(at: float = 1075.0, activity: Activity = IN_BACKWARD, **fields: object) -> Snapshot:
    """Rank 0, waiting for rank 1 (still alive, as last written at ``at``)."""
    return hung_at(at, activity, pid=10, rank=0, **fields)


def stopped(activity: Activity | None, at: float = 1075.0, **fields: object) -> Snapshot:
    """Rank 1, stopped by SIGTERM at ``at``, from a monitor that reads what it has in
    flight (nothing, unless ``pending`` says)."""
    fields.setdefault("in_flight_known", True)
    return hung_at(at, activity, interruption=Interruption(signal="SIGTERM", time=at),
                   **fields)


def verdicts(*gone: Snapshot, alive: tuple[Snapshot, ...] = ()) -> dict[int, tuple]:
    return judge(ExitJudge(None), list(alive), list(gone))


def test_a_rank_that_froze_after_a_wait_made_no_step_since_its_last() -> None:
    """The end of a wait restarted its stall's clock (progress at 1050 s); the verdict
    still says how long it made no step."""
    frozen = stopped(IN_COMPUTE, at=1120.0, steps=40, last_step=1000.0)
    frozen.progress = 1050.0
    verdict = verdicts(frozen, alive=(waiter(at=1120.0),))[1]
    assert verdict[1].startswith("it made no step for 120s (budget 60s), in compute"), verdict


def test_a_signal_that_ends_the_rank_a_hang_waited_for_is_not_a_preemption() -> None:
    assert verdicts(stopped(IN_COMPUTE), alive=(waiter(),))[1] == ("hung", (
        "it made no step for 75s (budget 60s), in compute at train.py:285 in step, outside "
        "any collective, while rank 0 waited in backward at __init__.py:347 in backward: "
        "the rank the others waited for; then it received SIGTERM (torchrun stopping it "
        "once another rank ended, or the scheduler)"))


@pytest.mark.parametrize(("rank1", "rank0"), [
    (stopped(IN_BACKWARD), waiter()),  # stalled, but waiting like the other
    (stopped(IN_COMPUTE, at=1030.0), waiter(at=1030.0)),  # within its budget: mid-step
    (stopped(None), waiter()),  # not known where it was
    (stopped(IN_COMPUTE), waiter(at=1050.0)),  # rank 0 seen waiting, but not stalled
    # Both in a CUDA sync, as ranks that wait for NCCL are: no rank to name
    (stopped(IN_SYNC), waiter(activity=IN_SYNC)),
])
def test_a_signal_after_a_hang_without_evidence_from_another_rank_is_a_stop(
        rank1: Snapshot, rank0: Snapshot) -> None:
    reason, detail = verdicts(rank1, alive=(rank0,))[1]
    assert reason == "interrupted" and detail.startswith("received SIGTERM"), detail


def test_a_stop_outside_any_collective_says_where_for_the_rules() -> None:
    """Where the ranks that timed out waiting for it are on another node, the rules
    name it from this (TrainingRankDown, the hang elsewhere)."""
    assert verdicts(stopped(IN_COMPUTE, at=1030.0))[1] == ("interrupted", (
        "received SIGTERM in compute at train.py:285 in step, outside any collective with "
        "nothing in flight"))


def progress(pg: str, enqueued: int) -> list[GroupProgress]:
    return [GroupProgress(pg=pg, ranks="0-1", enqueued=enqueued)]


def test_on_a_gpu_the_flight_recorder_names_the_rank_behind() -> None:
    """NCCL's ranks all sample as compute (a CUDA sync); the flight recorder tells."""
    rank0 = waiter(activity=IN_SYNC, collectives=progress("0", 12))
    rank1 = stopped(IN_SYNC, collectives=progress("0", 11))
    assert verdicts(rank1, alive=(rank0,))[1] == ("hung", (
        "it made no step for 75s (budget 60s), in compute at train.py:290 in step, behind "
        "the others (rank 0 is at collective 12 of process group 0, this rank at 11): the "
        "rank the others waited for; then it received SIGTERM (torchrun stopping it once "
        "another rank ended, or the scheduler)"))
    # ... and rank 0, ended by NCCL's watchdog (no error), waited for it
    assert verdicts(rank0, rank1)[0] == ("peer_failed", (
        "it made no step for 75s (budget 60s), in compute at train.py:290 in step, ahead of "
        "rank 1 (rank 0 is at collective 12 of process group 0, this rank at 11), then "
        "vanished with no error recorded: the process group's watchdog (NCCL's, past its "
        "timeout) ends a rank whose collective does not complete"))


def test_a_rank_behind_only_because_it_waits_in_another_group_is_not_the_one() -> None:
    """Pairs of groups then a global one: rank 2 waits in its pair for rank 3, so it is
    behind ranks 0 and 1 in the global group, and ahead of rank 3 in the pair."""
    def rank(number: int, pair: int, world: int, at: float = 1075.0) -> Snapshot:
        return hung_at(at, IN_SYNC, pid=20 + number, rank=number,
                       collectives=[GroupProgress(pg="0", enqueued=world),
                                    GroupProgress(pg=str(1 + number // 2), enqueued=pair)],
                       interruption=Interruption(signal="SIGTERM", time=at))
    rank0, rank2, rank3 = rank(0, 6, 12), rank(2, 6, 11), rank(3, 5, 11)
    found = verdicts(rank0, rank2, rank3)
    assert found[0] == found[2] == ("interrupted", "received SIGTERM")
    assert found[3][0] == "hung"
    assert "behind the others (rank 0 is at collective 12 of process group 0" in found[3][1]


def test_a_rank_gone_without_a_word_while_it_waited_past_its_budget() -> None:
    """ProcessGroupNCCL's watchdog ends a rank whose collective passed the timeout:
    SIGABRT, no Python error. It waited for rank 1."""
    assert verdicts(waiter(at=1610.0), alive=(stopped(IN_COMPUTE, at=1600.0),))[0] == (
        "peer_failed",
        "it made no step for 610s (budget 60s), waiting in backward at __init__.py:347 in "
        "backward, then vanished with no error recorded: the process group's watchdog "
        "(NCCL's, past its timeout) ends a rank whose collective does not complete")


@pytest.mark.parametrize(("rank1", "others", "reason"), [
    # stalled outside any collective while rank 0 waited: the hang, then a SIGKILL
    (hung_at(1610.0, IN_COMPUTE), (waiter(at=1600.0),), "hung"),
    (hung_at(1610.0, IN_COMPUTE), (), "killed"),  # no other rank to say it hung
    (hung_at(1030.0, IN_BACKWARD), (), "killed"),  # within its budget: killed mid-step
    (hung_at(1610.0, IN_SYNC), (waiter(at=1600.0, activity=IN_SYNC),), "killed"),
])
def test_a_rank_gone_without_a_word_after_a_hang(
        rank1: Snapshot, others: tuple[Snapshot, ...], reason: str) -> None:
    assert verdicts(rank1, alive=others)[1][0] == reason


def test_a_frozen_rank_killed_after_the_hang_is_the_one_that_hung() -> None:
    """SIGSTOP (or a C call holding the GIL), then the job stopped: the frozen rank
    cannot take the launcher's SIGTERM and dies of its SIGKILL. Its last snapshot, from
    just before it froze, was within its budget; as of the scrape that last saw it alive
    it had been stalled for minutes while rank 0 waited for it."""
    frozen = hung_at(1030.0, IN_COMPUTE)  # froze at 1030 s, mid-step, within budget
    clock = [1200.0]
    exits = ExitJudge(None, clock=lambda: clock[0])
    assert judge(exits, [frozen, waiter(at=1190.0)], []) == {}  # alive, not publishing
    clock[0] = 1215.0
    assert judge(exits, [], [frozen, waiter(at=1190.0)])[1] == ("hung", (
        "it made no step for 200s (budget 60s), in compute at train.py:285 in step, outside "
        "any collective, while rank 0 waited in backward at __init__.py:347 in backward: the "
        "rank the others waited for; then its process vanished with no error and no signal "
        "recorded (SIGKILL after the hang, or a crash)"))
    # Never seen alive by this agent (started after it froze): its snapshot alone, as before.
    assert verdicts(hung_at(1030.0, IN_COMPUTE), waiter(at=1190.0))[1][0] == "killed"


def test_a_rank_that_crashed_after_the_hang_is_the_one_that_hung_and_says_how() -> None:
    """A rank stuck in the driver, then a segmentation fault: still the rank the others
    waited for (hung), and the crash is how it ended."""
    crash = parse_crash_report("Fatal Python error: Segmentation fault\n\n"
                               "Current thread 0x00007f3a3d8e5740 (most recent call first):\n"
                               '  File "/job/train.py", line 285 in step\n',
                               "crash-rank1-4243.txt")
    assert crash is not None
    frozen = hung_at(1030.0, IN_COMPUTE)  # as the frozen rank above, seen alive at 1200 s
    clock = [1200.0]
    exits = ExitJudge(None, clock=lambda: clock[0])
    assert judge(exits, [frozen, waiter(at=1190.0)], []) == {}
    clock[0] = 1215.0
    found = judge(exits, [], [frozen, waiter(at=1190.0)], {1: crash})
    assert found[1][0] == "hung"
    assert found[1][1].endswith(
        "the rank the others waited for; then it crashed: SIGSEGV (Segmentation fault), a "
        "crash in native code, at train.py:285 in step; every thread's Python stack is in "
        "crash-rank1-4243.txt in the node's run directory"), found[1]


GLOO_TIMEOUT = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                            "Timed out waiting 15000ms for recv operation to complete")


@pytest.mark.parametrize(("error", "error_at", "activity", "reason"), [
    # rank 0 timed out waiting for it, then it was stopped: the rank rank 0 waited for
    (GLOO_TIMEOUT, 1015.0, IN_COMPUTE, "hung"),
    # a peer's closed connection is also what a preemption's staggered SIGTERMs cause
    (RuntimeError("Connection closed by peer [10.0.0.2]:8089"), 1015.0, IN_COMPUTE,
     "interrupted"),
    (GLOO_TIMEOUT, 1015.0, IN_BACKWARD, "interrupted"),  # it waited too
    (GLOO_TIMEOUT, 1017.0, IN_COMPUTE, "interrupted"),  # the timeout came after its signal
])
def test_a_rank_stopped_after_the_others_timed_out_waiting(
        error: Exception, error_at: float, activity: Activity, reason: str) -> None:
    """A process group timeout shorter than the step budget: the waiting rank's collective
    times out before the hung rank counts as stalled, and torchrun then stops it."""
    timed_out = snapshot(10, rank=0, phase="failed",
                         last_error=error_record(error, "step", None, error_at))
    found = verdicts(timed_out, stopped(activity, at=1016.0))
    assert found[0][0] == "peer_failed"
    assert found[1][0] == reason
    if reason == "hung":
        assert found[1][1] == (
            "it was in compute at train.py:285 in step, outside any collective, when rank 0 "
            "timed out waiting for a peer in a collective (RuntimeError: [../third_party/"
            "gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms for "
            "recv operation to complete): the rank the others waited for; then it received "
            "SIGTERM (torchrun stopping it once another rank ended, or the scheduler)")


# NCCL's watchdog, with a process group timeout (30 s) shorter than the step budget (60 s):
# rank 0's all-reduce #38, in flight since 1005 s, passes it; rank 1 never enqueued it.
IN_FLIGHT = PendingCollective(pg="0", seq=38, since=1005.0, timeout=30.0)


def nccl_waiter(at: float = 1034.0, pending: PendingCollective | None = IN_FLIGHT,
                ) -> Snapshot:
    """Rank 0 in a CUDA sync behind its all-reduce, last written at ``at``; not stalled."""
    return waiter(at=at, activity=IN_SYNC, pending=pending, publish_interval=1.0)


def test_a_watchdog_end_within_the_budget_names_the_rank_with_nothing_in_flight() -> None:
    """Neither rank stalled yet, both sampled in compute (CUDA syncs): rank 0 vanished with
    no error once its collective passed the group's timeout; rank 1, with nothing in
    flight, was then stopped by torchrun. On the same evidence at start-up, a rank that
    loads a checkpoint for longer than the timeout while the others wait at a barrier."""
    rank1 = stopped(IN_SYNC, at=1036.0, publish_interval=1.0)
    found = verdicts(nccl_waiter(), rank1)
    assert found[0] == ("peer_failed", (
        "its collective 38 of process group 0 had been in flight 29s at its last snapshot, "
        "and the group's timeout is 30s, then vanished with no error recorded: the process "
        "group's watchdog (NCCL's) ends a rank whose collective outlives the timeout, from "
        "C++ (SIGABRT)"))
    assert found[1] == ("hung", (
        "it was in compute at train.py:290 in step, outside any collective, when rank 0 "
        "vanished with no error (its collective 38 of process group 0 had been in flight "
        "29s at its last snapshot, and the group's timeout is 30s: NCCL's watchdog ends "
        "such a rank): the rank the others waited for; then it received SIGTERM (torchrun "
        "stopping it once another rank ended, or the scheduler)"))


@pytest.mark.parametrize(("rank0", "rank1_pending", "rank0_gone", "reasons"), [
    # killed 14 s before its collective's timeout: not the watchdog
    (nccl_waiter(at=1010.0), None, True, ("killed", "interrupted")),
    # rank 1 had the same collective in flight: it waited too, its watchdog not yet come
    (nccl_waiter(), PendingCollective(pg="0", seq=38, since=1006.0, timeout=30.0), True,
     ("peer_failed", "interrupted")),
    # the timeout not known (a torch without backend options): no judgement on it
    (nccl_waiter(pending=msgspec.structs.replace(IN_FLIGHT, timeout=None)), None, True,
     ("killed", "interrupted")),
    # rank 0 still alive: nobody timed out
    (nccl_waiter(), None, False, (None, "interrupted")),
])
def test_no_watchdog_end_without_a_collective_past_its_timeout(
        rank0: Snapshot, rank1_pending: PendingCollective | None, rank0_gone: bool,
        reasons: tuple[str | None, str]) -> None:
    rank1 = stopped(IN_SYNC, at=1036.0, publish_interval=1.0, pending=rank1_pending)
    found = verdicts(rank0, rank1) if rank0_gone else verdicts(rank1, alive=(rank0,))
    assert (found.get(0, (None,))[0], found[1][0]) == reasons


def collective_at_end(snap: Snapshot, *others: Snapshot) -> str:
    return ExitJudge(None).scrape([], [snap, *others], {}, lambda _: True)[snap.rank].collective


@pytest.mark.parametrize(("snap", "state"), [
    (snapshot(10, rank=0, phase="failed", last_error=error_record(
        GLOO_TIMEOUT, "step", None, 1015.0)), "timed_out"),      # gloo's own timeout
    (nccl_waiter(), "timed_out"),                                # NCCL's watchdog
    (stopped(IN_BACKWARD), "waiting"),                           # seen waiting
    (stopped(IN_SYNC, at=1036.0, pending=PendingCollective(
        pg="0", seq=38, since=1006.0, timeout=30.0)), "waiting"),  # in flight 30 s
    (stopped(IN_COMPUTE), "idle"),
    (stopped(IN_SYNC, at=1036.0, pending=PendingCollective(
        pg="0", seq=38, since=1030.0, timeout=30.0)), "idle"),   # in flight only 6 s
    (stopped(IN_COMPUTE, in_flight_known=False), "unknown"),     # on a GPU: no telling
    (stopped(None), "unknown"),
    (snapshot(10, rank=0, phase="failed", last_error=error_record(
        ValueError("batch 17 has 0 samples"), "step", None, 1015.0)), "unknown"),
])
def test_where_a_rank_stood_with_its_collectives_as_it_ended(snap: Snapshot,
                                                             state: str) -> None:
    """What the rules join across nodes (colossalai_rank_exit_info's ``collective``)."""
    assert collective_at_end(snap) == state


def test_without_the_recorders_status_a_stopped_rank_is_not_named() -> None:
    """A torch that records nothing: a rank in a CUDA sync may have waited too."""
    timed_out = snapshot(10, rank=0, phase="failed",
                         last_error=error_record(GLOO_TIMEOUT, "step", None, 1015.0))
    found = verdicts(timed_out, stopped(IN_SYNC, at=1016.0, in_flight_known=False))
    assert found[1] == ("interrupted", "received SIGTERM")


def test_an_oom_kill_after_a_hang_is_still_the_oom_kill(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text(OOM_RECORDS.format(pid=4242))  # at 2000 s
    exits = ExitJudge(KernelLog(str(log), boot_time=0.0), clock=lambda: 2500.0)
    rank1 = hung_at(1610.0, IN_COMPUTE)
    verdict = exits.scrape([waiter(at=1600.0)], [rank1], {}, lambda snap: True)[1]
    assert verdict.reason == "oom_killed"


@pytest.mark.parametrize(("error", "peer"), [
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                  "peer [127.0.0.1]:8089"), True),
    (RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
                  "reset by peer"), True),
    (RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
                  "OpType=ALLREDUCE) ran for 600008 milliseconds before timing out."), True),
    (RuntimeError("NCCL communicator was aborted on rank 3."), True),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there "
                  "was a network error, NCCL version 2.28.9"), True),
    (RuntimeError("Timed out waiting 1800000ms for recv operation to complete"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB."), False),
    (ValueError("batch 17 has 0 samples"), False),
    (RuntimeError("NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO)"), False),
])
def test_errors_that_say_a_peer_failed(error: Exception, peer: bool) -> None:
    assert is_peer_failure(error) is peer


def test_a_peer_failure_rethrown_with_another_first_line_is_still_one() -> None:
    exc = RuntimeError("step 412 failed")
    exc.__cause__ = RuntimeError("Connection reset by peer")
    assert is_peer_failure(exc)
    assert error_record(exc, "step", None, 0.0).peer


def test_a_phase_change_is_in_the_snapshot_before_the_rank_goes_on(tmp_path: Path) -> None:
    """A rank that freezes holding the GIL at the first step after a checkpoint: its
    publisher never runs again, and its last snapshot must already say training."""
    code = textwrap.dedent("""
        import ctypes, sys
        from pathlib import Path
        from colossalai_exporter import TrainingMonitor
        monitor = TrainingMonitor(serve="none", run_dir=sys.argv[1], step_timeout=30.0,
                                  publish_interval=3600.0)
        with monitor.step():
            pass
        with monitor.checkpoint():
            pass
        with monitor.step():
            Path(sys.argv[1], "frozen").touch()
            ctypes.PyDLL(None).sleep(60)  # a C call holding the GIL: nothing else runs
    """)
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=cli_env())
    try:
        wait_until((tmp_path / "frozen").exists, timeout=60, what="the rank frozen")
        assert read_snapshot(snapshot_path(tmp_path, 0)).phase == "training"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
