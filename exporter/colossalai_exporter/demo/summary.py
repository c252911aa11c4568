"""What the demo prints while it runs: one line per rank, and the moments that matter.

Everything here is read from outside the training processes, the way the node
agent sees them: the ranks' snapshot files, rank 0's ``/health`` and the
agent's ``/metrics``. Every HTTP call has a short timeout, so a wedged server
makes the summary say "unreachable" instead of freezing it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from colossalai_exporter.node.ranks import process_state
from colossalai_exporter.rankstate.files import read_all_snapshots
from colossalai_exporter.rankstate.schema import ACTIVE_PHASES, Snapshot
from colossalai_exporter.rankstate.verdict import judge

HTTP_TIMEOUT = 2.0


def rank_line(snap: Snapshot, now: float, rate: float | None) -> str:
    """``rank 0  training  step 120  9.7 steps/s  loss 0.0213  last step 0.1s ago (budget 10s)``."""
    stalled, reason = judge(snap, now)
    loss = snap.loss
    parts = [f"rank {snap.rank}", f"{snap.phase:<13}", f"step {snap.steps:>5}",
             f"{rate:5.1f} steps/s" if rate is not None else "    - steps/s",
             f"loss {loss:.4f}" if loss is not None else "loss -"]
    if snap.last_step:
        parts.append(f"last step {max(0.0, now - snap.last_step):.1f}s ago "
                     f"(budget {snap.timeout:.0f}s)")
    if stalled:
        parts.append("STALLED")
    elif snap.phase == "failed":
        parts.append(reason)
    return "  ".join(parts)


def health(url: str) -> tuple[int | None, str]:
    """(status, reason) of a ``/health`` endpoint; (None, why) when unreachable."""
    try:
        response = requests.get(url, timeout=HTTP_TIMEOUT)
    except requests.RequestException as exc:
        return None, type(exc).__name__
    try:
        body = response.json()
    except ValueError:
        return response.status_code, response.text[:200]
    reason = body.get("reason") if isinstance(body, dict) else None
    status = body.get("status") if isinstance(body, dict) else None
    return response.status_code, str(reason or status or "")


NO_RANKS_YET = "no ranks seen yet"


def agent_view(metrics_url: str) -> str:
    """The node agent's verdict on each rank: ``rank 0 up, stalled; rank 1 up``."""
    try:
        response = requests.get(metrics_url, timeout=HTTP_TIMEOUT)
        response.raise_for_status()
    except requests.RequestException as exc:
        return f"unreachable ({type(exc).__name__})"
    up: dict[str, float] = {}
    stalled: dict[str, float] = {}
    phase: dict[str, str] = {}
    for fam in text_string_to_metric_families(response.text):
        for sample in fam.samples:
            if sample.name == "colossalai_rank_up":
                up[sample.labels["rank"]] = sample.value
            elif sample.name == "colossalai_training_stalled":
                stalled[sample.labels["rank"]] = sample.value
            elif sample.name == "colossalai_training_phase" and sample.value:
                phase[sample.labels["rank"]] = sample.labels["phase"]
    if not up:
        return NO_RANKS_YET
    words = []
    for rank in sorted(up, key=int):
        # A rank whose process ended after finishing (or failing) is not "down": the
        # agent's rank_up says the process is gone, its last phase says why.
        ended = phase.get(rank) if phase.get(rank) in ("finished", "failed") else None
        word = f"rank {rank} {ended or ('up' if up[rank] else 'DOWN')}"
        if stalled.get(rank):
            word += ", stalled"
        words.append(word)
    return "; ".join(words)


@dataclass
class Summary:
    """Remembers the previous look, to print rates and only the changes that matter."""

    run_dir: Path
    health_url: str | None
    agent_metrics_url: str | None
    _last: dict[int, tuple[float, int]] = field(default_factory=dict)
    _health: tuple[int | None, str] | None = None
    _evidence: set[Path] = field(default_factory=set)
    _agent: str | None = None
    #: rank 0's server answered once: "unreachable" before that is start-up, not news
    _reached: bool = False
    #: the snapshots the last look read (the demo's failure injection reads them too)
    seen: list[Snapshot] = field(default_factory=list)

    def snapshots(self) -> list[Snapshot]:
        return read_all_snapshots(self.run_dir)

    def look(self, now: float | None = None) -> list[str]:
        """The lines to print now: one per rank, then any events since the last look."""
        now = time.time() if now is None else now
        lines = []
        snaps = self.seen = self.snapshots()
        for snap in snaps:
            rank, steps = snap.rank, snap.steps
            previous = self._last.get(rank)
            rate = None
            if previous and now > previous[0]:
                rate = (steps - previous[1]) / (now - previous[0])
            self._last[rank] = (now, steps)
            lines.append(rank_line(snap, now, rate))
        lines += self.events(snaps)
        return lines

    def events(self, snaps: list[Snapshot] | None = None) -> list[str]:
        lines = []
        if self.health_url:
            state = health(self.health_url)
            code, reason = state
            # Not news: no server yet while rank 0 starts, or none any more once rank 0
            # has ended.
            quiet = code is None and (not self._reached or _rank0_ended(snaps or []))
            self._reached = self._reached or code is not None
            # A change of status code is news; the reason's seconds ticking up is not.
            if not quiet and (self._health is None or code != self._health[0]):
                if code is None:
                    lines.append(f"rank 0 /health is unreachable ({reason})")
                else:
                    lines.append(f"rank 0 /health is {code}" + (f": {reason}" if reason else ""))
                self._health = state
        for path in sorted(self.run_dir.glob("stacks-rank*.txt")):
            if path not in self._evidence:
                self._evidence.add(path)
                lines.append(f"stall evidence written: {path}")
        if self.agent_metrics_url:
            view = agent_view(self.agent_metrics_url)
            if view == NO_RANKS_YET and self._agent is None:
                return lines  # the ranks are starting: nothing to say yet
            if view != self._agent:
                lines.append(f"node agent sees: {view}")
                self._agent = view
        return lines


def _rank0_ended(snaps: list[Snapshot]) -> bool:
    """Rank 0 finished or failed: its server stops with it (the last snapshot says so
    before the server goes, TrainingMonitor.close)."""
    return any(snap.rank == 0 and snap.phase in ("finished", "failed") for snap in snaps)


def describe(snaps: list[Snapshot]) -> list[str]:
    """Final words per rank, for when the run is over."""
    lines = []
    for snap in snaps:
        checkpoint = snap.checkpoint.last_step
        line = (f"rank {snap.rank} {ending(snap)} after {snap.steps} steps, last "
                f"checkpoint at step {checkpoint if checkpoint is not None else '-'}")
        if snap.error:
            line += f" ({snap.error})"
        lines.append(line)
    return lines


def ending(snap: Snapshot) -> str:
    """The rank's phase, or how it ended where its process is gone while its last
    snapshot still says it was at work (the node agent's verdict, in words): a SIGKILL
    or the OOM killer leaves no word of its own."""
    if snap.phase not in ACTIVE_PHASES or process_state(snap.pid, snap.pid_start)[0]:
        return snap.phase
    if snap.interruption is not None:
        return f"ended by {snap.interruption.signal} in phase {snap.phase}"
    return f"killed in phase {snap.phase} (its process vanished with no error)"
