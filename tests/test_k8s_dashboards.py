"""Dashboard ConfigMaps for the Grafana sidecar: generated from grafana/dashboards, kept current.

The generator is tested on dashboards of its own in tmp_path, so these tests
do not depend on which dashboards the repository holds; the committed file is
checked against whatever ``grafana/dashboards/*.json`` exist (none at all is a
valid state: no ConfigMaps).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from colossalai_exporter.k8s_dashboards import DEFAULT_DASHBOARDS, DEFAULT_OUTPUT, render
from conftest import cli_env

TRAINING = {"uid": "colossalai-training", "title": "ColossalAI training", "schemaVersion": 39,
            "panels": [{"id": 1, "type": "timeseries", "title": "Steps/s — rank",
                        "targets": [{"expr": 'sum by (rank) (rate(x{job="$job"}[5m]))'}]}]}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "colossalai_exporter.k8s_dashboards", *args],
                          capture_output=True, text=True, timeout=30, env=cli_env(),
                          check=False)


def _dashboards(tmp_path: Path, **files: str) -> Path:
    directory = tmp_path / "dashboards"
    directory.mkdir(parents=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


def test_committed_configmaps_are_current() -> None:
    result = _run("--check")
    assert result.returncode == 0, result.stderr
    documents = [d for d in yaml.safe_load_all(DEFAULT_OUTPUT.read_text()) if d]
    assert len(documents) == len(list(DEFAULT_DASHBOARDS.glob("*.json")))


def test_one_sidecar_configmap_per_dashboard(tmp_path: Path) -> None:
    directory = _dashboards(tmp_path, **{
        "colossalai-training.json": json.dumps(TRAINING),
        "colossalai-nodes.json": '{"uid": "colossalai-nodes", "panels": []}  \n',
        "README.md": "not a dashboard"})
    output = tmp_path / "dashboards.yaml"
    result = _run("--dashboards", str(directory), "--output", str(output))
    assert result.returncode == 0, result.stderr
    nodes, training = list(yaml.safe_load_all(output.read_text()))
    for doc, stem in ((nodes, "colossalai-nodes"), (training, "colossalai-training")):
        assert doc["apiVersion"] == "v1" and doc["kind"] == "ConfigMap"
        assert doc["metadata"]["name"] == f"grafana-dashboard-{stem}"
        assert doc["metadata"]["namespace"] == "monitoring"
        assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"   # a string, not 1
        assert list(doc["data"]) == [f"{stem}.json"]
    # the JSON model is carried unchanged (unicode included), readable as a block
    assert json.loads(training["data"]["colossalai-training.json"]) == TRAINING
    assert '"title": "Steps/s — rank"' in output.read_text()
    assert "colossalai-training.json: |" in output.read_text()


def test_no_dashboards_means_no_configmaps(tmp_path: Path) -> None:
    text = render(_dashboards(tmp_path))
    assert [d for d in yaml.safe_load_all(text) if d] == []
    assert "No dashboards were found" in text


def test_check_reports_a_stale_file(tmp_path: Path) -> None:
    directory = _dashboards(tmp_path, **{"colossalai-chat.json": '{"uid": "colossalai-chat"}'})
    output = tmp_path / "dashboards.yaml"
    assert _run("--dashboards", str(directory), "--output", str(output)).returncode == 0
    assert _run("--dashboards", str(directory), "--output", str(output), "--check"
                ).returncode == 0
    (directory / "colossalai-chat.json").write_text('{"uid": "colossalai-chat", "version": 2}')
    result = _run("--dashboards", str(directory), "--output", str(output), "--check")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"{output} is stale: run 'python -m colossalai_exporter.k8s_dashboards'")


def test_bad_dashboards_are_one_line_and_exit_2(tmp_path: Path) -> None:
    output = tmp_path / "out.yaml"
    cases = [
        ({"broken.json": "{"}, "broken.json: not a readable JSON dashboard"),
        ({"list.json": "[]"}, "list.json: a dashboard must be a JSON object"),
        ({"a_b.json": "{}", "a-b.json": "{}"}, "both become ConfigMap 'grafana-dashboard-a-b'"),
        ({"big.json": json.dumps({"x": "y" * (1 << 20)})}, "is over a ConfigMap's 1 MiB"),
    ]
    for index, (files, message) in enumerate(cases):
        directory = _dashboards(tmp_path / str(index), **files)
        result = _run("--dashboards", str(directory), "--output", str(output))
        assert result.returncode == 2, message
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], result.stderr
        assert not output.exists()
