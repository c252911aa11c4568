"""Alertmanager-shaped webhook bodies (version 4) for the bridge tests.

Field for field what Alertmanager 0.25's notify/webhook sends, including the
regex-escaped receiver and the zero endsAt of a firing alert.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

ZERO_TIME = "0001-01-01T00:00:00Z"


def alert(alertname: str = "Watchdog", status: str = "firing",
          starts_at: str = "2024-05-01T10:00:00.000Z", **labels: str) -> dict[str, Any]:
    all_labels = {"alertname": alertname, **labels}
    fingerprint = hashlib.sha256(json.dumps(all_labels, sort_keys=True).encode()).hexdigest()
    return {
        "status": status,
        "labels": all_labels,
        "annotations": {"summary": f"{alertname} is {status}"},
        "startsAt": starts_at,
        "endsAt": ZERO_TIME if status == "firing" else "2024-05-01T10:05:00.000Z",
        "generatorURL": "http://prometheus:9090/graph?g0.expr=vector%281%29",
        "fingerprint": fingerprint[:16],
    }


def notification(*alerts: dict[str, Any], group_key: str | None = None,
                 receiver: str = "colossalai\\.bridge") -> dict[str, Any]:
    alerts = alerts or (alert(),)
    status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
    names = sorted({a["labels"]["alertname"] for a in alerts})
    common = {k: v for k, v in alerts[0]["labels"].items()
              if all(a["labels"].get(k) == v for a in alerts)}
    return {
        "version": "4",
        "groupKey": group_key or f'{{}}:{{alertname="{names[0]}"}}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": receiver,
        "groupLabels": {"alertname": names[0]},
        "commonLabels": common,
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": list(alerts),
    }


def body(*alerts: dict[str, Any], **kwargs: Any) -> bytes:
    return json.dumps(notification(*alerts, **kwargs)).encode()
