"""Work the monitor is not told of (training/unannounced.py): a rank with no step for a
while whose training thread is in torch.save or an upload is in phase checkpointing,
one whose watched model is in eval mode is in phase evaluating, and one in
torch.compile's compiler is in phase compiling, from its last step, with that phase's
budget, until its next step or the work's end; between steps or inside one."""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import io
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from colossalai_exporter import Budgets, TrainingMonitor
from colossalai_exporter.rankstate.files import read_snapshot, snapshot_path
from colossalai_exporter.rankstate.schema import Snapshot
from colossalai_exporter.training import activity, unannounced
from conftest import require, wait_until

IDLE = 0.3  # the least idle time that counts, shortened for the test (10 s shipped)


@pytest.fixture
def short_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(unannounced, "MIN_IDLE_SECONDS", IDLE)


def watched(tmp_path: Path, model: Any) -> TrainingMonitor:
    monitor = TrainingMonitor(serve="none", run_dir=tmp_path, publish_interval=0.05,
                              record_signals=False,
                              budgets=Budgets(step=60.0, evaluation=900.0,
                                              checkpoint=1200.0))
    monitor.watch(SimpleNamespace(), model)  # a booster with no plugin: nothing to hook
    for _ in range(3):
        with monitor.step():
            pass
    return monitor


def on_disk(tmp_path: Path) -> Snapshot:
    return read_snapshot(snapshot_path(tmp_path, 0))


def publishes(tmp_path: Path, count: int) -> None:
    """Wait for ``count`` more snapshots to be written (each publish checks the mode)."""
    seen = [on_disk(tmp_path).written]

    def written() -> bool:
        now = on_disk(tmp_path).written
        if now != seen[-1]:
            seen.append(now)
        return len(seen) > count

    wait_until(written, timeout=30, interval=0.01, what=f"{count} publishes")


def since_last_step_with_budget(snap: Snapshot, budget: float) -> None:
    assert snap.last_step is not None
    assert snap.phase_start == snap.last_step  # from the last step on
    assert snap.timeout == budget and not snap.stalled


def back_to_training_at_the_next_step(monitor: TrainingMonitor, tmp_path: Path) -> None:
    with monitor.step():
        pass
    assert on_disk(tmp_path).phase == "training"  # written by the step's thread


def test_an_evaluation_in_eval_mode_is_phase_evaluating_until_the_next_step(
        tmp_path: Path, short_idle: None) -> None:
    model = SimpleNamespace(training=True)
    monitor = watched(tmp_path, model)
    try:
        model.training = False  # model.eval(): the validation loop begins
        wait_until(lambda: on_disk(tmp_path).phase == "evaluating", timeout=30,
                   interval=0.02, what="phase evaluating")
        since_last_step_with_budget(on_disk(tmp_path), 900.0)  # evaluation's
        model.training = True  # model.train(), then the next step
        back_to_training_at_the_next_step(monitor, tmp_path)
    finally:
        monitor.close()


def save_slowly(tmp_path: Path) -> Snapshot:
    """torch.save on the training thread into a file that takes a while to write (a slow
    filesystem): its write waits, inside torch.save, until the snapshot says
    checkpointing; that snapshot."""
    require(importlib.util.find_spec("torch") is not None, "torch (scripts/install-dev.sh)")
    import torch

    seen: list[Snapshot] = []

    class SlowFile(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            if not seen:
                wait_until(lambda: on_disk(tmp_path).phase == "checkpointing", timeout=30,
                           interval=0.02, what="phase checkpointing during torch.save")
                seen.append(on_disk(tmp_path))
            return len(memoryview(data).cast("B"))

    torch.save({"weight": torch.zeros(4)}, SlowFile())
    return seen[0]


def test_a_save_outside_a_step_is_phase_checkpointing_until_the_next_step(
        tmp_path: Path, short_idle: None) -> None:
    """The tutorial's save without monitor.checkpoint(), into a slow filesystem."""
    monitor = watched(tmp_path, SimpleNamespace(training=True))
    try:
        seen = save_slowly(tmp_path)
        since_last_step_with_budget(seen, 1200.0)  # the checkpoint budget
        assert seen.checkpoint.last_success is None  # not counted: outcome unknown
        back_to_training_at_the_next_step(monitor, tmp_path)
    finally:
        monitor.close()


def test_a_recompile_within_a_step_is_phase_compiling_until_the_next_step(
        tmp_path: Path, short_idle: None) -> None:
    """torch.compile recompiling in a step (new shapes: a guard failed): a backend as slow
    as inductor on a large graph, which waits until the snapshot says compiling. Its
    budget is the compile budget, from the rank's last step; the next step trains."""
    require(importlib.util.find_spec("torch") is not None, "torch (scripts/install-dev.sh)")
    import torch

    monitor = TrainingMonitor(serve="none", run_dir=tmp_path, publish_interval=0.05,
                              record_signals=False,
                              budgets=Budgets(step=60.0, compile=900.0))
    seen: list[Snapshot] = []

    def slow_backend(gm: Any, example_inputs: Any) -> Any:
        if not seen:
            wait_until(lambda: on_disk(tmp_path).phase == "compiling", timeout=30,
                       interval=0.02, what="phase compiling during the compile")
            seen.append(on_disk(tmp_path))
        return gm.forward

    torch._dynamo.reset()
    try:
        for _ in range(3):
            with monitor.step():
                pass
        with monitor.step():
            torch.compile(torch.nn.Linear(8, 8), backend=slow_backend)(torch.randn(4, 8))
            compiled_at = time.time()
            # The rest of the step, out of the compiler: training, with the step's budget
            # from when the compile ended.
            wait_until(lambda: on_disk(tmp_path).phase == "training", timeout=30,
                       interval=0.02, what="back to training once the compile is over")
            after = on_disk(tmp_path)
        since_last_step_with_budget(seen[0], 900.0)  # the compile budget
        assert seen[0].steps == 3  # the step that compiled is still in flight
        assert after.steps == 3 and after.timeout == 60.0, after
        assert after.phase_start >= compiled_at - 0.5, (after.phase_start, compiled_at)
        back_to_training_at_the_next_step(monitor, tmp_path)
    finally:
        monitor.close()
        torch._dynamo.reset()


def test_an_epochs_data_loader_start_is_phase_data_start_until_its_first_batch(
        tmp_path: Path, short_idle: None) -> None:
    """The second epoch's iterator takes its time for its first batch (workers started
    again, shards opened), past the idle time, outside any step: phase data_start, with
    its budget, from the rank's last step; once the batch is in, training again with
    the step's budget from then. A later batch that takes as long stays training: a data
    loader that stops giving batches mid-epoch is a hang within the step's budget."""
    require(importlib.util.find_spec("torch") is not None, "torch (scripts/install-dev.sh)")
    import torch

    monitor = TrainingMonitor(serve="none", run_dir=tmp_path, publish_interval=0.05,
                              record_signals=False,
                              budgets=Budgets(step=60.0, data_start=900.0))
    seen: list[Snapshot] = []
    epoch = [0]

    class Shards(torch.utils.data.IterableDataset[torch.Tensor]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            for k in range(3):
                if epoch[0] == 1 and k == 0:  # the next epoch's start, slow
                    wait_until(lambda: on_disk(tmp_path).phase == "data_start", timeout=30,
                               interval=0.02, what="phase data_start at the epoch's start")
                    seen.append(on_disk(tmp_path))
                if epoch[0] == 1 and k == 2:  # a later batch as slow: no start
                    wait_until(lambda: time.time() - on_disk(tmp_path).last_step > 3 * IDLE,
                               timeout=30, interval=0.02, what="idle past the threshold")
                    publishes(tmp_path, 3)
                    seen.append(on_disk(tmp_path))
                yield torch.zeros(1)

    data = torch.utils.data.DataLoader(Shards(), batch_size=None)
    try:
        for epoch[0] in (0, 1):
            for k, _ in enumerate(data):
                if epoch[0] == 1 and k == 0:
                    arrived = time.time()
                    wait_until(lambda: on_disk(tmp_path).phase == "training", timeout=30,
                               interval=0.02, what="back to training once the batch is in")
                    after = on_disk(tmp_path)
                with monitor.step():
                    pass
        start, later = seen
        since_last_step_with_budget(start, 900.0)  # the data start's budget
        assert start.steps == 3, start  # the first epoch's steps
        assert after.steps == 3 and after.timeout == 60.0, after
        assert after.phase_start >= arrived - 0.5, (after.phase_start, arrived)
        assert later.phase == "training" and later.timeout == 60.0, later
        assert later.activity is not None and later.activity.kind == "data", later
    finally:
        monitor.close()


def upload_while(tmp_path: Path, until: Any) -> Snapshot:
    """An HTTP PUT on the training thread to a store on loopback that reads nothing until
    ``until(snapshot)`` holds (or 30 s), then all of it; the snapshot it saw."""
    seen: list[Snapshot] = []

    def store(server: socket.socket) -> None:
        conn, _ = server.accept()
        with conn:
            wait_until(lambda: until(on_disk(tmp_path)), timeout=30, interval=0.02,
                       what="the snapshot during the upload")
            seen.append(on_disk(tmp_path))
            while conn.recv(1 << 20):  # then reads it all, until the client closes
                pass

    with socket.create_server(("127.0.0.1", 0)) as server:
        reader = threading.Thread(target=store, args=(server,))
        reader.start()
        upload = http.client.HTTPConnection("127.0.0.1", server.getsockname()[1], timeout=60)
        upload.request("PUT", "/checkpoints/step-3.pt", body=bytes(16 << 20))
        upload.close()
        reader.join(60)
    assert seen, "the upload never seen"
    return seen[0]


def test_an_upload_after_a_save_is_phase_checkpointing(
        tmp_path: Path, short_idle: None) -> None:
    """Rank 0 pushing its checkpoint to an object store after a watched save (an HTTP PUT
    on the training thread): the store reads nothing until the snapshot says
    checkpointing, with the checkpoint budget, from the last step."""
    monitor = watched(tmp_path, SimpleNamespace(training=True))
    try:
        with monitor.checkpoint(step=3):  # booster.save_model, watched
            pass
        seen = upload_while(tmp_path, lambda snap: snap.phase == "checkpointing")
        since_last_step_with_budget(seen, 1200.0)  # the checkpoint budget
        back_to_training_at_the_next_step(monitor, tmp_path)
    finally:
        monitor.close()


def test_a_child_process_after_a_save_is_phase_checkpointing(
        tmp_path: Path, short_idle: None) -> None:
    """The same upload run as a child process (``aws s3 cp``), waited for with
    ``subprocess``: checkpointing, with the checkpoint budget, from the last step."""
    import subprocess
    import sys

    monitor = watched(tmp_path, SimpleNamespace(training=True))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with monitor.checkpoint(step=3):  # booster.save_model, watched
            pass
        deadline = time.monotonic() + 30
        while on_disk(tmp_path).phase != "checkpointing" and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=0.05)
        since_last_step_with_budget(on_disk(tmp_path), 1200.0)  # the checkpoint budget
        assert on_disk(tmp_path).phase == "checkpointing"
        back_to_training_at_the_next_step(monitor, tmp_path)
    finally:
        child.kill()
        child.wait(10)
        monitor.close()


def test_a_transfer_with_no_save_before_it_stays_training(
        tmp_path: Path, short_idle: None) -> None:
    """The next data shard fetched over HTTP outside a DataLoader, no save since the last
    step: not a save. It stays training (with the step budget), so a fetch that hangs is
    paged as a stall, not after the checkpoint budget."""
    monitor = watched(tmp_path, SimpleNamespace(training=True))
    try:
        seen = upload_while(tmp_path, lambda snap: snap.written - (snap.last_step or 0)
                            > 4 * IDLE and snap.activity is not None
                            and snap.activity.kind == "network")
        assert seen.phase == "training" and seen.timeout == 60.0, seen
    finally:
        monitor.close()


def learning(tmp_path: Path, model: Any) -> TrainingMonitor:
    """A watched monitor whose step budget is learned (five times the longest recent
    step, 1 s at least), after three steps of a few microseconds."""
    monitor = TrainingMonitor(serve="none", run_dir=tmp_path, publish_interval=0.05,
                              record_signals=False,
                              budgets=Budgets(step_factor=5.0, step_floor=1.0,
                                              evaluation=900.0, checkpoint=1200.0))
    monitor.watch(SimpleNamespace(), model)
    for _ in range(3):
        with monitor.step():
            pass
    return monitor


def test_an_evaluation_inside_a_step_is_phase_evaluating_until_train_mode(
        tmp_path: Path, short_idle: None) -> None:
    """The loop's whole body in ``with monitor.step()``, the periodic validation in it
    (model.eval() … model.train()): evaluating, with evaluation's budget, from the last
    step; back to training, with the step's budget from then, once the model is in train
    mode again; and the step that held it is no part of the learned budget after."""
    model = SimpleNamespace(training=True)
    monitor = learning(tmp_path, model)
    try:
        publishes(tmp_path, 2)  # a check sees the model in train mode
        with monitor.step():
            model.training = False  # model.eval(): the validation loop begins
            wait_until(lambda: on_disk(tmp_path).phase == "evaluating", timeout=30,
                       interval=0.02, what="phase evaluating inside the step")
            since_last_step_with_budget(on_disk(tmp_path), 900.0)  # evaluation's
            model.training = True  # model.train(): the rest of the step
            trained_at = time.time()
            wait_until(lambda: on_disk(tmp_path).phase == "training", timeout=30,
                       interval=0.02, what="back to training once in train mode")
            after = on_disk(tmp_path)
            assert after.steps == 3 and after.phase_start >= trained_at - 0.5, after
            assert after.timeout == 1.0  # the step's budget: the quick steps' floor
        # The step lasted the evaluation; five times that is no step's budget.
        wait_until(lambda: on_disk(tmp_path).steps == 4, timeout=30, interval=0.02,
                   what="the step written")
        publishes(tmp_path, 2)
        assert on_disk(tmp_path).timeout == 1.0
        assert on_disk(tmp_path).phase == "training"
    finally:
        monitor.close()


def test_eval_mode_in_every_step_is_a_step_however_long(
        tmp_path: Path, short_idle: None) -> None:
    """An RL loop whose every step generates its rollout in eval mode, then trains: eval
    mode is part of the rank's ordinary steps, so a step that takes too long in it is
    a step that takes too long (the step's budget), not an evaluation."""
    model = SimpleNamespace(training=True)
    monitor = learning(tmp_path, model)
    try:
        for _ in range(2):
            with monitor.step():
                model.training = False  # the rollout
                publishes(tmp_path, 1)  # seen by a check, well within the idle time
                model.training = True  # the update
        with monitor.step():
            model.training = False  # a rollout that takes too long
            publishes(tmp_path, 2 + int(IDLE / 0.05))
            assert on_disk(tmp_path).phase == "training"
            model.training = True
    finally:
        monitor.close()


def test_a_save_inside_a_step_is_phase_checkpointing(
        tmp_path: Path, short_idle: None) -> None:
    """The tutorial's torch.save inside the step's block (``if step % 500 == 0``), into a
    slow filesystem: checkpointing, with the checkpoint budget, from the last step."""
    monitor = watched(tmp_path, SimpleNamespace(training=True))
    try:
        with monitor.step():
            seen = save_slowly(tmp_path)
        since_last_step_with_budget(seen, 1200.0)  # the checkpoint budget
        assert seen.steps == 3  # the step that saved was still in flight
        back_to_training_at_the_next_step(monitor, tmp_path)
    finally:
        monitor.close()


def test_training_in_eval_mode_never_leaves_training(tmp_path: Path, short_idle: None) -> None:
    """A script that trains with its model in eval mode (dropout off) steps far more
    often than the idle time: it stays in training, and no step publishes a return."""
    model = SimpleNamespace(training=False)
    monitor = watched(tmp_path, model)
    phases: list[str] = []
    try:
        deadline = on_disk(tmp_path).written + 4 * IDLE
        while on_disk(tmp_path).written < deadline:
            with monitor.step():
                phases.append(on_disk(tmp_path).phase)
    finally:
        monitor.close()
    assert set(phases) == {"training"}, phases


def test_an_explicit_phase_wins(tmp_path: Path, short_idle: None) -> None:
    """A checkpoint entered by the training thread is never replaced by evaluating."""
    model = SimpleNamespace(training=False)
    monitor = watched(tmp_path, model)
    try:
        with monitor.checkpoint(3):
            publishes(tmp_path, 2 + int(IDLE / 0.05))
            assert on_disk(tmp_path).phase == "checkpointing"
    finally:
        monitor.close()


def test_no_model_no_change(tmp_path: Path, short_idle: None) -> None:
    monitor = TrainingMonitor(serve="none", run_dir=tmp_path, publish_interval=0.05,
                              record_signals=False)
    try:
        with monitor.step():
            pass
        publishes(tmp_path, 2 + int(IDLE / 0.05))
        assert on_disk(tmp_path).phase == "training"
    finally:
        monitor.close()


def test_a_publish_samples_the_training_thread_once_however_long_the_rank_is_idle(
        tmp_path: Path, short_idle: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check for unannounced work and the snapshot share the publish's one sample
    (each costs a walk of the training thread's stack)."""
    monitor = watched(tmp_path, SimpleNamespace(training=True))
    here = threading.get_ident()
    calls: list[int | None] = []
    sample = activity.sample

    def counted(thread_id: int | None) -> Any:
        if threading.get_ident() == here:  # the publisher thread's own publishes aside
            calls.append(thread_id)
        return sample(thread_id)

    try:
        publishes(tmp_path, 2 + int(IDLE / 0.05))  # idle past the threshold: checked
        monkeypatch.setattr(activity, "sample", counted)
        monitor._publisher.publish()  # one publish, from this thread
        assert calls == [threading.main_thread().ident]
        assert on_disk(tmp_path).activity is not None
    finally:
        monitor.close()
