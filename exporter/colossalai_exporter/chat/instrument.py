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
from starlette.requests import Request
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


class ChatMetrics(Collector):
    """Counters the middleware updates and ``/metrics`` reads; ``registry`` serves them."""

    def __init__(self, ready: Callable[[], bool] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._ready = ready
        self.start_time = clock()
        self._clock = clock
        self.requests: Counter[tuple[str, str, str]] = Counter()
        self.errors: Counter[tuple[str, str, str]] = Counter()
        self.in_flight: Counter[tuple[str, str]] = Counter()
        self._durations = LabelledHistogram(BUCKETS)  # by route and method
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

    def __init__(self, app: ASGIApp, metrics: ChatMetrics, routes: list[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_template(self.routes, scope)
        method = str(scope["method"])
        status = [0]

        async def send_and_watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        self.metrics.begin(route, method)
        started = time.perf_counter()
        raised = False
        try:
            await self.app(scope, receive, send_and_watch)
        except Exception:
            raised = True
            raise
        finally:
            # No response started and an exception: the server answers 500 for it.
            code = status[0] or (500 if raised else 499)
            self.metrics.end(route, method, code, time.perf_counter() - started, raised)


def instrument(app: FastAPI, ready: Callable[[], bool] | None = None, *,
               health_path: str | None = "/health",
               metrics_path: str | None = "/metrics") -> ChatMetrics:
    """Add request metrics, ``GET /health`` and ``GET /metrics`` to ``app``.

    ``ready`` is called on every ``/health`` and ``/metrics`` request on the event
    loop, so it must be quick (read a flag). Until it returns true ``/health``
    answers 503 ``{"status": "loading", "uptime_seconds": …}``, then 200
    ``{"status": "ok", "uptime_seconds": …}`` (the tutorial's contract); a
    ``ready`` that raises answers 503 ``{"status": "error", …}``. The app's own
    routes are left alone: if it already has a route on ``health_path`` or
    ``metrics_path`` this raises ValueError (pass another path, or None to skip).
    Call it before the app starts serving (starlette adds middleware only then).
    """
    existing = {getattr(route, "path", None) for route in app.router.routes}
    for path in (health_path, metrics_path):
        if path is not None and path in existing:
            raise ValueError(f"the app already has a route on {path}; pass "
                             f"{'health_path' if path == health_path else 'metrics_path'}"
                             "=another path, or None to leave it out")
    metrics = ChatMetrics(ready)

    async def health() -> JSONResponse:
        ok, error = metrics.is_ready()
        body: dict[str, Any] = {"status": "ok" if ok else ("error" if error else "loading"),
                                "uptime_seconds": round(metrics.uptime(), 3)}
        if error:
            body["error"] = error
        return JSONResponse(body, status_code=200 if ok else 503)

    async def serve_metrics(request: Request) -> Response:
        body, content_type = encode(metrics.registry, request.headers.get("accept", ""))
        body, headers = compress(body, request.headers.get("accept-encoding", ""))
        return Response(body, media_type=content_type, headers=dict(headers))

    if health_path is not None:
        app.add_api_route(health_path, health, methods=["GET"], include_in_schema=False)
    if metrics_path is not None:
        app.add_api_route(metrics_path, serve_metrics, methods=["GET"], include_in_schema=False)
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=app.router.routes)
    return metrics
