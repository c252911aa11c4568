"""One config layer: a YAML file into typed structures that refuse unknown keys at any depth.

A component declares its file's shape as :class:`Section` subclasses (frozen
msgspec Structs with ``forbid_unknown_fields``) and reads it with :func:`load`:
one YAML loader (:func:`~colossalai_exporter.flags.load_yaml_file`), msgspec's
strict conversion, and any problem as one :class:`ConfigError` line that names
the file and the key's path::

    node.yml: web: unknown key `listen_adress`
    node.yml: gpu.expected: expected `int` >= 0, got -1

Two value types every component shares:

* :class:`Seconds` — a Prometheus-style duration (``30s``, ``1m30s``, ``500ms``,
  ``1h``) or a plain number of seconds; one grammar, :func:`parse_duration`.
* :class:`ConfigPath` — a path; a relative one is relative to the config
  file's folder (not to the working directory the daemon was started in).

Why msgspec rather than a validation library: it is already a dependency (the
bridge decodes notifications with it), converts and validates in one pass,
and its errors carry the key path.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec

from colossalai_exporter.errors import ConfigError
from colossalai_exporter.flags import load_yaml_file

T = TypeVar("T")

_DURATION_RE: Final = re.compile(
    r"^(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$")
_DURATION_UNITS: Final = (365 * 86400, 7 * 86400, 86400, 3600, 60, 1, 0.001)


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Base of every config section: unknown keys are errors, values are read-only."""


class Seconds(float):
    """A duration in seconds, written ``30s``/``1m30s``/``500ms`` or as a number."""


class ConfigPath(str):
    """A path from a config file, made absolute against the file's folder."""

    __slots__ = ()


def parse_prometheus_duration(text: str) -> float:
    """Seconds in a Prometheus duration, exactly as Prometheus reads one (``1h30m``).

    For values written into Prometheus' own files (a rule's ``for``); ValueError
    otherwise (``5 min``, ``1.5m``, ``-1s``, an empty string).
    """
    match = _DURATION_RE.match(text.strip())
    if not text.strip() or match is None or not any(match.groups()):
        raise ValueError(f"{text!r} is not a duration (like 30s, 5m, 1h30m, 500ms)")
    return float(sum(int(g) * unit for g, unit in zip(match.groups(), _DURATION_UNITS,
                                                       strict=True) if g))


_DECIMAL_RE: Final = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)?$")
_UNIT_SECONDS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0,
                        "w": 7 * 86400.0, "y": 365 * 86400.0, None: 1.0}


def parse_duration(text: str) -> float:
    """Seconds in a duration from a config file: ``parse_duration("1m30s") == 90``.

    Prometheus' grammar (``30s``, ``1h30m``, ``500ms``), and for the configs
    written before it was the one grammar, a single decimal value with a unit
    (``1.5s``, ``0.5m``) or a bare number of seconds (``"5"``). ValueError
    otherwise.
    """
    with_unit = _DECIMAL_RE.match(text.strip())
    if with_unit is not None:
        return float(with_unit.group(1)) * _UNIT_SECONDS[with_unit.group(2)]
    return parse_prometheus_duration(text)


def _decoder(base: Path) -> Callable[[type, Any], Any]:
    def dec_hook(kind: type, value: Any) -> Any:
        if kind is Seconds:
            if isinstance(value, bool):
                raise TypeError(f"expected a duration, got {value!r}")
            if isinstance(value, int | float):
                seconds = float(value)
            elif isinstance(value, str):
                seconds = parse_duration(value)
            else:
                raise TypeError(f"expected a duration, got {type(value).__name__}")
            if seconds < 0:
                raise ValueError(f"a duration cannot be negative, got {value!r}")
            return Seconds(seconds)
        if kind is ConfigPath:
            if not isinstance(value, str) or not value:
                raise TypeError(f"expected a path, got {value!r}")
            path = Path(value).expanduser()
            return ConfigPath(path if path.is_absolute() else base / path)
        raise NotImplementedError(kind)

    return dec_hook


_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def describe(error: msgspec.ValidationError) -> str:
    """``web: unknown key `listen_adress``` from msgspec's wording."""
    match = _AT.match(str(error))
    assert match is not None  # the pattern matches any text
    message = match.group("message")
    message = message.replace("Object contains unknown field", "unknown key")
    message = message.replace("Object missing required field", "missing key")
    message = message[:1].lower() + message[1:]
    path = (match.group("path") or "").lstrip(".")
    return f"{path}: {message}" if path else message


def convert(data: Any, kind: type[T], source: str, base: Path | None = None) -> T:
    """``data`` (parsed YAML) as ``kind``; ConfigError naming ``source`` and the key."""
    try:
        return msgspec.convert(data, kind, strict=True,
                               dec_hook=_decoder(base or Path.cwd()))
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {describe(exc)}") from None


def load(path: str | Path, kind: type[T], what: str = "config file") -> T:
    """Read the YAML file at ``path`` as ``kind``; relative paths in it are the file's."""
    source = Path(path)
    return convert(load_yaml_file(source, what), kind, str(source), source.parent.absolute())
