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
(``outside=True``, what the agent serves for it) is counted the same way.

With ``--prometheus3 PATH`` (Debian testing's, which scripts/install-dev.sh unpacks
into .tools/prometheus3/usr/bin/prometheus), the same server is then scraped by
that real Prometheus 3 twice, as job "classic" and as job "nhcb" with
``convert_classic_histograms_to_nhcb: true``, and the series each job stores are
counted from its head: the measurement beside the count.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
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


def stored_series(prometheus3: str, port: int, work: Path) -> dict[str, int]:
    """Series a real Prometheus 3 stores for the server on ``port``, scraped as is
    (job "classic") and converted to NHCB (job "nhcb"), after both scraped it."""
    jobs: list[dict[str, object]] = [{"job_name": name, "scrape_interval": "1s",
             "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for name in ("classic", "nhcb")]
    jobs[1]["convert_classic_histograms_to_nhcb"] = True
    config = work / "prometheus.yml"
    config.write_text(json.dumps({"scrape_configs": jobs}))  # JSON is YAML
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        web = probe.getsockname()[1]
    with (work / "prometheus.log").open("w") as log:
        proc = subprocess.Popen([prometheus3, f"--config.file={config}",
                                 f"--storage.tsdb.path={work / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{web}",
                                 "--enable-feature=native-histograms"],  # 3.0-3.7 need it
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        query = urllib.parse.quote(
            'count by (job) ({job=~"classic|nhcb",__name__!~"up|scrape_.+"})')
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{web}/api/v1/query?query={query}",
                                            timeout=5) as response:
                    rows = json.load(response)["data"]["result"]
                counts = {r["metric"]["job"]: int(r["value"][1]) for r in rows}
                if len(counts) == 2:
                    return counts
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"Prometheus 3 never stored both jobs (log: {work / 'prometheus.log'})")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--prometheus3", help="a Prometheus 3 binary: also measure what it stores")
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
            if args.prometheus3:
                stored = stored_series(args.prometheus3, port, Path(run_dir))
                saved = stored["classic"] - stored["nhcb"]
                print(f"stored by Prometheus 3 ({args.prometheus3}): {stored['classic']} series "
                      f"a rank as scraped, {stored['nhcb']} converted ({saved} fewer)")
                print(f"  {args.ranks:,} ranks: {stored['classic'] * args.ranks:,} -> "
                      f"{stored['nhcb'] * args.ranks:,} ({saved * args.ranks:,} fewer)")
            snap = monitor.snapshot()
        finally:
            monitor.close()
    outside = encode_openmetrics(families(snap, now=time.time(), outside=True)).decode()
    report("node agent's view of the rank", FORMATS["openmetrics"][1](outside), args.ranks)


if __name__ == "__main__":
    main()
