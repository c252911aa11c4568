"""The dashboard object around the panels: uid, variables, inputs, links, schema version.

One JSON file serves both ways of loading it:

* **Import screen** (Dashboards → New → Import): Grafana reads ``__inputs``,
  asks for a Prometheus data source for ``DS_PROMETHEUS`` and replaces every
  ``${DS_PROMETHEUS}`` in the file with its uid. The only such place is the
  default of the ``datasource`` variable, so the picked data source becomes
  that default.
* **Provisioning** (grafana/provisioning/): Grafana ignores ``__inputs`` and
  substitutes nothing. Panels still work, because none names a data source:
  each uses ``${datasource}``, and the variable falls back to the first
  Prometheus data source when its default names none.

``SCHEMA_VERSION`` 41 is what Grafana 12.0 and 12.1 write. The two newest
migrations before it (40: ``refresh`` must be a string; 41: drop
``timepicker.time_options``) are no-ops for these files, and an older Grafana
11 (schema 39) opens a newer version unchanged: its migrator only runs steps
above the file's version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from colossalai_exporter.dashboards.layout import place
from colossalai_exporter.dashboards.model import DATASOURCE, Row
from colossalai_exporter.dashboards.variables import DS_INPUT

SCHEMA_VERSION: Final = 41
TAG: Final = "colossalai"

# Panel plugins these dashboards use, for the import screen's "requires" list.
_PANEL_NAMES: Final = {"timeseries": "Time series", "stat": "Stat",
                       "state-timeline": "State timeline", "table": "Table"}


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[dict[str, Any], ...]
    rows: tuple[Row, ...]
    # PromQL of the "firing alerts" annotation (markers on every time series)
    alerts_annotation: str
    tags: tuple[str, ...] = ()
    refresh: str = "30s"
    time_from: str = "now-6h"

    def to_json(self) -> dict[str, Any]:
        panels = place(self.rows)
        kinds = sorted({p["type"] for p in panels if p["type"] != "row"})
        return {
            "__inputs": [{
                "name": DS_INPUT,
                "label": "Prometheus",
                "description": "The Prometheus that scrapes colossalai-exporter",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }],
            "__requires": [
                {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "11.0.0"},
                {"type": "datasource", "id": "prometheus", "name": "Prometheus",
                 "version": "1.0.0"},
                *({"type": "panel", "id": k, "name": _PANEL_NAMES[k], "version": ""}
                  for k in kinds),
            ],
            "annotations": {"list": [{
                "datasource": dict(DATASOURCE),
                "enable": True,
                "expr": self.alerts_annotation,
                "hide": False,
                "iconColor": "red",
                "name": "Firing alerts",
                "step": "60s",
                "tagKeys": "severity",
                "textFormat": "{{ alertname }} {{ severity }}",
                "titleFormat": "{{ alertname }}",
                "useValueForTime": False,
            }]},
            "description": self.description,
            "editable": True,
            "fiscalYearStartMonth": 0,
            "graphTooltip": 1,  # shared crosshair: line up a stall across panels
            "id": None,
            "links": [{
                "asDropdown": True,
                "icon": "external link",
                "includeVars": False,  # each dashboard's job is a different scrape job
                "keepTime": True,
                "tags": [TAG],
                "targetBlank": False,
                "title": "ColossalAI dashboards",
                "tooltip": "",
                "type": "dashboards",
                "url": "",
            }],
            "panels": panels,
            "refresh": self.refresh,
            "schemaVersion": SCHEMA_VERSION,
            "tags": [TAG, *self.tags],
            "templating": {"list": list(self.variables)},
            "time": {"from": self.time_from, "to": "now"},
            "timepicker": {},
            "timezone": "",
            "title": self.title,
            "uid": self.uid,
            "version": 1,
            "weekStart": "",
        }
