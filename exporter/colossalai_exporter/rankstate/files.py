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

from colossalai_exporter.rankstate.schema import Snapshot, SnapshotError, decode, encode

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
