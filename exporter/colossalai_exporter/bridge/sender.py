"""Outbound HTTP with ``requests``: one request, a deadline, a classified result.

Redirects are not followed and sessions ignore the environment (proxies, .netrc),
for the reasons colossalai_exporter/outbound.py gives: a heartbeat token or a
signed body must go only where the config says. The one thing the environment
could usefully give, a CA bundle (``REQUESTS_CA_BUNDLE``), comes from the
target's ``tls`` block instead, with client certificates: ``verify=`` and
``cert=`` on every request, and an adapter for what requests has no argument
for (``server_name``, ``min_version``).
Error texts never include the URL (requests puts it in exception messages,
and heartbeat URLs carry their token).
"""

from __future__ import annotations

import email.utils
import re
import ssl
import time
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests
import urllib3
from requests.adapters import DEFAULT_POOLBLOCK, HTTPAdapter

from colossalai_exporter import outbound
from colossalai_exporter.bridge.config import HttpCall, TLSSettings
from colossalai_exporter.configfile import TLS_VERSIONS, ssl_error_text
from colossalai_exporter.version import __version__

# Values of the ``result`` label of colossalai_bridge_deliveries_total.
RESULTS = ("success", "status", "timeout", "connection", "tls", "error")
DEFAULT_TLS = TLSSettings()
USER_AGENT = f"colossalai-exporter-bridge/{__version__}"


@dataclass(frozen=True)
class SendResult:
    result: str
    status: int | None = None
    retry_after: float | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.result == "success"


class _TLSAdapter(HTTPAdapter):
    """HTTPS with the tls block's ``server_name`` and ``min_version``.

    They go into the pool manager's keyword arguments, which urllib3 applies
    to every HTTPS connection: ``server_hostname`` is sent as SNI and is the
    name the certificate must match, in place of the URL's host.
    """

    def __init__(self, tls: TLSSettings) -> None:
        self._tls = tls  # before super().__init__, which calls init_poolmanager
        super().__init__()

    def init_poolmanager(self, connections: int, maxsize: int,
                         block: bool = DEFAULT_POOLBLOCK, **pool_kwargs: Any) -> None:
        if self._tls.server_name:
            pool_kwargs["server_hostname"] = self._tls.server_name
        if self._tls.min_version:
            pool_kwargs["ssl_minimum_version"] = TLS_VERSIONS[self._tls.min_version]
        super().init_poolmanager(connections, maxsize, block, **pool_kwargs)


def new_session(tls: TLSSettings | None = None, host: str | None = None) -> requests.Session:
    """A session that sends only where and what the config says.

    ``trust_env = False``: no proxies, ``.netrc`` credentials or CA bundle from
    environment variables or the home directory. ``tls`` (an endpoint's block)
    sets what cannot be given per request; :func:`send` gives the rest.
    ``host`` is the endpoint's host, for the warning filter below.
    """
    session = outbound.session()
    if tls is not None and (tls.server_name or tls.min_version):
        session.mount("https://", _TLSAdapter(tls))
    if tls is not None and tls.insecure_skip_verify and host:
        # urllib3 warns on every unverified request; the config asked for it for this
        # host, and `bridge check` and the start-up log already say so once. The
        # filter is for this host's warning only (warnings filters are per process,
        # and catch_warnings is not thread-safe): an unverified request anywhere else
        # in the process still warns.
        warnings.filterwarnings("ignore", category=urllib3.exceptions.InsecureRequestWarning,
                                message=insecure_warning_pattern(host))
    return session


def endpoint_session(endpoint: HttpCall) -> requests.Session:
    """:func:`new_session` for one endpoint's TLS block and host."""
    return new_session(endpoint.tls, urlsplit(endpoint.url).hostname)


def insecure_warning_pattern(host: str) -> str:
    """The start of urllib3's InsecureRequestWarning for ``host`` (its own wording)."""
    bare = host.strip("[]")
    return rf"Unverified HTTPS request is being made to host '\[?{re.escape(bare)}\]?'"



def _tls_failure(exc: BaseException) -> str:
    """What OpenSSL said, found in the chain of exceptions requests and urllib3 wrap it
    in; their own messages hold the URL (and so a heartbeat's token)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError) and current.verify_message:
            return f"certificate verify failed: {current.verify_message}"
        if isinstance(current, ssl.SSLError):
            return ssl_error_text(current)
        linked = (current.__cause__, current.__context__, getattr(current, "reason", None),
                  *current.args)
        todo.extend(e for e in linked if isinstance(e, BaseException))
    return type(exc).__name__


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def send(session: requests.Session, endpoint: HttpCall, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> SendResult:
    all_headers = {"User-Agent": USER_AGENT, **dict(endpoint.headers), **(headers or {})}
    if body is not None:
        all_headers.setdefault("Content-Type", "application/json")
    tls = endpoint.tls or DEFAULT_TLS
    try:
        response = session.request(endpoint.method, endpoint.url, data=body,
                                   headers=all_headers, timeout=endpoint.timeout,
                                   allow_redirects=False, verify=tls.verify, cert=tls.cert)
        response.close()
    except requests.Timeout:
        return SendResult("timeout", error=f"no answer within {endpoint.timeout:g}s")
    except requests.exceptions.SSLError as exc:  # before ConnectionError, its base class
        return SendResult("tls", error=f"TLS failed ({_tls_failure(exc)})")
    except requests.ConnectionError as exc:
        return SendResult("connection", error=f"connection failed ({type(exc).__name__})")
    except requests.RequestException as exc:
        return SendResult("error", error=f"request failed ({type(exc).__name__})")
    except OSError as exc:
        # Outside requests' own exceptions: raised before connecting when a ca_file,
        # cert_file or key_file that `bridge check` saw has gone since.
        return SendResult("tls", error="a ca_file, cert_file or key_file of the config "
                                       f"is missing ({type(exc).__name__})")
    if response.status_code in endpoint.success_codes:
        return SendResult("success", response.status_code)
    retry_after = None
    if response.status_code in (429, 503):
        retry_after = parse_retry_after(response.headers.get("Retry-After"))
    return SendResult("status", response.status_code, retry_after,
                      f"HTTP {response.status_code}")
