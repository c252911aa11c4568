"""The stable JSON body webhook targets receive (``body: stable``, the default).

Alertmanager's own body changes between versions (``notification_reason``
and ``routeLabels`` arrived late); this one is versioned by ``schema`` and
only grows: fields are added, never renamed or removed. ``body: alertmanager``
forwards Alertmanager's body unchanged instead. Documented in docs/bridge.md.
"""

from __future__ import annotations

import json
from typing import Any

from colossalai_exporter.bridge.alertmanager import Notification

SCHEMA = "colossalai-exporter.bridge.notification/v1"


def stable_body(notification: Notification, message_id: str) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "id": message_id,
        "status": notification.status,
        "receiver": notification.receiver,
        "group_key": notification.group_key,
        "group_labels": notification.group_labels,
        "common_labels": notification.common_labels,
        "common_annotations": notification.common_annotations,
        "external_url": notification.external_url,
        "truncated_alerts": notification.truncated_alerts,
        "alerts": [
            {
                "status": a.status,
                "labels": a.labels,
                "annotations": a.annotations,
                "starts_at": a.starts_at,
                "ends_at": a.ends_at,
                "generator_url": a.generator_url,
                "fingerprint": a.fingerprint,
            }
            for a in notification.alerts
        ],
    }


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
