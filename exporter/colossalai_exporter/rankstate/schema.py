"""The rank snapshot: what a training rank publishes and the node agent reads.

This package is the contract between the two sides. ``training/`` writes it (the
monitor's publisher), ``node/`` reads it (the ``ranks`` collector), and both serve
it through :mod:`.families`; the rules generator and the dashboards take the phase
names from here. It imports neither side, nor torch.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

import msgspec

# The snapshot's format version. A reader takes every version up to its own (fields
# added since have defaults) and refuses a newer one: a training image newer than
# the node agent costs that rank its outside view (counted, reason "version"), not
# a misreading.
# 3: phase "compiling", activities "compile" and "subprocess"; 4: phase "data_start"
SNAPSHOT_VERSION: Final = 4
Phase = Literal["init", "kernels", "training", "checkpointing", "evaluating", "compiling",
                "data_start", "finished", "failed"]
#: every phase, in the order a run goes through them (rules and dashboards take them from here)
PHASES: Final[tuple[Phase, ...]] = get_args(Phase)
#: why a snapshot file could not be used (colossalai_rank_snapshot_errors_total{reason})
ERROR_REASONS: Final = ("malformed", "invalid", "version", "unreadable")


ACTIVE_PHASES: Final = frozenset({"init", "kernels", "training", "checkpointing", "evaluating",
                                   "compiling", "data_start"})
# The tutorial's /health contract: 200 in these phases (when not stalled and kernels are
# ready). "evaluating" is ours: the tutorial had no evaluation phase, and a periodic
# evaluation is part of a healthy run, not an outage for an uptime monitor to page on.
# "compiling" likewise: torch.compile recompiling a graph within a step (new shapes), and
# "data_start": a data loader's iterator started again at an epoch's boundary.
HEALTHY_PHASES: Final = frozenset({"training", "checkpointing", "evaluating", "compiling",
                                   "data_start"})
HEARTBEAT_RESULTS: Final = ("success", "failure", "dropped")

Device = Literal["cuda", "cpu", "nvme"]
DEVICES: tuple[Device, ...] = ("cuda", "cpu", "nvme")

ACTIVITIES: Final = ("compute", "backward", "collective", "data", "checkpoint", "network",
                     "subprocess", "compile")
#: activities of a rank that waits for others, when the run is stalled
WAITING: Final = ("collective", "backward")


class Activity(msgspec.Struct, kw_only=True, frozen=True):
    """One sample: ``kind`` (one of :data:`ACTIVITIES`), the innermost frame as
    ``file.py:123 in function``, and for a collective the c10d function's name."""

    kind: str
    frame: str = ""
    collective: str = ""


class GroupProgress(msgspec.Struct, frozen=True, kw_only=True):
    """One process group's collectives on this rank, from the flight recorder."""

    #: the group's name as torch registers it (``new_group``'s counter, the same on every
    #: member of the group; "0" is the default group): what keys a comparison between ranks
    pg: str
    #: the group's global ranks, short (training/flight_recorder.py, ranks_label): what a
    #: page shows
    ranks: str = ""
    #: sequence number of the last collective this rank enqueued in the group
    enqueued: int
    #: its name (``gloo:all_reduce``), when the recorder still holds it
    op: str = ""


class PendingCollective(msgspec.Struct, frozen=True, kw_only=True):
    """Work this rank enqueued in a process group that has not completed, from the flight
    recorder's status (training/flight_recorder.py, PendingReader): what the group's
    timeout runs against. NCCL's watchdog ends a rank from C++, with no Python error,
    once work passes its group's timeout."""

    #: the group as the recorder's status keys it (NCCL: its registered name; gloo: this
    #: process's creation order, "0" the default group either way)
    pg: str
    #: the sequence number of the work it enqueued last in the group
    seq: int
    #: since when it has had work in flight there, completing none (wall clock, as the
    #: monitor first saw it: up to one publish interval late)
    since: float
    #: the group's timeout, seconds (its backend's options); None where torch did not say
    timeout: float | None = None


class CheckpointState(msgspec.Struct, kw_only=True):
    in_flight: bool = False
    last_success: float | None = None
    last_step: int | None = None
    duration: float | None = None
    failures: int = 0
    #: when a save last raised (absent before the first failure)
    last_failure: float | None = None


class GeminiState(msgspec.Struct, kw_only=True):
    chunk_memory: dict[str, float]
    h2d: float = 0.0
    d2h: float = 0.0


class HeartbeatState(msgspec.Struct, kw_only=True):
    last_success: float | None = None
    last_attempt: float | None = None
    success: int = 0
    failure: int = 0
    dropped: int = 0


class LastError(msgspec.Struct, kw_only=True):
    """The last exception the rank saw (training/errors.py)."""

    time: float
    where: str
    type: str
    device: str = ""
    message: str = ""
    #: the error says another rank or the process group failed (a peer's connection
    #: closed, a communicator aborted, a collective timed out), not this rank
    peer: bool = False


class Interruption(msgspec.Struct, kw_only=True):
    """A termination signal the rank received (training/signals.py): SIGTERM from a
    scheduler preempting or cancelling the job, or from torchrun stopping the ranks
    that survive a failed one; SIGINT from Ctrl-C."""

    signal: str
    time: float
    #: steps completed when it came: a rank that trains on afterwards was not ended by it
    steps: int = 0


class Snapshot(msgspec.Struct, kw_only=True):
    """One rank's state as the monitor publishes it and the node agent reads it.

    The same object serves rank 0's ``/metrics`` and ``/health`` in process and,
    written to ``<run dir>/rank-<R>.json``, the agent's view of the rank.
    ``stalled`` and ``reason`` are the writer's verdict; a reader judges again
    (``rankstate.verdict.judge``), since a frozen rank cannot.
    """

    version: int = SNAPSHOT_VERSION
    rank: int
    local_rank: int
    world_size: int
    pid: int
    pid_start: float | None = None
    pid_ns: int | None = None
    created: float
    written: float
    phase: Phase
    phase_start: float
    error: str = ""
    #: phase finished came from the interpreter's normal exit (the script ended without
    #: monitor.finish()), not from finish()
    finished_at_exit: bool = False
    kernels_ready: bool = False
    kernel_failures: int = 0
    #: when a kernel load or build last raised (absent before the first failure)
    kernel_last_failure: float | None = None
    last_error: LastError | None = None
    steps: int = 0
    last_step: float | None = None
    samples: int = 0
    tokens: int = 0
    loss: float | None = None
    step_buckets: list[float]
    step_hist: list[int]
    step_sum: float = 0.0
    timeout: float
    progress: float
    stalls: int = 0
    oom: dict[str, int] = msgspec.field(default_factory=dict)
    #: when the rank last ran out of memory, by device: only the devices that did.
    #: The failures' times are what the alerts read, since a set that exists only where
    #: something failed is cheap to select at fleet size (the counters exist on every
    #: rank and device; docs/rules.md, "Cost at scale").
    oom_last: dict[str, float] = msgspec.field(default_factory=dict)
    checkpoint: CheckpointState = msgspec.field(default_factory=CheckpointState)
    gemini: GeminiState | None = None
    heartbeats: dict[str, HeartbeatState] = msgspec.field(default_factory=dict)
    monitor_errors: dict[str, int] = msgspec.field(default_factory=dict)
    info: dict[str, str] = msgspec.field(default_factory=dict)
    stalled: bool = False
    reason: str = ""
    #: the termination signal that is ending the rank, once received
    interruption: Interruption | None = None
    #: where the training thread was when this was written (training/activity.py)
    activity: Activity | None = None
    #: while stalled: each process group's last enqueued collective (flight recorder)
    collectives: list[GroupProgress] | None = None
    #: the oldest of its collectives in flight, while one is (flight recorder's status)
    pending: PendingCollective | None = None
    #: whether the monitor could read the recorder's status: then ``pending`` None means
    #: nothing is in flight (a torch that records nothing says nothing either way)
    in_flight_known: bool = False
    #: how often the publisher writes: a reader knows when the next one is overdue
    publish_interval: float | None = None
    #: the process group's store, ``MASTER_ADDR:MASTER_PORT`` as the launcher set them
    #: for the rank (empty where it set neither): the endpoint the node agent checks
    rendezvous: str = ""
    #: the publisher's samples of the training thread while training, and how many
    #: found it waiting in a collective or backward
    activity_samples: int = 0
    waiting_samples: int = 0
    #: goodput: seconds of completed steps, each up to its stall budget (a step that
    #: overran is a stall past the budget), and the part of them the last successful
    #: checkpoint holds (what a restart now would keep)
    productive: float = 0.0
    checkpointed: float = 0.0

    def __post_init__(self) -> None:
        if len(self.step_hist) != len(self.step_buckets) + 1:
            raise ValueError(f"step_hist has {len(self.step_hist)} buckets for "
                             f"{len(self.step_buckets)} bounds (expected one more, +Inf)")


class SnapshotError(ValueError):
    """A snapshot file that cannot be used; ``reason`` is one of :data:`ERROR_REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Versioned(msgspec.Struct):
    version: int = 1  # files from before the field existed are version 1


_ENCODER = msgspec.json.Encoder()
_VERSION_DECODER = msgspec.json.Decoder(_Versioned)
_DECODER = msgspec.json.Decoder(Snapshot)


def encode(snap: Snapshot) -> bytes:
    """JSON bytes of a snapshot. A NaN or infinite loss is written as null (JSON has
    neither); the rank's own server still serves it as NaN."""
    return _ENCODER.encode(snap)


def decode(data: bytes, source: str = "snapshot") -> Snapshot:
    """A snapshot from JSON bytes, validated; :class:`SnapshotError` says why not."""
    try:
        version = _VERSION_DECODER.decode(data).version
    except msgspec.ValidationError as exc:
        raise SnapshotError("invalid", f"{source}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise SnapshotError("malformed", f"{source}: {exc}") from None
    if version > SNAPSHOT_VERSION:
        raise SnapshotError("version", f"{source}: format version {version} is newer than "
                                       f"this agent reads ({SNAPSHOT_VERSION}); upgrade the "
                                       "node agent")
    try:
        return _DECODER.decode(data)
    except msgspec.ValidationError as exc:  # __post_init__'s ValueError arrives as one
        raise SnapshotError("invalid", f"{source}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise SnapshotError("malformed", f"{source}: {exc}") from None
