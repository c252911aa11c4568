"""Heartbeat pings (the tutorial's STEP_HEARTBEAT_URL, CHECKPOINT_HEARTBEAT_URL), off the hot path.

The tutorial pinged from the training loop with a 5 s timeout: a slow
heartbeat service slowed training, an unreachable one stalled it for seconds
per ping. Here one daemon thread sends every ping:

* step pings are scheduled by the sender itself, which watches the step counter
  (after the first step, then every ``every`` steps): the training loop does
  nothing at all for them, not even a queue put;
* checkpoint pings arrive through a bounded queue; when it is full (the service
  hangs and pings pile up) new ones are dropped and counted, never waited for.

Every request has connect and read timeouts. Results are counted per
heartbeat (``success``, ``failure``, ``dropped``). A URL's path and query carry
the service's token, so logs only ever show ``scheme://host/…``, and the pings go
out as the bridge's do (colossalai_exporter/outbound.py): no proxy or ``.netrc``
from the environment, no redirect followed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import requests

from colossalai_exporter import outbound
from colossalai_exporter.rankstate.schema import HeartbeatState
from colossalai_exporter.training.state import RankState

log = logging.getLogger("colossalai_exporter.training")

STEP, CHECKPOINT = "step", "checkpoint"
QUEUE_SIZE = 8


def redact(url: str) -> str:
    """``https://vigilmon.online/api/heartbeat/<token>`` -> ``https://vigilmon.online/…``."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<unparsable URL>"
    return f"{parts.scheme or '?'}://{host}{port}/…"


def check_url(url: str | None, name: str) -> str | None:
    """``url`` if it is a usable http(s) URL; otherwise None and one warning (no token)."""
    if not url:
        return None
    try:
        parts = urlsplit(url)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
        _ = parts.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError:
        valid = False
    if not valid:
        log.warning("heartbeat URL %s is not an http(s) URL with a host; %s heartbeat "
                    "disabled", redact(url), name, extra={"heartbeat": name})
        return None
    return url


def _reason(exc: requests.RequestException) -> str:
    # The project's fixed failure reasons; the exception text may carry the URL.
    if isinstance(exc, requests.Timeout):
        return "timeout"
    if isinstance(exc, requests.exceptions.SSLError):
        return "tls"
    if isinstance(exc, requests.ConnectionError):
        text = str(exc).lower()
        if "name or service" in text or "resolve" in text or "nodename" in text:
            return "dns"
        return "refused"
    return "error"


class HeartbeatSender:
    """The background sender; ``start()``, ``checkpoint_done()``, ``stop()``."""

    def __init__(self, state: RankState, step_url: str | None, checkpoint_url: str | None,
                 *, every: int = 50, timeout: float = 5.0, connect_timeout: float = 2.0,
                 poll_interval: float = 0.2,
                 on_error: Callable[[str, BaseException | str], None] | None = None) -> None:
        self._state = state
        self._urls = {STEP: check_url(step_url, STEP),
                      CHECKPOINT: check_url(checkpoint_url, CHECKPOINT)}
        self._every = max(1, int(every))
        self._timeout = (connect_timeout, timeout)
        self._poll = poll_interval
        self._queue: queue.Queue[str] = queue.Queue(QUEUE_SIZE)
        self._stop = threading.Event()
        self._next_step_ping = 1
        self._on_error = on_error
        self._thread: threading.Thread | None = None
        self._session = outbound.session()  # no proxies or .netrc from the environment
        for name, url in self._urls.items():
            if url:
                state.heartbeats[name] = HeartbeatState()

    @property
    def enabled(self) -> bool:
        return any(self._urls.values())

    def start(self) -> None:
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="colossalai-heartbeat",
                                        daemon=True)
        self._thread.start()

    def checkpoint_done(self) -> None:
        """Queue a checkpoint ping; never blocks (a full queue drops and counts it)."""
        if not self._urls[CHECKPOINT]:
            return
        try:
            self._queue.put_nowait(CHECKPOINT)
        except queue.Full:
            self._count(CHECKPOINT, "dropped")

    def stop(self, timeout: float = 1.0) -> None:
        """Stop the thread; a ping in flight is abandoned (the thread is a daemon)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._session.close()

    def _count(self, name: str, result: str) -> None:
        stats = self._state.heartbeats[name]
        setattr(stats, result, getattr(stats, result) + 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                name = self._queue.get(timeout=self._poll)
            except queue.Empty:
                name = None
            if name is not None:
                self._send(name)
            steps = self._state.steps
            if self._urls[STEP] and steps >= self._next_step_ping:
                # Several multiples crossed while a send hung make one ping: it says
                # "steps are completing", and a burst would be rate-limited anyway.
                self._next_step_ping = (steps // self._every + 1) * self._every
                self._send(STEP)

    def _send(self, name: str) -> None:
        url = self._urls[name]
        if not url or self._stop.is_set():
            return
        stats = self._state.heartbeats[name]
        stats.last_attempt = time.time()
        try:
            # A redirect is a failure, not followed: it would carry the token elsewhere.
            response = self._session.get(url, timeout=self._timeout, allow_redirects=False)
            response.close()
        except requests.RequestException as exc:
            self._count(name, "failure")
            log.warning("%s heartbeat to %s failed: %s (%s)", name, redact(url), _reason(exc),
                        type(exc).__name__, extra={"heartbeat": name})
            return
        except Exception as exc:  # never let the sender thread die
            self._count(name, "failure")
            if self._on_error is not None:
                self._on_error("heartbeat", exc)
            return
        if 200 <= response.status_code < 300:
            self._count(name, "success")
            stats.last_success = time.time()
        else:
            self._count(name, "failure")
            log.warning("%s heartbeat to %s answered HTTP %d", name, redact(url),
                        response.status_code, extra={"heartbeat": name})
