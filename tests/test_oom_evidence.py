"""The node's evidence of kernel OOM kills (colossalai_exporter.node.oom).

The kernel log is read from the records in tests/fixtures/kmsg/ (one real capture,
the rest written from the kernel's format strings; the README there names the
sources), the cgroup and vmstat counters from fake /proc and /sys/fs/cgroup trees.
One test (slow, root, cgroup v1) has the kernel kill a process for real.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colossalai_exporter.node.oom import (
    KernelLog,
    MemoryCgroup,
    OomKill,
    cgroup_oom_kills,
    describe,
    memory_cgroup,
    vmstat_oom_kills,
)
from conftest import cli_env, limited_memory_cgroup, require, wait_until

FIXTURES = Path(__file__).parent / "fixtures" / "kmsg"
BOOT = 1_700_000_000.0
MIB = 1024 * 1024
POD = ("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod5f1c2e3a_7b4d_4c1e_"
       "9a2f_0d3e4c5b6a7f.slice/cri-containerd-9b2e4f0c1d7a.scope")


def kills_in(name: str) -> list[OomKill]:
    log = KernelLog(str(FIXTURES / name), boot_time=BOOT)
    try:
        kills = log.poll()
        assert log.readable is True and log.problem == ""
        return kills
    finally:
        log.close()


def test_real_memcg_kill_on_linux_6_18() -> None:
    assert kills_in("oom-kill-memcg-v1-linux-6.18.kmsg") == [OomKill(
        pid=819, task="python3", time=pytest.approx(BOOT + 6172.625307),  # type: ignore[arg-type]
        constraint="memcg", memcg="/slurm_job_4242", task_memcg="/slurm_job_4242",
        anon_rss_bytes=101888 * 1024, file_rss_bytes=6376 * 1024, shmem_rss_bytes=0,
        total_vm_bytes=426168 * 1024, group=False)]


def test_memcg_kill_on_linux_4_19_has_the_task_and_the_limit_cgroup() -> None:
    [kill] = kills_in("oom-kill-memcg-linux-4.19.kmsg")
    assert (kill.pid, kill.task, kill.constraint) == (4321, "python", "memcg")
    assert kill.memcg == "/slurm/uid_1000/job_77"
    assert kill.task_memcg == "/slurm/uid_1000/job_77/step_0/task_1"
    assert (kill.total_vm_bytes, kill.anon_rss_bytes) == (20049380 * 1024, 4180000 * 1024)
    assert (kill.file_rss_bytes, kill.shmem_rss_bytes, kill.group) == (12000 * 1024, 0, False)
    assert kill.time == pytest.approx(BOOT + 86400.112420)
    assert describe(kill) == "memory cgroup /slurm/uid_1000/job_77 at its limit, anon-rss 4.0 GiB"


def test_global_kill_on_linux_4_19_names_the_child_killed_in_the_chosen_ones_place() -> None:
    [kill] = kills_in("oom-kill-global-linux-4.19.kmsg")
    assert (kill.pid, kill.task, kill.constraint, kill.memcg, kill.task_memcg) == (
        5123, "python", "global", "", "")
    assert (kill.anon_rss_bytes, kill.shmem_rss_bytes) == (59600000 * 1024, 1024 * 1024)


def test_global_kill_on_linux_5_15() -> None:
    [kill] = kills_in("oom-kill-global-linux-5.15.kmsg")
    assert (kill.pid, kill.task, kill.constraint, kill.memcg) == (23456, "python", "global", "")
    assert kill.task_memcg == "/user.slice/user-1000.slice/session-4.scope"
    assert (kill.group, kill.anon_rss_bytes) == (False, 12897485 * 1024)
    assert describe(kill) == "the node out of memory (no cgroup limit), anon-rss 12.3 GiB"


def test_group_kill_on_cgroup_v2_is_every_process_of_the_container_once() -> None:
    kills = kills_in("oom-group-kill-cgroup-v2-linux-6.8.kmsg")
    assert [(kill.pid, kill.task) for kill in kills] == [
        (7001, "python3"), (7000, "torchrun"), (7002, "python3")]
    for kill in kills:
        assert (kill.group, kill.constraint, kill.memcg, kill.task_memcg) == (
            True, "memcg", POD, POD)
    assert kills[0].anon_rss_bytes == 16500000 * 1024  # the first victim's own line
    assert describe(kills[2]) == (f"memory cgroup {POD} at its limit, anon-rss 937.5 MiB, "
                                  f"with every process of cgroup {POD} (memory.oom.group)")


def test_noise_and_cut_records_are_not_kills() -> None:
    kills = kills_in("noise-and-truncated.kmsg")
    assert [kill.pid for kill in kills] == [222, 4242]
    # pid 111's summary, an unrelated record between: not 222's cgroup
    assert (kills[0].constraint, kills[0].memcg, kills[0].task_memcg) == ("memcg", "", "")
    assert (kills[1].task, kills[1].total_vm_bytes) == ("python3", 2 * MIB)
    assert kills[1].anon_rss_bytes is kills[1].file_rss_bytes is None


def test_every_cut_of_every_record_and_garbage_never_raise(tmp_path: Path) -> None:
    lines = [line for fixture in sorted(FIXTURES.glob("*.kmsg"))
             for line in fixture.read_bytes().splitlines()]
    rng = random.Random(4242)
    with (tmp_path / "cuts.kmsg").open("wb") as f:
        for line in lines:
            for end in range(len(line) + 1):
                f.write(line[:end] + b"\n")
        for _ in range(2000):
            f.write(bytes(rng.randrange(256) for _ in range(rng.randrange(80))) + b"\n")
    log = KernelLog(str(tmp_path / "cuts.kmsg"), boot_time=BOOT)
    kills = log.poll()
    assert log.readable is True
    assert {kill.pid for kill in kills} >= {819, 4321, 5123, 23456, 7000, 7001, 7002}
    log.close()


def test_second_poll_returns_only_new_kills(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_bytes((FIXTURES / "oom-kill-memcg-linux-4.19.kmsg").read_bytes())
    log = KernelLog(str(path), boot_time=BOOT)
    assert log.readable is None
    assert [kill.pid for kill in log.poll()] == [4321]
    assert log.poll() == []
    real = (FIXTURES / "oom-kill-memcg-v1-linux-6.18.kmsg").read_bytes()
    with path.open("ab") as f:  # a kill record written half before a poll, half after
        f.write(real[:-40])
    assert log.poll() == []
    with path.open("ab") as f:
        f.write(real[-40:])
    [kill] = log.poll()
    assert (kill.pid, kill.memcg) == (819, "/slurm_job_4242")  # its summary came a poll before
    assert log.poll() == []
    log.close()


def test_poll_never_blocks_on_a_quiet_device(tmp_path: Path) -> None:
    """/dev/kmsg answers EAGAIN when no record is left, as a FIFO with a writer does."""
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    log = KernelLog(str(fifo), boot_time=BOOT)
    try:
        start = time.monotonic()
        assert log.poll() == []
        os.write(writer, (FIXTURES / "oom-kill-global-linux-5.15.kmsg").read_bytes())
        assert [kill.pid for kill in log.poll()] == [23456]
        assert log.poll() == []
        assert log.readable is True
        assert time.monotonic() - start < 5
    finally:
        log.close()
        os.close(writer)


def test_constraints_named_by_the_summary_and_by_the_message(tmp_path: Path) -> None:
    records = []
    for pid, constraint in ((1, "CONSTRAINT_CPUSET"), (2, "CONSTRAINT_MEMORY_POLICY"),
                            (3, "CONSTRAINT_BPF")):
        records += [f"6,{pid},{pid}000,-;oom-kill:constraint={constraint},nodemask=0,2,cpuset=/,"
                    f"mems_allowed=0,2,global_oom,task_memcg=/a,task=py, thon,pid={pid},uid=0",
                    f"3,{pid},{pid}001,-;Out of memory: Killed process {pid} (py, thon)"]
    records.append("3,9,9000,-;Out of memory (oom_kill_allocating_task): Killed process 4 (x)")
    records.append("3,10,9001,-;Killed process 5 (x) total-vm:1kB, anon-rss:1kB")
    (tmp_path / "kmsg").write_text("\n".join(records) + "\n")
    kills = KernelLog(str(tmp_path / "kmsg"), boot_time=BOOT).poll()
    assert [(kill.pid, kill.constraint, kill.task_memcg) for kill in kills] == [
        (1, "cpuset", "/a"), (2, "mempolicy", "/a"), (3, "bpf", "/a"), (4, "global", ""),
        (5, "", "")]
    assert kills[0].task == "py, thon"
    assert [describe(kill).split(",")[0] for kill in kills] == [
        "the memory nodes of its cpuset out of memory",
        "the memory nodes of its NUMA policy out of memory",
        "out of memory (bpf)", "the node out of memory (no cgroup limit)",
        "out of memory (the kernel log does not say where)"]


def test_missing_log(tmp_path: Path) -> None:
    log = KernelLog(str(tmp_path / "kmsg"))
    assert log.poll() == []
    assert log.readable is False
    assert log.problem == (f"{tmp_path / 'kmsg'} does not exist "
                           "(a container without the host's /dev/kmsg)")


def test_log_without_read_permission(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_bytes((FIXTURES / "oom-kill-global-linux-5.15.kmsg").read_bytes())
    path.chmod(0)
    if os.access(path, os.R_OK):
        pytest.skip("root reads a file of mode 000; test_log_that_is_a_directory covers errors")
    log = KernelLog(str(path))
    assert log.poll() == []
    assert (log.readable, log.problem) == (False, f"permission denied: {path} is not readable "
                                                  "by this user")


def test_log_that_is_a_directory(tmp_path: Path) -> None:
    log = KernelLog(str(tmp_path))
    assert log.poll() == []
    assert log.readable is False
    assert log.problem == f"cannot read {tmp_path}: Is a directory"
    assert "\n" not in log.problem
    log.close()


def fake_proc(tmp_path: Path, pid: int, cgroup: str) -> str:
    (tmp_path / "proc" / str(pid)).mkdir(parents=True)
    (tmp_path / "proc" / str(pid) / "cgroup").write_text(cgroup)
    return str(tmp_path / "proc")


def control_file(directory: Path, name: str, text: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text)


def test_cgroup_v1_memory_controller(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, 42, "9:name=systemd:/\n4:memory:/slurm_job_4242\n0::/\n")
    sys_root = tmp_path / "cgroup"
    control_file(sys_root / "memory" / "slurm_job_4242", "memory.oom_control",
                 "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    cgroup = memory_cgroup(42, proc, str(sys_root))
    assert cgroup == MemoryCgroup(1, "/slurm_job_4242", str(sys_root / "memory/slurm_job_4242"))
    assert cgroup_oom_kills(cgroup) == (3, 0)


def test_cgroup_v2(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, 42, "0::/kubepods/pod1/ctr\n")
    sys_root = tmp_path / "cgroup"
    control_file(sys_root / "kubepods/pod1/ctr", "memory.events",
                 "low 0\nhigh 0\nmax 5\noom 2\noom_kill 2\noom_group_kill 1\n")
    cgroup = memory_cgroup(42, proc, str(sys_root))
    assert cgroup == MemoryCgroup(2, "/kubepods/pod1/ctr", str(sys_root / "kubepods/pod1/ctr"))
    assert cgroup_oom_kills(cgroup) == (2, 1)
    (sys_root / "kubepods/pod1/ctr/memory.events").write_text("low 0\nhigh 0\nmax 5\noom 2\n"
                                                             "oom_kill 2\n")  # before 5.x
    assert cgroup_oom_kills(cgroup) == (2, 0)


def test_hybrid_host_prefers_v1_memory_and_finds_v2_memory_under_unified(tmp_path: Path) -> None:
    sys_root = tmp_path / "cgroup"
    control_file(sys_root / "memory/job", "memory.oom_control", "oom_kill 1\n")
    control_file(sys_root / "unified/job", "cgroup.procs", "42\n")  # no memory controller
    proc = fake_proc(tmp_path, 42, "4:memory:/job\n1:name=systemd:/job\n0::/job\n")
    assert memory_cgroup(42, proc, str(sys_root)) == MemoryCgroup(
        1, "/job", str(sys_root / "memory/job"))
    # memory not bound to v1: cgroup2 at unified/ counts only where it has memory.events
    (tmp_path / "proc/42/cgroup").write_text("1:name=systemd:/job\n0::/job\n")
    assert memory_cgroup(42, proc, str(sys_root)) is None
    control_file(sys_root / "unified/job", "memory.events", "oom_kill 4\noom_group_kill 0\n")
    cgroup = memory_cgroup(42, proc, str(sys_root))
    assert cgroup == MemoryCgroup(2, "/job", str(sys_root / "unified/job"))
    assert cgroup_oom_kills(cgroup) == (4, 0)


def test_gone_process_removed_cgroup_and_foreign_namespace(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, 42, "0::/../../other/ctr\n")  # outside our cgroup namespace
    sys_root = tmp_path / "cgroup"
    control_file(tmp_path / "other/ctr", "memory.events", "oom_kill 1\n")
    assert memory_cgroup(42, proc, str(sys_root)) is None
    assert memory_cgroup(43, proc, str(sys_root)) is None  # no such process
    assert cgroup_oom_kills(MemoryCgroup(2, "/gone", str(sys_root / "gone"))) is None
    control_file(sys_root / "memory/old", "memory.oom_control", "oom_kill_disable 0\n")
    assert cgroup_oom_kills(MemoryCgroup(1, "/old", str(sys_root / "memory/old"))) is None


def test_vmstat_oom_kills(tmp_path: Path) -> None:
    assert vmstat_oom_kills(str(tmp_path)) is None
    (tmp_path / "vmstat").write_text("nr_free_pages 123\noom_kill 7\nnr_dirty 0\n")
    assert vmstat_oom_kills(str(tmp_path)) == 7
    (tmp_path / "vmstat").write_text("nr_free_pages 123\n")  # a kernel before 4.13
    assert vmstat_oom_kills(str(tmp_path)) is None


def test_describe_without_cgroup_or_sizes() -> None:
    kill = OomKill(pid=1, task="python", time=0.0, constraint="memcg", memcg="", task_memcg="",
                   anon_rss_bytes=None, file_rss_bytes=None, shmem_rss_bytes=None,
                   total_vm_bytes=None, group=True)
    assert describe(kill) == ("memory cgroup (unknown) at its limit, "
                              "with every process of cgroup (unknown) (memory.oom.group)")


def test_the_module_imports_neither_torch_nor_anything_outside_the_standard_library() -> None:
    code = ("import sys; before = set(sys.modules); import colossalai_exporter.node.oom; "
            "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
            "print(sorted(new - set(sys.stdlib_module_names)))")
    out = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip() == "['colossalai_exporter']"


@pytest.mark.slow
def test_real_kernel_oom_kill_in_a_v1_memory_cgroup() -> None:
    ns_pids = [line for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("NSpid:")]
    require(not ns_pids or len(ns_pids[0].split()) == 2,
            "the initial pid namespace (the kernel logs pids as seen there)")
    with limited_memory_cgroup(64 * MIB) as cgroup:
        log = KernelLog()
        log.poll()  # the backlog: afterwards only new kills
        assert log.readable, log.problem
        vmstat_before = vmstat_oom_kills()
        assert vmstat_before is not None
        proc = None
        try:
            memory = MemoryCgroup(1, f"/{cgroup.name}", str(cgroup))
            assert cgroup_oom_kills(memory) == (0, 0)
            proc = subprocess.Popen(["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec '
                                     f'{sys.executable} -c "x = bytearray(400*1024*1024)"'])
            assert proc.wait(timeout=30) == -9
            seen: list[OomKill] = []

            def ours() -> list[OomKill]:
                seen.extend(log.poll())
                return [kill for kill in seen if kill.pid == proc.pid]

            [kill] = wait_until(ours, timeout=10, what=f"the kernel log's kill of pid {proc.pid}")
            assert (kill.constraint, kill.memcg, kill.group) == ("memcg", f"/{cgroup.name}", False)
            assert kill.anon_rss_bytes
            assert abs(kill.time - time.time()) < 60
            assert cgroup_oom_kills(memory) == (1, 0)
            vmstat_after = vmstat_oom_kills()
            assert vmstat_after is not None and vmstat_after >= vmstat_before + 1
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()
