"""TrainingMonitor in a real CUDA training loop (GPU machines only; skipped elsewhere).

The hot-path promise that matters most on a GPU: the monitor never makes the
host wait for the device. torch's sync debug mode set to "error" turns every
synchronising call (``.item()``, ``float(tensor)``, a device-to-host copy)
into a RuntimeError, in any thread: the loop, the publisher and the rank-0
server all run under it here.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from colossalai_exporter import TrainingMonitor
from colossalai_exporter.rankstate.files import read_snapshot, snapshot_path
from conftest import free_port, http_get, wait_until
from test_training_monitor import sample


def need_cuda() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    return torch


def _model(torch: Any) -> tuple[Any, Any, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 1024, device="cuda")
    y = torch.randn(256, 1, device="cuda")
    return model, optimizer, x, y


def _train_step(torch: Any, model: Any, optimizer: Any, x: Any, y: Any) -> Any:
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.gpu
def test_the_monitor_never_synchronises_the_device(tmp_path: Path) -> None:
    torch = need_cuda()
    model, optimizer, x, y = _model(torch)
    _train_step(torch, model, optimizer, x, y)  # warm up kernels outside the check
    torch.cuda.synchronize()
    monitor = TrainingMonitor(rank=0, local_rank=0, world_size=1, serve="rank0",
                              port=free_port(), host="127.0.0.1", run_dir=tmp_path,
                              publish_interval=0.02)
    scrapes = []
    try:
        with warnings.catch_warnings():  # "a prototype feature": we know
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        for i in range(300):
            with monitor.step(samples=256) as step:
                step.loss = _train_step(torch, model, optimizer, x, y)
            if i % 60 == 0:
                assert monitor.url is not None
                scrapes.append(http_get(monitor.url + "/metrics")[0])
        # The check is live: a synchronising call fails right here.
        with pytest.raises(RuntimeError, match="synchroniz"):
            step.loss.item()
        # The publisher, under the check too, writes the last step's state for the agent.
        wait_until(lambda: read_snapshot(snapshot_path(tmp_path, 0)).steps == 300, 5,
                   what="a snapshot of all 300 steps")
        # The loss, copied to the host on a side stream without a wait, arrives while
        # the check is still on: the last step's, once its copy has completed.
        last = step.loss
        torch.cuda.set_sync_debug_mode(0)
        expected = float(last.item())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        wait_until(lambda: monitor.snapshot().loss == pytest.approx(expected), 5,
                   what="the last loss read without synchronising")
    finally:
        torch.cuda.set_sync_debug_mode(0)
        monitor.close()
    assert scrapes == [200] * 5
    snap = monitor.snapshot()
    assert snap.monitor_errors == {}, snap.monitor_errors
    assert snap.steps == 300


@pytest.mark.gpu
def test_loss_from_device_reads_the_loss_in_the_publisher(tmp_path: Path) -> None:
    torch = need_cuda()
    model, optimizer, x, y = _model(torch)
    monitor = TrainingMonitor(rank=0, local_rank=0, world_size=1, serve="none",
                              run_dir=tmp_path, publish_interval=0.02, loss_from_device=True)
    try:
        for _ in range(20):
            with monitor.step() as step:
                step.loss = _train_step(torch, model, optimizer, x, y)
        last = step.loss.item()
        wait_until(lambda: monitor.snapshot().loss == pytest.approx(last), 5,
                   what="the last loss published")
    finally:
        monitor.close()
    assert sample(monitor.snapshot(), "colossalai_training_loss") == pytest.approx(last)


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_is_counted_as_cuda(tmp_path: Path) -> None:
    torch = need_cuda()
    monitor = TrainingMonitor(rank=0, local_rank=0, world_size=1, serve="none",
                              run_dir=tmp_path)
    try:
        with pytest.raises(torch.OutOfMemoryError), monitor.step():
            torch.empty(2**50, dtype=torch.uint8, device="cuda")  # 1 PiB
        snap = monitor.snapshot()
    finally:
        monitor.close()
    assert snap.oom == {"cuda": 1, "cpu": 0, "nvme": 0}
    assert sample(snap, "colossalai_gemini_oom_total", device="cuda") == 1
    error = read_snapshot(snapshot_path(tmp_path, 0)).last_error  # on disk at once
    assert (error.where, error.type, error.device) == ("step", "OutOfMemoryError",
                                                                "cuda")
    assert error.message.startswith("CUDA out of memory. Tried to allocate"), error
