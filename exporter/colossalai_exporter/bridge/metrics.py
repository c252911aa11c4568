"""The bridge's own metrics: in-process counters plus gauges read from the store at scrape.

Queue depth, oldest pending age, dead letters and last success come from the
database, so they are right after a restart and reflect ``bridge outbox``
commands run from another process.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from colossalai_exporter import catalogue
from colossalai_exporter.bridge.alertmanager import PAYLOAD_REASONS
from colossalai_exporter.bridge.config import Target
from colossalai_exporter.bridge.sender import RESULTS
from colossalai_exporter.bridge.store import Store, StoreError

# Every reason a notification can be refused for (label values pre-created at 0).
# bad_request and head_too_large are refused by the HTTP layer, before a path is
# known: they count requests to any path of the bridge.
REFUSED_NOTIFICATION_REASONS = (
    "bad_request", "head_too_large", "unauthorized", "unsupported_media_type", "too_large",
    "body_timeout", "method_not_allowed", "store_unavailable", *PAYLOAD_REASONS)
DROP_REASONS = ("superseded", "expired")


class BridgeStats:
    """Thread-safe counters the routes and workers bump."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.received = 0
        self.rejected: Counter[str] = Counter()
        self.deliveries: Counter[tuple[str, str]] = Counter()
        self.dead_letters: Counter[str] = Counter()
        self.deduplicated: Counter[str] = Counter()
        self.dropped: Counter[tuple[str, str]] = Counter()

    def add_received(self) -> None:
        with self._lock:
            self.received += 1

    def add_rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason if reason in REFUSED_NOTIFICATION_REASONS else "other"] += 1

    def add_delivery(self, target: str, result: str) -> None:
        with self._lock:
            self.deliveries[target, result] += 1

    def add_dead_letter(self, target: str) -> None:
        with self._lock:
            self.dead_letters[target] += 1

    def add_deduplicated(self, target: str) -> None:
        with self._lock:
            self.deduplicated[target] += 1

    def add_dropped(self, target: str, reason: str, count: int = 1) -> None:
        with self._lock:
            self.dropped[target, reason] += count



class BridgeCollector(Collector):
    def __init__(self, stats: BridgeStats, store: Store, targets: Sequence[Target],
                 clock: Callable[[], float] = time.time) -> None:
        self._stats = stats
        self._store = store
        self._targets = tuple(targets)
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        names = [t.name for t in self._targets]
        with stats._lock:
            received = stats.received
            rejected = dict(stats.rejected)
            deliveries = dict(stats.deliveries)
            dead = dict(stats.dead_letters)
            dedup = dict(stats.deduplicated)
            dropped = dict(stats.dropped)
        fam = catalogue.counter("colossalai_bridge_notifications_received_total")
        fam.add_metric([], received)
        yield fam
        fam = catalogue.counter("colossalai_bridge_notifications_rejected_total")
        for reason in sorted(set(REFUSED_NOTIFICATION_REASONS) | set(rejected)):
            fam.add_metric([reason], rejected.get(reason, 0))
        yield fam
        fam = catalogue.counter("colossalai_bridge_deliveries_total")
        for name in names:
            for result in RESULTS:
                fam.add_metric([name, result], deliveries.get((name, result), 0))
        yield fam
        fam = catalogue.counter("colossalai_bridge_dead_letters_total")
        for name in names:
            fam.add_metric([name], dead.get(name, 0))
        yield fam
        fam = catalogue.counter("colossalai_bridge_deduplicated_total")
        for target in self._targets:
            if target.kind == "webhook":
                fam.add_metric([target.name], dedup.get(target.name, 0))
        yield fam
        fam = catalogue.counter("colossalai_bridge_heartbeat_pings_dropped_total")
        for target in self._targets:
            if target.kind == "heartbeat":
                for reason in DROP_REASONS:
                    fam.add_metric([target.name, reason], dropped.get((target.name, reason), 0))
        yield fam
        writable, _ = self._store.writable()
        gfam = catalogue.gauge("colossalai_bridge_store_writable")
        gfam.add_metric([], 1.0 if writable else 0.0)
        yield gfam
        yield from self._store_gauges(names)

    def _store_gauges(self, names: Sequence[str]) -> Iterator[Metric]:
        try:
            queues = self._store.queue_stats()
            dead_now = self._store.dead_letter_counts()
            successes = self._store.last_successes()
            firing = {t.name: len(self._store.firing(t.name))
                      for t in self._targets if t.kind == "health_heartbeat"}
        except StoreError:
            return  # the store gauges drop out; store_writable says why
        now = self._clock()
        depth = catalogue.gauge("colossalai_bridge_queue_depth")
        oldest = catalogue.gauge("colossalai_bridge_oldest_pending_age_seconds")
        for name in names:
            queue = queues.get(name)
            depth.add_metric([name], queue.depth if queue else 0)
            age = now - queue.oldest_created_at if queue and queue.oldest_created_at else 0.0
            oldest.add_metric([name], max(0.0, age))
        yield depth
        yield oldest
        gfam = catalogue.gauge("colossalai_bridge_dead_letters")
        for name in names:
            gfam.add_metric([name], dead_now.get(name, 0))
        yield gfam
        gfam = catalogue.gauge("colossalai_bridge_last_success_timestamp_seconds")
        for name in names:
            if name in successes:
                gfam.add_metric([name], successes[name])
        yield gfam
        gfam = catalogue.gauge("colossalai_bridge_health_heartbeat_firing_alerts")
        for name, count in firing.items():
            gfam.add_metric([name], count)
        yield gfam
