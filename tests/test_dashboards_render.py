"""The dashboard renderer against a real Prometheus scraping a stand-in rank-0 exposition.

The stand-in serves two ranks' training series through the monitor's own
mapping (``RankState`` -> snapshot -> ``training.families``): rank 1 steps,
has a loss, a checkpoint and a heartbeat; rank 0 stopped stepping 100 s ago
with a 2 s budget, so TrainingStalled fires (its ``for`` overridden to 0 s).
Neither rank runs Gemini, so exactly the two panels that read only Gemini
series must come back empty, with the two that read the node agents' view of a
hang; nothing is scraped for the node and chat
dashboards, so all their panels are empty except the firing-alerts table,
which (like Grafana's with an empty job variable) shows the job-less Watchdog.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from colossalai_exporter.rankstate.families import families
from colossalai_exporter.rankstate.schema import HeartbeatState
from colossalai_exporter.training.state import Budgets, RankState
from conftest import REPO, wait_until
from grafana_render import jsonmodel
from grafana_render.query import Prometheus
from grafana_render.render_png import legend_text, main, render_all
from prometheus_helpers import render_rules, running_prometheus, serving

pytestmark = pytest.mark.slow

DASHBOARDS_DIR = REPO / "grafana" / "dashboards"
GEMINI_ONLY = {"Gemini chunk memory by device", "Gemini host↔device traffic"}
# Read from the node agents, and only while a run hangs (no agent is scraped here), and
# from the monitors' samples of the training thread, which the stand-in never takes.
WAITING_PANELS = {"Who the job is waiting for", "Where each stalled rank is",
                  "Share of time waiting for other ranks"}


class TwoRanks(Collector):
    """Rank 1 takes a 0.2 s step every scrape; rank 0 is stuck since 100 s ago."""

    def __init__(self) -> None:
        now = time.time()
        self.budgets = Budgets(step=2.0)
        self.ranks = [RankState(r, r, 2, 1000 + r, None, now=now - 120) for r in (0, 1)]
        for state in self.ranks:
            state.phase, state.phase_start, state.kernels_ready = "training", now - 110, True
            state.info = {"plugin": "gemini", "world_size": "2", "run": "llama-7b-0412"}
            state.steps, state.last_step, state.loss = 10, now - 100, 2.5
        stepping = self.ranks[1]
        stepping.checkpoint_last_success, stepping.checkpoint_last_step = now - 30, 10
        stepping.checkpoint_duration = 4.0
        stepping.heartbeats = {"step": HeartbeatState(last_success=now, last_attempt=now,
                                                      success=1)}
        self.lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        with self.lock:
            stepping = self.ranks[1]
            stepping.steps += 1
            stepping.last_step = now
            stepping.hist[5] += 1  # the 0.25 s bucket
            stepping.duration_sum += 0.2
            stepping.productive += 0.2
            stepping.loss = 2.5 / stepping.steps ** 0.5
            beat = stepping.heartbeats["step"]
            beat.last_success = beat.last_attempt = now
            beat.success = stepping.steps
            for state in self.ranks:
                yield from families(state.snapshot(self.budgets, now))


@pytest.fixture
def exposition() -> Iterator[str]:
    with serving(TwoRanks()) as address:
        yield address


@pytest.fixture
def prometheus(tmp_path: Path, exposition: str) -> Iterator[str]:
    rules = render_rules(tmp_path, "for: {TrainingStalled: 0s}\n")
    with running_prometheus(tmp_path, f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{rules}/*.rules.yml"]
scrape_configs:
  - job_name: colossalai-training
    static_configs: [{{targets: ["{exposition}"]}}]
""") as running:
        yield running.url


def _titles(uid: str) -> set[str]:
    model = jsonmodel.load(DASHBOARDS_DIR / f"{uid}.json")
    return {p["title"] for p in jsonmodel.data_panels(model)}


def test_renders_every_dashboard_and_reports_the_empty_panels(
        tmp_path: Path, prometheus: str, capsys: pytest.CaptureFixture[str]) -> None:
    api = Prometheus(prometheus, timeout=2)

    def ready() -> bool:
        # several scrapes (so every rate over $__rate_interval has samples), the stall
        # alert firing and the straggler recording rule evaluated
        now = time.time()
        scrapes = api.query_range('count_over_time(up{job="colossalai-training"}[1m]) >= 8',
                                  now, now, 1)
        alerts = api.query_range('ALERTS{alertname="TrainingStalled", alertstate="firing"}',
                                 now, now, 1)
        ratio = api.query_range("job_rank:colossalai_training_steps:rate5m_ratio_to_median",
                                now, now, 1)
        # the goodput group runs once a minute (its own interval)
        goodput = api.query_range("colossalai:job_goodput_ratio:1h", now, now, 1)
        return bool(scrapes) and bool(alerts) and bool(ratio) and bool(goodput)

    wait_until(ready, timeout=120, interval=0.5,
               what="scrapes, TrainingStalled, the straggler ratio and goodput")
    end = time.time()
    (up,) = api.query_range('up{job="colossalai-training"}', end - 60, end, 1)
    start = up.times[0]  # from the first scrape: before it Grafana too shows nothing
    out = tmp_path / "png"
    results = {r.uid: r for r in render_all(prometheus, start, end, out,
                                            scrape_interval=1.0)}

    assert set(results) == {"colossalai-training", "colossalai-nodes", "colossalai-chat"}
    for uid, result in results.items():
        assert result.png == out / f"{uid}.png"
        data = result.png.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000, uid
        assert result.errors == {}, (uid, result.errors)  # every query valid in Prometheus
        assert {p.title for p in result.panels} == _titles(uid)

    training = results["colossalai-training"]
    assert training.variables == {"job": "colossalai-training", "rank": ".*"}
    assert set(training.empty_panels) == GEMINI_ONLY | WAITING_PANELS, training.empty_panels
    # The 24 h goodput (query B of the Goodput panel) is evaluated every 5 minutes: it
    # may or may not have run yet, by the group's offset in Prometheus.
    assert set(training.empty_queries) - {"Goodput B"} == {
        "Gemini chunk memory by device A", "Gemini host↔device traffic A",
        "Gemini host↔device traffic B", "Who the job is waiting for A",
        "Where each stalled rank is A", "Share of time waiting for other ranks A",
        "Share of time waiting for other ranks B"}
    (alerts,) = [p for p in training.panels if p.title == "Firing alerts"]
    firing = {s.labels["alertname"] for q in alerts.queries for s in q.series}
    assert firing == {"TrainingStalled"}
    (phase,) = [p for p in training.panels if p.title == "Phase per rank"]
    assert {s.values[-1] for q in phase.queries for s in q.series} == {3.0}  # "training"

    for uid in ("colossalai-nodes", "colossalai-chat"):
        result = results[uid]
        assert result.variables["job"] == "", uid  # no such scrape job
        assert set(result.empty_panels) == _titles(uid) - {"Firing alerts"}, uid

    # the command line: one dashboard, --fail-on-empty exits 1 and names the panels
    only = tmp_path / "only"
    only.mkdir()
    (only / "colossalai-training.json").write_bytes(
        (DASHBOARDS_DIR / "colossalai-training.json").read_bytes())
    code = main(["--prometheus.url", prometheus, "--start", str(start), "--end", str(end),
                 "--scrape-interval", "1s", "--dashboards-dir", str(only),
                 "--output-dir", str(tmp_path / "cli"), "--fail-on-empty"])
    printed = capsys.readouterr().out.splitlines()
    assert code == 1
    assert printed[0].startswith(f"wrote {tmp_path / 'cli' / 'colossalai-training.png'} (")
    assert sorted(printed[1:]) == sorted(f"no data: colossalai-training: {t}"
                                         for t in GEMINI_ONLY | WAITING_PANELS)


def test_legend_text_follows_grafana() -> None:
    labels = {"__name__": "up", "job": "j", "rank": "3"}
    assert legend_text("rank {{rank}} {{ job }}", labels) == "rank 3 j"
    assert legend_text("__auto", labels) == 'up{job="j", rank="3"}'
    assert legend_text("{{missing}}x", labels) == "x"
