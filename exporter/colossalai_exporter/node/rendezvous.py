"""Rendezvous reachability: a TCP connect to each store endpoint.

The endpoints are the stores of the ranks live on this node, as their snapshots say
(``MASTER_ADDR:MASTER_PORT`` as the launcher set them for the rank: the ranks collector
reads them), and any configured ones. A fixed guess is none: an agent on defaults
checked 127.0.0.1:29500, and a healthy ``torchrun --standalone`` job (its store on a
port of its own) paged NCCLRendezvousDown within a minute.

This is the tutorial's ``check_nccl_port``, done for every endpoint at once,
each with its own deadline, and with the reason a connect failed. NCCL's own
data ports are ephemeral; what can be checked from outside is the c10d store
or MASTER_ADDR:MASTER_PORT that every rank must reach to (re)join.

An address (the usual MASTER_ADDR) is connected to without blocking: ``begin``
starts the connect, and the agent's event loop learns that it is over when
the socket turns writable, so a dropped SYN never holds up anything but this
endpoint's own series. A name must be resolved first, and ``getaddrinfo`` has
no timeout and cannot be made non-blocking, so names are resolved and
connected to in a small thread pool, bounded by the collector's deadline.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import select
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from colossalai_exporter import catalogue
from colossalai_exporter.node.base import LoopWaker

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from prometheus_client.core import Metric as MetricFamily

    from colossalai_exporter.node.base import Pending
    from colossalai_exporter.node.collectors import Built
    from colossalai_exporter.node.config import NodeConfig
    from colossalai_exporter.node.ranks import RanksCollector

REASONS = ("refused", "timeout", "dns", "unreachable", "error")


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def label(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, spec: str) -> Endpoint:
        """``host:port`` or ``[v6]:port`` (a flag, the config file, a snapshot's store);
        ValueError otherwise."""
        host, sep, port = spec.strip().rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"not host:port: {spec!r}")
        return cls(host, int(port))


@dataclass(frozen=True)
class ConnectResult:
    ok: bool
    seconds: float
    reason: str = ""


def _reason(exc: OSError) -> str:
    if isinstance(exc, socket.gaierror):
        return "dns"
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EHOSTDOWN):
        return "unreachable"
    return "error"


def _ip_family(host: str) -> socket.AddressFamily | None:
    """AF_INET or AF_INET6 for an address literal; None for a name to resolve."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return socket.AF_INET6 if address.version == 6 else socket.AF_INET


def _is_ip_literal(host: str) -> bool:
    return _ip_family(host) is not None


def connect(endpoint: Endpoint, timeout: float) -> ConnectResult:
    """One TCP connect, closed at once; never longer than ``timeout`` (DNS included)."""
    start = time.monotonic()
    try:
        family = _ip_family(endpoint.host)
        if family is not None:
            # An address: no getaddrinfo, which create_connection would call anyway.
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout)
                sock.connect((endpoint.host, endpoint.port))
        else:
            # getaddrinfo has no timeout of its own; the collector's thread pool
            # deadline bounds it (a hung resolver is reported as timeout).
            with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout):
                pass
    except OSError as exc:
        return ConnectResult(False, time.monotonic() - start, _reason(exc))
    return ConnectResult(True, time.monotonic() - start)


class _Attempt:
    """One non-blocking connect to an address; ``result`` once it is over."""

    __slots__ = ("endpoint", "result", "sock", "start")

    def __init__(self, endpoint: Endpoint, family: socket.AddressFamily) -> None:
        self.endpoint = endpoint
        self.result: ConnectResult | None = None
        self.start = time.monotonic()
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        code = self.sock.connect_ex((endpoint.host, endpoint.port))
        # Loopback and a local refusal finish at once; a remote peer takes a round trip.
        if code not in (errno.EINPROGRESS, errno.EAGAIN):
            self._finish(code)

    def finish_writable(self) -> None:
        """The socket turned writable (or failed): the connect is over."""
        if self.result is None:
            self._finish(self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))

    def _finish(self, code: int) -> None:
        seconds = time.monotonic() - self.start
        if code == 0:
            self.result = ConnectResult(True, seconds)
        else:
            self.result = ConnectResult(False, seconds,
                                        _reason(OSError(code, errno.errorcode.get(code, ""))))


class _Connects:
    """One scrape's connects (a Pending): addresses without blocking, names in threads."""

    def __init__(self, attempts: list[_Attempt],
                 resolving: list[tuple[Endpoint, Future[ConnectResult]]], budget: float) -> None:
        self.attempts = attempts
        self.resolving = resolving
        self.start = time.monotonic()
        self.budget = budget

    def ready(self) -> bool:
        self._poll(0)
        return all(a.result is not None for a in self.attempts) and \
            all(future.done() for _, future in self.resolving)

    def watch(self, loop: asyncio.AbstractEventLoop,
              wake: Callable[[], None]) -> Callable[[], None]:
        waker = LoopWaker(loop, wake)
        watched: list[int] = []
        for attempt in self.attempts:
            if attempt.result is None:
                fd = attempt.sock.fileno()

                def writable(attempt: _Attempt = attempt, fd: int = fd) -> None:
                    # Level-triggered: a connected socket stays writable, and would
                    # wake the loop on every turn until it stopped watching it.
                    loop.remove_writer(fd)
                    attempt.finish_writable()
                    wake()

                loop.add_writer(fd, writable)
                watched.append(fd)
        for _, future in self.resolving:
            future.add_done_callback(waker)

        def stop() -> None:
            for fd in watched:
                loop.remove_writer(fd)
            waker.stop()

        return stop

    def _poll(self, timeout: float) -> None:
        """Finish the attempts whose sockets turned writable within ``timeout`` seconds."""
        open_attempts = {a.sock.fileno(): a for a in self.attempts if a.result is None}
        if not open_attempts:
            return
        poller = select.poll()
        for fd in open_attempts:
            poller.register(fd, select.POLLOUT)
        for fd, _ in poller.poll(max(0, math.ceil(timeout * 1000))):
            open_attempts[fd].finish_writable()

    def results(self, deadline: float) -> list[tuple[Endpoint, ConnectResult]]:
        """Wait (at most until the budget or ``deadline`` ends) and close the sockets."""
        end = min(self.start + self.budget, deadline)
        while any(a.result is None for a in self.attempts):
            remaining = end - time.monotonic()
            if remaining <= 0:
                break
            self._poll(remaining)
        results: dict[Endpoint, ConnectResult] = {}
        for attempt in self.attempts:
            attempt.sock.close()
            results[attempt.endpoint] = attempt.result or ConnectResult(
                False, time.monotonic() - attempt.start, "timeout")
        for endpoint, future in self.resolving:
            remaining = max(0.0, end - time.monotonic())
            try:
                results[endpoint] = future.result(timeout=remaining + 0.05)
            except FutureTimeout:  # not the builtin TimeoutError before Python 3.11
                results[endpoint] = ConnectResult(False, self.budget, "timeout")
        return list(results.items())


class RendezvousCollector:
    name = "rendezvous"
    reasons: tuple[str, ...] = ("error",)

    def __init__(self, endpoints: list[Endpoint], timeout: float = 2.0,
                 discovered: Callable[[], list[str]] | None = None) -> None:
        """``endpoints``: the configured ones; ``discovered``: the live ranks' stores."""
        self.endpoints = endpoints
        self.timeout = timeout
        self._discovered = discovered
        # Threads outlive a hung getaddrinfo; a small pool bounds how many pile up. Made
        # at the first name to resolve (a rank's MASTER_ADDR is often a host name).
        self._pool: ThreadPoolExecutor | None = None

    def current(self) -> list[Endpoint]:
        """The configured endpoints, then the live ranks' stores not among them; a store a
        snapshot names that is not host:port is skipped (the snapshot's, not ours)."""
        endpoints = list(self.endpoints)
        for spec in self._discovered() if self._discovered is not None else ():
            try:
                endpoint = Endpoint.parse(spec)
            except ValueError:
                continue
            if endpoint not in endpoints:
                endpoints.append(endpoint)
        return endpoints

    def begin(self, deadline: float) -> _Connects:
        """Start every connect; collect() waits for them."""
        budget = max(0.01, min(self.timeout, deadline - time.monotonic()))
        attempts: list[_Attempt] = []
        resolving: list[tuple[Endpoint, Future[ConnectResult]]] = []
        for endpoint in self.current():
            family = _ip_family(endpoint.host)
            if family is not None:
                try:
                    attempts.append(_Attempt(endpoint, family))
                except OSError:  # out of file descriptors, say: that endpoint fails alone
                    failed: Future[ConnectResult] = Future()
                    failed.set_result(ConnectResult(False, 0.0, "error"))
                    resolving.append((endpoint, failed))
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=8,
                                                    thread_name_prefix="rendezvous")
                resolving.append((endpoint, self._pool.submit(connect, endpoint, budget)))
        return _Connects(attempts, resolving, budget)

    def collect(self, deadline: float, pending: Pending | None = None) -> list[MetricFamily]:
        connects = pending if isinstance(pending, _Connects) else self.begin(deadline)
        return self._families(connects.results(deadline))

    def _families(self, results: list[tuple[Endpoint, ConnectResult]]) -> list[MetricFamily]:
        up = catalogue.gauge("colossalai_nccl_up")
        duration = catalogue.gauge("colossalai_nccl_connect_duration_seconds")
        failure = catalogue.info("colossalai_nccl_failure_info")
        for endpoint, result in results:
            up.add_metric([endpoint.label], 1.0 if result.ok else 0.0)
            duration.add_metric([endpoint.label], result.seconds)
            if not result.ok:
                failure.add_metric([endpoint.label, result.reason], {})
        return [up, duration, failure]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def from_config(config: NodeConfig, built: Built) -> RendezvousCollector:
    """The registry's factory (node/collectors.py): the configured endpoints, and the
    stores of the ranks the ranks collector sees (when it is on)."""
    ranks = cast("RanksCollector | None", built.collectors.get("ranks"))
    return RendezvousCollector(config.rendezvous, config.rendezvous_timeout,
                               discovered=ranks.local_stores if ranks is not None else None)
