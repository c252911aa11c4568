"""A loopback HTTP server standing in for Vigilmon (heartbeats) and webhook receivers.

The real Vigilmon cannot run here and its heartbeat contract is not published
where we can read it. What this mimics is what the tutorial shows and what
healthchecks.io-style services do: ``GET /api/heartbeat/<token>`` answers 200
and records a ping; any other path or method is also recorded and answered
200, so the same server is a webhook receiver. The body is ``ok``, as Slack's
incoming webhooks answer: Alertmanager's Slack notifier (0.33 here; not 0.25)
takes any other body, "OK" included, for a failed notification, logs "Notify for
alerts failed" and sends the message again at the group's next interval. Tests can make it fail (any
status, optionally with ``Retry-After``, e.g. 429 or 503) or hang (answer
only after a delay) for all requests or for the next N, or go down (stop
listening: connections are refused, as when the service or the network to
it is down) and come back on the same address.

With ``tls`` (a server-side ``ssl.SSLContext``) it serves HTTPS, as a
Vigilmon or webhook receiver behind a private CA, or one requiring client
certificates, would; handshakes it refuses are counted, with the SNI name
each client sent.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from conftest import wait_until


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


@dataclass
class Behaviour:
    status: int = 200
    delay: float = 0.0  # seconds to wait before answering (a hang, when over the timeout)
    retry_after: str | None = None
    times: int | None = None  # apply to the next N requests only, then answer 200


@dataclass
class FakeVigilmon:
    server: ThreadingHTTPServer
    requests: list[Recorded] = field(default_factory=list)
    behaviour: Behaviour = field(default_factory=Behaviour)
    lock: threading.Lock = field(default_factory=threading.Lock)
    failures_answered: int = 0
    port: int = 0
    down: bool = False
    tls: ssl.SSLContext | None = None
    handshake_failures: list[str] = field(default_factory=list)  # OpenSSL's reasons
    server_names: list[str | None] = field(default_factory=list)  # SNI of each handshake

    def __post_init__(self) -> None:
        self.port = self.port or int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def failed_handshakes(self) -> int:
        with self.lock:
            return len(self.handshake_failures)

    def go_down(self) -> None:
        """Stop listening: new connections are refused, open ones are closed."""
        _stop(self.server)
        self.down = True

    def come_back(self) -> None:
        """Listen again on the same port."""
        self.server = _listen(self, self.port)
        self.down = False

    def heartbeat_url(self, token: str) -> str:
        return f"{self.url}/api/heartbeat/{token}"

    def set(self, **kwargs: object) -> None:
        with self.lock:
            self.behaviour = Behaviour(**kwargs)  # type: ignore[arg-type]

    def received(self, path_prefix: str = "", *, include_failed: bool = False) -> list[Recorded]:
        """Requests to paths starting with ``path_prefix`` that were answered 2xx."""
        with self.lock:
            return [r for r in self.requests if r.path.startswith(path_prefix)
                    and (include_failed or r.headers.get("x-fake-answered", "200")[0] == "2")]

    def wait_for(self, path_prefix: str, count: int, timeout: float = 10.0) -> list[Recorded]:
        def enough() -> list[Recorded] | None:
            got = self.received(path_prefix)
            return got if len(got) >= count else None

        return wait_until(enough, timeout, what=f"{count} requests to {path_prefix}")  # type: ignore[no-any-return]


def _handler(fake: FakeVigilmon) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # One write per response: headers and body in separate small writes meet the
        # client's delayed ACK (Nagle), 40 ms a request.
        wbufsize = 65536
        disable_nagle_algorithm = True

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            with fake.lock:
                behaviour = fake.behaviour
                if behaviour.times is not None:
                    if behaviour.times <= 0:
                        behaviour = Behaviour()
                    else:
                        fake.behaviour = Behaviour(behaviour.status, behaviour.delay,
                                                   behaviour.retry_after, behaviour.times - 1)
            if behaviour.delay:
                time.sleep(behaviour.delay)
            headers = {k.lower(): v for k, v in self.headers.items()}
            headers["x-fake-answered"] = str(behaviour.status)
            with fake.lock:
                fake.requests.append(Recorded(self.command, self.path, headers, body,
                                              time.time()))
            try:
                self.send_response(behaviour.status)
                if behaviour.retry_after is not None:
                    self.send_header("Retry-After", behaviour.retry_after)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")
            except OSError:
                pass  # the client gave up waiting (a hang past its timeout)

        do_GET = do_POST = do_HEAD = do_PUT = _answer

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, fake: FakeVigilmon | None = None) -> None:
        super().__init__(("127.0.0.1", port), BaseHTTPRequestHandler)
        self.connections: set[socket.socket] = set()
        self.fake = fake

    def process_request(self, request: Any, client_address: Any) -> None:
        self.connections.add(request)
        super().process_request(request, client_address)

    def finish_request(self, request: Any, client_address: Any) -> None:
        fake = self.fake
        if fake is None or fake.tls is None:
            super().finish_request(request, client_address)
            return
        # The handshake runs here, in the connection's own thread, not in accept():
        # a client that stalls or fails it must not hold up the others.
        request.settimeout(10)
        try:
            tls_socket = fake.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:  # wrap_socket has closed the socket
            reason = getattr(exc, "reason", None) or type(exc).__name__
            with fake.lock:
                fake.handshake_failures.append(str(reason))
            return
        tls_socket.settimeout(None)
        self.connections.add(tls_socket)  # for go_down(); the plain socket is detached
        try:
            super().finish_request(tls_socket, client_address)
        finally:
            self.connections.discard(tls_socket)
            tls_socket.close()

    def shutdown_request(self, request: Any) -> None:
        self.connections.discard(request)
        super().shutdown_request(request)


def _listen(fake: FakeVigilmon | None, port: int) -> _Server:
    server = _Server(port, fake)  # allow_reuse_address: the port can be taken again at once
    if fake is not None:
        server.RequestHandlerClass = _handler(fake)
    threading.Thread(target=server.serve_forever, name="fake-vigilmon", daemon=True).start()
    return server


def _stop(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()
    # Keep-alive connections too: a service that is down answers nothing.
    for conn in list(getattr(server, "connections", ())):
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)


@contextmanager
def fake_vigilmon(tls: ssl.SSLContext | None = None) -> Iterator[FakeVigilmon]:
    server = _listen(None, 0)
    fake = FakeVigilmon(server, tls=tls)
    server.fake = fake
    server.RequestHandlerClass = _handler(fake)
    if tls is not None:
        def record_sni(_sock: Any, name: str | None, _ctx: ssl.SSLContext) -> None:
            with fake.lock:
                fake.server_names.append(name)

        tls.sni_callback = record_sni
    try:
        yield fake
    finally:
        if not fake.down:
            _stop(fake.server)
