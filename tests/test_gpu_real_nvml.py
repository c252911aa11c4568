"""The gpu collector against the real pynvml: no driver here, real GPUs elsewhere."""

from __future__ import annotations

import ctypes
import time

import pytest

from colossalai_exporter.node.base import CollectorError
from colossalai_exporter.node.gpu import GpuCollector
from gpu_helpers import registry_of


def _nvml_library_loads() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def _nvml_works() -> bool:
    if not _nvml_library_loads():
        return False
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    try:
        return int(pynvml.nvmlDeviceGetCount()) > 0
    finally:
        pynvml.nvmlShutdown()


def test_without_a_driver_the_real_pynvml_reports_no_driver(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if _nvml_library_loads():
        pytest.skip("libnvidia-ml is installed here: this test is for machines without one")
    monkeypatch.delenv("COLOSSALAI_EXPORTER_FAKE_NVML", raising=False)
    collector = GpuCollector(timeout=2.0)
    try:
        start = time.monotonic()
        with pytest.raises(CollectorError) as info:
            collector.collect(time.monotonic() + 2.0)
        assert time.monotonic() - start < 2.0
    finally:
        collector.close()
    assert info.value.reason == "no_driver"
    assert info.value.message.startswith("no NVIDIA driver found")
    assert info.value.families == []


@pytest.mark.gpu
def test_real_gpus_through_real_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    # A hardware test: skipped wherever no working NVIDIA GPU is present, CI included.
    if not _nvml_works():
        pytest.skip("no NVIDIA GPU with a working driver on this machine")
    monkeypatch.delenv("COLOSSALAI_EXPORTER_FAKE_NVML", raising=False)
    collector = GpuCollector(timeout=10.0)
    try:
        reg = registry_of(collector.collect(time.monotonic() + 30.0))
    finally:
        collector.close()
    count = reg.get_sample_value("colossalai_gpu_devices")
    assert count is not None
    assert count >= 1
    for index in range(int(count)):
        label = {"gpu": str(index)}
        total = reg.get_sample_value("colossalai_gpu_memory_total_bytes", label)
        used = reg.get_sample_value("colossalai_gpu_memory_used_bytes", label)
        assert total is not None
        assert total > 2**30
        assert used is not None
        assert 0 <= used <= total
        percent = reg.get_sample_value("colossalai_gpu_memory_used_percent", label)
        assert percent is not None
        assert 0 <= percent <= 100
        ratio = reg.get_sample_value("colossalai_gpu_utilization_ratio", label)
        assert ratio is None or 0 <= ratio <= 1
        temperature = reg.get_sample_value("colossalai_gpu_temperature_celsius", label)
        assert temperature is None or 0 < temperature < 120
