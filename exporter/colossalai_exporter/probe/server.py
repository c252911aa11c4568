"""The prober's HTTP routes: ``/probe``, ``/metrics``, ``/health`` and a landing page.

``/probe?target=…&module=…`` follows blackbox exporter: every probe answers
200 with its own fresh registry (``probe_success`` says whether it passed), and
``debug=true`` answers the probe's log and metrics as text instead. Requests
that cannot be probed get a JSON error: 400 (missing or malformed target,
missing or unknown module, bad scrape-timeout header), 403 (target outside the
allow list), 503 (``max_concurrent`` probes already running).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import platform
import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from colossalai_exporter import catalogue
from colossalai_exporter.probe.config import ProbeConfig
from colossalai_exporter.probe.metrics import ProberStats, outcome_registry
from colossalai_exporter.probe.modules import Outcome, Probe
from colossalai_exporter.probe.targets import BadTarget, NotAllowed, parse_target
from colossalai_exporter.version import __version__
from colossalai_exporter.web import App, Request, Response, json_response, metrics_response
from colossalai_exporter.web.app import error_response, text_response

# The handler gives a probe this much beyond its deadline to return by itself (its
# sockets time out at the deadline) before aborting it and answering "timeout".
GRACE_SECONDS = 0.25

LANDING = """<html><head><title>colossalai-exporter probe</title></head><body>
<h1>colossalai-exporter probe {version}</h1>
<p><a href="/metrics">/metrics</a> (the prober's own health) &middot;
<a href="/health">/health</a></p>
<p>Probe: <code>/probe?target=http://127.0.0.1:8000&amp;module=colossal_inference</code>
(add <code>&amp;debug=true</code> for the probe's log).</p>
<p>Modules: {modules}</p>
</body></html>
"""


class _BuildInfo(Collector):
    def collect(self) -> Iterator[Metric]:
        build = catalogue.info("colossalai_exporter_build_info")
        build.add_metric([], {"version": __version__,
                              "python_version": platform.python_version()})
        yield build


def effective_timeout(module_timeout: float, header: str | None, offset: float) -> float:
    """Blackbox's rule: the scrape timeout less the offset, and never over the module's."""
    if header is None or not header.strip():
        return module_timeout
    scrape = float(header)  # ValueError -> 400 in the handler
    if scrape <= 0:
        raise ValueError("not positive")
    return max(min(module_timeout, scrape - offset), 0.001)


class Prober:
    """Runs probes on its own threads, at most ``max_concurrent`` at once."""

    def __init__(self, config: ProbeConfig) -> None:
        self.config = config
        self.stats = ProberStats(config.modules, config.max_concurrent)
        self._slots = threading.BoundedSemaphore(config.max_concurrent)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.max_concurrent, thread_name_prefix="probe")
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.stats)
        self.registry.register(_BuildInfo())
        self.registry.register(ProcessCollector(registry=None))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def reject(self, status: int, reason: str, message: str) -> Response:
        self.stats.reject(reason)
        return error_response(status, reason, message)

    async def probe(self, request: Request) -> Response:
        raw_target = request.arg("target")
        module_name = request.arg("module")
        if not raw_target:
            return self.reject(400, "missing_target", "the target parameter is missing")
        if not module_name:
            return self.reject(400, "missing_module", "the module parameter is missing "
                               f"(modules: {', '.join(sorted(self.config.modules))})")
        module = self.config.modules.get(module_name)
        if module is None:
            return self.reject(400, "unknown_module", f"unknown module {module_name!r} "
                               f"(modules: {', '.join(sorted(self.config.modules))})")
        try:
            target = parse_target(raw_target, module.target_kind)
        except BadTarget as exc:
            return self.reject(400, "bad_target", str(exc))
        header = request.header("x-prometheus-scrape-timeout-seconds")
        try:
            timeout = effective_timeout(module.timeout, header, self.config.timeout_offset)
        except ValueError:
            return self.reject(400, "bad_timeout", "X-Prometheus-Scrape-Timeout-Seconds "
                               f"{header!r} is not a positive number of seconds")
        if not self._slots.acquire(blocking=False):
            return self.reject(503, "busy", f"{self.config.max_concurrent} probes are "
                               "running already (max_concurrent)")
        probe = Probe(module, target, self.config.allow, timeout)
        self.stats.started()
        future = self._pool.submit(probe.execute)
        future.add_done_callback(lambda _: self._slots.release())
        try:
            outcome = await asyncio.wait_for(asyncio.wrap_future(future), timeout + GRACE_SECONDS)
        except NotAllowed as exc:
            self.stats.cancelled()
            return self.reject(403, "not_allowed", str(exc))
        except (TimeoutError, asyncio.TimeoutError):  # the same class only from Python 3.11
            # Stuck past every socket timeout (a slow drip of bytes): shut its socket and
            # report; the worker thread ends on its own once its socket is closed.
            probe.abort()
            outcome = probe.outcome
            outcome.success, outcome.reason = False, "timeout"
            outcome.message = f"no result within {timeout:.3g}s"
            outcome.duration = timeout + GRACE_SECONDS
        self.stats.finished(outcome)
        return self.respond(request, outcome)

    def respond(self, request: Request, outcome: Outcome) -> Response:
        registry = outcome_registry(outcome)
        if (request.arg("debug") or "").lower() == "true":
            lines = [f"Logs for the probe of {outcome.target!r} with module "
                     f"{outcome.module!r}:", *outcome.log, "", "Metrics that would have been "
                     "returned:", generate_latest(registry).decode()]
            return text_response(200, "\n".join(lines))
        return metrics_response(registry, request)

    def metrics(self, request: Request) -> Response:
        return metrics_response(self.registry, request)

    def health(self, request: Request) -> Response:
        return json_response(200, {"status": "ok", "modules": sorted(self.config.modules)})

    def landing(self, request: Request) -> Response:
        modules = ", ".join(sorted(self.config.modules))
        return text_response(200, LANDING.format(version=__version__, modules=modules),
                             "text/html; charset=utf-8")


def build_app(prober: Prober, app: App | None = None) -> App:
    app = app or App(max_body_bytes=0)
    app.add_route("/probe", prober.probe)
    app.add_route("/metrics", prober.metrics)
    app.add_route("/health", prober.health)
    app.add_route("/", prober.landing)
    return app
