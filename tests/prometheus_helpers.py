"""A real Prometheus (the Debian package's binary) on loopback, for the tests that need one."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from conftest import free_port, http_get, require_binary, run_cli, wait_until


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def api(self, path: str) -> Any:
        """``data`` of a Prometheus HTTP API answer; fails the test on anything but success."""
        assert self.proc.poll() is None, self.log.read_text()
        status, _, body = http_get(self.url + path, timeout=5)
        assert status == 200, body
        return json.loads(body)["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("/api/v1/query?query=" + quote(expr))["result"]
        return result

    def alerts(self, name: str, state: str = "firing") -> list[dict[str, Any]]:
        return [a for a in self.api("/api/v1/alerts")["alerts"]
                if a["labels"]["alertname"] == name and a["state"] == state]


def render_rules(tmp_path: Path, override: str) -> Path:
    """The rules bundle rendered with ``override`` (YAML text) into ``tmp_path/rules``."""
    path = tmp_path / "override.yml"
    path.write_text(override)
    out = tmp_path / "rules"
    rendered = run_cli("rules", "--override", str(path), "--output-dir", str(out),
                       "--kubernetes-output", "")
    assert rendered.returncode == 0, rendered.stderr
    return out


@contextlib.contextmanager
def running_prometheus(tmp_path: Path, config: str) -> Iterator[Prometheus]:
    """Prometheus with ``config`` (YAML text), its own TSDB in tmp_path, stopped afterwards."""
    binary = require_binary("prometheus")
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(config)
    port = free_port()
    log_path = tmp_path / "prometheus.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={config_path}",
             f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=log)
        prometheus = Prometheus(f"http://127.0.0.1:{port}", proc, log_path)
        try:
            wait_until(lambda: http_get(prometheus.url + "/-/ready", timeout=1)[0] == 200,
                       timeout=30, interval=0.2, what="Prometheus ready")
            yield prometheus
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
