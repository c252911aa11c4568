"""A TrainingMonitor's settings: its keyword arguments resolved against the environment.

Every option a TrainingMonitor takes has an environment variable or a default
behind it (the rank from torch.distributed or torchrun's variables, the port
from ``COLOSSALAI_EXPORTER_PORT``, the run id from torchrun, Slurm or the
rendezvous address …). :meth:`MonitorSettings.resolve` does that once, in one
place, and the monitor reads the result: a frozen struct that a test (or a
launcher that builds monitors itself) can also construct directly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from colossalai_exporter.rankstate import files as snapfiles
from colossalai_exporter.training.state import Budgets

log = logging.getLogger("colossalai_exporter.training")

DEFAULT_PORT = 8766
SERVE_MODES = ("rank0", "local", "none")


def env_int(name: str, env: Mapping[str, str] | None = None) -> int | None:
    value = (os.environ if env is None else env).get(name)
    if value is None or not value.strip():
        return None
    try:
        return int(value)
    except ValueError:
        log.warning("ignoring %s=%r: not an integer", name, value)
        return None


def detect_ranks() -> tuple[int, int, int]:
    """(rank, local rank, world size): torch.distributed if initialised, else the env.

    torch is consulted only if the script imported it, so that a plain Python
    loop can use the monitor without torch installed.
    """
    rank = env_int("RANK")
    local = env_int("LOCAL_RANK")
    world = env_int("WORLD_SIZE")
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # a half-initialised process group: fall back to the environment
        pass
    rank = 0 if rank is None else rank
    return rank, (rank if local is None else local), (1 if world is None else world)


def detect_run_id() -> str:
    """An id every rank of one job shares and two concurrent jobs do not.

    Alertmanager inhibits the alerts that follow from a failure (the other ranks
    going down, the rendezvous closing) under the alert that names its cause,
    matching on this ``run`` label; ``equal`` treats two missing labels as equal,
    so it is never empty. In order: ``COLOSSALAI_EXPORTER_RUN_ID``, torchrun's
    ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``; "none" when not given with a master
    address, a new random UUID at each launch of a single-node torchrun), Slurm's job id,
    then the rendezvous address ``MASTER_ADDR:MASTER_PORT`` (one job at a time
    can listen there), else this process.
    """
    for name in ("COLOSSALAI_EXPORTER_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(name, "").strip()
        if value and value != "none":
            return value
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return f"{addr}:{port}"
    return f"{socket.gethostname()}-{os.getpid()}"


def master_endpoint(env: Mapping[str, str]) -> str:
    """``MASTER_ADDR:MASTER_PORT`` (an IPv6 address in brackets), "" without both."""
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    if not (addr and port.isdigit()):
        return ""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


@dataclass(frozen=True)
class MonitorSettings:
    """Everything a TrainingMonitor was told or found out, resolved (docs/training.md)."""

    rank: int
    local_rank: int
    world_size: int
    #: "rank0", "local" or "none"
    serve: str
    port: int
    host: str
    #: the exporter web config file of the rank server, if any
    web_config: str | None
    #: where snapshots and stall evidence go; None: nowhere
    run_dir: Path | None
    budgets: Budgets
    publish_interval: float
    #: None where this rank sends no heartbeat (only rank 0 does by default)
    step_heartbeat_url: str | None
    checkpoint_heartbeat_url: str | None
    heartbeat_every: int
    heartbeat_timeout: float
    nvme_paths: tuple[str, ...]
    loss_from_device: bool
    run_id: str
    watch_kernels: bool
    record_signals: bool
    #: ``MASTER_ADDR:MASTER_PORT`` as the launcher set them ("" without both): the
    #: process group's store, which the node agent checks (NCCLRendezvousDown)
    rendezvous: str = ""

    @property
    def serves(self) -> bool:
        """Whether this rank runs a /metrics and /health server."""
        return self.serve == "local" or (self.serve == "rank0" and self.rank == 0)

    @property
    def server_port(self) -> int:
        return self.port + (self.local_rank if self.serve == "local" else 0)

    @classmethod
    def resolve(
        cls, *,
        rank: int | None = None,
        local_rank: int | None = None,
        world_size: int | None = None,
        serve: str | None = None,
        port: int | None = None,
        host: str | None = None,
        web_config: str | os.PathLike[str] | None = None,
        run_dir: str | os.PathLike[str] | bool | None = True,
        budgets: Budgets | None = None,
        step_timeout: float | None = None,
        startup_timeout: float | None = None,
        checkpoint_timeout: float | None = None,
        publish_interval: float = 1.0,
        step_heartbeat_url: str | None = None,
        checkpoint_heartbeat_url: str | None = None,
        heartbeat_every: int = 50,
        heartbeat_timeout: float = 5.0,
        heartbeat_all_ranks: bool = False,
        nvme_paths: tuple[str, ...] | None = None,
        loss_from_device: bool | None = None,
        run_id: str | None = None,
        watch_kernels: bool = True,
        record_signals: bool = True,
    ) -> MonitorSettings:
        """The TrainingMonitor's keyword arguments (its docstring explains each), with
        what is not given taken from the environment or the defaults."""
        env = os.environ
        d_rank, d_local, d_world = detect_ranks()
        rank = d_rank if rank is None else rank
        overrides = {k: v for k, v in (("step", step_timeout), ("startup", startup_timeout),
                                       ("checkpoint", checkpoint_timeout)) if v is not None}
        mode = serve or env.get("COLOSSALAI_EXPORTER_SERVE") or "rank0"
        if mode not in SERVE_MODES:
            log.warning("serve=%r is not one of %s; serving nothing", mode,
                        ", ".join(SERVE_MODES))
            mode = "none"
        if run_dir is True:
            directory: Path | None = snapfiles.default_run_dir()
        elif run_dir is False or run_dir is None:
            directory = None
        else:
            directory = Path(run_dir)
        sends = rank == 0 or heartbeat_all_ranks
        web = web_config or env.get("COLOSSALAI_EXPORTER_WEB_CONFIG") or None
        return cls(
            rank=rank,
            local_rank=d_local if local_rank is None else local_rank,
            world_size=d_world if world_size is None else world_size,
            serve=mode,
            port=port if port is not None else (
                env_int("COLOSSALAI_EXPORTER_PORT") or DEFAULT_PORT),
            host=host or env.get("COLOSSALAI_EXPORTER_HOST") or "0.0.0.0",
            web_config=os.fspath(web) if web else None,
            run_dir=directory,
            budgets=dataclasses.replace(budgets or Budgets(), **overrides),
            publish_interval=publish_interval,
            step_heartbeat_url=(step_heartbeat_url or env.get("STEP_HEARTBEAT_URL"))
            if sends else None,
            checkpoint_heartbeat_url=(checkpoint_heartbeat_url
                                      or env.get("CHECKPOINT_HEARTBEAT_URL")) if sends else None,
            heartbeat_every=heartbeat_every,
            heartbeat_timeout=heartbeat_timeout,
            nvme_paths=nvme_paths if nvme_paths is not None else tuple(
                filter(None, [env.get("NVME_PATH")])),
            loss_from_device=bool(loss_from_device),
            run_id=(run_id or detect_run_id())[:200],
            watch_kernels=watch_kernels,
            record_signals=record_signals,
            rendezvous=master_endpoint(env),
        )
