"""Template variables: the data source, and label values such as job, instance, rank, gpu.

Names matter: the alerts' ``dashboard_url`` annotations set ``var-job``,
``var-instance`` and ``var-rank`` (see rulesgen/common.py), so these names are
part of the link contract and a test checks both sides agree.

Queries are stored in Grafana's classic string form (``label_values(metric{…},
label)``) with the same text in ``definition``: every Grafana since 7 reads
it, and newer ones convert it to their query-editor object on load.
"""

from __future__ import annotations

from typing import Any, Final

from colossalai_exporter.dashboards.model import DATASOURCE

# The import screen's name for the chosen data source; see dashboard.py.
DS_INPUT: Final = "DS_PROMETHEUS"

# Grafana's variable sort codes.
SORT_ALPHA: Final = 1
SORT_NUMERIC: Final = 3
# Refresh the options whenever the time range changes: instances come and go.
REFRESH_ON_TIME_RANGE: Final = 2


def datasource() -> dict[str, Any]:
    """The ``datasource`` variable every panel uses.

    Its default is ``${DS_PROMETHEUS}``: the import screen replaces that with
    the data source the user picks. Provisioning replaces nothing; Grafana then
    finds no data source of that name and selects the first Prometheus one,
    which is the provisioned one (grafana/provisioning/datasources/).
    """
    return {
        "current": {"selected": False, "text": "${" + DS_INPUT + "}",
                    "value": "${" + DS_INPUT + "}"},
        "hide": 0,
        "includeAll": False,
        "label": "Data source",
        "multi": False,
        "name": "datasource",
        "options": [],
        "query": "prometheus",
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
        "type": "datasource",
    }


def label_values(name: str, label: str, query: str, *, multi: bool = False,
                 numeric: bool = False, all_value: str | None = None) -> dict[str, Any]:
    """A query variable over ``label_values(query, label)``.

    ``multi`` variables default to All. ``all_value`` (".*") keeps the query
    short on large fleets instead of listing every value; leave it unset where
    the regex must stay within the listed values (jobs: the node agent
    re-serves training series under its own job).
    """
    definition = f"label_values({query}, {label})"
    variable: dict[str, Any] = {
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if multi else {},
        "datasource": dict(DATASOURCE),
        "definition": definition,
        "hide": 0,
        "includeAll": multi,
        "label": name.replace("_", " ").capitalize(),
        "multi": multi,
        "name": name,
        "options": [],
        "query": definition,
        "refresh": REFRESH_ON_TIME_RANGE,
        "regex": "",
        "skipUrlSync": False,
        "sort": SORT_NUMERIC if numeric else SORT_ALPHA,
        "type": "query",
    }
    if all_value is not None:
        variable["allValue"] = all_value
    return variable
