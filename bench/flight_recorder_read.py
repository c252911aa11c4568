"""What reading torch's flight recorder costs a rank's publisher (issue 17).

    .venv/bin/torchrun --nproc_per_node 2 bench/flight_recorder_read.py --collectives 5000

Two gloo ranks run N all-reduces (the recorder keeps the last 2,000 by default),
then rank 0 times ``ProgressReader.read()``: the first read of a stall, which also
reads the recorded entries to name each group's last collective, and the reads
after it, which only read the groups' status because nothing moved (the publisher
reads it once per publish interval, only while the rank is stalled); and
``PendingReader.read()``, the oldest collective in flight, which every publish
reads, stalled or not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

import torch
import torch.distributed as dist

from colossalai_exporter.training import flight_recorder


def timed(read: Callable[[], object], reads: int) -> str:
    """"median 11 us, p90 12 us" over ``reads`` calls of ``read``."""
    times = []
    for _ in range(reads):
        start = time.perf_counter()
        read()
        times.append(time.perf_counter() - start)
    times.sort()
    return (f"median {statistics.median(times) * 1e6:.0f} us, "
            f"p90 {times[int(len(times) * 0.9)] * 1e6:.0f} us")


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
        reader = flight_recorder.ProgressReader()
        start = time.perf_counter()
        known = reader.read()
        first = time.perf_counter() - start
        later = timed(reader.read, args.reads)
        pending_reader = flight_recorder.PendingReader()
        pending = timed(lambda: pending_reader.read(time.time()), args.reads)
        print(f"{args.collectives} collectives: progress: first read {first * 1e3:.1f} ms; "
              f"then {later}; in flight: {pending}; {known}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
