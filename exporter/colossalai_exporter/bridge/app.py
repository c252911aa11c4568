"""The bridge's HTTP app: ``POST /alertmanager``, ``GET /metrics``, ``GET /health``.

Why ``/alertmanager``: the path names the one sender whose format it speaks
(webhook version 4), as Alertmanager's own receiver names the receiving side;
a second format would get its own path rather than sniffing bodies.
``/alertmanager/`` is the same route: a receiver URL written with the slash
must not become a 404 that Alertmanager drops without retrying.

The ingest route answers 200 only after the notification and all its
deliveries are committed to SQLite (``synchronous=FULL``); if that fails it
answers 503, which Alertmanager retries. Malformed input is a 400 (which
Alertmanager does not retry: resending garbage cannot help).

The route is a coroutine: a body of ordinary size (an Alertmanager notification
is a few KB) is parsed on the event loop, which costs less than the hop to a
worker thread and back, and the commit is shared with concurrent requests by
the :class:`~colossalai_exporter.bridge.committer.GroupCommitter`. A large body
(thousands of alerts) is parsed in a worker thread so that it cannot stall
the other connections.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Protocol

from prometheus_client import CollectorRegistry, ProcessCollector

from colossalai_exporter.bridge.alertmanager import PayloadError, parse_notification
from colossalai_exporter.bridge.committer import GroupCommitter
from colossalai_exporter.bridge.config import BridgeConfig
from colossalai_exporter.bridge.ingest import plan
from colossalai_exporter.bridge.metrics import BridgeCollector, BridgeStats
from colossalai_exporter.bridge.store import IngestItem, Store, StoreError
from colossalai_exporter.web import App, Request, Response, json_response, metrics_response
from colossalai_exporter.web.app import error_response
from colossalai_exporter.web.auth import BasicAuthenticator, constant_time_equals

log = logging.getLogger(__name__)
INGEST_PATH = "/alertmanager"
INGEST_PATHS = (INGEST_PATH, INGEST_PATH + "/")
JSON_TYPES = ("application/json",)
# Bodies up to this size are parsed on the event loop (about 0.2 ms for a typical
# notification of 4 KB and a few alerts); larger ones in a worker thread.
INLINE_PARSE_BYTES = 64 * 1024


class Worker(Protocol):
    """A target's delivery worker, woken when a delivery for it was queued."""

    def wake(self) -> None: ...


class HealthView(Protocol):
    """What /health needs to know about a health-heartbeat scheduler."""

    last_paused: float | None


def bearer_guard(token: str) -> Callable[[Request], Response | None]:
    """Refuse requests without ``Authorization: Bearer <token>`` before reading the body."""

    def guard(request: Request) -> Response | None:
        header = request.header("authorization") or ""
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not constant_time_equals(given.strip(), token):
            return error_response(401, "unauthorized", "missing or wrong bearer token",
                                  [("WWW-Authenticate", 'Bearer realm="colossalai-bridge"')])
        return None

    return guard


def content_type_guard(request: Request) -> Response | None:
    if request.method != "POST":
        return None
    media = (request.header("content-type") or "").split(";")[0].strip().lower()
    if media not in JSON_TYPES:
        return error_response(415, "unsupported_media_type",
                              f"Content-Type must be application/json, got {media or 'none'!r}")
    return None


def _chain(*guards: Callable[[Request], Response | None]) -> Callable[[Request], Response | None]:
    def guard(request: Request) -> Response | None:
        for one in guards:
            refused = one(request)
            if refused is not None:
                return refused
        return None

    return guard


class Bridge:
    """Everything the routes need; built by :func:`build_app`, also handy in tests."""

    def __init__(self, config: BridgeConfig, store: Store, stats: BridgeStats,
                 workers: dict[str, Worker] | None = None,
                 health_schedulers: dict[str, HealthView] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.store = store
        self.stats = stats
        self.workers = workers or {}
        self.health_schedulers = health_schedulers or {}
        # Started and stopped by the runtime: after the workers start, before HTTP
        # serving; stopped after the server has finished its in-flight requests.
        self.committer = GroupCommitter(store, self.workers)
        self.started_at = clock()
        self._clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(BridgeCollector(stats, store, config.targets, clock))
        self.registry.register(ProcessCollector(registry=None))

    def _prepare(self, body: bytes) -> IngestItem | Response:
        """Parse and route a body: what to store, or the 400 that refuses it."""
        try:
            notification = parse_notification(body)
        except PayloadError as exc:
            return error_response(400, exc.reason, exc.message)
        enqueues, updates = plan(notification, self.config.targets)
        return IngestItem(body, tuple(enqueues), tuple(updates), self._clock())

    async def ingest(self, request: Request) -> Response:
        if len(request.body) <= INLINE_PARSE_BYTES:
            prepared = self._prepare(request.body)
        else:
            prepared = await asyncio.get_running_loop().run_in_executor(
                None, self._prepare, request.body)
        if isinstance(prepared, Response):
            return prepared
        try:
            # Returns only once the commit holding this notification is synced.
            result = await self.committer.ingest(prepared)
        except StoreError as exc:
            log.error("cannot store notification", extra={"err": str(exc)})
            return error_response(503, "store_unavailable",
                                  "the notification could not be stored; retry later")
        self.stats.add_received()
        for target in result.deduplicated:
            self.stats.add_deduplicated(target)
        for target, count in result.superseded.items():
            self.stats.add_dropped(target, "superseded", count)
        return json_response(200, {"status": "stored", "id": result.notification_id,
                                   "queued": list(result.queued),
                                   "deduplicated": list(result.deduplicated)})

    def observe(self, request: Request, response: Response) -> None:
        """Count refused notifications by the reason their error body names."""
        if request.path not in INGEST_PATHS or response.status < 400:
            return
        try:
            reason = str(json.loads(response.body).get("error", "other"))
        except (ValueError, AttributeError):
            reason = "other"
        self.stats.add_rejected(reason)

    def health(self, request: Request) -> Response:
        now = self._clock()
        writable, error = self.store.writable()
        problems: list[str] = []
        if not writable:
            problems.append(f"store not writable: {error}")
        try:
            successes = self.store.last_successes()
        except StoreError:
            successes = {}
        targets: dict[str, dict[str, object]] = {}
        for target in self.config.targets:
            last = successes.get(target.name)
            info: dict[str, object] = {"type": target.kind, "last_success": last}
            period = {"heartbeat": target.period, "health_heartbeat": target.interval}.get(
                target.kind)
            if period is not None:
                # Judged from the later of the last success and this process's start
                # (and, for health heartbeats, the last pause: no pings are due then).
                since = max(last or 0.0, self.started_at)
                scheduler = self.health_schedulers.get(target.name)
                if scheduler is not None and scheduler.last_paused is not None:
                    since = max(since, scheduler.last_paused)
                limit = period * self.config.unhealthy_after_periods
                healthy = now - since <= limit
                info["healthy"] = healthy
                if not healthy:
                    problems.append(f"target {target.name}: no success for "
                                    f"{now - since:.0f}s (limit {limit:.0f}s)")
            targets[target.name] = info
        body = {"status": "ok" if not problems else "unhealthy", "problems": problems,
                "store": {"writable": writable}, "targets": targets}
        return json_response(200 if not problems else 503, body)


def build_app(bridge: Bridge, authenticator: BasicAuthenticator | None = None) -> App:
    app = App(authenticator=authenticator, max_body_bytes=bridge.config.max_body_bytes,
              body_timeout=bridge.config.body_timeout,
              realm="colossalai-bridge", observer=bridge.observe)
    guards: list[Callable[[Request], Response | None]] = [content_type_guard]
    if bridge.config.bearer_token:
        guards.insert(0, bearer_guard(bridge.config.bearer_token))
    for path in INGEST_PATHS:
        app.add_route(path, bridge.ingest, ("POST",), guard=_chain(*guards))
    app.add_route("/metrics", lambda request: metrics_response(bridge.registry, request))
    app.add_route("/health", bridge.health)
    app.add_route("/", lambda request: json_response(200, {
        "service": "colossalai-exporter bridge",
        "endpoints": [INGEST_PATH, "/metrics", "/health"]}))
    return app
