"""Read GPUs through an NVML module with pynvml's API; runs in the worker.

:class:`NvmlReader` keeps NVML initialised between samples (``nvmlInit`` can
take seconds per GPU when persistence mode is off), caches what does not change
(UUIDs, names, driver version, device handles) and registers every GPU for
critical Xid events once per initialisation. A sample that meets
``NVML_ERROR_GPU_IS_LOST`` shuts NVML down so the next one re-initialises it:
handles of a GPU that fell off the bus stay invalid until then.

Per-metric ``NotSupported`` (and ``FunctionNotFound`` from older drivers) only
leaves that value out for that GPU; other NVML errors fail the sample.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from typing import Any

from colossalai_exporter.node.gpu.protocol import (
    GPU_LOST,
    NO_DRIVER,
    NVML_ERROR,
    Failure,
    GpuReading,
    Reading,
    XidEvent,
)

#: Events read per sample at most, so an event storm cannot stretch a sample.
MAX_EVENTS_PER_SAMPLE = 256

RECOVERY_ACTION = "recovery_action"
NVLINK_LINK_COUNT = "nvlink_link_count"
#: the NVLink error counters, totals over the GPU's links (the kinds DCGM and NVRx read)
NVLINK_ERROR_KINDS = ("crc_flit", "crc_data", "replay", "recovery")
#: NVML_NVLINK_STATE_ACTIVE and _SLEEP (a link in low power is not down); INACTIVE and
#: ACTIVE_TRAFFIC_DISABLED are
NVLINK_UP_STATES = (1, 2)
#: what the reader asks nvmlDeviceGetFieldValues for, by the pynvml constant naming it
FIELDS = {
    # driver >= 570: 0 none, 1 GPU reset, 2 node reboot, ... (health.RECOVERY_ACTIONS)
    RECOVERY_ACTION: "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION",
    NVLINK_LINK_COUNT: "NVML_FI_DEV_NVLINK_LINK_COUNT",
    "crc_flit": "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "crc_data": "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "replay": "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "recovery": "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
}


class NvmlReader:
    """Samples every visible GPU through ``nvml``, a module with pynvml's API."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._initialised = False
        self._driver_version = ""
        self._devices: list[tuple[Any, str, str]] = []  # (handle, uuid, name) by index
        self._event_set: Any = None
        self._watched: set[int] = set()

    # -- lifecycle -----------------------------------------------------------
    def initialise(self) -> Failure | None:
        """Initialise NVML and cache the devices; a Failure instead of raising."""
        if self._initialised:
            return None
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            return self._failure(exc, "nvmlInit")
        self._initialised = True
        try:
            self._driver_version = _text(nvml.nvmlSystemGetDriverVersion())
            count = int(nvml.nvmlDeviceGetCount())
            devices = []
            for index in range(count):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                devices.append((handle, _text(nvml.nvmlDeviceGetUUID(handle)),
                                _text(nvml.nvmlDeviceGetName(handle))))
            self._devices = devices
            self._register_xid_events()
        except nvml.NVMLError as exc:
            failure = self._failure(exc, "enumerating GPUs")
            self.shutdown()
            return failure
        return None

    def shutdown(self) -> None:
        """Release the event set and NVML; errors are ignored (the GPU may be gone)."""
        nvml = self.nvml
        if self._event_set is not None:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlEventSetFree(self._event_set)
        if self._initialised:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()
        self._initialised = False
        self._event_set = None
        self._watched = set()
        self._devices = []

    def _register_xid_events(self) -> None:
        nvml = self.nvml
        try:
            self._event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            if _omittable(nvml, exc):
                return
            raise
        for index, (handle, _, _) in enumerate(self._devices):
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError,
                                              self._event_set)
            except nvml.NVMLError as exc:
                # Some GPUs (and vGPUs) cannot deliver Xid events; they simply
                # have no Xid series.
                if not _omittable(nvml, exc):
                    raise
            else:
                self._watched.add(index)

    # -- sampling ------------------------------------------------------------
    def sample(self) -> Reading:
        """One reading of every GPU, or a Reading whose ``failure`` says why not."""
        failure = self.initialise()
        if failure is not None:
            return Reading(failure=failure)
        nvml = self.nvml
        xids: list[XidEvent] = []
        step = "reading Xid events"
        try:
            self._read_events(xids)
            gpus = []
            for index, (handle, uuid, name) in enumerate(self._devices):
                step = f"reading GPU {index}"
                gpus.append(self._read_gpu(index, handle, uuid, name))
        except nvml.NVMLError as exc:
            failure = self._failure(exc, step)
            if failure.reason == GPU_LOST or _value(exc) == nvml.NVML_ERROR_UNINITIALIZED:
                self.shutdown()
            return Reading(xids=tuple(xids), failure=failure)
        return Reading(gpus=tuple(gpus), driver_version=self._driver_version, xids=tuple(xids))

    def _read_events(self, into: list[XidEvent]) -> None:
        nvml = self.nvml
        if self._event_set is None:
            return
        for _ in range(MAX_EVENTS_PER_SAMPLE):
            try:
                data = nvml.nvmlEventSetWait_v2(self._event_set, 0)
            except nvml.NVMLError as exc:
                if _value(exc) == nvml.NVML_ERROR_TIMEOUT:
                    return  # no event pending: the normal case
                raise
            if not int(data.eventType) & nvml.nvmlEventTypeXidCriticalError:
                continue
            into.append(XidEvent(gpu=self._index_of(data.device), code=int(data.eventData),
                                 seen_at=time.time()))

    def _index_of(self, handle: Any) -> int:
        """The GPU index of an event's device handle, looked up among the handles this
        reader holds first: the event that says a GPU fell off the bus (Xid 79) comes
        with a handle NVML may answer GPU_IS_LOST for, and losing that event would lose
        the page."""
        key = _handle_key(handle)
        for index, (known, _, _) in enumerate(self._devices):
            if _handle_key(known) == key:
                return index
        return int(self.nvml.nvmlDeviceGetIndex(handle))

    def _read_gpu(self, index: int, handle: Any, uuid: str, name: str) -> GpuReading:
        nvml = self.nvml
        memory = self._optional(nvml.nvmlDeviceGetMemoryInfo, handle)
        utilization = self._optional(nvml.nvmlDeviceGetUtilizationRates, handle)
        temperature = self._optional(nvml.nvmlDeviceGetTemperature, handle,
                                     nvml.NVML_TEMPERATURE_GPU)
        power = self._optional(nvml.nvmlDeviceGetPowerUsage, handle)
        corrected = self._optional(nvml.nvmlDeviceGetTotalEccErrors, handle,
                                   nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_AGGREGATE_ECC)
        uncorrected = self._optional(nvml.nvmlDeviceGetTotalEccErrors, handle,
                                     nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                     nvml.NVML_AGGREGATE_ECC)
        processes = self._optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle)
        remapped = self._optional(nvml.nvmlDeviceGetRemappedRows, handle)
        fields = self._fields(handle)
        return GpuReading(
            index=index, uuid=uuid, name=name,
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            utilization_percent=None if utilization is None else float(utilization.gpu),
            temperature_celsius=None if temperature is None else float(temperature),
            power_milliwatts=None if power is None else int(power),
            ecc_corrected=None if corrected is None else int(corrected),
            ecc_uncorrected=None if uncorrected is None else int(uncorrected),
            xid_watched=index in self._watched,
            pids=None if processes is None else tuple(int(p.pid) for p in processes),
            recovery_action=fields.get(RECOVERY_ACTION),
            remapped_rows=None if remapped is None else (
                int(remapped[0]), int(remapped[1]), bool(remapped[2]), bool(remapped[3])),
            retired_pages=self._retired_pages(handle),
            pcie_replays=self._optional(nvml.nvmlDeviceGetPcieReplayCounter, handle),
            clock_event_reasons=self._clock_event_reasons(handle),
            ecc_volatile=self._ecc_volatile(handle),
            nvlink_links=self._nvlink_links(handle, fields.get(NVLINK_LINK_COUNT)),
            nvlink_errors=_nvlink_errors(fields),
        )

    def _fields(self, handle: Any) -> dict[str, int]:
        """The NVML fields the reader uses (FIELDS), in one call: name -> value, for those
        this GPU and driver support (each field answers on its own: NOT_SUPPORTED …)."""
        nvml = self.nvml
        ids = {getattr(nvml, constant): name for name, constant in FIELDS.items()
               if hasattr(nvml, constant)}  # an older nvidia-ml-py lacks the newest
        values = self._optional(nvml.nvmlDeviceGetFieldValues, handle, list(ids)) or []
        found: dict[str, int] = {}
        for value in values:
            if int(value.nvmlReturn) == 0 and int(value.fieldId) in ids:
                found[ids[int(value.fieldId)]] = _field_number(nvml, value)
        return found

    def _nvlink_links(self, handle: Any, count: int | None) -> tuple[int, int] | None:
        """(links, links active). Every link's state in one call where the driver has the
        NVLINK_GET_STATE field (one field a link, by scope): 18 calls a GPU a sample
        otherwise, each a trip into the driver. A link asleep (low power) is up."""
        if not count:
            return None  # no NVLink (a PCIe board, or NVML cannot say)
        nvml = self.nvml
        field_id = getattr(nvml, "NVML_FI_DEV_NVLINK_GET_STATE", None)
        if field_id is not None:
            values = self._optional(nvml.nvmlDeviceGetFieldValues, handle,
                                    [(field_id, link) for link in range(count)]) or []
            if len(values) == count and all(int(v.nvmlReturn) == 0 for v in values):
                states = [_field_number(nvml, v) for v in values]
                return count, sum(1 for state in states if state in NVLINK_UP_STATES)
        active = 0
        for link in range(count):
            state = self._optional(nvml.nvmlDeviceGetNvLinkState, handle, link)
            if state is None:
                return None
            active += 1 if int(state) == 1 else 0  # NVML_FEATURE_ENABLED
        return count, active

    def _ecc_volatile(self, handle: Any) -> tuple[tuple[str, str, int], ...] | None:
        """ECC errors since the driver loaded, by type and location (DRAM: the HBM;
        SRAM: on-chip caches and register files, whose uncorrectable errors NHC fails a
        node on). Volta and later; None where NVML does not split them."""
        nvml = self.nvml
        found: list[tuple[str, str, int]] = []
        for kind, error_type in (("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                 ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
            for location, where in (("dram", nvml.NVML_MEMORY_LOCATION_DRAM),
                                    ("sram", nvml.NVML_MEMORY_LOCATION_SRAM)):
                count = self._optional(nvml.nvmlDeviceGetMemoryErrorCounter, handle,
                                       error_type, nvml.NVML_VOLATILE_ECC, where)
                if count is not None:
                    found.append((kind, location, int(count)))
        return tuple(found) or None

    def _retired_pages(self, handle: Any) -> tuple[int, int, bool] | None:
        nvml = self.nvml
        single = self._optional(nvml.nvmlDeviceGetRetiredPages, handle,
                                nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        if single is None:
            return None  # Ampere and later remap rows instead
        double = self._optional(nvml.nvmlDeviceGetRetiredPages, handle,
                                nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR) or []
        pending = self._optional(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        return len(single), len(double), bool(pending)

    def _clock_event_reasons(self, handle: Any) -> int | None:
        nvml = self.nvml
        # The older name on drivers before 535 (the same mask).
        for name in ("nvmlDeviceGetCurrentClocksEventReasons",
                     "nvmlDeviceGetCurrentClocksThrottleReasons"):
            function = getattr(nvml, name, None)
            if function is not None:
                value = self._optional(function, handle)
                if value is not None:
                    return int(value)
        return None

    def _optional(self, function: Any, *args: Any) -> Any:
        """``function(*args)``, or None where this GPU or driver does not support it."""
        try:
            return function(*args)
        except self.nvml.NVMLError as exc:
            if _omittable(self.nvml, exc):
                return None
            raise

    def _failure(self, exc: Exception, step: str) -> Failure:
        nvml = self.nvml
        value = _value(exc)
        if value in (nvml.NVML_ERROR_LIBRARY_NOT_FOUND, nvml.NVML_ERROR_DRIVER_NOT_LOADED):
            return Failure(NO_DRIVER, f"no NVIDIA driver found (NVML: {exc})")
        if value == nvml.NVML_ERROR_GPU_IS_LOST:
            return Failure(GPU_LOST, f"{step}: NVML says the GPU is lost (fell off the bus?); "
                                     "NVML is re-initialised at the next scrape")
        return Failure(NVML_ERROR, f"{step}: NVML error {value}: {exc}")


def _field_number(nvml: Any, value: Any) -> int:
    """A field's value as its valueType says (NVML_VALUE_TYPE_*: the NVLink totals are
    unsigned long long, the recovery action and the link count unsigned int)."""
    kind = int(getattr(value, "valueType", 1))
    member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}
    return int(getattr(value.value, member.get(kind, "uiVal")))


def _nvlink_errors(fields: dict[str, int]) -> tuple[tuple[str, int], ...] | None:
    found = tuple((kind, fields[kind]) for kind in NVLINK_ERROR_KINDS if kind in fields)
    return found or None


def _omittable(nvml: Any, exc: Exception) -> bool:
    return _value(exc) in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND)


def _value(exc: Exception) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> Any:
    """What identifies a device handle: pynvml's is a ctypes pointer, equal to another
    only by the address it holds."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle  # not a ctypes pointer (a test's NVML): itself
