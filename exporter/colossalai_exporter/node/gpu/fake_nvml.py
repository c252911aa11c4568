"""A fake ``pynvml`` for machines without a GPU. Test-only.

Selected by ``COLOSSALAI_EXPORTER_FAKE_NVML=/path/to/scenario.json`` (read by
:class:`~colossalai_exporter.node.gpu.collector.GpuCollector`, which hands it
to its worker process). It offers the subset of pynvml's API that
:mod:`.reader` calls, under the same names, and raises pynvml's own
``NVMLError`` subclasses with the real ``NVML_ERROR_*`` values, so code under
test cannot tell it from the real binding by the errors it sees.

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
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

# The real binding's constants and exception classes: importing pynvml does not
# load libnvidia-ml, so this works on machines without a driver.
from pynvml import (
    NVML_AGGREGATE_ECC,
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNINITIALIZED,
    NVML_MEMORY_ERROR_TYPE_CORRECTED,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    NVML_TEMPERATURE_GPU,
    NVML_VOLATILE_ECC,
    NVMLError,
    nvmlEventTypeXidCriticalError,
)

from colossalai_exporter.node.gpu.protocol import FAKE_NVML_ENV

__all__ = [
    "NVML_AGGREGATE_ECC",
    "NVML_ERROR_DRIVER_NOT_LOADED",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_GPU_IS_LOST",
    "NVML_ERROR_LIBRARY_NOT_FOUND",
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_TIMEOUT",
    "NVML_ERROR_UNINITIALIZED",
    "NVML_MEMORY_ERROR_TYPE_CORRECTED",
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
    "NVML_TEMPERATURE_GPU",
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
    path = os.environ.get(FAKE_NVML_ENV, "")
    if not path:
        raise RuntimeError(f"fake NVML used without {FAKE_NVML_ENV} naming a scenario file")
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
    with open(os.environ[FAKE_NVML_ENV] + ".hung", "a", encoding="utf-8") as log:
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
