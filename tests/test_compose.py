"""deploy/compose: the stack's files resolve, and its configs pass the real checkers.

``docker compose config`` runs only where the compose plugin exists (Docker
is not a prerequisite of this project's CI); the rest rebuilds what each
container would see from the compose file's mounts and checks that.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from colossalai_exporter.bridge.config import validate as validate_bridge
from colossalai_exporter.demo.cli import parser as demo_parser
from colossalai_exporter.probe.config import ProbeConfig, apply_file
from colossalai_exporter.probe.targets import parse_target
from conftest import REPO
from deploy_helpers import (
    DEPLOY,
    amtool_check_config,
    load_yaml,
    node_config,
    parse_dockerfile,
    promtool_check_config,
)

COMPOSE_DIR = DEPLOY / "compose"
COMPOSE = COMPOSE_DIR / "docker-compose.yml"
GPU_OVERRIDE = COMPOSE_DIR / "docker-compose.gpu.yml"
GRAFANA = REPO / "grafana"

# service -> the port it listens on inside the network (the project's defaults)
PORTS = {"prometheus": 9090, "alertmanager": 9093, "grafana": 3000, "colossalai-node": 9466,
         "training-demo": 8766, "colossalai-prober": 9467, "colossalai-bridge": 9468}
_DEFAULT = re.compile(r"\$\{(\w+):-([^}]*)\}")


def _services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = load_yaml(COMPOSE)["services"]
    return services


def _env(service: str) -> dict[str, str]:
    """The service's environment with compose's ``${NAME:-default}`` defaults filled in."""
    environment = _services()[service].get("environment", {})
    return {k: _DEFAULT.sub(lambda m: m.group(2), str(v)) for k, v in environment.items()}


def _binds(service: str) -> list[tuple[Path, str]]:
    """(host path, container path) of the service's bind mounts (named volumes left out)."""
    binds = []
    for volume in _services()[service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            binds.append(((COMPOSE_DIR / source).resolve(), target))
    return binds


def _container_fs(service: str, root: Path) -> Path:
    """Copy each bind mount's host path to where the container sees it, under ``root``."""
    for host, target in _binds(service):
        dest = root / target.lstrip("/")
        if host.is_dir():
            shutil.copytree(host, dest)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(host, dest)
    secrets = load_yaml(COMPOSE)["secrets"]
    for name in _services()[service].get("secrets", []):
        dest = root / "run" / "secrets" / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(COMPOSE_DIR / secrets[name]["file"], dest)
    return root


def test_services_and_images() -> None:
    services = _services()
    assert set(services) == {*PORTS, "heartbeat-sink"}
    stages = {s.name for s in parse_dockerfile((REPO / "Dockerfile").read_text())}
    for name, service in services.items():
        assert service.get("image"), f"{name} has no image"
        if "build" in service:
            assert (COMPOSE_DIR / service["build"]["context"]).resolve() == REPO, name
            assert service["build"]["target"] in stages, name
        else:
            # third-party images are pinned, never :latest
            assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", service["image"]), name
    assert services["training-demo"]["build"]["target"] == "demo"
    command = services["training-demo"]["command"]
    assert command[0] == "demo"
    args = demo_parser().parse_args(command[1:])  # the demo's own flags accept them
    assert (str(args.run_dir), str(args.checkpoint_dir)) == ("/run/colossalai-exporter",
                                                             "/checkpoints")
    assert args.host == "0.0.0.0" and args.port == 8766 and args.agent_port == 0
    assert services["colossalai-node"]["command"][0] == "node"
    assert services["colossalai-bridge"]["command"][0] == "bridge"
    assert services["colossalai-prober"]["command"][0] == "probe"


def test_every_mounted_repository_path_exists() -> None:
    missing = [(name, str(host)) for name in _services() for host, _ in _binds(name)
               if not host.exists() and not host.is_relative_to(GRAFANA)]
    assert not missing
    for secret in load_yaml(COMPOSE)["secrets"].values():
        assert (COMPOSE_DIR / secret["file"]).is_file()


def test_grafana_mounts_the_provisioning_and_dashboards() -> None:
    binds = {str(host.relative_to(REPO)): target for host, target in _binds("grafana")}
    assert binds == {"grafana/provisioning": "/etc/grafana/provisioning",
                     "grafana/dashboards": "/var/lib/grafana/dashboards/colossalai"}
    for host, _ in _binds("grafana"):
        assert host.is_dir(), host


def test_grafana_provisioning_agrees_with_the_compose_stack() -> None:
    """Once grafana/provisioning exists: the provider reads the mounted dashboards and the
    datasource is this stack's Prometheus."""
    provisioning = GRAFANA / "provisioning"
    providers = [p for f in sorted(provisioning.glob("dashboards/*.y*ml"))
                 for p in (load_yaml(f) or {}).get("providers", [])]
    datasources = [d for f in sorted(provisioning.glob("datasources/*.y*ml"))
                   for d in (load_yaml(f) or {}).get("datasources", [])]
    assert providers and datasources
    mounted = {target for _, target in _binds("grafana")}
    for provider in providers:
        assert provider["options"]["path"] in mounted, provider
    for source in datasources:
        if source.get("type") == "prometheus":
            url = urlsplit(source["url"])
            assert (url.hostname, url.port) == ("prometheus", 9090), source


def test_ports_are_published_on_loopback_only() -> None:
    for name, service in _services().items():
        ports = service.get("ports", [])
        if name == "heartbeat-sink":
            assert not ports
            continue
        assert ports == [f"127.0.0.1:{PORTS[name]}:{PORTS[name]}"], name


def test_prometheus_config_as_the_container_sees_it(tmp_path: Path) -> None:
    root = _container_fs("prometheus", tmp_path)
    config = root / "etc" / "prometheus" / "prometheus.yml"
    assert config.read_text() == (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    result = promtool_check_config(config)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "rule files found" in output
    # only the *.json patterns (Slurm's) and the chat-app job (the stack runs no chat
    # server with the FastAPI helper) find nothing in the stack
    warnings = [line for line in output.splitlines() if "WARNING" in line]
    assert len(warnings) == 5, output
    assert all("*.json" in w or "colossalai-chat-app/" in w for w in warnings), output


def test_prometheus_targets_are_services_of_the_stack() -> None:
    services = _services()
    addresses = []
    for path in (COMPOSE_DIR / "targets").glob("*/*.yml"):
        for group in load_yaml(path):
            addresses += group["targets"]
    static = [t for job in load_yaml(DEPLOY / "prometheus" / "prometheus.yml")["scrape_configs"]
              for c in job.get("static_configs", []) for t in c["targets"]]
    for address in addresses + static:
        host, port = urlsplit(address if "//" in address else f"//{address}").netloc.split(":")
        if host == "localhost":
            continue  # Prometheus itself
        assert host in services, address
        assert int(port) == PORTS[host], address


def test_alertmanager_config_sends_everything_to_the_bridge(tmp_path: Path) -> None:
    root = _container_fs("alertmanager", tmp_path)
    config = root / "etc" / "alertmanager" / "alertmanager.yml"
    result = amtool_check_config(config)
    assert result.returncode == 0, result.stdout + result.stderr
    data = load_yaml(config)
    for receiver in data["receivers"]:
        if receiver["name"] == "record-only":
            assert set(receiver) == {"name"}  # nothing behind it
            continue
        (hook,) = receiver["webhook_configs"]
        url = urlsplit(hook["url"])
        assert (url.hostname, url.port, url.path) == ("colossalai-bridge", 9468, "/alertmanager")
        assert hook["http_config"]["authorization"]["credentials_file"] == \
            "/run/secrets/bridge-token"
        assert "slack_configs" not in receiver
    assert "bridge-token" in _services()["alertmanager"]["secrets"]


def test_alertmanager_config_is_the_shipped_one_without_slack() -> None:
    """Routing, timings and inhibitions as deploy/alertmanager/alertmanager.yml: the
    compose copy had drifted (no cause inhibitions, the old Watchdog cadence)."""
    shipped = load_yaml(REPO / "deploy" / "alertmanager" / "alertmanager.yml")
    shipped.pop("templates")
    shipped["route"]["routes"] = [route for route in shipped["route"]["routes"]
                                  if not route.get("receiver", "").startswith("slack-")]
    shipped["receivers"] = [r for r in shipped["receivers"] if not r["name"].startswith("slack-")]
    for receiver in shipped["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["http_config"]["authorization"]["credentials_file"] = "/run/secrets/bridge-token"
    assert load_yaml(REPO / "deploy" / "compose" / "alertmanager.yml") == shipped


def test_bridge_config_is_valid_with_the_stacks_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _container_fs("colossalai-bridge", tmp_path)
    text = (root / "etc" / "colossalai-exporter" / "bridge.yml").read_text()
    data = load_yaml(root / "etc" / "colossalai-exporter" / "bridge.yml")
    # The outbox is on the bridge-state volume, not the read-only root filesystem.
    volumes = dict(v.split(":")[::-1][:2] for v in _services()["colossalai-bridge"]["volumes"])
    assert volumes[data["state_dir"]] == "bridge-state"
    # Check it where the secret and the state directory exist.
    text = text.replace("/run/secrets/", f"{root}/run/secrets/")
    text = text.replace(data["state_dir"], str(tmp_path / "state"))
    config_path = tmp_path / "bridge.yml"
    config_path.write_text(text)
    for name, value in _env("colossalai-bridge").items():
        monkeypatch.setenv(name, value)
    config, problems = validate_bridge(load_yaml(config_path), config_path)
    assert problems == []
    assert config is not None
    assert config.bearer_token == (COMPOSE_DIR / "secrets" / "bridge-token").read_text().strip()
    assert {t.endpoint.url for t in config.targets} == {
        "http://heartbeat-sink:8000/?check=watchdog", "http://heartbeat-sink:8000/?check=training"}


def test_prober_config_admits_the_stacks_chat_target(tmp_path: Path) -> None:
    root = _container_fs("colossalai-prober", tmp_path)
    path = root / "etc" / "colossalai-exporter" / "probe.yml"
    config = ProbeConfig()
    apply_file(config, load_yaml(path), path)
    for group in load_yaml(COMPOSE_DIR / "targets" / "colossalai-chat" / "compose.yml"):
        assert group["labels"]["__param_module"] in config.modules
        for target in group["targets"]:
            assert config.allow.host_allowed(parse_target(target, "http").host), target


def test_demo_and_agent_share_pids_run_dir_and_checkpoints() -> None:
    services = _services()
    demo, node = services["training-demo"], services["colossalai-node"]
    assert demo["pid"] == "service:colossalai-node"
    assert _env("training-demo")["COLOSSALAI_EXPORTER_RUN_DIR"] == "/run/colossalai-exporter"
    assert "--ranks.run-dir=/run/colossalai-exporter" in node["command"]
    assert "--disk=checkpoints=/checkpoints" in node["command"]
    for volume in ("run-dir:/run/colossalai-exporter", "checkpoints:/checkpoints"):
        assert volume in demo["volumes"] and volume in node["volumes"]
    # read-write: a read-only mount would be reported as not_writable
    assert not any(v.endswith(":ro") for v in node["volumes"])
    config = node_config(node["command"][1:])
    assert [(d.name, d.path) for d in config.disks] == [("checkpoints", "/checkpoints")]
    assert not config.collectors["gpu"] and not config.collectors["rendezvous"]


def test_project_containers_have_a_read_only_root() -> None:
    for name, service in _services().items():
        if service.get("image", "").startswith("colossalai-exporter:"):
            assert service.get("read_only") is True, name
            assert "/tmp" in service.get("tmpfs", []), name


def test_gpu_override_turns_the_gpu_collector_on() -> None:
    override = load_yaml(GPU_OVERRIDE)["services"]["colossalai-node"]
    assert "--no-collector.gpu" not in override["command"]
    assert set(override["command"]) == set(_services()["colossalai-node"]["command"]) - {
        "--no-collector.gpu"}
    (device,) = override["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"


def _compose() -> list[str] | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    version = subprocess.run([docker, "compose", "version"], capture_output=True, text=True,
                             timeout=30, check=False)
    return [docker, "compose"] if version.returncode == 0 else None


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, GPU_OVERRIDE]], ids=["base", "gpu"])
def test_docker_compose_config(files: list[Path]) -> None:
    compose = _compose()
    if compose is None:
        # Docker is not a prerequisite the CI installs, so this skip is not turned
        # into a failure under CI=true (unlike conftest.require).
        pytest.skip("no `docker compose` plugin here (docker is optional, not a CI "
                    "prerequisite)")
    args = [a for f in files for a in ("-f", str(f))]
    result = subprocess.run([*compose, *args, "config", "--quiet"], capture_output=True,
                            text=True, timeout=60, check=False, cwd=COMPOSE_DIR)
    assert result.returncode == 0, result.stderr
