"""What the monitor records when training fails: the cause, on disk before the process dies.

Each failure must reach the node agent even when the process ends a moment
later, so these tests read the rank's snapshot file (what the agent reads)
from inside the exception handler, before anything else could publish.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from colossalai_exporter import Budgets, TrainingMonitor
from colossalai_exporter.rankstate.families import families
from colossalai_exporter.rankstate.files import read_snapshot, snapshot_path
from colossalai_exporter.rankstate.schema import Snapshot
from colossalai_exporter.training.errors import first_line
from colossalai_exporter.training.settings import detect_run_id
from conftest import REPO, require, small_tmpfs, wait_until
from test_training_monitor import need_torch, quiet, sample

CUDA_OOM = ("CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total capacity "
            "of 139.80 GiB of which 137.65 GiB is free.\nIncluding non-PyTorch memory …")


def on_disk(tmp_path: Path) -> Snapshot:
    return read_snapshot(snapshot_path(tmp_path, 0))


def test_budgets_are_importable_where_the_docs_import_them() -> None:
    from colossalai_exporter import Budgets as FromRoot
    from colossalai_exporter.training import Budgets as FromTraining

    assert FromRoot is FromTraining is Budgets
    assert Budgets(kernels=60).for_phase("kernels", None) == 60


def test_an_oom_in_a_step_is_on_disk_before_it_propagates(tmp_path: Path) -> None:
    # An hour between publishes: only the exception path can have written the file.
    monitor = quiet(tmp_path, publish_interval=3600)
    try:
        monitor.step_done(0.01)
        seen: list[Snapshot] = []
        with pytest.raises(RuntimeError) as raised:  # noqa: PT012 - the handler reads the file
            try:
                with monitor.step():
                    raise RuntimeError(CUDA_OOM)
            except RuntimeError:
                seen.append(on_disk(tmp_path))
                raise
        assert "CUDA out of memory" in str(raised.value)
    finally:
        monitor.close()
    (snap,) = seen
    assert snap.oom["cuda"] == 1
    error = snap.last_error
    assert error is not None
    assert error.where == "step"
    assert error.type == "RuntimeError"
    assert error.device == "cuda"
    assert error.message == ("CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a "
                                "total capacity of 139.80 GiB of which 137.65 GiB is free.")
    assert sample(snap, "colossalai_training_last_error_info", where="step",
                  device="cuda", type="RuntimeError") == 1
    assert sample(snap, "colossalai_training_last_error_timestamp_seconds") == error.time
    # the time the alert selects, for the device that ran out and no other
    assert snap.oom_last == {"cuda": error.time}
    assert sample(snap, "colossalai_gemini_oom_last_timestamp_seconds",
                  device="cuda") == error.time
    assert sample(snap, "colossalai_gemini_oom_last_timestamp_seconds", device="cpu") is None


FAILURE_TIMES = ("colossalai_gemini_oom_last_timestamp_seconds",
                 "colossalai_checkpoint_last_failure_timestamp_seconds",
                 "colossalai_kernel_build_last_failure_timestamp_seconds")


@pytest.mark.parametrize("outside", [False, True], ids=["rank server", "node agent"])
def test_a_rank_that_never_failed_serves_no_failure_times(tmp_path: Path,
                                                          outside: bool) -> None:
    # The alerts select these times: a healthy fleet must give them nothing to read,
    # while the counters beside them are served at zero.
    monitor = quiet(tmp_path, publish_interval=3600)
    try:
        monitor.step_done(0.01)
        with monitor.checkpoint(step=1), monitor.kernels():
            pass
        snap = monitor.snapshot()
    finally:
        monitor.close()
    served = {s.name for fam in families(snap, outside=outside) for s in fam.samples}
    assert "colossalai_gemini_oom_total" in served
    assert "colossalai_checkpoint_failures_total" in served
    assert served.isdisjoint(FAILURE_TIMES), served & set(FAILURE_TIMES)


def test_a_failed_checkpoint_names_its_exception(tmp_path: Path) -> None:
    monitor = quiet(tmp_path, publish_interval=3600)
    target = tmp_path / "not-a-dir"
    target.write_text("a file where the checkpoint folder should be")
    try:
        with pytest.raises(NotADirectoryError), monitor.checkpoint(step=5):
            (target / "model.pt").write_bytes(b"")
        snap = on_disk(tmp_path)
    finally:
        monitor.close()
    assert snap.checkpoint.failures == 1
    assert snap.checkpoint.last_failure is not None
    assert snap.last_error.time - 1 <= snap.checkpoint.last_failure <= snap.last_error.time
    assert sample(snap, "colossalai_checkpoint_last_failure_timestamp_seconds") == \
        snap.checkpoint.last_failure
    assert snap.last_error.where == "checkpoint"
    assert snap.last_error.type == "NotADirectoryError"
    assert "Not a directory" in snap.last_error.message
    assert snap.last_error.device == ""


def test_a_kernel_build_that_raises_is_counted_and_returns_to_its_phase(tmp_path: Path) -> None:
    monitor = quiet(tmp_path, publish_interval=3600)
    try:
        # A loader that loads another (two blocks) counts once.
        with pytest.raises(AssertionError), monitor.kernels(), monitor.kernels():
            raise AssertionError("No usable kernel found for CPUAdamLoader on the "
                                 "current machine.")
        snap = on_disk(tmp_path)
        assert monitor.snapshot().phase == "init"
    finally:
        monitor.close()
    assert snap.kernel_failures == 1
    assert snap.last_error.where == "kernels"
    assert snap.last_error.type == "AssertionError"
    assert sample(snap, "colossalai_kernel_build_failures_total") == 1
    assert snap.kernel_last_failure is not None
    assert snap.last_error.time - 1 <= snap.kernel_last_failure <= snap.last_error.time
    assert sample(snap, "colossalai_kernel_build_last_failure_timestamp_seconds") == \
        snap.kernel_last_failure


def test_no_snapshot_counts_a_kernel_failure_without_its_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each snapshot written may be the rank's last (killed a moment later): one that
    counts the failure must name the error, or the page says "1 kernel load(s) failed"
    and not why (seen once in a loaded CI run)."""
    monitor = quiet(tmp_path, publish_interval=3600)
    written: list[tuple[int, bool]] = []
    publisher = monitor._publisher
    for name in ("publish", "publish_now"):
        original = getattr(publisher, name)

        def recording(original: Any = original) -> None:
            original()
            snap = on_disk(tmp_path)
            written.append((snap.kernel_failures, snap.last_error is not None))

        monkeypatch.setattr(publisher, name, recording)
    try:
        with pytest.raises(AssertionError), monitor.kernels():
            raise AssertionError("No usable kernel found for CPUAdamLoader")
    finally:
        monitor.close()
    assert (1, True) in written
    assert (1, False) not in written, written


def test_kernels_have_their_own_budget(tmp_path: Path) -> None:
    monitor = quiet(tmp_path, budgets=Budgets(startup=900, kernels=45))
    try:
        with monitor.kernels():
            assert monitor.snapshot().timeout == 45
        assert monitor.snapshot().timeout == 900
    finally:
        monitor.close()


def test_messages_keep_paths_and_lose_url_credentials() -> None:
    assert first_line(OSError("No space left on device: '/ckpt/step-100/model.bin'")) == \
        "No space left on device: '/ckpt/step-100/model.bin'"
    redacted = first_line(RuntimeError(
        "upload to https://bob:hunter2@store.example/ckpt?token=abc&x=1 failed"))
    assert "hunter2" not in redacted and "abc" not in redacted
    assert "https://…@store.example/ckpt?…" in redacted
    assert len(first_line(RuntimeError("x" * 1000))) == 240


def test_the_run_id_is_shared_by_every_rank_of_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("COLOSSALAI_EXPORTER_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "node-0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert detect_run_id() == "node-0:29500"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id
    assert detect_run_id() == "node-0:29500"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert detect_run_id() == "4242"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "llama-70b")
    assert detect_run_id() == "llama-70b"


def test_an_uncaught_exception_fails_the_run_before_the_process_exits(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        from colossalai_exporter import TrainingMonitor
        monitor = TrainingMonitor(serve="none", run_dir={str(tmp_path)!r},
                                  publish_interval=3600, rank=0, world_size=1)
        monitor.step_done(0.01)
        raise MemoryError("host allocation failed")
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO / "exporter")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert "MemoryError: host allocation failed" in done.stderr  # the traceback as before
    snap = on_disk(tmp_path)
    assert snap.phase == "failed"
    assert snap.oom["cpu"] == 1
    assert snap.last_error.where == "run"
    assert snap.error == "MemoryError: host allocation failed"


def test_a_script_that_ends_without_finish_finishes_its_run_at_exit(tmp_path: Path) -> None:
    """The interpreter's normal exit finishes the run (marked so), so the node agent does
    not judge the vanished rank killed; a forked helper's exit does not."""
    script = textwrap.dedent(f"""
        import os, sys
        from colossalai_exporter import TrainingMonitor
        from pathlib import Path
        from colossalai_exporter.rankstate.files import read_snapshot, snapshot_path
        monitor = TrainingMonitor(serve="none", run_dir={str(tmp_path)!r},
                                  publish_interval=3600, rank=0, world_size=1)
        for _ in range(3):
            monitor.step_done(0.01)
        child = os.fork()
        if child == 0:
            sys.exit(0)  # a helper forked by the rank, exiting normally: atexit runs here
        os.waitpid(child, 0)
        monitor.step_done(0.01)  # published: the helper's exit must not have ended the run
        print(read_snapshot(snapshot_path(Path({str(tmp_path)!r}), 0)).phase)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO / "exporter")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["training"]
    snap = on_disk(tmp_path)
    assert (snap.phase, snap.finished_at_exit, snap.steps) == ("finished", True, 4)
    assert snap.last_error is None


def test_a_script_that_exits_after_an_error_it_caught_fails_its_run(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys
        from colossalai_exporter import TrainingMonitor
        monitor = TrainingMonitor(serve="none", run_dir={str(tmp_path)!r},
                                  publish_interval=3600, rank=0, world_size=1)
        monitor.step_done(0.01)
        try:
            with monitor.step():
                raise ValueError("batch 17 has 0 samples")
        except ValueError as exc:
            sys.exit(f"giving up: {{exc}}")
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO / "exporter")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    snap = on_disk(tmp_path)
    assert (snap.phase, snap.finished_at_exit) == ("failed", False)
    assert snap.error == "ValueError: batch 17 has 0 samples"


def test_colossalai_kernel_loads_are_watched_without_user_code(tmp_path: Path) -> None:
    require(importlib.util.find_spec("colossalai") is not None,
            "colossalai 0.5.0 (scripts/install-dev.sh)")
    # A real ColossalAI loader on a machine without CUDA: its load() raises
    # "AssertionError: No usable kernel found for CPUAdamLoader" (FACTS.md).
    script = textwrap.dedent(f"""
        import colossalai
        from colossalai.kernel.kernel_loader import CPUAdamLoader
        from colossalai_exporter import TrainingMonitor
        monitor = TrainingMonitor(serve="none", run_dir={str(tmp_path)!r},
                                  publish_interval=3600, rank=0, world_size=1)
        try:
            CPUAdamLoader().load()
        except AssertionError:
            print("phase after:", monitor.snapshot().phase)
        monitor.close()
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO / "exporter")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "phase after: init" in done.stdout
    snap = on_disk(tmp_path)
    assert snap.kernel_failures == 1
    assert snap.last_error.type == "AssertionError"
    assert "No usable kernel found for CPUAdamLoader" in snap.last_error.message


def test_a_monitor_without_colossalai_leaves_kernel_loading_alone(tmp_path: Path) -> None:
    monitor = TrainingMonitor(serve="none", run_dir=tmp_path, rank=0, world_size=1)
    try:
        if "colossalai" not in sys.modules:
            assert "colossalai.kernel.kernel_loader" not in sys.modules
    finally:
        monitor.close()


def test_a_checkpoint_into_a_full_filesystem_says_it_is_full(tmp_path: Path) -> None:
    torch = need_torch()
    monitor = quiet(tmp_path / "run", publish_interval=3600)
    try:
        with small_tmpfs(tmp_path / "ckpt", full=True) as full:
            target = full / "step-10.pt"
            with pytest.raises(RuntimeError), monitor.checkpoint(step=10, path=target):
                # torch's writer loses the errno: "[enforce fail at inline_container.cc…]
                # unexpected pos …", or "file write failed"
                torch.save(torch.nn.Linear(32, 64).state_dict(), target)
        snap = read_snapshot(snapshot_path(tmp_path / "run", 0))
    finally:
        monitor.close()
    message = snap.last_error.message
    assert message.startswith(f"filesystem full (0 B free of 1.0 MiB at {target}): "), message
    assert "enforce fail" in message or "write failed" in message, message


def test_a_checkpoint_with_room_left_says_nothing_of_space(tmp_path: Path) -> None:
    monitor = quiet(tmp_path, publish_interval=3600)
    try:
        with pytest.raises(PermissionError), monitor.checkpoint(path=tmp_path / "ckpt"):
            raise PermissionError(13, "Permission denied", str(tmp_path / "ckpt"))
        snap = on_disk(tmp_path)
    finally:
        monitor.close()
    assert snap.last_error.message.startswith("[Errno 13] Permission denied")


def test_entering_a_checkpoint_is_on_disk_before_the_save_starts(tmp_path: Path) -> None:
    # A save that freezes the process with the GIL held (torch.save into a hung mount)
    # leaves the publisher no chance: the phase must already be on disk.
    monitor = quiet(tmp_path, publish_interval=3600)
    try:
        monitor.step_done(0.01)
        with monitor.checkpoint(step=1):
            inside = on_disk(tmp_path).phase
        with monitor.kernels():
            building = on_disk(tmp_path).phase
    finally:
        monitor.close()
    assert (inside, building) == ("checkpointing", "kernels")


def test_a_diverged_loss_does_not_stop_the_snapshots(tmp_path: Path) -> None:
    # JSON has no NaN: the file says null, and it keeps being written (before, the
    # writer refused NaN, so the agent saw the rank's snapshot age and called it down).
    monitor = quiet(tmp_path)
    try:
        monitor.step_done(0.01, loss=float("nan"))
        monitor.step_done(0.01, loss=float("nan"))
        wait_until(lambda: on_disk(tmp_path).steps == 2, what="the NaN step on disk")
        assert on_disk(tmp_path).loss is None
        assert monitor.snapshot().monitor_errors.get("publish", 0) == 0
    finally:
        monitor.close()
