"""Helpers for the deploy/ tests: install layouts in tmp_path, promtool, a real Prometheus."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from conftest import REPO, free_port, http_get, require_binary, wait_until

DEPLOY = REPO / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
RULE_FILES = sorted((REPO / "rules").glob("*.rules.yml"))


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_all_yaml(path: Path) -> list[Any]:
    """Every document of a multi-document file (empty ones dropped)."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def prometheus_layout(root: Path, config: Path = PROMETHEUS_DIR / "prometheus.yml",
                      examples: bool = True) -> Path:
    """``/etc/prometheus`` as docs/deploy.md installs it, under ``root``; the config path.

    The rules are the committed bundle; each ``targets/*/*.example`` is
    installed under its real name, as a user would.
    """
    root.mkdir(parents=True, exist_ok=True)
    target = root / "prometheus.yml"
    shutil.copy(config, target)
    (root / "rules").mkdir(exist_ok=True)
    for rule_file in RULE_FILES:
        shutil.copy(rule_file, root / "rules" / rule_file.name)
    for job in ("colossalai-node", "colossalai-training", "colossalai-chat"):
        (root / "targets" / job).mkdir(parents=True, exist_ok=True)
    if examples:
        for example in PROMETHEUS_DIR.glob("targets/*/*.example"):
            dest = root / "targets" / example.parent.name / example.name.removesuffix(".example")
            shutil.copy(example, dest)
    return target


def promtool_check_config(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_binary("promtool"), "check", "config", *extra, str(config)],
                          capture_output=True, text=True, timeout=60, check=False,
                          cwd=config.parent)


def amtool_check_config(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_binary("amtool"), "check-config", str(config)],
                          capture_output=True, text=True, timeout=60, check=False,
                          cwd=config.parent)


@contextmanager
def running_prometheus(config: Path) -> Iterator[str]:
    """A real Prometheus on ``config`` (loopback, random port); yields its base URL."""
    binary = require_binary("prometheus")
    port = free_port()
    log_path = config.parent / "prometheus.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={config.parent / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, cwd=config.parent)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: http_get(base + "/-/ready", timeout=1)[0] == 200, timeout=30,
                       what=f"prometheus ready (log: {log_path})")
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def active_targets(base: str) -> list[dict[str, Any]]:
    """``/api/v1/targets`` active targets: labels, discoveredLabels, scrapeUrl …"""
    query = urllib.parse.urlencode({"state": "active"})
    status, _, body = http_get(f"{base}/api/v1/targets?{query}", timeout=5)
    assert status == 200, body
    targets: list[dict[str, Any]] = json.loads(body)["data"]["activeTargets"]
    return targets
