"""A node on defaults is quiet: no GPUs and no default paths are not failures.

Issue "a node on defaults is quiet": on a CPU-only node the gpu collector was
down (``no_driver``) and GPUCollectorDown paged; on a node without
``/checkpoints`` or ``/nvme`` the agent watched them anyway, ``/health`` was
503 and DiskPathBroken paged, for paths nobody configured. What must still
page does: a GPU node whose driver is gone, and a path the user named.

The agent runs as a real process where this machine is the node under test
(no driver, no GPU device nodes, neither default path); where a test needs a
node this machine is not (a GPU node, a default path that appears later), it
runs the agent in this process with a fake ``/dev`` and paths under its
temporary folder, served over real HTTP.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from colossalai_exporter.flags import ArgumentParser, add_common_flags
from colossalai_exporter.node.agent import Agent, build_app
from colossalai_exporter.node.base import NodeCollector
from colossalai_exporter.node.config import NodeConfig, add_node_flags, load_config
from colossalai_exporter.node.disk import DiskCollector, WatchedPath
from colossalai_exporter.node.gpu import GpuCollector
from colossalai_exporter.node.host import HostCollector
from colossalai_exporter.web import serve
from conftest import ServerProcess, cli_env, http_get, require, wait_until
from gpu_helpers import Scenario, fake_dev, gpu, use_fake_nvml, without_fake_nvml
from test_node_agent import scrape, value

DEFAULT_PATHS = ("/checkpoints", "/nvme")
Start = Callable[..., ServerProcess]  # the server_process fixture
NO_DRIVER = {"nvmlInit": 9}  # DRIVER_NOT_LOADED, as on a machine without the kernel module


# -- where this machine is the node under test: a real agent process ---------------

def _nvml_library_loads() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def _gpu_device_nodes() -> list[str]:
    return [name for name in os.listdir("/dev") if re.match(r"nvidia[0-9]", name)]


def _require_a_gpu_less_node() -> None:
    require(not _nvml_library_loads() and not _gpu_device_nodes(),
            "a machine without an NVIDIA driver or GPU device nodes")


def _require_no_default_paths() -> None:
    require(not any(os.path.lexists(path) for path in DEFAULT_PATHS),
            "a machine without /checkpoints and /nvme")


def _defaults_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The agent's environment on defaults: the real pynvml, no path named, and the
    ranks' run directory of this test's own (nothing else's ranks in it)."""
    env = without_fake_nvml(cli_env())
    for name in ("CHECKPOINT_DIR", "NVME_PATH"):
        env.pop(name, None)
    env["COLOSSALAI_EXPORTER_RUN_DIR"] = str(tmp_path)
    env.update(extra)
    return env


def _sample_names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def _health(url: str) -> tuple[int, list[tuple[str, str]]]:
    status, _, body = http_get(url + "/health")
    problems = json.loads(body)["problems"]
    return status, [(p["collector"], p["reason"]) for p in problems]


def test_a_gpu_less_node_on_defaults_is_quiet(server_process: Start, tmp_path: Path) -> None:
    _require_a_gpu_less_node()
    _require_no_default_paths()
    agent = server_process("node", env=_defaults_env(tmp_path))
    text = scrape(agent.url)
    assert value(text, "colossalai_exporter_collector_up", collector="gpu") == 1
    assert value(text, "colossalai_gpu_devices") == 0
    names = _sample_names(text)
    assert not {n for n in names if n.startswith("colossalai_gpu_")} - {"colossalai_gpu_devices"}
    assert value(text, "colossalai_exporter_collector_failure_info",
                 collector="gpu", reason="no_driver") is None
    # The default paths are not there: not watched, no series, and no failure.
    assert value(text, "colossalai_exporter_collector_up", collector="disk") == 1
    assert not {n for n in names if n.startswith("colossalai_disk_")}, names
    assert _health(agent.url) == (200, [])
    # The start-up report says the gpu collector is ready, not down.
    wait_until(lambda: 'msg="collector ready" collector=gpu' in agent.output(), 10,
               what="the start-up report on the gpu collector")
    assert "collector gpu is down" not in agent.output()


def test_a_path_named_by_the_environment_that_is_missing_still_pages(
        server_process: Start, tmp_path: Path) -> None:
    _require_a_gpu_less_node()
    _require_no_default_paths()
    missing = tmp_path / "nonexistent"
    agent = server_process("node", env=_defaults_env(tmp_path, CHECKPOINT_DIR=str(missing)))
    text = scrape(agent.url)
    assert value(text, "colossalai_disk_path_ok", name="checkpoints", path=str(missing)) == 0
    assert value(text, "colossalai_disk_path_failure_info", name="checkpoints",
                 path=str(missing), reason="missing") == 1
    # NVME_PATH is unset: /nvme is the built-in default, absent here, so not watched.
    assert value(text, "colossalai_disk_path_ok", name="nvme_offload", path="/nvme") is None
    assert _health(agent.url) == (503, [("disk", "missing")])


def test_no_driver_with_gpus_expected_still_pages(server_process: Start, tmp_path: Path) -> None:
    _require_a_gpu_less_node()
    agent = server_process("node", "--gpu.expected", "2", "--disk", f"ckpt={tmp_path}",
                           env=_defaults_env(tmp_path))
    text = scrape(agent.url)
    assert value(text, "colossalai_exporter_collector_up", collector="gpu") == 0
    assert value(text, "colossalai_exporter_collector_failure_info",
                 collector="gpu", reason="no_driver") == 1
    assert value(text, "colossalai_gpu_devices") is None
    assert _health(agent.url) == (503, [("gpu", "no_driver")])


# -- nodes this machine is not: the agent in this process, over real HTTP ---------

@contextmanager
def served(collectors: Sequence[NodeCollector]) -> Iterator[str]:
    """The agent with ``collectors`` on a free loopback port; yields its base URL."""
    agent = Agent(collectors, scrape_timeout=8.0)
    handle = serve(build_app(agent), "127.0.0.1:0", name="node")
    try:
        yield handle.url
    finally:
        handle.stop(5)
        agent.close()


@pytest.fixture
def no_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Scenario:
    """NVML workers started from now on find no NVIDIA driver."""
    scenario = Scenario(tmp_path / "nvml.json").write(gpus=[gpu(0)], errors=NO_DRIVER)
    use_fake_nvml(monkeypatch, scenario.path)
    return scenario


def test_no_driver_and_no_gpu_device_node_is_zero_gpus_and_healthy(
        no_driver: Scenario, tmp_path: Path) -> None:
    dev = fake_dev(tmp_path / "dev", "null", "nvidiactl", "nvme0n1")
    with served([GpuCollector(timeout=2.0, dev_root=dev), HostCollector()]) as url:
        text = scrape(url)
        assert value(text, "colossalai_exporter_collector_up", collector="gpu") == 1
        assert value(text, "colossalai_gpu_devices") == 0
        assert value(text, "colossalai_gpu_memory_total_bytes", gpu="0") is None
        assert value(text, "colossalai_exporter_collector_failure_info",
                     collector="gpu", reason="no_driver") is None
        assert _health(url) == (200, [])


def test_no_driver_with_a_gpu_device_node_is_down_and_degraded(
        no_driver: Scenario, tmp_path: Path) -> None:
    dev = fake_dev(tmp_path / "dev", "null", "nvidia0", "nvidiactl")
    with served([GpuCollector(timeout=2.0, dev_root=dev), HostCollector()]) as url:
        text = scrape(url)
        assert value(text, "colossalai_exporter_collector_up", collector="gpu") == 0
        assert value(text, "colossalai_exporter_collector_failure_info",
                     collector="gpu", reason="no_driver") == 1
        assert value(text, "colossalai_gpu_devices") is None
        assert _health(url) == (503, [("gpu", "no_driver")])


def test_a_default_path_is_watched_once_it_exists(tmp_path: Path) -> None:
    checkpoints, nvme = tmp_path / "checkpoints", tmp_path / "nvme"
    paths = [WatchedPath("checkpoints", str(checkpoints), default=True),
             WatchedPath("nvme_offload", str(nvme), default=True)]
    with served([DiskCollector(paths), HostCollector()]) as url:
        text = scrape(url)
        assert value(text, "colossalai_exporter_collector_up", collector="disk") == 1
        assert not {n for n in _sample_names(text) if n.startswith("colossalai_disk_")}
        assert _health(url) == (200, [])

        checkpoints.mkdir()  # the mount came up after the agent started
        text = scrape(url)
        assert value(text, "colossalai_disk_path_ok", name="checkpoints",
                     path=str(checkpoints)) == 1
        free = value(text, "colossalai_disk_free_bytes", name="checkpoints",
                     path=str(checkpoints))
        assert free is not None and free > 0
        assert value(text, "colossalai_disk_path_ok", name="nvme_offload", path=str(nvme)) is None
        assert _health(url) == (200, [])

        # Once there, it is watched like any other path: what is wrong with it pages.
        nvme.write_text("not a folder")
        text = scrape(url)
        assert value(text, "colossalai_disk_path_ok", name="nvme_offload", path=str(nvme)) == 0
        assert value(text, "colossalai_disk_path_failure_info", name="nvme_offload",
                     path=str(nvme), reason="not_directory") == 1
        assert _health(url) == (503, [("disk", "not_directory")])


# -- which paths are the built-in defaults ------------------------------------------

def _config(args: list[str], env: dict[str, str]) -> NodeConfig:
    parser = ArgumentParser(prog="node")
    add_common_flags(parser, 9466)
    add_node_flags(parser)
    return load_config(parser.parse_args(args), env=env)


def _disks(config: NodeConfig) -> list[tuple[str, str, bool]]:
    return [(d.name, d.path, d.default) for d in config.disks]


@pytest.mark.parametrize(("args", "env", "disks"), [
    ([], {}, [("checkpoints", "/checkpoints", True), ("nvme_offload", "/nvme", True)]),
    # An empty variable names nothing, as before.
    ([], {"CHECKPOINT_DIR": "", "NVME_PATH": ""},
     [("checkpoints", "/checkpoints", True), ("nvme_offload", "/nvme", True)]),
    ([], {"CHECKPOINT_DIR": "/data/ckpt"},
     [("checkpoints", "/data/ckpt", False), ("nvme_offload", "/nvme", True)]),
    ([], {"CHECKPOINT_DIR": "/data/ckpt", "NVME_PATH": "/mnt/nvme"},
     [("checkpoints", "/data/ckpt", False), ("nvme_offload", "/mnt/nvme", False)]),
    (["--disk", "checkpoints=/checkpoints"], {"NVME_PATH": "/mnt/nvme"},
     [("checkpoints", "/checkpoints", False)]),
    (["--disk.mount-point", "nvme_offload=/nvme"], {},
     [("nvme_offload", "/nvme", False)]),
])
def test_only_the_built_in_paths_are_defaults(args: list[str], env: dict[str, str],
                                              disks: list[tuple[str, str, bool]]) -> None:
    assert _disks(_config(args, env)) == disks


def test_paths_from_the_config_file_are_named(tmp_path: Path) -> None:
    path = tmp_path / "node.yml"
    path.write_text("disks:\n  - {name: checkpoints, path: /checkpoints}\n")
    assert _disks(_config(["--config.file", str(path)], {})) == [
        ("checkpoints", "/checkpoints", False)]
