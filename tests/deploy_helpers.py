"""Helpers for the deploy/ tests: install layouts, promtool, a real Prometheus, file parsers."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from colossalai_exporter.flags import ArgumentParser, add_common_flags
from colossalai_exporter.node.config import NodeConfig, add_node_flags, load_config
from conftest import REPO, http_get, require_binary
from prometheus_helpers import launch_prometheus

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
    for job in ("colossalai-node", "colossalai-training", "colossalai-chat",
                "colossalai-chat-app"):
        (root / "targets" / job).mkdir(parents=True, exist_ok=True)
    if examples:
        for example in PROMETHEUS_DIR.glob("targets/*/*.example"):
            dest = root / "targets" / example.parent.name / example.name.removesuffix(".example")
            shutil.copy(example, dest)
    return target


def promtool_check_config(config: Path, *extra: str, promtool: str | None = None
                          ) -> subprocess.CompletedProcess[str]:
    promtool = promtool or require_binary("promtool")
    return subprocess.run([promtool, "check", "config", *extra, str(config)],
                          capture_output=True, text=True, timeout=60, check=False,
                          cwd=config.parent)


def amtool_check_config(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_binary("amtool"), "check-config", str(config)],
                          capture_output=True, text=True, timeout=60, check=False,
                          cwd=config.parent)


@contextmanager
def running_prometheus(config: Path) -> Iterator[str]:
    """A real Prometheus on ``config`` (loopback, random port); yields its base URL.

    Run in the config's directory, so its relative rule and file_sd paths resolve.
    """
    with launch_prometheus(config, config.parent / "data", config.parent / "prometheus.log",
                           cwd=config.parent) as prometheus:
        yield prometheus.url


def active_targets(base: str) -> list[dict[str, Any]]:
    """``/api/v1/targets`` active targets: labels, discoveredLabels, scrapeUrl …"""
    query = urllib.parse.urlencode({"state": "active"})
    status, _, body = http_get(f"{base}/api/v1/targets?{query}", timeout=5)
    assert status == 200, body
    targets: list[dict[str, Any]] = json.loads(body)["data"]["activeTargets"]
    return targets


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> list[Stage]:
    """Instructions per stage: continuation lines joined, comments and blanks dropped."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, parts[0]))
        elif stages:
            stages[-1].instructions.append((keyword, args.strip()))
    return stages


def node_config(args: list[str]) -> NodeConfig:
    """What ``colossalai-exporter node ARGS`` would run with (its own flag parser)."""
    parser = ArgumentParser(prog="node")
    add_common_flags(parser, 9466)
    add_node_flags(parser)
    return load_config(parser.parse_args(args), env={})
