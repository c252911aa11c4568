"""One HTTP request on a socket we connect ourselves, each phase timed and bounded.

Why ``http.client`` and not requests: requests (urllib3) resolves names itself,
which would let a name be judged against the allow list and then re-resolved
to another address, and it cannot report how long connect, TLS and the wait
for the response head took. Here the probe connects to the exact address the
allow list accepted, does the TLS handshake itself (with the target's name for
SNI and verification), hands the socket to ``http.client`` for the protocol,
and reads the time at each boundary. Redirects are never followed: a redirect
could point outside the allow list, so a 3xx is judged as a status code.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field

from colossalai_exporter.configfile import secret_from_file
from colossalai_exporter.errors import ConfigError
from colossalai_exporter.probe.config import TLSOptions
from colossalai_exporter.probe.targets import Address, ProbeTarget
from colossalai_exporter.version import __version__

PHASES = ("resolve", "connect", "tls", "processing", "transfer")
USER_AGENT = f"colossalai-exporter-probe/{__version__}"


class ProbeFailure(Exception):
    """The probe failed for ``reason`` (one of config.REASONS)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass
class HttpResult:
    status: int
    body: bytes
    truncated: bool
    headers: dict[str, str]


@dataclass
class ProbeProgress:
    """State of one probe: phase timings, what it learnt, and a way to abort it.

    ``abort()`` is called from the request handler when the probe's deadline has
    passed: it shuts the open socket down, which wakes a blocked ``recv`` at once.
    """

    deadline: float
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    status_code: int = 0
    tls_used: bool = False
    cert_expiry: float | None = None
    body_length: int = 0
    aborted: bool = False
    _sock: socket.socket | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0 or self.aborted:
            raise ProbeFailure("timeout", "the probe's deadline passed")
        return left

    def add(self, phase: str, started: float) -> None:
        self.phases[phase] += time.monotonic() - started

    def _track(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)


def _connect_error(exc: OSError, address: Address) -> ProbeFailure:
    where = f"{address.ip}:{address.port}"
    if isinstance(exc, ConnectionRefusedError):
        return ProbeFailure("refused", f"connection to {where} refused")
    if isinstance(exc, TimeoutError | socket.timeout):
        return ProbeFailure("timeout", f"connecting to {where} timed out")
    if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL):
        return ProbeFailure("unreachable", f"{where} is unreachable: {exc.strerror}")
    return ProbeFailure("connection", f"connecting to {where} failed: {exc}")


def connect(progress: ProbeProgress, address: Address) -> socket.socket:
    """A TCP connection to ``address`` within the deadline (phase ``connect``)."""
    started = time.monotonic()
    sock = socket.socket(address.family, socket.SOCK_STREAM)
    progress._track(sock)
    try:
        sock.settimeout(progress.remaining())
        sock.connect(address.sockaddr)
    except OSError as exc:
        sock.close()
        if progress.aborted:
            raise ProbeFailure("timeout", "the probe's deadline passed while connecting") from None
        raise _connect_error(exc, address) from None
    finally:
        progress.add("connect", started)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def tls_context(options: TLSOptions) -> ssl.SSLContext:
    """The module's TLS settings as a context (its files were checked at start-up)."""
    return options.context()


def handshake(progress: ProbeProgress, sock: socket.socket, target: ProbeTarget,
              options: TLSOptions) -> ssl.SSLSocket:
    """TLS over ``sock`` (phase ``tls``); reason ``tls`` for every handshake failure."""
    started = time.monotonic()
    name = options.server_name or target.host
    try:
        sock.settimeout(progress.remaining())
        tls_sock = tls_context(options).wrap_socket(sock, server_hostname=name)
    except ssl.SSLCertVerificationError as exc:
        sock.close()
        raise ProbeFailure("tls", f"certificate of {name} not trusted: "
                           f"{exc.verify_message or exc.reason}") from None
    except TimeoutError:
        sock.close()
        raise ProbeFailure("timeout", "TLS handshake timed out") from None
    except (ssl.SSLError, OSError) as exc:
        sock.close()
        if progress.aborted:
            raise ProbeFailure("timeout", "the probe's deadline passed during TLS") from None
        # A plain-HTTP server answering a ClientHello, or closing on it, lands here too.
        raise ProbeFailure("tls", f"TLS handshake with {name} failed: {exc}") from None
    finally:
        progress.add("tls", started)
    progress._track(tls_sock)
    progress.tls_used = True
    if not options.insecure_skip_verify:
        cert = tls_sock.getpeercert()
        not_after = cert.get("notAfter") if cert else None
        if isinstance(not_after, str):
            progress.cert_expiry = float(ssl.cert_time_to_seconds(not_after))
    return tls_sock


def _header_values(headers: tuple[tuple[str, str], ...],
                   header_files: tuple[tuple[str, str], ...]) -> dict[str, str]:
    values = {"User-Agent": USER_AGENT, "Accept": "application/json, */*;q=0.5"}
    values.update(headers)
    for name, path in header_files:
        try:
            values[name] = secret_from_file(path)
        except ConfigError as exc:
            raise ProbeFailure("config", f"header file for {name}: {exc}") from None
    return values


def _read_body(progress: ProbeProgress, sock: socket.socket, response: http.client.HTTPResponse,
               max_body_bytes: int) -> tuple[bytes, bool]:
    """The body up to ``max_body_bytes``, each read bounded by the deadline."""
    chunks: list[bytes] = []
    size = 0
    while size < max_body_bytes:
        sock.settimeout(progress.remaining())
        chunk = response.read1(min(65536, max_body_bytes - size))
        if not chunk:
            return b"".join(chunks), False
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), not response.isclosed()


def _failure(exc: Exception, phase: str, progress: ProbeProgress) -> ProbeFailure:
    """Classify an exception raised while talking HTTP in ``phase``."""
    if isinstance(exc, ProbeFailure):
        return exc
    if isinstance(exc, TimeoutError):
        return ProbeFailure("timeout", f"no complete response within the deadline "
                            f"(phase {phase})")
    if isinstance(exc, ssl.SSLError):
        return ProbeFailure("tls", f"TLS error during {phase}: {exc}")
    if progress.aborted:
        return ProbeFailure("timeout", f"the probe's deadline passed (phase {phase})")
    if isinstance(exc, http.client.RemoteDisconnected | ConnectionError):
        return ProbeFailure("connection", f"connection lost during {phase}: {exc}")
    if isinstance(exc, http.client.HTTPException):
        return ProbeFailure("protocol", f"not a valid HTTP response: {exc!r}")
    return ProbeFailure("connection", f"socket error during {phase}: {exc}")


def _send(progress: ProbeProgress, address: Address, target: ProbeTarget, method: str,
          path: str, headers: tuple[tuple[str, str], ...],
          header_files: tuple[tuple[str, str], ...], body: bytes | None,
          tls: TLSOptions | None) -> tuple[http.client.HTTPConnection, socket.socket,
                                            http.client.HTTPResponse]:
    """Connect, send the request on a fresh connection and read the response head
    (phases connect, tls, processing)."""
    values = _header_values(headers, header_files)
    sock: socket.socket = connect(progress, address)
    if target.tls:
        sock = handshake(progress, sock, target, tls or TLSOptions())
    conn = http.client.HTTPConnection(target.host, target.port)
    conn.sock = sock
    values["Host"] = target.host_header()
    values["Connection"] = "close"
    started = time.monotonic()
    try:
        sock.settimeout(progress.remaining())
        conn.request(method, path, body=body, headers=values)
        response = conn.getresponse()
    except (ProbeFailure, OSError, http.client.HTTPException) as exc:
        progress._track(None)
        conn.close()
        raise _failure(exc, "processing", progress) from None
    finally:
        progress.add("processing", started)
    progress.status_code = response.status
    return conn, sock, response


def request(progress: ProbeProgress, address: Address, target: ProbeTarget, *, method: str,
            path: str,
            headers: tuple[tuple[str, str], ...] = (),
            header_files: tuple[tuple[str, str], ...] = (), body: bytes | None = None,
            tls: TLSOptions | None = None, max_body_bytes: int = 1 << 20) -> HttpResult:
    """One request on a fresh connection; phases add to ``progress.phases``."""
    conn, sock, response = _send(progress, address, target, method, path, headers,
                                 header_files, body, tls)
    started = time.monotonic()
    try:
        data, truncated = _read_body(progress, sock, response, max_body_bytes)
        progress.body_length = len(data)
        return HttpResult(response.status, data, truncated,
                          {k.lower(): v for k, v in response.getheaders()})
    except (ProbeFailure, OSError, http.client.HTTPException) as exc:
        raise _failure(exc, "transfer", progress) from None
    finally:
        progress.add("transfer", started)
        progress._track(None)
        conn.close()


class StreamEnded(Exception):
    """The connection ended before the body did (reason ``truncated``)."""


class OpenStream:
    """A response whose body is read as it arrives, each read with a wait of its own
    (a token's deadline) and never past the probe's: :func:`open_stream`."""

    def __init__(self, progress: ProbeProgress, conn: http.client.HTTPConnection,
                 sock: socket.socket, response: http.client.HTTPResponse) -> None:
        self.progress = progress
        self.status = response.status
        self._conn, self._sock, self._response = conn, sock, response
        self._started = time.monotonic()

    def read(self, wait: float) -> bytes:
        """The next bytes of the body, b"" at its end. TimeoutError when nothing came
        within ``wait`` seconds; StreamEnded when the connection ended before the body
        did (a chunked body without its last chunk, fewer bytes than Content-Length)."""
        progress = self.progress
        left = progress.remaining()
        self._sock.settimeout(max(0.001, min(wait, left)))
        try:
            chunk = self._response.read1(65536)
        except TimeoutError:
            if left <= wait:  # the probe's own deadline came first: reason timeout
                raise ProbeFailure("timeout", "the probe's deadline passed while the "
                                   "stream was being read") from None
            raise
        except http.client.IncompleteRead:
            raise StreamEnded("the connection ended in the middle of the chunked "
                              "body") from None
        except (OSError, http.client.HTTPException) as exc:
            if isinstance(exc, ConnectionError):
                raise StreamEnded(f"the connection ended: {exc}") from None
            raise _failure(exc, "transfer", progress) from None
        if not chunk and self._response.length:
            raise StreamEnded(f"the connection ended {self._response.length} bytes short "
                              "of its Content-Length")
        progress.body_length += len(chunk)
        return chunk

    def close(self) -> None:
        self.progress.add("transfer", self._started)
        self.progress._track(None)
        self._conn.close()


def open_stream(progress: ProbeProgress, address: Address, target: ProbeTarget, *,
                method: str, path: str, headers: tuple[tuple[str, str], ...] = (),
                header_files: tuple[tuple[str, str], ...] = (), body: bytes | None = None,
                tls: TLSOptions | None = None) -> OpenStream:
    """Send the request and return once the response head is in; the caller reads the
    body as it streams and closes it."""
    return OpenStream(progress, *_send(progress, address, target, method, path, headers,
                                       header_files, body, tls))
