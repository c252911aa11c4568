"""A tiny typed builder for the Grafana panels these dashboards use.

Four panel types are enough here: time series, stat, state timeline and table.
Each :class:`Panel` knows its queries, unit, thresholds and value mappings and
turns itself into Grafana's JSON model; where it sits (``gridPos``) and its id
are decided by :mod:`.layout`, so a definition only says what a panel shows
and how wide it is.

Every panel and every query names the ``datasource`` template variable, never
a concrete data source: one JSON file then works through Grafana's import
screen and through provisioning (see :mod:`.dashboard`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

PanelKind = Literal["timeseries", "stat", "state-timeline", "table"]

# The data source every panel, query, annotation and variable uses.
DATASOURCE: Final = {"type": "prometheus", "uid": "${datasource}"}

GRID_COLUMNS: Final = 24
REF_IDS: Final = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class Query:
    """One PromQL query of a panel.

    ``table`` makes it an instant query in table format (current values, one
    row per series): the firing-alerts and failure-reason tables.
    """

    expr: str
    legend: str = "__auto"
    table: bool = False


@dataclass(frozen=True)
class Step:
    """A threshold step: from ``value`` upwards the field is ``color`` (None: the base)."""

    color: str
    value: float | None = None


@dataclass(frozen=True)
class ValueText:
    """A value mapping: the number ``value`` is shown as ``text`` in ``color``."""

    value: str
    text: str
    color: str


def ok_bad(ok_value: str = "1", ok: str = "up", bad: str = "down") -> tuple[ValueText, ...]:
    """The usual mapping of a 0/1 health gauge."""
    bad_value = "0" if ok_value == "1" else "1"
    return (ValueText(ok_value, ok, "green"), ValueText(bad_value, bad, "red"))


@dataclass(frozen=True)
class Panel:
    """A panel: what it shows and how wide and tall it is (grid units, 24 columns)."""

    kind: PanelKind
    title: str
    description: str
    queries: tuple[Query, ...]
    w: int = 12
    h: int = 8
    unit: str = "short"
    min: float | None = None
    max: float | None = None
    decimals: int | None = None
    thresholds: tuple[Step, ...] = ()
    # time series: draw the thresholds as dashed lines (the alert's threshold)
    show_thresholds: bool = False
    mappings: tuple[ValueText, ...] = ()
    bars: bool = False
    stack: bool = False
    # refIds of queries drawn dashed: budgets, medians, predictions
    dashed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.queries:
            raise ValueError(f"panel {self.title!r} has no query")
        if not 0 < self.w <= GRID_COLUMNS:
            raise ValueError(f"panel {self.title!r}: width {self.w} outside 1..{GRID_COLUMNS}")

    def targets(self) -> list[dict[str, Any]]:
        out = []
        for ref, query in zip(REF_IDS, self.queries, strict=False):
            target: dict[str, Any] = {
                "datasource": dict(DATASOURCE),
                "editorMode": "code",
                "expr": query.expr,
                "legendFormat": query.legend,
                "range": not query.table,
                "instant": query.table,
                "refId": ref,
            }
            if query.table:
                target["format"] = "table"
            out.append(target)
        return out

    def field_defaults(self) -> dict[str, Any]:
        steps = self.thresholds or (Step("green"),)
        defaults: dict[str, Any] = {
            "color": {"mode": "thresholds" if self.kind in ("stat", "state-timeline")
                      else "palette-classic"},
            "mappings": [_mappings(self.mappings)] if self.mappings else [],
            "thresholds": {"mode": "absolute",
                           "steps": [{"color": s.color, "value": s.value} for s in steps]},
            "unit": self.unit,
        }
        for key in ("min", "max", "decimals"):
            value = getattr(self, key)
            if value is not None:
                defaults[key] = value
        custom = self._custom()
        if custom:
            defaults["custom"] = custom
        return defaults

    def _custom(self) -> dict[str, Any]:
        if self.kind == "timeseries":
            return {
                "drawStyle": "bars" if self.bars else "line",
                "lineWidth": 1,
                "fillOpacity": 60 if self.bars else 10,
                "showPoints": "never",
                "spanNulls": False,
                "stacking": {"mode": "normal" if self.stack else "none", "group": "A"},
                "thresholdsStyle": {"mode": "dashed" if self.show_thresholds else "off"},
            }
        if self.kind == "state-timeline":
            return {"fillOpacity": 80, "lineWidth": 0}
        return {}

    def overrides(self) -> list[dict[str, Any]]:
        return [{"matcher": {"id": "byFrameRefID", "options": ref},
                 "properties": [{"id": "custom.lineStyle",
                                 "value": {"fill": "dash", "dash": [10, 10]}}]}
                for ref in self.dashed]

    def options(self) -> dict[str, Any]:
        legend = {"displayMode": "list", "placement": "bottom", "showLegend": True,
                  "calcs": []}
        tooltip = {"mode": "multi", "sort": "desc"}
        if self.kind == "timeseries":
            return {"legend": legend, "tooltip": tooltip}
        if self.kind == "state-timeline":
            return {"showValue": "auto", "mergeValues": True, "alignValue": "left",
                    "rowHeight": 0.9, "legend": legend, "tooltip": tooltip}
        if self.kind == "stat":
            return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                      "values": False},
                    "orientation": "auto", "textMode": "value_and_name",
                    "colorMode": "background", "graphMode": "none",
                    "justifyMode": "auto", "wideLayout": True}
        return {"showHeader": True, "cellHeight": "sm",
                "footer": {"show": False, "reducer": ["sum"], "countRows": False}}

    def to_json(self, panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
        panel: dict[str, Any] = {
            "datasource": dict(DATASOURCE),
            "description": self.description,
            "fieldConfig": {"defaults": self.field_defaults(), "overrides": self.overrides()},
            "gridPos": grid,
            "id": panel_id,
            "options": self.options(),
            "targets": self.targets(),
            "title": self.title,
            "type": self.kind,
        }
        if self.kind == "table":
            # Labels are the table's columns; the sample's time and name are noise.
            panel["transformations"] = [{"id": "organize", "options": {
                "excludeByName": {"Time": True, "__name__": True}}}]
        return panel


def _mappings(values: tuple[ValueText, ...]) -> dict[str, Any]:
    return {"type": "value", "options": {
        v.value: {"text": v.text, "color": v.color, "index": i} for i, v in enumerate(values)}}


def timeseries(title: str, description: str, *queries: Query, **options: Any) -> Panel:
    return Panel("timeseries", title, description, queries, **options)


def stat(title: str, description: str, *queries: Query, **options: Any) -> Panel:
    return Panel("stat", title, description, queries, **options)


def state_timeline(title: str, description: str, *queries: Query, **options: Any) -> Panel:
    return Panel("state-timeline", title, description, queries, **options)


def table(title: str, description: str, *queries: Query, **options: Any) -> Panel:
    return Panel("table", title, description, queries, **options)


@dataclass(frozen=True)
class Row:
    """A titled row of panels, packed left to right (see :mod:`.layout`)."""

    title: str
    panels: tuple[Panel, ...]
