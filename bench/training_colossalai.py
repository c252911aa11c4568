"""Step time of a real 2-rank ColossalAI job with and without TrainingMonitor, in one run.

Run from the repository root (after `bash scripts/install-dev.sh`):

    .venv/bin/python bench/training_colossalai.py --interleaved --blocks 200 --block-steps 100
    .venv/bin/python bench/training_colossalai.py [--rounds 3] [--steps 400]

``--interleaved`` (the one bench/RESULTS.md reports) runs one job whose blocks
of steps alternate between monitor on and off in ABBA order and compares each
on block with its neighbouring off block, so that the machine's drift cancels;
``BENCH_NO_SCRAPE=1`` leaves the scraper out, as a control of the method's
resolution. Without it, each round launches the same job twice under torchrun
(2 ranks, gloo, TorchDDPPlugin, one thread per rank), once bare and once
monitored, in alternating order so that drift of the machine hits both alike
(too little, on a 2-core machine: RESULTS.md). The monitored
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
from typing import Any

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
    if mode in ("monitored", "interleaved"):
        from colossalai_exporter import TrainingMonitor
        # A fixed budget far above any block: an "off" block's steps bypass the monitor
        # and must not read as a stall (which would write stack dumps).
        monitor = TrainingMonitor(host="127.0.0.1", port=port, run_dir=run_dir,
                                  step_timeout=600 if mode == "interleaved" else None)
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

    perf = time.perf_counter
    if mode == "interleaved":
        # Blocks of steps with the monitor on and off, in one job, ABBA order: on =
        # the with-block, the publisher at its 1 s interval and the parent's scraper
        # (told through FLAG); off = the bare step, the publisher asleep, no scrapes.
        # Drift of the machine then falls on both alike within seconds.
        flag = os.path.join(run_dir, "FLAG")
        blocks = []
        for b in range(-1, steps):  # block -1 is the warm-up
            on = b % 4 in (0, 3)
            if int(os.environ["RANK"]) == 0:
                with open(flag + ".tmp", "w") as f:
                    f.write("on" if on else "off")
                os.replace(flag + ".tmp", flag)
            # The publisher's interval is private; a bench may reach in to make the
            # off blocks as quiet as a bare job (the wake makes it re-read it).
            monitor._publish_interval = 1.0 if on else 1e9
            monitor._wake.set()
            times = []
            cpu0 = time.process_time()  # every thread of this rank: training, publisher, server
            for i in range(warmup):
                t0 = perf()
                if on:
                    with monitor.step(samples=64) as step:
                        step.loss = work()
                else:
                    work()
                times.append(perf() - t0)
            if b >= 0:
                blocks.append({"on": on, "durations": times, "cpu": time.process_time() - cpu0})
        monitor.finish()
        monitor.close()
        if int(os.environ["RANK"]) == 0:
            with open(out, "w") as f:
                json.dump(blocks, f)
        sys.exit(0)
    durations = []
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


def scrape_while_on(url: str, flag: Path, stop: threading.Event, counts: list[int]) -> None:
    """Every second, scrape rank 0 if the job says its monitor is on."""
    while not stop.wait(1.0):
        try:
            if flag.read_text() != "on":
                continue
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
    url = f"http://127.0.0.1:{port}/metrics"
    scraper = threading.Thread(target=scrape_every_second, args=(url, stop, scrapes))
    if mode == "interleaved":
        (workdir / "run").mkdir(exist_ok=True)
        scraper = threading.Thread(target=scrape_while_on,
                                   args=(url, workdir / "run" / "FLAG", stop, scrapes))
    if mode != "bare" and os.environ.get("BENCH_NO_SCRAPE") != "1":
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
    durations: list[float] = json.loads(out.read_text())  # interleaved: a list of blocks
    return durations, scrapes[0]


def interleaved(blocks: int, block_steps: int) -> int:
    """One job, monitor on and off in alternating blocks (ABBA); per-block medians."""
    with tempfile.TemporaryDirectory() as tmp:
        result, scraped = run_job("interleaved", blocks, block_steps, Path(tmp))
    runs: list[dict[str, Any]] = result  # type: ignore[assignment]
    on = [statistics.median(b["durations"]) for b in runs if b["on"]]
    off = [statistics.median(b["durations"]) for b in runs if not b["on"]]
    # ABBA: pair each on block with its neighbouring off block (0-1, 3-2, 4-5, 7-6, ...).
    neighbours = [(i, j) for q in range(0, len(runs) - 3, 4) for i, j in ((q, q + 1),
                                                                          (q + 3, q + 2))]
    pairs = [statistics.median(runs[i]["durations"]) / statistics.median(runs[j]["durations"])
             for i, j in neighbours]
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, one job, {blocks} blocks"
          f" × {block_steps} steps (ABBA), rank 0 scraped {scraped} times in the on blocks")
    print(f"median of on-block medians  {statistics.median(on) * 1e3:.3f} ms ({len(on)} blocks)")
    print(f"median of off-block medians {statistics.median(off) * 1e3:.3f} ms ({len(off)} blocks)")
    ratio = statistics.median(on) / statistics.median(off)
    pairs.sort()
    quartiles = statistics.quantiles(pairs, n=4)
    print(f"ratio on / off: {ratio:.4f} (goal ≤ 1.01); paired on/off ratios: median "
          f"{statistics.median(pairs):.4f}, quartiles {quartiles[0]:.4f}–{quartiles[2]:.4f}, "
          f"range {pairs[0]:.4f}–{pairs[-1]:.4f} ({len(pairs)} pairs)")
    # A block's median hides the steps a scrape or a publish lands on; its mean (the
    # block's wall time) and rank 0's CPU time (all its threads) do not.
    mean_pairs = sorted(statistics.fmean(runs[i]["durations"])
                        / statistics.fmean(runs[j]["durations"]) for i, j in neighbours)
    mean_q = statistics.quantiles(mean_pairs, n=4)
    print(f"paired on/off ratios of block means: median {statistics.median(mean_pairs):.4f}, "
          f"quartiles {mean_q[0]:.4f}–{mean_q[2]:.4f}")
    cpu_on = statistics.median(b["cpu"] / len(b["durations"]) for b in runs if b["on"])
    cpu_off = statistics.median(b["cpu"] / len(b["durations"]) for b in runs if not b["on"])
    print(f"rank 0 CPU time per step (all threads): on {cpu_on * 1e3:.3f} ms, "
          f"off {cpu_off * 1e3:.3f} ms, extra {(cpu_on - cpu_off) * 1e3:+.3f} ms "
          f"({(cpu_on - cpu_off) / statistics.median(off) * 100:+.2f} % of an off step)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--interleaved", action="store_true",
                        help="one job with the monitor on and off in alternating blocks")
    parser.add_argument("--blocks", type=int, default=40, help="--interleaved: blocks")
    parser.add_argument("--block-steps", type=int, default=100,
                        help="--interleaved: steps per block")
    args = parser.parse_args()
    if args.interleaved:
        return interleaved(args.blocks, args.block_steps)
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
