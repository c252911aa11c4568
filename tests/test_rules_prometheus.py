"""The generated rules in a real Prometheus, scraping a real HTTP exposition of a stalled rank.

The exposition is built with the catalogue's own families (so a renamed metric
changes both sides) and served by a small loopback HTTP server standing in for
rank 0's monitor: it mimics TrainingMonitor's /metrics for two ranks, one
stalled and one stepping. Rules are rendered with `for: 2s` (an override file,
as users would) and evaluated every second.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from colossalai_exporter import catalogue
from conftest import wait_until
from prometheus_helpers import render_rules, running_prometheus, serving

pytestmark = pytest.mark.slow


class StalledRanks(Collector):
    """Rank 0 stopped stepping 100 s ago with a 5 s budget; rank 1 steps at every scrape."""

    def __init__(self) -> None:
        self.started = time.time() - 100

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        phase = catalogue.gauge("colossalai_training_phase")
        start = catalogue.gauge("colossalai_training_phase_start_timestamp_seconds")
        last = catalogue.gauge("colossalai_training_last_step_timestamp_seconds")
        budget = catalogue.gauge("colossalai_training_step_timeout_seconds")
        steps = catalogue.counter("colossalai_training_steps_total")
        for rank, last_step in (("0", self.started), ("1", now)):
            for name in ("init", "kernels", "training", "checkpointing"):
                phase.add_metric([rank, name], 1.0 if name == "training" else 0.0)
            start.add_metric([rank], self.started)
            last.add_metric([rank], last_step)
            budget.add_metric([rank], 5.0)
            steps.add_metric([rank], 42.0)
        yield from (phase, start, last, budget, steps)


@pytest.fixture
def exposition() -> Iterator[str]:
    with serving(StalledRanks()) as address:
        yield address


def test_training_stalled_fires_in_prometheus(tmp_path: Path, exposition: str) -> None:
    rules = render_rules(tmp_path, "for: {TrainingStalled: 2s}\n")
    config = f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{rules}/*.rules.yml"]
scrape_configs:
  - job_name: colossalai-training
    static_configs: [{{targets: ["{exposition}"]}}]
"""
    with running_prometheus(tmp_path, config) as prometheus:
        started = time.monotonic()
        (alert,) = wait_until(lambda: prometheus.alerts("TrainingStalled"), timeout=30,
                              interval=0.25, what="TrainingStalled firing")
        assert time.monotonic() - started < 30
        assert alert["labels"] == {"alertname": "TrainingStalled", "severity": "critical",
                                   "job": "colossalai-training", "instance": exposition,
                                   "rank": "0"}
        description = alert["annotations"]["description"]
        assert description.startswith(f"Rank 0 of job colossalai-training ({exposition}) has "
                                      "made no training step for 1m 4")
        assert description.endswith("(step budget 5s).")
        assert alert["annotations"]["runbook_url"].endswith("runbooks.md#trainingstalled")

        # every rule in every file evaluates without error against live data
        groups = prometheus.api("/api/v1/rules")["groups"]
        assert {g["file"].rsplit("/", 1)[-1] for g in groups} == {
            f"colossalai-{n}.rules.yml"
            for n in ("training", "node", "chat", "chat-engines", "pipeline")}
        # Groups on the global 1 s interval, and the goodput-1h group (once a minute):
        # every rule evaluated, healthy. The goodput-24h group (every 5 minutes) may not
        # have run yet: its rules are run as queries instead, which must not fail.
        def frequent(group: dict[str, Any]) -> bool:
            return float(group["interval"]) <= 60

        wait_until(lambda: all(r.get("lastEvaluation", "").startswith("2")
                               and not r["lastEvaluation"].startswith("0001")
                               for g in prometheus.api("/api/v1/rules")["groups"]
                               if frequent(g) for r in g["rules"]),
                   timeout=90, interval=0.5, what="every rule evaluated")
        groups = prometheus.api("/api/v1/rules")["groups"]
        for group in groups:
            for rule in group["rules"]:
                if frequent(group):
                    assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
                else:
                    prometheus.query(rule["query"])  # fails the test on an error
        assert [g["name"] for g in groups if not frequent(g)] == [
            "colossalai-training.goodput-24h"]
