"""Prometheus file_sd target files for one Slurm job, written atomically.

One file per scrape job and Slurm job, so the epilog removes exactly what
the prolog wrote and two jobs never touch each other's files:

    <dir>/colossalai-node/slurm-<job id>.json      the node agents of the job's nodes
    <dir>/colossalai-training/slurm-<job id>.json  rank 0's server on the first node
                                                    (or every local rank's, see below)

The directories match the ``file_sd_configs`` of deploy/prometheus/prometheus.yml.
Prometheus watches them with inotify and re-reads a changed file at once, so a
half-written file would be read as broken: each file is written to a temporary
name in the same directory (not matched by ``*.json``), flushed to disk, and
renamed over the old one, which readers see as one step.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colossalai_exporter import catalogue

NODE_JOB = "colossalai-node"
TRAINING_JOB = "colossalai-training"

_JOB_ID = re.compile(r"[0-9]+")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
#: set by the scrape config and Prometheus; a Slurm job must not change them
RESERVED_LABELS = ("job", "instance")


@dataclass(frozen=True)
class JobTargets:
    """What to write for one Slurm job."""

    job_id: str
    hosts: Sequence[str]
    node_port: int = 9466
    #: 0: the job has no rank servers to scrape (not a monitored training run)
    training_port: int = 8766
    #: 0: only rank 0 serves (TrainingMonitor's default ``serve="rank0"``), on the
    #: first node; N: every rank serves on training_port + local rank
    #: (``serve="local"``), N ranks per node
    local_ranks: int = 0
    domain: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


def check_job_id(job_id: str) -> str:
    """Slurm job ids are digits; anything else could escape the directory."""
    if not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"the job id must be digits (SLURM_JOB_ID), got {job_id!r}")
    return job_id


def check_label(name: str) -> str:
    if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
        raise ValueError(f"label {name!r} is not a Prometheus label name "
                         "(letters, digits and '_', not starting with a digit or '__')")
    if name in RESERVED_LABELS:
        raise ValueError(f"label {name!r} is set by Prometheus and the scrape config; "
                         "choose another name")
    if name in catalogue.label_names():
        raise ValueError(f"label {name!r} is set by the exporters themselves (Prometheus "
                         f"would rename theirs to exported_{name}); choose another name")
    return name


def _address(host: str, domain: str, port: int) -> str:
    return f"{host}.{domain}:{port}" if domain else f"{host}:{port}"


def target_groups(job: JobTargets) -> dict[str, list[dict[str, Any]]]:
    """Scrape job name -> the file_sd target groups to write for it (empty: none)."""
    labels = {"slurm_job_id": job.job_id, **job.labels}
    groups: dict[str, list[dict[str, Any]]] = {NODE_JOB: [], TRAINING_JOB: []}
    if job.node_port:
        groups[NODE_JOB].append({
            "targets": [_address(h, job.domain, job.node_port) for h in job.hosts],
            "labels": labels})
    if job.training_port:
        if job.local_ranks:
            ports = range(job.training_port, job.training_port + job.local_ranks)
            addresses = [_address(h, job.domain, p) for h in job.hosts for p in ports]
        else:
            # torchrun and srun give node rank 0 (and so global rank 0) to the first
            # host of the sorted nodelist, where MASTER_ADDR usually points too.
            addresses = [_address(job.hosts[0], job.domain, job.training_port)]
        groups[TRAINING_JOB].append({"targets": addresses, "labels": labels})
    return groups


def file_name(job_id: str) -> str:
    return f"slurm-{check_job_id(job_id)}.json"


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a reader sees the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; Prometheus usually runs as another user.
        tmp.chmod(0o644)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The rename itself survives a crash only once the directory is synced.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write(directory: Path, job: JobTargets) -> list[tuple[Path, int]]:
    """Write (or, for a disabled group, remove) the job's files: ``(path, targets)``."""
    name = file_name(job.job_id)
    written: list[tuple[Path, int]] = []
    for scrape_job, groups in target_groups(job).items():
        path = directory / scrape_job / name
        if not groups:
            path.unlink(missing_ok=True)
            continue
        body = json.dumps(groups, indent=2, sort_keys=True).encode() + b"\n"
        write_atomically(path, body)
        written.append((path, sum(len(g["targets"]) for g in groups)))
    return written


def remove(directory: Path, job_id: str) -> list[Path]:
    """Delete the job's files; those already gone are not an error."""
    name = file_name(job_id)
    removed: list[Path] = []
    for scrape_job in (NODE_JOB, TRAINING_JOB):
        path = directory / scrape_job / name
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed
