"""Gemini hooks on a stand-in (GeminiPlugin needs CUDA), and OOM classification on real texts."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from colossalai_exporter import TrainingMonitor
from colossalai_exporter.rankstate.families import families
from colossalai_exporter.training import classify_oom
from colossalai_exporter.training.colossal import plugin_info
from test_training_monitor import need_torch


class FakeGeminiManager:
    """Mimics colossalai.zero.gemini.gemini_mgr.GeminiManager (0.5.0) as the hook sees it.

    Real behaviour copied: ``_h2d_volume`` / ``_d2h_volume`` grow during an
    iteration as chunks move, and ``post_iter()`` (called by GeminiDDP at the end
    of every backward) zeroes them through ``reset_attributes()``.
    """

    def __init__(self) -> None:
        self.policy_name = "auto"
        self.reset_attributes()

    def reset_attributes(self) -> None:
        self._h2d_volume = 0
        self._d2h_volume = 0

    def post_iter(self) -> None:
        self.reset_attributes()


class FakeGeminiDDP:
    """Mimics GeminiDDP: ``gemini_manager``, ``chunk_manager.total_mem`` and a backward()."""

    def __init__(self) -> None:
        self.gemini_manager = FakeGeminiManager()
        self.chunk_manager = type("ChunkManager", (), {})()
        self.chunk_manager.total_mem = {"cpu": 0, "cuda": 0}

    def backward(self, h2d: int, d2h: int) -> None:
        self.gemini_manager._h2d_volume += h2d
        self.gemini_manager._d2h_volume += d2h
        self.chunk_manager.total_mem["cuda"] += 1024
        self.gemini_manager.post_iter()  # as GeminiDDP.backward does


class GeminiLikePlugin:
    """Has GeminiPlugin's attributes the info metric reads."""

    tp_size = 2
    dp_size = 4
    gemini_config: dict[str, Any] = {"placement_policy": "auto"}  # noqa: RUF012


def values(snap: dict[str, Any], name: str) -> dict[str, float]:
    return {s.labels.get("device", ""): s.value for f in families(snap) for s in f.samples
            if s.name == name}


def test_gemini_traffic_survives_the_per_iteration_reset(tmp_path: Path) -> None:
    monitor = TrainingMonitor(serve="none", run_dir=tmp_path, publish_interval=0.05)
    model = FakeGeminiDDP()
    try:
        monitor.watch(type("Booster", (), {"plugin": GeminiLikePlugin()})(), model)
        for _ in range(3):
            with monitor.step():
                model.backward(h2d=100, d2h=40)
        assert model.gemini_manager._h2d_volume == 0  # reset, as in Gemini
        monitor.close()  # one synchronous publish runs the chunk-memory poller
        snap = monitor.snapshot()
        assert values(snap, "colossalai_gemini_h2d_bytes_total") == {"": 300}
        assert values(snap, "colossalai_gemini_d2h_bytes_total") == {"": 120}
        assert values(snap, "colossalai_gemini_chunk_memory_bytes") == {"cpu": 0,
                                                                        "cuda": 3072}
        assert snap.info["placement_policy"] == "auto"
        assert snap.info["plugin"] == "GeminiLikePlugin"
        assert snap.info["tp_size"] == "2"
        monitor.watch(type("Booster", (), {})(), model)  # hooking twice counts once
        model.backward(h2d=1, d2h=1)
        assert monitor.snapshot().gemini.h2d == 301  # type: ignore[union-attr]
    finally:
        monitor.close()


def test_gemini_series_are_absent_without_gemini(tmp_path: Path) -> None:
    monitor = TrainingMonitor(serve="none", run_dir=tmp_path, start=False)
    names = {f.name for f in families(monitor.snapshot())}
    assert "colossalai_gemini_h2d_bytes" not in names
    assert "colossalai_gemini_chunk_memory_bytes" not in names
    assert plugin_info(None) == {"plugin": "none"}


def test_data_parallel_plugins_report_their_dp_size() -> None:
    class TorchDDPPlugin:  # ColossalAI's has no dp_size, tp_size or pp_size
        pass

    class HybridParallelPlugin:
        tp_size, pp_size, dp_size = 2, 2, 4
        stage_manager = None  # ColossalAI's, with pp_size 1

    class PipelineStageManager:  # ColossalAI's: `stage` is a property of the pp mesh axis
        stage = 1

    class PipelinedPlugin(HybridParallelPlugin):
        stage_manager = PipelineStageManager()

    class GeminiPlugin:
        tp_size = 2

    assert plugin_info(TorchDDPPlugin(), world_size=8) == {
        "plugin": "TorchDDPPlugin", "dp_size": 8, "tp_size": 1, "pp_size": 1}
    assert plugin_info(HybridParallelPlugin(), world_size=16) == {
        "plugin": "HybridParallelPlugin", "tp_size": 2, "pp_size": 2, "dp_size": 4}
    # the rank's stage, which TrainingStraggler compares ranks within
    assert plugin_info(PipelinedPlugin(), world_size=16)["pipeline_stage"] == 1
    assert plugin_info(GeminiPlugin(), world_size=8)["dp_size"] == 4


def test_real_torch_out_of_memory_type_is_cuda() -> None:
    torch = need_torch()
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
    assert classify_oom(exc) == "cuda"
    # By type first: an OutOfMemoryError is cuda whatever its text says.
    assert classify_oom(torch.OutOfMemoryError("something unexpected")) == "cuda"


@pytest.mark.parametrize(("exc", "device"), [
    (RuntimeError("Adjust layout failed! No enough CUDA memory! Need 4194304, "
                  "available 0"), "cuda"),
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
                  "reported"), "cuda"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                  "allocate memory: you tried to allocate 35184372088832 bytes. Error code 12 "
                  "(Cannot allocate memory)"), "cpu"),
    (MemoryError(), "cpu"),
    (ModuleNotFoundError("Please install tensornvme to use NVMeOptimizer"), "nvme"),
    (OSError(errno.ENOSPC, "No space left on device", "/nvme/offload/param_7.bin"), "nvme"),
    (OSError(errno.ENOSPC, "No space left on device", "/checkpoints/model.bin"), None),
    (OSError(errno.ENOENT, "No such file", "/nvme/offload/x"), None),
    (ModuleNotFoundError("No module named 'flash_attn'"), None),
    (RuntimeError("Expected all tensors to be on the same device"), None),
    (ValueError("out of memory"), None),  # not an allocation error type: by type first
])
def test_classification_of_real_texts(exc: BaseException, device: str | None) -> None:
    assert classify_oom(exc, nvme_paths=("/nvme",)) == device
