"""The gpu collector against the real pynvml: no driver here, real GPUs elsewhere."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from colossalai_exporter import catalogue
from colossalai_exporter.node.base import CollectorError
from colossalai_exporter.node.gpu import GpuCollector
from conftest import cli_env, http_get, require_binary, wait_until
from gpu_helpers import fake_dev, registry_of, without_fake_nvml
from test_node_agent import scrape, value


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


def test_without_a_driver_the_real_pynvml_reports_no_driver(tmp_path: Path) -> None:
    """On a GPU node (a /dev with the driver's device node) no driver is a failure."""
    if _nvml_library_loads():
        pytest.skip("libnvidia-ml is installed here: this test is for machines without one")
    collector = GpuCollector(timeout=2.0, dev_root=fake_dev(tmp_path / "dev", "nvidia0"))
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


def test_without_a_driver_or_gpu_device_nodes_the_real_pynvml_gives_zero_gpus(
        tmp_path: Path) -> None:
    if _nvml_library_loads():
        pytest.skip("libnvidia-ml is installed here: this test is for machines without one")
    collector = GpuCollector(timeout=2.0, dev_root=fake_dev(tmp_path / "dev", "null"))
    try:
        reg = registry_of(collector.collect(time.monotonic() + 2.0))
    finally:
        collector.close()
    assert reg.get_sample_value("colossalai_gpu_devices") == 0
    assert reg.get_sample_value("colossalai_gpu_memory_total_bytes", {"gpu": "0"}) is None


@pytest.mark.gpu
def test_real_gpus_through_real_nvml() -> None:
    # A hardware test: skipped wherever no working NVIDIA GPU is present, CI included.
    if not _nvml_works():
        pytest.skip("no NVIDIA GPU with a working driver on this machine")
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


def _need_real_gpus() -> int:
    """The number of GPUs real NVML sees; skips where there is no working GPU."""
    if not _nvml_works():
        pytest.skip("no NVIDIA GPU with a working driver on this machine")
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def _real_nvml_env() -> dict[str, str]:
    return without_fake_nvml(cli_env())


@pytest.mark.gpu
def test_the_agent_on_a_gpu_node(server_process, tmp_path: Path) -> None:
    """The agent as a real process on real GPUs: catalogued, promtool-clean, healthy."""
    count = _need_real_gpus()
    import pynvml

    pynvml.nvmlInit()
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        uuids = {pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                 for i in range(count)}
    finally:
        pynvml.nvmlShutdown()
    driver = driver.decode() if isinstance(driver, bytes) else driver
    uuids = {u.decode() if isinstance(u, bytes) else u for u in uuids}

    agent = server_process("node", "--no-collector.rendezvous", "--disk", f"c={tmp_path}",
                           "--gpu.expected", str(count), env=_real_nvml_env())
    text = scrape(agent.url)
    served = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert served <= catalogue.known_sample_names(), served - catalogue.known_sample_names()
    assert value(text, "colossalai_exporter_collector_up", collector="gpu") == 1
    assert value(text, "colossalai_gpu_devices") == count
    infos = [s for fam in text_string_to_metric_families(text) for s in fam.samples
             if s.name == "colossalai_gpu_info"]
    assert {s.labels["uuid"] for s in infos} == uuids
    assert {s.labels["driver_version"] for s in infos} == {driver}
    for index in range(count):
        total = value(text, "colossalai_gpu_memory_total_bytes", gpu=str(index))
        assert total is not None and total > 2**30

    status, _, body = http_get(agent.url + "/health")
    assert status == 200, body
    assert json.loads(body)["status"] == "ok"
    lint = subprocess.run([require_binary("promtool"), "check", "metrics"], input=text,
                          capture_output=True, text=True, timeout=30, check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr

    # One GPU more than the node has: a failure that still serves the visible GPUs.
    short = server_process("node", "--no-collector.rendezvous", "--no-collector.disk",
                           "--gpu.expected", str(count + 1), env=_real_nvml_env())
    text = scrape(short.url)
    assert value(text, "colossalai_exporter_collector_up", collector="gpu") == 0
    errors = value(text, "colossalai_exporter_collector_errors_total",
                   collector="gpu", reason="missing_gpus")
    assert errors is not None and errors >= 1  # one per scrape, wait_ready's included
    assert value(text, "colossalai_gpu_memory_total_bytes", gpu="0") is not None
    status, _, body = http_get(short.url + "/health")
    assert status == 503
    assert "missing_gpus" in body.decode()


_GPU_WORK = """
import sys, time, torch
held = torch.empty({nbytes}, dtype=torch.uint8, device="cuda")
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
print("ready", flush=True)
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""


@pytest.mark.gpu
def test_memory_and_utilization_follow_real_work(tmp_path: Path) -> None:
    """A process holding 8 GiB and multiplying matrices shows in the next scrapes."""
    _need_real_gpus()
    torch_ok = subprocess.run([sys.executable, "-c", "import torch; "
                               "assert torch.cuda.is_available()"],
                              capture_output=True, timeout=120, check=False)
    if torch_ok.returncode != 0:
        pytest.skip("no CUDA build of torch here to put work on the GPU")

    collector = GpuCollector(timeout=10.0)
    held = 8 * 2**30

    def totals() -> tuple[float, float]:
        reg = registry_of(collector.collect(time.monotonic() + 10.0))
        count = int(reg.get_sample_value("colossalai_gpu_devices") or 0)
        labels = [{"gpu": str(i)} for i in range(count)]
        used = sum(reg.get_sample_value("colossalai_gpu_memory_used_bytes", x) or 0
                   for x in labels)
        busy = max((reg.get_sample_value("colossalai_gpu_utilization_ratio", x) or 0
                    for x in labels), default=0.0)
        return used, busy

    try:
        before, _ = totals()
    except BaseException:
        collector.close()
        raise
    work = subprocess.Popen([sys.executable, "-c",
                             _GPU_WORK.format(nbytes=held, seconds=60)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert work.stdout is not None
        assert work.stdout.readline().strip() == "ready"

        def busy_with_the_work() -> tuple[float, float] | None:
            used, busy = totals()
            return (used, busy) if used >= before + held and busy > 0 else None

        seen = wait_until(busy_with_the_work, timeout=30, interval=0.5,
                          what="8 GiB more used and a busy GPU")
        assert seen[1] <= 1
    finally:
        work.kill()
        work.wait(30)
        if work.stdout is not None:
            work.stdout.close()
        collector.close()


@pytest.mark.gpu
def test_real_nvml_names_the_rank_whose_process_runs_on_a_gpu() -> None:
    """nvmlDeviceGetComputeRunningProcesses on a real GPU: a process holding a CUDA
    context on GPU 0 is matched to its rank by pid (colossalai_gpu_rank_info), and two
    handles NVML gives for one GPU are one device to the reader (the Xid event path)."""
    _need_real_gpus()
    import pynvml

    from colossalai_exporter.node.gpu.reader import _handle_key

    pynvml.nvmlInit()
    try:
        first = pynvml.nvmlDeviceGetHandleByIndex(0)
        again = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert _handle_key(first) == _handle_key(again)
    finally:
        pynvml.nvmlShutdown()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch; torch.zeros(1, device='cuda:0'); "
                               "print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        collector = GpuCollector(timeout=10.0, local_ranks=lambda: {holder.pid: 3})
        try:
            def named() -> bool:
                reg = registry_of(collector.collect(time.monotonic() + 30.0))
                return reg.get_sample_value("colossalai_gpu_rank_info",
                                            {"gpu": "0", "rank": "3"}) == 1
            wait_until(named, timeout=60, interval=0.5, what="rank 3 seen on GPU 0")
        finally:
            collector.close()
    finally:
        holder.kill()
        holder.wait(30)


@pytest.mark.gpu
def test_real_nvml_reads_the_gpus_health_fields() -> None:
    """Every health field the reader asks NVML for, on a real GPU: each answers or says
    NotSupported (None), and an H100/H200 on a driver >= 570 has the recovery action and
    row remapping (Hopper remaps rows; it has no page retirement)."""
    _need_real_gpus()
    import pynvml

    from colossalai_exporter.node.gpu.reader import NvmlReader

    reader = NvmlReader(pynvml)
    assert reader.initialise() is None
    try:
        reading = reader.sample()
    finally:
        reader.shutdown()
    assert reading.failure is None and reading.gpus
    for gpu in reading.gpus:
        assert gpu.recovery_action is None or gpu.recovery_action >= 0
        assert gpu.pcie_replays is None or gpu.pcie_replays >= 0
        assert gpu.clock_event_reasons is None or gpu.clock_event_reasons >= 0
        # NVLink: none on a PCIe board; an SXM board's links, active or not (a one-GPU
        # slice of an HGX machine may show them down)
        if gpu.nvlink_links is not None:
            links, active = gpu.nvlink_links
            assert links > 0
            assert 0 <= active <= links
        assert all(count >= 0 for _, count in gpu.nvlink_errors or ())
        assert all(count >= 0 for _, _, count in gpu.ecc_volatile or ())
        if "H100" in gpu.name or "H200" in gpu.name:  # Hopper splits ECC by location
            assert gpu.ecc_volatile is not None, gpu
        if "H100" in gpu.name or "H200" in gpu.name:
            assert gpu.remapped_rows is not None, gpu
            driver_major = int(reading.driver_version.split(".")[0])
            if driver_major >= 570:
                assert gpu.recovery_action is not None, gpu
