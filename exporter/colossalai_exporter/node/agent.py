"""The node agent: runs the collectors on every scrape and serves the results.

A scrape is synchronous and bounded: every collector is run, each handed the
time left of the scrape's deadline and bounding itself (the gpu collector by
its worker process, disk, ranks and rendezvous by their own worker threads or
non-blocking sockets), and a collector that fails or runs out of time is
reported down with its reason while the others are served.

Collectors that hand their work to another process or thread, or to a socket
(gpu, disk, ranks, rendezvous), are started first (``begin``) and collected
last, so that their work overlaps the others' and each other's; the families
are still served in the collectors' order.

``/metrics`` runs the whole scrape on the server's event loop
(:meth:`Agent.collect_async`): the inline collectors (host memory) read
``/proc``, and the begun ones are waited for without blocking, the loop woken
by the worker's pipe, the connecting sockets and the checking threads. A scrape
then costs no hand-over to a scrape thread and back, which was about a fifth
of its time (bench/RESULTS.md). Whatever is not ready within
:data:`LOOP_WAIT_SECONDS` — a hung mount, a stuck NVML call, a dropped SYN —
is finished by the collectors' own bounded ``collect`` in a thread, so the
loop is never blocked and a slow scrape still ends within its deadline.
Synchronous callers (the start-up report, a prometheus_client registry) run
the same scrape on an event loop of their own (:meth:`Agent.collect`): there
is one implementation of a scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from prometheus_client import ProcessCollector
from prometheus_client.core import Metric as MetricFamily

from colossalai_exporter import catalogue
from colossalai_exporter.node.base import BegunCollector, CollectorError, NodeCollector, Pending
from colossalai_exporter.node.blocking import BlockingCalls
from colossalai_exporter.version import __version__
from colossalai_exporter.web import App, Request, Response, json_response, metrics_response
from colossalai_exporter.web.app import text_response
from colossalai_exporter.web.exposition import CollectedFamilies

# Reasons every collector may report besides its own: the agent's deadline, and a bug.
AGENT_REASONS = ("timeout", "error")
# How long a scrape on the event loop waits for begun work before handing what is
# not ready to a thread: far above a healthy scrape's few milliseconds (eight GPUs'
# NVML reads included), and below every collector's own point of action (the disk
# collector's fallback threads at half its 2 s deadline, say).
LOOP_WAIT_SECONDS = 0.1

# What begin() started for one collector: when, and the work to wait for.
Begun = tuple[float, "Pending | None"]


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

    def __init__(self, collectors: Sequence[NodeCollector], scrape_timeout: float = 8.0,
                 calls: BlockingCalls | None = None) -> None:
        """``calls``: the runner of file system calls the collectors share, if any."""
        self.collectors = list(collectors)
        self.scrape_timeout = scrape_timeout
        self._calls = calls
        self.states: dict[str, CollectorState] = {}
        for collector in self.collectors:
            reasons = dict.fromkeys((*collector.reasons, *AGENT_REASONS), 0)
            self.states[collector.name] = CollectorState(errors=reasons)
        self._lock = threading.Lock()

    def _begin_all(self, deadline: float) -> dict[str, Begun]:
        with self._calls.batch() if self._calls is not None else contextlib.nullcontext():
            return self._begin_each(deadline)

    def _begin_each(self, deadline: float) -> dict[str, Begun]:
        begun: dict[str, Begun] = {}
        for collector in self.collectors:
            begin = getattr(collector, "begin", None)
            if begin is not None:
                started, pending = time.monotonic(), None
                # A bug in begin(); its collect() runs (and is reported) all the same.
                with contextlib.suppress(Exception):
                    pending = begin(deadline)
                begun[collector.name] = (started, pending)
        return begun

    def _run(self, collector: NodeCollector, deadline: float,
             begun: Begun | None = None, ready_at: float | None = None) -> list[MetricFamily]:
        """Run one collector and record its outcome; ``ready_at``: when its begun work
        was seen done (the loop may collect it later, after others' work)."""
        state = self.states[collector.name]
        now = time.monotonic()
        if now >= deadline:
            self._record(state, False, "timeout",
                         f"scrape deadline of {self.scrape_timeout:g}s spent before it ran", now)
            return []
        start = now if begun is None else begun[0]
        if ready_at is not None:
            start += now - ready_at  # the duration runs from begin() to ready, then collect()
        try:
            if begun is None:
                families = collector.collect(deadline)
            else:
                families = cast("BegunCollector", collector).collect(deadline, begun[1])
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

    def _in_order(self, results: dict[str, list[MetricFamily]]) -> list[MetricFamily]:
        families = [f for collector in self.collectors for f in results.get(collector.name, ())]
        families.extend(self._self_metrics())
        return families

    def collect(self) -> list[MetricFamily]:
        """One scrape from synchronous code (a prometheus_client collector's collect):
        :meth:`collect_async` on an event loop of its own. Not for a thread that runs
        an event loop; there, await :meth:`collect_async`."""
        return asyncio.run(self.collect_async())

    async def collect_async(self) -> list[MetricFamily]:
        """One scrape on the running event loop, never blocking it (see the module doc)."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.scrape_timeout
        begun = self._begin_all(deadline)
        results: dict[str, list[MetricFamily]] = {}
        for collector in self.collectors:
            if collector.name not in begun:
                results[collector.name] = self._run(collector, deadline)
        pendings = [pending for _, pending in begun.values() if pending is not None]
        ready_at = await _wait_ready(loop, pendings,
                                     min(deadline, time.monotonic() + LOOP_WAIT_SECONDS))
        late: list[NodeCollector] = []
        for collector in self.collectors:
            if collector.name in begun:
                pending = begun[collector.name][1]
                if pending is not None and id(pending) in ready_at:
                    results[collector.name] = self._run(collector, deadline,
                                                        begun[collector.name],
                                                        ready_at[id(pending)])
                else:
                    late.append(collector)
        if late:
            def finish() -> dict[str, list[MetricFamily]]:
                return {c.name: self._run(c, deadline, begun[c.name]) for c in late}

            results.update(await loop.run_in_executor(None, finish))
        return self._in_order(results)

    def _self_metrics(self) -> Iterable[MetricFamily]:
        up = catalogue.gauge("colossalai_exporter_collector_up")
        duration = catalogue.gauge("colossalai_exporter_collector_duration_seconds")
        errors = catalogue.counter("colossalai_exporter_collector_errors_total")
        failure = catalogue.info("colossalai_exporter_collector_failure_info")
        with self._lock:
            for name, state in self.states.items():
                up.add_metric([name], 1.0 if state.up else 0.0)
                duration.add_metric([name], state.duration)
                for reason, count in state.errors.items():
                    errors.add_metric([name, reason], count)
                if not state.up:
                    failure.add_metric([name, state.reason], {})
        build = catalogue.info("colossalai_exporter_build_info")
        build.add_metric([], {"version": __version__,
                              "python_version": platform.python_version()})
        yield from (up, duration, errors, failure, build)

    def health(self) -> tuple[bool, list[dict[str, str]]]:
        """(healthy, problems) from the last scrape of each collector.

        Degraded only for what is wrong: a collector that failed, and what a
        working collector found wrong (a watched checkpoint or offload path that
        is missing, read-only or hung). What is not wrong on this node is no
        failure to begin with (no NVIDIA driver on a node without GPUs: the gpu
        collector serves zero GPUs).
        """
        with self._lock:
            problems = [{"collector": name, "reason": s.reason, "message": s.message}
                        for name, s in self.states.items() if not s.up]
        for collector in self.collectors:
            found = getattr(collector, "problems", None)
            if found is not None and self.states.get(collector.name, CollectorState()).up:
                problems.extend(found())
        return not problems, problems

    def close(self) -> None:
        for collector in self.collectors:
            collector.close()


def _is_ready(pending: Pending) -> bool:
    try:
        return pending.ready()
    except Exception:  # a bug: collect() in a thread runs (and reports) it
        return False


async def _wait_ready(loop: asyncio.AbstractEventLoop, pendings: list[Pending],
                      until: float) -> dict[int, float]:
    """Until every pending is ready or ``until`` (monotonic) passes, without blocking;
    when each was seen ready, by ``id``."""
    ready_at: dict[int, float] = {}

    def still_waiting(candidates: list[Pending]) -> list[Pending]:
        now = time.monotonic()
        waiting = []
        for pending in candidates:
            if _is_ready(pending):
                ready_at[id(pending)] = now
            else:
                waiting.append(pending)
        return waiting

    waiting = still_waiting(pendings)
    if not waiting:
        return ready_at
    woken = asyncio.Event()
    stops = []
    for pending in waiting:
        with contextlib.suppress(Exception):  # unwatched, it is found at ``until``
            stops.append(pending.watch(loop, woken.set))
    timer = loop.call_later(max(0.0, until - time.monotonic()), woken.set)
    try:
        while True:
            waiting = still_waiting(waiting)
            if not waiting or time.monotonic() >= until:
                return ready_at
            await woken.wait()
            woken.clear()
    finally:
        timer.cancel()
        for stop in stops:
            with contextlib.suppress(Exception):
                stop()


LANDING = """<!doctype html>
<html><head><title>colossalai-exporter node agent</title></head>
<body><h1>colossalai-exporter node agent</h1>
<p>Version {version}. Collectors: {collectors}.</p>
<ul><li><a href="metrics">/metrics</a></li><li><a href="health">/health</a></li></ul>
</body></html>
"""


def build_app(agent: Agent, app: App | None = None) -> App:
    """Routes of the agent: ``/metrics``, ``/health`` and a landing page."""
    app = app or App()
    process = ProcessCollector(registry=None)

    async def metrics(request: Request) -> Response:
        families: list[Any] = await agent.collect_async()
        families.extend(process.collect())
        return metrics_response(CollectedFamilies(families), request)

    async def health(request: Request) -> Response:
        if not any(s.duration for s in agent.states.values()):
            await agent.collect_async()  # no scrape yet: judge on a fresh run, not on defaults
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
