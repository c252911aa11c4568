"""torch's flight recorder: each process group's collective progress, and stall evidence.

**Progress** (:func:`progress`): for every process group, the sequence number of
the last collective this rank enqueued, and its name (``gloo:all_reduce``,
``nccl:all_reduce``). Read by the publisher while the rank is stalled, never on
the training thread. A collective completes on no rank before every rank of
its group has enqueued it, so in a stalled run the ranks that wait have
enqueued a later collective than the rank they wait for, in the same group.
That names the culprit where the place its thread sits cannot: with NCCL,
collectives return at once on the CPU and every rank's thread waits in some
CUDA synchronisation, in "compute". torch 2.13 records gloo's collectives
without any setting (checked on the CPU); older versions, and NCCL where its
buffer is off, need ``TORCH_FR_BUFFER_SIZE``. A stall's first read costs up
to about 0.14 s with the buffer full (it names each group's last collective
from the recorded entries), every later one about 10 us (bench/RESULTS.md).

**Evidence** (:func:`dump`), when the run enabled the recorder explicitly:

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
import pickle
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

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


class GroupProgress(msgspec.Struct, frozen=True, kw_only=True):
    """One process group's collectives on this rank, from the flight recorder."""

    #: the group's name, the same on every rank ("0" is the default group)
    pg: str
    #: sequence number of the last collective this rank enqueued in the group
    enqueued: int
    #: its name (``gloo:all_reduce``), when the recorder still holds it
    op: str = ""


def progress(known: list[GroupProgress] | None = None) -> list[GroupProgress] | None:
    """Every process group's progress on this rank; None when the process has no
    initialised torch.distributed or its torch records nothing.

    Two reads: the groups' status alone (about 10 us), and the recorded entries only
    when a group has moved since ``known`` (the last answer), to name its last
    collective: the entries cost tens of milliseconds once the ring buffer is full
    (2,000 by default; bench/RESULTS.md), and a stalled rank does not move.
    Errors from torch propagate: the caller counts them as the monitor's own.
    """
    distributed = sys.modules.get("torch.distributed")
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if distributed is None or c10d is None or not distributed.is_initialized():
        return None
    for name in DUMP_FUNCTIONS:
        function = getattr(c10d, name, None)
        if function is not None:
            break
    else:
        return None
    # Our own process's memory, pickled by torch: plain dicts, lists and strings.
    status = pickle.loads(function(includeCollectives=False, includeStackTraces=False,
                                   onlyActive=True))
    groups = parse_progress(status)
    if groups is None or not groups:
        return groups
    if known is not None and [(g.pg, g.enqueued) for g in known] == [
            (g.pg, g.enqueued) for g in groups]:
        return known  # nothing moved: the names found before still hold
    return parse_progress(pickle.loads(function(includeCollectives=True,
                                                includeStackTraces=False, onlyActive=True)))


def parse_progress(dump: Mapping[str, Any]) -> list[GroupProgress] | None:
    """The groups of a flight recorder dump (its ``pg_status`` and ``entries``)."""
    status = dump.get("pg_status")
    if not isinstance(status, Mapping) or not status:
        return None
    names: dict[tuple[str, int], str] = {}
    for entry in dump.get("entries") or ():
        group = entry.get("process_group") or ("",)
        seq = entry.get("collective_seq_id")
        if isinstance(seq, int):
            names[str(group[0]), seq] = str(entry.get("profiling_name", ""))
    groups = []
    for pg, state in sorted(status.items()):
        enqueued = int(state.get("last_enqueued_collective", -1))
        if enqueued < 0:
            continue  # a group that never ran a collective says nothing
        groups.append(GroupProgress(pg=str(pg), enqueued=enqueued,
                                    op=names.get((str(pg), enqueued), "")))
    return groups
