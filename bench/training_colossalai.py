"""Step time of a real 2-rank ColossalAI job with and without TrainingMonitor, in one run.

Run from the repository root (after `bash scripts/install-dev.sh`):

    .venv/bin/python bench/training_colossalai.py [--rounds 3] [--steps 400]

Each round launches the same job twice under torchrun (2 ranks, gloo,
TorchDDPPlugin, one thread per rank), once bare and once monitored, in
alternating order so that drift of the machine hits both alike. The monitored
job runs everything the monitor runs in production: the with-block around
every step with the loss as a tensor, the publisher thread (snapshots every
second), rank 0's HTTP server, and a scraper in this process fetching rank 0's
/metrics every second as Prometheus would. Each rank times every step after
a warm-up with perf_counter; the figure per job is rank 0's median step time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import urllib.request
from pathlib import Path

JOB = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import colossalai
    from colossalai.booster import Booster
    from colossalai.booster.plugin import TorchDDPPlugin

    mode, steps, warmup, out, port, run_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \\
        sys.argv[4], int(sys.argv[5]), sys.argv[6]
    colossalai.launch_from_torch(backend="gloo", verbose=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 512))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    criterion = torch.nn.MSELoss()
    booster = Booster(plugin=TorchDDPPlugin())
    monitor = None
    if mode == "monitored":
        from colossalai_exporter import TrainingMonitor
        monitor = TrainingMonitor(host="127.0.0.1", port=port, run_dir=run_dir)
        model, optimizer, criterion, _, _ = monitor.boost(booster, model, optimizer, criterion)
    else:
        model, optimizer, criterion, _, _ = booster.boost(model, optimizer, criterion)
    x, y = torch.randn(64, 512), torch.randn(64, 512)

    def work():
        loss = criterion(model(x), y)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    durations = []
    perf = time.perf_counter
    for i in range(warmup + steps):
        t0 = perf()
        if monitor is None:
            work()
        else:
            with monitor.step(samples=64) as step:
                step.loss = work()
        if i >= warmup:
            durations.append(perf() - t0)
    if monitor is not None:
        monitor.finish()
        monitor.close()
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as f:
            json.dump(durations, f)
""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape_every_second(url: str, stop: threading.Event, counts: list[int]) -> None:
    while not stop.wait(1.0):
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                response.read()
            counts[0] += 1
        except OSError:
            pass  # not up yet, or finished


def run_job(mode: str, steps: int, warmup: int, workdir: Path) -> tuple[list[float], int]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        raise SystemExit("torchrun not found next to this Python (bash scripts/install-dev.sh)")
    script, out = workdir / "job.py", workdir / f"{mode}.json"
    script.write_text(JOB)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1] / "exporter"))
    stop, scrapes = threading.Event(), [0]
    scraper = threading.Thread(target=scrape_every_second,
                               args=(f"http://127.0.0.1:{port}/metrics", stop, scrapes))
    if mode == "monitored":
        scraper.start()
    try:
        subprocess.run([torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                        "--master_port", str(free_port()), str(script), mode, str(steps),
                        str(warmup), str(out), str(port), str(workdir / "run")],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=900)
    finally:
        stop.set()
        if scraper.is_alive():
            scraper.join()
    durations: list[float] = json.loads(out.read_text())
    return durations, scrapes[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    args = parser.parse_args()
    medians: dict[str, list[float]] = {"bare": [], "monitored": []}
    scraped = 0
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = ("bare", "monitored") if round_ % 2 == 0 else ("monitored", "bare")
            for mode in order:
                durations, scrapes = run_job(mode, args.steps, args.warmup, Path(tmp))
                scraped += scrapes
                medians[mode].append(statistics.median(durations))
                print(f"round {round_ + 1} {mode:<9} median step "
                      f"{medians[mode][-1] * 1e3:7.3f} ms  p90 "
                      f"{statistics.quantiles(durations, n=10)[-1] * 1e3:7.3f} ms", flush=True)
    bare, monitored = statistics.median(medians["bare"]), statistics.median(medians["monitored"])
    print(f"\npython {platform.python_version()}, {os.cpu_count()} CPUs, {args.rounds} rounds × "
          f"{args.steps} steps (after {args.warmup} warm-up), rank 0 scraped {scraped} times")
    print("| job | median step (median of rounds) |\n|---|---|")
    print(f"| bare ColossalAI loop | {bare * 1e3:.3f} ms |")
    print(f"| with TrainingMonitor | {monitored * 1e3:.3f} ms |")
    print(f"\nratio monitored / bare: {monitored / bare:.4f} (goal ≤ 1.01); per round: "
          + ", ".join(f"{m / b:.4f}" for m, b in zip(medians["monitored"], medians["bare"],
                                                        strict=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
