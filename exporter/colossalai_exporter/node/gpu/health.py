"""A GPU's own health verdicts, as NVML reports them: what to do, from the driver.

Six signals the operators' tools agree on (../shared/research/health-signals-2026-12.md
§1.3), each served only where the GPU and driver have it:

* the **recovery action** NVML asks for (driver >= 570; NVRx, Azure's health agent
  and NVSentinel act on it): none, reset the GPU, reboot the node, drain P2P, drain
  and reset;
* **row remapping** (Ampere and later): a remap pending until the next GPU reset,
  and a remap that failed (the GPU has run out of spare rows: replace it);
* **page retirement** (before Ampere): pages retired for single- and double-bit
  errors, and a retirement pending until the next reboot;
* **ECC errors since the driver loaded, by location**: DRAM (the HBM) and SRAM (on-chip
  caches and register files); an uncorrectable one needs a reset, many correctable
  SRAM errors a replacement (NHC's H100 limits);
* **NVLink**: the links a GPU has and how many are active (one down cuts the GPU's
  collectives to a slower path or breaks them), and the links' error counters summed
  over the links (CRC, replay, recovery: DCGM's and NVRx's), per GPU rather than per
  link, which would be 18 series a counter on an H100;
* **PCIe replays** (link-level retries: a marginal riser, slot or cable) and the
  **clock event reasons** that slow a GPU down without a job asking (hardware
  slowdown, thermal, power brake; the power cap and idle are left out, as NHC does).

The words for the recovery actions are NVML's (nvmlGpuRecoveryAction_t).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.core import Metric as MetricFamily

from colossalai_exporter import catalogue
from colossalai_exporter.node.gpu.protocol import GpuReading

#: NVML_GPU_RECOVERY_ACTION_* values -> the action label
RECOVERY_ACTIONS = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p",
                    4: "drain_and_reset", 5: "recover_imex_domain", 6: "bus_reset",
                    7: "system_reboot"}
#: what each recovery action asks of an operator (the page's and `node check`'s words)
RECOVERY_ACTION_WORDS = {
    "gpu_reset": "reset the GPU (nvidia-smi -r -i <gpu>) once its processes are stopped",
    "node_reboot": "drain the node and reboot it",
    "drain_p2p": "stop the node's multi-GPU (peer-to-peer) jobs, then reset the GPU",
    "drain_and_reset": "drain the node, then reset the GPU",
    "bus_reset": "drain the node and reset the GPU's PCIe bus",
    "system_reboot": "drain the node and reboot the whole system",
}
#: nvmlClocksEventReason* bits that mean the hardware slowed the GPU down, by label
#: (0xE8: healthagent's error mask); the power cap (0x4), idle (0x1), application
#: clocks (0x2), sync boost (0x10) and display (0x100) are the job's or the admin's
SLOWDOWN_REASONS = {"hw_slowdown": 0x08, "sw_thermal_slowdown": 0x20,
                    "hw_thermal_slowdown": 0x40, "hw_power_brake_slowdown": 0x80}


def health_families(gpus: Sequence[GpuReading]) -> list[MetricFamily]:
    action = catalogue.info("colossalai_gpu_recovery_action_info")
    remapped = catalogue.gauge("colossalai_gpu_remapped_rows")
    remap_pending = catalogue.gauge("colossalai_gpu_row_remap_pending")
    remap_failed = catalogue.gauge("colossalai_gpu_row_remap_failed")
    retired = catalogue.gauge("colossalai_gpu_retired_pages")
    retire_pending = catalogue.gauge("colossalai_gpu_retired_pages_pending")
    replays = catalogue.counter("colossalai_gpu_pcie_replays_total")
    slowdown = catalogue.gauge("colossalai_gpu_clock_slowdown_active")
    ecc_volatile = catalogue.counter("colossalai_gpu_ecc_volatile_errors_total")
    links = catalogue.gauge("colossalai_gpu_nvlink_links")
    links_active = catalogue.gauge("colossalai_gpu_nvlink_links_active")
    nvlink_errors = catalogue.counter("colossalai_gpu_nvlink_errors_total")
    for gpu in gpus:
        label = [str(gpu.index)]
        if gpu.recovery_action is not None:
            words = RECOVERY_ACTIONS.get(gpu.recovery_action, f"unknown_{gpu.recovery_action}")
            action.add_metric(label, {"action": words})
        if gpu.remapped_rows is not None:
            correctable, uncorrectable, pending, failed = gpu.remapped_rows
            remapped.add_metric([*label, "correctable"], correctable)
            remapped.add_metric([*label, "uncorrectable"], uncorrectable)
            remap_pending.add_metric(label, 1.0 if pending else 0.0)
            remap_failed.add_metric(label, 1.0 if failed else 0.0)
        if gpu.retired_pages is not None:
            single, double, pending = gpu.retired_pages
            retired.add_metric([*label, "single_bit_ecc"], single)
            retired.add_metric([*label, "double_bit_ecc"], double)
            retire_pending.add_metric(label, 1.0 if pending else 0.0)
        if gpu.pcie_replays is not None:
            replays.add_metric(label, gpu.pcie_replays)
        if gpu.clock_event_reasons is not None:
            for reason, bit in SLOWDOWN_REASONS.items():
                active = 1.0 if gpu.clock_event_reasons & bit else 0.0
                slowdown.add_metric([*label, reason], active)
        for kind, location, count in gpu.ecc_volatile or ():
            ecc_volatile.add_metric([*label, kind, location], count)
        if gpu.nvlink_links is not None:
            count, active_count = gpu.nvlink_links
            links.add_metric(label, count)
            links_active.add_metric(label, active_count)
        for kind, errors in gpu.nvlink_errors or ():
            nvlink_errors.add_metric([*label, kind], errors)
    return [action, remapped, remap_pending, remap_failed, retired, retire_pending, replays,
            slowdown, ecc_volatile, links, links_active, nvlink_errors]
