"""A real Prometheus (Debian's 2.42) scrapes the prober through blackbox exporter's relabel pattern.

The scrape config is the one blackbox exporter documents, unchanged but for the
module, the targets and the prober's address: it must work as is for users
moving from blackbox exporter.
"""

from __future__ import annotations

import json
import subprocess
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from chat_servers import inference_app, served
from conftest import (
    ServerProcess,
    cli_env,
    free_port,
    http_get,
    refused_port,
    require_binary,
    stop_process,
    wait_until,
)

SCRAPE_CONFIG = """
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: colossal_inference
    metrics_path: /probe
    params:
      module: [colossal_inference]
    static_configs:
      - targets:
        - {healthy}
        - {refused}
    relabel_configs:
      - source_labels: [__address__]
        target_label: __param_target
      - source_labels: [__param_target]
        target_label: instance
      - target_label: __address__
        replacement: {prober}
"""

pytestmark = pytest.mark.slow


def query(base: str, expr: str) -> list[dict[str, Any]]:
    status, _, body = http_get(f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
    assert status == 200, body
    result: list[dict[str, Any]] = json.loads(body)["data"]["result"]
    return result


def test_prometheus_sees_probe_success_per_target(tmp_path: Path) -> None:
    binary = require_binary("prometheus")
    prober_port, prom_port = free_port(), free_port()
    prober = ServerProcess(["probe", "--web.listen-address", f"127.0.0.1:{prober_port}"],
                           prober_port, cli_env())
    with served(inference_app({"engine": "Running"})) as healthy, refused_port() as closed:
        refused = f"http://127.0.0.1:{closed}"
        config = tmp_path / "prometheus.yml"
        config.write_text(SCRAPE_CONFIG.format(healthy=healthy, refused=refused,
                                               prober=f"127.0.0.1:{prober_port}"))
        log = (tmp_path / "prometheus.log").open("w")
        prom = subprocess.Popen([binary, f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{prom_port}"
        try:
            prober.wait_ready("/health")

            def both() -> dict[str, dict[str, Any]] | None:
                found = {r["metric"]["instance"]: r for r in query(base, "probe_success")}
                return found if len(found) == 2 else None

            found = wait_until(both, 30, interval=0.5, what="probe_success for both targets")
            assert found[healthy]["value"][1] == "1"
            assert found[healthy]["metric"]["job"] == "colossal_inference"
            assert found[refused]["value"][1] == "0"
            reasons = query(base, "probe_failure_info")
            assert [(r["metric"]["instance"], r["metric"]["reason"]) for r in reasons] == [
                (refused, "refused")]
            up = {r["metric"]["instance"]: r["value"][1] for r in query(base, "up")}
            assert up == {healthy: "1", refused: "1"}  # the prober answered both scrapes
        finally:
            stop_process(prom, timeout=15)
            log.close()
            prober.close()
