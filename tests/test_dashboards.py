"""The Grafana dashboards: committed files current, a valid JSON model, honest queries, links.

Queries are checked after Grafana's variable substitution (sample values for
$job, $rank …, built-ins for $__rate_interval and $__range): their metric
names must be catalogued or recording rules of rules/*.rules.yml, and the real
promtool must parse them (written into a throwaway rule file, since
`promtool check rules` parses every expression).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from colossalai_exporter import catalogue
from colossalai_exporter.dashboards.cli import generate
from colossalai_exporter.dashboards.dashboard import SCHEMA_VERSION
from colossalai_exporter.dashboards.model import DATASOURCE, GRID_COLUMNS
from colossalai_exporter.rulesgen import common, fabric, rules
from colossalai_exporter.rulesgen import training_hangs as hangs
from colossalai_exporter.rulesgen import training_stalls as stalls
from colossalai_exporter.rulesgen.names import metric_names
from conftest import REPO, require_binary, run_cli
from grafana_render import jsonmodel
from grafana_render.interpolate import builtins, interpolate, variables_in

DASHBOARDS_DIR = REPO / "grafana" / "dashboards"
PROVISIONING = REPO / "grafana" / "provisioning"
UIDS = ("colossalai-chat", "colossalai-nodes", "colossalai-training")
# Variables each dashboard must define: what the alerts' links set, plus gpu on nodes.
REQUIRED_VARIABLES = {
    "colossalai-training": {"datasource", "job", "rank"},
    "colossalai-nodes": {"datasource", "job", "instance", "gpu"},
    "colossalai-chat": {"datasource", "job", "instance"},
}
# Series Prometheus itself writes.
PROMETHEUS_BUILTIN = {"up", "ALERTS", "ALERTS_FOR_STATE"}
# A value for every variable: a multi-valued one is a list, as Grafana's All is.
SAMPLE_VALUES: dict[str, str | list[str]] = {
    "job": "colossalai-training", "app_job": "chat-app",
    "rank": ["0", "1"], "instance": ["node-1:9466", "node-2:9466"], "gpu": ["0", "1"],
    **builtins(range_seconds=6 * 3600, step_seconds=15, scrape_interval_seconds=15),
}


def _models() -> dict[str, dict[str, Any]]:
    return {p.stem: jsonmodel.load(p) for p in sorted(DASHBOARDS_DIR.glob("*.json"))}


def _rule_files() -> list[dict[str, Any]]:
    return [yaml.safe_load(p.read_text()) for p in sorted((REPO / "rules").glob("*.rules.yml"))]


def _recording_rules() -> set[str]:
    return {r["record"] for f in _rule_files() for g in f["groups"] for r in g["rules"]
            if "record" in r}


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every (path, value) of a key named "datasource", anywhere in the model."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield f"{path}.{key}", value
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def _expressions() -> list[tuple[str, str, str]]:
    """(uid, where, substituted PromQL) for every query of every dashboard."""
    out = []
    for uid, model in _models().items():
        for where, expr in jsonmodel.expressions(model):
            out.append((uid, where, interpolate(expr, SAMPLE_VALUES)))
    return out


def test_committed_dashboards_are_current() -> None:
    result = run_cli("dashboards", "--check")
    assert result.returncode == 0, result.stderr


def test_check_reports_a_stale_file(tmp_path: Path) -> None:
    out = str(tmp_path / "dashboards")
    assert run_cli("dashboards", "--output-dir", out).returncode == 0
    assert run_cli("dashboards", "--output-dir", out, "--check").returncode == 0
    target = tmp_path / "dashboards" / "colossalai-nodes.json"
    target.write_text(target.read_text().replace('"ColossalAI nodes"', '"Nodes"'))
    result = run_cli("dashboards", "--output-dir", out, "--check")
    assert result.returncode == 1
    assert result.stderr.strip() == f"{target} is stale: run 'colossalai-exporter dashboards'"
    (tmp_path / "dashboards" / "colossalai-chat.json").unlink()
    result = run_cli("dashboards", "--output-dir", out, "--check")
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 2


def test_thresholds_follow_the_rules_config(tmp_path: Path) -> None:
    override = tmp_path / "site.yml"
    override.write_text("thresholds: {gpu_memory_used_percent: 90, straggler_ratio: 0.5}\n")
    base, site = generate(), generate(overrides=[override])
    changed = {p.name for p in base if base[p] != site[p]}
    assert changed == {"colossalai-nodes.json", "colossalai-training.json"}
    nodes = json.loads(site[DASHBOARDS_DIR / "colossalai-nodes.json"])
    (memory,) = [p for p in jsonmodel.data_panels(nodes) if p["title"] == "GPU memory used"]
    steps = memory["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps == [{"color": "green", "value": None}, {"color": "red", "value": 90}]


def test_one_file_per_stable_uid() -> None:
    models = _models()
    assert tuple(models) == UIDS
    for stem, model in models.items():
        assert model["uid"] == stem
        assert model["id"] is None  # import and provisioning assign their own
        assert model["schemaVersion"] == SCHEMA_VERSION == 41
        assert "colossalai" in model["tags"]
        assert model["title"].startswith("ColossalAI ")


def test_importable_through_the_import_screen_and_provisioning() -> None:
    for uid, model in _models().items():
        # the import screen asks for DS_PROMETHEUS and replaces ${DS_PROMETHEUS} ...
        assert model["__inputs"] == [{
            "name": "DS_PROMETHEUS", "label": "Prometheus",
            "description": "The Prometheus that scrapes colossalai-exporter",
            "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}]
        text = json.dumps(model)
        assert text.count("${DS_PROMETHEUS}") == 2, uid  # ... only as the variable's default
        (datasource,) = [v for v in model["templating"]["list"] if v["type"] == "datasource"]
        assert datasource["name"] == "datasource"
        assert datasource["query"] == "prometheus"
        assert datasource["current"]["value"] == "${DS_PROMETHEUS}"
        # ... and everything else queries through the variable, so provisioning works too
        refs = list(_walk(model))
        assert refs, uid
        for where, value in refs:
            assert value == DATASOURCE == {"type": "prometheus", "uid": "${datasource}"}, \
                (uid, where)
        for panel in jsonmodel.data_panels(model):
            assert panel["datasource"] == DATASOURCE
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["datasource"] == DATASOURCE, (uid, panel["title"])
        for variable in jsonmodel.query_variables(model):
            assert variable["datasource"] == DATASOURCE


def test_panel_ids_unique_and_grid_positions_do_not_overlap() -> None:
    for uid, model in _models().items():
        panels = model["panels"]
        ids = [p["id"] for p in panels] + [c["id"] for p in panels for c in p.get("panels", [])]
        assert len(ids) == len(set(ids)), uid
        titles = [p["title"] for p in jsonmodel.data_panels(model)]
        assert len(titles) == len(set(titles)), uid
        boxes = []
        for panel in panels:
            grid = panel["gridPos"]
            assert set(grid) == {"h", "w", "x", "y"}
            assert grid["x"] >= 0 and grid["y"] >= 0 and grid["w"] >= 1 and grid["h"] >= 1
            assert grid["x"] + grid["w"] <= GRID_COLUMNS, (uid, panel["title"])
            boxes.append((panel["title"], grid))
        for i, (title_a, a) in enumerate(boxes):
            for title_b, b in boxes[i + 1:]:
                overlap = (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
                           and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])
                assert not overlap, (uid, title_a, title_b)


def test_panels_are_well_formed() -> None:
    kinds = {"timeseries", "stat", "state-timeline", "table"}
    for uid, model in _models().items():
        assert model["panels"][0]["type"] == "row"
        for panel in jsonmodel.data_panels(model):
            assert panel["type"] in kinds
            assert panel["description"], (uid, panel["title"])
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs))
            for target in panel["targets"]:
                assert target["expr"].strip()
                assert target["instant"] is (target.get("format") == "table")


def test_variables_match_the_alert_links() -> None:
    for uid, model in _models().items():
        names = [v["name"] for v in model["templating"]["list"]]
        assert len(names) == len(set(names))
        assert set(names) >= REQUIRED_VARIABLES[uid], uid
        for variable in jsonmodel.query_variables(model):
            selector, label = jsonmodel.variable_query(variable)
            assert selector and label, variable["name"]
            # a variable may only use the variables defined before it
            earlier = names[:names.index(variable["name"])]
            assert variables_in(selector) <= set(earlier), variable["name"]
            if variable["multi"]:
                assert variable["includeAll"] and variable["current"]["value"] == ["$__all"]


def _dashboard_links() -> list[tuple[str, str]]:
    links = []
    for rule_file in _rule_files():
        for group in rule_file["groups"]:
            for rule in group["rules"]:
                url = rule.get("annotations", {}).get("dashboard_url")
                if url:
                    links.append((rule["alert"], url))
    return links


def test_every_alert_dashboard_link_points_to_a_dashboard_and_its_variables() -> None:
    models = _models()
    links = _dashboard_links()
    assert {alert for alert, _ in links} >= {"TrainingStalled", "GPUMemoryOOMRisk",
                                             "ChatServerDown", "TrainingRankDown"}
    used = set()
    for alert, url in links:
        parsed = urlparse(url)
        match = re.fullmatch(r"/d/([\w-]+)/([\w-]+)", parsed.path)
        assert match, (alert, url)
        uid = match.group(1)
        assert uid in models, (alert, uid)
        used.add(uid)
        defined = {v["name"] for v in models[uid]["templating"]["list"]}
        params = parse_qs(parsed.query)
        assert params, (alert, url)
        for key in params:
            assert key.startswith("var-"), (alert, key)
            assert key.removeprefix("var-") in defined, (alert, key, uid)
    assert used == set(UIDS)


def test_histogram_panels_work_classic_or_native() -> None:
    """A panel reading a histogram's buckets reads its native form too (docs/deploy.md,
    Prometheus 3: native histograms with custom buckets)."""
    histograms = catalogue.native_histogram_names()
    read = 0
    for uid, where, expr in _expressions():
        names = metric_names(expr)
        for name in names:
            base, _, part = name.rpartition("_")
            if part in ("bucket", "sum", "count") and base in histograms:
                read += 1
                assert base in names, (uid, where, name)
                assert "or on (" in expr, (uid, where, expr)  # classic first, never both
    assert read >= 2  # the step duration's p90, the chat server's latency


def test_queries_use_only_catalogued_metrics_and_existing_recording_rules() -> None:
    known = (catalogue.known_sample_names() | catalogue.native_histogram_names()
             | PROMETHEUS_BUILTIN | _recording_rules())
    used: set[str] = set()
    expressions = _expressions()
    assert len(expressions) > 60
    for uid, where, expr in expressions:
        assert "$" not in expr and "[[" not in expr, (uid, where, expr)
        names = metric_names(expr)
        assert names, (uid, where, expr)
        assert names <= known, (uid, where, names - known)
        used |= names
    # the dashboards reuse the recording rules made for them (the per-rank 5m step
    # rate is drawn as a rate over $__rate_interval instead: it shows a stall sooner;
    # the kept seconds per rank are the goodput ratio's numerator, drawn as the ratio,
    # and the checkpointed seconds' increase is the kept seconds' own intermediate; the
    # ports' state id is drawn through the active-or-not rule made from it)
    intermediate = {rules.STEP_RATE, *(rules.kept_seconds(w) for w in rules.GOODPUT_WINDOWS),
                    *(rules.checkpointed_increase(w) for w in rules.GOODPUT_WINDOWS),
                    fabric.STATE,  # the ports' state, drawn as active or not
                    # each rank's and each node's run, joined by the alerts
                    common.RANK_RUN, common.NODE_RUN, common.AGENT_RANKS,
                    common.AGENT_SERVED_RANKS, common.TROUBLED_RUN,
                    hangs.WAITING_RUNS, stalls.BUSY_RUNS,
                    # the runs whose world has ranks that never reported, for an alert
                    stalls.REPORTED_RANKS, stalls.UNSTARTED_RUNS,
                    # the prolog's rank servers that answered once, for an alert
                    stalls.ANSWERED_SERVERS,
                    # the stalled ranks' last collectives, compared by an alert
                    hangs.LAST_COLLECTIVES,
                    # the ranks down, stalled and lost, each read once for the alerts
                    common.DOWN_RANKS, common.STALLED_RANKS, common.LOST_RANKS}
    assert used & _recording_rules() == _recording_rules() - intermediate


def test_promtool_parses_every_query(tmp_path: Path) -> None:
    groups = []
    for uid in UIDS:
        rules = [{"record": f"dashboard_check_{i}", "expr": expr}
                 for i, (u, _, expr) in enumerate(_expressions()) if u == uid]
        groups.append({"name": uid, "rules": rules})
    path = tmp_path / "dashboard-queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    result = subprocess.run([require_binary("promtool"), "check", "rules", str(path)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize(("expr", "values", "expected"), [
    ('up{job=~"$job"}', {"job": "a-b"}, 'up{job=~"a-b"}'),
    ('x{rank=~"${rank}"}', {"rank": ["0", "1"]}, 'x{rank=~"(0|1)"}'),
    ('x{i=~"[[i]]"}', {"i": ["h.1:80"]}, 'x{i=~"(h\\\\.1:80)"}'),
    ("rate(x[$__rate_interval]) + $__range_s", builtins(3600, 15, 15), "rate(x[60s]) + 3600"),
    ('x{a="$unknown"}', {}, 'x{a="$unknown"}'),
])
def test_interpolation(expr: str, values: dict[str, Any], expected: str) -> None:
    assert interpolate(expr, values) == expected


def test_rate_interval_is_grafanas() -> None:
    # max($__interval + scrape interval, 4 x scrape interval)
    assert builtins(3600, 15, 15)["__rate_interval"] == "60s"
    assert builtins(86400, 300, 15)["__rate_interval"] == "315s"
    assert builtins(60, 1, 1)["__rate_interval"] == "4s"


def test_provisioning_files_have_what_grafana_requires() -> None:
    dashboards = list((PROVISIONING / "dashboards").glob("*.yml"))
    datasources = list((PROVISIONING / "datasources").glob("*.yml"))
    assert dashboards and datasources
    for path in dashboards:
        data = yaml.safe_load(path.read_text())
        assert data["apiVersion"] == 1
        assert data["providers"]
        for provider in data["providers"]:
            assert provider["name"] and provider["type"] == "file"
            assert isinstance(provider.get("orgId", 1), int)
            assert Path(provider["options"]["path"]).is_absolute()
            assert isinstance(provider.get("updateIntervalSeconds", 10), int)
    for path in datasources:
        data = yaml.safe_load(path.read_text())
        assert data["apiVersion"] == 1
        sources = data["datasources"]
        assert sum(1 for s in sources if s.get("isDefault")) == 1
        for source in sources:
            assert source["name"] and source["uid"]
            assert source["type"] == "prometheus" and source["access"] == "proxy"
            assert re.match(r"https?://[\w.-]+(:\d+)?/?", source["url"])
            assert re.fullmatch(r"\d+(ms|s|m)", source["jsonData"]["timeInterval"])


def test_docs_describe_every_dashboard_panel_and_variable() -> None:
    text = " ".join((REPO / "docs" / "dashboards.md").read_text().split())
    for uid, model in _models().items():
        assert f"`{uid}`" in text and f"dashboards/{uid}.png" in text
        for panel in model["panels"]:
            assert panel["title"] in text, (uid, panel["title"])
        for variable in model["templating"]["list"]:
            assert f"`{variable['name']}`" in text, (uid, variable["name"])
