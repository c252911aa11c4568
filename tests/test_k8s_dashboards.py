"""Dashboard ConfigMaps for the Grafana sidecar: written by ``dashboards`` with the JSON files.

The ConfigMaps are rendered from the same models as the JSON files, so the
tests check that they carry each dashboard unchanged, that a site's override
reaches them, that the committed copy is current, and that what cannot be a
ConfigMap is one line and exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from colossalai_exporter.dashboards import cli as dashboards_cli
from colossalai_exporter.dashboards.configmaps import render
from colossalai_exporter.errors import ConfigError
from conftest import REPO, run_cli

TRAINING = {"uid": "colossalai-training", "title": "ColossalAI training", "schemaVersion": 39,
            "panels": [{"id": 1, "type": "timeseries", "title": "Steps/s — rank",
                        "targets": [{"expr": 'sum by (rank) (rate(x{job="$job"}[5m]))'}]}]}
COMMITTED = REPO / "deploy" / "kubernetes" / "dashboards.yaml"


def _documents(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_committed_configmaps_are_current_and_carry_each_dashboard() -> None:
    result = run_cli("dashboards", "--check")
    assert result.returncode == 0, result.stderr
    documents = _documents(COMMITTED.read_text())
    committed_json = sorted((REPO / "grafana" / "dashboards").glob("*.json"))
    assert [next(iter(d["data"])) for d in documents] == [p.name for p in committed_json]
    for doc, path in zip(documents, committed_json, strict=True):
        assert json.loads(doc["data"][path.name]) == json.loads(path.read_text())


def test_one_sidecar_configmap_per_dashboard() -> None:
    text = render({"colossalai-training.json": json.dumps(TRAINING, ensure_ascii=False),
                   "colossalai-nodes.json": '{\n  "uid": "colossalai-nodes"\n}\n'})
    nodes, training = _documents(text)
    for doc, stem in ((nodes, "colossalai-nodes"), (training, "colossalai-training")):
        assert doc["apiVersion"] == "v1" and doc["kind"] == "ConfigMap"
        assert doc["metadata"]["name"] == f"grafana-dashboard-{stem}"
        assert doc["metadata"]["namespace"] == "monitoring"
        assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"   # a string, not 1
        assert list(doc["data"]) == [f"{stem}.json"]
    # the JSON model is carried unchanged (unicode included), readable as a block
    assert json.loads(training["data"]["colossalai-training.json"]) == TRAINING
    assert "Steps/s — rank" in text
    assert "colossalai-nodes.json: |" in text


def test_no_dashboards_means_no_configmaps() -> None:
    assert _documents(render({})) == []


@pytest.mark.parametrize(("files", "message"), [
    ({"a_b.json": "{}", "a-b.json": "{}"}, "both become ConfigMap 'grafana-dashboard-a-b'"),
    ({"big.json": json.dumps({"x": "y" * (1 << 20)})}, "is over a ConfigMap's 1 MiB"),
    ({"Ünï.json": "{}"}, "is not a Kubernetes name"),
])
def test_what_cannot_be_a_configmap_is_refused(files: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        render(files)


def test_a_sites_override_reaches_the_configmaps(tmp_path: Path) -> None:
    override = tmp_path / "site.yml"
    override.write_text("selectors:\n  training: 'job=\"site-training\"'\n")
    out, maps = tmp_path / "dash", tmp_path / "maps.yaml"
    result = run_cli("dashboards", "--override", str(override), "--output-dir", str(out),
                     "--configmaps", str(maps), "--namespace", "grafana", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    documents = _documents(maps.read_text())
    assert {d["metadata"]["namespace"] for d in documents} == {"grafana"}
    for doc in documents:
        (name, body), = doc["data"].items()
        assert body == (out / name).read_text()
    training = next(d for d in documents if "colossalai-training.json" in d["data"])
    assert 'site-training' in training["data"]["colossalai-training.json"]
    # a different output folder leaves the repository's committed ConfigMaps alone
    assert run_cli("dashboards", "--check").returncode == 0


def test_another_output_dir_writes_no_configmaps_unless_asked(tmp_path: Path) -> None:
    files = dashboards_cli.generate(output_dir=tmp_path)
    assert all(path.suffix == ".json" for path in files)
    result = run_cli("dashboards", "--output-dir", str(tmp_path / "d"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "dashboards.yaml" not in result.stdout
