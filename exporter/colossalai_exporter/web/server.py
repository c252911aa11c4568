"""Run an ASGI app under uvicorn, on a socket bound before anything else starts.

Binding the socket ourselves turns a busy port or a bad address into one
readable :class:`ConfigError` (uvicorn itself would log and ``sys.exit(1)``),
and lets tests ask for port 0 and read the port they got.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from colossalai_exporter.errors import ConfigError
from colossalai_exporter.web.config import WebConfig

log = logging.getLogger(__name__)

# A client has this long to send a complete request head; uvicorn alone would
# wait forever for the first request on a connection (slowloris).
HEADER_TIMEOUT_SECONDS = 10.0
KEEP_ALIVE_SECONDS = 30.0  # longer than Prometheus' usual scrape interval is not needed
GRACEFUL_SHUTDOWN_SECONDS = 10.0


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for the first request's head, and TCP_NODELAY."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # The response head and body leave in two writes; without TCP_NODELAY, Nagle
        # holds the body until the client's delayed ACK (about 40 ms on Linux) on
        # every keep-alive request, which is how Prometheus scrapes.
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._head_timer = self.loop.call_later(HEADER_TIMEOUT_SECONDS, self._head_timeout)

    def _head_timeout(self) -> None:
        # ``cycle`` is set once h11 has parsed a complete request head.
        if getattr(self, "cycle", None) is None and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)


def parse_listen_address(address: str) -> tuple[str, int]:
    """``:9466``, ``0.0.0.0:9466``, ``[::1]:9466``, ``localhost:0`` -> (host, port)."""
    host, sep, port_text = address.rpartition(":")
    if not sep:
        raise ConfigError(f"--web.listen-address {address!r} must be HOST:PORT or :PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"--web.listen-address {address!r}: port must be 0-65535")
    return host or "0.0.0.0", int(port_text)


def bind_socket(address: str) -> socket.socket:
    host, port = parse_listen_address(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--web.listen-address {address!r}: cannot resolve {host!r}: "
                          f"{exc.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--web.listen-address {address!r}: cannot listen: "
                          f"{exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


@dataclass
class ServerHandle:
    """A running server; ``stop()`` finishes in-flight requests, then returns."""

    server: uvicorn.Server
    thread: threading.Thread
    sock: socket.socket
    scheme: str

    def __post_init__(self) -> None:
        self._address: tuple[str, int] = self.sock.getsockname()[:2]

    @property
    def port(self) -> int:
        return int(self._address[1])

    @property
    def url(self) -> str:
        host = self._address[0]
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{self.port}"

    def stop(self, timeout: float = GRACEFUL_SHUTDOWN_SECONDS + 5) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        # asyncio closed the listener's file descriptor; close our socket object too.
        self.sock.close()

    def wait(self, stop: threading.Event | None = None) -> None:
        """Block until ``stop`` is set (see :func:`stop_on_signals`), then stop gracefully."""
        stop = stop or stop_on_signals()
        while not stop.is_set() and self.thread.is_alive():
            stop.wait(0.5)
        self.stop()


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set.

    Call it before the server starts listening, so a signal that arrives as soon as
    the port answers is not lost to the default handler.
    """
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("shutting down", extra={"signal": signal.Signals(signum).name})
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop


def serve(app: Any, listen_address: str, web_config: WebConfig | None = None,
          *, name: str = "http") -> ServerHandle:
    """Start ``app`` on ``listen_address`` in a background thread and return its handle."""
    web_config = web_config or WebConfig()
    sock = bind_socket(listen_address)
    ssl_context = web_config.tls.ssl_context() if web_config.tls else None
    config = uvicorn.Config(
        app,
        http=HeaderTimeoutProtocol,
        ws="none",
        lifespan="off",
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_keep_alive=int(KEEP_ALIVE_SECONDS),
        timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_SECONDS),
        h11_max_incomplete_event_size=64 * 1024,  # cap on a request head's size
    )
    config.load()
    # Our own context carries min_version and client-certificate settings that
    # uvicorn's keyword arguments cannot express; startup() reads config.ssl.
    config.ssl = ssl_context
    server = uvicorn.Server(config)
    started = threading.Event()

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.serve(sockets=[sock]))
        finally:
            loop.close()
            started.set()

    thread = threading.Thread(target=run, name=f"{name}-server", daemon=True)
    thread.start()
    # Wait for the listener to be live so callers (and tests) can connect at once.
    while not server.started and thread.is_alive():
        started.wait(0.005)
    handle = ServerHandle(server, thread, sock, "https" if ssl_context else "http")
    log.info("listening", extra={"address": handle.url, "server": name})
    return handle
