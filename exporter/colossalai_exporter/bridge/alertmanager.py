"""Alertmanager webhook payloads (version 4) parsed into typed objects.

A pure function, kept apart from the HTTP route so that it can be tested on
its own and so that the route only maps :class:`PayloadError` to a 400. The
format is Alertmanager's ``notify/webhook`` ``Message``; unknown extra keys
(``notification_reason``, ``routeLabels`` in newer versions) are accepted and
ignored here (the body is stored and forwarded as received), because refusing
them would make Alertmanager retry a body that will never become valid.

One path, strict JSON (RFC 8259). msgspec decodes the body, then converts it
into the :class:`Notification` and :class:`Alert` structs, checking every
type; its error, which names the key, becomes the 400's reason and message.
Refused, because the body is stored and forwarded as received and a receiver
could not read it: ``NaN``/``Infinity`` (not JSON), bytes that are not UTF-8,
lone surrogate escapes, and numbers outside what a 64-bit integer or a double
holds, in any key (Python's own ``json`` refuses an integer of over 4,300
digits; that used to answer 500, which Alertmanager retries for ever). Two
steps rather than decoding straight into the structs, which would skip the
keys nobody reads unchecked: about 1.5× the one-step decode, cheaper than
screening the bytes for long numbers and decoding again (bench/RESULTS.md).
``null`` for an optional object or string is read as empty: Go's encoder
writes a nil map as ``null``.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Literal

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


Labels = dict[str, str]


class Alert(msgspec.Struct, frozen=True, kw_only=True):
    status: Status
    labels: Labels
    starts_at: str = msgspec.field(name="startsAt")
    annotations: Labels | None = None
    ends_at: str | None = msgspec.field(default=None, name="endsAt")
    generator_url: str | None = msgspec.field(default=None, name="generatorURL")
    fingerprint: str | None = None

    def __post_init__(self) -> None:
        # null (a nil map or pointer in Go) and absent both read as empty.
        for name, empty in (("annotations", {}), ("ends_at", ""), ("generator_url", ""),
                            ("fingerprint", "")):
            if getattr(self, name) is None:
                msgspec.structs.force_setattr(self, name, empty)


class Notification(msgspec.Struct, frozen=True, kw_only=True):
    version: str
    receiver: str
    status: Status
    group_key: str = msgspec.field(name="groupKey")
    alerts: tuple[Alert, ...]
    group_labels: Labels | None = msgspec.field(default=None, name="groupLabels")
    common_labels: Labels | None = msgspec.field(default=None, name="commonLabels")
    common_annotations: Labels | None = msgspec.field(default=None, name="commonAnnotations")
    external_url: str | None = msgspec.field(default=None, name="externalURL")
    truncated_alerts: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = msgspec.field(
        default=0, name="truncatedAlerts")

    def __post_init__(self) -> None:
        for name, empty in (("group_labels", {}), ("common_labels", {}),
                            ("common_annotations", {}), ("external_url", "")):
            if getattr(self, name) is None:
                msgspec.structs.force_setattr(self, name, empty)


# msgspec's wording -> (reason, our wording); {0} is the key's path.
_VALIDATION_WORDS: Final = (
    (re.compile(r"^Object missing required field `(?P<key>[^`]*)`"), "missing_field",
     "{where}{key} is required"),
    (re.compile(r"^Expected `(?P<want>[^`]*)`, got `(?P<got>[^`]*)`"), "invalid_type",
     "{where} must be {want}, got {got}"),
    (re.compile(r"^Invalid enum value (?P<got>.*)"), "invalid_value",
     "{where} must be firing or resolved, got {got}"),
    (re.compile(r"^Expected `int` (?P<bound>[<>]=.*)"), "invalid_value",
     "{where} must be a non-negative integer below 2**63"),
)
_TYPE_WORDS: Final = {"str": "a string", "object": "an object", "array": "an array",
                      "int": "an integer", "float": "a number", "null": "null",
                      "bool": "a boolean", "array | null": "an array",
                      "object | null": "an object", "str | null": "a string"}
_AT: Final = re.compile(r" - at `\$(?P<path>[^`]*)`$")

def parse_notification(body: bytes) -> Notification:
    """Parse and validate a webhook body; :class:`PayloadError` says what is wrong.

    >>> n = parse_notification(b'{"version": "4", "status": "firing", "receiver": "r",'
    ...     b' "groupKey": "{}:{}", "alerts": [{"status": "firing", "labels":'
    ...     b' {"alertname": "Watchdog"}, "startsAt": "2024-01-01T00:00:00Z"}]}')
    >>> n.alerts[0].labels["alertname"]
    'Watchdog'
    """
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PayloadError("invalid_utf8", f"body is not valid UTF-8 at byte {exc.start}") \
            from None
    try:
        # Untyped first: msgspec holds every number, the keys nobody reads included, to
        # a 64-bit integer or a double, and refuses NaN and lone surrogate escapes.
        data = msgspec.json.decode(body)
    except msgspec.ValidationError:
        raise PayloadError("invalid_value", "a number is out of range: JSON numbers here "
                           "must fit a 64-bit integer or a double") from None
    except msgspec.DecodeError as exc:
        raise PayloadError("malformed_json", "body is not JSON: "
                           + str(exc).removeprefix("JSON is malformed: ")) from None
    except RecursionError:  # msgspec's answer to objects nested thousands deep
        raise PayloadError("malformed_json", "body is not JSON: nested too deeply") from None
    version = data.get("version") if isinstance(data, dict) else None
    if isinstance(version, str) and version != SUPPORTED_VERSION:
        raise PayloadError("unknown_version", f"webhook version {version!r} is not supported "
                           f"(this bridge reads version {SUPPORTED_VERSION})")
    try:
        return msgspec.convert(data, Notification)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None


def _validation_error(text: str) -> PayloadError:
    at = _AT.search(text)
    path = at.group("path").lstrip(".") if at else ""
    if path.endswith("[...]"):  # a value in a map of labels; msgspec does not name the key
        path = path.removesuffix("[...]") + " values"
    words = text[:at.start()] if at else text
    if not path and words.startswith("Expected `object`"):
        got = words.rpartition("`")[0].rpartition("`")[2]
        return PayloadError("invalid_type", f"body must be a JSON object, got {got}")
    for pattern, reason, template in _VALIDATION_WORDS:
        match = pattern.match(words)
        if match is None:
            continue
        fields = match.groupdict()
        if "want" in fields:
            fields["want"] = _TYPE_WORDS.get(fields["want"], fields["want"])
        where = f"{path}." if reason == "missing_field" and path else path
        return PayloadError(reason, template.format(where=where, **fields))
    return PayloadError("invalid_value", f"{path}: {words}" if path else words)
