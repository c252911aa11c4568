"""The gpu collector against the fake NVML, with real worker processes.

Every test starts real spawned worker processes. A hang under test gets a short
deadline (0.3-1.5 s) so it is proven quickly; every other scrape gets ``BUDGET``,
and a test that gives a short deadline waits for its worker to start first
(``started``): each worker is a fresh Python interpreter, which on a loaded
2-core machine can take seconds to start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from colossalai_exporter import catalogue
from colossalai_exporter.node.base import CollectorError
from colossalai_exporter.node.gpu import GpuCollector
from colossalai_exporter.node.gpu.protocol import REASONS
from conftest import SOURCE_ROOT, cli_env, require_binary, wait_until
from gpu_helpers import (
    Scenario,
    exposition,
    fake_dev,
    fake_nvml_env,
    gpu,
    registry_of,
    series,
    use_fake_nvml,
)

MARGIN = 0.4  # scheduling slack on a busy 2-core machine
# The deadline of a scrape that tests no hang: long enough for a fresh worker to start.
BUDGET = 30.0

Make = Callable[..., GpuCollector]


@pytest.fixture
def scenario(tmp_path: Path) -> Scenario:
    return Scenario(tmp_path / "nvml.json").write(gpus=[gpu(0), gpu(1)])


@pytest.fixture
def make(scenario: Scenario, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Make]:
    """Collectors on a GPU node: a fake ``/dev`` with the driver's device nodes, so
    no driver is a failure as on real GPU nodes, whatever this machine's ``/dev``
    holds (the tests of a node without GPUs pass a ``dev_root`` of their own)."""
    made: list[GpuCollector] = []
    use_fake_nvml(monkeypatch, scenario.path)
    gpu_node_dev = fake_dev(tmp_path / "dev", "nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm")

    def make(**kwargs: Any) -> GpuCollector:
        kwargs.setdefault("timeout", BUDGET)
        kwargs.setdefault("dev_root", gpu_node_dev)
        collector = GpuCollector(**kwargs)
        made.append(collector)
        return collector

    yield make
    for collector in made:
        collector.close()


def collect(collector: GpuCollector, budget: float = BUDGET, pending: Any = None) -> Any:
    return registry_of(collector.collect(time.monotonic() + budget, pending))


def collect_once_started(collector: GpuCollector, within: float = BUDGET) -> Any:
    """collect(), retried while the worker reports it is still initialising."""
    give_up = time.monotonic() + within
    while True:
        try:
            return collect(collector)
        except CollectorError as error:
            if "still initialising" not in error.message or time.monotonic() > give_up:
                raise


def started(collector: GpuCollector, within: float = BUDGET) -> GpuCollector:
    """``collector`` once its current worker has initialised NVML and said so (its
    "ready" is waiting, or was received), so that a short deadline given next is spent
    on the call under test, not on starting an interpreter."""
    def ready() -> bool:
        worker = collector._worker
        return worker is not None and (worker.ready or worker.readable(0))

    wait_until(ready, within, what="the NVML worker to initialise")
    return collector


def failure(collector: GpuCollector, budget: float = BUDGET,
            pending: Any = None) -> CollectorError:
    with pytest.raises(CollectorError) as info:
        collector.collect(time.monotonic() + budget, pending)
    assert info.value.reason in REASONS
    return info.value


def worker_pid(collector: GpuCollector) -> int:
    worker = collector._worker
    assert worker is not None
    assert worker.pid is not None
    return worker.pid


def gone(pid: int) -> bool:
    """True once ``pid`` is not a live process (a reaped or zombie one counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_reports_every_gpu_with_nvml_values_in_base_units(scenario: Scenario,
                                                          make: Make) -> None:
    scenario.write(driver_version="550.54.15", gpus=[
        gpu(0, memory_used=20 * 2**30, utilization=37, temperature=55, power_mw=250_500,
            ecc={"corrected": 3, "uncorrected": 1}),
        # A consumer card: no ECC, no power reading (NVML says NotSupported).
        gpu(1, name="NVIDIA GeForce RTX 4090", ecc=None, power_mw=None),
    ])
    reg = collect(make())
    g0, g1 = {"gpu": "0"}, {"gpu": "1"}
    assert reg.get_sample_value("colossalai_gpu_devices") == 2
    assert reg.get_sample_value("colossalai_gpu_expected_devices") is None
    assert reg.get_sample_value("colossalai_gpu_memory_used_bytes", g0) == 20 * 2**30
    assert reg.get_sample_value("colossalai_gpu_memory_total_bytes", g0) == 80 * 2**30
    assert reg.get_sample_value("colossalai_gpu_memory_used_percent", g0) == 25.0
    assert reg.get_sample_value("colossalai_gpu_utilization_ratio", g0) == 0.37
    assert reg.get_sample_value("colossalai_gpu_temperature_celsius", g0) == 55
    assert reg.get_sample_value("colossalai_gpu_power_watts", g0) == 250.5
    assert reg.get_sample_value("colossalai_gpu_ecc_errors_total",
                                {"gpu": "0", "type": "corrected"}) == 3
    assert reg.get_sample_value("colossalai_gpu_ecc_errors_total",
                                {"gpu": "0", "type": "uncorrected"}) == 1
    assert reg.get_sample_value("colossalai_gpu_info", {
        "gpu": "1", "uuid": gpu(1)["uuid"], "name": "NVIDIA GeForce RTX 4090",
        "driver_version": "550.54.15"}) == 1
    # NotSupported leaves out that value for that GPU only.
    assert reg.get_sample_value("colossalai_gpu_power_watts", g1) is None
    assert reg.get_sample_value("colossalai_gpu_ecc_errors_total",
                                {"gpu": "1", "type": "corrected"}) is None
    assert reg.get_sample_value("colossalai_gpu_temperature_celsius", g1) == 41
    assert reg.get_sample_value("colossalai_gpu_xid_errors_total", g1) == 0
    assert reg.get_sample_value("colossalai_gpu_last_xid", g0) is None


def test_values_follow_the_hardware_live(scenario: Scenario, make: Make) -> None:
    collector = make()
    assert collect(collector).get_sample_value("colossalai_gpu_temperature_celsius",
                                               {"gpu": "0"}) == 40
    scenario.write(gpus=[gpu(0, temperature=88), gpu(1)])
    reg = collect(collector)
    assert reg.get_sample_value("colossalai_gpu_temperature_celsius", {"gpu": "0"}) == 88
    # A GPU vanishing under its handle reads as lost; the re-initialised NVML
    # then enumerates what is left.
    scenario.write(gpus=[gpu(0)])
    assert failure(collector).reason == "gpu_lost"
    assert collect(collector).get_sample_value("colossalai_gpu_devices") == 1


def test_eight_gpus_stay_within_the_series_budget_and_lint_clean(scenario: Scenario,
                                                                 make: Make) -> None:
    scenario.write(gpus=[gpu(i) for i in range(8)])
    collector = make(expected=8)
    collect(collector)
    # Every GPU with an Xid, so the optional last-Xid series are all there too.
    scenario.update(xid=[{"id": i, "gpu": i, "code": 79} for i in range(8)])
    text = exposition(collector.collect(time.monotonic() + BUDGET))
    lines = series(text)
    assert len(lines) <= 120, len(lines)
    # devices, expected; 14 a GPU with ECC and one Xid code (its count and its boots)
    assert len(lines) == 2 + 8 * 14
    served = {line.split("{")[0].split(" ")[0] for line in lines}
    assert served <= catalogue.known_sample_names()
    promtool = require_binary("promtool")
    check = subprocess.run([promtool, "check", "metrics"], input=text, text=True,
                           capture_output=True, timeout=30, check=False)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize(("where", "code", "reason"), [
    ("nvmlInit", 9, "no_driver"),            # DRIVER_NOT_LOADED: kernel module absent
    ("nvmlInit", 12, "no_driver"),           # LIBRARY_NOT_FOUND: no libnvidia-ml
    ("nvmlInit", 18, "nvml_error"),          # LIB_RM_VERSION_MISMATCH: upgraded, no reboot
    ("nvmlDeviceGetMemoryInfo", 999, "nvml_error"),   # UNKNOWN in a per-GPU read
    ("nvmlDeviceGetCount", 4, "nvml_error"),           # NO_PERMISSION
])
def test_nvml_errors_become_reasons(scenario: Scenario, make: Make, where: str, code: int,
                                    reason: str, tmp_path: Path) -> None:
    scenario.write(gpus=[gpu(0)], errors={where: code})
    error = failure(make())
    assert error.reason == reason
    assert error.families == []
    if reason == "no_driver":
        assert error.message.startswith("no NVIDIA driver found")
        assert f"yet {tmp_path / 'dev' / 'nvidia0'} exists" in error.message
    else:
        assert f"NVML error {code}" in error.message


def test_recovers_when_the_error_clears_without_a_new_worker(scenario: Scenario,
                                                             make: Make) -> None:
    scenario.write(gpus=[gpu(0)], errors={"nvmlInit": 9})
    collector = make(no_driver_recheck=0)
    assert failure(collector).reason == "no_driver"
    pid = worker_pid(collector)
    scenario.write(gpus=[gpu(0)])  # the driver got loaded
    assert collect(collector).get_sample_value("colossalai_gpu_devices") == 1
    assert worker_pid(collector) == pid


def test_no_driver_stands_for_its_recheck_interval_without_asking_the_worker(
        scenario: Scenario, make: Make) -> None:
    scenario.write(gpus=[gpu(0)], errors={"nvmlInit": 12})
    collector = make(no_driver_recheck=0.5)
    first = failure(collector)
    assert first.reason == "no_driver"
    assert first.message.endswith("(asked again every 0.5s)")
    worker = collector._worker
    assert worker is not None
    asked = worker._next_id
    scenario.write(gpus=[gpu(0)])  # the driver got installed
    start = time.monotonic()
    pending = collector.begin(start + 2)
    assert pending is not None and pending.ready()
    assert failure(collector, pending=pending).message == first.message
    assert worker._next_id == asked  # answered without a round trip to the worker
    assert time.monotonic() - start < 0.1
    time.sleep(0.5)
    assert collect(collector).get_sample_value("colossalai_gpu_devices") == 1


NO_DRIVER = {"nvmlInit": 9}  # DRIVER_NOT_LOADED, as on a machine without the kernel module


@pytest.mark.parametrize("expected", [None, 0])
def test_no_driver_on_a_node_without_gpus_is_zero_gpus_not_a_failure(
        scenario: Scenario, make: Make, tmp_path: Path, expected: int | None) -> None:
    # A CPU-only node: no driver, and its /dev has none of the driver's device nodes.
    scenario.write(errors=NO_DRIVER)
    dev = fake_dev(tmp_path / "cpu-dev", "null", "nvme0", "nvme0n1", "tty0")
    reg = collect(make(dev_root=dev, expected=expected))
    text = exposition(list(reg.collect()))
    assert series(text) == (["colossalai_gpu_devices 0.0"] if expected is None else
                            ["colossalai_gpu_devices 0.0", "colossalai_gpu_expected_devices 0.0"])


def test_no_driver_with_a_gpu_device_node_is_a_failure(scenario: Scenario, make: Make,
                                                       tmp_path: Path) -> None:
    # The device node is what the driver leaves behind: a GPU node whose driver broke.
    scenario.write(errors=NO_DRIVER)
    for nodes in (["nvidia0"], ["nvidia7", "nvidiactl"]):
        dev = fake_dev(tmp_path / f"dev-{nodes[0]}", *nodes)
        error = failure(make(dev_root=dev))
        assert error.reason == "no_driver"
        assert f"yet {dev / nodes[0]} exists" in error.message
        assert error.families == []
    # The driver's other nodes say nothing about GPUs.
    dev = fake_dev(tmp_path / "dev-ctl", "nvidiactl", "nvidia-uvm", "nvidia-caps")
    assert collect(make(dev_root=dev)).get_sample_value("colossalai_gpu_devices") == 0


def test_no_driver_with_gpus_expected_is_a_failure(scenario: Scenario, make: Make,
                                                   tmp_path: Path) -> None:
    scenario.write(errors=NO_DRIVER)
    error = failure(make(dev_root=fake_dev(tmp_path / "cpu-dev"), expected=2))
    assert error.reason == "no_driver"
    assert "yet 2 GPUs expected" in error.message
    assert error.families == []


def test_a_driver_that_vanishes_after_gpus_were_seen_is_a_failure(
        scenario: Scenario, make: Make, tmp_path: Path) -> None:
    # No device nodes either (a container that lost them, say): what this collector
    # saw earlier is enough to know the node has GPUs.
    collector = make(dev_root=fake_dev(tmp_path / "cpu-dev"), no_driver_recheck=0)
    assert collect(collector).get_sample_value("colossalai_gpu_devices") == 2
    scenario.update(errors=NO_DRIVER)
    # The worker keeps NVML initialised: the fake says so only at a fresh nvmlInit,
    # so make the next sample re-initialise it, as a lost GPU does.
    scenario.update(gpus=[gpu(0, lost=True), gpu(1)])
    assert failure(collector).reason == "gpu_lost"
    error = failure(collector)
    assert error.reason == "no_driver"
    assert "yet GPUs were seen since the agent started" in error.message


def test_the_judgement_of_no_driver_stands_and_is_made_again_at_the_recheck(
        scenario: Scenario, make: Make, tmp_path: Path) -> None:
    """The standing no_driver answer keeps its judgement (no GPU node: zero GPUs)
    without asking the worker or listing /dev; at the recheck both are asked again."""
    scenario.write(errors=NO_DRIVER)
    dev = fake_dev(tmp_path / "cpu-dev")
    collector = make(dev_root=dev, no_driver_recheck=1.0)
    assert collect(collector).get_sample_value("colossalai_gpu_devices") == 0
    answered = time.monotonic()  # the answer stands until about 1 s after this
    fake_dev(dev, "nvidia0")  # the driver's device node appears (modprobe, say)
    pending = collector.begin(time.monotonic() + 2)
    # Ready at once: no request went to the worker.
    assert pending is not None and pending.ready()
    if time.monotonic() - answered < 0.8:  # still standing (a busy machine may be late)
        assert collect(collector, pending=pending).get_sample_value(
            "colossalai_gpu_devices") == 0
    error = wait_until(lambda: _no_driver_failure(collector), 5,
                       what="no_driver to be judged again with /dev/nvidia0 present")
    assert error.message.endswith(f"yet {dev / 'nvidia0'} exists (asked again every 1s)")


def _no_driver_failure(collector: GpuCollector) -> CollectorError | None:
    try:
        collector.collect(time.monotonic() + 2.0)
    except CollectorError as error:
        return error if error.reason == "no_driver" else None
    return None


def test_lost_gpu_fails_that_scrape_then_nvml_is_reinitialised(scenario: Scenario,
                                                               make: Make) -> None:
    collector = make()
    collect(collector)
    pid = worker_pid(collector)
    # The fake recovers a lost GPU only for handles from a later nvmlInit: the
    # next scrape succeeds only if the worker shut NVML down and re-initialised it.
    scenario.write(gpus=[gpu(0), gpu(1, lost=True)])
    error = failure(collector)
    assert error.reason == "gpu_lost"
    assert "GPU 1" in error.message
    reg = collect(collector)
    assert reg.get_sample_value("colossalai_gpu_devices") == 2
    assert reg.get_sample_value("colossalai_gpu_memory_used_bytes", {"gpu": "1"}) == 2 * 2**30
    assert worker_pid(collector) == pid  # re-initialised in place, not replaced


def test_hung_nvml_times_out_and_the_next_scrape_is_not_blocked(scenario: Scenario,
                                                                make: Make) -> None:
    collector = make(timeout=0.5)
    collect(started(collector))
    hung_pid = worker_pid(collector)
    scenario.write(gpus=[gpu(0)], hang="nvmlDeviceGetMemoryInfo")

    start = time.monotonic()
    error = failure(collector, budget=5.0)  # the collector's own 0.5 s bounds it
    assert error.reason == "timeout"
    assert time.monotonic() - start < 0.5 + MARGIN
    assert "killed" in error.message
    wait_until(lambda: gone(hung_pid), 5, what="the stuck worker to be killed")

    # Still hanging: the next scrape fails within its own deadline too (once its
    # replacement has started: a worker still starting would take the request into
    # the hang after the scenario below is healed).
    started(collector)
    start = time.monotonic()
    error = failure(collector, budget=0.5)
    assert error.reason == "timeout"
    assert time.monotonic() - start < 0.5 + MARGIN
    assert "killed" in error.message

    scenario.write(gpus=[gpu(0)])  # the GPU answers again
    started(collector)  # the worker started at that kill
    start = time.monotonic()
    reg = collect(collector, budget=1.0)
    assert time.monotonic() - start < 1.0 + MARGIN
    assert reg.get_sample_value("colossalai_gpu_devices") == 1


def test_a_scrape_arriving_during_a_hang_waits_at_most_its_own_deadline(
        scenario: Scenario, make: Make) -> None:
    collector = make(timeout=1.5)
    collect(started(collector))
    scenario.write(gpus=[gpu(0)], hang="nvmlDeviceGetTemperature")
    first: list[BaseException] = []

    def scrape() -> None:
        try:
            collector.collect(time.monotonic() + 1.5)
        except CollectorError as exc:
            first.append(exc)

    thread = threading.Thread(target=scrape)
    thread.start()
    time.sleep(0.1)  # let the first scrape take its turn with the worker
    start = time.monotonic()
    error = failure(collector, budget=0.3)
    assert error.reason == "timeout"
    assert time.monotonic() - start < 0.3 + MARGIN
    thread.join(5)
    assert [e.reason for e in first if isinstance(e, CollectorError)] == ["timeout"]


def test_slow_nvml_init_is_waited_for_then_replaced(scenario: Scenario, make: Make) -> None:
    # nvmlInit can take seconds without persistence mode: a starting worker is
    # given init_timeout before it counts as stuck.
    scenario.write(gpus=[gpu(0)], hang="nvmlInit")
    collector = make(timeout=0.3, init_timeout=1.0)
    pid = worker_pid(collector)
    error = failure(collector)
    assert error.reason == "timeout"
    assert "still initialising" in error.message
    assert worker_pid(collector) == pid
    # Once the first worker is wedged for good, the scenario is healed for the
    # one that replaces it. That one starts the moment the first is killed, so
    # healing after the kill would race it into the hang.
    wait_until(lambda: pid in scenario.hung_pids(), 5, what="the worker to hang in nvmlInit")
    scenario.write(gpus=[gpu(0)])
    time.sleep(max(0.0, 1.0 - collector._worker.age()) if collector._worker else 0)
    error = failure(collector)
    assert error.reason == "timeout"
    assert "killed" in error.message
    wait_until(lambda: gone(pid), 5, what="the stuck worker to be killed")
    # The replacement may still be starting (a spawn on a loaded machine can
    # outlast the 0.3 s deadline); within init_timeout it answers "initialising".
    assert collect_once_started(collector).get_sample_value("colossalai_gpu_devices") == 1


def test_a_crashed_worker_is_reported_and_replaced(make: Make) -> None:
    collector = make()
    collect(collector)
    pid = worker_pid(collector)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: gone(pid), 5, what="the worker to die")
    error = failure(collector)
    assert error.reason == "worker_died"
    assert str(pid) in error.message
    assert collect(collector).get_sample_value("colossalai_gpu_devices") == 2
    assert worker_pid(collector) != pid


def test_fewer_gpus_than_expected_fail_but_serve_the_visible_ones(scenario: Scenario,
                                                                  make: Make) -> None:
    error = failure(make(expected=4))
    assert error.reason == "missing_gpus"
    assert error.message == "2 of 4 expected GPUs are visible to NVML"
    reg = registry_of(error.families)
    assert reg.get_sample_value("colossalai_gpu_devices") == 2
    assert reg.get_sample_value("colossalai_gpu_expected_devices") == 4
    assert reg.get_sample_value("colossalai_gpu_memory_used_bytes", {"gpu": "1"}) == 2 * 2**30

    reg = collect(make(expected=2))
    assert reg.get_sample_value("colossalai_gpu_expected_devices") == 2


def test_zero_gpus_is_a_failure_unless_zero_are_expected(scenario: Scenario,
                                                         make: Make) -> None:
    scenario.write(gpus=[])
    error = failure(make())
    assert error.reason == "missing_gpus"
    assert "no GPUs" in error.message
    assert registry_of(error.families).get_sample_value("colossalai_gpu_devices") == 0
    assert failure(make(expected=1)).reason == "missing_gpus"
    assert collect(make(expected=0)).get_sample_value("colossalai_gpu_devices") == 0


def test_critical_xid_events_are_counted_with_the_last_code(scenario: Scenario,
                                                            make: Make) -> None:
    # An Xid from before the agent registered for events is not delivered (as in NVML).
    scenario.write(gpus=[gpu(0), gpu(1), gpu(2, xid_supported=False)],
                   xid=[{"id": "old", "gpu": 0, "code": 13}])
    collector = make()
    reg = collect(collector)
    assert reg.get_sample_value("colossalai_gpu_xid_errors_total", {"gpu": "0"}) == 0
    assert reg.get_sample_value("colossalai_gpu_xid_errors_total", {"gpu": "2"}) is None

    before = time.time()
    scenario.update(xid=[{"id": "old", "gpu": 0, "code": 13},
                         {"id": 1, "gpu": 1, "code": 48}, {"id": 2, "gpu": 1, "code": 79}])
    reg = collect(collector)
    assert reg.get_sample_value("colossalai_gpu_xid_errors_total", {"gpu": "0"}) == 0
    assert reg.get_sample_value("colossalai_gpu_xid_errors_total", {"gpu": "1"}) == 2
    assert reg.get_sample_value("colossalai_gpu_last_xid", {"gpu": "1"}) == 79
    seen = reg.get_sample_value("colossalai_gpu_last_xid_timestamp_seconds", {"gpu": "1"})
    assert before <= seen <= time.time()
    # Each event counts once: a quiet scrape leaves the counter where it was.
    assert collect(collector).get_sample_value("colossalai_gpu_xid_errors_total",
                                               {"gpu": "1"}) == 2


def test_xid_events_are_classified_by_the_catalog_and_outlive_a_lost_gpu(
        scenario: Scenario, make: Make) -> None:
    """Each code counted with its tier, action and meaning (node/gpu/xid_catalog.yml);
    a code the catalog lacks is "unknown", to look up. After Xid 79 the GPU is lost and
    every sample fails: the events are still served, so the page does not resolve."""
    scenario.write(gpus=[gpu(0), gpu(1)])
    collector = make()
    reg = collect(collector)
    assert reg.get_sample_value("colossalai_gpu_xid_events_total",
                                {"gpu": "0", "xid": "13", "tier": "application",
                                 "action": "restart_job",
                                 "what": "graphics engine exception (often an illegal "
                                         "memory access in the job)"}) is None
    scenario.update(xid=[{"id": 1, "gpu": 0, "code": 13}, {"id": 2, "gpu": 0, "code": 13},
                         {"id": 3, "gpu": 1, "code": 999}])
    reg = collect(collector)
    assert reg.get_sample_value("colossalai_gpu_xid_events_total",
                                {"gpu": "0", "xid": "13", "tier": "application",
                                 "action": "restart_job",
                                 "what": "graphics engine exception (often an illegal "
                                         "memory access in the job)"}) == 2
    assert reg.get_sample_value("colossalai_gpu_xid_events_total",
                                {"gpu": "1", "xid": "999", "tier": "unknown",
                                 "action": "look_up",
                                 "what": "not in this agent's Xid catalog"}) == 1

    scenario.update(gpus=[gpu(0), gpu(1, lost=True)],
                    xid=[{"id": 1, "gpu": 0, "code": 13}, {"id": 2, "gpu": 0, "code": 13},
                         {"id": 3, "gpu": 1, "code": 999}, {"id": 4, "gpu": 1, "code": 79}])
    error = failure(collector)
    assert error.reason == "gpu_lost"
    served = registry_of(error.families)
    assert served.get_sample_value("colossalai_gpu_xid_events_total",
                                   {"gpu": "1", "xid": "79", "tier": "critical",
                                    "action": "drain_reboot",
                                    "what": "GPU has fallen off the bus"}) == 1
    assert served.get_sample_value("colossalai_gpu_xid_events_total",
                                   {"gpu": "0", "xid": "13", "tier": "application",
                                    "action": "restart_job",
                                    "what": "graphics engine exception (often an illegal "
                                            "memory access in the job)"}) == 2


def test_an_xid_back_after_a_reboot_is_counted_by_the_gpus_uuid(
        scenario: Scenario, make: Make, tmp_path: Path) -> None:
    """Boot A: Xid 48 on GPU 1, written to the state directory. Boot B (another boot
    id, a new agent): the same GPU, now at index 0, has Xid 48 again: seen in 2 boots.
    GPU 1 of boot B (another board) has its first 48: 1."""
    from colossalai_exporter.node.gpu.xid_history import FILE_NAME, XidBoots

    state = tmp_path / "state"
    scenario.write(gpus=[gpu(0), gpu(1)])
    first = make(xid_boots=XidBoots(state, "boot-a"))
    collect(first)
    scenario.update(xid=[{"id": 1, "gpu": 1, "code": 48}])
    boots = {"gpu": "1", "xid": "48"}
    wait_until(lambda: collect(first).get_sample_value("colossalai_gpu_xid_boots", boots) == 1,
               timeout=10, what="Xid 48 counted in boot A")
    wait_until(lambda: (state / FILE_NAME).is_file()
               and "boot-a" in (state / FILE_NAME).read_text(), timeout=10,
               what="the history written")
    first.close()

    moved = gpu(1)["uuid"]
    scenario.write(gpus=[gpu(0, uuid=moved), gpu(1, uuid="GPU-another-board")])
    second = make(xid_boots=XidBoots(state, "boot-b"))
    collect(second)
    scenario.update(xid=[{"id": 2, "gpu": 0, "code": 48}, {"id": 3, "gpu": 1, "code": 48}])

    def counted() -> tuple[float | None, float | None]:
        reg = collect(second)
        return (reg.get_sample_value("colossalai_gpu_xid_boots", {"gpu": "0", "xid": "48"}),
                reg.get_sample_value("colossalai_gpu_xid_boots", {"gpu": "1", "xid": "48"}))

    wait_until(lambda: counted() == (2, 1), timeout=10, what="Xid 48 back on the same GPU")


def test_the_ranks_on_each_gpu_are_named_and_kept_while_the_gpu_is_lost(
        scenario: Scenario, make: Make) -> None:
    """NVML's compute processes matched to the node's ranks by pid: a GPU fault's page
    names the ranks it took down, also once the GPU no longer answers."""
    scenario.write(gpus=[gpu(0, processes=[4100, 999]), gpu(1, processes=[4101])])
    collector = make(local_ranks=lambda: {4100: 8, 4101: 9})
    reg = collect(collector)
    assert reg.get_sample_value("colossalai_gpu_rank_info", {"gpu": "0", "rank": "8"}) == 1
    assert reg.get_sample_value("colossalai_gpu_rank_info", {"gpu": "1", "rank": "9"}) == 1
    assert reg.get_sample_value("colossalai_gpu_rank_info", {"gpu": "0", "rank": "9"}) is None

    scenario.write(gpus=[gpu(0, processes=[4100]), gpu(1, lost=True)],
                   xid=[{"id": 1, "gpu": 1, "code": 79}])
    served = registry_of(failure(collector).families)
    assert served.get_sample_value("colossalai_gpu_rank_info", {"gpu": "1", "rank": "9"}) == 1

    # A GPU whose driver cannot list processes, and no ranks collector: nothing named.
    scenario.write(gpus=[gpu(0)])
    assert collect(make()).get_sample_value("colossalai_gpu_rank_info",
                                            {"gpu": "0", "rank": "8"}) is None


def test_the_xid_catalog_is_complete_and_consistent() -> None:
    from colossalai_exporter.node.gpu import xid

    table = xid.catalog()
    # The codes the research names (health-signals-2026-12.md, 1.2), each with its tier.
    critical = {48, 62, 64, 74, 79, 95, 119, 120, 136, 140, 143, *range(144, 151), 155, 156,
                158, 167}
    assert {code for code, c in table.items() if c.tier == "critical"} == critical
    assert {code for code, c in table.items() if c.tier == "application"} == {13, 31, 43, 45}
    assert {code for code, c in table.items() if c.tier == "warning"} == {63, 92, 94, 109, 154}
    assert all(c.action in xid.actions() and c.what for c in table.values())


def test_xid_counts_survive_a_replaced_worker(scenario: Scenario, make: Make) -> None:
    collector = make(timeout=0.5)
    collect(started(collector))
    scenario.update(xid=[{"id": 1, "gpu": 0, "code": 79}])
    collect(collector)
    scenario.update(hang="nvmlDeviceGetPowerUsage")
    assert failure(collector).reason == "timeout"
    scenario.update(hang=[])
    reg = collect(started(collector))  # the worker started at the kill
    assert reg.get_sample_value("colossalai_gpu_xid_errors_total", {"gpu": "0"}) == 1
    assert reg.get_sample_value("colossalai_gpu_last_xid", {"gpu": "0"}) == 79


def test_first_scrape_waits_for_the_worker_started_by_the_constructor(make: Make) -> None:
    # The worker starts in the constructor without waiting for it, and the first
    # scrape waits for it (within its deadline) rather than reporting "still
    # initialising". How soon the agent serves its first scrape (goal: 0.5 s) is
    # measured by bench/node_scrape.py, not asserted here.
    start = time.monotonic()
    collector = make()
    constructed = time.monotonic() - start
    reg = collect(collector)
    assert constructed < 0.1, constructed
    assert reg.get_sample_value("colossalai_gpu_devices") == 2


def test_close_stops_the_worker(make: Make) -> None:
    collector = make()
    collect(collector)
    pid = worker_pid(collector)
    collector.close()
    wait_until(lambda: gone(pid), 5, what="the worker to exit")
    assert failure(collector).reason == "nvml_error"


def test_the_worker_imports_pynvml_from_its_environment(scenario: Scenario,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The product has no switch for the fake: the worker imports "pynvml", and the
    # fake is found first only because the test put its folder on PYTHONPATH.
    use_fake_nvml(monkeypatch, scenario.path)
    collector = GpuCollector(timeout=BUDGET)
    try:
        assert collect(collector).get_sample_value("colossalai_gpu_devices") == 2
    finally:
        collector.close()


def test_no_environment_variable_of_the_product_selects_a_fake() -> None:
    # Issue 18: a deployed agent must never serve invented GPUs. The package holds no
    # fake NVML and reads no environment variable that names one.
    package = SOURCE_ROOT / "colossalai_exporter"
    assert not list(package.rglob("fake_nvml*.py"))
    for source in package.rglob("*.py"):
        text = source.read_text(encoding="utf-8")
        assert "FAKE_NVML" not in text and "fake_nvml" not in text, source


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="timeout must be positive"):
        GpuCollector(timeout=0)
    with pytest.raises(ValueError, match="0 or more"):
        GpuCollector(expected=-1)


def test_a_hung_worker_exits_when_its_agent_dies(scenario: Scenario, tmp_path: Path) -> None:
    # The agent crashes (no close()) while its worker hangs in nvmlInit: the
    # worker's watchdog thread must still notice and exit.
    scenario.write(gpus=[gpu(0)], hang="nvmlInit")
    # Files, not pipes: the worker inherits the agent's stdout and stderr, and
    # reading a pipe to its end would wait for the orphan too, under the
    # program's own timeout; the orphan gets its own wait below.
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    program = (
        "import os, sys, time\n"
        "from colossalai_exporter.node.gpu import GpuCollector\n"
        "c = GpuCollector(timeout=0.2)\n"
        "try:\n"
        "    c.collect(time.monotonic() + 0.2)\n"
        "except Exception as exc:\n"
        "    print(exc.reason)\n"
        "print(c._worker.pid, flush=True)\n"
        "os._exit(0)\n")
    with out.open("w") as stdout, err.open("w") as stderr:
        result = subprocess.run([sys.executable, "-c", program],
                                stdout=stdout, stderr=stderr, timeout=10,
                                env=fake_nvml_env(scenario.path, cli_env()),
                                check=False)
    assert result.returncode == 0, err.read_text()
    reason, pid = out.read_text().split()
    assert reason == "timeout"
    wait_until(lambda: gone(int(pid)), 5, what="the orphaned worker to exit")


def test_a_worker_whose_agent_died_before_it_started_exits(scenario: Scenario) -> None:
    # An agent that dies while its worker is still importing: the worker is
    # adopted before its watchdog starts, and must still see that its agent
    # (named on its command line, here one that already exited) is gone.
    from colossalai_exporter.node.gpu import worker

    scenario.write(gpus=[gpu(0)], hang="nvmlInit")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True, timeout=10)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        orphan = subprocess.Popen(
            [sys.executable, "-c", worker._BOOT, worker._SOURCE_ROOT, str(theirs.fileno()),
             dead.stdout.strip()],
            stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
            env=fake_nvml_env(scenario.path, cli_env()))
        try:
            assert orphan.wait(timeout=10) == 1
        finally:
            orphan.kill()


def test_begin_asks_early_and_collect_takes_that_reading(scenario: Scenario, make: Make) -> None:
    """The agent calls begin() before the other collectors run: one request serves
    the scrape, and its answer is fresh (asked for after the scrape started)."""
    collector = make()
    collect(collector)
    worker = collector._worker
    assert worker is not None
    scenario.write(gpus=[gpu(0, temperature=77), gpu(1)])
    asked = worker._next_id
    pending = collector.begin(time.monotonic() + 2)
    wait_until(lambda: worker.conn.poll(0), 5, what="the worker's answer")
    reg = collect(collector, pending=pending)
    assert worker._next_id == asked + 1
    assert reg.get_sample_value("colossalai_gpu_temperature_celsius", {"gpu": "0"}) == 77


def test_an_answer_begun_by_another_scrape_that_never_collected_is_stale(
        scenario: Scenario, make: Make) -> None:
    collector = make()
    collect(collector)
    worker = collector._worker
    assert worker is not None
    thread = threading.Thread(target=collector.begin, args=(time.monotonic() + 2,))
    thread.start()
    thread.join(5)
    wait_until(lambda: worker.conn.poll(0), 5, what="the worker's answer")
    scenario.write(gpus=[gpu(0, temperature=66), gpu(1)])
    reg = collect(collector)  # this thread began nothing: that answer is not its own
    assert reg.get_sample_value("colossalai_gpu_temperature_celsius", {"gpu": "0"}) == 66


def test_begin_does_not_block_on_a_hung_worker(scenario: Scenario, make: Make) -> None:
    collector = make(timeout=0.5)
    collect(started(collector))
    scenario.write(gpus=[gpu(0)], hang="nvmlDeviceGetMemoryInfo")
    for _ in range(2):  # the second begin() finds a request still unanswered
        start = time.monotonic()
        pending = collector.begin(time.monotonic() + 0.5)
        assert time.monotonic() - start < 0.1
        assert failure(collector, budget=0.5, pending=pending).reason == "timeout"
        assert time.monotonic() - start < 0.5 + MARGIN


def test_an_event_handle_is_matched_by_the_address_it_holds() -> None:
    """pynvml's device handles are ctypes pointers: the one an event carries is another
    object than the reader's, equal only by address (what the reader matches on, so that
    a lost GPU's index need not be asked of NVML)."""
    import ctypes

    import pynvml

    from colossalai_exporter.node.gpu.reader import _handle_key

    device = pynvml.struct_c_nvmlDevice_t()
    kept = ctypes.pointer(device)
    from_event = ctypes.cast(ctypes.addressof(device), pynvml.c_nvmlDevice_t)
    assert kept is not from_event
    assert _handle_key(kept) == _handle_key(from_event) == ctypes.addressof(device)
    other = ctypes.pointer(pynvml.struct_c_nvmlDevice_t())
    assert _handle_key(other) != _handle_key(kept)


def test_ecc_errors_since_the_driver_loaded_by_location(make: Make,
                                                        scenario: Scenario) -> None:
    """GPU 0 splits its volatile ECC counts by DRAM and SRAM; GPU 1 (an older driver)
    cannot, and serves none of them."""
    scenario.write(gpus=[
        gpu(0, ecc_locations={"dram": {"corrected": 7}, "sram": {"uncorrected": 1}}),
        gpu(1),
    ])
    reg = collect_once_started(make())
    value = reg.get_sample_value
    name = "colossalai_gpu_ecc_volatile_errors_total"
    assert value(name, {"gpu": "0", "type": "corrected", "location": "dram"}) == 7
    assert value(name, {"gpu": "0", "type": "uncorrected", "location": "sram"}) == 1
    assert value(name, {"gpu": "0", "type": "uncorrected", "location": "dram"}) == 0
    assert value(name, {"gpu": "1", "type": "corrected", "location": "dram"}) is None


def test_nvlink_links_active_and_their_errors(make: Make, scenario: Scenario) -> None:
    """GPU 0 has 18 links, link 3 down, link 4 asleep (low power: up), and replay and CRC
    errors; GPU 1 all 18 up and no error, on a driver without the per-link state field;
    GPU 2 (a PCIe board) has no NVLink and serves none of it."""
    scenario.write(gpus=[
        gpu(0, nvlink={"links": 18, "inactive": [3], "asleep": [4],
                       "errors": {"replay": 7, "crc_flit": 2}}),
        # a driver without the per-link state field: each link asked on its own
        gpu(1, nvlink={"links": 18, "state_field": False}),
        gpu(2),
    ])
    reg = collect_once_started(make())
    value = reg.get_sample_value
    assert value("colossalai_gpu_nvlink_links", {"gpu": "0"}) == 18
    assert value("colossalai_gpu_nvlink_links_active", {"gpu": "0"}) == 17
    assert value("colossalai_gpu_nvlink_links_active", {"gpu": "1"}) == 18
    assert value("colossalai_gpu_nvlink_errors_total", {"gpu": "0", "kind": "replay"}) == 7
    assert value("colossalai_gpu_nvlink_errors_total", {"gpu": "0", "kind": "crc_flit"}) == 2
    assert value("colossalai_gpu_nvlink_errors_total", {"gpu": "0", "kind": "recovery"}) == 0
    assert value("colossalai_gpu_nvlink_errors_total", {"gpu": "1", "kind": "crc_data"}) == 0
    text = exposition(list(reg.collect()))
    assert not [line for line in series(text) if "nvlink" in line and 'gpu="2"' in line]


def test_the_gpus_own_health_verdicts(make: Make, scenario: Scenario) -> None:
    """NVML's recovery action, row remaps, retired pages, PCIe replays and hardware
    slowdowns, each where the GPU has it; a GPU without them serves none of them."""
    scenario.write(gpus=[
        gpu(0, recovery_action=4, pcie_replays=120, clock_event_reasons=0x40 | 0x4 | 0x1,
            remapped_rows={"correctable": 2, "uncorrectable": 1, "pending": True,
                           "failure": False}),
        gpu(1, recovery_action=0, retired_pages={"single_bit": 3, "double_bit": 1,
                                                 "pending": True}),
        gpu(2),  # an older driver and board: none of it
    ])
    reg = collect_once_started(make())
    value = reg.get_sample_value
    assert value("colossalai_gpu_recovery_action_info",
                 {"gpu": "0", "action": "drain_and_reset"}) == 1
    assert value("colossalai_gpu_recovery_action_info", {"gpu": "1", "action": "none"}) == 1
    assert value("colossalai_gpu_remapped_rows", {"gpu": "0", "kind": "uncorrectable"}) == 1
    assert value("colossalai_gpu_row_remap_pending", {"gpu": "0"}) == 1
    assert value("colossalai_gpu_row_remap_failed", {"gpu": "0"}) == 0
    assert value("colossalai_gpu_retired_pages", {"gpu": "1", "kind": "single_bit_ecc"}) == 3
    assert value("colossalai_gpu_retired_pages_pending", {"gpu": "1"}) == 1
    assert value("colossalai_gpu_pcie_replays_total", {"gpu": "0"}) == 120
    # HW thermal slowdown is active; the power cap (0x4) and idle (0x1) are not reasons
    assert value("colossalai_gpu_clock_slowdown_active",
                 {"gpu": "0", "reason": "hw_thermal_slowdown"}) == 1
    assert value("colossalai_gpu_clock_slowdown_active",
                 {"gpu": "0", "reason": "hw_slowdown"}) == 0
    text = exposition(list(reg.collect()))
    for name in ("recovery_action", "remapped_rows", "retired_pages", "pcie_replays",
                 "clock_slowdown"):
        assert f'colossalai_gpu_{name}' not in "\n".join(
            line for line in series(text) if 'gpu="2"' in line), name
