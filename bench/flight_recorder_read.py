"""What reading torch's flight recorder costs a stalled rank's publisher (issue 17).

    .venv/bin/torchrun --nproc_per_node 2 bench/flight_recorder_read.py --collectives 5000

Two gloo ranks run N all-reduces (the recorder keeps the last 2,000 by default),
then rank 0 times ``flight_recorder.progress()``: the first read of a stall, which
also reads the recorded entries to name each group's last collective, and the
reads after it, which only read the groups' status because nothing moved. The
publisher reads it once per publish interval, only while the rank is stalled.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

import torch
import torch.distributed as dist

from colossalai_exporter.training import flight_recorder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", type=int, default=5000)
    parser.add_argument("--reads", type=int, default=200)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    tensor = torch.ones(1024)
    for _ in range(args.collectives):
        dist.all_reduce(tensor)
    if dist.get_rank() == 0:
        start = time.perf_counter()
        known = flight_recorder.progress()
        first = time.perf_counter() - start
        times = []
        for _ in range(args.reads):
            start = time.perf_counter()
            flight_recorder.progress(known)
            times.append(time.perf_counter() - start)
        times.sort()
        print(f"{args.collectives} collectives: first read {first * 1e3:.1f} ms; then median "
              f"{statistics.median(times) * 1e6:.0f} us, p90 "
              f"{times[int(len(times) * 0.9)] * 1e6:.0f} us; {known}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
