"""Fleet simulation (issue 19): the shipped rules and routing at 1,024 and 4,096 ranks.

N nodes of 8 ranks each are served from this process on loopback, one path per
node (file_sd targets with their own ``instance``), each answering what a node
agent answers: its own series as a real agent served them for a node with 8
GPUs (fake NVML) and 2 watched disks, captured once at start, and the outside
view of its 8 ranks built by the agent's own code (``RankFamilies``, the ranks
collector's four series) from synthetic snapshots that step, checkpoint and
age like live ranks. Each job's rank 0 also serves its in-process view (job
``colossalai-training``). A real Prometheus scrapes and evaluates the shipped
rules every 15 s and sends to a real Alertmanager with the shipped routing,
whose receivers are a counting webhook on loopback.

After the settle time it reports the active series (per node, per rank), each
rule group's evaluation time, and Prometheus' memory. With ``--incident`` it
then stalls the whole of job 0 (every rank stops stepping, waiting in an
all-reduce), and later kills one of its ranks, and counts the notifications each
receiver gets, with what their text says.

With ``--engine victoria-metrics`` the same fleet is scraped, stored and judged by
the layout a site that outgrows one Prometheus would run (Debian's
``victoria-metrics`` package): ``--scrapers`` vmagents sharding the targets between
them (``-promscrape.cluster.membersCount``/``memberNum``), remote-writing to one
victoria-metrics store, and one vmalert evaluating the shipped rule files against
it, writing recorded series and ``ALERTS`` back to it and sending to the same
Alertmanager. It reports the same things, for each of those processes.

    python bench/fleet.py --ranks 1024
    python bench/fleet.py --ranks 4096 --incident
    python bench/fleet.py --ranks 4096 --engine victoria-metrics --scrapers 2
    python bench/fleet.py --ranks 4096 --release current   # Prometheus 3, Alertmanager 0.33
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "exporter")]

import yaml  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from colossalai_exporter import catalogue  # noqa: E402
from colossalai_exporter.rankstate.families import RankFamilies, families  # noqa: E402
from colossalai_exporter.rankstate.schema import (  # noqa: E402
    Activity,
    CheckpointState,
    PendingCollective,
    Snapshot,
)
from colossalai_exporter.training.state import STEP_BUCKETS  # noqa: E402
from colossalai_exporter.web.exposition import encode_text  # noqa: E402
from conftest import (  # noqa: E402
    RELEASES,
    free_port,
    http_get,
    require_binary,
    stack_binaries,
    stop_process,
    wait_until,
)
from fake_vigilmon import FakeVigilmon, fake_vigilmon  # noqa: E402
from gpu_helpers import fake_nvml_env, gpu  # noqa: E402
from prometheus_helpers import (  # noqa: E402
    launch_prometheus,
    running_alertmanager,
    shipped_alertmanager_config,
)

RANKS_PER_NODE = 8
STEP_SECONDS = 2.0  # a large model's step
CHECKPOINT_EVERY = 600.0


class Fleet:
    """The state of every simulated rank; builds each node's exposition on demand."""

    def __init__(self, nodes: int, jobs: int, node_template: str) -> None:
        self.nodes, self.jobs = nodes, jobs
        self.t0 = time.time() - 3600  # the jobs have run for an hour already
        self.template = node_template
        self.stalled_at: dict[int, float] = {}  # job -> when it stopped stepping
        self.dead: set[int] = set()  # global ranks whose process is gone
        self.lock = threading.Lock()

    def job_of(self, node: int) -> int:
        return node * self.jobs // self.nodes

    def world(self) -> int:
        return self.nodes * RANKS_PER_NODE // self.jobs

    def snapshot(self, rank: int, job: int, now: float) -> Snapshot:
        stalled_at = self.stalled_at.get(job)
        until = now if stalled_at is None else stalled_at
        steps = int((until - self.t0) / STEP_SECONDS)
        last_step = self.t0 + steps * STEP_SECONDS
        checkpoints = int((until - self.t0) / CHECKPOINT_EVERY)
        hist = [0] * (len(STEP_BUCKETS) + 1)
        hist[STEP_BUCKETS.index(2.5)] = steps
        return Snapshot(
            rank=rank, local_rank=rank % RANKS_PER_NODE, world_size=self.world(),
            pid=100000 + rank, created=self.t0, written=now, phase="training",
            phase_start=self.t0, kernels_ready=True, steps=steps, last_step=last_step,
            step_buckets=list(STEP_BUCKETS), step_hist=hist,
            step_sum=steps * STEP_SECONDS, timeout=60.0, progress=last_step,
            oom={"cuda": 0, "cpu": 0, "nvme": 0},
            checkpoint=CheckpointState(
                last_success=self.t0 + checkpoints * CHECKPOINT_EVERY,
                last_step=int(checkpoints * CHECKPOINT_EVERY / STEP_SECONDS),
                duration=30.0),
            info={"run": f"fleet-job-{job}", "plugin": "GeminiPlugin", "world_size":
                  str(self.world()), "colossalai_version": "0.5.0",
                  "torch_version": "2.5.1", "dp_size": str(self.world())},
            activity=Activity(kind="collective", collective="all_reduce",
                              frame="gemini/chunk/manager.py:204 in reduce_chunk"),
            # What a monitor reads of the flight recorder's status at every publish: the
            # collective in flight (served as its age, 0 while nothing is): a stalled job's
            # all-reduce since it stopped stepping.
            in_flight_known=True,
            pending=None if stalled_at is None else PendingCollective(
                pg="0", seq=steps * 4, since=stalled_at, timeout=600.0),
            publish_interval=1.0, activity_samples=int(until - self.t0),
            waiting_samples=int((until - self.t0) * 0.3),
            productive=steps * STEP_SECONDS,
            checkpointed=checkpoints * CHECKPOINT_EVERY)

    def node_text(self, node: int) -> bytes:
        now = time.time()
        job = self.job_of(node)
        with self.lock:
            dead = set(self.dead)
        training = RankFamilies(outside=True)
        up = catalogue.gauge("colossalai_rank_up")
        age = catalogue.gauge("colossalai_rank_snapshot_age_seconds")
        alive = catalogue.gauge("colossalai_rank_process_alive")
        stopped = catalogue.gauge("colossalai_rank_process_stopped")
        for local in range(RANKS_PER_NODE):
            rank = node * RANKS_PER_NODE + local
            snap = self.snapshot(rank, job, now)
            is_alive = rank not in dead
            label = [str(rank)]
            up.add_metric(label, 1.0 if is_alive else 0.0)
            age.add_metric(label, 0.4 if is_alive else now - self.t0)
            alive.add_metric(label, 1.0 if is_alive else 0.0)
            stopped.add_metric(label, 0.0)
            training.add(snap, now)
        ranks = encode_text([up, age, stopped, alive, *training.families()])
        return self.template.encode() + ranks

    def rank0_text(self, job: int) -> bytes:
        node = job * self.nodes // self.jobs
        return encode_text(families(self.snapshot(node * RANKS_PER_NODE, job, time.time())))


def node_template(tmp: Path) -> str:
    """A real agent's exposition for a node with 8 GPUs (fake NVML) and 2 disks, no ranks
    (the simulated ranks' families replace the empty ones)."""
    scenario = tmp / "gpus.json"
    scenario.write_text(json.dumps({"driver_version": "550.54.15", "gpus": [
        gpu(i, memory_used=60 * 2**30, utilization=97, temperature=61, power_mw=640_000)
        for i in range(8)]}))
    port = free_port()
    rendezvous = socket.create_server(("127.0.0.1", 0))  # a reachable rendezvous store
    env = fake_nvml_env(scenario, dict(os.environ, PYTHONPATH=str(REPO / "exporter")))
    (tmp / "ckpt").mkdir()
    agent = subprocess.Popen(
        [sys.executable, "-m", "colossalai_exporter", "node", "--web.listen-address",
         f"127.0.0.1:{port}", "--disk", f"checkpoints={tmp / 'ckpt'}", "--disk", "root=/",
         "--ranks.run-dir", str(tmp / "no-ranks"), "--log.level", "warn",
         "--rendezvous.target", f"127.0.0.1:{rendezvous.getsockname()[1]}"], env=env)
    try:
        def scrape() -> str:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                             headers={"Accept": "text/plain"})
            with urllib.request.urlopen(request, timeout=2) as response:
                text: str = response.read().decode()
            return text if 'colossalai_gpu_memory_used_bytes{gpu="7"' in text else ""

        text = wait_until(scrape, timeout=30, interval=0.2, what="the agent's GPU metrics")
    finally:
        agent.terminate()
        agent.wait(10)
        rendezvous.close()
    kept, skip = [], False
    for line in text.splitlines():
        name = line.split()[2] if line.startswith("#") else re.split(r"[{ ]", line)[0]
        skip = name.startswith("colossalai_rank_")
        if not skip:
            kept.append(line)
    return "\n".join(kept) + "\n"


class Notifications:
    """Alertmanager's notifications, by receiver: the fault suite's recording receiver
    (tests/fake_vigilmon.py), each receiver at ``/bridge/<name>`` or ``/slack/<name>``."""

    def __init__(self, receiver: FakeVigilmon) -> None:
        self.receiver = receiver

    def _received(self, since: float) -> Iterator[tuple[str, str, dict[str, Any], float]]:
        """(receiver, alert name, body, when) of each notification since ``since``."""
        for note in self.receiver.received("/"):
            if note.at < since:
                continue
            body = json.loads(note.body)
            if "attachments" in body:  # a Slack message: its title names the alert
                found = re.search(r": (\w+)", body["attachments"][0]["title"])
                name = found.group(1) if found else ""
            else:
                name = body.get("commonLabels", {}).get("alertname", "")
            yield note.path.rsplit("/", 1)[-1], name, body, note.at

    def by_receiver(self, since: float, alertname: str) -> Counter[str]:
        return Counter(r for r, name, _, _ in self._received(since) if name == alertname)

    def log(self, since: float, alertname: str) -> list[str]:
        """One line a notification of ``alertname`` since ``since``: when, to whom,
        firing or resolved, how many alerts, and the first alert's rank."""
        lines = []
        for receiver, name, body, at in self._received(since):
            if name != alertname:
                continue
            if "attachments" in body:
                title = body["attachments"][0]["title"]
                lines.append(f"{at - since:6.1f} s  {receiver}: {title}")
            else:
                alerts = body.get("alerts", [])
                rank = alerts[0]["labels"].get("rank", "-") if alerts else "-"
                lines.append(f"{at - since:6.1f} s  {receiver}: {body.get('status')}, "
                             f"{len(alerts)} alert(s), first rank {rank}")
        return lines

    def texts(self, since: float, alertname: str) -> list[str]:
        return [json.dumps(body)[:600] for r, name, body, _ in self._received(since)
                if r == "slack-critical" and name == alertname]


def serve(fleet: Fleet) -> tuple[ThreadingHTTPServer, int]:
    """The simulated agents' and rank servers' expositions, one path each."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            parts = self.path.strip("/").split("/")
            if parts[0] == "node":
                body = fleet.node_text(int(parts[1]))
            elif parts[0] == "rank0":
                body = fleet.rank0_text(int(parts[1]))
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def write_targets(tmp: Path, fleet: Fleet, port: int) -> None:
    nodes = [{"targets": [f"127.0.0.1:{port}"],
              "labels": {"__metrics_path__": f"/node/{i}", "instance": f"node-{i:04d}:9466"}}
             for i in range(fleet.nodes)]
    rank0 = [{"targets": [f"127.0.0.1:{port}"],
              "labels": {"__metrics_path__": f"/rank0/{j}",
                         "instance": f"node-{j * fleet.nodes // fleet.jobs:04d}:8766"}}
             for j in range(fleet.jobs)]
    (tmp / "nodes.json").write_text(json.dumps(nodes))
    (tmp / "rank0.json").write_text(json.dumps(rank0))


def scrape_configs(tmp: Path) -> list[dict[str, Any]]:
    return [
        {"job_name": "colossalai-node",
         "file_sd_configs": [{"files": [str(tmp / "nodes.json")]}]},
        {"job_name": "colossalai-training",
         "file_sd_configs": [{"files": [str(tmp / "rank0.json")]}]},
    ]


def prometheus_config(tmp: Path, alertmanager: str, interval: int) -> Path:
    config = {
        "global": {"scrape_interval": f"{interval}s", "evaluation_interval": f"{interval}s",
                   "scrape_timeout": f"{min(interval, 10)}s"},
        "rule_files": [str(p) for p in sorted((REPO / "rules").glob("*.rules.yml"))],
        "alerting": {"alertmanagers": [{"static_configs": [
            {"targets": [alertmanager.removeprefix("http://")]}]}]},
        "scrape_configs": scrape_configs(tmp),
    }
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def query(url: str, expr: str, timeout: float = 30) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/api/v1/query?query={urllib.parse.quote(expr)}",
                                timeout=timeout) as response:
        result: list[dict[str, Any]] = json.load(response)["data"]["result"]
    return result


def query_api(url: str, path: str) -> Any:
    with urllib.request.urlopen(url + path, timeout=30) as response:
        return json.load(response)["data"]


def scalar(url: str, expr: str, timeout: float = 30) -> float:
    result = query(url, expr, timeout)
    return float(result[0]["value"][1]) if result else float("nan")


def rss_mib(pid: int) -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return (int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024)


class SelfMetrics:
    """Prometheus' own /metrics, read every evaluation (it does not scrape itself here):
    head series, each rule group's last evaluation time (the largest seen is kept)."""

    SERIES = "prometheus_tsdb_head_series"
    MISSED = "prometheus_rule_group_iterations_missed_total"
    FAILED = "prometheus_rule_evaluation_failures_total"

    def __init__(self, urls: list[str], interval: int) -> None:
        self.urls, self.interval = urls, interval
        self.longest: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.values: dict[str, float] = {}
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            for url in self.urls:
                try:
                    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
                        text = response.read().decode()
                except OSError:
                    continue
                for family in text_string_to_metric_families(text):
                    for sample in family.samples:
                        self._observe(sample.name, sample.labels, sample.value)

    def _observe(self, name: str, labels: dict[str, str], value: float) -> None:
        if name == "prometheus_rule_group_last_duration_seconds":
            group = labels["rule_group"].split(";")[-1]
            self.last[group] = value
            self.longest[group] = max(self.longest.get(group, 0.0), value)
        elif name in (self.SERIES, self.MISSED, self.FAILED):
            self._keep(name, labels, value)

    def _keep(self, name: str, labels: dict[str, str], value: float) -> None:
        self.values[name + json.dumps(labels, sort_keys=True)] = value

    def total(self, name: str) -> float:
        return sum(v for k, v in self.values.items() if k.startswith(name + "{"))


class VictoriaSelfMetrics(SelfMetrics):
    """vmalert's and victoria-metrics' /metrics, read every evaluation interval.

    vmalert keeps each group's iteration time as a summary: the mean of the iterations
    since the last read (Δsum/Δcount, one iteration for a 15 s group) is its last
    evaluation, and the summary's maximum (quantile 1, over its sliding window) the
    longest. The store's active series are its series seen this hour
    (``vm_cache_entries{type="storage/hour_metric_ids"}``), the count VictoriaMetrics
    itself calls active; an evaluation that failed is ``vmalert_execution_errors_total``;
    rows vmalert could not queue for the store (recorded series, ALERTS) are counted
    too."""

    SERIES = "vm_cache_entries"
    MISSED = "vmalert_iteration_missed_total"
    FAILED = "vmalert_execution_errors_total"
    DROPPED = "vmalert_remotewrite_dropped_rows_total"

    def __init__(self, urls: list[str], interval: int) -> None:
        self.sums: dict[str, tuple[float, float]] = {}  # group -> (sum, count) last read
        self.pending: dict[str, float] = {}  # group -> sum read before its count
        super().__init__(urls, interval)

    def _observe(self, name: str, labels: dict[str, str], value: float) -> None:
        group = labels.get("group", "")
        if name == "vmalert_iteration_duration_seconds" and labels.get("quantile") == "1":
            self.longest[group] = max(self.longest.get(group, 0.0), value)
        elif name == "vmalert_iteration_duration_seconds_sum":
            self.pending[group] = value
        elif name == "vmalert_iteration_duration_seconds_count":
            total, before = self.pending.pop(group, 0.0), self.sums.get(group, (0.0, 0.0))
            if value > before[1]:
                self.last[group] = (total - before[0]) / (value - before[1])
                self.longest[group] = max(self.longest.get(group, 0.0), self.last[group])
            self.sums[group] = (total, value)
        elif name == self.SERIES:
            if labels.get("type") == "storage/hour_metric_ids":
                self._keep(name, labels, value)
        elif name in (self.MISSED, self.FAILED, self.DROPPED):
            self._keep(name, labels, value)


@dataclass
class Engine:
    """What scrapes, stores and evaluates: the store's query API, the rule evaluator's
    rules API, each process by name (for its memory) and their own metrics."""

    name: str
    url: str
    rules_url: str
    processes: dict[str, int]
    own: SelfMetrics
    layout: str = ""  # how the report's title names the layout, after the interval
    series: str = "head series"
    query_timeout: float = 30  # the report's counts of whole jobs


def _cause(rule: dict[str, Any]) -> str:
    """" (left_early)": which of the rules that share an alert's name."""
    cause = rule.get("labels", {}).get("cause")
    return f" ({cause})" if cause else ""


def report_scale(engine: Engine, fleet: Fleet, interval: int) -> None:
    url, own, wait = engine.url, engine.own, engine.query_timeout
    ranks = fleet.nodes * RANKS_PER_NODE
    head = own.total(own.SERIES)
    # the evaluations as they were before the report's own heavy counts below
    last, longest = dict(own.last), dict(own.longest)
    node_series = scalar(url, 'count({job="colossalai-node"})', wait)
    rank_series = scalar(url, 'count({job="colossalai-node", rank!="", __name__!~".*:.*"})',
                         wait)
    recorded = scalar(url, 'count({__name__=~".*:.*"})', wait)
    rank0_series = scalar(url, 'count({job="colossalai-training"})', wait)
    print(f"\n## {ranks} ranks: {fleet.nodes} nodes x 8, {fleet.jobs} job(s), "
          f"scrape and evaluation every {interval} s{engine.layout}\n")
    print(f"- {engine.series}: {head:.0f} (nodes' job {node_series:.0f}: "
          f"{node_series / fleet.nodes:.1f} a node, of which "
          f"{rank_series / ranks:.1f} a rank; rank servers' job {rank0_series:.0f}; "
          f"recorded by the rules {recorded:.0f})")
    for name, pid in engine.processes.items():
        rss, peak = rss_mib(pid)
        print(f"- {name} RSS now {rss:.0f} MiB, peak {peak:.0f} MiB")
    print("\n| rule group | last evaluation | longest seen |")
    print("|---|---|---|")
    for group in sorted(last):
        print(f"| {group} | {last[group] * 1e3:.0f} ms | {longest[group] * 1e3:.0f} ms |")
    rules = [r for g in query_api(engine.rules_url, "/api/v1/rules")["groups"]
             for r in g["rules"]]
    rules.sort(key=lambda r: -float(r.get("evaluationTime", 0)))
    print("\nslowest rules: " + "; ".join(
        f"{r['name']}{_cause(r)} {float(r['evaluationTime']) * 1e3:.0f} ms"
        for r in rules[:20]))
    print(f"\nmissed rule group iterations: "
          f"{own.total(own.MISSED):.0f}; "
          f"failed rule evaluations: {own.total(own.FAILED):.0f}")
    if isinstance(own, VictoriaSelfMetrics):
        every = scalar(url, 'count({__name__=~".+"})', wait)
        print(f"- series in the store with a sample in the last 5 minutes: {every:.0f}")
        print(f"- rows vmalert dropped before the store (recorded series, ALERTS): "
              f"{own.total(own.DROPPED):.0f}")
        firing = Counter(a["labels"]["alertname"] for a in
                         query_api(engine.rules_url, "/api/v1/alerts")["alerts"]
                         if a["state"] == "firing")
        print(f"- alerts firing in vmalert (name: alerts): {dict(sorted(firing.items()))}")


def incident(engine: Engine, fleet: Fleet, notes: Notifications, settle: float) -> None:
    url = engine.url
    world = fleet.world()
    since = time.time()
    with fleet.lock:
        fleet.stalled_at[0] = since
    print(f"\n## Incident 1: the whole of job 0 ({world} ranks) stops stepping\n")
    wait_until(lambda: notes.by_receiver(since, "TrainingStalled"), timeout=600,
               interval=1, what="TrainingStalled notified")
    first = time.time()
    time.sleep(settle)  # an observation window: what arrives in it is what is counted
    counts = notes.by_receiver(since, "TrainingStalled")
    print(f"- first notification {first - since:.0f} s after the stall; in the "
          f"{settle:.0f} s after it, per receiver: {dict(counts)}")
    firing = {r["metric"]["alertname"]: r["value"][1] for r in
              query(url, 'count by (alertname) (ALERTS{alertstate="firing"})')}
    print(f"- alerts firing in {engine.name} (name: series): {firing}")
    for text in notes.texts(since, "TrainingStalled")[:1]:
        print(f"- Slack text: {text}")
    print("- each notification, from the stall:")
    for line in notes.log(since, "TrainingStalled"):
        print(f"  - {line}")
    since = time.time()
    with fleet.lock:
        fleet.dead.add(3)
    print("\n## Incident 2: then rank 3 of job 0 dies\n")
    wait_until(lambda: notes.by_receiver(since, "TrainingRankDown"), timeout=600,
               interval=1, what="TrainingRankDown notified")
    first = time.time()
    time.sleep(settle)
    counts = notes.by_receiver(since, "TrainingRankDown")
    print(f"- first notification {first - since:.0f} s after the death; in the "
          f"{settle:.0f} s after it, per receiver: {dict(counts)}")
    print("- each notification, from the death:")
    for line in notes.log(since, "TrainingRankDown"):
        print(f"  - {line}")


@contextmanager
def running_victoria_metrics(tmp: Path, alertmanager: str, interval: int,
                             scrapers: int) -> Iterator[Engine]:
    """The scale-out layout on loopback: ``scrapers`` vmagents, each scraping its share of
    the targets (vmagent's own cluster sharding: every member reads the same scrape
    config and keeps the targets whose hash falls to its ``memberNum``), remote-writing
    to one victoria-metrics; one vmalert evaluating the shipped rule files against it,
    writing recorded series and ALERTS back to it (and restoring alert state from it)
    and sending to ``alertmanager``. Each process is stopped afterwards, vmalert first."""
    store = f"http://127.0.0.1:{free_port()}"
    config = tmp / "vmagent.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{interval}s",
                   "scrape_timeout": f"{min(interval, 10)}s"},
        "scrape_configs": scrape_configs(tmp)}))
    urls: dict[str, str] = {}
    pids: dict[str, int] = {}
    with ExitStack() as stack:
        def start(name: str, binary: str, url: str, *args: str) -> None:
            log = stack.enter_context((tmp / f"{name}.log").open("w"))
            proc = subprocess.Popen([require_binary(binary),
                                     f"-httpListenAddr={url.removeprefix('http://')}",
                                     "-loggerLevel=WARN", *args],
                                    stdout=log, stderr=subprocess.STDOUT)
            stack.callback(stop_process, proc, 15)
            urls[name], pids[name] = url, proc.pid

        # The report counts whole jobs: at 16,384 ranks about 750 k series in one query,
        # above the store's default limits of 300 k series and 30 s a query (the rules'
        # reads stay far below both).
        start("victoria-metrics", "victoria-metrics", store,
              f"-storageDataPath={tmp / 'vm-data'}", "-search.maxUniqueTimeseries=2000000",
              "-search.maxQueryDuration=180s")
        for member in range(scrapers):
            shard = ([f"-promscrape.cluster.membersCount={scrapers}",
                      f"-promscrape.cluster.memberNum={member}"] if scrapers > 1 else [])
            start(f"vmagent-{member}", "vmagent", f"http://127.0.0.1:{free_port()}",
                  f"-promscrape.config={config}", *shard,
                  f"-remoteWrite.url={store}/api/v1/write",
                  f"-remoteWrite.tmpDataPath={tmp / f'vmagent-{member}'}")
        start("vmalert", "vmalert", f"http://127.0.0.1:{free_port()}",
              f"-rule={REPO / 'rules'}/*.rules.yml", f"-evaluationInterval={interval}s",
              f"-datasource.url={store}", f"-remoteWrite.url={store}",
              f"-remoteRead.url={store}", f"-notifier.url={alertmanager}")
        def healthy(url: str) -> bool:
            status: int = http_get(url + "/health", timeout=1)[0]
            return status == 200

        for name, url in urls.items():
            wait_until(functools.partial(healthy, url), timeout=30, interval=0.2,
                       what=f"{name} healthy (log: {tmp / name}.log)")
        own = VictoriaSelfMetrics([urls["vmalert"], store], interval)
        stack.callback(own.stop.set)
        yield Engine("the store (vmalert's ALERTS)", store, urls["vmalert"], pids, own,
                     layout=f", on victoria-metrics ({scrapers} vmagent(s), one vmalert)",
                     series="active series in the store", query_timeout=180)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--interval", type=int, default=15)
    parser.add_argument("--settle", type=float, default=240.0,
                        help="seconds of scrapes and evaluations before measuring")
    parser.add_argument("--engine", choices=("prometheus", "victoria-metrics"),
                        default="prometheus",
                        help="one Prometheus, or vmagents, victoria-metrics and vmalert")
    parser.add_argument("--scrapers", type=int, default=2,
                        help="vmagents sharing the targets (victoria-metrics only)")
    parser.add_argument("--release", choices=RELEASES, default="bookworm",
                        help="whose Prometheus and Alertmanager: Debian bookworm's (2.42, "
                             "0.25) or testing's (Prometheus 3, .tools/prometheus3)")
    parser.add_argument("--incident", action="store_true")
    parser.add_argument("--observe", type=float, default=120.0,
                        help="seconds each incident's notifications are counted for, "
                             "from its first")
    args = parser.parse_args()
    nodes = args.ranks // RANKS_PER_NODE
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        fleet = Fleet(nodes, args.jobs, node_template(tmp))
        receiver = stack.enter_context(fake_vigilmon())
        notes = Notifications(receiver)
        server, port = serve(fleet)
        stack.callback(server.shutdown)
        write_targets(tmp, fleet, port)
        am_config = shipped_alertmanager_config(
            tmp, lambda name: f"{receiver.url}/bridge/{name}",
            lambda name: f"{receiver.url}/slack/{name}", "fleet", lambda c: None)
        prometheus_binary, alertmanager_binary = stack_binaries(args.release)
        alertmanager = stack.enter_context(running_alertmanager(am_config, tmp,
                                                                alertmanager_binary))
        if args.engine == "prometheus":
            prometheus = stack.enter_context(launch_prometheus(
                prometheus_config(tmp, alertmanager, args.interval), tmp / "data",
                tmp / "prometheus.log", binary=prometheus_binary))
            own = SelfMetrics([prometheus.url], args.interval)
            stack.callback(own.stop.set)
            engine = Engine("Prometheus", prometheus.url, prometheus.url,
                            {"Prometheus": prometheus.proc.pid}, own)
        else:
            engine = stack.enter_context(running_victoria_metrics(
                tmp, alertmanager, args.interval, args.scrapers))
        start = time.time()
        wait_until(lambda: time.time() - start >= args.settle, timeout=args.settle + 60,
                   interval=5, what="the settle time")
        report_scale(engine, fleet, args.interval)
        if args.incident:
            incident(engine, fleet, notes, settle=args.observe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
