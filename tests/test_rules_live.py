"""The generated rules against the real thing: Prometheus scraping a real rank-0 monitor
and a real node agent, and the stall and rank-down alerts firing through its API.

The ranks, rank 0's server and the node agent are those of ``colossalai-exporter
demo`` (plain-Python backend: real TrainingMonitor processes, a real agent
reading their snapshots), so a renamed metric on either side leaves a rule
visibly dead here rather than silently in production.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from conftest import wait_until
from prometheus_helpers import render_rules, running_prometheus
from test_demo import Demo

pytestmark = pytest.mark.slow


def test_stall_and_rank_down_fire_from_real_monitor_and_agent(tmp_path: Path) -> None:
    rules = render_rules(tmp_path, "for: {TrainingStalled: 2s, TrainingRankDown: 2s}\n")
    demo = Demo(tmp_path / "demo", "--backend", "plain", "--steps", "100000",
                "--step-seconds", "0.02", "--stall-after", "40", "--stall-for", "120",
                "--step-timeout", "3", "--interval", "1")
    try:
        config = f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{rules}/*.rules.yml"]
scrape_configs:
  - job_name: colossalai-training
    static_configs: [{{targets: ["127.0.0.1:{demo.port}"]}}]
  - job_name: colossalai-node
    static_configs: [{{targets: ["127.0.0.1:{demo.agent_port}"]}}]
"""
        with running_prometheus(tmp_path, config) as prometheus:
            (stalled,) = wait_until(lambda: prometheus.alerts("TrainingStalled"), timeout=60,
                                    interval=0.25, what="TrainingStalled firing")
            target = f"127.0.0.1:{demo.port}"
            run = stalled["labels"].pop("run")
            assert run.startswith("demo-")  # one id for the demo's ranks, none of torchrun's
            assert stalled["labels"] == {"alertname": "TrainingStalled", "severity": "critical",
                                         "job": "colossalai-training", "instance": target,
                                         "rank": "0"}
            description = stalled["annotations"]["description"]
            assert description.startswith(f"Rank 0 of job colossalai-training ({target}) has "
                                          "made no training step for "), description
            # where it stalled (the function the demo hangs in, as docs/training.md says
            # the page shows), and the demo's two ranks, both stopped
            assert "(step budget 3s). It is in compute at worker.py:" in description, description
            assert description.endswith(" in hang_like_a_kernel_that_never_returns. 2 rank(s) "
                                        "of this run are stalled."), description

            # The node agent's view of both ranks reaches Prometheus under its own job.
            node = prometheus.query('colossalai_training_stalled{job="colossalai-node"} == 1')
            assert sorted(s["metric"]["rank"] for s in node) == ["0", "1"]
            assert not prometheus.alerts("TrainingRankDown")

            # A rank SIGKILLed: the agent sees its pid gone, the rule names the rank.
            snapshot = json.loads((tmp_path / "demo" / "run" / "rank-1.json").read_text())
            os.kill(int(snapshot["pid"]), signal.SIGKILL)
            (down,) = wait_until(lambda: prometheus.alerts("TrainingRankDown"), timeout=30,
                                 interval=0.25, what="TrainingRankDown firing")
            assert down["labels"]["rank"] == "1" and down["labels"]["cause"] == "process"
            assert down["labels"]["job"] == "colossalai-node"
            assert down["labels"]["run"] == run  # the same run: a cause alert would mute it
    finally:
        demo.close()
