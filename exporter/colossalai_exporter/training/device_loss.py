"""Reading a step's loss off the hot path, without ever making a thread wait for the GPU.

The training loop hands the monitor ``loss.detach()``: a one-element tensor
whose value a CUDA kernel will write some time later. ``.item()`` would block
until it has (a device synchronisation, which stalls the training thread if it
runs there and costs a sync per publish if the publisher does it). Instead the
publisher thread:

1. makes a side stream wait for the device's default stream (an event recorded
   there now, so after the kernel that computes the loss, which the training
   thread launched before it handed the tensor over);
2. copies the value into a pinned host buffer on that side stream
   (``non_blocking``: the copy is queued, nothing waits) and records an event;
3. at a later publish, when ``event.query()`` says the copy is done, reads the
   host buffer, a plain CPU read.

One copy is in flight at a time; a loss handed over meanwhile replaces the one
waiting to be copied, so a slow device costs freshness, never a wait. The
tensor is referenced until its copy completes, so the caching allocator cannot
hand its memory to another kernel before the copy has read it.

Numbers and CPU tensors are read at once. ``synchronous=True``
(``TrainingMonitor(loss_from_device=True)``) keeps the old behaviour: ``.item()``
in the publisher thread, one synchronisation per publish. Accelerators other
than CUDA are read only then (their stream APIs differ).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any


def loss_value(loss: Any, from_device: bool = False) -> float:
    """A loss as a float. ValueError/TypeError when not numeric.

    Python and NumPy numbers convert directly. A torch tensor on the CPU is
    read directly (no synchronisation). A tensor on an accelerator is only
    read when ``from_device`` is true (``.item()`` waits for the device);
    otherwise LookupError.
    """
    if isinstance(loss, bool):
        raise TypeError("loss is a bool")
    if isinstance(loss, (int, float)):
        return float(loss)
    device = getattr(loss, "device", None)
    if device is not None and hasattr(loss, "detach"):
        if getattr(device, "type", "cpu") != "cpu" and not from_device:
            raise LookupError("loss tensor is on an accelerator")
        tensor = loss.detach()
        if tensor.numel() != 1:
            raise ValueError(f"loss tensor has {tensor.numel()} elements, expected 1")
        return float(tensor.item())
    if hasattr(loss, "__float__") and not isinstance(loss, (str, bytes)):
        return float(loss)
    raise TypeError(f"loss must be a number or a one-element tensor, got "
                    f"{type(loss).__name__}")


@dataclass
class _Copy:
    """One device-to-host copy in flight."""

    event: Any
    host: Any
    source: Any  # keeps the device tensor alive until the copy has read it


class DeviceLossReader:
    """Turns loss values and tensors into floats from one thread (the publisher's)."""

    def __init__(self, synchronous: bool = False, torch: Any = None) -> None:
        """``torch``: the module to use (tests pass a small fake); by default the
        one the training script imported."""
        self._synchronous = synchronous
        self._torch = torch
        self._ready: float | None = None
        self._copy: _Copy | None = None
        self._waiting: Any = None  # a device loss handed over while a copy was in flight
        self._streams: dict[Any, Any] = {}
        self._hosts: dict[Any, Any] = {}

    def submit(self, loss: Any) -> None:
        """Start reading ``loss``; ValueError/TypeError when it is not a loss."""
        device = getattr(loss, "device", None)
        kind = getattr(device, "type", "cpu") if hasattr(loss, "detach") else "cpu"
        if kind == "cpu" or self._synchronous:
            self._ready = loss_value(loss, from_device=True)
        elif kind == "cuda":
            if loss.numel() != 1:
                raise ValueError(f"loss tensor has {loss.numel()} elements, expected 1")
            self._waiting = loss.detach()
            self._start_copy()
        else:
            raise TypeError(f"a loss tensor on {kind} is read only with "
                            "TrainingMonitor(loss_from_device=True), which synchronises "
                            "once per publish; or pass a float")

    def poll(self) -> float | None:
        """The newest value read since the last poll, or None."""
        copy = self._copy
        if copy is not None and copy.event.query():
            self._copy = None
            self._ready = float(copy.host.item())  # pinned host memory: a CPU read
            self._start_copy()
        value, self._ready = self._ready, None
        return value

    def _start_copy(self) -> None:
        if self._copy is not None or self._waiting is None:
            return
        tensor, self._waiting = self._waiting, None
        torch = self._torch or sys.modules["torch"]  # the tensor exists: torch is imported
        device = tensor.device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        key = (device, tensor.dtype)
        host = self._hosts.get(key)
        if host is None:  # pinned once per device and dtype: cudaHostAlloc is not cheap
            host = self._hosts[key] = torch.empty((), dtype=tensor.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.default_stream(device))
        with torch.cuda.stream(stream):
            host.copy_(tensor.reshape(()), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._copy = _Copy(event, host, tensor)
