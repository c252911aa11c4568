"""A chat server that answers but generates nothing reaches the pager, named, with its reason.

Every part is real but Slack: a uvicorn server on loopback that streams in the
OpenAI-compatible shape (tests/chat_servers.py), the prober with a streaming
module, Debian's Prometheus on the shipped chat job (deploy/prometheus/
prometheus.yml, a target group picking the module) and the shipped chat rules
(their `for` shortened through the documented override), and Debian's
Alertmanager on the shipped routing and Slack template. One stream wedges after
two tokens while the server's /health stays 200; another target on the same
server streams normally and must page no one. tests/fake_vigilmon.py stands in
for Slack and the webhook receivers.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from chat_servers import served, streaming_app
from conftest import REPO, ServerProcess, cli_env, free_port, http_get, wait_until
from fake_vigilmon import fake_vigilmon
from prometheus_helpers import (
    launch_prometheus,
    render_rules,
    running_alertmanager,
    shipped_alertmanager_config,
)

pytestmark = pytest.mark.slow

PROBER_CONFIG = """
allow: {loopback: true}
modules:
  chat_stream:
    prober: stream
    timeout: 10s
    stream: {format: openai, first_token_timeout: 3s, max_token_gap: 1s}
"""


def prometheus_config(targets: list[str], prober: str, alertmanager: str,
                      rules: Path) -> dict[str, Any]:
    """The shipped colossalai-chat job, its targets in one group picking the stream module."""
    shipped: dict[str, Any] = yaml.safe_load(
        (REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in shipped["scrape_configs"] if j["job_name"] == "colossalai-chat"]
    job.pop("file_sd_configs")
    job["static_configs"] = [{"targets": targets, "labels": {"__param_module": "chat_stream"}}]
    for relabel in job["relabel_configs"]:
        if relabel.get("target_label") == "__address__":
            relabel["replacement"] = prober
    return {
        # A probe may take up to the scrape timeout less the prober's 0.5 s offset: the
        # stream module's limits (3 s, 1 s) fit in it.
        "global": {"scrape_interval": "5s", "scrape_timeout": "5s",
                   "evaluation_interval": "2s"},
        "rule_files": [str(rules / "colossalai-chat.rules.yml")],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
        "scrape_configs": [job],
    }


def test_a_wedged_stream_pages_as_generating_nothing_and_a_healthy_one_pages_no_one(
        tmp_path: Path) -> None:
    state: dict[str, Any] = {}
    with contextlib.ExitStack() as stop:
        slack = stop.enter_context(fake_vigilmon())
        url = stop.enter_context(served(streaming_app(state)))
        wedged, healthy = f"{url}/wedge", f"{url}/ok"
        assert http_get(f"{url}/health")[0] == 200  # what the server's liveness check says

        config = tmp_path / "probe.yml"
        config.write_text(PROBER_CONFIG)
        prober_port = free_port()
        prober = ServerProcess(["probe", "--config.file", str(config), "--web.listen-address",
                                f"127.0.0.1:{prober_port}"], prober_port, cli_env())
        stop.callback(prober.close)
        prober.wait_ready("/health")

        rules = render_rules(tmp_path, "for: {ChatGeneratingNothing: 10s}\n")
        am_config = shipped_alertmanager_config(
            tmp_path, lambda name: f"{slack.url}/hook/{name}",
            lambda name: f"{slack.url}/slack/{name}", "token", lambda config: None)
        alertmanager = stop.enter_context(running_alertmanager(am_config, tmp_path))
        prom_config = tmp_path / "prometheus.yml"
        prom_config.write_text(yaml.safe_dump(prometheus_config(
            [wedged, healthy], f"127.0.0.1:{prober_port}",
            alertmanager.removeprefix("http://"), rules)))
        prometheus = stop.enter_context(launch_prometheus(
            prom_config, tmp_path / "prometheus-data", tmp_path / "prometheus.log", None,
            "--rules.alert.resend-delay=2s"))

        def pages() -> list[dict[str, Any]]:
            return [json.loads(r.body)["attachments"][0]
                    for r in slack.received("/slack/slack-critical")]

        wait_until(lambda: any("ChatGeneratingNothing" in p["title"] for p in pages()),
                   timeout=150, interval=1,
                   what=f"ChatGeneratingNothing in Slack (log: {tmp_path / 'prometheus.log'})")
        (page,) = [p for p in pages() if "ChatGeneratingNothing" in p["title"]]
        # The first line names the server and why, as on-call reads it.
        assert page["title"] == (f"🔴 FIRING: ChatGeneratingNothing — job colossalai-chat — "
                                 f"{wedged} (token_gap)"), page["title"]
        assert "token_gap" in page["text"] and "tokens in the last probe: 1." in page["text"], \
            page["text"]
        # The healthy stream on the same server: probed, passing, and paging no one.
        assert prometheus.query(f'probe_success{{instance="{healthy}"}} == 1')
        assert prometheus.query(
            f'colossalai_probe_stream_completed{{instance="{healthy}"}} == 1')
        assert not prometheus.query(f'ALERTS{{instance="{healthy}"}}')
        assert all(healthy not in p["title"] for p in pages())
        # Nothing pages as "down": the server answered every probe.
        assert not prometheus.query('ALERTS{alertname="ChatServerDown"}')
