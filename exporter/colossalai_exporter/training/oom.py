"""Out-of-memory classification: which memory ran out, judged by type first, then text.

ColossalAI's Gemini moves tensors between GPU memory, host RAM and NVMe, and each
runs out differently (FACTS.md):

* ``torch.OutOfMemoryError`` ("CUDA out of memory. Tried to allocate …"), a
  RuntimeError subclass; Gemini's auto placement raises a plain
  ``RuntimeError("Adjust layout failed! No enough CUDA memory! Need …")``.
* host RAM: ``RuntimeError: [enforce fail at alloc_cpu.cpp:…] …
  DefaultCPUAllocator: can't allocate memory: you tried to allocate …``;
  also Python's own ``MemoryError``.
* NVMe offload: ``ModuleNotFoundError("Please install tensornvme to use
  NVMeOptimizer")``, and OSErrors (no space, missing mount) raised while
  writing the offload files.

The tutorial matched "out of memory" in any text, which misses Gemini's and the
CPU allocator's messages and cannot tell devices apart.
"""

from __future__ import annotations

import errno
import sys

from colossalai_exporter.rankstate.schema import Device

_CUDA_TEXTS = ("cuda out of memory", "adjust layout failed! no enough cuda memory",
               "cuda error: out of memory", "cublas_status_alloc_failed")
_CPU_TEXTS = ("defaultcpuallocator: can't allocate memory", "cpu out of memory")
_NVME_TEXTS = ("tensornvme", "nvmeoptimizer", "nvme_offload", "nvme offload")
# OSErrors that mean the offload (or any) file could not be written for lack of room.
_NVME_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def _torch_oom_type() -> type[BaseException] | None:
    # Only look at torch if the training script already imported it: the
    # classifier must work (and stay cheap) in processes without torch.
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom is None and torch is not None:
        oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return oom if isinstance(oom, type) else None


def _mentions_nvme(exc: BaseException) -> bool:
    filename = getattr(exc, "filename", None)
    text = f"{exc} {filename or ''}".lower()
    return any(t in text for t in _NVME_TEXTS)


def classify_oom(exc: BaseException, nvme_paths: tuple[str, ...] = ()) -> Device | None:
    """The device that ran out of memory, or None when ``exc`` is not an out-of-memory.

    ``nvme_paths`` are the offload directories (``NVME_PATH``): an ENOSPC/EDQUOT
    OSError on a file under one of them counts as an NVMe out-of-memory.

    >>> classify_oom(RuntimeError("Adjust layout failed! No enough CUDA memory! Need 4"))
    'cuda'
    >>> classify_oom(ValueError("bad shape")) is None
    True
    """
    torch_oom = _torch_oom_type()
    if torch_oom is not None and isinstance(exc, torch_oom):
        return "cuda"
    if isinstance(exc, MemoryError):
        return "cpu"
    if isinstance(exc, ImportError):
        return "nvme" if _mentions_nvme(exc) else None
    if isinstance(exc, OSError):
        if exc.errno not in _NVME_ERRNOS:
            return None
        filename = str(getattr(exc, "filename", "") or "")
        under_offload = any(p and filename.startswith(p) for p in nvme_paths)
        return "nvme" if under_offload or _mentions_nvme(exc) else None
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        if any(t in text for t in _CUDA_TEXTS):
            return "cuda"
        if any(t in text for t in _CPU_TEXTS):
            return "cpu"
        if any(t in text for t in _NVME_TEXTS) and (
                "memory" in text or "space" in text or "allocat" in text):
            return "nvme"
    return None
