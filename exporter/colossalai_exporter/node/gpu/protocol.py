"""What the NVML worker sends back: plain, picklable readings and failure reasons.

Both sides import this module; it imports nothing outside the standard
library, so the worker process stays small.
"""

from __future__ import annotations

from dataclasses import dataclass

TIMEOUT = "timeout"
NO_DRIVER = "no_driver"
GPU_LOST = "gpu_lost"
MISSING_GPUS = "missing_gpus"
NVML_ERROR = "nvml_error"
WORKER_DIED = "worker_died"

#: Every reason the gpu collector's CollectorError can carry.
REASONS: tuple[str, ...] = (TIMEOUT, NO_DRIVER, GPU_LOST, MISSING_GPUS, NVML_ERROR, WORKER_DIED)


@dataclass(frozen=True)
class GpuReading:
    """One GPU's values from one sample; ``None`` where NVML said NotSupported."""

    index: int
    uuid: str
    name: str
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization_percent: float | None = None
    temperature_celsius: float | None = None
    power_milliwatts: int | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    #: whether critical Xid events are registered for this GPU
    xid_watched: bool = False
    #: pids of the compute processes on the GPU (None where NVML cannot list them)
    pids: tuple[int, ...] | None = None
    #: NVML's GPU_RECOVERY_ACTION field (driver >= 570): 0 none, 1 GPU reset, 2 node
    #: reboot, 3 drain P2P, 4 drain and reset, ...
    recovery_action: int | None = None
    #: row remapping (Ampere and later): (correctable rows, uncorrectable rows, a remap
    #: pending until the next reset, a remap that failed)
    remapped_rows: tuple[int, int, bool, bool] | None = None
    #: page retirement (before Ampere): (pages retired for single-bit errors, for
    #: double-bit errors, a retirement pending until the next reboot)
    retired_pages: tuple[int, int, bool] | None = None
    #: PCIe replays since the driver loaded
    pcie_replays: int | None = None
    #: NVML's clocks event reasons, a bit mask (nvmlClocksEventReason*)
    clock_event_reasons: int | None = None
    #: ECC errors since the driver loaded, by (type corrected|uncorrected, location
    #: dram|sram); None where NVML cannot tell them apart by location
    ecc_volatile: tuple[tuple[str, str, int], ...] | None = None
    #: NVLink: (links the GPU has, links active now); None on a GPU without NVLink
    nvlink_links: tuple[int, int] | None = None
    #: NVLink error counters summed over the GPU's links, by kind (NVLINK_ERROR_KINDS)
    nvlink_errors: tuple[tuple[str, int], ...] | None = None


@dataclass(frozen=True)
class XidEvent:
    """A critical Xid event, stamped with the wall-clock time the worker read it."""

    gpu: int
    code: int
    seen_at: float


@dataclass(frozen=True)
class Failure:
    """Why a sample failed: one of :data:`REASONS` and a readable message."""

    reason: str
    message: str


@dataclass(frozen=True)
class Reading:
    """The worker's answer to one sample request.

    ``xids`` are the events read before the sample finished or failed: they
    count even when ``failure`` is set or when the reading itself is stale.
    """

    gpus: tuple[GpuReading, ...] = ()
    driver_version: str = ""
    xids: tuple[XidEvent, ...] = ()
    failure: Failure | None = None
