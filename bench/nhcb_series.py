"""Series a rank costs Prometheus with classic histograms and with them converted at scrape
to native histograms with custom buckets (issue 30; docs/deploy.md, "Prometheus 3").

Run from the repository root (after `bash scripts/install-dev.sh`):

    .venv/bin/python bench/nhcb_series.py [--ranks 4096]

A real TrainingMonitor steps three times with a loss and writes a checkpoint. Its
own server (``serve="rank0"``) is then scraped over HTTP, in OpenMetrics and in the
text format, as Prometheus scrapes it. Every sample is counted, and each histogram
family's ``_bucket``/``_sum``/``_count`` series separately: each label set of such
a family becomes one series when Prometheus 3 converts it
(``convert_classic_histograms_to_nhcb``). The node agent's view of the same rank
(``outside=True``, what the agent serves for it) is counted the same way. This
is a count of what the expositions hold, not a measurement on a Prometheus 3.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from prometheus_client.core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families as text_parse

from colossalai_exporter import TrainingMonitor
from colossalai_exporter.rankstate.families import families
from colossalai_exporter.web.exposition import encode_openmetrics

FORMATS: dict[str, tuple[str, Callable[[str], Iterable[Metric]]]] = {
    "openmetrics": ("application/openmetrics-text;version=1.0.0", om_parse),
    "text": ("text/plain;version=0.0.4", text_parse),
}


def count(fams: Iterable[Metric]) -> tuple[int, int, int, dict[str, int]]:
    """(series, classic histogram series, native histogram series after conversion,
    classic series by histogram family)."""
    total, classic, label_sets = 0, Counter[str](), set[tuple[str, tuple[tuple[str, str], ...]]]()
    for fam in fams:
        for sample in fam.samples:
            total += 1
            if fam.type == "histogram":
                classic[fam.name] += 1
                key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
                label_sets.add((fam.name, key))
    return total, sum(classic.values()), len(label_sets), dict(classic)


def scrape(port: int, accept: str) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Accept": accept})
    for _ in range(100):
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                body: bytes = response.read()
                return body.decode()
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the rank server on port {port} never answered")


def report(view: str, fams: Iterable[Metric], ranks: int) -> None:
    total, classic, native, by_family = count(fams)
    after = total - classic + native
    print(f"{view}: {total} series a rank, {after} after conversion "
          f"({total - after} fewer); histograms {by_family or 'none'} -> {native} series")
    print(f"  {ranks:,} ranks: {total * ranks:,} -> {after * ranks:,} "
          f"({(total - after) * ranks:,} fewer)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4096)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as run_dir:
        monitor = TrainingMonitor(rank=0, local_rank=0, world_size=1, serve="rank0",
                                  port=port, host="127.0.0.1", run_dir=run_dir,
                                  publish_interval=0.1)
        try:
            for _ in range(3):
                with monitor.step(samples=4, tokens=4096) as step:
                    step.loss = 1.25
            with monitor.checkpoint(step=3):
                pass
            for name, (accept, parse) in FORMATS.items():
                report(f"rank server ({name}, HTTP)", parse(scrape(port, accept)), args.ranks)
            snap = monitor.snapshot()
        finally:
            monitor.close()
    outside = encode_openmetrics(families(snap, now=time.time(), outside=True)).decode()
    report("node agent's view of the rank", om_parse(outside), args.ranks)


if __name__ == "__main__":
    main()
