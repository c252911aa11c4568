"""Targets: parse the ``target`` parameter, resolve it with a deadline, apply the allow list.

The allow list is judged on the addresses a name resolves to, and the probe then
connects to exactly the address that was judged: a name that resolves to an
allowed address at check time cannot be re-resolved to another one afterwards
(DNS rebinding), and ``localhost.example.com`` pointing at 10.0.0.5 is not
"loopback" because of its name.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# getaddrinfo cannot be interrupted; it runs here so a hung resolver costs a thread,
# not the probe's deadline. Small: lookups are quick or the resolver is broken.
_RESOLVER = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="resolve")


class BadTarget(ValueError):
    """The ``target`` parameter does not parse (answered 400)."""


class NotAllowed(Exception):
    """The target is outside the allow list (answered 403)."""


class ResolveError(Exception):
    """The name did not resolve (a probe failure with reason ``dns``)."""


@dataclass(frozen=True)
class ProbeTarget:
    """A parsed target: ``scheme`` is http, https or tcp; ``path`` is a prefix for HTTP."""

    raw: str
    scheme: str
    host: str
    port: int
    path: str = ""
    query: str = ""

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = {"http": 80, "https": 443}.get(self.scheme)
        return host if self.port == default else f"{host}:{self.port}"

    def request_path(self, module_path: str) -> str:
        """The module's path under the target's own path (a reverse-proxy prefix, say)."""
        if module_path:
            path = self.path.rstrip("/") + "/" + module_path.lstrip("/")
        else:
            path = self.path or "/"
        return path + (f"?{self.query}" if self.query else "")


def _port(text: str, raw: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise BadTarget(f"target {raw!r}: port must be 1-65535")
    return int(text)


def parse_target(raw: str, kind: str) -> ProbeTarget:
    """``kind`` is ``tcp`` (HOST:PORT) or ``http`` (a URL; ``http://`` is assumed when absent)."""
    raw = raw.strip()
    if not raw or any(c.isspace() for c in raw):
        raise BadTarget(f"target {raw!r} is empty or contains whitespace")
    if kind == "tcp":
        host, sep, port = raw.rpartition(":")
        host = host.strip("[]") if host.startswith("[") else host
        if not sep or not host or "/" in raw:
            raise BadTarget(f"target {raw!r} must be HOST:PORT for a tcp module")
        return ProbeTarget(raw, "tcp", host.lower(), _port(port, raw))
    url = raw if "://" in raw else "http://" + raw
    try:
        parts = urlsplit(url)
        url_port = parts.port
    except ValueError as exc:
        raise BadTarget(f"target {raw!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise BadTarget(f"target {raw!r}: scheme must be http or https, got {parts.scheme!r}")
    if parts.username is not None or parts.password is not None:
        # Credentials in a target end up in Prometheus labels; use header_files instead.
        raise BadTarget(f"target {raw!r}: credentials in the URL are refused "
                        "(put them in the module's header_files)")
    if not parts.hostname:
        raise BadTarget(f"target {raw!r} has no host")
    default = 443 if parts.scheme == "https" else 80
    return ProbeTarget(raw, parts.scheme, parts.hostname.lower(), url_port or default,
                  parts.path, parts.query)


@dataclass(frozen=True)
class Address:
    """One resolved address to connect to."""

    family: int
    ip: IPAddress
    port: int

    @property
    def sockaddr(self) -> tuple[str, int]:
        return (str(self.ip), self.port)


def _normalise(ip: IPAddress) -> IPAddress:
    # ::ffff:10.0.0.5 must be judged as 10.0.0.5.
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def resolve(host: str, port: int, timeout: float) -> list[Address]:
    """Addresses of ``host`` (an IP literal needs no lookup); ResolveError on failure."""
    try:
        literal = _normalise(ipaddress.ip_address(host))
    except ValueError:
        pass
    else:
        family = socket.AF_INET if literal.version == 4 else socket.AF_INET6
        return [Address(family, literal, port)]
    future = _RESOLVER.submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
    try:
        infos = future.result(timeout=max(timeout, 0.001))
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise ResolveError(f"resolving {host!r} took longer than {timeout:.3g}s") from None
    except socket.gaierror as exc:
        raise ResolveError(f"cannot resolve {host!r}: {exc.strerror}") from None
    except OSError as exc:
        raise ResolveError(f"cannot resolve {host!r}: {exc}") from None
    addresses: list[Address] = []
    for family, _, _, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue  # type: ignore[unreachable]  # typeshed types it as always inet
        address = Address(int(family), _normalise(ipaddress.ip_address(sockaddr[0])), port)
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise ResolveError(f"{host!r} has no IPv4 or IPv6 address")
    return addresses


@dataclass(frozen=True)
class AllowList:
    """Which targets may be probed.

    ``hosts`` are name patterns (``chat.internal``, ``*.svc.cluster.local``) the
    operator vouches for, whatever they resolve to; ``networks`` and ``loopback``
    are judged on resolved addresses; ``ports``, when given, restricts every target.
    """

    loopback: bool = True
    hosts: tuple[str, ...] = ()
    networks: tuple[IPNetwork, ...] = ()
    ports: tuple[int, ...] = ()
    _patterns: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_patterns", tuple(h.lower() for h in self.hosts))

    def host_allowed(self, host: str) -> bool:
        return any(fnmatch.fnmatchcase(host.lower(), p) for p in self._patterns)

    def address_allowed(self, ip: IPAddress) -> bool:
        if self.loopback and ip.is_loopback:
            return True
        return any(ip.version == net.version and ip in net for net in self.networks)

    def filter(self, target: ProbeTarget, addresses: list[Address]) -> list[Address]:
        """The addresses the probe may connect to; NotAllowed when there is none."""
        if self.ports and target.port not in self.ports:
            raise NotAllowed(f"port {target.port} is not in allow.ports "
                             f"({', '.join(map(str, self.ports))})")
        if self.host_allowed(target.host):
            return addresses
        allowed = [a for a in addresses if self.address_allowed(a.ip)]
        if not allowed:
            shown = ", ".join(str(a.ip) for a in addresses[:4])
            raise NotAllowed(f"target host {target.host!r} resolves to {shown}, which is "
                             "outside the allow list (allow.loopback, allow.networks, "
                             "allow.hosts)")
        return allowed
