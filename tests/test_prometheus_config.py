"""deploy/prometheus: promtool accepts the installed layout; Prometheus relabels as documented."""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from colossalai_exporter.slurm import file_sd
from conftest import REPO, require_prometheus3, wait_until
from deploy_helpers import (
    PROMETHEUS_DIR,
    RULE_FILES,
    active_targets,
    load_yaml,
    prometheus_layout,
    promtool_check_config,
    running_prometheus,
)

CONFIG = PROMETHEUS_DIR / "prometheus.yml"


def _jobs() -> dict[str, dict[str, Any]]:
    return {job["job_name"]: job for job in load_yaml(CONFIG)["scrape_configs"]}


def test_promtool_checks_config_rules_and_every_target_file(tmp_path: Path) -> None:
    config = prometheus_layout(tmp_path)
    # What a Slurm prolog adds (the *.json files), through the real module.
    file_sd.write(tmp_path / "targets", file_sd.JobTargets("77", ["gpu-a1", "gpu-a2"]))
    result = promtool_check_config(config)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # Every rule_files and file_sd pattern matched a file (promtool only warns otherwise),
    # but the chat jobs' *.json, which nothing here writes.
    warnings = [line.strip() for line in output.splitlines() if "WARNING" in line]
    assert len(warnings) == 2, output
    assert "targets/colossalai-chat/*.json" in warnings[0]
    assert "targets/colossalai-chat-app/*.json" in warnings[1]
    assert f"SUCCESS: {len(RULE_FILES)} rule files found" in output
    assert len(RULE_FILES) == 5  # training, node, chat, chat-engines, pipeline


def test_prometheus3_takes_the_config_with_its_nhcb_lines_uncommented(tmp_path: Path) -> None:
    """The two commented ``convert_classic_histograms_to_nhcb`` lines (global and the
    training job) are right for Prometheus 3, and rightly commented for bookworm's 2.42."""
    text = CONFIG.read_text()
    uncommented = re.sub(r"^(\s*)# (convert_classic_histograms_to_nhcb: true)$", r"\1\2",
                         text, flags=re.M)
    assert uncommented.count("\n  convert_classic_histograms_to_nhcb: true") == 1  # global
    assert uncommented.count("\n    convert_classic_histograms_to_nhcb: true") == 1  # the job
    converted = tmp_path / "converted.yml"
    converted.write_text(uncommented)
    config = prometheus_layout(tmp_path / "etc", converted)
    result = promtool_check_config(config, promtool=require_prometheus3("promtool"))
    assert result.returncode == 0, result.stdout + result.stderr
    refused = promtool_check_config(config)  # bookworm's 2.42
    assert "field convert_classic_histograms_to_nhcb not found" in refused.stdout + refused.stderr
    # and the shipped one, as it is, on Prometheus 3 too
    shipped = prometheus_layout(tmp_path / "shipped")
    result = promtool_check_config(shipped, promtool=require_prometheus3("promtool"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rejects_a_broken_target_file(tmp_path: Path) -> None:
    """The check above would notice a bad file_sd file: promtool reads them."""
    config = prometheus_layout(tmp_path)
    # A label value given as a list (a YAML nesting slip). Not a dashed label name:
    # Prometheus 3 accepts any UTF-8 label name, so that one is no longer broken.
    (tmp_path / "targets" / "colossalai-node" / "bad.yml").write_text(
        "- targets: [a:1]\n  labels: {team: [ml-infra]}\n")
    result = promtool_check_config(config)
    assert result.returncode == 1
    assert "cannot unmarshal" in result.stdout + result.stderr


def test_job_names_are_the_ones_the_rules_select() -> None:
    rules = load_yaml(REPO / "rules" / "config.yml")
    jobs = set(_jobs())
    for name, selector in rules["selectors"].items():
        if name == "engine":  # the inference servers' own jobs, the site's to name
            assert selector == ""
            continue
        if name == "rdma_ports":  # which ports, not a job
            continue
        if name == "node_exporter":  # node_exporter's job: the site's, not shipped here
            assert selector == 'job="node"'
            continue
        (job,) = re.fullmatch(r'job="([^"]+)"', selector).groups()  # type: ignore[union-attr]
        assert job in jobs, f"selector {name} wants job {job}"
    assert set(rules["expected_jobs"]) <= jobs


def test_chat_job_uses_blackbox_relabel_pattern() -> None:
    chat = _jobs()["colossalai-chat"]
    assert chat["metrics_path"] == "/probe"
    assert "params" not in chat  # it would overwrite the target files' __param_module
    assert chat["relabel_configs"] == [
        {"source_labels": ["__param_module"], "regex": "", "target_label": "__param_module",
         "replacement": "colossal_inference"},
        {"source_labels": ["__address__"], "target_label": "__param_target"},
        {"source_labels": ["__param_target"], "target_label": "instance"},
        {"target_label": "__address__", "replacement": "colossalai-prober:9467"},
    ]


def test_rules_and_alerting_are_wired() -> None:
    config = load_yaml(CONFIG)
    assert config["rule_files"] == ["rules/*.rules.yml"]
    (manager,) = config["alerting"]["alertmanagers"]
    assert manager["static_configs"] == [{"targets": ["alertmanager:9093"]}]
    # the scrape deadline the node agent works within (8 s) is under Prometheus' timeout
    assert config["global"]["scrape_timeout"] == "10s"


def test_default_ports() -> None:
    jobs = _jobs()
    assert jobs["colossalai-bridge"]["static_configs"] == [{"targets": ["colossalai-bridge:9468"]}]
    assert jobs["colossalai-prober"]["static_configs"] == [{"targets": ["colossalai-prober:9467"]}]
    examples = PROMETHEUS_DIR / "targets"
    node = load_yaml(examples / "colossalai-node" / "nodes.yml.example")
    assert all(t.endswith(":9466") for group in node for t in group["targets"])
    training = load_yaml(examples / "colossalai-training" / "llama-70b.yml.example")
    assert all(t.endswith(":8766") for group in training for t in group["targets"])


@pytest.mark.slow
def test_real_prometheus_builds_probe_urls_and_labels(tmp_path: Path) -> None:
    """Prometheus 2.42 loads the layout; /api/v1/targets shows the relabelled chat targets."""
    config = prometheus_layout(tmp_path)
    with running_prometheus(config) as base:
        def chat_targets() -> dict[str, dict[str, Any]] | None:
            found = {t["labels"]["instance"]: t for t in active_targets(base)
                     if t["labels"]["job"] == "colossalai-chat"}
            return found if len(found) == 4 else None

        chat = wait_until(chat_targets, timeout=20, interval=0.25, what="4 chat targets")
        inference = urllib.parse.urlsplit(chat["http://inference-1:8000"]["scrapeUrl"])
        assert inference.netloc == "colossalai-prober:9467"
        assert inference.path == "/probe"
        assert urllib.parse.parse_qs(inference.query) == {
            "module": ["colossal_inference"], "target": ["http://inference-1:8000"]}
        # __param_module in the target file picks the group's module
        health = urllib.parse.urlsplit(chat["http://chat-1:8080"]["scrapeUrl"])
        assert urllib.parse.parse_qs(health.query)["module"] == ["health_json"]
        # the same server probed by the streaming module under a target of its own
        stream = urllib.parse.urlsplit(chat["http://inference-1:8000/"]["scrapeUrl"])
        assert urllib.parse.parse_qs(stream.query)["module"] == ["chat_stream"]
        # no __ label leaks into the stored series
        assert set(chat["http://chat-1:8080"]["labels"]) == {"instance", "job"}

        by_job: dict[str, set[str]] = {}
        for target in active_targets(base):
            by_job.setdefault(target["labels"]["job"], set()).add(target["labels"]["instance"])
        assert by_job["colossalai-node"] == {"gpu-node-01:9466", "gpu-node-02:9466",
                                             "gpu-node-03:9466"}
        assert by_job["colossalai-training"] == {"gpu-node-01:8766"}
        assert by_job["colossalai-chat-app"] == {"chat-1:8080"}


def test_no_shipped_config_sets_a_label_the_exporters_set_themselves() -> None:
    """A target label, relabeling or static alert label named like one of the exporters'
    own (run, rank, gpu …) makes Prometheus rename theirs to exported_<name> at scrape:
    the run label then no longer joins a job's alerts (issue 26)."""
    from colossalai_exporter import catalogue

    ours = catalogue.label_names()
    targets = sorted((PROMETHEUS_DIR / "targets").glob("*/*.example"))
    assert targets
    for path in targets:
        for group in load_yaml(path):
            clash = set(group.get("labels", {})) & ours
            assert not clash, f"{path}: {sorted(clash)}"
    kubernetes = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
    relabels = [(CONFIG, r.get("target_label", "")) for job in _jobs().values()
                for key in ("relabel_configs", "metric_relabel_configs")
                for r in job.get(key, [])]
    for path in kubernetes:
        text = path.read_text()
        relabels += [(path, m) for m in re.findall(r"targetLabel:\s*(\S+)", text)]
    assert relabels
    for path, label in relabels:
        assert label not in ours, f"{path}: relabels to {label!r}"
    for rules in RULE_FILES:
        for group in load_yaml(rules)["groups"]:
            for rule in group["rules"]:
                clash = set(rule.get("labels", {})) & ours
                assert not clash, f"{rules}: {rule.get('alert') or rule.get('record')}: {clash}"
    # and a Slurm job's own labels cannot either
    with pytest.raises(ValueError, match="exported_run"):
        file_sd.check_label("run")
