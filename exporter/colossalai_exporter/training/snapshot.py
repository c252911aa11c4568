"""Rank snapshots on disk: one small JSON file per rank in the run directory.

Written atomically (a temporary file in the same directory, then ``os.replace``)
so a reader never sees half a file; read by the node agent, which never
imports torch. The default directory is under ``/dev/shm`` (memory-backed: a
write costs no disk I/O and survives nothing but the node's uptime, which is
what live state needs); ``COLOSSALAI_EXPORTER_RUN_DIR`` or the monitor's
``run_dir`` argument changes it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_RUN_DIR = "/dev/shm/colossalai-exporter"
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


def write_snapshot(run_dir: Path, snap: dict[str, Any]) -> Path:
    """Atomically replace the rank's snapshot file; returns its path."""
    path = snapshot_path(run_dir, int(snap["rank"]))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = json.dumps(snap, separators=(",", ":"), allow_nan=False).encode()
    with open(tmp, "wb") as f:
        f.write(data)
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


def read_snapshot(path: Path) -> dict[str, Any]:
    """Parse one snapshot; ValueError/OSError when unreadable or not a snapshot."""
    with open(path, "rb") as f:
        snap = json.loads(f.read(1 << 20))
    if not isinstance(snap, dict) or "rank" not in snap or "phase" not in snap:
        raise ValueError(f"{path}: not a rank snapshot")
    return snap


def read_all_snapshots(run_dir: Path) -> list[dict[str, Any]]:
    """Every readable snapshot in ``run_dir``, by rank; one being replaced is skipped."""
    snaps = []
    for _, path in iter_snapshot_files(run_dir):
        try:
            snaps.append(read_snapshot(path))
        except (OSError, ValueError):
            continue  # replaced or removed while reading: the next look gets it
    return snaps
