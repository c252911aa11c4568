"""The node agent's collectors, registered once.

Each entry says what a collector is called (its ``--no-collector.NAME`` flag,
its ``collectors.NAME`` config key and its ``collector`` label), what it does
(the flag's help), whether it runs by default, which collectors' results it
reads, and where its factory is: a ``from_config(config, built)`` function in
the collector's own module, which reads what it needs from the
:class:`~colossalai_exporter.node.config.NodeConfig` and may return None (a
disk collector with no path to watch). The flags, the config file's
``collectors`` section and the agent's list are all derived from
:data:`REGISTRY`; adding a collector is one entry here and one factory there.

Why the factory is named by its module path rather than imported: the flags
and the config are read before the NVML worker is started, and importing the
collectors pulls in prometheus_client and psutil, which would delay the
worker's start and so the first scrape (see node/cli.py).

The order of :data:`REGISTRY` is the order the agent serves their families in.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from colossalai_exporter.node.base import NodeCollector
    from colossalai_exporter.node.blocking import BlockingCalls
    from colossalai_exporter.node.config import NodeConfig
    from colossalai_exporter.node.gpu.worker import Worker


@dataclass
class Built:
    """What a factory may use besides the config: the runners the agent shares and
    the collectors built so far (those named in its entry's ``uses`` among them,
    when they are switched on)."""

    gpu_worker: Worker | None = None
    fs_calls: BlockingCalls | None = None
    collectors: dict[str, NodeCollector] = field(default_factory=dict)


Factory = Callable[["NodeConfig", Built], "NodeCollector | None"]


@dataclass(frozen=True)
class CollectorEntry:
    name: str
    #: one line for ``--no-collector.NAME``'s help
    what: str
    #: ``module:function`` of its factory, imported only when the agent is built
    factory: str
    default: bool = True
    #: collectors whose results it reads; built before it, passed in ``Built``
    uses: tuple[str, ...] = ()

    def load_factory(self) -> Factory:
        module, _, function = self.factory.partition(":")
        return cast(Factory, getattr(importlib.import_module(module), function))


_NODE = "colossalai_exporter.node"
REGISTRY: tuple[CollectorEntry, ...] = (
    CollectorEntry("gpu", "GPUs through NVML in a worker process",
                   f"{_NODE}.gpu.collector:from_config", uses=("ranks",)),
    CollectorEntry("host", "host memory, swap and OOM kills", f"{_NODE}.host:from_config"),
    CollectorEntry("disk", "the watched checkpoint and offload paths",
                   f"{_NODE}.disk:from_config"),
    CollectorEntry("rendezvous", "TCP connects to the rendezvous stores of the local ranks",
                   f"{_NODE}.rendezvous:from_config", uses=("ranks",)),
    CollectorEntry("ranks", "the local training ranks' snapshots",
                   f"{_NODE}.ranks:from_config"),
    CollectorEntry("nccl", "NCCL's RAS service on this node", f"{_NODE}.nccl_ras:from_config",
                   uses=("ranks",)),
    CollectorEntry("infiniband", "InfiniBand and RoCE ports (sysfs)",
                   f"{_NODE}.infiniband:from_config"),
)
NAMES: tuple[str, ...] = tuple(entry.name for entry in REGISTRY)
_BY_NAME = {entry.name: entry for entry in REGISTRY}


def defaults() -> dict[str, bool]:
    return {entry.name: entry.default for entry in REGISTRY}


def build(config: NodeConfig, built: Built) -> list[NodeCollector]:
    """The switched-on collectors, each built after the ones it uses, in REGISTRY's order."""

    def ensure(entry: CollectorEntry) -> None:
        if entry.name in done:
            return
        done.add(entry.name)
        for used in entry.uses:
            if config.collectors[used]:
                ensure(_BY_NAME[used])
        collector = entry.load_factory()(config, built)
        if collector is not None:
            built.collectors[entry.name] = collector

    done: set[str] = set()
    for entry in REGISTRY:
        if config.collectors[entry.name]:
            ensure(entry)
    return [built.collectors[name] for name in NAMES if name in built.collectors]
