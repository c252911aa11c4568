"""TrainingMonitor in one process: steps, phases, budgets, OOMs, loss, checkpoints, failures."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from colossalai_exporter import TrainingMonitor
from colossalai_exporter.rankstate import files as snapfiles
from colossalai_exporter.rankstate.families import families
from colossalai_exporter.rankstate.schema import Snapshot
from colossalai_exporter.rankstate.verdict import judge
from colossalai_exporter.training import Budgets, classify_oom
from colossalai_exporter.training.device_loss import DeviceLossReader
from colossalai_exporter.training.settings import detect_ranks
from colossalai_exporter.training.state import RankState
from conftest import require, wait_until


def quiet(tmp_path: Path, **kwargs: Any) -> TrainingMonitor:
    """A monitor that serves nothing and publishes into ``tmp_path``, quickly."""
    kwargs.setdefault("serve", "none")
    kwargs.setdefault("publish_interval", 0.05)
    return TrainingMonitor(run_dir=tmp_path, **kwargs)


def need_torch() -> Any:
    try:
        import torch
    except ImportError:
        torch = None
    require(torch is not None, "torch (the training extra)")
    return torch


def sample(snap: dict[str, Any], name: str, **labels: str) -> float | None:
    for fam in families(snap):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def test_ranks_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert detect_ranks() == (3, 1, 8)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert detect_ranks() == (0, 0, 1)


def test_with_block_and_plain_call_count_steps(tmp_path: Path) -> None:
    monitor = quiet(tmp_path)
    try:
        assert monitor.snapshot().phase == "init"
        for i in range(3):
            with monitor.step(samples=8, tokens=512) as step:
                step.loss = 1.0 / (i + 1)
        monitor.step_done(0.02, samples=8, loss=0.25)
        monitor.step_done(samples=8)  # duration: since the previous step_done()
        wait_until(lambda: monitor.snapshot().loss == 0.25, what="loss published")
        snap = monitor.snapshot()
        assert snap.phase == "training"
        assert snap.kernels_ready is True  # the first step means kernels loaded
        assert snap.steps == 5
        assert snap.samples == 40
        assert snap.tokens == 1536
        assert sum(snap.step_hist) == 5
        assert sample(snap, "colossalai_training_steps_total", rank="0") == 5
        assert sample(snap, "colossalai_training_step_duration_seconds_count") == 5
        assert sample(snap, "colossalai_training_step_duration_seconds_bucket",
                      le="0.025") == 5
        assert sample(snap, "colossalai_training_loss") == 0.25
    finally:
        monitor.close()


def test_budget_is_learned_with_a_floor_and_can_be_fixed() -> None:
    budgets = Budgets(step_factor=5, step_floor=10, startup=900, checkpoint=300, kernels=400)
    assert budgets.for_phase("init", None) == 900
    assert budgets.for_phase("kernels", None) == 400
    assert budgets.for_phase("training", None) == 900  # no step yet: start-up budget
    assert budgets.for_phase("training", 1.0) == 10  # 5 x 1 s is under the floor
    assert budgets.for_phase("training", 4.0) == 20
    assert budgets.for_phase("checkpointing", 4.0) == 300
    assert Budgets(step=7).for_phase("training", 100.0) == 7


def test_learned_budget_follows_the_longest_recent_step(tmp_path: Path) -> None:
    monitor = quiet(tmp_path, budgets=Budgets(step_factor=5, step_floor=1))
    try:
        for duration in (0.1, 0.4, 0.2):
            monitor.step_done(duration)
        assert monitor.snapshot().timeout == pytest.approx(2.0)
        assert sample(monitor.snapshot(), "colossalai_training_step_timeout_seconds") == \
            pytest.approx(2.0)
    finally:
        monitor.close()


def test_the_budget_after_the_first_step_is_five_times_it(tmp_path: Path) -> None:
    """A pipeline's steps of minutes: the second step's budget is five times the first's
    (the ring once read one slot behind, and gave the floor: a healthy run of long steps
    stalled a minute into its second)."""
    monitor = quiet(tmp_path, budgets=Budgets(step_factor=5, step_floor=60))
    try:
        monitor.step_done(180.0)
        assert monitor.snapshot().timeout == pytest.approx(900.0)
        monitor.step_done(170.0)
        assert monitor.snapshot().timeout == pytest.approx(850.0)  # the first has left
    finally:
        monitor.close()


def test_the_first_step_leaves_the_learned_budget_once_another_is_in(
        tmp_path: Path) -> None:
    """The first step's warm-up (the first compile: minutes) would make the next 127 steps'
    budget five times itself; only the steps after it count, the last 128 of them."""
    monitor = quiet(tmp_path, budgets=Budgets(step_factor=5, step_floor=1))
    try:
        monitor.step_done(300.0)  # the first compile
        for _ in range(3):
            monitor.step_done(0.4)
        assert monitor.snapshot().timeout == pytest.approx(2.0)
        for _ in range(200):  # past the ring: the last 128 steps
            monitor.step_done(0.2)
        assert monitor.snapshot().timeout == pytest.approx(1.0)
    finally:
        monitor.close()


def test_a_forgotten_step_leaves_the_learned_budget() -> None:
    state = RankState(0, 0, 1, 1, None)
    for duration in (9.0, 1.0, 20.0, 2.0):  # the third held an evaluation
        state.recent[state.steps] = duration
        state.steps += 1
    state.forget_step(3)
    assert state.longest_recent_step() == 2.0
    state.forget_step(4)
    state.forget_step(2)
    assert state.longest_recent_step() == 9.0  # only the first is left
    state.forget_step(5)  # not completed yet: nothing to forget
    assert state.recent[4] == 0.0


def test_stall_is_judged_per_phase_against_its_budget() -> None:
    base = RankState(0, 0, 1, 1, None, now=90.0).snapshot(Budgets(), now=90.0)
    base = msgspec.structs.replace(base, phase="training", progress=100.0, timeout=10.0,
                                   kernels_ready=True)

    def like(**changes: Any) -> Snapshot:
        return msgspec.structs.replace(base, **changes)

    assert judge(base, 105.0) == (False, "")
    stalled, reason = judge(base, 111.0)
    assert stalled
    assert reason == "stalled in phase training: no step completed for 11.0s (budget 10.0s)"
    stalled, reason = judge(like(phase="kernels"), 111.0)
    assert stalled
    assert "phase kernels" in reason
    assert judge(like(phase="init"), 105.0) == (False, "phase is init")
    assert judge(like(kernels_ready=False), 105.0) == (False, "kernels not ready")
    assert judge(like(phase="finished"), 1e9) == (False, "run finished")


def test_phases_checkpoint_and_evaluation(tmp_path: Path) -> None:
    monitor = quiet(tmp_path)
    try:
        with monitor.kernels():
            assert monitor.snapshot().phase == "kernels"
            assert monitor.snapshot().kernels_ready is False
        assert monitor.snapshot().kernels_ready is True
        monitor.step_done(0.01)
        with monitor.checkpoint(step=1):
            assert monitor.snapshot().phase == "checkpointing"
            assert monitor.snapshot().checkpoint.in_flight is True
            with monitor.checkpoint(step=99):  # nested (a watched save): counted once
                pass
        snap = monitor.snapshot()
        assert snap.phase == "training"
        assert snap.checkpoint.last_step == 1
        assert snap.checkpoint.last_success is not None
        assert snap.checkpoint.in_flight is False
        with pytest.raises(OSError, match="disk full"), monitor.checkpoint(step=2):
            raise OSError(28, "disk full")
        snap = monitor.snapshot()
        assert snap.checkpoint.failures == 1
        assert snap.checkpoint.last_step == 1
        with monitor.evaluation():
            assert monitor.snapshot().phase == "evaluating"
        assert monitor.snapshot().phase == "training"
        monitor.finish()
        on_disk = json.loads((tmp_path / "rank-0.json").read_text())
        assert on_disk["phase"] == "finished"
        assert sample(monitor.snapshot(), "colossalai_training_phase", phase="finished") == 1
        monitor.phase("training")  # the outcome is final
        assert monitor.snapshot().phase == "finished"
    finally:
        monitor.close()


def test_fail_records_the_reason_and_counts_an_oom_once(tmp_path: Path) -> None:
    monitor = quiet(tmp_path)
    error = RuntimeError("Adjust layout failed! No enough CUDA memory! Need 1024, got 0")
    try:
        with pytest.raises(RuntimeError) as raised, monitor.step():
            raise error
        assert raised.value is error  # re-raised unchanged
        monitor.fail(error)  # the same exception again: not counted twice
        snap = monitor.snapshot()
        assert snap.oom == {"cuda": 1, "cpu": 0, "nvme": 0}
        assert snap.phase == "failed"
        assert snap.steps == 0  # a step that raised did not complete
        assert "Adjust layout failed" in snap.error
        assert snap.reason.startswith("run failed: RuntimeError")
    finally:
        monitor.close()


def test_real_host_oom_is_counted_as_cpu_and_reraised_unchanged(tmp_path: Path) -> None:
    torch = need_torch()
    monitor = quiet(tmp_path)
    try:
        with pytest.raises(RuntimeError) as raised, monitor.step():
            torch.empty(2**45, dtype=torch.uint8)  # 32 TiB: the allocator refuses
        assert "DefaultCPUAllocator: can't allocate memory" in str(raised.value)
        assert classify_oom(raised.value) == "cpu"
        assert monitor.snapshot().oom["cpu"] == 1
        assert sample(monitor.snapshot(), "colossalai_gemini_oom_total", device="cpu") == 1
    finally:
        monitor.close()


def test_loss_tensor_on_cpu_is_converted_off_the_hot_path(tmp_path: Path) -> None:
    torch = need_torch()
    monitor = quiet(tmp_path)
    try:
        with monitor.step() as step:
            step.loss = torch.tensor(2.5, requires_grad=True) * 1
        wait_until(lambda: monitor.snapshot().loss == 2.5, what="tensor loss converted")
    finally:
        monitor.close()


class FakeCuda:
    """The slice of torch's CUDA API that DeviceLossReader uses, with a device it controls.

    Real behaviour mimicked: a copy queued on a stream completes later, when the
    device gets to it (here: when the test calls ``run()``); ``Event.query()``
    says whether it has, without waiting; ``item()`` on a device tensor
    synchronises (here: counted, so a test can require none).
    """

    def __init__(self) -> None:
        self.queued: list[Any] = []
        self.item_reads = 0
        self.waits = 0
        self.cuda = self

    def run(self) -> None:
        """The device executes everything queued so far."""
        for action in self.queued:
            action()
        self.queued.clear()

    # torch.cuda
    class Stream:
        def __init__(self, device: Any) -> None:
            self.device = device

        def wait_stream(self, other: Any) -> None:
            pass  # ordering only: the fake device runs everything in queue order

    def default_stream(self, device: Any) -> Any:
        return self.Stream(device)

    def stream(self, stream: Any) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def Event(self) -> Any:
        fake = self

        class Event:
            done = False

            def record(self, stream: Any) -> None:
                fake.queued.append(lambda: setattr(self, "done", True))

            def query(self) -> bool:
                return self.done

        return Event()

    # torch
    def empty(self, shape: Any, dtype: Any, pin_memory: bool) -> Any:
        assert pin_memory
        fake = self

        class Host:
            value = float("nan")

            def copy_(self, source: Any, non_blocking: bool) -> None:
                assert non_blocking
                fake.queued.append(lambda: setattr(self, "value", source.value))

            def item(self) -> float:
                return self.value

        return Host()


class DeviceTensor:
    """Stands in for a one-element CUDA tensor: a ``device`` of type "cuda".

    Its value exists only once the fake device has run; ``item()`` would
    synchronise, so it counts the reads.
    """

    class device:  # mimics the tensor attribute torch.device
        type = "cuda"

    dtype = "float32"

    def __init__(self, value: float, cuda: FakeCuda | None = None) -> None:
        self.value = value
        self.reads = 0

    def detach(self) -> DeviceTensor:
        return self

    def reshape(self, shape: Any) -> DeviceTensor:
        return self

    def numel(self) -> int:
        return 1

    def item(self) -> float:
        self.reads += 1
        return self.value


def test_a_device_loss_is_copied_without_waiting_for_the_device() -> None:
    cuda = FakeCuda()
    reader = DeviceLossReader(torch=cuda)
    first = DeviceTensor(1.5)
    reader.submit(first)
    assert reader.poll() is None  # the device has not run the copy yet: no value, no wait
    reader.submit(DeviceTensor(2.5))  # handed over while the first copy is in flight
    reader.submit(newest := DeviceTensor(3.5))  # replaces the waiting one
    cuda.run()
    assert reader.poll() == 1.5  # the first copy completed; the newest one now queued
    assert reader.poll() is None
    cuda.run()
    assert reader.poll() == 3.5
    assert first.reads == newest.reads == 0  # never item() on the device tensor
    reader.submit(2.0)  # numbers and CPU values are read at once
    assert reader.poll() == 2.0


def test_a_device_loss_is_read_with_item_only_when_asked(tmp_path: Path) -> None:
    eager = quiet(tmp_path / "eager", loss_from_device=True)
    try:
        eager_loss = DeviceTensor(3.5)
        eager.step_done(0.01, loss=eager_loss)
        wait_until(lambda: eager.snapshot().loss == 3.5, what="device loss read")
        assert eager_loss.reads >= 1
    finally:
        eager.close()


def test_a_loss_on_another_accelerator_says_how_to_read_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class XpuTensor(DeviceTensor):
        class device:
            type = "xpu"

    monitor = quiet(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, "colossalai_exporter.training"):
            monitor.step_done(0.01, loss=XpuTensor(1.0))
            monitor.close()
    finally:
        monitor.close()
    assert "loss_from_device=True" in caplog.text
    assert monitor.snapshot().loss is None


def test_non_numeric_loss_warns_once_and_training_continues(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    monitor = quiet(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, "colossalai_exporter.training"):
            for _ in range(3):
                with monitor.step() as step:
                    step.loss = "not a number"
                monitor.close()  # publishes once more, synchronously
            monitor.step_done(0.01, loss=float("nan"))
            monitor.close()
        snap = monitor.snapshot()
        assert snap.steps == 4
        assert snap.monitor_errors["loss"] >= 1
        assert math.isnan(snap.loss)  # a diverged loss is a value, not an error
        warnings = [r for r in caplog.records if "loss not recorded" in r.getMessage()]
        assert len(warnings) == 1
        assert "got str" in warnings[0].getMessage()
    finally:
        monitor.close()


def test_a_failing_integration_hook_never_reaches_training(tmp_path: Path) -> None:
    monitor = quiet(tmp_path)

    def broken(state: object) -> None:
        raise RuntimeError("hook bug")

    try:
        monitor.add_poller(broken)
        monitor.step_done(0.01)
        wait_until(lambda: monitor.snapshot().monitor_errors.get("hook", 0) >= 1,
                   what="hook error counted")
        monitor.step_done(0.01)
        assert monitor.snapshot().steps == 2
    finally:
        monitor.close()


def test_unwritable_run_dir_warns_and_training_continues(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, "colossalai_exporter.training"):
        monitor = TrainingMonitor(run_dir=blocker / "run", serve="none")
    try:
        assert monitor.run_dir is None
        monitor.step_done(0.01)
        assert monitor.snapshot().steps == 1
        assert any("not writable" in r.getMessage() and "training continues" in r.getMessage()
                   for r in caplog.records)
    finally:
        monitor.close()


def test_snapshot_file_is_replaced_atomically_and_on_phase_change(tmp_path: Path) -> None:
    monitor = quiet(tmp_path, publish_interval=30)  # only phase changes publish now
    try:
        path = tmp_path / "rank-0.json"
        wait_until(path.exists, what="first snapshot")
        monitor.phase("evaluating")
        wait_until(lambda: json.loads(path.read_text())["phase"] == "evaluating",
                   what="snapshot on phase change")
        assert not list(tmp_path.glob(".*.tmp"))
    finally:
        monitor.close()


def test_package_root_and_node_side_never_import_torch() -> None:
    import subprocess
    import sys

    from conftest import cli_env

    code = ("import sys, colossalai_exporter, colossalai_exporter.node.ranks\n"
            "from colossalai_exporter import TrainingMonitor\n"
            "TrainingMonitor(serve='none', run_dir=None).close()\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_a_rank_that_serves_nothing_caps_its_steps_at_the_budget_too(tmp_path: Path) -> None:
    """The cap comes from the snapshot the publisher builds, not only from a scrape of
    rank 0's server: an overrunning step on any rank counts its budget, not its stall."""
    monitor = quiet(tmp_path, step_timeout=5.0)  # serves nothing: no scrape ever asks
    path = snapfiles.snapshot_path(tmp_path, monitor.rank)
    try:
        monitor.step_done(2.0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the publisher has seen the training phase
            if path.exists() and snapfiles.read_snapshot(path).steps == 1:
                break
            time.sleep(0.02)
        monitor.step_done(60.0)  # overran: 5 s of step, 55 s of stall
    finally:
        monitor.close()  # publishes a last snapshot
    assert snapfiles.read_snapshot(path).productive == pytest.approx(2 + 5)


def test_productive_and_checkpointed_seconds_for_goodput(tmp_path: Path) -> None:
    """Productive seconds: completed steps, each up to the stall budget the publisher
    last computed; checkpointed seconds: the part the last good checkpoint saved."""
    monitor = quiet(tmp_path, step_timeout=5.0)
    try:
        monitor.step_done(2.0)
        monitor.step_done(3.0)
        assert monitor.snapshot().timeout == 5.0  # the publisher's view: cap now 5 s
        monitor.step_done(60.0)  # overran its budget: 5 s of step, 55 s of stall
        with monitor.checkpoint(step=3):
            monitor.step_done(1.0)  # (a step inside the save is not in it)
        monitor.step_done(4.0)
        with pytest.raises(OSError, match="disk full"), monitor.checkpoint(step=5):
            raise OSError("disk full")
        snap = monitor.snapshot()
    finally:
        monitor.close()
    assert snap.productive == pytest.approx(2 + 3 + 5 + 1 + 4)
    assert snap.checkpointed == pytest.approx(2 + 3 + 5)  # the failed save kept nothing
    assert sample(snap, "colossalai_training_productive_seconds_total") == \
        pytest.approx(15.0)
    assert sample(snap, "colossalai_training_checkpointed_seconds_total") == \
        pytest.approx(10.0)
    assert sample(snap, "colossalai_training_start_timestamp_seconds") == snap.created


def test_settings_resolve_the_options_against_the_environment(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from colossalai_exporter.training.settings import MonitorSettings

    for name, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                        "COLOSSALAI_EXPORTER_PORT": "9100", "COLOSSALAI_EXPORTER_SERVE": "local",
                        "STEP_HEARTBEAT_URL": "https://hb.example/step", "NVME_PATH": "/nvme",
                        "TORCHELASTIC_RUN_ID": "llama-70b",
                        "COLOSSALAI_EXPORTER_HOST": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    settings = MonitorSettings.resolve(run_dir=tmp_path, step_timeout=30.0)
    assert (settings.rank, settings.local_rank, settings.world_size) == (3, 1, 8)
    assert (settings.serve, settings.serves, settings.server_port) == ("local", True, 9101)
    assert settings.host == "127.0.0.1"  # the rank server kept on loopback
    assert settings.run_dir == tmp_path and settings.run_id == "llama-70b"
    assert settings.budgets.step == 30.0 and settings.nvme_paths == ("/nvme",)
    assert settings.step_heartbeat_url is None  # rank 3: only rank 0 sends by default
    assert MonitorSettings.resolve(heartbeat_all_ranks=True).step_heartbeat_url == \
        "https://hb.example/step"
    # what is given wins over the environment; a serve mode that does not exist serves none
    given = MonitorSettings.resolve(rank=0, port=8000, serve="everywhere", run_dir=False,
                                    host="::1")
    assert (given.rank, given.port, given.serve, given.serves, given.run_dir, given.host) == (
        0, 8000, "none", False, None, "::1")
    monitor = quiet(tmp_path, rank=0, start=False)
    assert monitor.settings.rank == monitor.rank == 0




def test_the_end_of_a_wait_for_the_others_is_progress(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Released from a long wait (another rank's evaluation of its own), a rank does the
    rest of its step while ranks not yet released wait for it: judged from its last step
    it would be stalled and outside any collective, as the rank a hang waits for is. The
    wait's end starts the stall's clock again; a rank that froze after it is stalled a
    budget later. Waiting itself is no progress."""
    from types import SimpleNamespace

    from colossalai_exporter.rankstate.schema import Activity
    from colossalai_exporter.training import state as state_module

    budget = 10.0
    monitor = quiet(tmp_path, publish_interval=30.0, budgets=Budgets(step=budget))
    compute = Activity(kind="compute", frame="train.py:40 in step")
    waiting = Activity(kind="collective", frame="train.py:38 in step",
                       collective="all_reduce")
    place = [compute]
    monitor._where = lambda: place[0]  # type: ignore[method-assign]
    try:
        with monitor.step():
            pass
        # The snapshots' clock, moved by the test: the judgement is of time, not speed.
        clock = [time.time() + budget + 1.0]
        monkeypatch.setattr(state_module, "time", SimpleNamespace(time=lambda: clock[0]))
        snap = monitor.snapshot()
        assert snap.stalled and snap.activity == compute  # never waited: the culprit's place
        place[0] = waiting
        clock[0] += 30.0
        snap = monitor.snapshot()
        assert snap.stalled and snap.activity == waiting  # waiting is no progress
        place[0] = compute  # released: the rest of its step
        clock[0] += 0.5
        released = clock[0]
        snap = monitor.snapshot()
        assert not snap.stalled and snap.progress == released, snap
        clock[0] += budget - 0.5
        assert not monitor.snapshot().stalled
        clock[0] += 1.0  # frozen after its wait: stalled a budget after it
        snap = monitor.snapshot()
        assert snap.stalled and snap.activity == compute, snap
        assert snap.progress == released
    finally:
        monitor.close()
