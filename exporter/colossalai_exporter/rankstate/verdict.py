"""The verdict on a snapshot: stalled or not, and healthy as the tutorial's /health means it.

Pure functions of the snapshot, so that the node agent, reading a snapshot a frozen
rank wrote minutes ago, reaches the verdict the rank itself cannot.
"""

from __future__ import annotations

from colossalai_exporter.rankstate.schema import HEALTHY_PHASES, Snapshot


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


def healthy(snap: Snapshot) -> bool:
    """The tutorial's rule: a healthy phase, not stalled, kernels ready."""
    return snap.phase in HEALTHY_PHASES and not snap.stalled and snap.kernels_ready
