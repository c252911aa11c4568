"""What an Xid means and what to do about it, from the catalog in xid_catalog.yml.

The gpu collector labels every Xid it counts with its tier and action, so that the
rules page on the tier and the page says the action in words (the rules generator
and ``node check`` take the words from the same catalog). A code the catalog does
not list (a newer driver's) is tier ``unknown``, action ``look_up``: a warning,
never silence. The driver also logs every Xid in the kernel log, which is where
``node check`` finds the ones from before it ran.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Final

CATALOG: Final = Path(__file__).with_name("xid_catalog.yml")
TIERS: Final = ("critical", "warning", "application", "unknown")
LOOK_UP: Final = "look_up"
LOOK_UP_WORDS: Final = "look the code up in NVIDIA's Xid catalog"
# "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off
# the bus." (older drivers: "NVRM: Xid (PCI:0000:86:00): 13, Graphics Exception: …")
_KERNEL_XID = re.compile(r"NVRM: Xid \(PCI:(?P<pci>[0-9A-Fa-f:.]+)\): (?P<code>\d+)\b")


@dataclass(frozen=True)
class XidClass:
    tier: str
    action: str
    what: str


UNKNOWN: Final = XidClass("unknown", LOOK_UP, "not in this agent's Xid catalog")


@dataclass(frozen=True)
class KernelXid:
    """An Xid as the driver logged it in the kernel log."""

    when: float
    pci: str  # the GPU's PCI address, as the log names it
    code: int


@cache
def _load(path: Path = CATALOG) -> tuple[dict[str, str], dict[int, XidClass]]:
    """The catalog, checked: every code has a known tier and an action of the catalog's
    and says what it is (a broken catalog is a bug of this package, so it fails loudly).
    Read at the first Xid, not at start-up: the agent's first scrape does not wait for
    PyYAML."""
    import yaml

    data: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    actions = {str(key): str(words) for key, words in data["actions"].items()}
    codes = {}
    for code, entry in data["codes"].items():
        xid = XidClass(str(entry["tier"]), str(entry["action"]), str(entry["what"]))
        if not isinstance(code, int) or xid.tier not in TIERS[:3] \
                or xid.action not in actions or not xid.what:
            raise ValueError(f"{path}: bad entry for Xid {code!r}: {entry!r}")
        codes[code] = xid
    return actions, codes


def catalog() -> dict[int, XidClass]:
    return _load()[1]


def actions() -> dict[str, str]:
    """Every action key with the words a page uses for it, ``look_up`` last."""
    return {**_load()[0], LOOK_UP: LOOK_UP_WORDS}


def classify(code: int) -> XidClass:
    return catalog().get(code, UNKNOWN)


def kernel_xids(records: Iterable[tuple[float, str]]) -> list[KernelXid]:
    """The Xids among kernel-log records (node/kmsg.py)."""
    found = []
    for when, text in records:
        match = _KERNEL_XID.search(text)
        if match:
            found.append(KernelXid(when, match["pci"], int(match["code"])))
    return found
