"""``colossalai-exporter rules``: committed files current, overrides, readable errors."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from colossalai_exporter.errors import ConfigError
from colossalai_exporter.rulesgen import config as rules_config
from colossalai_exporter.rulesgen import rules
from colossalai_exporter.rulesgen.cli import DEFAULT_CONFIG, generate
from conftest import REPO, require_binary, run_cli


def _render_to(tmp_path: Path, *extra: str) -> tuple[int, str]:
    result = run_cli("rules", "--output-dir", str(tmp_path / "rules"),
                     "--kubernetes-output", str(tmp_path / "k8s.yaml"), *extra)
    return result.returncode, result.stderr


def test_committed_files_are_current() -> None:
    result = run_cli("rules", "--check")
    assert result.returncode == 0, result.stderr


def test_check_reports_a_stale_file(tmp_path: Path) -> None:
    assert _render_to(tmp_path)[0] == 0
    assert _render_to(tmp_path, "--check")[0] == 0
    target = tmp_path / "rules" / "colossalai-node.rules.yml"
    target.write_text(target.read_text().replace("> 95", "> 99"))
    code, err = _render_to(tmp_path, "--check")
    assert code == 1
    assert err.strip() == f"{target} is stale: run 'colossalai-exporter rules'"


def test_rules_written_elsewhere_leave_the_shipped_prometheusrule_alone(
        tmp_path: Path) -> None:
    # An override rendered into another folder once rewrote the checkout's
    # PrometheusRule with the fault suite's shortened windows.
    shipped = REPO / "deploy" / "kubernetes" / "prometheusrule.yaml"
    before = shipped.read_bytes()
    override = tmp_path / "fast.yml"
    override.write_text("for: {TrainingStalled: 2s}\n")
    result = run_cli("rules", "--override", str(override), "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert shipped.read_bytes() == before
    assert "prometheusrule" not in result.stdout + result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        p.name for p in (REPO / "rules").glob("*.rules.yml"))


def test_every_alert_has_a_for_window_and_the_names_match() -> None:
    cfg = rules_config.load(DEFAULT_CONFIG, alerts=rules.alert_names())
    built = {r.name for f in rules.build(cfg) for g in f.groups for r in g.rules
             if hasattr(r, "severity")}
    assert built == rules.alert_names() == set(cfg.for_)


def test_the_readme_counts_every_alert() -> None:
    """The README's "Rules bundle: N alerts" is the number the rules build (it said 51
    for 52 once: a count in prose drifts)."""
    readme = (REPO / "README.md").read_text()
    assert f"**Rules bundle**: {len(rules.alert_names())} alerts (" in readme


def test_override_changes_only_what_it_names(tmp_path: Path) -> None:
    override = tmp_path / "fast.yml"
    override.write_text("for: {TrainingStalled: 2s}\nthresholds: {gpu_memory_used_percent: 90}\n")
    base = generate(kubernetes_path=None)
    fast = generate(overrides=[override], kubernetes_path=None)
    changed = {p.name for p in base if base[p] != fast[p]}
    assert changed == {"colossalai-training.rules.yml", "colossalai-node.rules.yml"}
    training = yaml.safe_load(fast[REPO / "rules" / "colossalai-training.rules.yml"])
    stalled = [r for g in training["groups"] for r in g["rules"]
               if r.get("alert") == "TrainingStalled"]
    assert stalled[0]["for"] == "2s"
    node = yaml.safe_load(fast[REPO / "rules" / "colossalai-node.rules.yml"])
    gpu = [r for g in node["groups"] for r in g["rules"] if r.get("alert") == "GPUMemoryOOMRisk"]
    assert gpu[0]["expr"].endswith("> 90")


def test_zero_for_window_is_omitted(tmp_path: Path) -> None:
    pipeline = yaml.safe_load(generate(kubernetes_path=None)[
        REPO / "rules" / "colossalai-pipeline.rules.yml"])
    watchdog = [r for g in pipeline["groups"] for r in g["rules"] if r.get("alert") == "Watchdog"]
    assert "for" not in watchdog[0]


def test_prometheus_rule_holds_every_group() -> None:
    files = generate()
    k8s = yaml.safe_load(files[REPO / "deploy" / "kubernetes" / "prometheusrule.yaml"])
    assert k8s["apiVersion"] == "monitoring.coreos.com/v1"
    assert k8s["kind"] == "PrometheusRule"
    assert k8s["metadata"]["labels"]["role"] == "alert-rules"
    groups = [g for p, text in files.items() if p.suffix == ".yml"
              for g in yaml.safe_load(text)["groups"]]
    assert k8s["spec"]["groups"] == groups


@pytest.mark.parametrize(("override", "message"), [
    ("thresholds: {gpu_memory_percent: 90}",
     "thresholds: unknown key `gpu_memory_percent` (known: straggler_ratio, "),
    ("thresholds: {gpu_memory_used_percent: high}",
     "thresholds.gpu_memory_used_percent: expected `float`, got `str`"),
    ("thresholds: {gpu_memory_used_percent: true}",
     "thresholds.gpu_memory_used_percent: expected `float`, got `bool`"),
    ("thresholds: {disk_free_bytes: 2.5}",
     "thresholds.disk_free_bytes: expected `int`, got `float`"),
    ("thresholds: {checkpoint_interval: 2 hours}",
     "thresholds.checkpoint_interval: '2 hours' is not a Prometheus duration"),
    ("thresholds: {checkpoint_interval: 7200}",
     "thresholds.checkpoint_interval: expected a Prometheus duration (like 30s, 5m, 1h30m), "
     "got 7200"),
    ("for: {TrainingStaled: 1m}", "for: unknown key `TrainingStaled` (known: TrainingStalled, "),
    ("selectors: {training: 5}", "selectors.training: expected `str`, got `int`"),
    ("expected_jobs: colossalai-node", "expected_jobs: expected `array`, got `str`"),
    ("runbook_url: https://example.com/runbooks", "runbook_url: must contain {anchor}"),
    ("- a list", "must be a YAML mapping, got list"),
])
def test_bad_override_is_one_line_and_exit_2(tmp_path: Path, override: str,
                                             message: str) -> None:
    path = tmp_path / "override.yml"
    path.write_text(override + "\n")
    code, err = _render_to(tmp_path, "--override", str(path))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"colossalai-exporter: error: {path}: ") or \
        lines[0].startswith("colossalai-exporter: error: rules override")
    assert message in lines[0]
    assert not (tmp_path / "rules").exists()


def test_bad_base_config_names_the_file(tmp_path: Path) -> None:
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    del data["for"]["Watchdog"]
    data["for"]["Watchdogg"] = "0s"
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(data))
    result = run_cli("rules", "--config.file", str(path), "--check")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"colossalai-exporter: error: {path}: for.Watchdogg: unknown alert (alerts: "
        + ", ".join(sorted(rules.alert_names())) + ")")
    del data["for"]["Watchdogg"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"for\.Watchdog: missing"):
        rules_config.load(path, alerts=rules.alert_names())


def test_unknown_flag_is_one_line() -> None:
    result = run_cli("rules", "--frobnicate")
    assert result.returncode == 2
    assert result.stderr.strip() == ("colossalai-exporter: error: unrecognized arguments: "
                                     "--frobnicate")


def test_durations() -> None:
    assert rules_config.Duration.parse("1h30m").seconds == 5400
    assert rules_config.Duration.parse("0s").seconds == 0
    assert rules_config.Duration.parse("1d").seconds == 86400
    for bad in ("", "5", "m5", "1h 30m", "-5m", "5M"):
        with pytest.raises(ValueError, match="not a Prometheus duration"):
            rules_config.Duration.parse(bad)


def test_no_rule_reads_an_in_process_only_series_from_the_node_agent() -> None:
    """The agent leaves these out (series budget): a rule reading them from its job
    would never fire."""
    from colossalai_exporter.rankstate.families import INSIDE_ONLY

    names = "|".join(sorted(INSIDE_ONLY))
    selector = re.compile(rf"\b({names})(?:_bucket|_sum|_count)?\{{([^}}]*)\}}")
    texts = [p.read_text() for p in (REPO / "rules").glob("*.rules.yml")]
    uses = [m for text in texts for m in selector.finditer(text)]
    assert uses, "expected the step-duration recording rule to read the rank servers"
    for use in uses:
        assert 'job="colossalai-training"' in use.group(2), use.group(0)


def test_every_clock_slowdown_reason_the_agent_exports_has_words_in_the_straggler_page() -> None:
    from colossalai_exporter.node.gpu.health import SLOWDOWN_REASONS
    from colossalai_exporter.rulesgen.gpu import SLOWDOWN_WORDS

    assert set(SLOWDOWN_WORDS) == set(SLOWDOWN_REASONS)


def test_ports_missing_with_the_sites_expected_ports(tmp_path: Path) -> None:
    """infiniband_expected_ports: 2 in an override: node-a with one of two ports active
    and node-b, whose agent reports no RDMA port at all, fire; node-c with two do not."""
    override = tmp_path / "site.yml"
    override.write_text("thresholds: {infiniband_expected_ports: 2}\n")
    files = generate(overrides=[override], rules_dir=tmp_path, kubernetes_path=None)
    node_rules = tmp_path / "colossalai-node.rules.yml"
    node_rules.write_text(files[node_rules])
    state = "colossalai_infiniband_state_id"
    spec = {
        "rule_files": [str(node_rules)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": f'up{{job="colossalai-node",instance="{n}:9466"}}', "values": "1x20"}
                for n in ("node-a", "node-b", "node-c")] + [
                {"series": f'{state}{{job="colossalai-node",instance="node-a:9466",'
                           f'device="mlx5_{d}",port="1"}}', "values": v}
                for d, v in ((0, "4x20"), (1, "1x20"))] + [
                {"series": f'{state}{{job="colossalai-node",instance="node-c:9466",'
                           f'device="mlx5_{d}",port="1"}}', "values": "4x20"}
                for d in (0, 1)],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "InfiniBandPortsMissing", "exp_alerts": []},
                {"eval_time": "15m", "alertname": "InfiniBandPortsMissing", "exp_alerts": [
                    {"exp_labels": {"severity": "critical", "cause": "expected", "node": node,
                                    "subsystem": "infiniband", "remedy": "drain"},
                     "exp_annotations": {
                         "summary": "A node has fewer active InfiniBand or RoCE ports than it "
                                    "should.",
                         "description": f"{node} has {active} active RDMA ports, fewer than "
                                        "the 2 its nodes have: an adapter missing, a port "
                                        "never cabled or down since boot. Drain it and check "
                                        "`ibstat` and the cables before it runs a multi-node "
                                        "job.",
                         "runbook_url": "https://github.com/colossalai-exporter/"
                                        "colossalai-exporter/blob/main/docs/runbooks.md"
                                        "#infinibandportsmissing"}}
                    for node, active in (("node-a", 1), ("node-b", 0))]},
            ]}],
    }
    test_file = tmp_path / "ports.test.yml"
    test_file.write_text(yaml.safe_dump(spec))
    result = subprocess.run(
        [require_binary("promtool"), "test", "rules", str(test_file)],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_hardware_alert_names_its_subsystem_and_remedy() -> None:
    """The verdict (rulesgen/verdict.py) summarises the alerts that carry both labels: every
    GPU and fabric alert but the job's GPU memory and the agent's own blindness."""
    from colossalai_exporter.node.gpu import xid
    from colossalai_exporter.node.gpu.health import RECOVERY_ACTION_WORDS
    from colossalai_exporter.rulesgen.verdict import (
        RECOVERY_REMEDIES,
        REMEDIES,
        SUBSYSTEMS,
        XID_REMEDIES,
    )

    # every action the Xid catalog and NVML name has a remedy of the ladder
    assert set(XID_REMEDIES) == set(xid.actions())
    assert set(RECOVERY_REMEDIES) == set(RECOVERY_ACTION_WORDS)
    assert set(XID_REMEDIES.values()) | set(RECOVERY_REMEDIES.values()) <= set(REMEDIES)
    (node,) = [f for f in rules.build(rules_config.load(DEFAULT_CONFIG))
               if f.name == "colossalai-node"]
    alerts = [r for g in node.groups for r in g.rules if isinstance(r, rules.Alert)]
    hardware = {a.name for a in alerts if a.name.startswith(("GPU", "InfiniBand"))}
    judged = {a.name for a in alerts if a.subsystem}
    assert judged == hardware - {"GPUMemoryOOMRisk", "GPUCollectorDown"}
    for alert in alerts:
        if alert.subsystem:
            assert alert.subsystem in SUBSYSTEMS
            assert alert.remedy in REMEDIES or "{{" in str(alert.remedy), alert.name
