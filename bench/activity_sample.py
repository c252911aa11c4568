"""What naming the rank a hang waits for costs: one sample of the training thread's place.

The monitor's publisher samples the training thread once per publish (about once a
second; training/activity.py): ``sys._current_frames()`` and a walk up the stack.
It runs on the publisher thread, holding the GIL while it does, which is the only
way it can touch the training thread. Measured here against a training thread
``depth`` frames deep inside a real torch backward (the usual place), and as a
share of a second, the default publish interval::

    .venv/bin/python bench/activity_sample.py --depth 60
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from colossalai_exporter.training.activity import sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=60, help="Python frames above backward")
    parser.add_argument("--samples", type=int, default=2000)
    args = parser.parse_args()
    model = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    stop = threading.Event()
    ready = threading.Event()

    def nested(level: int) -> None:
        if level:
            nested(level - 1)
            return
        ready.set()
        while not stop.is_set():
            model(x).pow(2).sum().backward()

    worker = threading.Thread(target=nested, args=(args.depth,), daemon=True)
    worker.start()
    ready.wait(30)
    kinds: dict[str, int] = {}
    costs = []
    for _ in range(args.samples):
        start = time.perf_counter()
        where = sample(worker.ident)
        costs.append(time.perf_counter() - start)
        kind = where.kind if where else "none"
        kinds[kind] = kinds.get(kind, 0) + 1
    stop.set()
    worker.join(10)
    costs_us = sorted(c * 1e6 for c in costs)
    median = statistics.median(costs_us)
    print(f"{args.samples} samples of a thread {args.depth} frames deep in a training loop")
    print(f"median {median:.1f} us, p99 {costs_us[int(0.99 * len(costs_us))]:.1f} us; "
          f"at one sample a second: {median / 1e6:.6%} of the GIL")
    print("classified:", dict(sorted(kinds.items())))


if __name__ == "__main__":
    main()
