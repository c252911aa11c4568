"""From a parsed notification to what must be stored: deliveries and firing-state updates.

Pure functions: which targets a notification goes to, and the deduplication
key. The store applies the result in the same transaction that stores the
notification, so a 200 means both the body and its deliveries are on disk.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from colossalai_exporter.bridge.alertmanager import Alert, Notification
from colossalai_exporter.bridge.config import Target
from colossalai_exporter.bridge.store import Enqueue, FiringUpdate

# Built once: json.dumps(..., separators=...) constructs a new encoder on every call.
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def alert_fingerprint(alert: Alert) -> str:
    """Alertmanager's fingerprint, or a hash of the labels when a sender left it out."""
    if alert.fingerprint:
        return alert.fingerprint
    canonical = json.dumps(alert.labels, sort_keys=True, separators=(",", ":"))
    return "labels:" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


def dedup_key(notification: Notification) -> str:
    """Same group, same status, same alerts (fingerprint, status, start): same notification.

    HA Alertmanagers each send the group; a restarted one re-sends it. Both
    produce this same key, while a new alert in the group, a resolve or a
    re-fired alert (new startsAt) produces a new one.
    """
    alerts = sorted([(a.fingerprint or alert_fingerprint(a), a.status, a.starts_at)
                     for a in notification.alerts])
    canonical = _COMPACT.encode([notification.group_key, notification.status, alerts])
    return hashlib.sha256(canonical.encode()).hexdigest()


def plan(notification: Notification,
         targets: Sequence[Target]) -> tuple[list[Enqueue], list[FiringUpdate]]:
    """The deliveries and health-heartbeat state changes one notification causes."""
    enqueues: list[Enqueue] = []
    updates: list[FiringUpdate] = []
    key: str | None = None
    for target in targets:
        matches = target.matches
        matching = [a for a in notification.alerts if matches(a.labels)]
        if not matching:
            continue
        if target.kind == "heartbeat":
            # Never deduplicated: each firing notification is one ping.
            if any(a.status == "firing" for a in matching):
                enqueues.append(Enqueue(target.name, "ping", newest_only=True))
            elif target.fail_endpoint is not None:
                enqueues.append(Enqueue(target.name, "fail", newest_only=True))
        elif target.kind == "health_heartbeat":
            updates.extend(
                FiringUpdate(target.name, alert_fingerprint(a),
                             json.dumps(a.labels, sort_keys=True), a.status == "firing")
                for a in matching)
        else:
            key = key or dedup_key(notification)
            enqueues.append(Enqueue(target.name, "webhook", dedup_key=key,
                                    dedup_window=target.dedup_window))
    return enqueues, updates
