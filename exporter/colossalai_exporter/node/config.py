"""Node agent configuration: YAML file, then environment variables, then flags.

Example ``node.yml`` (every key optional)::

    web:
      listen_address: ":9466"
      config_file: web.yml
    log: {level: info, format: logfmt}
    scrape_timeout_seconds: 8
    collectors: {gpu: true, host: true, disk: true, rendezvous: true}
    gpu: {timeout_seconds: 5, expected: 8}
    disks:
      - {name: checkpoints, path: /ckpt}
      - {name: nvme_offload, path: /nvme, mount_point: true}
    rendezvous:
      targets: ["10.0.0.1:29500"]
      timeout_seconds: 2
    ranks:
      run_dir: /dev/shm/colossalai-exporter
    infiniband:
      sysfs: /sys/class/infiniband
    state_dir: /var/lib/colossalai-exporter

Environment: ``CHECKPOINT_DIR`` and ``NVME_PATH`` (the tutorial's) name the
default disks, ``MASTER_ADDR``/``MASTER_PORT`` a rendezvous target checked always (the
live ranks' own stores are checked anyway).
Without a flag, a file's ``disks`` or these variables, the agent watches the
built-in :data:`DEFAULT_DISKS`, each only where it exists (see node/disk.py).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from colossalai_exporter.configfile import (
    ConfigPath,
    DaemonFile,
    Seconds,
    Section,
    load,
)
from colossalai_exporter.daemon import DaemonSettings
from colossalai_exporter.errors import ConfigError
from colossalai_exporter.node import collectors as registry
from colossalai_exporter.node.disk import WatchedPath
from colossalai_exporter.node.rendezvous import Endpoint

DEFAULT_PORT = 9466
#: (name, environment variable naming its path, the built-in path when it is unset)
#: for the disks watched when no flag or config file names any: the tutorial's
DEFAULT_DISKS: tuple[tuple[str, str, str], ...] = (
    ("checkpoints", "CHECKPOINT_DIR", "/checkpoints"),
    ("nvme_offload", "NVME_PATH", "/nvme"),
)


@dataclass
class NodeConfig:
    daemon: DaemonSettings = field(default_factory=lambda: DaemonSettings.on_port(DEFAULT_PORT))
    scrape_timeout: float = 8.0
    collectors: dict[str, bool] = field(default_factory=registry.defaults)
    gpu_timeout: float = 5.0
    gpu_expected: int | None = None
    disks: list[WatchedPath] = field(default_factory=list)
    rendezvous: list[Endpoint] = field(default_factory=list)
    rendezvous_timeout: float = 2.0
    #: where the local ranks' TrainingMonitor snapshots are; None means the
    #: monitor's default ($COLOSSALAI_EXPORTER_RUN_DIR, else /dev/shm/colossalai-exporter)
    ranks_run_dir: str | None = None
    #: NCCL's RAS service on this node (NCCL_RAS_ADDR's default)
    nccl_ras: Endpoint = field(default_factory=lambda: Endpoint("127.0.0.1", 28028))
    nccl_timeout: float = 3.0
    #: where the RDMA devices are (a fake tree in tests)
    infiniband_sysfs: str = "/sys/class/infiniband"
    #: where the agent keeps what must outlive a reboot (which boots saw each GPU's Xids);
    #: None: nothing kept
    state_dir: str | None = None


def parse_disk(spec: str, mount_point: bool = False) -> WatchedPath:
    """``NAME=PATH`` from ``--disk``; the name becomes the ``name`` label."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--disk {spec!r} must be NAME=PATH, e.g. checkpoints=/ckpt")
    return WatchedPath(name.strip(), path.strip(), mount_point)


def parse_endpoint(spec: str, where: str = "--rendezvous.target") -> Endpoint:
    try:
        return Endpoint.parse(spec)
    except ValueError:
        raise ConfigError(f"{where} {spec!r} must be HOST:PORT with a port 1-65535") from None


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{where} must be a positive number of seconds, got {value!r}")
    return float(value)


# The file's shape (docs/node.md, deploy/node/node.example.yml). Unknown keys at any
# depth are errors naming their path: a typo must not start the agent on defaults.
if TYPE_CHECKING:
    class CollectorsSection(Section, frozen=True):
        """``collectors: {NAME: bool}``, one key per registered collector."""
else:
    # Derived from the registry, so a new collector's key needs no edit here.
    CollectorsSection = msgspec.defstruct(
        "CollectorsSection", [(e.name, bool, e.default) for e in registry.REGISTRY],
        bases=(Section,), frozen=True, module=__name__)


class GpuSection(Section, frozen=True):
    timeout_seconds: Seconds | None = None
    expected: Annotated[int, msgspec.Meta(ge=0)] | None = None


class DiskSection(Section, frozen=True):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    path: ConfigPath
    mount_point: bool = False


class RendezvousSection(Section, frozen=True):
    targets: list[str] = msgspec.field(default_factory=list)
    timeout_seconds: Seconds | None = None


class RanksSection(Section, frozen=True):
    run_dir: ConfigPath | None = None


class NcclSection(Section, frozen=True):
    ras_address: str | None = None
    timeout_seconds: Seconds | None = None


class InfinibandSection(Section, frozen=True):
    sysfs: ConfigPath | None = None


class NodeFile(DaemonFile, frozen=True):
    scrape_timeout_seconds: Seconds | None = None
    collectors: CollectorsSection = CollectorsSection()
    gpu: GpuSection = GpuSection()
    disks: list[DiskSection] = msgspec.field(default_factory=list)
    rendezvous: RendezvousSection = RendezvousSection()
    ranks: RanksSection = RanksSection()
    nccl: NcclSection = NcclSection()
    infiniband: InfinibandSection = InfinibandSection()
    state_dir: ConfigPath | None = None


def apply_file(config: NodeConfig, file: NodeFile, source: str) -> None:
    """Values the file sets replace the defaults; flags replace them in turn."""
    config.daemon.apply_file(file.web, file.log)
    if file.scrape_timeout_seconds is not None:
        config.scrape_timeout = _positive(file.scrape_timeout_seconds,
                                          f"{source}: scrape_timeout_seconds")
    config.collectors = {name: getattr(file.collectors, name) for name in registry.NAMES}
    if file.gpu.timeout_seconds is not None:
        config.gpu_timeout = _positive(file.gpu.timeout_seconds,
                                       f"{source}: gpu.timeout_seconds")
    if file.gpu.expected is not None:
        config.gpu_expected = file.gpu.expected
    config.disks = [WatchedPath(d.name, str(d.path), d.mount_point) for d in file.disks]
    config.rendezvous = [parse_endpoint(t, f"{source}: rendezvous.targets")
                         for t in file.rendezvous.targets]
    if file.rendezvous.timeout_seconds is not None:
        config.rendezvous_timeout = _positive(file.rendezvous.timeout_seconds,
                                              f"{source}: rendezvous.timeout_seconds")
    if file.ranks.run_dir is not None:
        config.ranks_run_dir = str(file.ranks.run_dir)
    if file.nccl.ras_address is not None:
        config.nccl_ras = parse_endpoint(file.nccl.ras_address, f"{source}: nccl.ras_address")
    if file.nccl.timeout_seconds is not None:
        config.nccl_timeout = _positive(file.nccl.timeout_seconds,
                                        f"{source}: nccl.timeout_seconds")
    if file.infiniband.sysfs is not None:
        config.infiniband_sysfs = str(file.infiniband.sysfs)
    if file.state_dir is not None:
        config.state_dir = str(file.state_dir)


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where} must be a whole number of GPUs, got {value!r}")
    return value


def apply_environment(config: NodeConfig, env: Mapping[str, str]) -> None:
    if not config.disks:
        # A path from the environment was named by the user: missing, it is a failure.
        # The built-in one was not: it is watched only where it exists.
        config.disks = [
            WatchedPath(name, env[variable]) if env.get(variable)
            else WatchedPath(name, builtin, default=True)
            for name, variable, builtin in DEFAULT_DISKS
        ]
    ras = env.get("NCCL_RAS_ADDR")
    if ras and config.nccl_ras == Endpoint("127.0.0.1", 28028):
        config.nccl_ras = parse_endpoint(ras, "NCCL_RAS_ADDR")
    # A store given in the agent's environment is checked always; without one, only the
    # stores the live ranks' snapshots name (node/rendezvous.py).
    if not config.rendezvous and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        config.rendezvous = [parse_endpoint(f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
                                            "MASTER_ADDR:MASTER_PORT")]


def add_node_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disk", action="append", default=[], metavar="NAME=PATH",
                        help="watch a path (repeatable); default checkpoints=$CHECKPOINT_DIR "
                             "and nvme_offload=$NVME_PATH, else /checkpoints and /nvme "
                             "where they exist")
    parser.add_argument("--disk.mount-point", dest="disk_mount", action="append", default=[],
                        metavar="NAME=PATH",
                        help="watch a path that must be a mount point (an NVMe offload mount)")
    parser.add_argument("--rendezvous.target", dest="rendezvous", action="append", default=[],
                        metavar="HOST:PORT",
                        help="rendezvous/store endpoint to check always (repeatable), "
                             "besides the stores the live ranks' snapshots name; default "
                             "$MASTER_ADDR:$MASTER_PORT where both are set")
    parser.add_argument("--rendezvous.timeout", dest="rendezvous_timeout", type=float,
                        default=None, metavar="SECONDS",
                        help="deadline for one rendezvous connect (default 2)")
    parser.add_argument("--state.dir", dest="state_dir", default=None, metavar="PATH",
                        help="where to keep what must outlive a reboot: the boots each "
                             "GPU's Xids were seen in (e.g. /var/lib/colossalai-exporter; "
                             "default: nothing kept)")
    parser.add_argument("--infiniband.sysfs", dest="infiniband_sysfs", default=None,
                        metavar="PATH",
                        help="where the RDMA devices are (default /sys/class/infiniband)")
    parser.add_argument("--ranks.run-dir", dest="ranks_run_dir", default=None, metavar="PATH",
                        help="where local training ranks publish their state snapshots "
                             "(default $COLOSSALAI_EXPORTER_RUN_DIR, else "
                             "/dev/shm/colossalai-exporter)")
    parser.add_argument("--gpu.expected", dest="gpu_expected", type=int, default=None,
                        metavar="N", help="fewer visible GPUs than N is a gpu collector failure")
    parser.add_argument("--gpu.timeout", dest="gpu_timeout", type=float, default=None,
                        metavar="SECONDS", help="deadline for one NVML sample (default 5)")
    parser.add_argument("--scrape.timeout", dest="scrape_timeout", type=float, default=None,
                        metavar="SECONDS", help="deadline for a whole scrape (default 8)")
    for entry in registry.REGISTRY:
        on, off = f"--collector.{entry.name}", f"--no-collector.{entry.name}"
        parser.add_argument(on, dest=f"collector_{entry.name}", action="store_true",
                            default=None, help=argparse.SUPPRESS if entry.default else
                            f"enable the {entry.name} collector: {entry.what}")
        parser.add_argument(off, dest=f"collector_{entry.name}", action="store_false",
                            help=f"disable the {entry.name} collector: {entry.what}"
                            if entry.default else argparse.SUPPRESS)


def apply_flags(config: NodeConfig, args: argparse.Namespace) -> None:
    """Flags replace the file's values."""
    config.daemon.apply_flags(args)
    if args.disk or args.disk_mount:
        config.disks = [parse_disk(s) for s in args.disk]
        config.disks += [parse_disk(s, mount_point=True) for s in args.disk_mount]
    if args.rendezvous:
        config.rendezvous = [parse_endpoint(s) for s in args.rendezvous]
    if args.rendezvous_timeout is not None:
        config.rendezvous_timeout = _positive(args.rendezvous_timeout, "--rendezvous.timeout")
    if args.ranks_run_dir is not None:
        config.ranks_run_dir = args.ranks_run_dir
    if args.infiniband_sysfs is not None:
        config.infiniband_sysfs = args.infiniband_sysfs
    if args.state_dir is not None:
        config.state_dir = args.state_dir
    if args.gpu_timeout is not None:
        config.gpu_timeout = _positive(args.gpu_timeout, "--gpu.timeout")
    if args.scrape_timeout is not None:
        config.scrape_timeout = _positive(args.scrape_timeout, "--scrape.timeout")
    if args.gpu_expected is not None:
        config.gpu_expected = _count(args.gpu_expected, "--gpu.expected")
    for name in registry.NAMES:
        value = getattr(args, f"collector_{name}")
        if value is not None:
            config.collectors[name] = value
    names = [d.name for d in config.disks]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"disk name {duplicates[0]!r} is used twice")


def load_config(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> NodeConfig:
    config = NodeConfig()
    if args.config_file:
        apply_file(config, load(args.config_file, NodeFile), args.config_file)
    apply_flags(config, args)
    apply_environment(config, os.environ if env is None else env)
    return config
