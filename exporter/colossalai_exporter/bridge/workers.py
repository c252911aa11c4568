"""Delivery workers: one thread per heartbeat or webhook target, draining its outbox.

Why hand-written retries instead of a retry library (tenacity, backoff,
urllib3's Retry): the retry state must live in the database — the next
attempt time survives a restart, and a failing target must not hold a thread
in a sleep loop that SIGTERM cannot interrupt — while those libraries keep
it in a Python call stack. The schedule itself is a few lines
(:func:`backoff_delay`).

Per target, deliveries go out oldest first; a delivery waiting for its retry
holds back the ones behind it, so a target that comes back receives
everything in order of arrival. A failing target never delays another.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable

from colossalai_exporter.bridge import payload, signing
from colossalai_exporter.bridge.alertmanager import PayloadError, parse_notification
from colossalai_exporter.bridge.config import RetryPolicy, Target
from colossalai_exporter.bridge.metrics import BridgeStats
from colossalai_exporter.bridge.sender import SendResult, endpoint_session, send
from colossalai_exporter.bridge.store import Delivery, Store, StoreError

log = logging.getLogger(__name__)
IDLE_POLL_SECONDS = 1.0  # also how soon `bridge outbox retry` from another process is seen


def backoff_delay(attempt: int, settings: RetryPolicy,
                  rand: Callable[[], float] = random.random) -> float:
    """Exponential backoff with "equal jitter": half fixed, half random.

    The fixed half keeps retries from hammering a target that just failed; the
    random half spreads out bridges (or targets) that failed at the same moment.
    """
    base = min(settings.max_backoff, settings.initial_backoff * 2 ** max(0, attempt - 1))
    return float(base / 2 + rand() * base / 2)


def message_id(delivery: Delivery, body: bytes) -> str:
    """Stable across retries of one delivery, different for every target and notification."""
    digest = hashlib.sha256(f"{delivery.notification_id}:{delivery.target}:".encode() + body)
    return "msg_" + digest.hexdigest()[:32]


class TargetWorker:
    """Drains one target's outbox until stopped."""

    def __init__(self, target: Target, store: Store, settings: RetryPolicy,
                 stats: BridgeStats, clock: Callable[[], float] = time.time) -> None:
        self.target = target
        self._store = store
        self._settings = settings
        self._stats = stats
        self._clock = clock
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._session = endpoint_session(target.endpoint)
        # The fail URL's own session: the adapter holding server_name and min_version,
        # and the insecure_skip_verify warning filter, are per session and host.
        fail = target.fail_endpoint
        self._fail_session = self._session if fail is None else endpoint_session(fail)
        self._last_attempt: float | None = None
        # True while the worker looks for or waits for work: only then can a new
        # delivery change what it does next (see wake()).
        self._idle = True
        self._thread = threading.Thread(target=self._run, name=f"deliver-{target.name}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """A delivery for this target was committed.

        Only an idle worker needs waking. A webhook worker that is sending, or
        waiting for its oldest delivery's retry, would find that same delivery
        first: new ones queue behind it. Waking it anyway made every group commit
        cost each worker an outbox query, which under load took the GIL from the
        event loop about a fifth of the time (bench/RESULTS.md). A heartbeat's new
        ping replaces the pending one, so a heartbeat worker is always woken.
        """
        if self._idle or self.target.kind == "heartbeat":
            self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        self._session.close()
        self._fail_session.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self.step()
            except StoreError as exc:
                log.error("outbox unavailable", extra={"target": self.target.name,
                                                       "err": str(exc)})
                wait = IDLE_POLL_SECONDS
            except Exception:
                # A bug must not end the thread: the target's deliveries would wait in
                # the outbox, unsent, with nothing but a growing queue to say so.
                log.exception("delivery worker failed; retrying",
                              extra={"target": self.target.name})
                self._stats.add_delivery(self.target.name, "error")
                wait = IDLE_POLL_SECONDS
            if wait > 0:
                self._wake.wait(min(wait, IDLE_POLL_SECONDS))
                self._wake.clear()

    def step(self) -> float:
        """Deliver at most one; return how long to wait before the next step."""
        target = self.target
        # Idle from before the query: a commit that lands after the query has read
        # the outbox then wakes the worker instead of waiting for the next poll.
        self._idle = True
        delivery = self._store.next_delivery(target.name)
        if delivery is None:
            return IDLE_POLL_SECONDS
        self._idle = False
        now = self._clock()
        if target.kind == "heartbeat":
            if now - delivery.created_at > target.ttl:
                # A late ping would tell Vigilmon all is well for a moment that has passed.
                self._store.drop(delivery)
                self._stats.add_dropped(target.name, "expired")
                log.warning("heartbeat ping expired unsent", extra={
                    "target": target.name, "age": round(now - delivery.created_at, 3)})
                return 0
            if self._last_attempt is not None and target.min_interval > 0:
                ready = self._last_attempt + target.min_interval
                if now < ready:
                    return ready - now
        if delivery.next_attempt_at > now:
            return delivery.next_attempt_at - now
        if target.kind == "webhook" and now - delivery.created_at > target.max_age:
            self._give_up(delivery, delivery.last_error or "max_age reached", now)
            return 0
        result = self._send(delivery)
        self._last_attempt = now
        self._stats.add_delivery(target.name, result.result)
        if result.ok:
            self._store.delivered(delivery, self._clock())
            log.debug("delivered", extra={"target": target.name, "delivery": delivery.id})
            return 0
        retry_after = result.retry_after
        if retry_after is not None:
            delay = min(retry_after, self._settings.max_retry_after)
        else:
            delay = backoff_delay(delivery.attempts + 1, self._settings)
        log.warning("delivery failed", extra={"target": target.name, "delivery": delivery.id,
                                              "err": result.error, "retry_in": round(delay, 3)})
        if target.kind == "webhook" and now + delay - delivery.created_at > target.max_age:
            self._give_up(delivery, result.error, now)
        else:
            self._store.failed(delivery, result.error, now + delay, now)
        return 0

    def _give_up(self, delivery: Delivery, error: str, now: float) -> None:
        self._store.dead_letter(delivery, error, now)
        self._stats.add_dead_letter(self.target.name)
        log.error("delivery moved to dead letters", extra={"target": self.target.name,
                                                           "delivery": delivery.id, "err": error})

    def _send(self, delivery: Delivery) -> SendResult:
        target = self.target
        if delivery.kind == "fail" and target.fail_endpoint is not None:
            return send(self._fail_session, target.fail_endpoint)
        if target.kind == "heartbeat":
            return send(self._session, target.endpoint)
        raw = self._store.notification_body(delivery.notification_id)
        if raw is None:
            return SendResult("error", error="notification body missing from the store")
        if target.body == "alertmanager":
            body = raw
            mid = message_id(delivery, raw)
        else:
            try:
                notification = parse_notification(raw)
            except PayloadError as exc:  # stored bodies were valid; a schema change is a bug
                return SendResult("error", error=f"stored notification unreadable: {exc}")
            mid = message_id(delivery, raw)
            body = payload.encode(payload.stable_body(notification, mid))
        headers = {}
        if target.signing_secret is not None:
            headers = signing.headers(target.signing_secret, mid, int(self._clock()), body)
        return send(self._session, target.endpoint, body, headers)


