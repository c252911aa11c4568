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
import socket
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

from colossalai_exporter.rankstate.files import read_snapshot, snapshot_path
from colossalai_exporter.rankstate.schema import Snapshot
from conftest import ServerProcess, cli_env, free_port, stack_binaries, stop_process, wait_until
from fake_vigilmon import FakeVigilmon, Recorded
from gpu_helpers import Scenario, fake_nvml_env, gpu
from prometheus_helpers import (
    Prometheus,
    render_rules,
    running_alertmanager,
    shipped_alertmanager_config,
    start_prometheus,
)

INTERVAL = 1.0  # Prometheus' scrape and evaluation interval in the suite
# The documented override mechanism (docs/rules.md): shorter `for` windows, so that
# each case pages within seconds; the rules themselves are the shipped ones. Their order
# is the shipped one too, 5 s for 30 s and 10 s for a minute: with the stuck phases at
# 2 s, ahead of TrainingStalled, the suite proved that a recompile stuck on rank 1 paged
# alone, where the shipped windows paged rank 0, waiting for it, as stalled 30 s before
# CompileStuck named rank 1. And a frozen rank "waits least" from the moment it freezes:
# the straggler rule leaves a stalled run alone, and a rank with no step for
# straggler_stepped_within (5m shipped, 5 s here) too, which a budget or a process
# group's timeout longer than the straggler's `for` needs: with the 15 s timeout and
# 40 s budget of the hang-then-short cases, a loaded run paged the frozen rank as a
# straggler first. Its `for` outlasts the 5 s step budget as its shipped 10m outlasts
# most real ones.
# The slower group of training alerts (every minute when shipped) runs at the suite's
# interval too, as its `for` windows are scaled: at one evaluation a minute a loaded
# run's TrainingStraggler paged after the case's deadline.
RULES_OVERRIDE = """
expected_jobs: [colossalai-node]
thresholds: {training_slow_evaluation_interval: 1s, hang_after_timeout_for: 3s,
             straggler_stepped_within: 5s}
for:
  TrainingStalled: 5s
  TrainingHangSuspect: 0s
  TrainingStraggler: 15s
  TrainingStartupStuck: 10s
  TrainingRanksMissing: 10s
  CheckpointStuck: 10s
  CompileStuck: 10s
  DataStartStuck: 10s
  EvaluationStuck: 10s
  TrainingRankDown: 10s
  TrainingNodeLost: 10s
  NCCLRendezvousDown: 10s
  RankStateUnreadable: 5s
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


def prometheus_config(tmp: Path, rules: Path, alertmanager: str, rank_servers: list[str],
                      agents: list[str]) -> Path:
    config = {
        "global": {"scrape_interval": f"{INTERVAL:g}s", "scrape_timeout": f"{INTERVAL:g}s",
                   "evaluation_interval": f"{INTERVAL:g}s"},
        "rule_files": [str(rules / "*.rules.yml")],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
        "scrape_configs": [
            {"job_name": "colossalai-training",
             "static_configs": [{"targets": rank_servers}]},
            {"job_name": "colossalai-node", "static_configs": [{"targets": agents}]},
        ],
    }
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class Job:
    """One torchrun (a node's launcher) with its ranks of tests/faults/train.py, in a
    process group of its own."""

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
              restarts: int = 0, topology: str = "booster", nodes: int = 1,
              node_rank: int = 0, name: str = "", serve: str = "rank0",
              dead_master_port: int = 0) -> Job:
    """``ranks`` per node; with ``nodes`` > 1 this is node ``node_rank``'s launcher, with a
    run directory of its own (each node's agent reads only its own). ``name``: another
    job's launcher on the first node (its own log, the node's run directory)."""
    suffix = f"-node{node_rank}" if nodes > 1 else ""
    run_dir = tmp / f"run{suffix}"
    log = tmp / f"train{suffix}{name and '-' + name}.log"
    env = cli_env(FAULT=fault, FAULT_RANK=str(rank), CHECKPOINT_DIR=str(checkpoint_dir),
                  CHECKPOINT_EVERY=str(checkpoint_every), TOPOLOGY=topology,
                  COLOSSALAI_EXPORTER_RUN_DIR=str(run_dir),
                  COLOSSALAI_EXPORTER_PORT=str(rank0_port), COLOSSALAI_EXPORTER_SERVE=serve,
                  OMP_NUM_THREADS="1",
                  PYTHONUNBUFFERED="1", DEAD_MASTER_PORT=str(dead_master_port))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--max-restarts", str(restarts), "--nnodes", str(nodes),
            "--node_rank", str(node_rank),
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
    jobs: list[Job]  # one launcher per node
    agents: list[ServerProcess]  # one node agent per node
    rank0: str
    ranks: int = 2  # in all
    prometheus_config: Path | None = None
    notes: list[str] = field(default_factory=list)
    #: the fake NVML every agent reads, when the case gives the node GPUs
    gpus: Scenario | None = None
    #: the Prometheus binary, for restart_prometheus
    prometheus_binary: str | None = None
    #: the master's rendezvous address where the master node never came up: a port
    #: bound and not listening, so that a connect is refused as by a host with no store
    dead_master: str = ""

    @property
    def job(self) -> Job:
        return self.jobs[0]

    @property
    def agent(self) -> ServerProcess:
        return self.agents[0]

    def job_of(self, rank: int) -> Job:
        """The launcher whose node runs ``rank``."""
        per_node = self.ranks // len(self.jobs)
        return self.jobs[rank // per_node]

    def notifications(self) -> list[Notification]:
        """Every webhook notification Alertmanager sent to the bridge's receivers."""
        out = []
        for record in self.receiver.received("/bridge/"):
            body = json.loads(record.body)
            out.append(Notification(record.at, body["receiver"], body["status"],
                                    body["alerts"]))
        return out

    def pages(self) -> list[Notification]:
        """The notifications that paged: to the bridge's receiver (every alert but the
        Watchdog, which goes to its heartbeat receiver) with an alert firing, in order."""
        return [n for n in self.notifications() if n.receiver == "bridge"
                and any(a["status"] == "firing" for a in n.alerts)]

    def paged(self) -> dict[str, list[tuple[float, dict[str, Any]]]]:
        """Alert name -> (arrival, alert) for every firing alert that reached the pager."""
        paged: dict[str, list[tuple[float, dict[str, Any]]]] = {}
        for note in self.pages():
            for alert in note.alerts:
                if alert["status"] == "firing":
                    paged.setdefault(alert["labels"]["alertname"], []).append((note.at, alert))
        return paged

    def what_paged(self) -> list[str]:
        """Every firing alert that reached the pager as on-call reads it (its labels, the
        first line of its description): what a failed assertion must show, since a
        flaky extra page is seldom reproduced."""
        return [f"{note.at:.1f} {alert['labels']}: "
                f"{alert['annotations'].get('description', '')[:400]}"
                for note in self.pages() for alert in note.alerts
                if alert["status"] == "firing"]

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

    def restart_agent(self, node: int = 0) -> None:
        """Stop a node's agent and start it again on the same port (an upgrade, a crash)."""
        old = self.agents[node]
        old.close()
        self.agents[node] = start_agent(old.args, old.port, self.agent_env())

    def agent_env(self) -> dict[str, str] | None:
        return agent_env(self.gpus)

    def restart_prometheus(self) -> None:
        """Stop Prometheus and start it again on the same port and data (an upgrade)."""
        assert self.prometheus_config is not None
        port = int(self.prometheus.url.rsplit(":", 1)[1])
        stop_process(self.prometheus.proc, timeout=15)
        self.prometheus = run_prometheus(self.prometheus_config, self.tmp, port,
                                         self.prometheus_binary)


def agent_env(gpus: Scenario | None) -> dict[str, str] | None:
    """A node agent's environment: the fake NVML's, when the case gives the node GPUs."""
    return fake_nvml_env(gpus.path, cli_env()) if gpus is not None else None


def start_agent(args: list[str], port: int, env: dict[str, str] | None = None) -> ServerProcess:
    agent = ServerProcess(args, port, env)
    agent.wait_ready("/metrics")
    return agent


def run_prometheus(config: Path, tmp: Path, port: int, binary: str | None = None) -> Prometheus:
    """Prometheus as the suite runs it, on ``port``; the caller stops it."""
    return start_prometheus(config, tmp / "prometheus-data", tmp / "prometheus.log", None,
                            f"--rules.alert.resend-delay={INTERVAL:g}s", port=port,
                            binary=binary)


@contextlib.contextmanager
def running_stack(tmp: Path, receiver: FakeVigilmon, fault: str, rank: int,
                  checkpoint_dir: Path, checkpoint_every: int = 50,
                  ranks: int = 2, restarts: int = 0,
                  shipped_for: tuple[str, ...] = (), topology: str = "booster",
                  nodes: int = 1, agent_defaults: bool = False,
                  gpus: int = 0, release: str = "bookworm",
                  serve: str = "rank0") -> Iterator[Stack]:
    """Receiver, Alertmanager, agents and Prometheus first, then the job: Prometheus sees
    the job from its first second, as it would a job started under a running stack.

    ``ranks``: per node. ``nodes``: launchers (and node agents) on this machine, each
    with its own run directory, as separate nodes would be. ``restarts``: torchrun's
    --max-restarts. ``shipped_for``: alerts that keep the shipped `for` window instead of
    the short one (a crash loop's ranks are down between restarts for less than
    TrainingRankDown's shipped minute). ``agent_defaults``: the agent as a user starts it
    on a node (its GPU collector on, the default watched paths), told only where the
    ranks and the rendezvous are. ``gpus``: every agent reads that many GPUs from a fake
    NVML (tests/fake_nvml); ``Stack.gpus`` is its scenario, which a case rewrites to make
    a GPU fail. ``release``: whose Prometheus and Alertmanager (conftest.RELEASES)."""
    prometheus_binary, alertmanager_binary = stack_binaries(release)
    override = yaml.safe_load(RULES_OVERRIDE)
    for name in shipped_for:
        del override["for"][name]
    rules = render_rules(tmp, yaml.safe_dump(override))
    master_port = free_port()
    # serve="local": every rank serves, on the port plus its local rank (one node).
    rank0_port = consecutive_free_ports(ranks if serve == "local" else 1)
    servers = [f"127.0.0.1:{rank0_port + i}" for i in range(ranks if serve == "local" else 1)]
    with contextlib.ExitStack() as stop:
        dead_master = stop.enter_context(bound_port()) if fault == "master_never_starts" \
            else 0
        alertmanager = stop.enter_context(running_alertmanager(
            alertmanager_config(tmp, receiver.url), tmp, alertmanager_binary))
        agents: list[ServerProcess] = []
        scenario = Scenario(tmp / "nvml.json").write(gpus=[gpu(i) for i in range(gpus)]) \
            if gpus else None
        env = agent_env(scenario)
        for node in range(nodes):
            suffix = f"-node{node}" if nodes > 1 else ""
            args = ["node", "--web.listen-address", "", "--ranks.run-dir",
                    str(tmp / f"run{suffix}"),
                    "--rendezvous.target", f"127.0.0.1:{master_port}"]
            if not agent_defaults:
                args += ["--disk", f"checkpoints={checkpoint_dir}"]
                args += ["--gpu.expected", str(gpus)] if gpus else ["--no-collector.gpu"]
            port = free_port()
            args[2] = f"127.0.0.1:{port}"
            agents.append(start_agent(args, port, env))
            stop.callback(lambda node=node: agents[node].close())
        config = prometheus_config(tmp, rules, alertmanager.removeprefix("http://"),
                                   servers,
                                   [f"127.0.0.1:{a.port}" for a in agents])
        stack = Stack(tmp, run_prometheus(config, tmp, free_port(), prometheus_binary),
                      alertmanager, receiver, [], agents, f"http://127.0.0.1:{rank0_port}",
                      ranks * nodes, config, gpus=scenario, prometheus_binary=prometheus_binary,
                      dead_master=f"127.0.0.1:{dead_master}" if dead_master else "")
        stop.callback(lambda: stop_process(stack.prometheus.proc, timeout=15))
        for node in range(nodes):
            job = start_job(tmp, fault, rank, checkpoint_dir, master_port, rank0_port,
                            checkpoint_every, ranks, restarts, topology, nodes, node,
                            serve=serve, dead_master_port=dead_master)
            stack.jobs.append(job)
            stop.callback(job.stop)
        yield stack


@contextlib.contextmanager
def bound_port() -> Iterator[int]:
    """A loopback port bound and not listening while the block runs: a connect to it is
    refused (RST) as to a host whose store never started, and nothing else can take it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def consecutive_free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free now (free_port's, and the next)."""
    for _ in range(100):
        first = free_port()
        if count == 1 or all(port_free(first + i) for i in range(1, count)):
            return first
    raise AssertionError(f"no {count} consecutive free ports")


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


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
