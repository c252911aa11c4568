"""The rules config (``rules/config.yml``): typed, validated, every problem one line.

The YAML file holds every value (thresholds, ``for`` windows, selectors, the
runbook URL pattern); this module only knows the *shape*, as dataclasses, so
values live in one place. An override (a partial mapping, for example a test's
short ``for`` windows) is merged over the base before validation, and both are
checked the same way: an unknown key or a wrong type is a :class:`ConfigError`
naming the file and the dotted key.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colossalai_exporter.configfile import parse_prometheus_duration, unknown_key
from colossalai_exporter.errors import ConfigError
from colossalai_exporter.flags import load_yaml_file


@dataclass(frozen=True)
class Duration:
    """A Prometheus duration (``1h30m``), kept as written and in seconds."""

    text: str
    seconds: float

    @classmethod
    def parse(cls, text: str) -> Duration:
        """``Duration.parse("1h30m").seconds == 5400``; ValueError when malformed."""
        # Prometheus' own grammar: the text is written into the rule files as it is.
        try:
            seconds = parse_prometheus_duration(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a Prometheus duration (like 30s, 5m, "
                             "1h30m)") from None
        # Whole seconds stay an int: dashboards write them into JSON as 7200, not 7200.0.
        return cls(text, int(seconds) if seconds.is_integer() else seconds)

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Selectors:
    """PromQL label matchers (without braces) that choose each component's series."""

    training: str
    node: str
    probe: str
    bridge: str


@dataclass(frozen=True)
class Thresholds:
    """Numbers the alerts compare against; each is commented in rules/config.yml."""

    straggler_ratio: float
    straggler_wait_ratio: float
    straggler_min_waiting: float
    gpu_memory_used_percent: float
    host_memory_available_percent: float
    disk_free_bytes: int
    disk_filling_free_percent: float
    disk_filling_lookback: Duration
    disk_filling_horizon: Duration
    disk_filling_for: Duration
    checkpoint_interval: Duration
    restart_loop_restarts: int
    restart_loop_window: Duration
    gemini_oom_window: Duration
    checkpoint_failure_window: Duration
    kernel_failure_window: Duration
    heartbeat_failing_after: Duration
    chat_latency_seconds: float
    bridge_no_success_after: Duration
    bridge_dead_letter_window: Duration
    bridge_oldest_pending_age: Duration


@dataclass(frozen=True)
class Kubernetes:
    """Metadata of the generated PrometheusRule object."""

    name: str
    namespace: str
    labels: dict[str, str]


@dataclass(frozen=True)
class RulesConfig:
    """The whole rules config; see rules/config.yml for what each value means."""

    runbook_url: str
    grafana_url: str
    selectors: Selectors
    expected_jobs: list[str]
    thresholds: Thresholds
    # keyed by alert name; the YAML key is ``for``
    for_: dict[str, Duration]
    kubernetes: Kubernetes

    def runbook(self, alertname: str) -> str:
        """The runbook URL of one alert."""
        return self.runbook_url.format(anchor=alertname.lower(), alertname=alertname)


def _yaml_key(field: dataclasses.Field[Any]) -> str:
    return field.name.rstrip("_")


def _type_name(tp: Any) -> str:
    if tp is Duration:
        return "a duration (like 30s, 5m, 1h30m)"
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is str:
        return "a string"
    origin = typing.get_origin(tp)
    if origin is list:
        return "a list of strings"
    if origin is dict:
        return "a mapping"
    return "a mapping"


def _convert(value: Any, tp: Any, where: str) -> Any:
    """``value`` as type ``tp``, or ConfigError naming ``where``."""
    def wrong() -> ConfigError:
        return ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")

    if tp is Duration:
        if not isinstance(value, str):
            raise wrong()
        try:
            return Duration.parse(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise wrong()
        return _build(tp, value, where)
    # bool is an int in Python; `true` for a threshold is a mistake, not 1.
    if isinstance(value, bool):
        raise wrong()
    if tp is float:
        if not isinstance(value, int | float):
            raise wrong()
        return float(value)
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise wrong()
        return value
    if tp is str:
        if not isinstance(value, str):
            raise wrong()
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise wrong()
        return list(value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise wrong()
        return {str(k): _convert(v, args[1], f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"unsupported config type {tp!r}")  # a bug in this module, not input


def _build(cls: type[Any], data: Mapping[str, Any], where: str) -> Any:
    fields = {_yaml_key(f): f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    prefix = f"{where}." if where else ""
    for key in data:
        if key not in fields:
            raise ConfigError(f"{where}: {unknown_key(key, fields)}" if where
                              else unknown_key(key, fields))
    kwargs: dict[str, Any] = {}
    for key, field in fields.items():
        if key not in data:
            raise ConfigError(f"{prefix}{key}: missing")
        kwargs[field.name] = _convert(data[key], hints[field.name], f"{prefix}{key}")
    return cls(**kwargs)


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` merged in, mapping by mapping (lists are replaced)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _check_override_keys(base: Mapping[str, Any], override: Mapping[str, Any],
                         where: str) -> None:
    """An override may only name keys the base has (a typo must not add a new key)."""
    for key, value in override.items():
        dotted = f"{where}.{key}" if where else str(key)
        if key not in base:
            raise ConfigError(f"{where}: {unknown_key(key, base)}" if where
                              else unknown_key(key, base))
        if isinstance(value, Mapping) and isinstance(base[key], Mapping) and key != "labels":
            _check_override_keys(base[key], value, dotted)


def from_mapping(data: Mapping[str, Any], alerts: set[str] | None = None) -> RulesConfig:
    """Validate a complete config mapping; ``alerts`` are the names ``for`` must cover."""
    config: RulesConfig = _build(RulesConfig, data, "")
    if "{anchor}" not in config.runbook_url and "{alertname}" not in config.runbook_url:
        raise ConfigError("runbook_url: must contain {anchor} or {alertname}")
    try:
        config.runbook("X")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"runbook_url: bad pattern ({exc}); only {{anchor}} and "
                          "{alertname} may appear in braces") from None
    if alerts is not None:
        unknown = sorted(set(config.for_) - alerts)
        if unknown:
            raise ConfigError(f"for.{unknown[0]}: unknown alert (alerts: "
                              f"{', '.join(sorted(alerts))})")
        missing = sorted(alerts - set(config.for_))
        if missing:
            raise ConfigError(f"for.{missing[0]}: missing (every alert needs a for window)")
    return config


def load(path: Path, overrides: list[Path] | None = None,
         alerts: set[str] | None = None) -> RulesConfig:
    """Read ``path``, merge each override file over it, validate.

    Each error names the file that caused it: the base when it is invalid on
    its own, otherwise the override that made it so.
    """
    data: dict[str, Any] = load_yaml_file(path, "rules config")
    try:
        config = from_mapping(data, alerts)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    for override in overrides or []:
        extra = load_yaml_file(override, "rules override")
        try:
            _check_override_keys(data, extra, "")
            data = merge(data, extra)
            config = from_mapping(data, alerts)
        except ConfigError as exc:
            raise ConfigError(f"{override}: {exc}") from None
    return config
