"""Our text and OpenMetrics encoders write exactly what prometheus_client writes.

web/exposition.py replaces the library's encoders on the scrape path for speed;
these tests hold it to the library's bytes on every server's real families and
on every family type and escaping edge case, and check that whatever it does
not handle goes to the library.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    Summary,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    StateSetMetricFamily,
    SummaryMetricFamily,
    UnknownMetricFamily,
)
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from colossalai_exporter.web.exposition import (
    CollectedFamilies,
    encode,
    encode_openmetrics,
    encode_text,
)
from gpu_helpers import Scenario, gpu, use_fake_nvml

# What Prometheus 2.42 (the Debian package the tests run) sends when it scrapes.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
ACCEPT_HEADERS = [
    "",
    "*/*",
    "text/plain",
    "text/plain;version=0.0.4",
    PROMETHEUS_ACCEPT,
    "application/openmetrics-text",
    "application/openmetrics-text;version=1.0.0",
    "application/openmetrics-text;version=0.0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    "application/openmetrics-text;version=1.0.0;escaping=values",
    # Only the library writes these; encode() must hand them over.
    "application/openmetrics-text;version=1.0.0;escaping=dots",
    "application/openmetrics-text;version=2.0.0",
    "text/plain;version=1.0.0;escaping=underscores",
    "text/plain;version=1.0.0;escaping=dots",
]


def assert_same_as_library(families: Sequence[Metric]) -> None:
    fixed = CollectedFamilies(families)  # collected once: both encoders see the same values
    assert encode_text(fixed.families) == generate_latest(fixed)
    assert encode_openmetrics(fixed.families) == openmetrics_latest(fixed)


def edge_case_families() -> list[Metric]:
    registry = CollectorRegistry()  # instrumented metrics: _created samples, _total names
    requests = Counter("demo_requests", "Requests, by \"path\" and code.\nSecond line \\ end.",
                       ["path", "code"], registry=registry)
    requests.labels('/v1/"chat"', "200").inc(3)
    requests.labels("C:\\models\nnew line", "500").inc()
    requests.labels("ünïcødé ✓", "").inc(0.5)
    latency = Histogram("demo_latency_seconds", "Latency.", ["path"], registry=registry,
                        buckets=(0.001, 0.5, 2.5, 1e21))
    latency.labels("/a").observe(0.3)
    latency.labels("/a").observe(1e22)
    Summary("demo_size_bytes", "Size.", registry=registry).observe(4096)
    Gauge("demo_nan", "Not a number.", registry=registry).set(math.nan)
    Gauge("demo_inf", "Infinite.", registry=registry).set(math.inf)
    Gauge("demo_minus_inf", "Minus infinity.", registry=registry).set(-math.inf)
    Gauge("demo_big", "Big.", registry=registry).set(123456789012.5)
    Gauge("demo_small", "Small.", registry=registry).set(1.5e-9)
    edges = Gauge("demo_edges", "Around the 1e6 switch to exponents.", ["v"], registry=registry)
    for value in (999999.5, 1e6, 1234567.0, -1234567.0, 1e-7, 0.0, -0.0, 12, 2**53, 1e300):
        edges.labels(repr(value)).set(value)
    Info("demo_build", "Build.", registry=registry).info({"version": "1.2.3", "commit": "a\"b"})
    Enum("demo_phase", "Phase.", states=["init", "training", "finished"],
         registry=registry).state("training")
    families = list(registry.collect())

    stamped = GaugeMetricFamily("demo_stamped", "With a timestamp.", labels=["rank"])
    stamped.add_metric(["0"], 1.0, timestamp=1700000000.123)
    stamped.add_metric(["1"], 2.0, timestamp=1700000000)
    unit = GaugeMetricFamily("demo_age_seconds", "With a unit.", unit="seconds")
    unit.add_metric([], 12.0)
    created = CounterMetricFamily("demo_jobs", "Jobs.", labels=["job"], created=1700000000.5)
    created.add_metric(["a"], 7, created=1700000001.25)
    info = InfoMetricFamily("demo_node", "Node.", value={"node": "gpu-a1"})
    stateset = StateSetMetricFamily("demo_mode", "Mode.", value={"on": True, "off": False})
    gauge_hist = GaugeHistogramMetricFamily("demo_queue", "Queue.", buckets=[("1", 2), ("+Inf", 5)],
                                            gsum_value=7)
    hist = HistogramMetricFamily("demo_hist", "Hist.", buckets=[("0.5", 1), ("+Inf", 3)],
                                 sum_value=2.5)
    summary = SummaryMetricFamily("demo_summary", "Summary.", count_value=3, sum_value=1.5)
    unknown = UnknownMetricFamily("demo_unknown", "Untyped.", value=4)
    empty = GaugeMetricFamily("demo_empty", "No samples at all.", labels=["x"])
    return [*families, stamped, unit, created, info, stateset, gauge_hist, hist, summary,
            unknown, empty]


def test_every_family_type_and_escape_is_written_as_the_library_writes_it() -> None:
    families = edge_case_families()
    types = {f.type for f in families}
    assert types >= {"counter", "gauge", "histogram", "summary", "info", "stateset",
                     "gaugehistogram", "unknown"}
    assert_same_as_library(families)


@pytest.mark.parametrize("accept", ACCEPT_HEADERS)
def test_negotiation_and_content_type_are_the_librarys(accept: str) -> None:
    registry = CollectedFamilies(edge_case_families())
    library_encoder, library_type = choose_encoder(accept)
    assert encode(registry, accept) == (library_encoder(registry), library_type)  # type: ignore[arg-type]


def test_what_only_the_library_writes_goes_to_the_library_collected_once() -> None:
    registry = CollectorRegistry()
    hits = Counter("demo_hits", "Hits.", registry=registry)
    hits.inc(exemplar={"trace_id": "abc123"})

    class CountingCollector:
        calls = 0

        def collect(self) -> Iterator[Metric]:
            CountingCollector.calls += 1
            return registry.collect()

    collector = CountingCollector()
    body, content_type = encode(collector, "application/openmetrics-text;version=1.0.0")  # type: ignore[arg-type]
    assert b'# {trace_id="abc123"} 1.0' in body  # the exemplar, which only the library writes
    assert body == openmetrics_latest(registry)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert CountingCollector.calls == 1  # a collect runs collectors: never twice per scrape


def test_the_node_agents_families(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import CollectorRegistry, ProcessCollector

    from colossalai_exporter.node.agent import Agent
    from colossalai_exporter.node.disk import DiskCollector, WatchedPath
    from colossalai_exporter.node.gpu import GpuCollector
    from colossalai_exporter.node.host import HostCollector
    from colossalai_exporter.node.rendezvous import Endpoint, RendezvousCollector

    scenario = Scenario(tmp_path / "nvml.json").write(
        driver_version="550.54.15", gpus=[gpu(0), gpu(1)],
        xid=[{"id": 1, "gpu": 1, "code": 79}])
    use_fake_nvml(monkeypatch, scenario.path)
    with socket.socket() as closed:  # a port nothing listens on: nccl_up 0, reason refused
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
    agent = Agent([GpuCollector(), HostCollector(),
                   DiskCollector([WatchedPath("checkpoints", str(tmp_path)),
                                  WatchedPath("nvme_offload", str(tmp_path / "missing"))]),
                   RendezvousCollector([Endpoint("127.0.0.1", dead_port)], timeout=1.0)])
    registry = CollectorRegistry(auto_describe=False)  # what the agent's /metrics serves
    registry.register(agent)
    ProcessCollector(registry=registry)
    try:
        deadline = time.monotonic() + 30  # the NVML worker's first answer
        while True:
            families = list(registry.collect())
            if agent.states["gpu"].up or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert agent.states["gpu"].up, agent.states["gpu"]
        names = {f.name for f in families}
        assert {"colossalai_gpu_memory_used_bytes", "colossalai_disk_path_ok",
                "colossalai_nccl_up", "process_cpu_seconds"} <= names, names
        assert_same_as_library(families)
    finally:
        agent.close()


def test_a_training_ranks_families(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from colossalai_exporter import TrainingMonitor
    from colossalai_exporter.node.ranks import RanksCollector
    from colossalai_exporter.training.server import SnapshotCollector

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    monitor = TrainingMonitor(run_dir=tmp_path / "run", serve="none")
    try:
        for i in range(20):
            with monitor.step(samples=8, tokens=4096) as step:
                step.loss = 2.0 - i / 10
        with monitor.checkpoint(step=20):
            pass
        monitor.record_oom(RuntimeError("Adjust layout failed! No enough CUDA memory"))
        monitor._publisher.publish()
        own = CollectorRegistry()
        own.register(SnapshotCollector(monitor.snapshot))
        ProcessCollector(registry=own)
        families = list(own.collect())
        assert "colossalai_training_step_duration_seconds" in {f.name for f in families}
        assert_same_as_library(families)
        # The node agent re-serves the same snapshot with a rank label.
        seen = list(RanksCollector(tmp_path / "run").collect(time.monotonic() + 5))
        assert any(f.name == "colossalai_rank_up" and f.samples for f in seen)
        assert_same_as_library(seen)
    finally:
        monitor.finish()
        monitor.close()


def test_the_chat_helpers_families() -> None:
    from colossalai_exporter.chat.instrument import ChatMetrics

    metrics = ChatMetrics()
    metrics.requests[("POST", "/v1/chat/completions", "200")] += 5
    metrics.errors[("POST", "/v1/chat/completions", "engine")] += 1
    families = list(metrics.registry.collect())
    assert_same_as_library(families)
