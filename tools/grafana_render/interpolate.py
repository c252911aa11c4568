"""Grafana's variable substitution in PromQL, as far as these dashboards use it.

Grafana replaces ``$name``, ``${name}`` and ``[[name]]`` before a query leaves
for Prometheus: a single-valued variable as its raw text, a multi-valued one
(or All without a custom all value) as ``(a|b)`` with regex characters
escaped, and the built-ins ``$__interval``, ``$__rate_interval`` and
``$__range`` from the time range and the data source's scrape interval.
The renderer uses this to send what Grafana would send, and the tests to
hand promtool and the catalogue check real PromQL.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from colossalai_exporter.rulesgen.promql import regex_alternatives

Value = str | Sequence[str]

_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def duration(seconds: float) -> str:
    """A PromQL duration for whole seconds (``90`` -> ``90s``; at least ``1s``)."""
    return f"{max(1, round(seconds))}s"


def builtins(range_seconds: float, step_seconds: float,
             scrape_interval_seconds: float = 15.0) -> dict[str, str]:
    """Grafana's built-in variables for a query over ``range_seconds`` at ``step_seconds``.

    ``$__rate_interval`` is Grafana's: the larger of ``$__interval`` plus one
    scrape interval and four scrape intervals, so a rate always has samples.
    """
    rate = max(step_seconds + scrape_interval_seconds, 4 * scrape_interval_seconds)
    return {
        "__interval": duration(step_seconds),
        "__interval_ms": str(round(step_seconds * 1000)),
        "__rate_interval": duration(rate),
        "__range": duration(range_seconds),
        "__range_s": str(round(range_seconds)),
        "__range_ms": str(round(range_seconds * 1000)),
    }


def format_value(value: Value) -> str:
    """One variable's value as Grafana's Prometheus data source writes it into a query."""
    if isinstance(value, str):
        return value
    return "(" + regex_alternatives(list(value)) + ")"


def interpolate(expr: str, values: Mapping[str, Value]) -> str:
    """``expr`` with every variable in ``values`` replaced; unknown ones are left alone."""
    def sub(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        if name not in values:
            return match.group(0)
        return format_value(values[name])

    return _VARIABLE.sub(sub, expr)


def variables_in(expr: str) -> set[str]:
    """Names of the variables ``expr`` refers to."""
    return {m.group(1) or m.group(2) or m.group(3) for m in _VARIABLE.finditer(expr)}
