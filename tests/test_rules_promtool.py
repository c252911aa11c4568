"""The generated rules against the real promtool, the catalogue and the runbooks."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from colossalai_exporter import catalogue
from colossalai_exporter.rulesgen import rules
from colossalai_exporter.rulesgen.names import metric_names, template_queries
from conftest import RELEASES, REPO, release_binary

RULES_DIR = REPO / "rules"
RULE_FILES = sorted(RULES_DIR.glob("*.rules.yml"))
TEST_FILES = sorted((RULES_DIR / "tests").glob("*.test.yml"))
K8S = REPO / "deploy" / "kubernetes" / "prometheusrule.yaml"
# Series Prometheus itself writes for every target.
PROMETHEUS_BUILTIN = {"up", "ALERTS"}


def _rules() -> list[dict[str, Any]]:
    return [r for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"]
            for r in g["rules"]]


# Each promtool check runs on bookworm's 2.42 and on Prometheus 3, whose ranges leave
# out their first instant (a 1m range over 1m samples holds one) and whose label
# names may be any UTF-8: the shipped rules must mean the same on both.
def _promtool(*args: str, release: str = "bookworm") -> subprocess.CompletedProcess[str]:
    # A deadline for a promtool that hangs, not a speed: the unit tests take 10-15 s on
    # an idle 2-core machine, and several times that beside a CI run.
    return subprocess.run([release_binary(release, "promtool"), *args], capture_output=True,
                          text=True, timeout=600, check=False, cwd=REPO)


def test_rule_files_exist() -> None:
    assert [f.name for f in RULE_FILES] == sorted(
        f"colossalai-{n}.rules.yml"
        for n in ("training", "node", "chat", "chat-engines", "pipeline"))


@pytest.mark.parametrize("release", RELEASES)
def test_promtool_check_rules_is_clean(tmp_path: Path, release: str) -> None:
    # the PrometheusRule's spec is a rule file too
    spec = tmp_path / "prometheusrule-spec.yml"
    spec.write_text(yaml.safe_dump(yaml.safe_load(K8S.read_text())["spec"]))
    result = _promtool("check", "rules", *map(str, RULE_FILES), str(spec), release=release)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    # promtool's lint (two rules of one name with the same labels, say) exits 0 as well
    assert "FAILED" not in result.stdout + result.stderr, result.stdout + result.stderr


@pytest.mark.parametrize("release", RELEASES)
def test_promtool_unit_tests_pass(release: str) -> None:
    result = _promtool("test", "rules", *map(str, TEST_FILES), release=release)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus3_promtool_is_version_3() -> None:
    version = _promtool("--version", release="current")
    assert re.match(r"promtool, version 3\.", version.stdout), version.stdout


def _cases() -> list[dict[str, Any]]:
    return [case for f in TEST_FILES for test in yaml.safe_load(f.read_text())["tests"]
            for case in test.get("alert_rule_test", [])]


def test_every_alert_rule_has_a_firing_case_with_every_annotation() -> None:
    """Each rule (name, severity, cause) fires in some case that checks all its annotations."""
    fired: dict[tuple[str, str, str], set[str]] = {}
    for case in _cases():
        for alert in case["exp_alerts"]:
            labels = alert["exp_labels"]
            key = (case["alertname"], labels["severity"], labels.get("cause", ""))
            fired.setdefault(key, set()).update(alert.get("exp_annotations", {}))
    for rule in _rules():
        if "alert" not in rule:
            continue
        key = (rule["alert"], rule["labels"]["severity"], rule["labels"].get("cause", ""))
        assert key in fired, f"no promtool case where {key} fires"
        assert fired[key] >= set(rule["annotations"]), (key, set(rule["annotations"]) - fired[key])
        assert "runbook_url" in fired[key]


def test_every_alert_has_a_not_firing_case_and_one_before_for_elapses() -> None:
    cases = _cases()
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    # Watchdog always fires: it has no quiet case by design.
    assert quiet == rules.alert_names() - {"Watchdog"}
    windows = {r["alert"] for r in _rules() if "alert" in r and "for" in r}
    assert windows <= quiet


def test_every_rule_reads_only_catalogued_metrics() -> None:
    known = (catalogue.known_sample_names() | PROMETHEUS_BUILTIN | set(catalogue.ENGINE_METRICS)
             | set(catalogue.NODE_EXPORTER_METRICS) | catalogue.native_histogram_names())
    known |= {r["record"] for r in _rules() if "record" in r}
    for rule in _rules():
        used = metric_names(rule["expr"])
        for text in rule.get("annotations", {}).values():
            for promql in template_queries(text):
                used |= metric_names(promql)
        unknown = used - known
        assert not unknown, f"{rule.get('alert') or rule.get('record')}: not catalogued: {unknown}"


def test_every_histogram_read_works_classic_or_native() -> None:
    """A rule that reads a histogram's _bucket, _sum or _count reads its native form too:
    the rules work whether Prometheus keeps the classic series or converts them at scrape
    into one native histogram with custom buckets (docs/deploy.md, Prometheus 3)."""
    histograms = catalogue.native_histogram_names() | {
        name.removesuffix("_sum") for name in catalogue.ENGINE_METRICS if name.endswith("_sum")}
    read = 0
    for rule in _rules():
        names = metric_names(rule["expr"])
        for name in names:
            base, _, part = name.rpartition("_")
            if part in ("bucket", "sum", "count") and base in histograms:
                read += 1
                assert base in names, f"{rule.get('alert') or rule.get('record')}: {name} alone"
    assert read >= 4  # the step mean's two parts, the engines' queue times


def test_recording_rules_are_named_level_metric_operations() -> None:
    for rule in _rules():
        if "record" in rule:
            level, metric, ops = rule["record"].split(":")
            assert level, rule["record"]
            assert ops, rule["record"]
            # colossalai:job_goodput_ratio:1h is issue 19's name: the project as the level
            assert metric.startswith("colossalai_") or level == "colossalai", rule["record"]


@pytest.mark.parametrize(("expr", "names"), [
    ('sum by (job, rank) (rate(a_total{job="x", phase=~"a|b"}[5m]))', {"a_total"}),
    ("quantile by (job) (0.5, x:y:z) / on (job) group_left () w", {"x:y:z", "w"}),
    ("absent(up{job=\"a\"}) or absent(up{job='b'})", {"up"}),
    ("time() - foo offset 5m > 1e9 and bar @ 100 unless baz", {"foo", "bar", "baz"}),
    ("predict_linear(free[6h], 86400) < 0 and inf > nan", {"free"}),
    ("vector(1)", set()),
])
def test_metric_name_extraction(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_every_alert_has_a_runbook_section_and_its_url() -> None:
    text = (REPO / "docs" / "runbooks.md").read_text()
    headings = set(re.findall(r"^## (\w+)\s*$", text, re.MULTILINE))
    assert headings >= rules.alert_names()
    for rule in _rules():
        if "alert" in rule:
            url = rule["annotations"]["runbook_url"]
            assert url.endswith("docs/runbooks.md#" + rule["alert"].lower())


def test_docs_rules_md_has_a_row_for_every_alert() -> None:
    text = (REPO / "docs" / "rules.md").read_text()
    table = text.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| (\w+) \|", table, re.MULTILINE)) - {"alert"}
    assert rows == rules.alert_names()


def test_annotations_follow_the_conventions() -> None:
    for rule in _rules():
        if "alert" not in rule:
            continue
        annotations = rule["annotations"]
        assert "{{" not in annotations["summary"], rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        if rule["alert"] != "Watchdog":
            assert "{{" in annotations["description"], rule["alert"]


def runbook_queries() -> list[str]:
    """Every query of the runbooks' ```promql blocks: a line at the block's level starts
    one, an open bracket continues it onto the next lines; ``# …`` comments dropped."""
    text = (REPO / "docs" / "runbooks.md").read_text()
    queries: list[str] = []
    for block in re.findall(r"```promql\n(.*?)```", text, re.DOTALL):
        lines: list[str] = []
        depth = 0
        for raw in block.splitlines():
            line = re.sub(r"\s+#.*$", "", raw).rstrip()
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if depth == 0 and lines:
                queries.append("\n".join(lines))
                lines = []
            lines.append(line)
            depth += sum(line.count(o) - line.count(c) for o, c in ("()", "{}", "[]"))
        if lines:
            queries.append("\n".join(lines))
    return queries


def test_runbook_queries_parse_and_select_what_is_served_or_recorded(tmp_path: Path) -> None:
    """On-call pastes the runbooks' "Check first" queries as they stand: each must parse
    (promtool, as a recording rule's expression) and select only metrics the exporters
    serve, the rules record, Prometheus writes, node_exporter serves (node_*), or the
    chat engines the engine rules read serve (vLLM, SGLang, TGI). A helper following
    the docs found queries that parsed and named the wrong rank."""
    queries = runbook_queries()
    assert len(queries) > 100
    known = (catalogue.known_sample_names() | catalogue.native_histogram_names()
             | PROMETHEUS_BUILTIN | {"ALERTS_FOR_STATE"}
             | {r["record"] for r in _rules() if "record" in r})
    for query in queries:
        unknown = {n for n in metric_names(query)
                   if not n.startswith(("node_", "vllm:", "sglang:", "tgi_"))} - known
        assert not unknown, (query, unknown)
    rules_file = tmp_path / "runbook-queries.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "runbooks", "rules": [
        {"record": f"runbook:query:{i}", "expr": q} for i, q in enumerate(queries)]}]}))
    checked = _promtool("check", "rules", str(rules_file))
    assert checked.returncode == 0, checked.stdout + checked.stderr
