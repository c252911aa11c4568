"""Plain data for rules: what the builders produce and the renderer writes."""

from __future__ import annotations

from dataclasses import dataclass, field

from colossalai_exporter.rulesgen.config import Duration

SEVERITIES = ("critical", "warning", "info")


@dataclass(frozen=True)
class Alert:
    """One alerting rule. Several rules may share a name (one runbook, one ``for`` key)."""

    name: str
    expr: str
    severity: str
    summary: str
    description: str
    # Grafana dashboard uid and its variables (name -> template text), or None.
    dashboard: tuple[str, dict[str, str]] | None = None
    # Only for a second rule of an alert that needs its own window (disk filling up).
    for_: Duration | None = None
    # A static ``cause`` label telling apart rules that share a name and severity
    # (promtool rejects duplicates, and routing or silences may want to tell them apart).
    cause: str | None = None
    # The node's hardware verdict (rulesgen/verdict.py): the part of the node the alert
    # judges (a verdict.SUBSYSTEMS key) and what the node needs, a verdict.REMEDIES key
    # or a template choosing one from the alert's own labels (an Xid's catalog action).
    subsystem: str | None = None
    remedy: str | None = None

    def __post_init__(self) -> None:
        if (self.subsystem is None) != (self.remedy is None):
            raise ValueError(f"{self.name}: a subsystem and a remedy go together")
        if self.severity not in SEVERITIES:
            raise ValueError(f"{self.name}: severity {self.severity!r} not in {SEVERITIES}")
        if "{{" in self.summary:
            raise ValueError(f"{self.name}: the summary is static; templates go in description")


@dataclass(frozen=True)
class Recording:
    """One recording rule, named level:metric:operations."""

    record: str
    expr: str

    def __post_init__(self) -> None:
        if self.record.count(":") != 2:
            raise ValueError(f"recording rule {self.record!r} is not level:metric:operations")


@dataclass(frozen=True)
class Group:
    """A rule group (evaluated together, in order)."""

    name: str
    rules: tuple[Alert | Recording, ...]
    # Evaluation interval of the group when not Prometheus' global one.
    interval: str | None = None


@dataclass(frozen=True)
class RuleFile:
    """One rules/<name>.rules.yml file."""

    name: str
    groups: tuple[Group, ...] = field(default_factory=tuple)

    @property
    def filename(self) -> str:
        return f"{self.name}.rules.yml"
