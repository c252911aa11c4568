"""Run an ASGI app under uvicorn, on a socket bound before anything else starts.

uvicorn runs its httptools protocol (llhttp, a C parser), with a deadline and a
size cap on every request head and TCP_NODELAY (:class:`HttpToolsServerProtocol`).
Its pure-Python h11 protocol is not used: about a quarter of the requests per
second, and a head cap only for heads that arrive in pieces.

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
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from colossalai_exporter.errors import ConfigError
from colossalai_exporter.web.config import WebConfig

log = logging.getLogger(__name__)

# A client has this long to send a complete request head; uvicorn alone would
# wait forever for the first request on a connection (slowloris).
HEADER_TIMEOUT_SECONDS = 10.0
# The most bytes a request head (request line and headers) may take.
MAX_HEAD_BYTES = 64 * 1024
KEEP_ALIVE_SECONDS = 30.0  # longer than Prometheus' usual scrape interval is not needed
GRACEFUL_SHUTDOWN_SECONDS = 10.0


def set_nodelay(transport: asyncio.Transport) -> None:
    # The response head and body leave in two writes; without TCP_NODELAY, Nagle
    # holds the body until the client's delayed ACK (about 40 ms on Linux) on
    # every keep-alive request, which is how Prometheus scrapes.
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop llhttp once a head is over the cap."""


class IgnoresUpgrades:
    """Mixin for uvicorn's protocols: an Upgrade header is ignored in one debug line.

    uvicorn warns twice for every request that asks for an upgrade, advising a
    WebSocket library to install. These servers offer no upgrade (``ws="none"``),
    and a server may ignore Upgrade (RFC 9110, section 7.8): the request is
    served as plain HTTP/1.1. Left as they were, those warnings let any client
    fill the log.
    """

    logger: logging.Logger

    def _unsupported_upgrade_warning(self) -> None:
        self.logger.debug("ignored a request's Upgrade header: no protocol upgrade is offered")


class HttpToolsServerProtocol(IgnoresUpgrades, HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp, a C parser) with Go's ``http.Server`` protections.

    About four times the requests per second of uvicorn's h11 protocol on the same
    app, which is most of a scrape's HTTP cost (bench/RESULTS.md). What it adds to
    uvicorn's:

    * TCP_NODELAY (see :func:`set_nodelay`).
    * A deadline for every request head, as Go's ``http.Server.ReadHeaderTimeout``:
      the first from the moment the connection is made, each later one from the
      moment its first bytes arrive on a kept-alive connection (Go too waits for
      those under its idle timeout, then starts the head's deadline). A client
      that has not completed a head by then is disconnected. This also bounds a
      client that trickles the rest of a body the app has already answered (413, 408):
      those bytes arrive while no request is being served.
    * A cap on a head's size. Neither llhttp nor httptools has one (httptools
      buffers a 10 MiB header value whole); Node, which embeds llhttp, counts head
      bytes itself. Like Go's ``MaxHeaderBytes`` (and Node's limit), a head over
      :data:`MAX_HEAD_BYTES` is answered ``431 Request Header Fields Too Large``
      and the connection closed. Counted twice over: the URL and header bytes the
      parser hands over (a whole oversized head in one read), and every read that
      ends with a head still incomplete (what httptools is buffering unseen).
    """

    #: Told the reason (``bad_request``, ``head_too_large``) of every request this
    #: layer refuses before the app sees it; see :func:`serve`'s ``on_refused``.
    on_refused: Callable[[str], None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head = False
        self._head_parsed = 0  # URL and header bytes of the current head, from the parser
        self._head_pending = 0  # bytes of reads that ended inside the current head
        self._head_refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        set_nodelay(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(HEADER_TIMEOUT_SECONDS, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:
            # No request is being served: these bytes start the next head (or trail
            # a body that was answered early); the deadline runs from now.
            self._arm_head_timer()
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            # The whole read counts, though a pipelined one may begin with the end of
            # earlier requests: an over-count of at most one read, for clients that
            # pipeline (Prometheus does not).
            self._head_pending += len(data)
            if self._head_pending > MAX_HEAD_BYTES:
                self._refuse_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_parsed = self._head_pending = 0
        self._arm_head_timer()  # a pipelined head, while an earlier request is served

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def _count_head(self, size: int) -> None:
        self._head_parsed += size
        if self._head_parsed > MAX_HEAD_BYTES:
            self._head_refused = True
            raise _HeadTooLarge  # httptools raises HttpParserCallbackError: send_400_response

    def send_400_response(self, msg: str) -> None:
        if self._head_refused:
            self._refuse_head()
        else:
            self._tell_refused("bad_request")
            super().send_400_response(msg)

    def _tell_refused(self, reason: str) -> None:
        if self.on_refused is not None:
            try:
                self.on_refused(reason)
            except Exception:
                self.logger.exception("on_refused failed")

    def _refuse_head(self) -> None:
        self._tell_refused("head_too_large")
        msg = f"request head over {MAX_HEAD_BYTES} bytes"
        self.logger.warning("Refused a request head over %d bytes.", MAX_HEAD_BYTES)
        content = [STATUS_LINE[431]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend([b"content-type: text/plain; charset=utf-8\r\n",
                        b"content-length: %d\r\n" % len(msg), b"connection: close\r\n",
                        b"\r\n", msg.encode("ascii")])
        self.transport.write(b"".join(content))
        self.transport.close()


LISTEN_OPTION = "--web.listen-address"


def parse_listen_address(address: str, option: str = LISTEN_OPTION) -> tuple[str, int]:
    """``:9466``, ``0.0.0.0:9466``, ``[::1]:9466``, ``localhost:0`` -> (host, port).

    ``option`` names, in errors, what the user sets the address with.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep:
        raise ConfigError(f"{option} {address!r} must be HOST:PORT or :PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{option} {address!r}: port must be 0-65535")
    return host or "0.0.0.0", int(port_text)


def bind_socket(address: str, option: str = LISTEN_OPTION) -> socket.socket:
    host, port = parse_listen_address(address, option)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"{option} {address!r}: cannot resolve {host!r}: "
                          f"{exc.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{option} {address!r}: cannot listen: "
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
        """Where a local client reaches it (loopback for a wildcard address)."""
        host = self._address[0]
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        return self._with_host(host)

    @property
    def bound(self) -> str:
        """The address it listens on, as bound (0.0.0.0 on every interface): what the
        log says, since it is read to see what is exposed."""
        return self._with_host(self._address[0])

    def _with_host(self, host: str) -> str:
        if ":" in host:
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
          *, name: str = "http", option: str = LISTEN_OPTION,
          on_refused: Callable[[str], None] | None = None) -> ServerHandle:
    """Start ``app`` on ``listen_address`` in a background thread and return its handle.

    ``option``: how the user sets ``listen_address``, for error messages.
    ``on_refused``: told the reason of each request refused before it reached the
    app (a malformed or oversized head), which no route and no observer sees.
    """
    http: type[HttpToolsServerProtocol] = HttpToolsServerProtocol
    if on_refused is not None:
        http = type("RefusalCountingProtocol", (HttpToolsServerProtocol,),
                    {"on_refused": staticmethod(on_refused)})
    web_config = web_config or WebConfig()
    sock = bind_socket(listen_address, option)
    ssl_context = web_config.tls.ssl_context() if web_config.tls else None
    config = uvicorn.Config(
        app,
        http=http,
        ws="none",
        lifespan="off",
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_keep_alive=int(KEEP_ALIVE_SECONDS),
        timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_SECONDS),
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
    log.info("listening", extra={"address": handle.bound, "server": name})
    return handle
