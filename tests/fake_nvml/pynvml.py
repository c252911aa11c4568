"""A fake ``pynvml`` for machines without a GPU: the tests' stand-in for NVML.

It is not part of the product and no switch in the product selects it. A test
puts this folder first on the NVML worker's ``PYTHONPATH`` and names a scenario
file in ``$FAKE_NVML_SCENARIO`` (tests/gpu_helpers.py: ``fake_nvml_env``), so
the worker's ``import pynvml`` finds this module instead of nvidia-ml-py. It
offers the subset of pynvml's API that the agent's reader
(colossalai_exporter/node/gpu/reader.py) calls, under the same names, and
raises the real binding's own ``NVMLError`` subclasses with the real
``NVML_ERROR_*`` values, so code under test cannot tell it from the real
binding by the errors it sees.

The scenario file is checked at every call and re-read when it changed, so a
test can change the hardware live (write a new file and rename it over the old
one). A scenario looks like::

    {
      "driver_version": "550.54.15",
      "gpus": [
        {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-0000…",
         "memory_total": 85899345920, "memory_used": 1073741824,
         "utilization": 37, "temperature": 55, "power_mw": 250000,
         "ecc": {"corrected": 2, "uncorrected": 0}}
      ],
      "errors": {"nvmlInit": 9},
      "hang": "nvmlDeviceGetMemoryInfo",
      "xid": [{"id": 1, "gpu": 0, "code": 79}]
    }

What each knob mimics on real hardware:

- ``gpus``: the devices ``nvmlDeviceGetCount`` enumerates, in index order.
  A value left out of a GPU (``memory_total``/``memory_used``,
  ``utilization`` in percent, ``temperature`` in °C, ``power_mw`` in
  milliwatts as NVML reports power, ``ecc``) raises ``NVMLError_NotSupported``
  for that GPU, as consumer GPUs do for ECC and some boards do for power.
- ``gpus[].errors`` / top-level ``errors``: ``{function name: NVML error
  code}``: that call raises ``NVMLError(code)`` for that GPU / for every call,
  e.g. ``{"nvmlInit": 9}`` is a machine whose kernel module is not loaded
  (DRIVER_NOT_LOADED) and ``{"nvmlInit": 12}`` one without libnvidia-ml
  (LIBRARY_NOT_FOUND).
- ``gpus[].lost: true``: the GPU fell off the bus: every call with a handle
  obtained before the loss was noticed raises ``NVMLError_GpuIsLost``;
  handles from a later ``nvmlInit`` work again, as after a successful GPU
  reset and driver re-initialisation. A fresh process sees the loss once.
- ``hang``: a function name (or a list, or ``"*"`` for every call): that call
  never returns, like NVML calls into a wedged GPU (they block in the kernel
  driver and cannot be interrupted). Test aid, no NVML counterpart: a process
  entering a hang first appends ``PID FUNCTION`` to ``SCENARIO.hung``.
- ``slow``: ``{function name: seconds}``: that call answers, but only after
  that long, as NVML calls do on a GPU that is busy in the driver or wakes
  from a low power state (``nvmlInit`` without persistence mode can take
  seconds per GPU).
- ``xid``: critical Xid events (``code`` as in the kernel log's "NVRM: Xid"
  lines, 79 = fallen off the bus, 48 = double-bit ECC, …). Like NVML, an
  event set delivers only events that appear after the GPU was registered,
  each once, through ``nvmlEventSetWait_v2``; ``gpus[].xid_supported: false``
  makes ``nvmlDeviceRegisterEvents`` raise NotSupported for that GPU.
- ``gpus[].processes``: the pids of the compute processes on the GPU, as
  ``nvmlDeviceGetComputeRunningProcesses`` lists them (each with
  ``usedGpuMemory``); left out, the GPU has none.
- The health fields, each NotSupported when left out (as on GPUs or drivers
  without it): ``recovery_action`` (the ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``
  field of ``nvmlDeviceGetFieldValues``, driver >= 570: 0 none, 1 GPU reset, 2
  node reboot, 3 drain P2P, 4 drain and reset); ``remapped_rows``
  (``{"correctable": n, "uncorrectable": n, "pending": bool, "failure": bool}``,
  Ampere and later); ``retired_pages`` (``{"single_bit": n, "double_bit": n,
  "pending": bool}``, before Ampere); ``pcie_replays`` (a count);
  ``clock_event_reasons`` (the nvmlClocksEventReason* bit mask: 0x8 HW slowdown,
  0x20 SW thermal, 0x40 HW thermal, 0x80 power brake, 0x4 the power cap);
  ``ecc_locations`` (``{"dram": {"corrected": n, "uncorrected": n}, "sram": {…}}``:
  ``nvmlDeviceGetMemoryErrorCounter`` by location); ``nvlink`` (``{"links": 18,
  "inactive": [3], "asleep": [4], "errors": {"crc_flit": n, "crc_data": n, "replay": n,
  "recovery": n}, "state_field": true}``: the link count,
  the error totals over the links and each link's state (``NVLINK_GET_STATE``, one
  field a link by scope; NOT_SUPPORTED with ``"state_field": false``, as before the
  driver had it) through ``nvmlDeviceGetFieldValues``, and each link's state through
  ``nvmlDeviceGetNvLinkState``, where an asleep link is enabled); left out, the GPU has
  no NVLink (0 links).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

#: the environment variable naming the scenario file
SCENARIO_ENV = "FAKE_NVML_SCENARIO"


def _real_binding() -> ModuleType:
    """nvidia-ml-py's pynvml, loaded under another name from the rest of sys.path.

    Its constants and exception classes are reused as they are. Importing it does
    not load libnvidia-ml, so this works on machines without a driver. It runs
    under its own name because it attaches its NVMLError_* classes to
    ``sys.modules[__name__]``, which under "pynvml" would be this module.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    found = importlib.machinery.PathFinder.find_spec("pynvml", rest)
    if found is None or found.origin is None:
        raise ImportError("the fake NVML needs nvidia-ml-py installed for its errors and constants")
    spec = importlib.util.spec_from_file_location("_real_pynvml", found.origin)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_real = _real_binding()
NVML_AGGREGATE_ECC = _real.NVML_AGGREGATE_ECC
NVML_ERROR_DRIVER_NOT_LOADED = _real.NVML_ERROR_DRIVER_NOT_LOADED
NVML_ERROR_FUNCTION_NOT_FOUND = _real.NVML_ERROR_FUNCTION_NOT_FOUND
NVML_ERROR_GPU_IS_LOST = _real.NVML_ERROR_GPU_IS_LOST
NVML_ERROR_INVALID_ARGUMENT = _real.NVML_ERROR_INVALID_ARGUMENT
NVML_ERROR_LIBRARY_NOT_FOUND = _real.NVML_ERROR_LIBRARY_NOT_FOUND
NVML_ERROR_NOT_SUPPORTED = _real.NVML_ERROR_NOT_SUPPORTED
NVML_ERROR_TIMEOUT = _real.NVML_ERROR_TIMEOUT
NVML_ERROR_UNINITIALIZED = _real.NVML_ERROR_UNINITIALIZED
NVML_MEMORY_ERROR_TYPE_CORRECTED = _real.NVML_MEMORY_ERROR_TYPE_CORRECTED
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = _real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
NVML_MEMORY_LOCATION_DRAM = _real.NVML_MEMORY_LOCATION_DRAM
NVML_MEMORY_LOCATION_SRAM = _real.NVML_MEMORY_LOCATION_SRAM
NVML_TEMPERATURE_GPU = _real.NVML_TEMPERATURE_GPU
NVML_VOLATILE_ECC = _real.NVML_VOLATILE_ECC
NVMLError = _real.NVMLError
nvmlEventTypeXidCriticalError = _real.nvmlEventTypeXidCriticalError
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = _real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
NVML_FI_DEV_NVLINK_LINK_COUNT = _real.NVML_FI_DEV_NVLINK_LINK_COUNT
NVML_FI_DEV_NVLINK_GET_STATE = _real.NVML_FI_DEV_NVLINK_GET_STATE
NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL = _real.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL
NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL = _real.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL
NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL = _real.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL
NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL = _real.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL
NVML_VALUE_TYPE_UNSIGNED_INT = _real.NVML_VALUE_TYPE_UNSIGNED_INT
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = _real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = \
    _real.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = \
    _real.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
NVML_SUCCESS = _real.NVML_SUCCESS

__all__ = [
    "NVML_AGGREGATE_ECC",
    "NVML_ERROR_DRIVER_NOT_LOADED",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_GPU_IS_LOST",
    "NVML_ERROR_LIBRARY_NOT_FOUND",
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_TIMEOUT",
    "NVML_ERROR_UNINITIALIZED",
    "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION",
    "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "NVML_FI_DEV_NVLINK_GET_STATE",
    "NVML_FI_DEV_NVLINK_LINK_COUNT",
    "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
    "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "NVML_MEMORY_ERROR_TYPE_CORRECTED",
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
    "NVML_MEMORY_LOCATION_DRAM",
    "NVML_MEMORY_LOCATION_SRAM",
    "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR",
    "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS",
    "NVML_SUCCESS",
    "NVML_TEMPERATURE_GPU",
    "NVML_VALUE_TYPE_UNSIGNED_INT",
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG",
    "NVML_VOLATILE_ECC",
    "NVMLError",
    "nvmlEventTypeXidCriticalError",
]


@dataclass(frozen=True)
class _Handle:
    index: int
    generation: int


@dataclass
class _EventSet:
    registered: set[int] = field(default_factory=set)
    delivered: set[Any] = field(default_factory=set)


@dataclass(frozen=True)
class _Memory:
    total: int
    used: int
    free: int


@dataclass(frozen=True)
class _Utilization:
    gpu: int
    memory: int


@dataclass(frozen=True)
class _EventData:
    device: _Handle
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


class _State:
    """Per-process fake driver state."""

    def __init__(self) -> None:
        self.refcount = 0
        self.generation = 0
        self.lost_since: dict[int, int] = {}  # gpu index -> generation that saw the loss
        self.scenario: dict[str, Any] = {}
        self.stamp: tuple[int, int, int] | None = None


_state = _State()


def _scenario() -> dict[str, Any]:
    path = os.environ.get(SCENARIO_ENV, "")
    if not path:
        raise RuntimeError(f"fake NVML used without {SCENARIO_ENV} naming a scenario file")
    info = os.stat(path)
    stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
    if stamp != _state.stamp:
        with open(path, encoding="utf-8") as handle:
            loaded = json.load(handle)
        if not isinstance(loaded, dict):
            raise RuntimeError(f"fake NVML scenario {path} is not a JSON object")
        _state.scenario, _state.stamp = loaded, stamp
    return _state.scenario


def _record_hang(function: str) -> None:
    """Append "PID FUNCTION" to SCENARIO.hung, so a test knows this process is
    wedged before it changes the scenario for the processes that come after."""
    with open(os.environ[SCENARIO_ENV] + ".hung", "a", encoding="utf-8") as log:
        log.write(f"{os.getpid()} {function}\n")


def _gpus() -> list[dict[str, Any]]:
    gpus = _scenario().get("gpus", [])
    return list(gpus)


def _enter(function: str, handle: _Handle | None = None, needs_init: bool = True) -> None:
    """Everything a call does before answering: hang, fail, or check the handle."""
    scenario = _scenario()
    hang = scenario.get("hang")
    hangs = [hang] if isinstance(hang, str) else list(hang or [])
    if function in hangs or "*" in hangs:
        _record_hang(function)
        while True:  # a wedged GPU: the call never returns
            time.sleep(3600)
    delay = scenario.get("slow", {}).get(function)
    if delay:
        time.sleep(float(delay))
    code = scenario.get("errors", {}).get(function)
    if code is not None:
        raise NVMLError(int(code))
    if needs_init and _state.refcount == 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    if handle is None:
        return
    gpu = _gpu(handle)
    if gpu.get("lost"):
        seen = _state.lost_since.setdefault(handle.index, _state.generation)
        if handle.generation <= seen:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    else:
        _state.lost_since.pop(handle.index, None)
    code = gpu.get("errors", {}).get(function)
    if code is not None:
        raise NVMLError(int(code))


def _gpu(handle: _Handle) -> dict[str, Any]:
    gpus = _gpus()
    if not 0 <= handle.index < len(gpus):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)  # the device vanished under its handle
    return dict(gpus[handle.index])


def _value(handle: _Handle, key: str) -> Any:
    value = _gpu(handle).get(key)
    if value is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return value


def nvmlInit() -> None:
    _enter("nvmlInit", needs_init=False)
    _state.refcount += 1
    _state.generation += 1


def nvmlShutdown() -> None:
    _enter("nvmlShutdown")
    _state.refcount -= 1


def nvmlSystemGetDriverVersion() -> str:
    _enter("nvmlSystemGetDriverVersion")
    return str(_scenario().get("driver_version", "550.54.15"))


def nvmlDeviceGetCount() -> int:
    _enter("nvmlDeviceGetCount")
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    _enter("nvmlDeviceGetHandleByIndex")
    if not 0 <= index < len(_gpus()):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _Handle(index, _state.generation)


def nvmlDeviceGetIndex(handle: _Handle) -> int:
    _enter("nvmlDeviceGetIndex", handle)
    return handle.index


def nvmlDeviceGetUUID(handle: _Handle) -> str:
    _enter("nvmlDeviceGetUUID", handle)
    return str(_gpu(handle).get("uuid", f"GPU-fake0000-0000-0000-0000-{handle.index:012d}"))


def nvmlDeviceGetName(handle: _Handle) -> str:
    _enter("nvmlDeviceGetName", handle)
    return str(_gpu(handle).get("name", "NVIDIA Fake GPU"))


def nvmlDeviceGetMemoryInfo(handle: _Handle) -> _Memory:
    _enter("nvmlDeviceGetMemoryInfo", handle)
    total, used = int(_value(handle, "memory_total")), int(_value(handle, "memory_used"))
    return _Memory(total=total, used=used, free=total - used)


def nvmlDeviceGetUtilizationRates(handle: _Handle) -> _Utilization:
    _enter("nvmlDeviceGetUtilizationRates", handle)
    return _Utilization(gpu=int(_value(handle, "utilization")), memory=0)


def nvmlDeviceGetTemperature(handle: _Handle, sensor: int) -> int:
    _enter("nvmlDeviceGetTemperature", handle)
    if sensor != NVML_TEMPERATURE_GPU:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return int(_value(handle, "temperature"))


def nvmlDeviceGetPowerUsage(handle: _Handle) -> int:
    _enter("nvmlDeviceGetPowerUsage", handle)
    return int(_value(handle, "power_mw"))


def nvmlDeviceGetTotalEccErrors(handle: _Handle, error_type: int, counter_type: int) -> int:
    _enter("nvmlDeviceGetTotalEccErrors", handle)
    if counter_type not in (NVML_AGGREGATE_ECC, NVML_VOLATILE_ECC):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    ecc = _value(handle, "ecc")
    if error_type == NVML_MEMORY_ERROR_TYPE_CORRECTED:
        return int(ecc.get("corrected", 0))
    if error_type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
        return int(ecc.get("uncorrected", 0))
    raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)


def nvmlDeviceGetMemoryErrorCounter(handle: _Handle, error_type: int, counter_type: int,
                                    location: int) -> int:
    """``ecc_locations``: ``{"dram": {"corrected": n, "uncorrected": n}, "sram": {…}}``;
    NOT_SUPPORTED without it (a GPU or driver that does not split by location)."""
    _enter("nvmlDeviceGetMemoryErrorCounter", handle)
    counts = _value(handle, "ecc_locations")
    where = {NVML_MEMORY_LOCATION_DRAM: "dram", NVML_MEMORY_LOCATION_SRAM: "sram"}.get(location)
    kind = {NVML_MEMORY_ERROR_TYPE_CORRECTED: "corrected",
            NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "uncorrected"}.get(error_type)
    if where is None or kind is None or counter_type not in (NVML_AGGREGATE_ECC,
                                                              NVML_VOLATILE_ECC):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return int(counts.get(where, {}).get(kind, 0))


@dataclass(frozen=True)
class _Process:
    pid: int
    usedGpuMemory: int = 0


def nvmlDeviceGetComputeRunningProcesses(handle: _Handle) -> list[_Process]:
    _enter("nvmlDeviceGetComputeRunningProcesses", handle)
    return [_Process(int(pid)) for pid in _gpu(handle).get("processes", [])]


def nvmlDeviceGetRemappedRows(handle: _Handle) -> tuple[int, int, int, int]:
    _enter("nvmlDeviceGetRemappedRows", handle)
    rows = _value(handle, "remapped_rows")
    return (int(rows.get("correctable", 0)), int(rows.get("uncorrectable", 0)),
            int(bool(rows.get("pending"))), int(bool(rows.get("failure"))))


def nvmlDeviceGetRetiredPages(handle: _Handle, cause: int) -> list[int]:
    _enter("nvmlDeviceGetRetiredPages", handle)
    pages = _value(handle, "retired_pages")
    key = {NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: "single_bit",
           NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: "double_bit"}.get(cause)
    if key is None:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return [0x1000 * i for i in range(int(pages.get(key, 0)))]  # page addresses


def nvmlDeviceGetRetiredPagesPendingStatus(handle: _Handle) -> int:
    _enter("nvmlDeviceGetRetiredPagesPendingStatus", handle)
    return int(bool(_value(handle, "retired_pages").get("pending")))


def nvmlDeviceGetPcieReplayCounter(handle: _Handle) -> int:
    _enter("nvmlDeviceGetPcieReplayCounter", handle)
    return int(_value(handle, "pcie_replays"))


def nvmlDeviceGetCurrentClocksEventReasons(handle: _Handle) -> int:
    _enter("nvmlDeviceGetCurrentClocksEventReasons", handle)
    return int(_value(handle, "clock_event_reasons"))


@dataclass
class _FieldValue:
    """c_nvmlFieldValue_t's parts the reader uses: per-field return code, value type and
    value."""

    fieldId: int
    nvmlReturn: int = NVML_SUCCESS
    value: Any = None
    valueType: int = NVML_VALUE_TYPE_UNSIGNED_INT


@dataclass
class _Value:
    """c_nvmlValue_t, a union: the member valueType names holds the value."""

    uiVal: int = 0
    ullVal: int = 0


_NVLINK_ERROR_FIELDS = {
    NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: "crc_flit",
    NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: "crc_data",
    NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: "replay",
    NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: "recovery",
}


def _field(gpu: dict[str, Any], field_id: int, scope: int) -> _FieldValue:
    unsupported = _FieldValue(field_id, NVML_ERROR_NOT_SUPPORTED, _Value())
    nvlink = gpu.get("nvlink")
    if field_id == NVML_FI_DEV_NVLINK_GET_STATE:
        # One link (the scope) a field; drivers before it answer NOT_SUPPORTED, as a
        # scenario's "state_field": false does.
        if nvlink is None or not nvlink.get("state_field", True):
            return unsupported
        if not 0 <= scope < int(nvlink["links"]):
            return _FieldValue(field_id, NVML_ERROR_INVALID_ARGUMENT, _Value())
        state = 0 if scope in nvlink.get("inactive", ()) else \
            2 if scope in nvlink.get("asleep", ()) else 1
        return _FieldValue(field_id, NVML_SUCCESS, _Value(uiVal=state))
    if field_id == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
        action = gpu.get("recovery_action")
        return unsupported if action is None else _FieldValue(field_id, NVML_SUCCESS,
                                                              _Value(uiVal=int(action)))
    if field_id == NVML_FI_DEV_NVLINK_LINK_COUNT:
        # A board without NVLink: 0 links (the reader takes NOT_SUPPORTED the same way).
        links = int(nvlink["links"]) if nvlink is not None else 0
        return _FieldValue(field_id, NVML_SUCCESS, _Value(uiVal=links))
    if field_id in _NVLINK_ERROR_FIELDS:
        if nvlink is None:
            return unsupported
        count = int(nvlink.get("errors", {}).get(_NVLINK_ERROR_FIELDS[field_id], 0))
        return _FieldValue(field_id, NVML_SUCCESS, _Value(ullVal=count),
                           NVML_VALUE_TYPE_UNSIGNED_LONG_LONG)
    return unsupported


def nvmlDeviceGetFieldValues(handle: _Handle,
                             field_ids: list[int | tuple[int, int]]) -> list[_FieldValue]:
    """Like NVML: the call succeeds and each field says whether it is supported."""
    _enter("nvmlDeviceGetFieldValues", handle)
    gpu = _gpu(handle)
    # As pynvml: a field is its id, or (id, scope) for one link of a per-link field.
    pairs = [f if isinstance(f, tuple) else (f, 0) for f in field_ids]
    return [_field(gpu, field_id, scope) for field_id, scope in pairs]


def nvmlDeviceGetNvLinkState(handle: _Handle, link: int) -> int:
    """1 (NVML_FEATURE_ENABLED) for an active link, 0 for one down; a link the GPU does
    not have is INVALID_ARGUMENT, a GPU without NVLink NOT_SUPPORTED, as in NVML."""
    _enter("nvmlDeviceGetNvLinkState", handle)
    nvlink = _value(handle, "nvlink")
    if not 0 <= link < int(nvlink["links"]):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return 0 if link in nvlink.get("inactive", ()) else 1


def nvmlEventSetCreate() -> _EventSet:
    _enter("nvmlEventSetCreate")
    return _EventSet()


def nvmlDeviceRegisterEvents(handle: _Handle, event_types: int, event_set: _EventSet) -> None:
    _enter("nvmlDeviceRegisterEvents", handle)
    if _gpu(handle).get("xid_supported") is False:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    if event_types & nvmlEventTypeXidCriticalError:
        event_set.registered.add(handle.index)
        # Events that happened before registration are never delivered.
        event_set.delivered.update(_event_key(pos, event)
                                   for pos, event in enumerate(_scenario().get("xid", [])))


def nvmlEventSetWait_v2(event_set: _EventSet, timeoutms: int) -> _EventData:
    _enter("nvmlEventSetWait_v2")
    for pos, event in enumerate(_scenario().get("xid", [])):
        key = _event_key(pos, event)
        index = int(event.get("gpu", 0))
        if key in event_set.delivered or index not in event_set.registered:
            continue
        event_set.delivered.add(key)
        return _EventData(device=_Handle(index, _state.generation),
                          eventType=nvmlEventTypeXidCriticalError,
                          eventData=int(event["code"]))
    if timeoutms > 0:
        time.sleep(timeoutms / 1000)
    raise NVMLError(NVML_ERROR_TIMEOUT)


def nvmlEventSetFree(event_set: _EventSet) -> None:
    _enter("nvmlEventSetFree")
    event_set.registered.clear()


def _event_key(position: int, event: dict[str, Any]) -> Any:
    return event.get("id", position)
