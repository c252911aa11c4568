"""Metric names a PromQL expression reads, so tests can hold rules and dashboards to the catalogue.

Not a PromQL parser: it removes everything that can contain identifiers that
are not metric names (string literals, label matchers, ranges, grouping label
lists, ``offset``/``@`` modifiers), then keeps the identifiers that are not
functions, aggregators or keywords. That is enough for the rules in this
repository, and it errs towards reporting a name (a test then fails loudly)
rather than missing one.

>>> sorted(metric_names('sum by (job) (rate(foo_total{job="a"}[5m])) / on (job) bar > 1e9'))
['bar', 'foo_total']
"""

from __future__ import annotations

import re

KEYWORDS = frozenset({
    "and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left",
    "group_right", "offset", "inf", "nan", "start", "end",
    # aggregation operators (may be followed by `by (...)` before their parenthesis)
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_MODIFIER = re.compile(r"\b(?:offset\s+-?[0-9a-z]+|@\s*(?:[0-9.]+|start\s*\(\s*\)|end\s*\(\s*\)))")
_IDENT = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")
_COMMENT = re.compile(r"#[^\n]*")


def metric_names(expr: str) -> set[str]:
    """Every metric (or recording rule) name ``expr`` selects."""
    text = _STRING.sub(" ", expr)
    text = _COMMENT.sub(" ", text)
    text = _BRACES.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _MODIFIER.sub(" ", text)
    names: set[str] = set()
    for match in _IDENT.finditer(text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in KEYWORDS:
            continue
        names.add(name)
    return names


_PRINTF = re.compile(r'printf\s+"((?:[^"\\]|\\.)*)"')


def template_queries(template: str) -> list[str]:
    """The PromQL of every ``printf "..." ... | query`` in an annotation template."""
    return [m.group(1).replace('\\"', '"') for m in _PRINTF.finditer(template)
            if "|" in template[m.end():].split("}}", 1)[0] and "query" in
            template[m.end():].split("}}", 1)[0]]
