"""One fault case's whole stack: a real ColossalAI job, the node agent, Prometheus with
the shipped rules, Alertmanager with the shipped routing, and a recording receiver.

Everything is real but the receiver: ``tests/fake_vigilmon.py`` records what
Alertmanager sends to the bridge's webhook and to Slack's incoming webhooks
(both receivers of deploy/alertmanager/alertmanager.yml, rewritten only for
loopback addresses and shorter waits). The rules are rendered from
rules/config.yml through the documented override mechanism (`colossalai-exporter
rules --override`) with short `for` windows, and Prometheus scrapes and evaluates
every second.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psutil
import requests
import yaml

from colossalai_exporter.training.snapshot import Snapshot, read_snapshot, snapshot_path
from conftest import ServerProcess, cli_env, free_port, wait_until
from fake_vigilmon import FakeVigilmon, Recorded
from prometheus_helpers import (
    Prometheus,
    launch_prometheus,
    render_rules,
    running_alertmanager,
    shipped_alertmanager_config,
)

INTERVAL = 1.0  # Prometheus' scrape and evaluation interval in the suite
# The documented override mechanism (docs/rules.md): shorter `for` windows, so that
# each case pages within seconds; the rules themselves are the shipped ones.
RULES_OVERRIDE = """
expected_jobs: [colossalai-node]
for:
  TrainingStalled: 5s
  TrainingHangSuspect: 0s
  TrainingStraggler: 5s
  TrainingStartupStuck: 2s
  CheckpointStuck: 2s
  TrainingRankDown: 10s
  NCCLRendezvousDown: 10s
"""
# Alertmanager's waits before a group's first notification, shortened like the rules.
GROUP_WAIT = "1s"
TRAIN_SCRIPT = Path(__file__).with_name("train.py")


def alertmanager_config(tmp: Path, receiver_url: str) -> Path:
    """deploy/alertmanager/alertmanager.yml with loopback receivers and 1 s group waits."""
    def short_waits(config: dict[str, Any]) -> None:
        config["route"]["group_wait"] = GROUP_WAIT
        for route in config["route"]["routes"]:
            route["group_wait"] = "0s" if route.get("receiver") == "bridge-watchdog" \
                else GROUP_WAIT

    return shipped_alertmanager_config(tmp, lambda name: f"{receiver_url}/bridge/{name}",
                                       lambda name: f"{receiver_url}/slack/{name}", "faults",
                                       short_waits)


def prometheus_config(tmp: Path, rules: Path, alertmanager: str, rank0: str,
                      agent: str) -> Path:
    config = {
        "global": {"scrape_interval": f"{INTERVAL:g}s", "scrape_timeout": f"{INTERVAL:g}s",
                   "evaluation_interval": f"{INTERVAL:g}s"},
        "rule_files": [str(rules / "*.rules.yml")],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
        "scrape_configs": [
            {"job_name": "colossalai-training", "static_configs": [{"targets": [rank0]}]},
            {"job_name": "colossalai-node", "static_configs": [{"targets": [agent]}]},
        ],
    }
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class Job:
    """torchrun with ranks of tests/faults/train.py (two, or four), in a process group of
    its own."""

    proc: subprocess.Popen[bytes]
    run_dir: Path
    log: Path

    def pid(self, rank: int) -> int:
        return self.snapshot(rank).pid

    def snapshot(self, rank: int) -> Snapshot:
        return read_snapshot(snapshot_path(self.run_dir, rank))

    def stop(self) -> None:
        """End torchrun and every rank. torchrun starts each rank in a session of its
        own (start_new_session), so killing torchrun's group would leave the ranks
        running, burning the CPU the next cases need: every descendant is ended."""
        try:
            tree = [psutil.Process(self.proc.pid),
                    *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGCONT)  # a SIGSTOPped rank must die too
                proc.kill()
        psutil.wait_procs(tree, timeout=30)
        self.proc.wait(timeout=30)


def start_job(tmp: Path, fault: str, rank: int, checkpoint_dir: Path, master_port: int,
              rank0_port: int, checkpoint_every: int, ranks: int = 2,
              restarts: int = 0) -> Job:
    run_dir = tmp / "run"
    log = tmp / "train.log"
    env = cli_env(FAULT=fault, FAULT_RANK=str(rank), CHECKPOINT_DIR=str(checkpoint_dir),
                  CHECKPOINT_EVERY=str(checkpoint_every),
                  COLOSSALAI_EXPORTER_RUN_DIR=str(run_dir),
                  COLOSSALAI_EXPORTER_PORT=str(rank0_port), OMP_NUM_THREADS="1",
                  PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--max-restarts", str(restarts),
            "--master_addr", "127.0.0.1", "--master_port", str(master_port),
            str(TRAIN_SCRIPT)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return Job(proc, run_dir, log)


@dataclass
class Notification:
    """One Alertmanager notification as a receiver got it."""

    at: float
    receiver: str
    status: str
    alerts: list[dict[str, Any]]


@dataclass
class Stack:
    tmp: Path
    prometheus: Prometheus
    alertmanager: str
    receiver: FakeVigilmon
    job: Job
    agent: ServerProcess
    rank0: str
    ranks: int = 2
    notes: list[str] = field(default_factory=list)

    def notifications(self) -> list[Notification]:
        """Every webhook notification Alertmanager sent to the bridge's receivers."""
        out = []
        for record in self.receiver.received("/bridge/"):
            body = json.loads(record.body)
            out.append(Notification(record.at, body["receiver"], body["status"],
                                    body["alerts"]))
        return out

    def paged(self) -> dict[str, list[tuple[float, dict[str, Any]]]]:
        """Alert name -> (arrival, alert) for every firing alert that reached the pager.

        The pager is the bridge's webhook receiver, which every alert but the
        Watchdog reaches (it goes to the bridge's heartbeat receiver instead).
        """
        paged: dict[str, list[tuple[float, dict[str, Any]]]] = {}
        for note in self.notifications():
            if note.receiver != "bridge":
                continue
            for alert in note.alerts:
                if alert["status"] == "firing":
                    paged.setdefault(alert["labels"]["alertname"], []).append((note.at, alert))
        return paged

    def slack(self, alertname: str) -> list[Recorded]:
        return [r for r in self.receiver.received("/slack/")
                if alertname in json.loads(r.body)["attachments"][0]["title"]]

    def alertmanager_states(self, alertname: str) -> list[str]:
        got = requests.get(self.alertmanager + "/api/v2/alerts?filter="
                           + quote(f'alertname="{alertname}"'), timeout=2).json()
        return [a["status"]["state"] for a in got]

    def healthy(self) -> bool:
        steps = self.prometheus.query('colossalai_training_steps_total{job="colossalai-training"}'
                                      " > 10")
        up = self.prometheus.query('colossalai_rank_up{job="colossalai-node"} == 1')
        return bool(steps) and len(up) == self.ranks


@contextlib.contextmanager
def running_stack(tmp: Path, receiver: FakeVigilmon, fault: str, rank: int,
                  checkpoint_dir: Path, checkpoint_every: int = 50,
                  ranks: int = 2, restarts: int = 0,
                  shipped_for: tuple[str, ...] = ()) -> Iterator[Stack]:
    """Receiver, Alertmanager, agent and Prometheus first, then the job: Prometheus sees
    the job from its first second, as it would a job started under a running stack.

    ``restarts``: torchrun's --max-restarts. ``shipped_for``: alerts that keep the
    shipped `for` window instead of the short one (a crash loop's ranks are down
    between restarts for less than TrainingRankDown's shipped minute)."""
    override = yaml.safe_load(RULES_OVERRIDE)
    for name in shipped_for:
        del override["for"][name]
    rules = render_rules(tmp, yaml.safe_dump(override))
    master_port, rank0_port, agent_port = free_port(), free_port(), free_port()
    with contextlib.ExitStack() as stop:
        alertmanager = stop.enter_context(running_alertmanager(
            alertmanager_config(tmp, receiver.url), tmp))
        agent = ServerProcess(
            ["node", "--web.listen-address", f"127.0.0.1:{agent_port}",
             "--ranks.run-dir", str(tmp / "run"), "--disk", f"checkpoints={checkpoint_dir}",
             "--rendezvous.target", f"127.0.0.1:{master_port}", "--no-collector.gpu"],
            agent_port)
        stop.callback(agent.close)
        agent.wait_ready("/metrics")
        prometheus = stop.enter_context(launch_prometheus(
            prometheus_config(tmp, rules, alertmanager.removeprefix("http://"),
                              f"127.0.0.1:{rank0_port}", f"127.0.0.1:{agent_port}"),
            tmp / "prometheus-data", tmp / "prometheus.log", None,
            f"--rules.alert.resend-delay={INTERVAL:g}s"))
        job = start_job(tmp, fault, rank, checkpoint_dir, master_port, rank0_port,
                        checkpoint_every, ranks, restarts)
        stop.callback(job.stop)
        yield Stack(tmp, prometheus, alertmanager, receiver, job, agent,
                    f"http://127.0.0.1:{rank0_port}", ranks)


def wait_healthy(stack: Stack) -> None:
    def training() -> bool:
        if stack.job.proc.poll() is not None:
            raise AssertionError(f"the job exited ({stack.job.proc.returncode}) before it "
                                 f"trained: {stack.job.log.read_text()[-3000:]}")
        return stack.healthy()

    try:
        wait_until(training, timeout=180, interval=0.5, what="the job training")
    except AssertionError as exc:
        targets = stack.prometheus.api("/api/v1/targets")["activeTargets"]
        health = [(t["labels"]["job"], t["health"], t["lastError"]) for t in targets]
        raise AssertionError(f"{exc}; Prometheus targets: {health}; job log: "
                             f"{stack.job.log.read_text()[-2000:]}") from None


def wait_for_snapshot(stack: Stack, rank: int) -> None:
    wait_until((stack.job.run_dir / f"rank-{rank}.json").exists, timeout=180,
               interval=0.2, what=f"rank {rank}'s first snapshot (log: {stack.job.log})")


def now() -> float:
    return time.time()
