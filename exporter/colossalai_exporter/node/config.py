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

Environment: ``CHECKPOINT_DIR`` and ``NVME_PATH`` (the tutorial's) name the
default disks, ``MASTER_ADDR``/``MASTER_PORT`` the default rendezvous target.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from colossalai_exporter.errors import ConfigError
from colossalai_exporter.flags import load_yaml_file
from colossalai_exporter.node.disk import WatchedPath
from colossalai_exporter.node.rendezvous import Endpoint

COLLECTORS = ("gpu", "host", "disk", "rendezvous", "ranks")
DEFAULT_PORT = 9466
TOP_KEYS = {"web", "log", "scrape_timeout_seconds", "collectors", "gpu", "disks", "rendezvous",
            "ranks"}


@dataclass
class NodeConfig:
    listen_address: str = f":{DEFAULT_PORT}"
    web_config_file: str | None = None
    log_level: str = "info"
    log_format: str = "logfmt"
    scrape_timeout: float = 8.0
    collectors: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(COLLECTORS, True))
    gpu_timeout: float = 5.0
    gpu_expected: int | None = None
    disks: list[WatchedPath] = field(default_factory=list)
    rendezvous: list[Endpoint] = field(default_factory=list)
    rendezvous_timeout: float = 2.0
    #: where the local ranks' TrainingMonitor snapshots are; None means the
    #: monitor's default ($COLOSSALAI_EXPORTER_RUN_DIR, else /dev/shm/colossalai-exporter)
    ranks_run_dir: str | None = None


def parse_disk(spec: str, mount_point: bool = False) -> WatchedPath:
    """``NAME=PATH`` from ``--disk``; the name becomes the ``name`` label."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--disk {spec!r} must be NAME=PATH, e.g. checkpoints=/ckpt")
    return WatchedPath(name.strip(), path.strip(), mount_point)


def parse_endpoint(spec: str, where: str = "--rendezvous.target") -> Endpoint:
    host, sep, port = spec.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{where} {spec!r} must be HOST:PORT with a port 1-65535")
    return Endpoint(host, int(port))


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{where} must be a positive number of seconds, got {value!r}")
    return float(value)


def _section(data: Mapping[str, Any], key: str, source: str) -> dict[str, Any]:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {key} must be a mapping")
    return value


def apply_file(config: NodeConfig, data: Mapping[str, Any], source: str) -> None:
    unknown = sorted(set(data) - TOP_KEYS)
    if unknown:
        raise ConfigError(f"{source}: unknown key {unknown[0]!r} "
                          f"(known: {', '.join(sorted(TOP_KEYS))})")
    web = _section(data, "web", source)
    config.listen_address = str(web.get("listen_address", config.listen_address))
    config.web_config_file = web.get("config_file", config.web_config_file)
    log = _section(data, "log", source)
    config.log_level = str(log.get("level", config.log_level))
    config.log_format = str(log.get("format", config.log_format))
    if "scrape_timeout_seconds" in data:
        config.scrape_timeout = _positive(data["scrape_timeout_seconds"],
                                          f"{source}: scrape_timeout_seconds")
    for name, enabled in _section(data, "collectors", source).items():
        if name not in COLLECTORS or not isinstance(enabled, bool):
            raise ConfigError(f"{source}: collectors.{name} must be one of "
                              f"{', '.join(COLLECTORS)} with true or false")
        config.collectors[name] = enabled
    gpu = _section(data, "gpu", source)
    if "timeout_seconds" in gpu:
        config.gpu_timeout = _positive(gpu["timeout_seconds"], f"{source}: gpu.timeout_seconds")
    if "expected" in gpu:
        config.gpu_expected = _count(gpu["expected"], f"{source}: gpu.expected")
    disks = data.get("disks") or []
    if not isinstance(disks, list):
        raise ConfigError(f"{source}: disks must be a list of {{name, path}}")
    for i, disk in enumerate(disks):
        if not isinstance(disk, dict) or not isinstance(disk.get("name"), str) \
                or not isinstance(disk.get("path"), str):
            raise ConfigError(f"{source}: disks[{i}] needs string keys name and path")
        config.disks.append(WatchedPath(disk["name"], disk["path"],
                                        bool(disk.get("mount_point", False))))
    rendezvous = _section(data, "rendezvous", source)
    for target in rendezvous.get("targets") or []:
        config.rendezvous.append(parse_endpoint(str(target), f"{source}: rendezvous.targets"))
    if "timeout_seconds" in rendezvous:
        config.rendezvous_timeout = _positive(rendezvous["timeout_seconds"],
                                              f"{source}: rendezvous.timeout_seconds")
    ranks = _section(data, "ranks", source)
    if "run_dir" in ranks:
        if not isinstance(ranks["run_dir"], str) or not ranks["run_dir"]:
            raise ConfigError(f"{source}: ranks.run_dir must be a path")
        config.ranks_run_dir = ranks["run_dir"]


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where} must be a whole number of GPUs, got {value!r}")
    return value


def apply_environment(config: NodeConfig, env: Mapping[str, str]) -> None:
    if not config.disks:
        config.disks = [
            WatchedPath("checkpoints", env.get("CHECKPOINT_DIR") or "/checkpoints"),
            WatchedPath("nvme_offload", env.get("NVME_PATH") or "/nvme"),
        ]
    if not config.rendezvous:
        host = env.get("MASTER_ADDR") or "127.0.0.1"
        port = env.get("MASTER_PORT") or "29500"
        config.rendezvous = [parse_endpoint(f"{host}:{port}", "MASTER_ADDR:MASTER_PORT")]


def add_node_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disk", action="append", default=[], metavar="NAME=PATH",
                        help="watch a path (repeatable); default checkpoints=$CHECKPOINT_DIR "
                             "and nvme_offload=$NVME_PATH")
    parser.add_argument("--disk.mount-point", dest="disk_mount", action="append", default=[],
                        metavar="NAME=PATH",
                        help="watch a path that must be a mount point (an NVMe offload mount)")
    parser.add_argument("--rendezvous.target", dest="rendezvous", action="append", default=[],
                        metavar="HOST:PORT",
                        help="rendezvous/store endpoint (repeatable); default "
                             "$MASTER_ADDR:$MASTER_PORT, else 127.0.0.1:29500")
    parser.add_argument("--rendezvous.timeout", dest="rendezvous_timeout", type=float,
                        default=None, metavar="SECONDS")
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
    for name in COLLECTORS:
        parser.add_argument(f"--collector.{name}", dest=f"collector_{name}",
                            action="store_true", default=None, help=argparse.SUPPRESS)
        parser.add_argument(f"--no-collector.{name}", dest=f"collector_{name}",
                            action="store_false", help=f"disable the {name} collector")


def apply_flags(config: NodeConfig, args: argparse.Namespace) -> None:
    for attr in ("listen_address", "web_config_file", "log_level", "log_format"):
        if getattr(args, attr) is not None:
            setattr(config, attr, getattr(args, attr))
    if args.disk or args.disk_mount:
        config.disks = [parse_disk(s) for s in args.disk]
        config.disks += [parse_disk(s, mount_point=True) for s in args.disk_mount]
    if args.rendezvous:
        config.rendezvous = [parse_endpoint(s) for s in args.rendezvous]
    if args.rendezvous_timeout is not None:
        config.rendezvous_timeout = _positive(args.rendezvous_timeout, "--rendezvous.timeout")
    if args.ranks_run_dir is not None:
        config.ranks_run_dir = args.ranks_run_dir
    if args.gpu_timeout is not None:
        config.gpu_timeout = _positive(args.gpu_timeout, "--gpu.timeout")
    if args.scrape_timeout is not None:
        config.scrape_timeout = _positive(args.scrape_timeout, "--scrape.timeout")
    if args.gpu_expected is not None:
        config.gpu_expected = _count(args.gpu_expected, "--gpu.expected")
    for name in COLLECTORS:
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
        apply_file(config, load_yaml_file(args.config_file), args.config_file)
    apply_flags(config, args)
    apply_environment(config, os.environ if env is None else env)
    return config
