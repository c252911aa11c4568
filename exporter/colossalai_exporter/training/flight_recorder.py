"""Stall evidence from torch's NCCL flight recorder, when the run has it enabled.

The flight recorder keeps the last collectives of every process group in a
ring buffer (``TORCH_FR_BUFFER_SIZE``; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` before
torch 2.6). torch dumps it itself only when a collective times out (10 min by
default) or the NCCL heartbeat monitor kills the process (480 s); a stall the
monitor detects earlier dumps it at that moment, beside the Python stacks, so
the evidence exists before anything is killed.

The dump is the pickle that torch's own dumps contain (``_dump_fr_trace``;
``_dump_nccl_trace`` in torch < 2.6), the input of torch's flight recorder
analyzer (``python -m torch.distributed.flight_recorder.fr_trace``). This module
never imports torch: it only looks in ``sys.modules``, because a process that
never imported torch has no flight recorder to dump.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

BUFFER_SIZE_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
# Newest name first: torch 2.6 renamed the NCCL-specific dump to a generic one.
DUMP_FUNCTIONS = ("_dump_fr_trace", "_dump_nccl_trace")


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the run asked torch to record collectives (a positive buffer size)."""
    for name in BUFFER_SIZE_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            try:
                return int(value) > 0
            except ValueError:
                return False  # torch would refuse it too; nothing was recorded
    return False


def dump(run_dir: Path, rank: int, now: float | None = None,
         environ: Mapping[str, str] = os.environ) -> Path | None:
    """Write ``flight-recorder-rank<R>-<unix time>.pickle``; None when there is nothing to dump.

    Errors from torch propagate: the caller counts them as the monitor's own.
    """
    if not enabled(environ):
        return None
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if c10d is None:
        return None
    for name in DUMP_FUNCTIONS:
        function = getattr(c10d, name, None)
        if function is not None:
            data = function()
            break
    else:
        return None  # a torch built without distributed support or without the recorder
    now = time.time() if now is None else now
    path = run_dir / f"flight-recorder-rank{rank}-{int(now)}.pickle"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path
