"""torch's flight recorder: each process group's collective progress, and stall evidence.

**Progress** (:class:`ProgressReader`): for every process group, by the name
every member shares, its global ranks, the sequence number of the last
collective this rank enqueued, and its name (``gloo:all_reduce``,
``nccl:all_reduce``). Read by the publisher while the rank is stalled, never on
the training thread. A collective completes on no rank before every rank of
its group has enqueued it, so in a stalled run the ranks that wait have
enqueued a later collective than the rank they wait for, in the same group
(groups are told apart by the name torch registered for them: ``pg_status``
numbers a process's groups by creation order, which differs between ranks).
That names the culprit where the place its thread sits cannot: with NCCL,
collectives return at once on the CPU and every rank's thread waits in some
CUDA synchronisation, in "compute". torch 2.13 records gloo's collectives
without any setting (checked on the CPU); older versions, and NCCL where its
buffer is off, need ``TORCH_FR_BUFFER_SIZE``. A stall's first read costs up
to about 0.14 s with the buffer full (it names each group's last collective
from the recorded entries), every later one about 10 us (bench/RESULTS.md).

**In flight** (:class:`PendingReader`): the oldest collective this rank has
enqueued and not completed, since when, and its group's timeout, read from the
recorder's status at every publish. ProcessGroupNCCL's watchdog ends a rank whose
collective outlives the timeout from C++, with no Python error: this is what
tells that end apart from a kill (node/exits.py), and the rank that had nothing
in flight from the ranks that waited for it.

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

import hashlib
import itertools
import os
import pickle
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from colossalai_exporter.rankstate.schema import GroupProgress, PendingCollective

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


def ranks_label(ranks: Sequence[int]) -> str:
    """A group's global ranks in a few characters: ``0-7`` (contiguous), ``1,3`` (up to
    eight others), ``0-254/2`` (every second rank of many), and a long irregular list as
    its size and a digest (``64 ranks #1a2b3c4d``): the default group of a 4,096-rank run
    would otherwise be a 20 kB label value."""
    ordered = sorted(set(ranks))
    if not ordered:
        return ""
    if len(ordered) == 1:
        return str(ordered[0])
    if ordered[-1] - ordered[0] == len(ordered) - 1:
        return f"{ordered[0]}-{ordered[-1]}"
    if len(ordered) <= 8:
        return ",".join(map(str, ordered))
    step = ordered[1] - ordered[0]
    if all(b - a == step for a, b in itertools.pairwise(ordered)):
        return f"{ordered[0]}-{ordered[-1]}/{step}"
    digest = hashlib.sha1(",".join(map(str, ordered)).encode()).hexdigest()[:8]
    return f"{len(ordered)} ranks #{digest}"


class ProgressReader:
    """Every process group's progress on this rank, read from torch's flight recorder.

    Read by the publisher while the rank is stalled (never on the training thread),
    in two steps: the groups' status alone (about 10 us), and the recorded entries only
    when the status moved since the last read, to find each group's name and last
    collective: the entries cost tens of milliseconds once the ring buffer is full
    (2,000 by default; bench/RESULTS.md), and a stalled rank does not move.

    The status is keyed by a number each process gives its groups in the order it
    created them (gloo), not by the group's name: ranks 2 and 3 of a job with pairs
    ``[0, 1]`` and ``[2, 3]`` call their pair "1", as ranks 0 and 1 call theirs. The
    entries carry the name torch registered, which every member shares, and that is
    what a rank's progress is compared by (NCCL's status is keyed by that name already,
    with the group's ranks in ``pg_config``).
    """

    def __init__(self) -> None:
        self._status: Any = None
        self._groups: list[GroupProgress] | None = None

    def read(self) -> list[GroupProgress] | None:
        """None when the process has no initialised torch.distributed or its torch
        records nothing. Errors from torch propagate: the caller counts them as the
        monitor's own."""
        function = _dump_function()
        if function is None:
            return None
        # Our own process's memory, pickled by torch: plain dicts, lists and strings.
        status = pickle.loads(function(includeCollectives=False, includeStackTraces=False,
                                       onlyActive=True)).get("pg_status")
        if status == self._status and self._groups is not None:
            return self._groups  # nothing moved: the names found before still hold
        # onlyActive=False: NCCL drops completed entries from the active ones, and the
        # rank a hang waits for has completed every collective it enqueued.
        dump = pickle.loads(function(includeCollectives=True, includeStackTraces=False,
                                     onlyActive=False))
        self._status, self._groups = status, parse_progress(dump, group_members())
        return self._groups


class PendingReader:
    """The oldest collective this rank has in flight, read from the recorder's status at
    every publish (about 10 us: no entries are read), and since when.

    The status gives, per group, the sequence numbers of the last work enqueued and of
    the last completed (NCCL's watchdog notes a completion within about 100 ms of the
    GPU finishing it; gloo counts a collective that failed as completed). While they
    differ, the work enqueued last is in flight: NCCL numbers point-to-point work
    apart from collectives, so a pipeline's numbers interleave, and only a difference
    says something. The recorder keeps no start time in its status, so "since" is when
    this reader first saw the group with work in flight after that last completion:
    for work completed in order, when the oldest of it was enqueued, up to one publish
    interval late; a completion starts it again. Each group's timeout comes from its
    backend's options (``new_group`` without a timeout gets torch's default, not the one
    ``init_process_group`` was given), read again only when the process's groups change.
    """

    def __init__(self) -> None:
        #: whether the last read found the recorder's status: then None meant nothing in
        #: flight, not "not known"
        self.readable = False
        #: whether the last read's status records completions in order: NCCL's, whose one
        #: watchdog thread notes each work's completion (its status is keyed by the
        #: group's name). Where torch records for a backend from outside it (gloo's
        #: status, keyed by creation order), each work's completion is noted by whichever
        #: thread finished it: with gloo's several worker threads, an earlier work's note
        #: can land after a later one's, and the group reads "in flight" for ever after
        #: its last collective returned (seen in this project's tests, about 1 run in 40
        #: on a loaded machine). The monitor then believes it only of a rank that waits.
        self.ordered = False
        self._first_seen: dict[tuple[str, int], float] = {}
        self._timeouts: dict[str, float] = {}
        self._groups_known = -1

    def read(self, now: float) -> PendingCollective | None:
        """None when nothing is in flight, or the process records nothing. Errors from
        torch propagate: the caller counts them as the monitor's own."""
        self.readable = self.ordered = False
        function = _dump_function()
        if function is None:
            return None
        dump = pickle.loads(function(includeCollectives=False, includeStackTraces=False,
                                     onlyActive=True))
        status = dump.get("pg_status")
        if not isinstance(status, Mapping):
            return None
        self.readable = True
        first_seen: dict[tuple[str, int], float] = {}
        enqueued: dict[str, int] = {}
        for key, group in status.items():
            if not isinstance(group, Mapping):
                continue
            last = int(group.get("last_enqueued_collective", -1))
            done = int(group.get("last_completed_collective", -1))
            if last != done:
                since_done = (str(key), done)
                first_seen[since_done] = self._first_seen.get(since_done, now)
                enqueued[str(key)] = last
        self._first_seen = first_seen
        if not first_seen:
            return None
        (pg, _), since = min(first_seen.items(), key=lambda item: item[1])
        by_name = isinstance(dump.get("pg_config"), Mapping) and pg in dump["pg_config"]
        self.ordered = by_name
        return PendingCollective(pg=pg, seq=enqueued[pg], since=since,
                                 timeout=self._timeout(pg, by_name))

    def _timeout(self, key: str, by_name: bool) -> float | None:
        """The group's timeout in seconds: NCCL's status keys a group by its registered
        name (its pg_config lists it), gloo's by this process's creation order."""
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        world = getattr(c10d, "_world", None)
        names = getattr(world, "pg_names", None)
        if not isinstance(names, Mapping):
            return None
        if len(names) != self._groups_known:
            self._groups_known, self._timeouts = len(names), {}
            for order, (group, name) in enumerate(names.items()):
                seconds = _group_timeout(group)
                if seconds is not None:
                    self._timeouts[f"name:{name}"] = self._timeouts[f"order:{order}"] = seconds
        return self._timeouts.get(f"name:{key}" if by_name else f"order:{key}")


def _group_timeout(group: Any) -> float | None:
    try:
        backend = group._get_backend(group._device_types[0])
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, IndexError, RuntimeError, TypeError):
        return None  # a torch without backend options: the timeout is not known


def _dump_function() -> Any:
    """torch's flight recorder dump, where this process has an initialised
    torch.distributed and its torch records; else None."""
    distributed = sys.modules.get("torch.distributed")
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if distributed is None or c10d is None or not distributed.is_initialized():
        return None
    for name in DUMP_FUNCTIONS:
        function = getattr(c10d, name, None)
        if function is not None:
            return function
    return None


def group_members() -> dict[str, list[int]]:
    """Each process group's global ranks by its registered name, as this process's
    torch.distributed knows them (plain Python dicts: no collective, no device)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(c10d, "_world", None)
    try:
        names = dict(world.pg_names)  # type: ignore[union-attr]
        ranks = dict(world.pg_group_ranks)  # type: ignore[union-attr]
    except (AttributeError, TypeError):
        return {}
    return {str(name): sorted(ranks.get(group, {})) for group, name in names.items()}


def parse_progress(dump: Mapping[str, Any], members: Mapping[str, Sequence[int]] | None = None,
                   ) -> list[GroupProgress] | None:
    """The groups of a flight recorder dump, by their registered names.

    From its ``entries`` (each names its group and sequence number) and, for groups
    that ``pg_config`` names (NCCL's, whose status is keyed by name), its
    ``pg_status``. ``members``: each group's global ranks, where the dump's own
    ``pg_config`` does not list them (gloo's is empty).
    """
    status = dump.get("pg_status")
    if not isinstance(status, Mapping) or not status:
        return None
    members = dict(members or {})
    config = dump.get("pg_config")
    enqueued: dict[str, int] = {}
    ops: dict[str, str] = {}
    if isinstance(config, Mapping):
        for name, group in config.items():
            if not name or not isinstance(group, Mapping):
                continue
            ranks = _config_ranks(group.get("ranks"))
            if ranks and name not in members:
                members[str(name)] = ranks
            state = status.get(name)
            if isinstance(state, Mapping):
                enqueued[str(name)] = int(state.get("last_enqueued_collective", -1))
    for entry in dump.get("entries") or ():
        group = entry.get("process_group") or ("",)
        seq = entry.get("collective_seq_id")
        name = str(group[0])
        if isinstance(seq, int) and name and seq >= enqueued.get(name, -1):
            enqueued[name] = seq
            ops[name] = str(entry.get("profiling_name", ""))
    return [GroupProgress(pg=name, ranks=ranks_label(members.get(name, ())), enqueued=seq,
                          op=ops.get(name, ""))
            for name, seq in sorted(enqueued.items()) if seq >= 0]


def _config_ranks(text: object) -> list[int]:
    # pg_config writes a group's ranks as the text of a list: "[0, 1]"
    if not isinstance(text, str):
        return []
    try:
        return [int(r) for r in text.strip("[] ").split(",") if r.strip()]
    except ValueError:
        return []
