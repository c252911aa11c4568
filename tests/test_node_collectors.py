"""The node agent's collector registry (node/collectors.py): flags, the config
file's ``collectors`` keys and the agent's list all come from it."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import pytest

from colossalai_exporter.configfile import convert
from colossalai_exporter.errors import ConfigError
from colossalai_exporter.flags import add_common_flags
from colossalai_exporter.node import collectors
from colossalai_exporter.node.config import (
    CollectorsSection,
    NodeConfig,
    NodeFile,
    add_node_flags,
    apply_file,
    load_config,
)
from colossalai_exporter.node.gpu.collector import GpuCollector
from colossalai_exporter.node.nccl_ras import NcclRasCollector
from colossalai_exporter.node.ranks import RanksCollector


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_common_flags(parser, 9466)
    add_node_flags(parser)
    return parser


def test_every_entry_names_a_factory_in_its_collectors_module() -> None:
    for entry in collectors.REGISTRY:
        factory = entry.load_factory()
        assert list(inspect.signature(factory).parameters) == ["config", "built"], entry.name
        # the factory lives beside the collector it builds
        assert factory.__module__ == entry.factory.partition(":")[0]
        for used in entry.uses:
            assert used in collectors.NAMES, (entry.name, used)


def test_flags_and_config_keys_are_the_registry() -> None:
    help_text = _parser().format_help()
    for name in collectors.NAMES:
        assert f"--no-collector.{name}" in help_text
    assert set(CollectorsSection.__struct_fields__) == set(collectors.NAMES)
    args = _parser().parse_args(["--no-collector.host"])
    config = load_config(args, env={})
    assert config.collectors == {**collectors.defaults(), "host": False}


def test_a_config_key_that_is_no_collector_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigError) as err:
        convert({"collectors": {"hots": False}}, NodeFile, "node.yml")
    assert "collectors: unknown key `hots`" in str(err.value)
    assert "rendezvous" in str(err.value)


def test_collectors_are_built_after_what_they_use_and_served_in_registry_order(
        tmp_path: Path) -> None:
    config = NodeConfig()
    file = {"collectors": {"rendezvous": False}, "disks": [{"name": "ckpt", "path": "."}]}
    apply_file(config, convert(file, NodeFile, "node.yml", base=tmp_path), "node.yml")
    order: list[str] = []
    real_build = collectors.CollectorEntry.load_factory

    def recording(entry: collectors.CollectorEntry) -> collectors.Factory:
        factory = real_build(entry)
        return lambda cfg, built: (order.append(entry.name), factory(cfg, built))[1]

    mp = pytest.MonkeyPatch()
    mp.setattr(collectors.CollectorEntry, "load_factory", recording)
    try:
        built = collectors.build(config, collectors.Built())
    finally:
        mp.undo()
    try:
        # gpu and nccl read the ranks collector's pids: ranks is built first ...
        assert order.index("ranks") < order.index("gpu") < order.index("nccl")
        # ... and the families are still served in the registry's order (gpu first).
        assert [c.name for c in built] == ["gpu", "host", "disk", "ranks", "nccl", "infiniband"]
        nccl = next(c for c in built if isinstance(c, NcclRasCollector))
        ranks = next(c for c in built if isinstance(c, RanksCollector))
        assert nccl.local_ranks == ranks.local_pids
        gpu = next(c for c in built if isinstance(c, GpuCollector))
        assert gpu._local_ranks == ranks.local_pids
    finally:
        for collector in built:
            close = getattr(collector, "close", None)
            if close is not None:
                close()


def test_a_collector_without_what_it_uses_is_built_without_it() -> None:
    config = NodeConfig()
    config.collectors = {**collectors.defaults(), "gpu": False, "ranks": False}
    config.disks = []
    built = collectors.build(config, collectors.Built())
    try:
        names = [c.name for c in built]
        assert "ranks" not in names and "disk" not in names  # no path to watch: none
        nccl = next(c for c in built if isinstance(c, NcclRasCollector))
        assert nccl.local_ranks() == {}
    finally:
        for collector in built:
            close = getattr(collector, "close", None)
            if close is not None:
                close()
