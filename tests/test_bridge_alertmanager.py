"""A real Alertmanager (Debian's prometheus-alertmanager 0.25) sends to the real bridge,
which pings the fake Vigilmon: the path a Watchdog alert takes in production."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from fake_vigilmon import FakeVigilmon, fake_vigilmon
from prometheus_helpers import running_alertmanager
from test_bridge_e2e import TOKEN, Start, metric, server_process, write_config

__all__ = ["server_process"]  # the fixture, re-used from the end-to-end tests


@pytest.fixture
def vigilmon() -> Iterator[FakeVigilmon]:
    with fake_vigilmon() as fake:
        yield fake


def test_watchdog_from_alertmanager_reaches_vigilmon_and_criticals_reach_the_webhook(
        server_process: Start, tmp_path: Path, vigilmon: FakeVigilmon) -> None:
    config = write_config(tmp_path / "bridge.yml", tmp_path / "state", [
        {"name": "watchdog", "type": "heartbeat", "url": vigilmon.heartbeat_url("wd-token")},
        {"name": "oncall", "type": "webhook", "url": vigilmon.url + "/oncall",
         "selector": ['severity="critical"'], "signing_secret": "k"},
    ])
    bridge = server_process(config)
    (tmp_path / "token").write_text(TOKEN)
    am_config = {
        "route": {"receiver": "bridge", "group_by": ["alertname"], "group_wait": "0s",
                  "group_interval": "1s", "repeat_interval": "1m"},
        "receivers": [{"name": "bridge", "webhook_configs": [{
            "url": f"{bridge.url}/alertmanager", "send_resolved": True,
            "http_config": {"authorization": {"credentials_file": str(tmp_path / "token")}},
        }]}],
    }
    (tmp_path / "alertmanager.yml").write_text(yaml.safe_dump(am_config))
    with running_alertmanager(tmp_path / "alertmanager.yml", tmp_path) as alertmanager:
        api = f"{alertmanager}/api/v2"
        alerts = [{"labels": {"alertname": "Watchdog", "severity": "none"}},
                  {"labels": {"alertname": "TrainingStalled", "severity": "critical",
                              "job": "llama"}, "annotations": {"summary": "stalled"}}]
        assert requests.post(f"{api}/alerts", json=alerts, timeout=5).ok
        ping = vigilmon.wait_for("/api/heartbeat/wd-token", 1, timeout=20)[0]
        assert ping.method == "GET"
        hook = vigilmon.wait_for("/oncall", 1, timeout=20)[0]
        sent = json.loads(hook.body)
        assert sent["alerts"][0]["labels"]["job"] == "llama"
        assert len(sent["alerts"][0]["fingerprint"]) == 16  # Alertmanager's own fingerprint
        assert "webhook-signature" in hook.headers
        assert metric(bridge, "colossalai_bridge_notifications_rejected_total",
                      reason="unauthorized") == 0
        assert (metric(bridge, "colossalai_bridge_notifications_received_total") or 0) >= 2
