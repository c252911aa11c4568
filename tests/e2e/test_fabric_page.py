"""An InfiniBand port that drops reaches the pager: the port, the node, the physical
state and the run's ranks on the node, in the first line; a port that was never up
and a healthy one page no one.

Every part is real but the adapter and Slack: the node agent with its infiniband
collector on a sysfs tree laid out as the kernel's (tests/test_infiniband.py builds
it; the test rewrites a port's state files as the driver would when the link drops),
a TrainingMonitor in this process publishing rank 0 of run "r-ib" into the agent's
run directory, Debian's Prometheus on the shipped node rules (the fabric group every
second and InfiniBandPortDown's `for` shortened through the documented override),
and Debian's Alertmanager on the shipped routing and Slack template.
tests/fake_vigilmon.py stands in for Slack and the webhook receivers.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from colossalai_exporter import TrainingMonitor
from conftest import ServerProcess, cli_env, free_port, wait_until
from fake_vigilmon import fake_vigilmon
from prometheus_helpers import (
    launch_prometheus,
    render_rules,
    running_alertmanager,
    shipped_alertmanager_config,
)
from test_infiniband import port

pytestmark = pytest.mark.slow

OVERRIDE = """
for: {InfiniBandPortDown: 2s, InfiniBandPortsMissing: 2s}
thresholds: {infiniband_evaluation_interval: 1s}
"""


def test_a_port_that_drops_pages_once_naming_the_port_the_node_and_the_run(
        tmp_path: Path) -> None:
    sysfs = tmp_path / "infiniband"
    port(sysfs, "mlx5_0", 1)
    dropping = port(sysfs, "mlx5_1", 1)
    port(sysfs, "mlx5_2", 1, state="1: DOWN", phys="2: Polling")  # never cabled
    run_dir = tmp_path / "run"
    with contextlib.ExitStack() as stop:
        slack = stop.enter_context(fake_vigilmon())
        monitor = TrainingMonitor(rank=0, local_rank=0, world_size=1, serve="none",
                                  run_dir=run_dir, run_id="r-ib", record_signals=False)
        stop.callback(monitor.close)
        monitor.step_done(0.1)

        agent_port = free_port()
        agent = ServerProcess(["node", "--web.listen-address", f"127.0.0.1:{agent_port}",
                               "--no-collector.gpu", "--no-collector.rendezvous",
                               "--no-collector.nccl", "--disk", f"checkpoints={tmp_path}",
                               "--ranks.run-dir", str(run_dir),
                               "--infiniband.sysfs", str(sysfs)], agent_port, cli_env())
        stop.callback(agent.close)
        agent.wait_ready()

        rules = render_rules(tmp_path, OVERRIDE)
        am_config = shipped_alertmanager_config(
            tmp_path, lambda name: f"{slack.url}/hook/{name}",
            lambda name: f"{slack.url}/slack/{name}", "token", lambda config: None)
        alertmanager = stop.enter_context(running_alertmanager(am_config, tmp_path))
        prom_config = tmp_path / "prometheus.yml"
        prom_config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules / "colossalai-node.rules.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [
                {"targets": [alertmanager.removeprefix("http://")]}]}]},
            "scrape_configs": [{"job_name": "colossalai-node", "static_configs": [
                {"targets": [f"127.0.0.1:{agent_port}"]}]}],
        }))
        prometheus = stop.enter_context(launch_prometheus(
            prom_config, tmp_path / "prometheus-data", tmp_path / "prometheus.log", None,
            "--rules.alert.resend-delay=1s"))

        # The port carried traffic (the fabric group recorded it active) and the rank is
        # seen with its run; then the link drops: the driver's files say so.
        wait_until(lambda: prometheus.query(
            'node_device_port:colossalai_infiniband_active:max{device="mlx5_1"} == 1')
            and prometheus.query('colossalai_training_start_timestamp_seconds{run="r-ib"}'),
            timeout=60, interval=0.5, what="mlx5_1 recorded active and rank 0 of r-ib seen")
        (dropping / "state").write_text("1: DOWN\n")
        (dropping / "phys_state").write_text("2: Polling\n")
        (dropping / "counters" / "link_downed").write_text("1\n")

        def pages() -> list[dict[str, Any]]:
            return [json.loads(r.body)["attachments"][0]
                    for r in slack.received("/slack/slack-critical")]

        wait_until(lambda: any("InfiniBandPortDown" in p["title"] for p in pages()),
                   timeout=90, interval=0.5,
                   what=f"InfiniBandPortDown in Slack (log: {tmp_path / 'prometheus.log'})")
        (page,) = [p for p in pages() if "InfiniBandPortDown" in p["title"]]
        # The first line names the port and the node, as on-call reads it; the text why.
        assert page["title"] == ("🔴 FIRING: InfiniBandPortDown — run r-ib — port mlx5_1/1 "
                                 "on 127.0.0.1 — drain for service"), page["title"]
        assert ("Port mlx5_1/1 on 127.0.0.1 is down (physical state: polling: it sees no "
                "peer, the cable or the switch side)") in page["text"], page["text"]
        assert "Ranks of run r-ib on the node: 0." in page["text"], page["text"]
        # The node's verdict says the same, for what reads it instead of a page.
        wait_until(lambda: prometheus.query(
            'node_subsystem:colossalai_hardware_verdict:max{node="127.0.0.1",'
            'subsystem="infiniband"} == 2')
            and prometheus.query('node:colossalai_hardware_remedy:max{node="127.0.0.1",'
                                 'remedy="drain"}'),
            timeout=30, interval=0.5, what="the node's infiniband verdict critical, drain")
        assert not prometheus.query(
            'node_subsystem:colossalai_hardware_verdict:max{subsystem!="infiniband"} != 0')
        # The port never cabled and the healthy one: no alert, no page.
        assert not prometheus.query('ALERTS{device=~"mlx5_0|mlx5_2"}')
        assert all("mlx5_0" not in p["title"] and "mlx5_2" not in p["title"]
                   for p in pages())
