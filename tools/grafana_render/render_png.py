"""Plot every panel of a dashboard from a real Prometheus into one PNG, laid out like Grafana.

So that a reader sees what the dashboards show without installing Grafana,
and so that a test can tell which panels return no data::

    PYTHONPATH=tools python -m grafana_render.render_png \\
        --prometheus.url http://127.0.0.1:9090 --since 30m --output-dir docs/dashboards

    from grafana_render.render_png import render_all
    results = render_all("http://127.0.0.1:9090", start, end, Path("docs/dashboards"))
    {r.uid: r.empty_panels for r in results}

Each panel's queries go through ``/api/v1/query_range`` with the variables
Grafana would pick (:mod:`.query`) and the built-ins it would send
(:mod:`.interpolate`). Each panel is an axes at its ``gridPos``: time series
as lines (dashed where the dashboard draws them dashed, thresholds as dashed
horizontal lines), state timelines as coloured bands, stats as their last
values, tables as the label sets seen. A panel whose queries return no finite
sample is drawn "No data" and listed in :attr:`RenderResult.empty_panels`.

Needs matplotlib (the ``dev`` extra); uses the Agg canvas through
:class:`matplotlib.figure.Figure`, never pyplot's global state.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from grafana_render import jsonmodel
from grafana_render.interpolate import Value, builtins, interpolate
from grafana_render.query import Prometheus, QueryError, Series, resolve_variables

REPO = Path(__file__).resolve().parents[2]

DEFAULT_DASHBOARDS_DIR = REPO / "grafana" / "dashboards"
DEFAULT_OUTPUT_DIR = REPO / "docs" / "dashboards"

# Inches per grid column and per grid row (Grafana: 24 columns, 30 px rows).
COLUMN_INCHES = 0.75
ROW_INCHES = 0.34
POINTS = 240  # about as many points per series as Grafana asks for on a wide panel

# Grafana's colour names -> matplotlib's.
_COLORS = {"green": "#56a64b", "red": "#e02f44", "yellow": "#f2cc0c", "orange": "#ff9830",
           "blue": "#3274d9", "purple": "#a352cc", "light-green": "#96d98d",
           "light-blue": "#8ab8ff",
           "text": "#8e8e8e", "transparent": "#f4f5f5"}
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


@dataclass
class QueryResult:
    ref: str
    expr: str  # as sent, variables substituted
    legend: str
    series: list[Series] = field(default_factory=list)
    error: str = ""


@dataclass
class PanelResult:
    id: int
    title: str
    kind: str
    grid: dict[str, int]
    queries: list[QueryResult]

    @property
    def empty(self) -> bool:
        """No finite sample in any query: Grafana would draw nothing."""
        return not any(math.isfinite(v) for q in self.queries for s in q.series
                       for v in s.values)


@dataclass
class RenderResult:
    uid: str
    title: str
    png: Path
    variables: dict[str, Value]
    panels: list[PanelResult]

    @property
    def empty_panels(self) -> list[str]:
        """Titles of the panels that returned no data, in dashboard order."""
        return [p.title for p in self.panels if p.empty]

    @property
    def empty_queries(self) -> list[str]:
        """``"<panel title> <refId>"`` of every query without data (finer than panels)."""
        return [f"{p.title} {q.ref}" for p in self.panels for q in p.queries
                if not any(math.isfinite(v) for s in q.series for v in s.values)]

    @property
    def errors(self) -> dict[str, str]:
        """Panel title -> the first query error Prometheus gave for it."""
        return {p.title: e for p in self.panels for e in [next(
            (q.error for q in p.queries if q.error), "")] if e}


def legend_text(template: str, labels: Mapping[str, str]) -> str:
    """A series' legend as Grafana writes it from a ``{{label}}`` template."""
    if not template or template == "__auto":
        inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
        return labels.get("__name__", "") + "{" + inner + "}"
    return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), template)


def format_value(value: float, unit: str) -> str:
    """A compact human value for a Grafana unit (the few these dashboards use)."""
    if not math.isfinite(value):
        return str(value)
    if unit in ("bytes", "Bps"):
        suffix = "/s" if unit == "Bps" else ""
        for name, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(value) >= size:
                return f"{value / size:.3g} {name}{suffix}"
        return f"{value:.3g} B{suffix}"
    if unit == "s":
        for name, size in (("d", 86400), ("h", 3600), ("min", 60)):
            if abs(value) >= size:
                return f"{value / size:.3g} {name}"
        return f"{value:.3g} s"
    if unit == "percent":
        return f"{value:.3g}%"
    if unit == "percentunit":
        return f"{100 * value:.3g}%"
    suffix = {"ops": " ops/s", "reqps": " req/s", "celsius": " °C", "watt": " W"}.get(unit, "")
    return f"{value:.4g}{suffix}"


def _mapping(panel: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """Value mappings of a panel: value text -> (display text, colour)."""
    out: dict[str, tuple[str, str]] = {}
    for mapping in panel.get("fieldConfig", {}).get("defaults", {}).get("mappings", []):
        for value, shown in mapping.get("options", {}).items():
            out[value] = (shown.get("text", value), shown.get("color", "text"))
    return out


def _key(value: float) -> str:
    return f"{value:g}"


def _threshold_color(panel: Mapping[str, Any], value: float) -> str:
    steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get(
        "steps", [])
    color = "text"
    for step in steps:
        if step.get("value") is None or value >= step["value"]:
            color = step.get("color", color)
    return color


def _dashed_refs(panel: Mapping[str, Any]) -> set[str]:
    refs = set()
    for override in panel.get("fieldConfig", {}).get("overrides", []):
        matcher = override.get("matcher", {})
        dashed = any(p.get("id") == "custom.lineStyle" and p.get("value", {}).get("fill") ==
                     "dash" for p in override.get("properties", []))
        if matcher.get("id") == "byFrameRefID" and dashed:
            refs.add(matcher.get("options"))
    return refs


def _finite(series: Series) -> tuple[list[float], list[float]]:
    pairs = [(t, v) for t, v in zip(series.times, series.values, strict=True)
             if math.isfinite(v)]
    return [t for t, _ in pairs], [v for _, v in pairs]


def _time_axis(ax: Axes, span: tuple[float, float]) -> None:
    """Unix seconds on the x axis, labelled as UTC clock times."""
    seconds = span[1] - span[0]
    fmt = "%H:%M:%S" if seconds < 600 else "%H:%M" if seconds < 2 * 86400 else "%m-%d %H:%M"
    ax.set_xlim(*span)
    ax.xaxis.set_major_locator(MaxNLocator(6))
    ax.xaxis.set_major_formatter(FuncFormatter(
        lambda v, _: datetime.fromtimestamp(v, timezone.utc).strftime(fmt)))
    ax.tick_params(axis="x", labelsize=7)


def _plot_timeseries(ax: Axes, panel: Mapping[str, Any], result: PanelResult) -> None:
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    dashed = _dashed_refs(panel)
    lines = 0
    for query in result.queries:
        for series in query.series:
            times, values = _finite(series)
            if not times:
                continue
            ax.plot(times, values, linewidth=1.2, linestyle="--" if query.ref in dashed else "-",
                    label=legend_text(query.legend, series.labels))
            lines += 1
    custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
    if custom.get("thresholdsStyle", {}).get("mode", "off") != "off":
        # a threshold far from the data (a 2h checkpoint interval over seconds of
        # data) would flatten every line: draw only those inside the data's range
        low, high = ax.get_ylim()
        for step in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]:
            if step.get("value") is not None and low <= step["value"] <= high:
                ax.axhline(step["value"], color=_COLORS.get(step["color"], step["color"]),
                           linestyle="--", linewidth=1)
        ax.set_ylim(low, high)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_value(v, unit)))
    ax.tick_params(axis="y", labelsize=7)
    if lines:
        ax.legend(fontsize=6, loc="upper left", ncol=2 if lines > 4 else 1, framealpha=0.6)


def _plot_state_timeline(ax: Axes, panel: Mapping[str, Any], result: PanelResult) -> None:
    mapping = _mapping(panel)
    rows: list[str] = []
    for query in result.queries:
        for series in query.series:
            y = len(rows)
            rows.append(legend_text(query.legend, series.labels))
            for i, (t, v) in enumerate(zip(series.times, series.values, strict=True)):
                if not math.isfinite(v):
                    continue
                end = series.times[i + 1] if i + 1 < len(series.times) else t
                text, color = mapping.get(_key(v), (_key(v), "text"))
                ax.broken_barh([(t, end - t)], (y - 0.4, 0.8),
                               color=_COLORS.get(color, color))
    ax.set_yticks(range(len(rows)), rows, fontsize=6)
    ax.set_ylim(-0.6, max(len(rows), 1) - 0.4)
    ax.invert_yaxis()
    handles = dict(mapping.values())
    for text, color in handles.items():
        ax.plot([], [], linewidth=6, color=_COLORS.get(color, color), label=text)
    ax.legend(fontsize=6, loc="lower left", ncol=min(len(handles), 7), framealpha=0.6)


def _plot_stat(ax: Axes, panel: Mapping[str, Any], result: PanelResult) -> None:
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    mapping = _mapping(panel)
    cells: list[tuple[str, str, str]] = []
    for query in result.queries:
        for series in query.series:
            _, values = _finite(series)
            if values:
                last = values[-1]
                text, color = mapping.get(_key(last), (format_value(last, unit),
                                                       _threshold_color(panel, last)))
                cells.append((legend_text(query.legend, series.labels), text, color))
    ax.set_axis_off()
    per_row = max(1, min(len(cells), 4))
    rows = math.ceil(len(cells) / per_row) or 1
    for i, (name, text, color) in enumerate(cells[:16]):
        col, row = i % per_row, i // per_row
        x, y = (col + 0.5) / per_row, 1 - (row + 0.5) / rows
        ax.text(x, y, f"{text}\n{name}", ha="center", va="center", fontsize=8,
                transform=ax.transAxes,
                bbox={"boxstyle": "round", "facecolor": _COLORS.get(color, color),
                      "alpha": 0.8})


def _plot_table(ax: Axes, result: PanelResult) -> None:
    seen: dict[str, None] = {}
    for query in result.queries:
        for series in query.series:
            labels = {k: v for k, v in sorted(series.labels.items()) if k != "__name__"}
            seen[", ".join(f"{k}={v}" for k, v in labels.items())] = None
    ax.set_axis_off()
    lines = list(seen)[:12] + ([f"… {len(seen) - 12} more"] if len(seen) > 12 else [])
    ax.text(0.01, 0.98, "\n".join(lines), ha="left", va="top", fontsize=6,
            family="monospace", transform=ax.transAxes)


def _draw(fig: Figure, model: Mapping[str, Any], results: list[PanelResult],
          span: tuple[float, float]) -> None:
    height = max([p["gridPos"]["y"] + p["gridPos"]["h"] for p in model.get("panels", [])] or [1])
    by_id = {p.id: p for p in results}

    def box(grid: Mapping[str, int], pad_top: float) -> tuple[float, float, float, float]:
        # room for the y tick labels on the left and the last time label on the right
        left = grid["x"] / 24 + 0.045
        width = grid["w"] / 24 - 0.06
        top = 1 - grid["y"] / height - pad_top / height
        bottom = 1 - (grid["y"] + grid["h"]) / height + 0.9 / height
        return left, bottom, width, top - bottom

    fig.suptitle(model.get("title", ""), fontsize=14, y=1 - 0.2 / height)
    for panel in model.get("panels", []):
        if panel.get("type") == "row":
            y = 1 - (panel["gridPos"]["y"] + 0.6) / height
            fig.text(0.005, y, panel.get("title", ""), fontsize=11, weight="bold")
    for panel in jsonmodel.data_panels(model):
        result = by_id[panel["id"]]
        ax = fig.add_axes(box(panel["gridPos"], 0.7))
        ax.set_title(panel["title"], fontsize=8, loc="left")
        if result.empty:
            ax.set_axis_off()
            error = next((q.error for q in result.queries if q.error), "")
            ax.text(0.5, 0.5, "No data" + (f"\n{error[:80]}" if error else ""),
                    ha="center", va="center", color="#8e8e8e", transform=ax.transAxes)
            continue
        if result.kind == "state-timeline":
            _plot_state_timeline(ax, panel, result)
        elif result.kind == "stat":
            _plot_stat(ax, panel, result)
        elif result.kind == "table":
            _plot_table(ax, result)
        else:
            _plot_timeseries(ax, panel, result)
        if result.kind in ("timeseries", "state-timeline"):
            _time_axis(ax, span)


def query_panels(model: Mapping[str, Any], prometheus: Prometheus, start: float, end: float,
                 values: Mapping[str, Value], step: float,
                 scrape_interval: float) -> list[PanelResult]:
    """Run every panel's queries as Grafana would; errors are kept, not raised."""
    substitutions: dict[str, Value] = {**builtins(end - start, step, scrape_interval),
                                       **values}
    results = []
    for panel in jsonmodel.data_panels(model):
        queries = []
        for target in jsonmodel.targets(panel):
            expr = interpolate(target["expr"], substitutions)
            query = QueryResult(target["refId"], expr, target.get("legendFormat", ""))
            try:
                query.series = prometheus.query_range(expr, start, end, step)
            except QueryError as exc:
                query.error = str(exc)
            queries.append(query)
        results.append(PanelResult(panel["id"], panel["title"], panel["type"], panel["gridPos"],
                                   queries))
    return results


def render_dashboard(model: Mapping[str, Any] | Path, prometheus_url: str, start: float,
                     end: float, output_dir: Path = DEFAULT_OUTPUT_DIR, *,
                     variables: Mapping[str, Value] | None = None,
                     scrape_interval: float = 15.0, step: float | None = None) -> RenderResult:
    """Query and plot one dashboard into ``output_dir/<uid>.png``.

    ``variables`` override what Grafana would pick (like ``var-job=…`` in a
    link); ``scrape_interval`` is the data source's, for ``$__rate_interval``.
    """
    if isinstance(model, Path):
        model = jsonmodel.load(model)
    if end <= start:
        raise ValueError(f"empty time range: start {start} >= end {end}")
    step = step or max(1.0, round((end - start) / POINTS))
    prometheus = Prometheus(prometheus_url)
    values = resolve_variables(model, prometheus, start, end, variables)
    results = query_panels(model, prometheus, start, end, values, step, scrape_interval)
    height = max([p["gridPos"]["y"] + p["gridPos"]["h"] for p in model.get("panels", [])] or [1])
    fig = Figure(figsize=(24 * COLUMN_INCHES, height * ROW_INCHES + 0.5), dpi=80)
    _draw(fig, model, results, (start, end))
    output_dir.mkdir(parents=True, exist_ok=True)
    png = output_dir / f"{model['uid']}.png"
    fig.savefig(png)
    return RenderResult(model["uid"], model.get("title", ""), png, values, results)


def render_all(prometheus_url: str, start: float, end: float,
               output_dir: Path = DEFAULT_OUTPUT_DIR,
               dashboards_dir: Path = DEFAULT_DASHBOARDS_DIR, *,
               variables: Mapping[str, Mapping[str, Value]] | None = None,
               scrape_interval: float = 15.0) -> list[RenderResult]:
    """Render every ``*.json`` dashboard in ``dashboards_dir``; ``variables`` by uid."""
    results = []
    for path in sorted(dashboards_dir.glob("*.json")):
        model = jsonmodel.load(path)
        results.append(render_dashboard(model, prometheus_url, start, end, output_dir,
                                        variables=(variables or {}).get(model["uid"]),
                                        scrape_interval=scrape_interval))
    return results


def _seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)?", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30s, 15m, 6h")
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2) or "s"]
    return float(match.group(1)) * scale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grafana_render.render_png",
                                     description="Plot every dashboard panel from Prometheus.")
    parser.add_argument("--prometheus.url", dest="url", required=True, metavar="URL")
    parser.add_argument("--since", type=_seconds, default=3600.0, metavar="DURATION",
                        help="time range ending now (default 1h); ignored with --start")
    parser.add_argument("--start", type=float, default=None, metavar="UNIX_TIME")
    parser.add_argument("--end", type=float, default=None, metavar="UNIX_TIME")
    parser.add_argument("--scrape-interval", type=_seconds, default=15.0, metavar="DURATION",
                        help="the data source's scrape interval, for $__rate_interval")
    parser.add_argument("--dashboards-dir", type=Path, default=DEFAULT_DASHBOARDS_DIR)
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--fail-on-empty", action="store_true",
                        help="exit 1 when a panel returned no data")
    args = parser.parse_args(argv)
    end = args.end if args.end is not None else time.time()
    start = args.start if args.start is not None else end - args.since
    results = render_all(args.url, start, end, args.output_dir, args.dashboards_dir,
                         scrape_interval=args.scrape_interval)
    for result in results:
        print(f"wrote {result.png} ({len(result.panels)} panels)")
        for title in result.empty_panels:
            error = result.errors.get(title)
            print(f"no data: {result.uid}: {title}" + (f" ({error})" if error else ""))
    return 1 if args.fail_on_empty and any(r.empty_panels for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
