"""What an Xid means and what to do about it, from the catalog in xid_catalog.yml.

The gpu collector labels every Xid it counts with its tier and action, so that the
rules page on the tier and the page says the action in words. A code the catalog
does not list (a newer driver's) is tier ``unknown``, action ``look_up``: a warning,
never silence.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Final

CATALOG: Final = Path(__file__).with_name("xid_catalog.yml")
TIERS: Final = ("critical", "warning", "application", "unknown")
ACTIONS: Final = ("drain_reboot", "drain_reset_gpu", "drain_check_memory", "drain_check_nvlink",
                  "replace_gpu", "reset_when_drained", "read_recovery_action", "restart_job",
                  "none", "look_up")


@dataclass(frozen=True)
class XidClass:
    tier: str
    action: str
    what: str


UNKNOWN: Final = XidClass("unknown", "look_up", "not in this agent's Xid catalog")


@cache
def catalog(path: Path = CATALOG) -> dict[int, XidClass]:
    """The catalog, checked: every entry has a known tier and action and says what it is
    (a broken catalog is a bug of this package, so it fails loudly and early). Read at
    the first Xid, not at start-up: the agent's first scrape does not wait for PyYAML."""
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    out = {}
    for code, entry in data.items():
        xid = XidClass(str(entry["tier"]), str(entry["action"]), str(entry["what"]))
        if not isinstance(code, int) or xid.tier not in TIERS[:3] \
                or xid.action not in ACTIONS[:-1] or not xid.what:
            raise ValueError(f"{path}: bad entry for Xid {code!r}: {entry!r}")
        out[code] = xid
    return out


def classify(code: int) -> XidClass:
    return catalog().get(code, UNKNOWN)
