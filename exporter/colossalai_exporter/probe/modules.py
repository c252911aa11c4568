"""Run a module against a target: resolve, check the allow list, then the module's steps.

Each prober kind is a short function of steps; a step that fails raises
:class:`~colossalai_exporter.probe.http.ProbeFailure` with its reason, and the
outcome records which steps passed (``colossalai_probe_step_success``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from colossalai_exporter.probe import http
from colossalai_exporter.probe.config import HttpOptions, JsonCheck, Module
from colossalai_exporter.probe.http import HttpResult, ProbeFailure, ProbeProgress
from colossalai_exporter.probe.stream import Done, MalformedStream, StreamParser, Token
from colossalai_exporter.probe.targets import (
    Address,
    AllowList,
    NotAllowed,
    ProbeTarget,
    ResolveError,
    resolve,
)


@dataclass
class StreamStats:
    """What a streaming probe measured (prober ``stream``), as far as it got."""

    #: seconds from the start of the request (connect included) to the first token
    first_token: float | None = None
    #: the longest wait between two tokens
    max_gap: float = 0.0
    tokens: int = 0
    #: tokens per second after the first (None below two tokens)
    tokens_per_second: float | None = None
    completed: bool = False


@dataclass
class Outcome:
    """What one probe found; turned into metrics by :mod:`.metrics`."""

    module: str
    target: str
    success: bool = False
    reason: str | None = None
    message: str = ""
    duration: float = 0.0
    dns_seconds: float = 0.0
    ip_protocol: int = 0
    steps: list[tuple[str, bool]] = field(default_factory=list)
    progress: ProbeProgress | None = None
    log: list[str] = field(default_factory=list)
    http: bool = True
    stream: StreamStats | None = None


class Probe:
    """One probe run: ``execute()`` in a worker thread, ``abort()`` from the handler."""

    def __init__(self, module: Module, target: ProbeTarget, allow: AllowList, timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.module = module
        self.target = target
        self.allow = allow
        self.timeout = timeout
        self.started = clock()
        self.progress = ProbeProgress(deadline=self.started + timeout)
        self.outcome = Outcome(module.name, target.raw, progress=self.progress,
                               http=module.prober != "tcp")

    def abort(self) -> None:
        self.progress.abort()

    def note(self, text: str) -> None:
        offset = time.monotonic() - self.started
        self.outcome.log.append(f"{offset * 1000:8.1f}ms {text}")

    def execute(self) -> Outcome:
        """Run the probe; NotAllowed propagates (the handler answers 403)."""
        outcome = self.outcome
        try:
            addresses = self._resolve()
            addresses = self.allow.filter(self.target, addresses)
            address = addresses[0]
            outcome.ip_protocol = address.ip.version
            self.note(f"probing {address.ip} port {address.port} with module "
                      f"{self.module.name} (prober {self.module.prober}), timeout "
                      f"{self.timeout:.3g}s")
            RUNNERS[self.module.prober](self, address)
            outcome.success = True
            self.note("probe succeeded")
        except NotAllowed:
            raise
        except ProbeFailure as exc:
            if self.progress.aborted and exc.reason != "timeout":
                exc = ProbeFailure("timeout", f"the probe's deadline passed ({exc.message})")
            outcome.reason, outcome.message = exc.reason, exc.message
            self.note(f"probe failed: reason={exc.reason}: {exc.message}")
        finally:
            outcome.duration = time.monotonic() - self.started
        return outcome

    def _resolve(self) -> list[Address]:
        started = time.monotonic()
        try:
            addresses = resolve(self.target.host, self.target.port, self.progress.remaining())
        except ResolveError as exc:
            raise ProbeFailure("dns", str(exc)) from None
        finally:
            self.outcome.dns_seconds = time.monotonic() - started
            self.progress.add("resolve", started)
        self.note(f"resolved {self.target.host} to {', '.join(str(a.ip) for a in addresses)}")
        return addresses

    # -- steps ---------------------------------------------------------------------------
    def step(self, name: str, ok: bool) -> None:
        self.outcome.steps.append((name, ok))

    def get(self, name: str, address: Address, options: HttpOptions, path: str,
            method: str | None = None) -> HttpResult:
        """One HTTP request as step ``name``; a transport failure fails the step."""
        full_path = self.target.request_path(path)
        self.note(f"step {name}: {method or options.method} {full_path}")
        try:
            result = http.request(
                self.progress, address, self.target, method=method or options.method,
                path=full_path, headers=options.headers, header_files=options.header_files,
                body=options.body if (method or options.method) not in ("GET", "HEAD") else None,
                tls=options.tls, max_body_bytes=options.max_body_bytes)
        except ProbeFailure:
            self.step(name, False)
            raise
        self.note(f"step {name}: HTTP {result.status}, {len(result.body)} bytes")
        return result

    def fail(self, name: str, reason: str, message: str) -> ProbeFailure:
        self.step(name, False)
        return ProbeFailure(reason, message)


def _json(result: HttpResult) -> Any:
    if result.truncated:
        return None
    try:
        return json.loads(result.body)
    except (ValueError, UnicodeDecodeError):
        return None


def _check_json(probe: Probe, name: str, result: HttpResult,
                checks: tuple[JsonCheck, ...]) -> None:
    if not checks:
        return
    document = _json(result)
    if document is None:
        raise probe.fail(name, "body", f"{name}: response body is not JSON"
                         + (" (over max_body_bytes)" if result.truncated else ""))
    for check in checks:
        found, value = check.value_in(document)
        if not found:
            raise probe.fail(name, "body", f"{name}: JSON field {check.field!r} is missing")
        if value != check.equals:
            raise probe.fail(name, check.reason, f"{name}: JSON field {check.field!r} is "
                             f"{value!r}, expected {check.equals!r}")


def _status(probe: Probe, name: str, result: HttpResult, options: HttpOptions) -> None:
    if not options.status_ok(result.status):
        wanted = ", ".join(map(str, options.valid_status_codes)) or "2xx"
        raise probe.fail(name, "status", f"{name}: HTTP {result.status}, expected {wanted}")


def run_http(probe: Probe, address: Address) -> None:
    options = probe.module.http
    result = probe.get("request", address, options, options.path)
    _status(probe, "request", result, options)
    _check_json(probe, "request", result, options.json)
    probe.step("request", True)


def run_tcp(probe: Probe, address: Address) -> None:
    sock = http.connect(probe.progress, address)
    try:
        if probe.module.tcp_tls:
            sock = http.handshake(probe.progress, sock, probe.target, probe.module.http.tls)
    except ProbeFailure:
        probe.step("connect", False)
        raise
    finally:
        probe.progress._track(None)
        sock.close()
    probe.note(f"connected to {address.ip}:{address.port}")
    probe.step("connect", True)


def run_colossal_inference(probe: Probe, address: Address) -> None:
    """Colossal-Inference's api_server: /ping says Healthy always, /engine_check tells the truth.

    /engine_check answers HTTP 200 with ``{"status": "Error"}`` when the engine
    loop has died, so the status code alone proves nothing.
    """
    options = probe.module.http
    ping = probe.get("ping", address, options, "/ping", "GET")
    _status(probe, "ping", ping, options)
    _check_json(probe, "ping", ping, (JsonCheck("status", "Healthy"),))
    probe.step("ping", True)
    engine = probe.get("engine_check", address, options, "/engine_check", "GET")
    _status(probe, "engine_check", engine, options)
    document = _json(engine)
    status = document.get("status") if isinstance(document, dict) else None
    if status == "Error":
        raise probe.fail("engine_check", "engine_error",
                         'engine_check: {"status": "Error"} (the inference engine is down)')
    if status != "Running":
        raise probe.fail("engine_check", "body",
                         f"engine_check: expected JSON status 'Running', got {status!r}")
    probe.step("engine_check", True)


def run_colossalchat(probe: Probe, address: Address) -> None:
    """ColossalChat's FastAPI server has no health route: FastAPI's own pages prove it runs.

    ``/openapi.json`` (a JSON document with ``paths``) or ``/docs`` answering 200
    means the app is up; when both are switched off, any answer below 500 on the
    root means it is listening (the tutorial's "200 or 405").
    """
    options = probe.module.http
    for name, path in (("openapi", "/openapi.json"), ("docs", "/docs")):
        result = probe.get(name, address, options, path, "GET")
        if result.status >= 500:
            raise probe.fail(name, "status", f"{name}: HTTP {result.status}")
        document = _json(result) if name == "openapi" else None
        if result.status == 200 and (name == "docs" or (isinstance(document, dict)
                                     and "paths" in document)):
            probe.step(name, True)
            return
        probe.step(name, False)
    root = probe.get("root", address, options, "/", "GET")
    if root.status >= 500:
        raise probe.fail("root", "status", f"root: HTTP {root.status} (5xx: the app is broken)")
    probe.step("root", True)


def run_health_json(probe: Probe, address: Address) -> None:
    """The tutorial's /health: 200 with status ok; 503 with status loading while it loads."""
    options = probe.module.http
    result = probe.get("health", address, options, options.path or "/health")
    document = _json(result)
    status = document.get("status") if isinstance(document, dict) else None
    if result.status == 503 and status == "loading":
        raise probe.fail("health", "loading", "health: 503, the model is still loading")
    _status(probe, "health", result, options)
    if status != "ok":
        raise probe.fail("health", "body", f"health: expected JSON status 'ok', got {status!r}")
    _check_json(probe, "health", result, options.json)
    probe.step("health", True)


def run_generate(probe: Probe, address: Address) -> None:
    """A tiny real generation (POST, small token limit); timed to the end of the body."""
    options = probe.module.http
    result = probe.get("generate", address, options, options.path or "/generate")
    _status(probe, "generate", result, options)
    if not result.body.strip():
        raise probe.fail("generate", "body", "generate: empty response body")
    _check_json(probe, "generate", result, options.json)
    probe.step("generate", True)


def run_stream(probe: Probe, address: Address) -> None:
    """A tiny streamed generation, read token by token (probe/stream.py has the formats).

    Fails with ``first_token_timeout`` when no non-empty token came within the
    module's limit of the request, ``token_gap`` when two tokens were further apart
    than its gap limit, ``truncated`` when the connection or the body ended before
    the format's final event, ``empty`` when it completed without a token,
    ``engine_error`` for an error event in the stream, ``body`` for bytes that are
    not the format's events or a stream over ``max_body_bytes``.
    """
    stats = probe.outcome.stream = StreamStats()
    try:
        _read_stream(probe, address, stats)
    except ProbeFailure:
        probe.step("stream", False)
        raise
    probe.note(f"stream: {stats.tokens} tokens, first after {stats.first_token or 0:.3f}s, "
               f"longest gap {stats.max_gap:.3f}s")
    probe.step("stream", True)


def _read_stream(probe: Probe, address: Address, stats: StreamStats) -> None:
    options, limits = probe.module.http, probe.module.stream
    path = probe.target.request_path(options.path)
    probe.note(f"step stream: {options.method} {path} (format {limits.format})")
    started = time.monotonic()
    stream = http.open_stream(probe.progress, address, probe.target, method=options.method,
                              path=path, headers=options.headers,
                              header_files=options.header_files, body=options.body,
                              tls=options.tls)
    try:
        if not options.status_ok(stream.status):
            wanted = ", ".join(map(str, options.valid_status_codes)) or "2xx"
            raise ProbeFailure("status", f"stream: HTTP {stream.status}, expected {wanted}")
        _read_events(probe, stream, stats, started)
    finally:
        stream.close()
    if stats.tokens == 0:
        raise ProbeFailure("empty", "stream: completed without a single token")


def _read_events(probe: Probe, stream: http.OpenStream, stats: StreamStats,
                 started: float) -> None:
    options, limits = probe.module.http, probe.module.stream
    parser = StreamParser(limits.format)
    first = last = 0.0
    size = 0
    while not stats.completed:
        if stats.tokens == 0:
            wait = started + limits.first_token_timeout - time.monotonic()
        else:
            wait = last + limits.max_token_gap - time.monotonic()
        try:
            if wait <= 0:
                raise TimeoutError
            chunk = stream.read(wait)
            events = parser.feed(chunk) if chunk else parser.end()
        except TimeoutError:
            if stats.tokens == 0:
                raise ProbeFailure("first_token_timeout", "stream: no token within "
                                   f"{limits.first_token_timeout:g}s of the request") from None
            raise ProbeFailure("token_gap", f"stream: no token for {limits.max_token_gap:g}s "
                               f"after token {stats.tokens}") from None
        except http.StreamEnded as exc:
            raise ProbeFailure("truncated", f"stream: {exc}, after {stats.tokens} tokens and "
                               "before the final event") from None
        except MalformedStream as exc:
            raise ProbeFailure("body", f"stream: {exc}") from None
        size += len(chunk)
        if size > options.max_body_bytes:
            raise ProbeFailure("body", f"stream: over max_body_bytes ({options.max_body_bytes})"
                               " before its final event")
        now = time.monotonic()
        for event in events:
            if isinstance(event, Token):
                if stats.tokens == 0:
                    first, stats.first_token = now, now - started
                else:
                    stats.max_gap = max(stats.max_gap, now - last)
                last = now
                stats.tokens += 1
            elif isinstance(event, Done):
                stats.completed = True
            else:
                raise ProbeFailure("engine_error", f"stream: the server reported an error: "
                                   f"{event.message}")
        if not chunk and not stats.completed:
            raise ProbeFailure("truncated", f"stream: the body ended after {stats.tokens} "
                               "tokens, before the final event")
    if stats.tokens > 1 and last > first:
        stats.tokens_per_second = (stats.tokens - 1) / (last - first)


RUNNERS: dict[str, Callable[[Probe, Address], None]] = {
    "http": run_http,
    "tcp": run_tcp,
    "colossal_inference": run_colossal_inference,
    "colossalchat": run_colossalchat,
    "health_json": run_health_json,
    "generate": run_generate,
    "stream": run_stream,
}
