"""Per-step cost of TrainingMonitor's hot path, against a bare loop and prometheus_client.

Run from the repository root:

    PYTHONPATH=exporter python bench/training_overhead.py [--steps N] [--repeats R]

Each variant runs N iterations, R times; the best (least disturbed) run is
reported, in nanoseconds per iteration, with the bare loop's own cost
subtracted. The monitor runs as in training: publisher thread on (snapshots
into a temporary run directory every second), no HTTP server.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from colossalai_exporter import TrainingMonitor


def best_ns_per_iter(loop: Callable[[int], None], steps: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter_ns()
        loop(steps)
        best = min(best, (time.perf_counter_ns() - started) / steps)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    registry = CollectorRegistry()
    counter = Counter("bench_steps", "steps", registry=registry)
    gauge = Gauge("bench_loss", "loss", registry=registry)
    with tempfile.TemporaryDirectory() as run_dir:
        monitor = TrainingMonitor(serve="none", run_dir=run_dir)

        def bare(n: int) -> None:
            box = [0.0]  # the loop body stores a loss, as the measured variants do
            for _ in range(n):
                box[0] = 1.0

        def with_block(n: int) -> None:
            step = monitor.step
            for _ in range(n):
                with step() as s:
                    s.loss = 1.0

        def plain_call(n: int) -> None:
            done = monitor.step_done
            for _ in range(n):
                done(loss=1.0)

        def prometheus_pair(n: int) -> None:
            inc, set_ = counter.inc, gauge.set
            for _ in range(n):
                inc()
                set_(1.0)

        results = {name: best_ns_per_iter(fn, args.steps, args.repeats) for name, fn in
                   (("bare loop", bare), ("with monitor.step()", with_block),
                    ("monitor.step_done()", plain_call),
                    ("Counter.inc() + Gauge.set()", prometheus_pair))}
        monitor.close()

    base = results["bare loop"]
    pair = results["Counter.inc() + Gauge.set()"] - base
    print(f"python {sys.version.split()[0]} on {platform.machine()}, "
          f"{args.steps} steps x {args.repeats} repeats (best run)")
    print(f"{'variant':32} {'ns/iter':>9} {'minus bare':>11} {'vs pair':>8}")
    for name, ns in results.items():
        cost = ns - base
        ratio = f"{cost / pair:.2f}x" if name != "bare loop" else "-"
        print(f"{name:32} {ns:9.1f} {cost:11.1f} {ratio:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
