"""Outbound HTTP with ``requests``: one request, a deadline, a classified result.

Redirects are not followed: a redirect would send the request — and a
heartbeat token or a signed body — to an address the config never named.
For the same reason sessions ignore the environment (:func:`new_session`):
``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` would route every request,
token in the URL, through a host the config does not name, and ``~/.netrc``
would add credentials the config does not hold.
Error texts never include the URL (requests puts it in exception messages,
and heartbeat URLs carry their token).
"""

from __future__ import annotations

import email.utils
import time
from dataclasses import dataclass

import requests

from colossalai_exporter.bridge.config import Endpoint
from colossalai_exporter.version import __version__

# Values of the ``result`` label of colossalai_bridge_deliveries_total.
RESULTS = ("success", "status", "timeout", "connection", "error")
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


def new_session() -> requests.Session:
    """A session that sends only where and what the config says.

    ``trust_env = False``: no proxies, ``.netrc`` credentials or CA bundle from
    environment variables or the home directory.
    """
    session = requests.Session()
    session.trust_env = False
    return session


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


def send(session: requests.Session, endpoint: Endpoint, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> SendResult:
    all_headers = {"User-Agent": USER_AGENT, **dict(endpoint.headers), **(headers or {})}
    if body is not None:
        all_headers.setdefault("Content-Type", "application/json")
    try:
        response = session.request(endpoint.method, endpoint.url, data=body,
                                   headers=all_headers, timeout=endpoint.timeout,
                                   allow_redirects=False)
        response.close()
    except requests.Timeout:
        return SendResult("timeout", error=f"no answer within {endpoint.timeout:g}s")
    except requests.ConnectionError as exc:
        return SendResult("connection", error=f"connection failed ({type(exc).__name__})")
    except requests.RequestException as exc:
        return SendResult("error", error=f"request failed ({type(exc).__name__})")
    if response.status_code in endpoint.success_codes:
        return SendResult("success", response.status_code)
    retry_after = None
    if response.status_code in (429, 503):
        retry_after = parse_retry_after(response.headers.get("Retry-After"))
    return SendResult("status", response.status_code, retry_after,
                      f"HTTP {response.status_code}")
