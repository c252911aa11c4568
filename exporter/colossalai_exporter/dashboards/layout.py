"""Place rows and panels on Grafana's 24-column grid and number them.

A shelf packing: each row header takes a full-width line of height 1; its
panels follow left to right, and a panel that would cross column 24 starts a
new shelf below the tallest panel of the current one. Shelves never overlap,
so a definition only chooses widths and heights. Ids count from 1 in reading
order, so they are stable as long as the definition is.
"""

from __future__ import annotations

from typing import Any

from colossalai_exporter.dashboards.model import GRID_COLUMNS, Row


def place(rows: tuple[Row, ...]) -> list[dict[str, Any]]:
    """The dashboard's ``panels`` list: row panels, each followed by its panels."""
    out: list[dict[str, Any]] = []
    y = 0
    next_id = 1
    for row in rows:
        out.append({"collapsed": False, "gridPos": {"h": 1, "w": GRID_COLUMNS, "x": 0, "y": y},
                    "id": next_id, "panels": [], "title": row.title, "type": "row"})
        next_id += 1
        y += 1
        x, shelf = 0, 0
        for panel in row.panels:
            if x + panel.w > GRID_COLUMNS:
                y += shelf
                x, shelf = 0, 0
            out.append(panel.to_json(next_id, {"h": panel.h, "w": panel.w, "x": x, "y": y}))
            next_id += 1
            x += panel.w
            shelf = max(shelf, panel.h)
        y += shelf
    return out
