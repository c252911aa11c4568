"""``colossalai-exporter demo``: watch a short real training run through the exporter's eyes."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import requests

from colossalai_exporter.demo import alerting, onehost
from colossalai_exporter.demo.launch import (
    Started,
    check_port_free,
    choose_backend,
    start_agent,
    start_ranks,
)
from colossalai_exporter.demo.summary import Summary, describe
from colossalai_exporter.errors import ConfigError
from colossalai_exporter.flags import ArgumentParser
from colossalai_exporter.rankstate.schema import Snapshot

DEFAULTS = onehost.Ports()


def positive(kind: type[int] | type[float], minimum: float) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` no smaller than ``minimum``."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind.__name__}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is below {minimum}")
        return value
    parse.__name__ = kind.__name__
    return parse


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="colossalai-exporter demo",
        description="A short real training run on the CPU with the TrainingMonitor and the "
                    "node agent: ColossalAI (TorchDDPPlugin, 2 ranks under torchrun) when "
                    "installed, else plain torch DDP, else a plain Python loop.")
    p.add_argument("--backend", choices=("auto", "colossalai", "torch", "plain"),
                   default="auto", help="what trains (default: the best one installed)")
    p.add_argument("--ranks", type=positive(int, 1), default=2, help="ranks (default 2)")
    p.add_argument("--steps", type=positive(int, 1), default=600,
                   help="steps per rank (default 600, about a minute)")
    p.add_argument("--step-seconds", type=positive(float, 0), default=0.1,
                   help="extra time each step takes (default 0.1)")
    p.add_argument("--checkpoint-every", type=positive(int, 0), default=100,
                   help="steps between checkpoints, 0 for none (default 100)")
    p.add_argument("--stall-after", type=positive(int, 0), default=0, metavar="N",
                   help="stop stepping after N steps, to see /health turn 503, the stall "
                        "evidence and the node agent's view")
    p.add_argument("--stall-for", type=positive(float, 0), default=0.0, metavar="SECONDS",
                   help="how long the stall lasts before the ranks exit (default: until "
                        "Ctrl-C)")
    p.add_argument("--kill-after", type=positive(int, 1), default=None, metavar="N",
                   help="kill the last rank with SIGKILL after step N, as the kernel's OOM "
                        "killer would (default with --alerting: 100, unless --stall-after "
                        "is given)")
    p.add_argument("--step-timeout", type=positive(float, 0.1), default=10.0,
                   metavar="SECONDS", help="the step budget a stall is judged by (default 10; "
                                            "real runs learn it)")
    p.add_argument("--host", default="127.0.0.1", help="address every server binds")
    p.add_argument("--port", type=positive(int, 1), default=DEFAULTS.rank0,
                   help="rank 0's /metrics and /health (default 8766)")
    p.add_argument("--agent-port", type=positive(int, 0), default=DEFAULTS.agent,
                   help="the node agent's port, 0 to not start one (default 9466)")
    p.add_argument("--master-port", type=positive(int, 0), default=0,
                   help="torchrun's rendezvous port, for a node agent of your own to check "
                        "(default: a free port)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="run dir, checkpoints and logs (default: a new temporary directory)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="where ranks write snapshots and stall evidence, for a node agent "
                        "of your own (default: WORKDIR/run)")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="where checkpoints go (default: WORKDIR/checkpoints)")
    p.add_argument("--interval", type=positive(float, 0.1), default=2.0,
                   help="seconds between summary lines (default 2)")
    stack = p.add_argument_group("the alert path")
    stack.add_argument("--alerting", action="store_true",
                       help="also start, on this host, Prometheus with the shipped rules, "
                            "Alertmanager with the shipped routing and Slack templates, the "
                            "bridge, and a pager standing in for Slack and the on-call "
                            "webhook (Debian's prometheus and prometheus-alertmanager must be "
                            "installed); inject the failure and print the page on-call "
                            "would get; runs until Ctrl-C")
    for name, what in (("prometheus", "Prometheus"), ("alertmanager", "Alertmanager"),
                       ("bridge", "the bridge"), ("pager", "the pager")):
        stack.add_argument(f"--{name}-port", type=positive(int, 1),
                           default=getattr(DEFAULTS, name),
                           help=f"port for {what} (default {getattr(DEFAULTS, name)})")
    return p


def wait_for_http(url: str, procs: Started, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and procs.running():
        try:
            requests.get(url, timeout=1.0)
            return True
        except requests.RequestException:
            time.sleep(0.2)
    return False


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    backend, what = choose_backend(args.backend)
    ports = stack_ports(args)
    # Looked up first: a missing one is an error before anything starts.
    binaries = alerting.binaries() if args.alerting else None
    if args.alerting:
        if not args.agent_port:
            raise ConfigError("--alerting needs the node agent: leave --agent-port at a port")
        if args.kill_after is None and not args.stall_after:
            args.kill_after = 100
    check_port_free(args.host, args.port, "rank 0")
    if args.agent_port:
        check_port_free(args.host, args.agent_port, "node agent")
    if args.alerting:
        for name in ("prometheus", "alertmanager", "bridge", "pager"):
            check_port_free(args.host, getattr(ports, name), name)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="colossalai-exporter-demo-"))
    run_dir = args.run_dir or workdir / "run"
    checkpoints = args.checkpoint_dir or workdir / "checkpoints"
    for path in (workdir, run_dir, checkpoints):  # the logs go in workdir
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create {path}: {exc.strerror or exc}") from None
    base = f"http://{args.host}:{args.port}"
    agent_base = f"http://{args.host}:{args.agent_port}"

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    with contextlib.ExitStack() as cleanup, \
            open(workdir / "agent.log", "ab") as agent_log, \
            open(workdir / "train.log", "ab") as train_log:
        # The alert path first, so that Prometheus sees the run from its first second,
        # as it would a job started under a running stack. Stopped last.
        stack = alerting.start(workdir, args.host, ports, binaries) if binaries else None
        if stack:
            cleanup.callback(stack.stop)
        agent = start_agent(args.host, args.agent_port, run_dir, checkpoints, agent_log) \
            if args.agent_port else Started([])
        cleanup.callback(agent.stop)
        worker_args = ["--steps", str(args.steps), "--step-seconds", str(args.step_seconds),
                       "--stall-after", str(args.stall_after), "--stall-for", str(args.stall_for),
                       "--checkpoint-every", str(args.checkpoint_every),
                       "--checkpoint-dir", str(checkpoints), "--run-dir", str(run_dir),
                       "--host", args.host, "--port", str(args.port),
                       "--step-timeout", str(args.step_timeout)]
        ranks = start_ranks(backend, args.ranks, worker_args, args.host, train_log,
                            args.master_port)
        cleanup.callback(ranks.stop)
        return watch(args, backend, what, workdir, run_dir, base, agent_base, ranks, agent,
                     stop, stack)


@dataclass
class Failure:
    """The failure the demo injects, and when it happened."""

    kill_after: int | None
    stall_after: int
    at: float | None = None

    def inject(self, snaps: list[Snapshot]) -> str | None:
        """Kill the last rank once it has done ``kill_after`` steps, or note when the
        ranks reached ``stall_after``; a line to print when it happens."""
        if self.at is not None or not snaps:
            return None
        last = max(snaps, key=lambda snap: snap.rank)
        if self.kill_after and last.steps >= self.kill_after and last.phase == "training":
            with contextlib.suppress(ProcessLookupError):
                os.kill(last.pid, signal.SIGKILL)
            self.at = time.time()
            return (f"killed rank {last.rank} (pid {last.pid}) with SIGKILL at step "
                    f"{last.steps}, as the kernel's OOM killer would")
        if self.stall_after and all(snap.steps >= self.stall_after for snap in snaps):
            self.at = max(snap.last_step or time.time() for snap in snaps)
            return f"every rank stopped stepping after step {self.stall_after}"
        return None


def watch(args: argparse.Namespace, backend: str, what: str, workdir: Path, run_dir: Path,
          base: str, agent_base: str, ranks: Started, agent: Started,
          stop: threading.Event, stack: alerting.AlertStack | None) -> int:
    print(f"colossalai-exporter demo: {args.ranks} ranks, {what}", flush=True)
    print(f"  rank 0 metrics   {base}/metrics", flush=True)
    print(f"  rank 0 health    {base}/health", flush=True)
    if args.agent_port:
        print(f"  node agent       {agent_base}/metrics   (every rank seen from outside)")
        print(f"  agent health     {agent_base}/health")
    print(f"  run directory    {run_dir}   (rank snapshots, stall evidence)")
    print(f"  training log     {workdir / 'train.log'}", flush=True)
    if stack:
        for line in alerting.introduce(stack, args.host, stack_ports(args), workdir):
            print(line, flush=True)
    if args.stall_after:
        lasts = f"for {args.stall_for:g} s" if args.stall_for else "until you press Ctrl-C"
        print(f"  every rank stops stepping after step {args.stall_after}, {lasts}; watch "
              f"/health turn 503 about {args.step_timeout:g} s later", flush=True)
    if args.kill_after:
        print(f"  the last rank is killed with SIGKILL after step {args.kill_after}",
              flush=True)
    print("  Ctrl-C stops " + ("everything the demo started" if stack
                               else "the ranks and the node agent"), flush=True)
    if args.agent_port and not wait_for_http(agent_base + "/health", agent, 15):
        print(f"node agent did not come up: see {workdir / 'agent.log'}", flush=True)
    summary = Summary(run_dir, base + "/health",
                      agent_base + "/metrics" if args.agent_port else None)
    failure = Failure(args.kill_after, args.stall_after)
    pages = alerting.PageWatch(stack.pager) if stack else None
    ended = False
    while not stop.is_set():
        lines = summary.look() if not ended else []
        injected = failure.inject(summary.seen) if not ended else None
        lines += [injected] if injected else []
        lines += pages.look(failure.at) if pages else []
        for line in lines:
            print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)
        if not ended and not ranks.running():
            ended = True
            code = report_end(args, backend, workdir, ranks, summary)
            if not stack:
                return code
            print("the alert path stays up for you to look at (the URLs above); Ctrl-C "
                  "stops it", flush=True)
        stop.wait(args.interval)
    print("interrupted: stopping " + ("everything the demo started" if stack
                                      else "the ranks and the node agent"), flush=True)
    return 130


def stack_ports(args: argparse.Namespace) -> onehost.Ports:
    return onehost.Ports(args.prometheus_port, args.alertmanager_port, args.bridge_port,
                         args.agent_port, args.port, args.pager_port)


def report_end(args: argparse.Namespace, backend: str, workdir: Path, ranks: Started,
               summary: Summary) -> int:
    """Print how the run ended; the exit code the demo ends with."""
    codes = ranks.returncodes()
    print(f"training ended ({backend}), exit codes {codes}, logs in {workdir}:", flush=True)
    for line in describe(summary.snapshots()):
        print(f"  {line}", flush=True)
    if not args.stall_after and not args.kill_after:
        print("next: add --stall-after 100 to see a stall reach /health and the node agent, "
              "or --alerting to see the page it sends (Prometheus, Alertmanager and the "
              "bridge on this host); docs/deploy.md wires them for real", flush=True)
    return 0 if all(code == 0 for code in codes) else 1
