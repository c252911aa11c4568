"""``python -m colossalai_exporter.slurm``: Prometheus targets for a Slurm job.

    python -m colossalai_exporter.slurm write  [--file-sd.dir DIR] [--node.port 9466]
                                               [--training.port 8766] [--training.local-ranks N]
                                               [--domain SUFFIX] [--label NAME=VALUE]…
    python -m colossalai_exporter.slurm remove [--file-sd.dir DIR]
    python -m colossalai_exporter.slurm hostnames [NODELIST]

The job comes from the environment Slurm gives prologs and epilogs
(``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``, ``SLURM_JOB_NAME``) unless
``--job-id`` / ``--nodelist`` say otherwise. ``hostnames`` prints one host per
line, like ``scontrol show hostnames``. A bad nodelist, job id or flag is one
line on stderr and exit code 2; nothing is written then.

Not a ``colossalai-exporter`` subcommand on purpose: it runs in Slurm's
prolog on the controller, where only this module's few imports are needed.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from colossalai_exporter.errors import ConfigError
from colossalai_exporter.flags import ArgumentParser
from colossalai_exporter.slurm import file_sd
from colossalai_exporter.slurm.hostlist import HostlistError, expand

PROG = "colossalai_exporter.slurm"
_DOMAIN = re.compile(r"[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*")
DIR_ENV = "COLOSSALAI_EXPORTER_FILE_SD_DIR"
DEFAULT_DIR = "/etc/prometheus/targets"


def _first(env: Mapping[str, str], *names: str) -> str | None:
    # SLURM_NODELIST and SLURM_JOBID are the older spellings, still set by Slurm.
    for name in names:
        if env.get(name):
            return env[name]
    return None


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description="Prometheus file_sd targets for a Slurm job.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    write = sub.add_parser("write", help="write the job's target files")
    remove = sub.add_parser("remove", help="remove the job's target files")
    for command in (write, remove):
        command.add_argument("--file-sd.dir", dest="directory", default=None, metavar="DIR",
                             help=f"file_sd directory (default ${DIR_ENV}, else {DEFAULT_DIR})")
        command.add_argument("--job-id", default=None, help="default $SLURM_JOB_ID")
    write.add_argument("--nodelist", default=None,
                       help="Slurm hostlist expression (default $SLURM_JOB_NODELIST)")
    write.add_argument("--node.port", dest="node_port", type=int, default=9466,
                       help="node agent port; 0 writes no node targets")
    write.add_argument("--training.port", dest="training_port", type=int, default=8766,
                       help="rank server port; 0 writes no training targets")
    write.add_argument("--training.local-ranks", dest="local_ranks", type=int, default=0,
                       metavar="N", help="every rank serves (serve='local'): N ranks per node on "
                                         "ports training.port … training.port+N-1; default "
                                         "0: rank 0 only, on the first node")
    write.add_argument("--domain", default="", help="suffix for the host names (a DNS domain)")
    write.add_argument("--label", action="append", default=[], metavar="NAME=VALUE",
                       help="extra target label (repeatable)")
    names = sub.add_parser("hostnames", help="print the expanded nodelist, one host a line")
    names.add_argument("nodelist", nargs="?", default=None)
    return parser


def _port(value: int, flag: str) -> int:
    if not 0 <= value < 65536:
        raise ConfigError(f"{flag} must be 0 (off) or a port 1-65535, got {value}")
    return value


def _labels(specs: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    if env.get("SLURM_JOB_NAME"):
        labels["slurm_job_name"] = env["SLURM_JOB_NAME"]
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep:
            raise ConfigError(f"--label {spec!r} must be NAME=VALUE")
        try:
            labels[file_sd.check_label(name)] = value
        except ValueError as exc:
            raise ConfigError(f"--label: {exc}") from None
    return labels


def _hosts(nodelist: str | None) -> list[str]:
    if nodelist is None:
        raise ConfigError("no nodelist: set SLURM_JOB_NODELIST (Slurm does in prologs "
                          "and epilogs) or pass --nodelist")
    try:
        return expand(nodelist)
    except HostlistError as exc:
        raise ConfigError(f"nodelist {exc}") from None


def _job_id(value: str | None) -> str:
    if value is None:
        raise ConfigError("no job id: set SLURM_JOB_ID or pass --job-id")
    try:
        return file_sd.check_job_id(value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def run(argv: Sequence[str], env: Mapping[str, str]) -> int:
    args = _parser().parse_args(list(argv))
    if args.command == "hostnames":
        nodelist = args.nodelist or _first(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        print("\n".join(_hosts(nodelist)))
        return 0
    directory = Path(args.directory or env.get(DIR_ENV) or DEFAULT_DIR)
    job_id = _job_id(args.job_id or _first(env, "SLURM_JOB_ID", "SLURM_JOBID"))
    if args.command == "remove":
        for path in file_sd.remove(directory, job_id):
            print(f"removed {path}")
        return 0
    if args.local_ranks < 0:
        raise ConfigError("--training.local-ranks must be 0 or more")
    job = file_sd.JobTargets(
        job_id=job_id,
        hosts=_hosts(args.nodelist or _first(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST")),
        node_port=_port(args.node_port, "--node.port"),
        training_port=_port(args.training_port, "--training.port"),
        local_ranks=args.local_ranks, domain=args.domain, labels=_labels(args.label, env))
    if job.domain and not _DOMAIN.fullmatch(job.domain):
        raise ConfigError(f"--domain {job.domain!r} is not a DNS domain like cluster.internal")
    try:
        written = file_sd.write(directory, job)
    except OSError as exc:
        raise ConfigError(f"cannot write targets under {directory}: {exc.strerror}") from None
    for path, count in written:
        print(f"wrote {path} ({count} target{'' if count == 1 else 's'})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv, os.environ)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
