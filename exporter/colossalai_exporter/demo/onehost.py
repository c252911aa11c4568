"""A ready folder of configs for one host, made from the shipped ones.

``colossalai-exporter demo --alerting`` runs the real Prometheus, Alertmanager and
bridge on these files, and they are the by-hand recipe of docs/deploy.md ("One
host by hand") done for you: the shipped ``deploy/prometheus/prometheus.yml`` and
``deploy/alertmanager/alertmanager.yml`` with only the substitutions docs/deploy.md
lists (tests/test_demo.py holds the files to exactly those), the rules rendered with
an override, the secret files created, and a bridge config delivering to a receiver
of your choice.

Layout under the folder::

    prometheus/prometheus.yml            the shipped file, loopback addresses
    prometheus/rules/*.rules.yml         `colossalai-exporter rules --override rules-override.yml`
    prometheus/targets/<job>/local.yml   this host's node agent and rank 0
    alertmanager/alertmanager.yml        the shipped file, loopback bridge, secrets here
    alertmanager/templates/*.tmpl        the shipped Slack templates
    alertmanager/secrets/                bridge-token, slack-critical-url, slack-warning-url
    bridge/bridge.yml                    the Watchdog heartbeat and one on-call webhook
    bridge/secrets/bridge-token          the same token Alertmanager sends
    rules-override.yml                   the shortened `for` windows, said on screen
"""

from __future__ import annotations

import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from colossalai_exporter import checkout
from colossalai_exporter.rulesgen import cli as rules_cli

# The demo scrapes and evaluates more often than the shipped 15 s, to page sooner.
DEMO_INTERVAL = "5s"

# The documented override mechanism (docs/rules.md): the shipped rules with `for`
# windows short enough that a failure pages within a minute.
RULES_OVERRIDE = """\
# colossalai-exporter demo --alerting: the shipped rules (rules/config.yml) with
# shorter `for` windows, so that the demo's failure pages within about a minute.
# Render your own the same way: colossalai-exporter rules --override this-file.yml
grafana_url: "http://{host}:3000"   # where Grafana would listen on this host
for:
  TrainingStalled: 10s
  TrainingRankDown: 15s
  TrainingNodeLost: 15s
  CheckpointStuck: 15s
"""


@dataclass(frozen=True)
class Ports:
    """Where each part of the stack listens on the host."""

    prometheus: int = 9090
    alertmanager: int = 9093
    bridge: int = 9468
    agent: int = 9466  # the node agent's default
    rank0: int = 8766  # TrainingMonitor's default
    pager: int = 9469


@dataclass(frozen=True)
class Folder:
    """The written folder's paths the stack is started with."""

    root: Path

    @property
    def prometheus_config(self) -> Path:
        return self.root / "prometheus" / "prometheus.yml"

    @property
    def alertmanager_config(self) -> Path:
        return self.root / "alertmanager" / "alertmanager.yml"

    @property
    def bridge_config(self) -> Path:
        return self.root / "bridge" / "bridge.yml"


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return data


def dump(path: Path, data: object, header: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    comments = "".join(f"# {line}\n" for line in header.splitlines())
    path.write_text(comments + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


def write_secret(path: Path, value: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value + "\n", encoding="utf-8")
    path.chmod(0o600)
    return path


def prometheus_config(host: str, ports: Ports) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with the substitutions above."""
    config = load(checkout.deploy_file("prometheus/prometheus.yml"))
    config["global"]["scrape_interval"] = DEMO_INTERVAL
    config["global"]["scrape_timeout"] = DEMO_INTERVAL
    config["global"]["evaluation_interval"] = DEMO_INTERVAL
    here = {"alertmanager:9093": f"{host}:{ports.alertmanager}",
            "colossalai-bridge:9468": f"{host}:{ports.bridge}",
            "localhost:9090": f"{host}:{ports.prometheus}"}
    for manager in config["alerting"]["alertmanagers"]:
        for group in manager["static_configs"]:
            group["targets"] = [here.get(t, t) for t in group["targets"]]
    jobs = []
    for job in config["scrape_configs"]:
        if job["job_name"] == "colossalai-prober":
            continue
        for group in job.get("static_configs", []):
            group["targets"] = [here.get(t, t) for t in group["targets"]]
        jobs.append(job)
    config["scrape_configs"] = jobs
    return config


def alertmanager_config(host: str, ports: Ports, secrets_dir: Path) -> dict[str, Any]:
    """deploy/alertmanager/alertmanager.yml with the substitutions above."""
    config = load(checkout.deploy_file("alertmanager/alertmanager.yml"))
    bridge = f"http://{host}:{ports.bridge}/alertmanager"
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = bridge
            auth = hook["http_config"]["authorization"]
            auth["credentials_file"] = str(secrets_dir / Path(auth["credentials_file"]).name)
        for slack in receiver.get("slack_configs", []):
            slack["api_url_file"] = str(secrets_dir / Path(slack["api_url_file"]).name)
    return config


def bridge_config(root: Path, pager: str) -> dict[str, Any]:
    """The bridge: the Watchdog as a heartbeat and every other alert to one webhook,
    both at ``pager`` (in a real deployment, Vigilmon's heartbeat URL and your on-call
    tool's webhook: deploy/bridge/bridge.example.yml)."""
    return {
        "state_dir": str(root / "bridge" / "state"),
        "receiver": {"bearer_token_file": str(root / "bridge" / "secrets" / "bridge-token")},
        "targets": [
            {"name": "watchdog", "type": "heartbeat", "url": f"{pager}/heartbeat/watchdog",
             "selector": ['alertname="Watchdog"'], "period": "1m", "ttl": "2m"},
            {"name": "oncall", "type": "webhook", "url": f"{pager}/webhook/oncall",
             "selector": ['alertname!="Watchdog"']},
        ],
    }


def write(root: Path, host: str, ports: Ports) -> Folder:
    """Write the folder (replacing files of an earlier run; Prometheus' and the bridge's
    data directories are kept, as a restarted service keeps them)."""
    folder = Folder(root)
    pager = f"http://{host}:{ports.pager}"
    origin = ("Made by `colossalai-exporter demo --alerting` from {source}; what differs "
              "is listed in docs/deploy.md, 'One host by hand'.")

    override = root / "rules-override.yml"
    override.parent.mkdir(parents=True, exist_ok=True)
    override.write_text(RULES_OVERRIDE.format(host=host), encoding="utf-8")
    rules_dir = root / "prometheus" / "rules"
    shutil.rmtree(rules_dir, ignore_errors=True)
    for path, text in rules_cli.generate(rules_cli.DEFAULT_CONFIG, [override], rules_dir,
                                         None).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")

    dump(folder.prometheus_config, prometheus_config(host, ports),
         origin.format(source="deploy/prometheus/prometheus.yml"))
    for job, port in (("colossalai-node", ports.agent), ("colossalai-training", ports.rank0)):
        dump(root / "prometheus" / "targets" / job / "local.yml",
             [{"targets": [f"{host}:{port}"]}],
             f"{job} on this host (file_sd: add a node's or a run's file beside it)")

    secrets_dir = root / "alertmanager" / "secrets"
    token = secrets.token_urlsafe(24)
    write_secret(secrets_dir / "bridge-token", token)
    write_secret(root / "bridge" / "secrets" / "bridge-token", token)
    for channel in ("slack-critical", "slack-warning"):
        # Your Slack incoming-webhook URLs go here; the demo's pager stands in for Slack.
        write_secret(secrets_dir / f"{channel}-url", f"{pager}/slack/{channel}")
    dump(folder.alertmanager_config, alertmanager_config(host, ports, secrets_dir),
         origin.format(source="deploy/alertmanager/alertmanager.yml"))
    templates = root / "alertmanager" / "templates"
    shutil.rmtree(templates, ignore_errors=True)
    shutil.copytree(checkout.deploy_file("alertmanager/templates"), templates)

    dump(folder.bridge_config, bridge_config(root, pager),
         "The bridge for one host: see deploy/bridge/bridge.example.yml for every target kind.")
    return folder
