"""A Slurm training job whose ranks never start reaches the pager, naming the job and its
rank server in the first line; a job that starts, and a static target between runs,
page no one.

Every part is real but Slack and the job's ranks: the Slurm prolog's target writer
(`python -m colossalai_exporter.slurm write`, as deploy/slurm/prolog-slurmctld.sh runs
it for `sbatch --comment=colossalai`) puts each job's rank server into Prometheus'
file_sd directory; job 4242's server port is bound and never listens (every rank stuck
before it creates its monitor: an import on a hung mount), job 4243's is a
TrainingMonitor in this process serving rank 0. Debian's Prometheus runs the shipped
training rules with TrainingNeverStarted's wait shortened through the documented
override, and Debian's Alertmanager the shipped routing and Slack template.
tests/fake_vigilmon.py stands in for Slack and the webhook receivers.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from colossalai_exporter import TrainingMonitor
from conftest import cli_env, free_port, wait_until
from fake_vigilmon import fake_vigilmon
from prometheus_helpers import (
    launch_prometheus,
    render_rules,
    running_alertmanager,
    shipped_alertmanager_config,
)

pytestmark = pytest.mark.slow

OVERRIDE = """
for: {TrainingNeverStarted: 2s}
thresholds: {training_never_started_after: 15s, training_slow_evaluation_interval: 1s}
"""


def write_targets(sd_dir: Path, job_id: str, name: str, port: int) -> None:
    """What the prolog writes for a training job on one node (127.0.0.1)."""
    env = {**{k: v for k, v in cli_env().items() if not k.startswith("SLURM_")},
           "SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": name, "SLURM_JOB_NODELIST": "127.0.0.1"}
    written = subprocess.run(
        [sys.executable, "-m", "colossalai_exporter.slurm", "write", "--training.port",
         str(port), "--node.port", str(free_port()), "--file-sd.dir", str(sd_dir)],
        capture_output=True, text=True, timeout=30, env=env, check=False)
    assert written.returncode == 0, written.stderr


def test_a_slurm_job_whose_ranks_never_start_pages_naming_the_job(tmp_path: Path) -> None:
    sd_dir = tmp_path / "targets"
    with contextlib.ExitStack() as stop:
        slack = stop.enter_context(fake_vigilmon())
        # Job 4242: its rank server's port is taken and never answers (bound, not
        # listening: refused, as a node where nothing serves yet).
        never = stop.enter_context(socket.socket())
        never.bind(("127.0.0.1", 0))
        write_targets(sd_dir, "4242", "llama-70b", never.getsockname()[1])
        # Job 4243: rank 0 created its monitor and serves.
        served = free_port()
        monitor = TrainingMonitor(rank=0, local_rank=0, world_size=1, serve="rank0",
                                  port=served, run_dir=tmp_path / "run", run_id="4243",
                                  record_signals=False)
        stop.callback(monitor.close)
        monitor.step_done(0.1)
        write_targets(sd_dir, "4243", "sft", served)

        rules = render_rules(tmp_path, OVERRIDE)
        am_config = shipped_alertmanager_config(
            tmp_path, lambda name: f"{slack.url}/hook/{name}",
            lambda name: f"{slack.url}/slack/{name}", "token", lambda config: None)
        alertmanager = stop.enter_context(running_alertmanager(am_config, tmp_path))
        static = socket.socket()  # a static target between runs: nothing serves
        stop.callback(static.close)
        static.bind(("127.0.0.1", 0))
        prom_config = tmp_path / "prometheus.yml"
        prom_config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules / "colossalai-training.rules.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [
                {"targets": [alertmanager.removeprefix("http://")]}]}]},
            "scrape_configs": [{"job_name": "colossalai-training", "file_sd_configs": [
                {"files": [str(sd_dir / "colossalai-training" / "*.json")]}],
                "static_configs": [{"targets": [f"127.0.0.1:{static.getsockname()[1]}"]}]}],
        }))
        prometheus = stop.enter_context(launch_prometheus(
            prom_config, tmp_path / "prometheus-data", tmp_path / "prometheus.log", None,
            "--rules.alert.resend-delay=1s"))

        def pages() -> list[dict[str, Any]]:
            return [json.loads(r.body)["attachments"][0]
                    for r in slack.received("/slack/slack-critical")]

        wait_until(lambda: any("TrainingNeverStarted" in p["title"] for p in pages()),
                   timeout=120, interval=0.5,
                   what=f"TrainingNeverStarted in Slack (log: {tmp_path / 'prometheus.log'})")
        (page,) = [p for p in pages() if "TrainingNeverStarted" in p["title"]]
        never_at = f"127.0.0.1:{never.getsockname()[1]}"
        assert page["title"] == ("🔴 FIRING: TrainingNeverStarted — job colossalai-training "
                                 f"— Slurm job 4242 (llama-70b), rank server {never_at}"), \
            page["title"]
        assert (f"Slurm job 4242 (llama-70b) has run for more than 15s and its rank server "
                f"{never_at} has never answered") in page["text"], page["text"]
        # The job that started and the static target: not even pending.
        firing = prometheus.api("/api/v1/alerts")["alerts"]
        assert [a["labels"] for a in firing
                if a["labels"]["alertname"] == "TrainingNeverStarted"] == [
            {"alertname": "TrainingNeverStarted", "job": "colossalai-training",
             "instance": never_at, "slurm_job_id": "4242", "slurm_job_name": "llama-70b",
             "severity": "critical"}]
