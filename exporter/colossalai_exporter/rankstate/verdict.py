"""The verdict on a snapshot: stalled or not, and healthy as the tutorial's /health means it.

Pure functions of the snapshot, so that the node agent, reading a snapshot a frozen
rank wrote minutes ago, reaches the verdict the rank itself cannot.
"""

from __future__ import annotations

import re
from typing import Final

from colossalai_exporter.rankstate.schema import HEALTHY_PHASES, LastError, Snapshot

#: A collective that timed out, as the backends say it: gloo's own error and
#: ProcessGroupNCCL's watchdog's. Unlike a peer's closed connection (which a
#: preemption's staggered signals also cause), the rank waited the process group's
#: whole timeout for a peer that never came: a peer that hung.
COLLECTIVE_TIMEOUT: Final = (
    r"timed out waiting \d+ ?ms for (?:recv|send)",
    r"watchdog caught collective operation timeout",
)
_COLLECTIVE_TIMEOUT = re.compile("|".join(COLLECTIVE_TIMEOUT), re.IGNORECASE)


def judge(snap: Snapshot, now: float) -> tuple[bool, str]:
    """(stalled, reason) for a snapshot at wall-clock time ``now``.

    A pure function of the snapshot so that the node agent, reading a snapshot a
    frozen rank wrote minutes ago, reaches the verdict the rank itself cannot.
    """
    phase = snap.phase
    if phase == "failed":
        return False, f"run failed: {snap.error or 'unknown error'}"
    if phase == "finished":
        return False, "run finished"
    idle = now - snap.progress
    timeout = snap.timeout
    if idle > timeout:
        what = "no step completed" if phase == "training" else f"phase {phase} unchanged"
        return True, (f"stalled in phase {phase}: {what} for {idle:.1f}s "
                      f"(budget {timeout:.1f}s)")
    if phase not in HEALTHY_PHASES:
        return False, f"phase is {phase}"
    if not snap.kernels_ready:
        return False, "kernels not ready"
    return False, ""


def timed_out_in_collective(error: LastError) -> bool:
    """Whether ``error`` is a collective that timed out waiting for a peer."""
    return _COLLECTIVE_TIMEOUT.search(error.message) is not None


def healthy(snap: Snapshot) -> bool:
    """The tutorial's rule: a healthy phase, not stalled, kernels ready."""
    return snap.phase in HEALTHY_PHASES and not snap.stalled and snap.kernels_ready
