"""Ask a real Prometheus what a dashboard would show: variables first, then every query.

:class:`Prometheus` is a thin client of the HTTP API (``/api/v1/query_range``
and ``/api/v1/label/<name>/values``). :func:`resolve_variables` picks each
template variable's value the way Grafana does when a dashboard opens with no
URL parameters: All for multi-valued variables that default to All, else the
first option in the variable's sort order, each query seeing the variables
before it (``rank`` depends on ``job``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import requests

from colossalai_exporter.dashboards.variables import SORT_NUMERIC
from grafana_render import jsonmodel
from grafana_render.interpolate import Value, interpolate


class QueryError(Exception):
    """Prometheus refused a query (bad PromQL, a timeout): the message is its error."""


@dataclass(frozen=True)
class Series:
    """One series of a range query: its labels and its samples."""

    labels: dict[str, str]
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


class Prometheus:
    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()

    def _get(self, path: str, params: dict[str, Any]) -> Any:
        response = self.session.get(self.url + path, params=params, timeout=self.timeout)
        try:
            body = response.json()
        except ValueError:
            raise QueryError(f"HTTP {response.status_code} from {path}: not JSON") from None
        if body.get("status") != "success":
            raise QueryError(f"{body.get('errorType', 'error')}: {body.get('error', body)}")
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        data = self._get("/api/v1/query_range",
                         {"query": expr, "start": start, "end": end, "step": step})
        if data.get("resultType") != "matrix":
            raise QueryError(f"expected a matrix, got {data.get('resultType')}")
        out = []
        for item in data["result"]:
            points = item.get("values", [])
            out.append(Series(dict(item["metric"]), [float(t) for t, _ in points],
                              [float(v) for _, v in points]))
        return out

    def label_values(self, label: str, match: str | None, start: float,
                     end: float) -> list[str]:
        params: dict[str, Any] = {"start": start, "end": end}
        if match:
            params["match[]"] = match
        values: list[str] = self._get(f"/api/v1/label/{label}/values", params)
        return values


def _sorted(values: list[str], sort: int) -> list[str]:
    if sort == SORT_NUMERIC:
        def key(v: str) -> tuple[int, float, str]:
            try:
                return (0, float(v), v)
            except ValueError:
                return (1, 0.0, v)
        return sorted(values, key=key)
    return sorted(values)


def resolve_variables(model: Mapping[str, Any], prometheus: Prometheus, start: float,
                      end: float, overrides: Mapping[str, Value] | None = None,
                      ) -> dict[str, Value]:
    """Every query variable's value for ``[start, end]``; ``overrides`` win (like ``var-x=``)."""
    overrides = overrides or {}
    values: dict[str, Value] = {}
    for variable in jsonmodel.query_variables(model):
        name = variable["name"]
        if name in overrides:
            values[name] = overrides[name]
            continue
        selector, label = jsonmodel.variable_query(variable)
        match = interpolate(selector, values) if selector else None
        options = _sorted(prometheus.label_values(label, match, start, end),
                          int(variable.get("sort", 0)))
        current = variable.get("current") or {}
        wants_all = variable.get("includeAll") and "$__all" in (current.get("value") or [])
        if wants_all:
            values[name] = variable.get("allValue") or options
        else:
            values[name] = options[0] if options else ""
    return values
