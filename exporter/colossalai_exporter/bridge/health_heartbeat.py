"""Health heartbeats: ping on a schedule while no alert matching the selector fires.

The design (docs/bridge.md has the long version):

* State is the set of matching alerts currently firing, per target, in the
  store's ``firing`` table, keyed by fingerprint, updated in the same
  transaction that stores the notification. A restart keeps it, so a bridge
  restarted during an outage keeps the heartbeat paused.
* A resolved notification removes the alert. A firing alert that is not
  re-notified within ``alert_ttl`` is forgotten: Alertmanager re-sends firing
  alerts every ``repeat_interval``, so silence means the alert ended and its
  resolve was lost (or ``send_resolved`` is off). ``alert_ttl`` must exceed
  ``repeat_interval + group_interval``.
* Pings are not queued: a missed scheduled ping is not worth sending late, the
  next one is due one interval later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from colossalai_exporter.bridge.config import Target
from colossalai_exporter.bridge.metrics import BridgeStats
from colossalai_exporter.bridge.sender import endpoint_session, send
from colossalai_exporter.bridge.store import Store, StoreError

log = logging.getLogger(__name__)


class HealthHeartbeat:
    def __init__(self, target: Target, store: Store, stats: BridgeStats,
                 clock: Callable[[], float] = time.time) -> None:
        self.target = target
        self._store = store
        self._stats = stats
        self._clock = clock
        self._stop = threading.Event()
        self._session = endpoint_session(target.endpoint)
        self.last_paused: float | None = None  # the last tick that found it paused
        self._paused = False
        self._thread = threading.Thread(target=self._run, name=f"health-{target.name}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Nothing to do: the state is read at the next tick."""

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        self._session.close()

    def tick(self) -> bool | None:
        """One scheduled step: True pinged ok, False ping failed, None paused."""
        target = self.target
        now = self._clock()
        firing = self._store.firing(target.name, now, target.alert_ttl)
        if firing:
            if not self._paused:  # log the change, not every tick while it lasts
                log.info("health heartbeat paused", extra={"target": target.name,
                                                           "firing": len(firing)})
            self._paused = True
            self.last_paused = now
            return None
        if self._paused:
            log.info("health heartbeat resumed", extra={"target": target.name})
            self._paused = False
        result = send(self._session, target.endpoint)
        self._stats.add_delivery(target.name, result.result)
        if result.ok:
            self._store.record_success(target.name, self._clock())
            return True
        self._store.record_attempt(target.name, self._clock())
        log.warning("health heartbeat ping failed", extra={"target": target.name,
                                                           "err": result.error})
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self._clock()
            try:
                self.tick()
            except StoreError as exc:
                log.error("state unavailable", extra={"target": self.target.name,
                                                      "err": str(exc)})
            except Exception:
                # As for delivery workers: a bug must not stop the schedule for good.
                log.exception("health heartbeat failed; retrying",
                              extra={"target": self.target.name})
            elapsed = self._clock() - started
            self._stop.wait(max(0.0, self.target.interval - elapsed))
