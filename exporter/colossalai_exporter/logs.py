"""Logging in the Go exporters' style: ``--log.level`` and ``--log.format=logfmt|json``."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from colossalai_exporter.errors import ConfigError

LEVELS = ("debug", "info", "warn", "error")
FORMATS = ("logfmt", "json")

# Attributes every LogRecord has; anything else came from ``extra=`` and is logged as a field.
# uvicorn adds ``color_message`` (the message with ANSI colour escapes, for its own
# terminal formatter) to its records: a copy of msg that would put escapes into every
# logfmt and JSON line, so it is not a field either.
_STANDARD_ATTRS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime",
                                                                 "color_message"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z",
        "level": record.levelname.lower().replace("warning", "warn"),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    for key, value in vars(record).items():
        if key not in _STANDARD_ATTRS and not key.startswith("_"):
            fields[key] = value
    if record.exc_info:
        fields["err"] = logging.Formatter().formatException(record.exc_info)
    return fields


def _logfmt_value(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' ="\n\t'):
        return json.dumps(text)
    return text


class LogfmtFormatter(logging.Formatter):
    """``ts=… level=info logger=… msg="…" key=value`` lines."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in _fields(record).items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str)


def setup_logging(level: str = "info", fmt: str = "logfmt") -> None:
    """Configure the root logger once for a command (stderr, chosen level and format)."""
    if level not in LEVELS:
        raise ConfigError(f"--log.level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ConfigError(f"--log.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter() if fmt == "logfmt" else JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING if level == "warn" else getattr(logging, level.upper()))
    # uvicorn's access log would log every scrape; errors still come through.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    # urllib3 (under requests, in the bridge's sender) logs each request's URL at debug
    # and a retried one's path at warning; a heartbeat URL carries its token there. The
    # bridge logs its own deliveries, with the URL redacted (HttpCall.redacted).
    logging.getLogger("urllib3").setLevel(logging.ERROR)
