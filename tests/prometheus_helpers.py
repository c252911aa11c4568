"""A real Prometheus and a real Alertmanager (the Debian packages' binaries) on loopback,
for the tests that need them."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from conftest import REPO, free_port, http_get, require_binary, run_cli, stop_process, wait_until


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


def start_prometheus(config_path: Path, data_dir: Path, log_path: Path,
                     cwd: Path | None = None, *extra_args: str,
                     port: int | None = None, binary: str | None = None) -> Prometheus:
    """Prometheus on ``config_path`` (loopback, ``port`` or a free one), ready; the caller
    stops its ``proc`` (launch_prometheus does). ``binary``: another Prometheus than the
    one on PATH (conftest.require_prometheus3)."""
    binary = binary or require_binary("prometheus")
    port = port or free_port()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={config_path}", f"--storage.tsdb.path={data_dir}",
             f"--web.listen-address=127.0.0.1:{port}", *extra_args],
            stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    prometheus = Prometheus(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        wait_until(lambda: http_get(prometheus.url + "/-/ready", timeout=1)[0] == 200,
                   timeout=30, interval=0.2, what=f"Prometheus ready (log: {log_path})")
    except BaseException:
        stop_process(proc, timeout=15)
        raise
    return prometheus


@contextlib.contextmanager
def launch_prometheus(config_path: Path, data_dir: Path, log_path: Path,
                      cwd: Path | None = None, *extra_args: str,
                      binary: str | None = None) -> Iterator[Prometheus]:
    """Prometheus on ``config_path`` (loopback, a free port), ready; stopped afterwards."""
    prometheus = start_prometheus(config_path, data_dir, log_path, cwd, *extra_args,
                                  binary=binary)
    try:
        yield prometheus
    finally:
        stop_process(prometheus.proc, timeout=15)


@contextlib.contextmanager
def running_prometheus(tmp_path: Path, config: str) -> Iterator[Prometheus]:
    """Prometheus with ``config`` (YAML text), its own TSDB in tmp_path, stopped afterwards."""
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(config)
    with launch_prometheus(config_path, tmp_path / "prometheus-data",
                           tmp_path / "prometheus.log") as prometheus:
        yield prometheus


def shipped_alertmanager_config(tmp: Path, webhook_url: Callable[[str], str],
                                slack_url: Callable[[str], str], token: str,
                                adjust: Callable[[dict[str, Any]], None]) -> Path:
    """deploy/alertmanager/alertmanager.yml with its receivers on loopback, written to
    ``tmp``: each webhook to ``webhook_url(receiver name)`` with ``token`` as its bearer
    credentials file, each Slack webhook to ``slack_url(receiver name)``; ``adjust``
    changes the routes' timings. Routes, inhibitions and templates stay as shipped."""
    source = REPO / "deploy" / "alertmanager"
    config: dict[str, Any] = yaml.safe_load((source / "alertmanager.yml").read_text())
    config["templates"] = [str(source / "templates" / "*.tmpl")]
    adjust(config)
    credentials = tmp / "bridge-token"
    credentials.write_text(token)
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = webhook_url(receiver["name"])
            hook["http_config"]["authorization"]["credentials_file"] = str(credentials)
        for slack in receiver.get("slack_configs", []):
            secret = tmp / f"{receiver['name']}-url"
            secret.write_text(slack_url(receiver["name"]))
            slack["api_url_file"] = str(secret)
    path = tmp / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def running_alertmanager(config_path: Path, tmp_path: Path,
                         binary: str | None = None) -> Iterator[str]:
    """Alertmanager on ``config_path`` (loopback, a free port, no cluster), ready; yields
    its base URL and stops it afterwards. State in tmp_path/am-data, log in
    tmp_path/alertmanager.log. ``binary``: another than the one on PATH."""
    binary = binary or require_binary("prometheus-alertmanager")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "alertmanager.log"
    with log_path.open("w") as log:
        # --cluster.listen-address= : no gossip port, which would need a second free port
        # and could join another test's Alertmanager on the same machine.
        proc = subprocess.Popen(
            [binary, f"--config.file={config_path}", f"--storage.path={tmp_path / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: http_get(url + "/-/ready", timeout=1)[0] == 200, timeout=30,
                       interval=0.2, what=f"Alertmanager ready (log: {log_path})")
            yield url
        finally:
            stop_process(proc, timeout=15)


@contextlib.contextmanager
def serving(collector: Collector) -> Iterator[str]:
    """``collector``'s exposition on a loopback HTTP server; yields its ``host:port``."""
    registry = CollectorRegistry()
    registry.register(collector)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
