"""deploy/kubernetes: every manifest parses with its required fields, and the pieces fit.

Without a cluster there is no API server to validate against, so the checks
are the ones that catch real mistakes: selectors that select nothing, ports
and volumes referred to by names that do not exist, security settings, the
job labels the rules select, configs that the components themselves reject.
``kubectl kustomize`` (offline) runs where kubectl exists.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from colossalai_exporter.bridge.config import validate as validate_bridge
from colossalai_exporter.dashboards.configmaps import render
from colossalai_exporter.probe.config import ProbeConfig, apply_file
from colossalai_exporter.probe.targets import parse_target
from colossalai_exporter.version import __version__
from conftest import REPO
from deploy_helpers import DEPLOY, RULE_FILES, load_all_yaml, load_yaml, node_config

K8S = DEPLOY / "kubernetes"
NAMESPACE = "monitoring"
MANIFESTS = sorted(K8S.glob("*.yaml"))
APPLIED = [p for p in MANIFESTS if not p.name.endswith(".example.yaml")
           and p.name != "kustomization.yaml"]
WORKLOADS = ("DaemonSet", "Deployment")
# kind -> what its spec must have
REQUIRED_SPEC = {
    "DaemonSet": ("selector", "template"),
    "Deployment": ("selector", "template", "replicas"),
    "Job": ("template",),
    "Service": ("selector", "ports"),
    "ServiceMonitor": ("selector", "endpoints"),
    "PodMonitor": ("selector", "podMetricsEndpoints"),
    "Probe": ("jobName", "prober", "module", "targets"),
    "PrometheusRule": ("groups",),
    "PersistentVolumeClaim": ("accessModes", "resources"),
}
# The jobs the rules select (the engine selector is empty by default: every job).
RULE_JOBS = {name: match.group(1)
             for name, s in load_yaml(REPO / "rules" / "config.yml")["selectors"].items()
             if (match := re.fullmatch(r'job="([^"]+)"', s))}


def _docs(paths: list[Path] = APPLIED) -> list[dict[str, Any]]:
    return [doc for path in paths for doc in load_all_yaml(path)]


def _by_kind(kind: str, docs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return [d for d in (docs if docs is not None else _docs()) if d["kind"] == kind]


def _one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    containers: list[dict[str, Any]] = workload["spec"]["template"]["spec"]["containers"]
    return containers


def test_every_document_has_its_required_fields() -> None:
    docs = _docs(MANIFESTS)
    assert len(docs) >= 15
    for doc in docs:
        where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        assert doc.get("apiVersion") and doc.get("kind"), where
        if doc["kind"] == "Kustomization":
            continue
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), where
        assert doc["metadata"].get("namespace"), where
        for field in REQUIRED_SPEC.get(doc["kind"], ()):
            assert field in doc["spec"], f"{where}: spec.{field}"
    for doc in _docs():
        assert doc["metadata"]["namespace"] == NAMESPACE
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "colossalai-exporter"


def test_kustomization_applies_every_manifest_but_the_examples() -> None:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    assert kustomization["namespace"] == NAMESPACE
    assert sorted(kustomization["resources"]) == sorted(p.name for p in APPLIED)


@pytest.mark.parametrize("kind", WORKLOADS)
def test_workloads_are_consistent_and_locked_down(kind: str) -> None:
    workloads = _by_kind(kind)
    assert workloads
    for workload in workloads:
        name = workload["metadata"]["name"]
        spec, pod = workload["spec"], workload["spec"]["template"]["spec"]
        assert _matches(spec["selector"]["matchLabels"],
                        workload["spec"]["template"]["metadata"]["labels"]), name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] == 10001, name   # the image's user
        assert pod["automountServiceAccountToken"] is False, name
        volumes = {v["name"] for v in pod["volumes"]}
        for container in _containers(workload):
            where = f"{name}/{container['name']}"
            assert container["image"] == (
                f"ghcr.io/colossalai-exporter/colossalai-exporter:{__version__}"), where
            ports = {p["name"] for p in container["ports"]}
            assert all(len(p) <= 15 for p in ports), where   # IANA_SVC_NAME
            for probe in ("readinessProbe", "livenessProbe"):
                assert container[probe]["httpGet"]["port"] in ports, f"{where} {probe}"
            for mount in container["volumeMounts"]:
                assert mount["name"] in volumes, f"{where}: volume {mount['name']}"
            security = container["securityContext"]
            assert security["runAsNonRoot"] is True, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            resources = container["resources"]
            assert resources["requests"]["cpu"] and resources["requests"]["memory"], where
            assert resources["limits"]["memory"], where
            # a read-only root needs somewhere to write temporary files
            assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"]), where


def test_services_select_workloads_and_name_their_ports() -> None:
    workloads = _by_kind("DaemonSet") + _by_kind("Deployment")
    for service in _by_kind("Service"):
        name = service["metadata"]["name"]
        (workload,) = [w for w in workloads if _matches(
            service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        ports = {p["name"]: p["containerPort"] for c in _containers(workload)
                 for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, name
            assert port["port"] == ports[port["targetPort"]], name


def _job_relabel(endpoint: dict[str, Any]) -> str:
    (job,) = [r["replacement"] for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
    return str(job)


@pytest.mark.parametrize(("monitor", "job"), [
    ("colossalai-node", RULE_JOBS["node"]),
    ("colossalai-bridge", RULE_JOBS["bridge"]),
    ("colossalai-prober", "colossalai-prober"),
])
def test_service_monitors_select_their_service_under_the_rules_job(monitor: str,
                                                                   job: str) -> None:
    service_monitor = _one("ServiceMonitor", monitor)
    (service,) = [s for s in _by_kind("Service") if _matches(
        service_monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in service_monitor["spec"]["endpoints"]:
        assert endpoint["port"] in service_ports
        assert endpoint["path"] == "/metrics"
        assert _job_relabel(endpoint) == job


def test_pod_monitor_selects_the_example_training_pod() -> None:
    pod_monitor = _one("PodMonitor", "colossalai-training")
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    (example,) = load_all_yaml(K8S / "training-pod.example.yaml")
    template = example["spec"]["template"]
    assert _matches(pod_monitor["spec"]["selector"]["matchLabels"],
                    template["metadata"]["labels"])
    ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"]
             for p in c["ports"]}
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert ports[endpoint["port"]] == 8766
    assert _job_relabel(endpoint) == RULE_JOBS["training"]
    # nothing else carries the label: the agent's own pods are not rank servers
    for workload in _by_kind("DaemonSet") + _by_kind("Deployment"):
        assert not _matches(pod_monitor["spec"]["selector"]["matchLabels"],
                            workload["spec"]["template"]["metadata"]["labels"])


def test_node_agent_daemonset() -> None:
    daemonset = _one("DaemonSet", "colossalai-node")
    pod = daemonset["spec"]["template"]["spec"]
    # the ranks collector checks rank pids: it needs the host's PID namespace
    assert pod["hostPID"] is True
    assert pod["runtimeClassName"] == "nvidia"
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    # never takes a GPU from training
    assert not any("nvidia.com" in k for section in container["resources"].values()
                   for k in section)
    args = container["args"]
    assert args[0] == "node"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    watched = [a.split("=", 2)[2] for a in args if a.startswith("--disk")]
    assert watched == ["/host/data/checkpoints", "/host/mnt/nvme"]
    for path in watched:
        # each path sits under a hostPath mount of its parent, writable (a read-only
        # mount would read as not_writable) and seeing host mounts appear later
        (mount,) = [m for p, m in mounts.items() if path.startswith(p + "/")]
        assert not mount.get("readOnly", False), path
        assert mount["mountPropagation"] == "HostToContainer", path
        assert "hostPath" in volumes[mount["name"]], path
    assert "--disk.mount-point=nvme_offload=/host/mnt/nvme" in args
    run_dir = "--ranks.run-dir=/run/colossalai-exporter"
    assert run_dir in args
    run_mount = mounts["/run/colossalai-exporter"]
    assert volumes[run_mount["name"]]["hostPath"]["path"] == "/run/colossalai-exporter"
    assert run_mount["readOnly"] is True   # the agent only reads snapshots
    assert container["ports"] == [{"name": "metrics", "containerPort": 9466}]
    # and the agent's own flag parser accepts the arguments
    config = node_config(args[1:])
    assert [(d.name, d.path, d.mount_point) for d in config.disks] == [
        ("checkpoints", "/host/data/checkpoints", False), ("nvme_offload", "/host/mnt/nvme", True)]
    assert config.ranks_run_dir == "/run/colossalai-exporter"
    assert config.daemon.listen_address == ":9466"
    # probes on the landing page: /health is 503 while a collector reports a problem
    assert container["livenessProbe"]["httpGet"]["path"] == "/"


def test_bridge_deployment_keeps_one_writer_and_its_outbox(tmp_path: Path) -> None:
    deployment = _one("Deployment", "colossalai-bridge")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == 10001
    (container,) = pod["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_map = _one("ConfigMap", volumes["config"]["configMap"]["name"])
    text = config_map["data"]["bridge.yml"]
    data = yaml.safe_load(text)
    # the outbox is on the PersistentVolumeClaim
    assert mounts["state"]["mountPath"] == data["state_dir"]
    claim = volumes["state"]["persistentVolumeClaim"]["claimName"]
    assert _one("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteOnce"]
    # every secret file the config names is a key of the Secret the pod mounts
    secret_dir = mounts["secrets"]["mountPath"]
    (secret,) = load_all_yaml(K8S / "bridge-secret.example.yaml")
    assert secret["metadata"]["name"] == volumes["secrets"]["secret"]["secretName"]
    named = re.findall(re.escape(secret_dir) + r"/([\w.-]+)", text)
    assert named and set(named) <= set(secret["stringData"])
    # and the bridge itself accepts the config, with those files in place
    for key, value in secret["stringData"].items():
        (tmp_path / key).write_text(value + "\n")
    text = text.replace(secret_dir, str(tmp_path)).replace(data["state_dir"],
                                                           str(tmp_path / "state"))
    config_path = tmp_path / "bridge.yml"
    config_path.write_text(text)
    config, problems = validate_bridge(load_yaml(config_path), config_path)
    assert problems == [] and config is not None
    assert container["args"][:2] == ["bridge", "--config.file=" + mounts["config"]["mountPath"]]


def test_probe_uses_the_prober_service_and_its_allow_list(tmp_path: Path) -> None:
    probe = _one("Probe", "colossalai-chat-inference")
    assert probe["spec"]["jobName"] == RULE_JOBS["probe"]
    service = _one("Service", "colossalai-prober")
    (port,) = service["spec"]["ports"]
    assert probe["spec"]["prober"] == {
        "url": f"{service['metadata']['name']}.{NAMESPACE}.svc:{port['port']}",
        "path": "/probe"}
    config_path = tmp_path / "probe.yml"
    config_path.write_text(_one("ConfigMap", "colossalai-prober-config")["data"]["probe.yml"])
    config = ProbeConfig()
    apply_file(config, load_yaml(config_path), config_path)
    assert probe["spec"]["module"] in config.modules
    assert not config.allow.loopback
    for target in probe["spec"]["targets"]["staticConfig"]["static"]:
        assert config.allow.host_allowed(parse_target(target, "http").host), target


def test_prometheus_rule_is_the_rules_bundle() -> None:
    (rule,) = load_all_yaml(K8S / "prometheusrule.yaml")
    groups = {g["name"]: g for path in RULE_FILES for g in load_yaml(path)["groups"]}
    assert {g["name"]: g for g in rule["spec"]["groups"]} == groups
    kubernetes = load_yaml(REPO / "rules" / "config.yml")["kubernetes"]
    assert rule["metadata"]["name"] == kubernetes["name"]
    assert rule["metadata"]["labels"] == kubernetes["labels"]


def _kubectl() -> str | None:
    return shutil.which("kubectl")


def test_kustomize_builds_the_bundle(tmp_path: Path) -> None:
    kubectl = _kubectl()
    if kubectl is None:
        # kubectl is not a prerequisite the CI installs, so this skip is not turned
        # into a failure under CI=true (unlike conftest.require).
        pytest.skip("no kubectl here (optional, not a CI prerequisite)")
    # With one dashboard, so that the generated file is exercised with content too.
    bundle = tmp_path / "kubernetes"
    shutil.copytree(K8S, bundle)
    (bundle / "dashboards.yaml").write_text(
        render({"colossalai-nodes.json": '{"uid": "colossalai-nodes"}'}))
    result = subprocess.run([kubectl, "kustomize", str(bundle)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    built = [d for d in yaml.safe_load_all(result.stdout) if d is not None]
    kinds = sorted(d["kind"] for d in built)
    # The committed dashboards.yaml was replaced by the one-dashboard file above.
    others = [p for p in APPLIED if p.name != "dashboards.yaml"]
    expected = sorted([*(d["kind"] for d in _docs(others)), "ConfigMap"])
    assert kinds == expected
    assert {d["metadata"]["namespace"] for d in built} == {NAMESPACE}
