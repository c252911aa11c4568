"""The rules config (``rules/config.yml``): typed, validated, every problem one line.

The YAML file holds every value (thresholds, ``for`` windows, selectors, the
runbook URL pattern); this module only knows the *shape*, as config-layer
sections (:mod:`colossalai_exporter.configfile`: msgspec Structs that refuse
unknown keys at any depth, with the wording every other config uses), so
values live in one place. An override (a partial mapping, for example a test's
short ``for`` windows) is merged over the base before validation, and both are
checked the same way: a problem is a :class:`ConfigError` naming the file and
the dotted key.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import msgspec

from colossalai_exporter import configfile
from colossalai_exporter.configfile import Section, parse_prometheus_duration, unknown_key
from colossalai_exporter.errors import ConfigError
from colossalai_exporter.flags import load_yaml_file


class Duration:
    """A Prometheus duration (``1h30m``), kept as written and in seconds.

    Not the layer's :class:`~colossalai_exporter.configfile.Seconds`: the rule files
    carry the text as the user wrote it, so only Prometheus' own grammar is accepted
    here (no plain numbers).
    """

    __slots__ = ("seconds", "text")

    def __init__(self, text: str, seconds: float) -> None:
        self.text = text
        self.seconds = seconds

    @classmethod
    def parse(cls, text: str) -> Duration:
        """``Duration.parse("1h30m").seconds == 5400``; ValueError when malformed."""
        try:
            seconds = parse_prometheus_duration(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a Prometheus duration (like 30s, 5m, "
                             "1h30m)") from None
        # Whole seconds stay an int: dashboards write them into JSON as 7200, not 7200.0.
        return cls(text, int(seconds) if seconds.is_integer() else seconds)

    @classmethod
    def from_config(cls, value: object) -> Duration:
        """The config layer's hook for this type (a TypeError or ValueError names the key)."""
        if not isinstance(value, str):
            raise TypeError(f"expected a Prometheus duration (like 30s, 5m, 1h30m), "
                            f"got {value!r}")
        return cls.parse(value)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Duration({self.text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Duration) and (self.text, self.seconds) == (other.text,
                                                                             other.seconds)

    def __hash__(self) -> int:
        return hash((self.text, self.seconds))


class Selectors(Section, frozen=True):
    """PromQL label matchers (without braces) that choose each component's series."""

    training: str
    node: str
    probe: str
    #: chat apps' own /metrics (the FastAPI helper)
    chat_app: str
    #: inference servers' own /metrics (vLLM, SGLang, TGI) for the optional engine rules
    engine: str
    bridge: str
    #: node_exporter, whose infiniband collector the fabric rules read besides the agents'
    node_exporter: str
    #: which RDMA ports the fabric rules watch (leave out management NICs)
    rdma_ports: str


class Thresholds(Section, frozen=True):
    """Numbers the alerts compare against; each is commented in rules/config.yml."""

    straggler_ratio: float
    straggler_wait_ratio: float
    straggler_min_waiting: float
    straggler_stepped_within: Duration
    gpu_memory_used_percent: float
    host_memory_available_percent: float
    disk_free_bytes: int
    disk_filling_free_percent: float
    disk_filling_lookback: Duration
    disk_filling_horizon: Duration
    disk_filling_for: Duration
    hang_after_timeout_for: Duration
    checkpoint_interval: Duration
    restart_loop_restarts: int
    restart_loop_window: Duration
    node_lost_window: Duration
    gemini_oom_window: Duration
    checkpoint_failure_window: Duration
    kernel_failure_window: Duration
    heartbeat_failing_after: Duration
    training_slow_evaluation_interval: Duration
    training_never_started_after: Duration
    chat_latency_seconds: float
    chat_first_token_seconds: float
    chat_stream_failure_ratio: float
    chat_stream_window: Duration
    chat_progress_timeout: Duration
    engine_queue_seconds: float
    engine_queue_window: Duration
    bridge_no_success_after: Duration
    bridge_dead_letter_window: Duration
    bridge_oldest_pending_age: Duration
    gpu_xid_window: Duration
    gpu_xid_recurring_count: int
    gpu_xid_recurring_window: Duration
    gpu_retired_pages: int
    gpu_pcie_replays_per_minute: float
    gpu_clock_slowdown_share: float
    gpu_clock_slowdown_window: Duration
    gpu_sram_corrected_errors: int
    gpu_nvlink_down_memory: Duration
    gpu_nvlink_error_minutes: int
    gpu_nvlink_error_window: Duration
    infiniband_down_memory: Duration
    infiniband_flaps: int
    infiniband_flap_window: Duration
    infiniband_symbol_errors_per_hour: int
    infiniband_transport_errors_per_hour: int
    infiniband_expected_ports: int
    infiniband_evaluation_interval: Duration


class Kubernetes(Section, frozen=True):
    """Metadata of the generated PrometheusRule object."""

    name: str
    namespace: str
    labels: dict[str, str]


class RulesConfig(Section, frozen=True):
    """The whole rules config; see rules/config.yml for what each value means."""

    runbook_url: str
    grafana_url: str
    selectors: Selectors
    expected_jobs: list[str]
    thresholds: Thresholds
    #: keyed by alert name; the YAML key is ``for``
    for_: dict[str, Duration] = msgspec.field(name="for")
    kubernetes: Kubernetes
    #: alerts evaluated and visible but routed to no one (label record_only="true")
    record_only: list[str] = msgspec.field(default_factory=list)

    def runbook(self, alertname: str) -> str:
        """The runbook URL of one alert."""
        return self.runbook_url.format(anchor=alertname.lower(), alertname=alertname)


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


def from_mapping(data: Mapping[str, Any], alerts: AbstractSet[str] | None = None) -> RulesConfig:
    """Validate a complete config mapping; ``alerts`` are the names ``for`` must cover."""
    config = configfile.convert(data, RulesConfig)
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
        unknown = sorted(set(config.record_only) - alerts)
        if unknown:
            raise ConfigError(f"record_only: {unknown[0]} is not an alert (alerts: "
                              f"{', '.join(sorted(alerts))})")
    return config


def load(path: Path, overrides: list[Path] | None = None,
         alerts: AbstractSet[str] | None = None) -> RulesConfig:
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
