"""Rank snapshots on disk: one small JSON file per rank in the run directory.

Written atomically (a temporary file in the same directory, then ``os.replace``)
so a reader never sees half a file; read by the node agent, which never
imports torch. The default directory is under ``/dev/shm`` (memory-backed: a
write costs no disk I/O and survives nothing but the node's uptime, which is
what live state needs); ``COLOSSALAI_EXPORTER_RUN_DIR`` or the monitor's
``run_dir`` argument changes it.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Final, Literal

import msgspec

from colossalai_exporter.training.activity import Activity
from colossalai_exporter.training.flight_recorder import GroupProgress

# The snapshot's format version. A reader takes every version up to its own (fields
# added since have defaults) and refuses a newer one: a training image newer than
# the node agent costs that rank its outside view (counted, reason "version"), not
# a misreading.
SNAPSHOT_VERSION: Final = 2
Phase = Literal["init", "kernels", "training", "checkpointing", "evaluating", "finished",
                "failed"]
#: why a snapshot file could not be used (colossalai_rank_snapshot_errors_total{reason})
ERROR_REASONS: Final = ("malformed", "invalid", "version", "unreadable")


class CheckpointState(msgspec.Struct, kw_only=True):
    in_flight: bool = False
    last_success: float | None = None
    last_step: int | None = None
    duration: float | None = None
    failures: int = 0


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
    (``state.judge``), since a frozen rank cannot.
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
    kernels_ready: bool = False
    kernel_failures: int = 0
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
    #: how often the publisher writes: a reader knows when the next one is overdue
    publish_interval: float | None = None
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


DEFAULT_RUN_DIR = "/dev/shm/colossalai-exporter"
_MAX_SNAPSHOT_BYTES = 1 << 20
RUN_DIR_ENV = "COLOSSALAI_EXPORTER_RUN_DIR"
SNAPSHOT_RE = re.compile(r"^rank-(\d+)\.json$")


def default_run_dir() -> Path:
    return Path(os.environ.get(RUN_DIR_ENV) or DEFAULT_RUN_DIR)


def pid_namespace() -> int | None:
    """This process's PID namespace (the inode of /proc/self/ns/pid), None where unknown.

    A rank writes it into its snapshot so that the node agent can tell whether
    the pid beside it means anything where the agent runs: a training pod
    without ``hostPID`` has pids of its own, which the agent must not judge.
    """
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def snapshot_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank-{rank}.json"


def prepare_run_dir(run_dir: Path) -> None:
    """Create the run directory and check it is writable (OSError otherwise)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    probe = run_dir / f".write-test-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()


def write_snapshot(run_dir: Path, snap: Snapshot) -> Path:
    """Atomically replace the rank's snapshot file; returns its path."""
    path = snapshot_path(run_dir, snap.rank)
    # One temporary file per thread: a signal handler may publish in the main thread
    # while that thread is in the middle of writing (training/signals.py).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(encode(snap))
    os.replace(tmp, path)
    return path


def iter_snapshot_files(run_dir: Path) -> Iterator[tuple[int, Path]]:
    """(rank, path) for every snapshot file in ``run_dir``, by rank."""
    try:
        names = sorted(os.listdir(run_dir))
    except FileNotFoundError:
        return
    found = []
    for name in names:
        match = SNAPSHOT_RE.match(name)
        if match:
            found.append((int(match.group(1)), run_dir / name))
    yield from sorted(found)


def read_snapshot(path: Path) -> Snapshot:
    """Read and validate one snapshot file; OSError when unreadable, SnapshotError when
    it is not a snapshot this version can use."""
    with open(path, "rb") as f:
        # Sized by the file (a few KiB), capped at 1 MiB for a bogus file: a read of a
        # fixed 1 MiB allocates that much each time, a third of the agent's read.
        data = f.read(min(os.fstat(f.fileno()).st_size, _MAX_SNAPSHOT_BYTES) + 1)
    return decode(data, str(path))


def read_all_snapshots(run_dir: Path) -> list[Snapshot]:
    """Every usable snapshot in ``run_dir``, by rank; one being replaced is skipped."""
    snaps = []
    for _, path in iter_snapshot_files(run_dir):
        try:
            snaps.append(read_snapshot(path))
        except (OSError, SnapshotError):
            continue  # replaced or removed while reading: the next look gets it
    return snaps
