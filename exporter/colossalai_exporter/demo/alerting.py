"""``demo --alerting``: the real alert path on one host, from a failure to the page.

Prometheus with the shipped rules, Alertmanager with the shipped routing,
inhibition and Slack templates, and the bridge, all started from the folder
onehost.py writes, on loopback, each in its own process group (stopped with the
demo). The pager (pager.py) stands in for Slack, the on-call webhook and the
Vigilmon heartbeat; what reaches it is printed as on-call would read it, with
the seconds since the failure.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from colossalai_exporter.demo import onehost
from colossalai_exporter.demo.launch import Started, spawn
from colossalai_exporter.demo.pager import Pager, describe, firing
from colossalai_exporter.errors import ConfigError

INSTALL_HINT = ("install them with: sudo apt-get install prometheus prometheus-alertmanager "
                "(Debian, Ubuntu), or put the upstream prometheus and alertmanager binaries "
                "on PATH")


def binaries() -> tuple[str, str]:
    """Prometheus and Alertmanager: Debian names its Alertmanager prometheus-alertmanager,
    the upstream tarball alertmanager."""
    prometheus = shutil.which("prometheus")
    alertmanager = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    missing = [name for name, path in (("prometheus", prometheus),
                                       ("prometheus-alertmanager", alertmanager)) if not path]
    if missing or prometheus is None or alertmanager is None:
        raise ConfigError(f"--alerting needs Prometheus and Alertmanager, and "
                          f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on "
                          f"PATH: {INSTALL_HINT}")
    return prometheus, alertmanager


def commands(folder: onehost.Folder, host: str, ports: onehost.Ports,
             prometheus: str, alertmanager: str) -> dict[str, list[str]]:
    """The three services' command lines, as docs/deploy.md ("One host by hand") gives
    them; the demo prints them."""
    root = folder.root
    return {
        "prometheus": [
            prometheus, f"--config.file={folder.prometheus_config}",
            f"--storage.tsdb.path={root / 'prometheus' / 'data'}",
            f"--web.listen-address={host}:{ports.prometheus}",
            f"--web.external-url=http://{host}:{ports.prometheus}"],
        "alertmanager": [
            alertmanager, f"--config.file={folder.alertmanager_config}",
            f"--storage.path={root / 'alertmanager' / 'data'}",
            f"--web.listen-address={host}:{ports.alertmanager}",
            # No gossip: a single Alertmanager would otherwise listen on :9094 on every
            # interface and try to join a cluster.
            "--cluster.listen-address=",
            f"--web.external-url=http://{host}:{ports.alertmanager}"],
        "bridge": [
            sys.executable, "-m", "colossalai_exporter", "bridge",
            f"--config.file={folder.bridge_config}",
            f"--web.listen-address={host}:{ports.bridge}"],
    }


@dataclass
class AlertStack:
    """The started services and the pager."""

    folder: onehost.Folder
    services: Started
    pager: Pager
    argv: dict[str, list[str]]

    def stop(self) -> None:
        self.services.stop()
        self.pager.close()


def start(workdir: Path, host: str, ports: onehost.Ports,
          found: tuple[str, str]) -> AlertStack:
    """Write the folder and start the services (logs in ``workdir``) with the Prometheus
    and Alertmanager :func:`binaries` found; the caller stops them."""
    prometheus, alertmanager = found
    folder = onehost.write(workdir / "stack", host, ports)
    argv = commands(folder, host, ports, prometheus, alertmanager)
    pager = Pager(host, ports.pager)
    procs = []
    try:
        for name, command in argv.items():
            with open(workdir / f"{name}.log", "ab") as log:
                procs.append(spawn(command, log))
    except BaseException:
        Started(procs).stop()
        pager.close()
        raise
    return AlertStack(folder, Started(procs), pager, argv)


def introduce(stack: AlertStack, host: str, ports: onehost.Ports, workdir: Path) -> list[str]:
    """What the demo says about the stack before the run."""
    lines = [f"  Prometheus       http://{host}:{ports.prometheus}/alerts",
             f"  Alertmanager     http://{host}:{ports.alertmanager}",
             f"  bridge           http://{host}:{ports.bridge}/metrics",
             f"  pager            {host}:{ports.pager} (stands in for Slack, the on-call "
             "webhook and the Vigilmon heartbeat)",
             f"  configs          {stack.folder.root}   (the shipped deploy/ files for one "
             "host: docs/deploy.md, 'One host by hand')",
             f"  rules            shipped, `for` windows shortened by "
             f"{stack.folder.root / 'rules-override.yml'}",
             f"  service logs     {workdir}/{{prometheus,alertmanager,bridge}}.log",
             "  started:"]
    lines += [f"    {shlex.join(command)}" for command in stack.argv.values()]
    return lines


@dataclass
class PageWatch:
    """Turns what reached the pager into lines: every notification that fires, with
    its seconds after the failure, and the Watchdog's first heartbeat."""

    pager: Pager
    seen: int = 0
    pages: int = 0
    heartbeat: bool = False

    def look(self, failure_at: float | None) -> list[str]:
        lines = []
        new = self.pager.received(self.seen)
        self.seen += len(new)
        for received in new:
            if received.path.startswith("/heartbeat/"):
                if not self.heartbeat:
                    self.heartbeat = True
                    lines.append("the Watchdog's heartbeat reached the pager through "
                                 "Alertmanager and the bridge: the alert path is live")
                continue
            if not firing(received):
                continue
            self.pages += 1
            when = (f"{received.at - failure_at:.0f} s after the failure"
                    if failure_at is not None else "before any failure was injected")
            where = ("Slack " + received.path.removeprefix("/slack/")
                     if received.path.startswith("/slack/")
                     else "the bridge's webhook " + received.path.removeprefix("/webhook/"))
            first = "PAGE" if self.pages == 1 else "page"
            lines.append(f"{first} to {where}, {when}:")
            lines += [f"    | {line}" for line in describe(received)]
        return lines
