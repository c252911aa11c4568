"""Metrics: a probe's outcome as blackbox-style families, and the prober's own counters."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from colossalai_exporter import catalogue
from colossalai_exporter.histograms import LabelledHistogram
from colossalai_exporter.probe.config import REASONS
from colossalai_exporter.probe.http import PHASES
from colossalai_exporter.probe.modules import Outcome, StreamStats
from colossalai_exporter.web.exposition import CollectedFamilies

REFUSED_PROBE_REASONS = ("missing_target", "bad_target", "missing_module", "unknown_module",
                         "bad_timeout", "not_allowed", "busy")
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _gauge(name: str, value: float | None = None) -> GaugeMetricFamily:
    fam = catalogue.gauge(name)
    if value is not None:
        fam.add_metric([], value)
    return fam


def outcome_families(outcome: Outcome) -> list[Metric]:
    """The families one probe answers with (each probe gets its own registry)."""
    families: list[Metric] = [
        _gauge("probe_success", value=1.0 if outcome.success else 0.0),
        _gauge("probe_duration_seconds", value=outcome.duration),
        _gauge("probe_dns_lookup_time_seconds", value=outcome.dns_seconds),
        _gauge("probe_ip_protocol", value=float(outcome.ip_protocol)),
    ]
    failure = catalogue.info("probe_failure_info")
    if outcome.reason is not None:
        failure.add_metric([], {"reason": outcome.reason})
    families.append(failure)
    progress = outcome.progress
    if outcome.http and progress is not None:
        families.append(_gauge("probe_http_status_code", value=float(progress.status_code)))
        phases = catalogue.gauge("probe_http_duration_seconds")
        for phase in PHASES:
            phases.add_metric([phase], progress.phases[phase])
        families.append(phases)
        families.append(_gauge("probe_http_ssl", value=1.0 if progress.tls_used else 0.0))
        families.append(_gauge("probe_http_uncompressed_body_length",
                                value=float(progress.body_length)))
    if progress is not None and progress.cert_expiry is not None:
        families.append(_gauge("probe_ssl_earliest_cert_expiry", value=progress.cert_expiry))
    if outcome.stream is not None:
        families.extend(stream_families(outcome.stream))
    steps = catalogue.gauge("colossalai_probe_step_success")
    for step, ok in outcome.steps:
        steps.add_metric([step], 1.0 if ok else 0.0)
    families.append(steps)
    return families


def stream_families(stats: StreamStats) -> list[Metric]:
    """A streaming probe's measurements; those it did not get to are absent."""
    families: list[Metric] = [
        _gauge("colossalai_probe_stream_completed", 1.0 if stats.completed else 0.0),
        _gauge("colossalai_probe_stream_tokens", float(stats.tokens)),
    ]
    if stats.first_token is not None:
        families.append(_gauge("colossalai_probe_stream_first_token_seconds",
                               stats.first_token))
    if stats.tokens > 1:
        families.append(_gauge("colossalai_probe_stream_max_token_gap_seconds", stats.max_gap))
    if stats.tokens_per_second is not None:
        families.append(_gauge("colossalai_probe_stream_tokens_per_second",
                               stats.tokens_per_second))
    return families


def outcome_registry(outcome: Outcome) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CollectedFamilies(outcome_families(outcome)))
    return registry


class ProberStats(Collector):
    """The prober's own counters, read at every ``/metrics`` scrape."""

    def __init__(self, modules: Iterable[str], max_concurrent: int) -> None:
        self._lock = threading.Lock()
        self._modules = sorted(modules)
        self._max_concurrent = max_concurrent
        self.probes: Counter[tuple[str, str]] = Counter()
        self.rejected: Counter[str] = Counter()
        self.in_flight = 0
        self._durations = LabelledHistogram(DURATION_BUCKETS)  # by module

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finished(self, outcome: Outcome) -> None:
        with self._lock:
            self.in_flight -= 1
            result = "success" if outcome.success else (outcome.reason or "unknown")
            self.probes[outcome.module, result] += 1
            self._durations.observe((outcome.module,), outcome.duration)

    def cancelled(self) -> None:
        """A probe that ended without an outcome (NotAllowed after resolution)."""
        with self._lock:
            self.in_flight -= 1

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            probes = dict(self.probes)
            rejected = dict(self.rejected)
            in_flight = self.in_flight
            durations = self._durations.snapshot()
        fam = catalogue.counter("colossalai_probe_probes_total")
        keys = {(m, r) for m in self._modules for r in ("success", *REASONS)} | set(probes)
        for module, result in sorted(keys):
            fam.add_metric([module, result], probes.get((module, result), 0))
        yield fam
        fam = catalogue.counter("colossalai_probe_rejected_total")
        for reason in sorted(set(REFUSED_PROBE_REASONS) | set(rejected)):
            fam.add_metric([reason], rejected.get(reason, 0))
        yield fam
        yield self._durations.family("colossalai_probe_duration_seconds", durations,
                                     also=[(module,) for module in self._modules])
        yield _gauge("colossalai_probe_in_flight", value=float(in_flight))
        yield _gauge("colossalai_probe_max_concurrent", value=float(self._max_concurrent))
        yield _gauge("colossalai_probe_modules", value=float(len(self._modules)))
