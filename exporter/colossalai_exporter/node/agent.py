"""The node agent: runs the collectors on every scrape and serves the results.

A scrape is synchronous and bounded: collectors run one after another in the
scrape's thread, each handed the time left of the scrape's deadline and
bounding itself (the gpu collector by its worker process, disk, ranks and
rendezvous by their own worker threads), and a collector that fails or runs out of time is
reported down with its reason while the others are served. Running them in
sequence rather than on a pool halves the scrape time (bench/RESULTS.md);
the worst case stays within the scrape deadline.

Collectors that hand their work to another process or thread (gpu, disk, ranks) are
started first (``begin``) and collected last, so that their work overlaps the
others' instead of the scrape's thread waiting for each hand-over in turn; the
families are still served in the collectors' order.
"""

from __future__ import annotations

import contextlib
import platform
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import Metric as MetricFamily

from colossalai_exporter.catalogue import family
from colossalai_exporter.node.base import CollectorError, NodeCollector
from colossalai_exporter.version import __version__
from colossalai_exporter.web import App, Request, Response, json_response, metrics_response
from colossalai_exporter.web.app import text_response

# Reasons every collector may report besides its own: the agent's deadline, and a bug.
AGENT_REASONS = ("timeout", "error")


@dataclass
class CollectorState:
    """The outcome of a collector's last run, for self-metrics and /health."""

    up: bool = True
    reason: str = ""
    message: str = ""
    duration: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)


class Agent:
    """Collector registry of the node agent (a prometheus_client collector itself)."""

    def __init__(self, collectors: Sequence[NodeCollector], scrape_timeout: float = 8.0) -> None:
        self.collectors = list(collectors)
        self.scrape_timeout = scrape_timeout
        self.states: dict[str, CollectorState] = {}
        for collector in self.collectors:
            reasons = dict.fromkeys((*collector.reasons, *AGENT_REASONS), 0)
            self.states[collector.name] = CollectorState(errors=reasons)
        self._lock = threading.Lock()

    def _run(self, collector: NodeCollector, deadline: float,
             start: float | None = None) -> list[MetricFamily]:
        start = time.monotonic() if start is None else start
        state = self.states[collector.name]
        try:
            families = collector.collect(deadline)
        except CollectorError as exc:
            self._record(state, False, exc.reason, exc.message, start)
            return exc.families
        except Exception as exc:  # a bug in a collector must not fail the scrape
            self._record(state, False, "error", f"{type(exc).__name__}: {exc}", start)
            return []
        self._record(state, True, "", "", start)
        return families

    def _record(self, state: CollectorState, up: bool, reason: str, message: str,
                start: float) -> None:
        with self._lock:
            state.up, state.reason, state.message = up, reason, message
            state.duration = time.monotonic() - start
            if not up:
                state.errors[reason] = state.errors.get(reason, 0) + 1

    def collect(self) -> Iterable[MetricFamily]:
        deadline = time.monotonic() + self.scrape_timeout
        begun: dict[str, float] = {}
        for collector in self.collectors:
            begin = getattr(collector, "begin", None)
            if begin is not None:
                begun[collector.name] = time.monotonic()
                # A bug in begin(); its collect() runs (and is reported) all the same.
                with contextlib.suppress(Exception):
                    begin(deadline)
        results: dict[str, list[MetricFamily]] = {}
        # Inline collectors first, then those whose work has been running meanwhile.
        for collector in sorted(self.collectors, key=lambda c: c.name in begun):
            if time.monotonic() >= deadline:
                self._record(self.states[collector.name], False, "timeout",
                             f"scrape deadline of {self.scrape_timeout:g}s spent before it ran",
                             time.monotonic())
                continue
            results[collector.name] = self._run(collector, deadline, begun.get(collector.name))
        for collector in self.collectors:
            yield from results.get(collector.name, ())
        yield from self._self_metrics()

    def _self_metrics(self) -> Iterable[MetricFamily]:
        up = family("colossalai_exporter_collector_up")
        duration = family("colossalai_exporter_collector_duration_seconds")
        errors = family("colossalai_exporter_collector_errors_total")
        failure = family("colossalai_exporter_collector_failure_info")
        with self._lock:
            for name, state in self.states.items():
                up.add_metric([name], 1.0 if state.up else 0.0)
                duration.add_metric([name], state.duration)
                for reason, count in state.errors.items():
                    errors.add_metric([name, reason], count)
                if not state.up:
                    failure.add_metric([name, state.reason], {})
        build = family("colossalai_exporter_build_info")
        build.add_metric([], {"version": __version__,
                              "python_version": platform.python_version()})
        yield from (up, duration, errors, failure, build)

    def health(self) -> tuple[bool, list[dict[str, str]]]:
        """(healthy, problems) from the last scrape of each collector."""
        with self._lock:
            problems = [{"collector": name, "reason": s.reason, "message": s.message}
                        for name, s in self.states.items() if not s.up]
        return not problems, problems

    def close(self) -> None:
        for collector in self.collectors:
            collector.close()


LANDING = """<!doctype html>
<html><head><title>colossalai-exporter node agent</title></head>
<body><h1>colossalai-exporter node agent</h1>
<p>Version {version}. Collectors: {collectors}.</p>
<ul><li><a href="metrics">/metrics</a></li><li><a href="health">/health</a></li></ul>
</body></html>
"""


def build_registry(agent: Agent) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(agent)
    ProcessCollector(registry=registry)
    return registry


def build_app(agent: Agent, app: App | None = None) -> App:
    """Routes of the agent: ``/metrics``, ``/health`` and a landing page."""
    app = app or App()
    registry = build_registry(agent)

    def metrics(request: Request) -> Response:
        return metrics_response(registry, request)

    def health(request: Request) -> Response:
        if not any(s.duration for s in agent.states.values()):
            list(agent.collect())  # no scrape yet: judge on a fresh run, not on defaults
        healthy, problems = agent.health()
        return json_response(200 if healthy else 503, {
            "status": "ok" if healthy else "degraded",
            "problems": problems,
            "collectors": sorted(agent.states),
        })

    def landing(request: Request) -> Response:
        names = ", ".join(sorted(agent.states)) or "none"
        return text_response(200, LANDING.format(version=__version__, collectors=names),
                             "text/html; charset=utf-8")

    app.add_route("/metrics", metrics)
    app.add_route("/health", health)
    app.add_route("/", landing)
    return app
