"""Alertmanager webhook payloads (version 4) parsed into typed objects.

A pure function, kept apart from the HTTP route so that it can be tested on
its own and so that the route only maps :class:`PayloadError` to a 400. The
format is Alertmanager's ``notify/webhook`` ``Message``; unknown extra keys
(``notification_reason``, ``routeLabels`` in newer versions) are accepted and
ignored here (the body is stored and forwarded as received), because refusing
them would make Alertmanager retry a body that will never become valid.

Two paths, one result. A body is first decoded by msgspec straight into the
:class:`Notification` and :class:`Alert` structs, which checks every type in
the same pass over the bytes: about 11 µs for a typical 4.4 KB notification,
against 46 µs for ``json.loads`` plus checks in Python (bench/RESULTS.md),
and parsing is most of the bridge's own work per notification. Whatever that
decoder refuses (and a version other than 4) goes through the second path,
``json.loads`` and one check per field, which accepts what the first cannot
(``null`` for an optional field, a lone surrogate escape) and otherwise finds
the problem and names it: the reason and message of every 400 come from it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, cast

import msgspec

SUPPORTED_VERSION = "4"
STATUSES = ("firing", "resolved")
Status = Literal["firing", "resolved"]
# Reasons a body is refused with 400; each is a label value of
# colossalai_bridge_notifications_rejected_total.
PAYLOAD_REASONS = ("invalid_utf8", "malformed_json", "unknown_version", "missing_field",
                   "invalid_type", "invalid_value")


class PayloadError(ValueError):
    """A body that is not a valid webhook version 4 notification."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class Alert(msgspec.Struct, frozen=True, kw_only=True):
    status: Status
    labels: dict[str, str]
    starts_at: str = msgspec.field(name="startsAt")
    annotations: dict[str, str] = {}
    ends_at: str = msgspec.field(default="", name="endsAt")
    generator_url: str = msgspec.field(default="", name="generatorURL")
    fingerprint: str = ""


class Notification(msgspec.Struct, frozen=True, kw_only=True):
    version: str
    receiver: str
    status: Status
    group_key: str = msgspec.field(name="groupKey")
    alerts: tuple[Alert, ...]
    group_labels: dict[str, str] = msgspec.field(default={}, name="groupLabels")
    common_labels: dict[str, str] = msgspec.field(default={}, name="commonLabels")
    common_annotations: dict[str, str] = msgspec.field(default={}, name="commonAnnotations")
    external_url: str = msgspec.field(default="", name="externalURL")
    truncated_alerts: Annotated[int, msgspec.Meta(ge=0)] = msgspec.field(
        default=0, name="truncatedAlerts")


_DECODER = msgspec.json.Decoder(Notification)


def _field(obj: dict[str, Any], key: str, where: str, *, required: bool = True) -> Any:
    if key not in obj:
        if required:
            raise PayloadError("missing_field", f"{where}{key} is required")
        return None
    return obj[key]


def _string(obj: dict[str, Any], key: str, where: str, *, required: bool = True) -> str:
    value = _field(obj, key, where, required=required)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise PayloadError("invalid_type",
                           f"{where}{key} must be a string, got {_type_name(value)}")
    return value


def _labels(obj: dict[str, Any], key: str, where: str, *, required: bool = True) -> dict[str, str]:
    value = _field(obj, key, where, required=required)
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise PayloadError("invalid_type",
                           f"{where}{key} must be an object, got {_type_name(value)}")
    for name, text in value.items():
        if not isinstance(text, str):
            raise PayloadError("invalid_type", f"{where}{key}.{name} must be a string, got "
                               f"{_type_name(text)}")
    return dict(value)


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean",
            type(None): "null", int: "number", float: "number"}.get(type(value), "value")


def _status(obj: dict[str, Any], where: str) -> Status:
    status = _string(obj, "status", where)
    if status not in STATUSES:
        raise PayloadError("invalid_value",
                           f"{where}status must be firing or resolved, got {status!r}")
    return cast("Status", status)


def _checked_alert(obj: Any, index: int) -> Alert:
    where = f"alerts[{index}]."
    if not isinstance(obj, dict):
        raise PayloadError("invalid_type", f"alerts[{index}] must be an object, got "
                           f"{_type_name(obj)}")
    return Alert(
        status=_status(obj, where),
        labels=_labels(obj, "labels", where),
        annotations=_labels(obj, "annotations", where, required=False),
        starts_at=_string(obj, "startsAt", where),
        ends_at=_string(obj, "endsAt", where, required=False),
        generator_url=_string(obj, "generatorURL", where, required=False),
        fingerprint=_string(obj, "fingerprint", where, required=False),
    )


def parse_notification(body: bytes) -> Notification:
    """Parse and validate a webhook body; :class:`PayloadError` says what is wrong.

    >>> n = parse_notification(b'{"version": "4", "status": "firing", "receiver": "r",'
    ...     b' "groupKey": "{}:{}", "alerts": [{"status": "firing", "labels":'
    ...     b' {"alertname": "Watchdog"}, "startsAt": "2024-01-01T00:00:00Z"}]}')
    >>> n.alerts[0].labels["alertname"]
    'Watchdog'
    """
    try:
        notification = _DECODER.decode(body)
    except (msgspec.DecodeError, RecursionError):  # ValidationError is a DecodeError
        # msgspec raises RecursionError for objects nested thousands deep.
        return _parse_checked(body)
    if notification.version != SUPPORTED_VERSION:
        return _parse_checked(body)
    return notification


def _parse_checked(body: bytes) -> Notification:
    """The second path: parse with ``json.loads``, check each field, name any problem."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PayloadError("invalid_utf8", f"body is not valid UTF-8 at byte {exc.start}") \
            from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PayloadError("malformed_json", f"body is not JSON: {exc.msg} at line "
                           f"{exc.lineno}, column {exc.colno}") from None
    except RecursionError:
        raise PayloadError("malformed_json", "body is not JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise PayloadError("invalid_type", f"body must be a JSON object, got {_type_name(data)}")
    version = _field(data, "version", "")
    if not isinstance(version, str):
        raise PayloadError("invalid_type", f"version must be a string, got {_type_name(version)}")
    if version != SUPPORTED_VERSION:
        raise PayloadError("unknown_version", f"webhook version {version!r} is not supported "
                           f"(this bridge reads version {SUPPORTED_VERSION})")
    alerts_value = _field(data, "alerts", "")
    if not isinstance(alerts_value, list):
        raise PayloadError("invalid_type",
                           f"alerts must be an array, got {_type_name(alerts_value)}")
    truncated = data.get("truncatedAlerts", 0)
    if isinstance(truncated, bool) or not isinstance(truncated, int) or truncated < 0:
        raise PayloadError("invalid_type", "truncatedAlerts must be a non-negative integer")
    return Notification(
        version=version,
        receiver=_string(data, "receiver", ""),
        status=_status(data, ""),
        group_key=_string(data, "groupKey", ""),
        alerts=tuple(_checked_alert(item, i) for i, item in enumerate(alerts_value)),
        group_labels=_labels(data, "groupLabels", "", required=False),
        common_labels=_labels(data, "commonLabels", "", required=False),
        common_annotations=_labels(data, "commonAnnotations", "", required=False),
        external_url=_string(data, "externalURL", "", required=False),
        truncated_alerts=truncated,
    )
