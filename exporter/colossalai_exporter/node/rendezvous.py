"""Rendezvous reachability: a TCP connect to each configured store endpoint.

This is the tutorial's ``check_nccl_port``, done for every endpoint at once,
each with its own deadline, and with the reason a connect failed. NCCL's own
data ports are ephemeral; what can be checked from outside is the c10d store
or MASTER_ADDR:MASTER_PORT that every rank must reach to (re)join.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from colossalai_exporter.catalogue import family

if TYPE_CHECKING:
    from prometheus_client.core import Metric as MetricFamily

REASONS = ("refused", "timeout", "dns", "unreachable", "error")


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def label(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


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


class RendezvousCollector:
    name = "rendezvous"
    reasons: tuple[str, ...] = ("error",)

    def __init__(self, endpoints: list[Endpoint], timeout: float = 2.0) -> None:
        self.endpoints = endpoints
        self.timeout = timeout
        # Threads outlive a hung getaddrinfo; a small pool bounds how many pile up.
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(8, len(endpoints))),
                                        thread_name_prefix="rendezvous")

    def collect(self, deadline: float) -> list[MetricFamily]:
        budget = max(0.01, min(self.timeout, deadline - time.monotonic()))
        if len(self.endpoints) == 1 and _is_ip_literal(self.endpoints[0].host):
            # No name to resolve, so nothing the socket timeout does not bound: the
            # usual single MASTER_ADDR endpoint is checked in the scrape's own thread.
            return self._families([(self.endpoints[0], connect(self.endpoints[0], budget))])
        futures = [(ep, self._pool.submit(connect, ep, budget)) for ep in self.endpoints]
        results: list[tuple[Endpoint, ConnectResult]] = []
        for endpoint, future in futures:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                result = future.result(timeout=min(budget, remaining) + 0.05)
            except TimeoutError:
                result = ConnectResult(False, budget, "timeout")
            results.append((endpoint, result))
        return self._families(results)

    def _families(self, results: list[tuple[Endpoint, ConnectResult]]) -> list[MetricFamily]:
        up = family("colossalai_nccl_up")
        duration = family("colossalai_nccl_connect_duration_seconds")
        failure = family("colossalai_nccl_failure_info")
        for endpoint, result in results:
            up.add_metric([endpoint.label], 1.0 if result.ok else 0.0)
            duration.add_metric([endpoint.label], result.seconds)
            if not result.ok:
                failure.add_metric([endpoint.label, result.reason], {})
        return [up, duration, failure]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
