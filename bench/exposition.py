"""Our /metrics encoders against prometheus_client's, on a training rank's real families.

Run from the repository root (after `bash scripts/install-dev.sh`):

    .venv/bin/python bench/exposition.py [--repeat 2000]

The families are a TrainingMonitor's after 500 steps, a checkpoint and an
out-of-memory record, plus the process collector: what rank 0 serves. Both
encoders write the same families (collected once), in the text format and in
OpenMetrics 1.0, alternately; the figure is the median time per encode.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import (
    generate_latest as untyped_openmetrics_latest,
)
from prometheus_client.registry import Collector

from colossalai_exporter.web.exposition import (
    CollectedFamilies,
    encode_openmetrics,
    encode_text,
)


def openmetrics_latest(collector: Collector) -> bytes:
    return bytes(untyped_openmetrics_latest(collector))  # type: ignore[no-untyped-call]


def rank_families() -> list[Metric]:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    from colossalai_exporter import TrainingMonitor
    from colossalai_exporter.training.server import SnapshotCollector

    monitor = TrainingMonitor(serve="none", run_dir=tempfile.mkdtemp(), start=False)
    for i in range(500):
        with monitor.step(samples=8, tokens=4096) as step:
            step.loss = 3.0 - i / 500
    with monitor.checkpoint(step=500):
        pass
    monitor.record_oom(RuntimeError("Adjust layout failed! No enough CUDA memory"))
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(monitor.snapshot))
    ProcessCollector(registry=registry)
    families = list(registry.collect())
    monitor.close()
    return families


def median_seconds(encoders: dict[str, Callable[[], bytes]], repeat: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in encoders}
    for _ in range(repeat):
        for name, encode in encoders.items():  # alternate, so drift hits all alike
            start = time.perf_counter()
            encode()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    families = rank_families()
    fixed = CollectedFamilies(families)
    if encode_text(families) != generate_latest(fixed) or \
            encode_openmetrics(families) != openmetrics_latest(fixed):
        raise SystemExit("the encoders disagree; run tests/test_exposition.py")
    series = sum(len(f.samples) for f in families)
    medians = median_seconds({
        "text, prometheus_client": lambda: generate_latest(fixed),
        "text, ours": lambda: encode_text(families),
        "OpenMetrics, prometheus_client": lambda: openmetrics_latest(fixed),
        "OpenMetrics, ours": lambda: encode_openmetrics(families),
    }, args.repeat)
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, {len(families)} "
          f"families, {series} samples, {args.repeat} encodes each, alternating\n")
    print("| format | prometheus_client | ours | speed-up |\n|---|---|---|---|")
    for fmt in ("text", "OpenMetrics"):
        theirs, ours = medians[f"{fmt}, prometheus_client"], medians[f"{fmt}, ours"]
        print(f"| {fmt} | {theirs * 1e3:.3f} ms | {ours * 1e3:.3f} ms | {theirs / ours:.1f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
