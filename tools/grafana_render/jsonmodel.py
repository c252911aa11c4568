"""Reading a dashboard's JSON model: its data panels, their queries, its variables.

Works on the JSON (not on the Python definitions) so that the renderer and
the tests look at exactly what users import.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

_LABEL_VALUES = re.compile(
    r"^\s*label_values\(\s*(?:(?P<query>.*\S)\s*,\s*)?(?P<label>\w+)\s*\)\s*$", re.DOTALL)


def load(path: Path) -> dict[str, Any]:
    model: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return model


def data_panels(model: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every panel that queries (rows left out, collapsed rows' panels included)."""
    out: list[dict[str, Any]] = []
    for panel in model.get("panels", []):
        if panel.get("type") == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def targets(panel: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [t for t in panel.get("targets", []) if t.get("expr")]


def query_variables(model: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [v for v in model.get("templating", {}).get("list", []) if v.get("type") == "query"]


def variable_query(variable: Mapping[str, Any]) -> tuple[str | None, str]:
    """``(series selector or None, label)`` of a ``label_values(...)`` query variable."""
    query = variable.get("query")
    text = query.get("query", "") if isinstance(query, dict) else str(query or "")
    match = _LABEL_VALUES.match(text)
    if match is None:
        raise ValueError(f"variable {variable.get('name')!r}: not a label_values() query: "
                         f"{text!r}")
    return match.group("query"), match.group("label")


def expressions(model: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """``(where, PromQL)`` for every query: panels, annotations and variables."""
    for panel in data_panels(model):
        for target in targets(panel):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for annotation in model.get("annotations", {}).get("list", []):
        if annotation.get("expr"):
            yield f"annotation {annotation['name']!r}", annotation["expr"]
    for variable in query_variables(model):
        selector, _ = variable_query(variable)
        if selector:
            yield f"variable {variable['name']!r}", selector
