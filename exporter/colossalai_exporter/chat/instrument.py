"""The FastAPI helper: request metrics as pure ASGI middleware, plus /health and /metrics.

Why ASGI middleware and not ``@app.middleware("http")``: starlette's
BaseHTTPMiddleware sees a streamed response end as soon as its headers are
sent, so a ``/generate/stream`` answer of server-sent events would be timed at
its first byte. Wrapping ``send`` sees every body chunk, and the wrapped call
returns only after the last event was sent (or the client went away), so a
stream is timed to its end and counted in flight while it runs.

The ``route`` label is the route's template (``/items/{item_id}``), found by
matching the request against the app's routes the way the router will, never
the raw path: raw paths would give every distinct URL its own series.

A streamed response (its first body part says more will follow) is also
measured as a generation: the time to its first non-empty part, the gaps
between parts, and whether it ended with its last part or was cut (by the
server raising, or by the client going away). Every non-empty part is
progress: with ``progress_timeout`` set, ``/health`` answers 503 "stalled"
while requests are in flight and nothing was produced for that long, the
check vLLM's users asked for (a live API process over a wedged engine).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match

from colossalai_exporter import catalogue
from colossalai_exporter.histograms import LabelledHistogram
from colossalai_exporter.web.exposition import encode
from colossalai_exporter.web.metrics import compress

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

UNMATCHED = "unmatched"  # the route label of requests no route matches (404s)
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Time to a stream's first part: a queue wait and a prefill, 10 ms to a minute.
FIRST_CHUNK_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Gaps between parts: a token every 5-100 ms when healthy, seconds when it stalls.
CHUNK_GAP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CUT_BY = ("client", "server")


class ChatMetrics(Collector):
    """Counters the middleware updates and ``/metrics`` reads; ``registry`` serves them."""

    def __init__(self, ready: Callable[[], bool] | None = None,
                 clock: Callable[[], float] = time.time,
                 progress_timeout: float | None = None) -> None:
        self._lock = threading.Lock()
        self._ready = ready
        self.start_time = clock()
        self._clock = clock
        self.requests: Counter[tuple[str, str, str]] = Counter()
        self.errors: Counter[tuple[str, str, str]] = Counter()
        self.in_flight: Counter[tuple[str, str]] = Counter()
        self._durations = LabelledHistogram(BUCKETS)  # by route and method
        self._first_chunks = LabelledHistogram(FIRST_CHUNK_BUCKETS)  # by route
        self._chunk_gaps = LabelledHistogram(CHUNK_GAP_BUCKETS)  # by route
        self.streams: Counter[str] = Counter()  # by route
        self.streams_cut: Counter[tuple[str, str]] = Counter()  # by route and who cut it
        #: the generation heartbeat: see progress_timeout, mark_progress
        self.progress_timeout = progress_timeout
        self.working = 0  # requests in flight, the helper's own routes left out
        # Monotonic: the wall-clock time is derived at scrape, so that a part costs one
        # clock read (the middleware's).
        self._started_monotonic = self._last_progress = time.monotonic()
        self._queue: tuple[float, float] | None = None  # (waiting, running) as told
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.registry.register(ProcessCollector(registry=None))

    def is_ready(self) -> tuple[bool, str | None]:
        """(ready, error text when ready() raised)."""
        if self._ready is None:
            return True, None
        try:
            return bool(self._ready()), None
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"

    def uptime(self) -> float:
        return self._clock() - self.start_time

    def mark_progress(self) -> None:
        """Something was generated outside a streamed response (a non-streaming
        generation, a batch job): the app says so (streamed parts count by themselves)."""
        self._last_progress = time.monotonic()

    @property
    def last_progress_time(self) -> float:
        """When something was last generated, as a Unix time."""
        return self.start_time + (self._last_progress - self._started_monotonic)

    def set_queue(self, waiting: float, running: float) -> None:
        """The engine's queue as the app knows it: requests waiting to be scheduled and
        requests being generated (served as colossalai_chat_requests_waiting/_running)."""
        with self._lock:
            self._queue = (float(waiting), float(running))

    def stalled_for(self) -> float | None:
        """Seconds without progress while requests are in flight, when over
        ``progress_timeout``; else None (also without a timeout)."""
        if self.progress_timeout is None or self.working == 0:
            return None
        quiet = time.monotonic() - self._last_progress
        return quiet if quiet > self.progress_timeout else None

    def begin_work(self) -> None:
        with self._lock:
            if self.working == 0:
                # Idle time is not a stall: the quiet starts when work arrives.
                self._last_progress = time.monotonic()
            self.working += 1

    def end_work(self) -> None:
        with self._lock:
            self.working -= 1

    def stream_chunk(self, route: str, first: bool, since: float, now: float) -> None:
        """A non-empty part of a streamed response left at ``now`` (time.monotonic()):
        ``since`` seconds after the request arrived (the first) or the previous part."""
        self._last_progress = now
        with self._lock:
            if first:
                self.streams[route] += 1
                self._first_chunks.observe((route,), since)
            else:
                self._chunk_gaps.observe((route,), since)

    def stream_cut(self, route: str, by: str) -> None:
        with self._lock:
            self.streams_cut[route, by] += 1

    def begin(self, route: str, method: str) -> None:
        with self._lock:
            self.in_flight[route, method] += 1

    def end(self, route: str, method: str, status: int, seconds: float,
            exception: bool) -> None:
        with self._lock:
            self.in_flight[route, method] -= 1
            self.requests[route, method, str(status)] += 1
            if exception:
                self.errors[route, method, "exception"] += 1
            elif status >= 500:
                self.errors[route, method, "status_5xx"] += 1
            self._durations.observe((route, method), seconds)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            requests = dict(self.requests)
            errors = dict(self.errors)
            in_flight = dict(self.in_flight)
            durations = self._durations.snapshot()
            first_chunks = self._first_chunks.snapshot()
            chunk_gaps = self._chunk_gaps.snapshot()
            streams = dict(self.streams)
            cut = dict(self.streams_cut)
            queue = self._queue
        fam = catalogue.counter("colossalai_chat_requests_total")
        for labels, value in sorted(requests.items()):
            fam.add_metric(list(labels), value)
        yield fam
        yield self._durations.family("colossalai_chat_request_duration_seconds", durations)
        flying = catalogue.gauge("colossalai_chat_requests_in_flight")
        for pair, value in sorted(in_flight.items()):
            flying.add_metric(list(pair), value)
        yield flying
        fam = catalogue.counter("colossalai_chat_request_errors_total")
        # Every route seen gets both kinds at 0, so rate() works before the first error.
        seen = {(r, m) for r, m, _ in requests} | {(r, m) for r, m, _ in errors}
        for route, method in sorted(seen):
            for kind in ("exception", "status_5xx"):
                fam.add_metric([route, method, kind], errors.get((route, method, kind), 0))
        yield fam
        ready, _ = self.is_ready()
        ready_fam = catalogue.gauge("colossalai_chat_ready")
        ready_fam.add_metric([], 1.0 if ready else 0.0)
        yield ready_fam
        start = catalogue.gauge("colossalai_chat_start_time_seconds")
        start.add_metric([], self.start_time)
        yield start
        yield from self._stream_families(first_chunks, chunk_gaps, streams, cut, queue)

    def _stream_families(self, first_chunks: Any, chunk_gaps: Any, streams: dict[str, int],
                         cut: dict[tuple[str, str], int],
                         queue: tuple[float, float] | None) -> Iterator[Metric]:
        yield self._first_chunks.family("colossalai_chat_stream_first_chunk_seconds",
                                        first_chunks)
        yield self._chunk_gaps.family("colossalai_chat_stream_chunk_gap_seconds", chunk_gaps)
        fam = catalogue.counter("colossalai_chat_streams_total")
        for route, value in sorted(streams.items()):
            fam.add_metric([route], value)
        yield fam
        fam = catalogue.counter("colossalai_chat_streams_cut_total")
        for route in sorted(streams):  # both kinds at 0 for every route that streamed
            for by in CUT_BY:
                fam.add_metric([route, by], cut.get((route, by), 0))
        yield fam
        progress = catalogue.gauge("colossalai_chat_last_progress_timestamp_seconds")
        progress.add_metric([], self.last_progress_time)
        yield progress
        if queue is not None:
            for name, queued in zip(("colossalai_chat_requests_waiting",
                                    "colossalai_chat_requests_running"), queue, strict=True):
                gauge = catalogue.gauge(name)
                gauge.add_metric([], queued)
                yield gauge


def route_template(routes: list[BaseRoute], scope: Scope) -> str:
    """The template of the route that will serve ``scope`` (a 405 counts as its route)."""
    partial: str | None = None
    for route in routes:
        match, _ = route.matches(scope)
        path = getattr(route, "path", None)
        if match == Match.FULL:
            return str(path) if path is not None else UNMATCHED
        if match == Match.PARTIAL and partial is None and path is not None:
            partial = str(path)
    return partial or UNMATCHED


class MetricsMiddleware:
    """Times every HTTP request to the end of its response body; see the module docstring."""

    def __init__(self, app: ASGIApp, metrics: ChatMetrics, routes: list[BaseRoute],
                 own_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes
        #: the helper's /health and /metrics: not work, for the generation heartbeat
        self.own_paths = own_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_template(self.routes, scope)
        method = str(scope["method"])
        metrics = self.metrics
        status = [0]
        gone = [False]
        # A streamed response: (it is one, its last part left, when the previous part left)
        stream = [False, False, 0.0]

        async def send_and_watch(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                status[0] = int(message["status"])
            elif kind == "http.response.body":
                more = bool(message.get("more_body", False))
                if message.get("body") and (stream[0] or more):
                    now = time.monotonic()
                    metrics.stream_chunk(route, not stream[0],
                                         now - (stream[2] if stream[0] else arrived), now)
                    stream[0], stream[2] = True, now
                stream[1] = not more
            try:
                await send(message)
            except OSError:  # uvicorn's ClientDisconnected: the client went away
                gone[0] = True
                raise

        async def receive_and_watch() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not stream[1]:
                gone[0] = True  # before the response's last part: the client went away
            return message

        work = scope.get("path") not in self.own_paths
        metrics.begin(route, method)
        if work:
            metrics.begin_work()
        started, arrived = time.perf_counter(), time.monotonic()
        raised = False
        try:
            await self.app(scope, receive_and_watch, send_and_watch)
        except Exception as exc:
            # A client that went away is not the server's error (starlette turns the
            # failed send into ClientDisconnect).
            gone[0] = gone[0] or isinstance(exc, ClientDisconnect | OSError)
            raised = not gone[0]
            raise
        finally:
            if work:
                metrics.end_work()
            if stream[0] and (gone[0] or not stream[1]):
                # Its last part never left, or went to no one: the app raised, or the
                # client went away (the send failed, the app saw the disconnect and
                # stopped, or the response was cancelled on it).
                metrics.stream_cut(route, "server" if raised else "client")
            # No response started and an exception: the server answers 500 for it; a
            # client that went away is nginx's 499.
            code = 499 if gone[0] else status[0] or (500 if raised else 499)
            metrics.end(route, method, code, time.perf_counter() - started, raised)


def instrument(app: FastAPI, ready: Callable[[], bool] | None = None, *,
               health_path: str | None = "/health",
               metrics_path: str | None = "/metrics",
               progress_timeout: float | None = None) -> ChatMetrics:
    """Add request metrics, ``GET /health`` and ``GET /metrics`` to ``app``.

    ``ready`` is called on every ``/health`` and ``/metrics`` request on the event
    loop, so it must be quick (read a flag). Until it returns true ``/health``
    answers 503 ``{"status": "loading", "uptime_seconds": …}``, then 200
    ``{"status": "ok", "uptime_seconds": …}`` (the tutorial's contract); a
    ``ready`` that raises answers 503 ``{"status": "error", …}``. The app's own
    routes are left alone: if it already has a route on ``health_path`` or
    ``metrics_path`` this raises ValueError (pass another path, or None to skip).
    Call it before the app starts serving (starlette adds middleware only then).

    ``progress_timeout`` (seconds) ties ``/health`` to generation: while requests are
    in flight and no streamed part left (nor ``mark_progress()`` was called) for that
    long, it answers 503 ``{"status": "stalled", "stalled_seconds": …}``, so an
    orchestrator restarts a server whose engine is wedged behind a live API.
    """
    if progress_timeout is not None and progress_timeout <= 0:
        raise ValueError(f"progress_timeout must be positive seconds, got {progress_timeout}")
    existing = {getattr(route, "path", None) for route in app.router.routes}
    for path in (health_path, metrics_path):
        if path is not None and path in existing:
            raise ValueError(f"the app already has a route on {path}; pass "
                             f"{'health_path' if path == health_path else 'metrics_path'}"
                             "=another path, or None to leave it out")
    metrics = ChatMetrics(ready, progress_timeout=progress_timeout)

    async def health() -> JSONResponse:
        ok, error = metrics.is_ready()
        body: dict[str, Any] = {"status": "ok" if ok else ("error" if error else "loading"),
                                "uptime_seconds": round(metrics.uptime(), 3)}
        if error:
            body["error"] = error
        stalled = metrics.stalled_for() if ok else None
        if stalled is not None:
            ok = False
            body.update(status="stalled", stalled_seconds=round(stalled, 3),
                        in_flight=metrics.working)
        return JSONResponse(body, status_code=200 if ok else 503)

    async def serve_metrics(request: Request) -> Response:
        body, content_type = encode(metrics.registry, request.headers.get("accept", ""))
        body, headers = compress(body, request.headers.get("accept-encoding", ""))
        return Response(body, media_type=content_type, headers=dict(headers))

    if health_path is not None:
        app.add_api_route(health_path, health, methods=["GET"], include_in_schema=False)
    if metrics_path is not None:
        app.add_api_route(metrics_path, serve_metrics, methods=["GET"], include_in_schema=False)
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=app.router.routes,
                       own_paths=tuple(p for p in (health_path, metrics_path) if p))
    return metrics
