"""deploy/systemd: the units' hardening and wiring, and systemd's own checks where present.

``systemd-analyze verify`` and ``security --offline`` run where systemd-analyze
is installed (it is not a prerequisite the CI installs, so their skip is not a
failure under CI=true); the rest reads the files.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from colossalai_exporter.flags import ArgumentParser, add_common_flags
from colossalai_exporter.node.config import NodeConfig, add_node_flags, load_config
from deploy_helpers import DEPLOY, load_yaml

SYSTEMD = DEPLOY / "systemd"
NODE = SYSTEMD / "colossalai-exporter-node.service"
BRIDGE = SYSTEMD / "colossalai-exporter-bridge.service"
BINARY = "/opt/colossalai-exporter/bin/colossalai-exporter"

Unit = dict[str, list[tuple[str, str]]]


def parse_unit(text: str) -> Unit:
    """Sections -> (key, value) in order; keys repeat in systemd, so no dict of keys."""
    unit: Unit = {}
    section = None
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            unit.setdefault(section, [])
            continue
        assert section is not None, f"{line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {line!r}"
        unit[section].append((key.strip(), value.strip()))
    return unit


def values(unit: Unit, key: str, section: str = "Service") -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def value(unit: Unit, key: str, section: str = "Service") -> str:
    found = values(unit, key, section)
    assert found, f"{key}= missing in [{section}]"
    return found[-1]  # the last assignment wins, as in systemd


def parse_env(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, val = line.partition("=")
            env[key.strip()] = val.strip()
    return env


@pytest.mark.parametrize(("path", "command"), [(NODE, "node"), (BRIDGE, "bridge")])
def test_common_hardening_and_wiring(path: Path, command: str) -> None:
    unit = parse_unit(path.read_text())
    assert set(unit) == {"Unit", "Service", "Install"}
    assert value(unit, "Description", "Unit")
    assert value(unit, "Documentation", "Unit").startswith("https://")
    assert "network-online.target" in value(unit, "After", "Unit")
    assert value(unit, "WantedBy", "Install") == "multi-user.target"
    name = path.name.removesuffix(".service")
    assert value(unit, "EnvironmentFile") == f"-/etc/default/{name}"
    (exec_start,) = values(unit, "ExecStart")
    assert shlex.split(exec_start)[:2] == [BINARY, command]
    assert value(unit, "Restart") == "on-failure"
    # exit 2 is a bad flag or config: restarting would loop on it
    assert value(unit, "RestartPreventExitStatus") == "2"
    expected = {
        "DynamicUser": "yes", "NoNewPrivileges": "yes", "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6", "RestrictNamespaces": "yes",
        "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes", "LockPersonality": "yes", "RestrictSUIDSGID": "yes",
        "SystemCallArchitectures": "native", "UMask": "0077",
    }
    assert {k: value(unit, k) for k in expected} == expected
    assert values(unit, "SystemCallFilter")[0] == "@system-service"
    # No capability but the node agent's CAP_SYSLOG, for the kernel log that names
    # OOM-killed pids (docs/node.md); the bridge has none.
    caps = "CAP_SYSLOG" if command == "node" else ""
    assert value(unit, "CapabilityBoundingSet") == value(unit, "AmbientCapabilities") == caps
    assert value(unit, "ProtectHome") in ("yes", "read-only")
    # every variable the command line uses has a default in the unit
    defaults = {v.partition("=")[0] for v in values(unit, "Environment")}
    for line in values(unit, "ExecStart") + values(unit, "ExecStartPre"):
        assert set(re.findall(r"\$\{?(\w+)", line)) <= defaults, line


def test_node_agent_sees_pids_shm_gpus_and_true_mount_flags() -> None:
    unit = parse_unit(NODE.read_text())
    # the Xid history outlives reboots in the unit's own state directory
    assert value(unit, "StateDirectory") == "colossalai-exporter/node"
    (exec_start,) = values(unit, "ExecStart")
    assert "--state.dir=/var/lib/colossalai-exporter/node" in shlex.split(exec_start)
    # the ranks collector checks other users' pids and the host collector reads
    # /proc/meminfo: /proc must stay whole
    assert not values(unit, "ProtectProc") and not values(unit, "ProcSubset")
    # the ranks' snapshots are in the host's /dev/shm; NVML opens /dev/nvidia*
    assert value(unit, "PrivateDevices") == "no"
    assert value(unit, "DevicePolicy") == "closed"
    assert values(unit, "DeviceAllow") == ["char-nvidia* rw", "/dev/kmsg r"]
    assert value(unit, "ProtectKernelLogs") == "no"  # the kernel log names OOM-killed pids
    assert not values(unit, "MemoryDenyWriteExecute")
    # watched paths are writable (for the mount flags the agent reports), "-": optional
    env = parse_env(SYSTEMD / "colossalai-exporter-node.env")
    writable = value(unit, "ReadWritePaths").split()
    for disk in shipped_node_config(env).disks:
        assert f"-{disk.path}" in writable, disk
    assert env["COLOSSALAI_EXPORTER_RUN_DIR"] == "/dev/shm/colossalai-exporter"


def shipped_node_config(env: dict[str, str]) -> NodeConfig:
    """What the unit's agent runs with: the env file's flags, its --config.file read from
    the shipped example that deploy.md installs there."""
    parser = ArgumentParser(prog="node")
    add_common_flags(parser, 9466)
    add_node_flags(parser)
    flags = env["NODE_AGENT_ARGS"].split()
    assert flags == ["--config.file=/etc/colossalai-exporter/node.yml"], flags
    example = DEPLOY / "node" / "node.example.yml"
    return load_config(parser.parse_args([f"--config.file={example}"]), env=env)


def test_node_env_file_and_config_are_what_the_agent_and_the_health_check_read() -> None:
    """The unit's agent and the Slurm health check read one file: the env file names it,
    and healthcheck.sh's default is the same path (a helper following deploy.md found
    the check reading a file the docs never had one write, and never checking the GPU
    count or the NVMe mount the agent did)."""
    env = parse_env(SYSTEMD / "colossalai-exporter-node.env")
    config = shipped_node_config(env)
    assert config.daemon.listen_address == ":9466"
    assert config.gpu_expected == 8
    assert {d.name: (d.path, d.mount_point) for d in config.disks} == {
        "checkpoints": ("/checkpoints", False), "nvme_offload": ("/nvme", True)}
    healthcheck = (DEPLOY / "slurm" / "healthcheck.sh").read_text()
    assert "${COLOSSALAI_NODE_CONFIG:-/etc/colossalai-exporter/node.yml}" in healthcheck


def test_bridge_keeps_its_outbox_in_the_state_directory() -> None:
    unit = parse_unit(BRIDGE.read_text())
    assert value(unit, "StateDirectory") == "colossalai-exporter/bridge"
    assert value(unit, "StateDirectoryMode") == "0700"
    # the example config's state_dir is exactly that directory
    example = load_yaml(DEPLOY / "bridge" / "bridge.example.yml")
    assert example["state_dir"] == "/var/lib/colossalai-exporter/bridge"
    # secrets: root-only files handed over as credentials, never readable by path
    credentials = dict(c.split(":", 1) for c in values(unit, "LoadCredential"))
    assert credentials["bridge-token"] == "/etc/colossalai-exporter/bridge-token"
    (check,) = values(unit, "ExecStartPre")
    assert shlex.split(check)[:3] == [BINARY, "bridge", "check"]
    assert value(unit, "MemoryDenyWriteExecute") == "yes"
    assert value(unit, "PrivateDevices") == "yes"
    env = parse_env(SYSTEMD / "colossalai-exporter-bridge.env")
    assert env["BRIDGE_CONFIG"] == "/etc/colossalai-exporter/bridge.yml"
    assert env["BRIDGE_ARGS"] == "--web.listen-address=:9468"


def test_tmpfiles_creates_the_kubernetes_run_dir() -> None:
    lines = [line.split() for line in
             (SYSTEMD / "colossalai-exporter.tmpfiles.conf").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines == [["d", "/run/colossalai-exporter", "1777", "root", "root", "-"]]
    daemonset = (DEPLOY / "kubernetes" / "node-agent.yaml").read_text()
    assert "path: /run/colossalai-exporter" in daemonset


def _analyze() -> str:
    binary = shutil.which("systemd-analyze")
    if binary is None:
        # systemd-analyze is not a prerequisite the CI installs, so this skip is not
        # turned into a failure under CI=true (unlike conftest.require).
        pytest.skip("no systemd-analyze here (optional, not a CI prerequisite)")
    return binary


def _installed(tmp_path: Path, path: Path) -> Path:
    """The unit with ExecStart pointing at an executable that exists here."""
    executable = tmp_path / "colossalai-exporter"
    executable.write_text("#!/bin/sh\n")
    executable.chmod(0o755)
    unit = tmp_path / path.name
    unit.write_text(path.read_text().replace(BINARY, str(executable)))
    return unit


@pytest.mark.parametrize("path", [NODE, BRIDGE], ids=["node", "bridge"])
def test_systemd_analyze_verify_has_nothing_to_say(tmp_path: Path, path: Path) -> None:
    binary = _analyze()
    result = subprocess.run([binary, "verify", "--man=no", str(_installed(tmp_path, path))],
                            capture_output=True, text=True, timeout=60, check=False)
    # unknown keys and bad values are warnings with exit 0: any output is a finding
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), \
        result.stdout + result.stderr


def test_systemd_analyze_verify_would_catch_a_typo(tmp_path: Path) -> None:
    binary = _analyze()
    unit = _installed(tmp_path, NODE)
    unit.write_text(unit.read_text().replace("ProtectSystem=", "ProtectSytem="))
    result = subprocess.run([binary, "verify", "--man=no", str(unit)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert "Unknown key 'ProtectSytem'" in result.stderr


@pytest.mark.parametrize(("path", "limit"), [(NODE, 2.5), (BRIDGE, 1.5)],
                         ids=["node", "bridge"])
def test_systemd_security_exposure_is_low(tmp_path: Path, path: Path, limit: float) -> None:
    binary = _analyze()
    result = subprocess.run([binary, "security", "--offline=yes", "--no-pager",
                             str(_installed(tmp_path, path))],
                            capture_output=True, text=True, timeout=60, check=False)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    if match is None and "--offline" in result.stderr:
        pytest.skip("this systemd-analyze has no offline security analysis (systemd < 250)")
    assert match, result.stdout + result.stderr
    # 0 (locked down) … 10 (exposed); the node agent keeps /proc, /dev/shm and NVML open
    assert float(match.group(1)) <= limit, result.stdout
