"""The rules and panels that read a histogram, on a real Prometheus, classic or native.

Prometheus 3 can store a scraped classic histogram as one native histogram with
custom buckets (docs/deploy.md, "Prometheus 3"). The shipped step-mean rule and the
p90 panel read both forms. The Prometheus here is Debian's 2.42, which cannot
convert, but stores native histograms a target exposes in protobuf
(``--enable-feature=native-histograms``). histogram_sum, histogram_count,
histogram_quantile and ``or`` treat those as they treat converted ones, so the
expressions are run on three ranks:

- rank 0 exposes only a native histogram (exponential buckets, as 2.42 knows them);
- rank 1 exposes only classic ``_bucket``/``_sum``/``_count``;
- rank 2 has both under the same labels (two targets, ``honor_labels``), with the
  native one saying otherwise. That is the case of ``always_scrape_classic_histograms``
  or of a switch: the classic side must win, not be added to, nor cancel, the native.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from colossalai_exporter.rulesgen import rules
from conftest import REPO, wait_until
from prometheus_helpers import Prometheus, launch_prometheus

NAME = "colossalai_training_step_duration_seconds"
LABELS = {"job": "colossalai-training", "instance": "node-0:8766"}
RATE = 10.0  # observations a second
START = time.time()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _zigzag(n: int) -> int:
    return (n << 1) ^ (n >> 63)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _message(number: int, body: bytes) -> bytes:
    return _field(number, 2, _varint(len(body)) + body)


def _string(number: int, text: str) -> bytes:
    return _message(number, text.encode())


def _double(number: int, value: float) -> bytes:
    return _field(number, 1, struct.pack("<d", value))


def _uint(number: int, value: int) -> bytes:
    return _field(number, 0, _varint(value))


def observed() -> int:
    return int((time.time() - START) * RATE)


def native_family(ranks: dict[str, float]) -> bytes:
    """A delimited protobuf MetricFamily: per rank, every observation the same value
    (a power of two's upper half, so one exponential bucket of schema 0)."""
    count = observed()
    metrics = b""
    for rank, value in ranks.items():
        bucket = 1 if value <= 2 else 2  # schema 0: bucket i is (2^(i-1), 2^i]
        histogram = (_uint(1, count) + _double(2, value * count) + _field(5, 0, _varint(0))
                     + _message(12, _field(1, 0, _varint(_zigzag(bucket))) + _uint(2, 1))
                     + _message(13, _varint(_zigzag(count))))
        labels = b"".join(_message(1, _string(1, k) + _string(2, v))
                          for k, v in {**LABELS, "rank": rank}.items())
        metrics += _message(4, labels + _message(7, histogram))
    family = _string(1, NAME) + _string(2, "Wall-clock duration of training steps.") \
        + _uint(3, 4) + metrics
    return _varint(len(family)) + family


def classic_text(ranks: dict[str, float]) -> bytes:
    count = observed()
    lines = [f"# HELP {NAME} Wall-clock duration of training steps.", f"# TYPE {NAME} histogram"]
    for rank, value in ranks.items():
        labels = ",".join(f'{k}="{v}"' for k, v in {**LABELS, "rank": rank}.items())
        for le in (1.0, 2.0, 4.0):
            lines.append(f'{NAME}_bucket{{{labels},le="{le}"}} {count if value <= le else 0}')
        lines.append(f'{NAME}_bucket{{{labels},le="+Inf"}} {count}')
        lines += [f"{NAME}_sum{{{labels}}} {value * count}", f"{NAME}_count{{{labels}}} {count}"]
    return ("\n".join(lines) + "\n").encode()


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/native":
            body = native_family({"0": 1.5, "2": 3.0})
            kind = ("application/vnd.google.protobuf; "
                    "proto=io.prometheus.client.MetricFamily; encoding=delimited")
        else:
            body = classic_text({"1": 1.5, "2": 1.5})
            kind = "text/plain; version=0.0.4"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    target = f"127.0.0.1:{server.server_address[1]}"
    jobs = [{"job_name": name, "honor_labels": True, "scrape_interval": "1s",
             "metrics_path": f"/{name}", "static_configs": [{"targets": [target]}]}
            for name in ("native", "classic")]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"},
                                      "scrape_configs": jobs}))
    try:
        with launch_prometheus(config, tmp_path / "data", tmp_path / "prometheus.log", None,
                               "--enable-feature=native-histograms") as running:
            yield running
    finally:
        server.shutdown()
        server.server_close()


def _exprs(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("expr"), str):
            yield node["expr"]
        for value in node.values():
            yield from _exprs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _exprs(value)


def by_rank(prometheus: Prometheus, expr: str) -> dict[str, float]:
    results = prometheus.query(expr)
    ranks = [r["metric"]["rank"] for r in results]
    assert len(ranks) == len(set(ranks)), results  # one answer a rank, never two
    return {r["metric"]["rank"]: float(r["value"][1]) for r in results}


def test_step_mean_and_p90_read_native_classic_and_both(prometheus: Prometheus) -> None:
    recorded = yaml.safe_load((REPO / "rules" / "colossalai-training.rules.yml").read_text())
    (mean,) = [r["expr"] for g in recorded["groups"] for r in g["rules"]
               if r.get("record") == rules.STEP_MEAN]
    dashboard = json.loads((REPO / "grafana" / "dashboards"
                            / "colossalai-training.json").read_text())
    (p90,) = [e for e in _exprs(dashboard) if e.startswith("histogram_quantile(0.9")]
    p90 = (p90.replace("$__rate_interval", "1m").replace('"$job"', '".+"')
           .replace('"$rank"', '".+"'))

    # the native side exists only for ranks 0 and 2: the flag took and protobuf was spoken
    wait_until(lambda: len(prometheus.query(f"histogram_count(rate({NAME}[1m]))")) == 2
               and len(prometheus.query(f"rate({NAME}_count[1m])")) == 2,
               timeout=30, interval=0.5, what="both forms scraped twice")
    assert sorted(r["metric"]["rank"] for r in prometheus.query(NAME)) == ["0", "2"]

    means = by_rank(prometheus, mean)
    assert means.keys() == {"0", "1", "2"}, means
    # rank 2: the classic 1.5 s, not the native 3 s, nor the two added (2.25 s)
    assert means == pytest.approx({"0": 1.5, "1": 1.5, "2": 1.5}), means

    quantiles = by_rank(prometheus, p90)
    # every observation in (1, 2]: 90% of the way through the bucket, either form
    # (rank 2's native (2, 4] would give 3.8; a collision would give nothing)
    assert quantiles == pytest.approx({"0": 1.9, "1": 1.9, "2": 1.9}), quantiles


# --- Prometheus 3: a real rank server's classic histogram converted at scrape ---------

STEP_FAMILY = "colossalai_training_step_duration_seconds"


def _stored(prometheus: Prometheus, job: str) -> dict[str, int]:
    """Series Prometheus holds for ``job``, by metric name (its own up/scrape_* left out)."""
    counts: dict[str, int] = {}
    for row in prometheus.query(f'count by (__name__) ({{job="{job}",__name__!~"up|scrape_.+"}})'):
        counts[row["metric"]["__name__"]] = int(row["value"][1])
    return counts


def test_prometheus3_converts_a_rank_servers_histogram_and_the_rules_read_it(
        tmp_path: Path) -> None:
    """Prometheus 3 (Debian testing's) scrapes one real TrainingMonitor server twice:
    job "classic" as is, job "nhcb" with ``convert_classic_histograms_to_nhcb``, as
    docs/deploy.md ships it. The converted job stores the step histogram as one series
    (no ``_bucket``/``_sum``/``_count``) and every other series as the classic job does;
    the cumulative mean and p90 read the same from both; the shipped step-mean rule and
    the p90 panel answer once for the converted job."""
    from colossalai_exporter import TrainingMonitor
    from conftest import free_port, require_prometheus3

    binary = require_prometheus3("prometheus")
    port = free_port()
    monitor = TrainingMonitor(rank=0, local_rank=0, world_size=1, serve="rank0", port=port,
                              host="127.0.0.1", run_dir=str(tmp_path / "run"),
                              publish_interval=0.1)
    stop = threading.Event()
    steps = 0

    def train() -> None:  # steps of about 20 ms until told to stop
        nonlocal steps
        while not stop.is_set():
            with monitor.step(samples=4, tokens=4096) as step:
                time.sleep(0.02)
                step.loss = 1.25
            steps += 1

    jobs = [{"job_name": name, "scrape_interval": "1s",
             "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for name in ("classic", "nhcb")]
    jobs[1]["convert_classic_histograms_to_nhcb"] = True
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"},
                                      "scrape_configs": jobs}))
    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        # 3.0-3.7 refuse every histogram sample without the flag (docs/deploy.md)
        with launch_prometheus(config, tmp_path / "data", tmp_path / "prometheus.log", None,
                               "--enable-feature=native-histograms",
                               binary=binary) as prometheus:
            rate_both = (f"histogram_count(rate({STEP_FAMILY}[1m])) > 0 "
                         f"or rate({STEP_FAMILY}_count[1m]) > 0")
            wait_until(lambda: len(prometheus.query(rate_both)) == 2, timeout=60,
                       interval=0.5, what="both jobs scraped the steps twice")

            mean = next(r["expr"] for g in yaml.safe_load(
                (REPO / "rules" / "colossalai-training.rules.yml").read_text())["groups"]
                for r in g["rules"] if r.get("record") == rules.STEP_MEAN)
            means = prometheus.query(mean.replace('job="colossalai-training"', 'job="nhcb"'))
            assert len(means) == 1 and 0.01 < float(means[0]["value"][1]) < 10, means
            dashboard = json.loads((REPO / "grafana" / "dashboards"
                                    / "colossalai-training.json").read_text())
            (p90,) = [e for e in _exprs(dashboard) if e.startswith("histogram_quantile(0.9")]
            p90 = (p90.replace("$__rate_interval", "1m").replace('"$job"', '"nhcb"')
                   .replace('"$rank"', '".+"'))
            quantiles = prometheus.query(p90)
            assert len(quantiles) == 1 and 0.01 < float(quantiles[0]["value"][1]) < 10, quantiles

            stop.set()
            trainer.join(timeout=10)
            # both jobs past the last step: the same counts
            wait_until(lambda: {float(r["value"][1]) for r in prometheus.query(
                f'histogram_count({STEP_FAMILY}{{job="nhcb"}}) '
                f'or {STEP_FAMILY}_count{{job="classic"}}')} == {float(steps)},
                timeout=30, interval=0.5, what="both jobs scraped the last step")
            classic, nhcb = _stored(prometheus, "classic"), _stored(prometheus, "nhcb")
            buckets = classic.pop(f"{STEP_FAMILY}_bucket")
            assert classic.pop(f"{STEP_FAMILY}_sum") == classic.pop(f"{STEP_FAMILY}_count") == 1
            assert nhcb.pop(STEP_FAMILY) == 1
            assert nhcb == classic  # every other series stored alike
            assert buckets >= 10  # the step histogram's bounds and +Inf: 19 series become 1

            def value(expr: str) -> float:
                (row,) = prometheus.query(expr)
                return float(row["value"][1])

            assert value(f'histogram_sum({STEP_FAMILY}{{job="nhcb"}}) / '
                         f'histogram_count({STEP_FAMILY}{{job="nhcb"}})') == pytest.approx(
                value(f'{STEP_FAMILY}_sum{{job="classic"}} / {STEP_FAMILY}_count{{job="classic"}}'))
            # custom buckets interpolate linearly, as the classic function does
            classic_p90 = f'sum by (le) ({STEP_FAMILY}_bucket{{job="classic"}})'
            assert value(f'histogram_quantile(0.9, {STEP_FAMILY}{{job="nhcb"}})') == pytest.approx(
                value(f"histogram_quantile(0.9, {classic_p90})"))
    finally:
        stop.set()
        monitor.close()
