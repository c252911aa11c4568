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

from colossalai_exporter.training.snapshot import Snapshot, read_all_snapshots
from colossalai_exporter.training.state import judge

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


def agent_view(metrics_url: str) -> str:
    """The node agent's verdict on each rank: ``rank 0 up, stalled; rank 1 up``."""
    try:
        response = requests.get(metrics_url, timeout=HTTP_TIMEOUT)
        response.raise_for_status()
    except requests.RequestException as exc:
        return f"unreachable ({type(exc).__name__})"
    up: dict[str, float] = {}
    stalled: dict[str, float] = {}
    for fam in text_string_to_metric_families(response.text):
        for sample in fam.samples:
            if sample.name == "colossalai_rank_up":
                up[sample.labels["rank"]] = sample.value
            elif sample.name == "colossalai_training_stalled":
                stalled[sample.labels["rank"]] = sample.value
    if not up:
        return "no ranks seen yet"
    words = []
    for rank in sorted(up, key=int):
        word = f"rank {rank} {'up' if up[rank] else 'DOWN'}"
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

    def snapshots(self) -> list[Snapshot]:
        return read_all_snapshots(self.run_dir)

    def look(self, now: float | None = None) -> list[str]:
        """The lines to print now: one per rank, then any events since the last look."""
        now = time.time() if now is None else now
        lines = []
        for snap in self.snapshots():
            rank, steps = snap.rank, snap.steps
            previous = self._last.get(rank)
            rate = None
            if previous and now > previous[0]:
                rate = (steps - previous[1]) / (now - previous[0])
            self._last[rank] = (now, steps)
            lines.append(rank_line(snap, now, rate))
        lines += self.events()
        return lines

    def events(self) -> list[str]:
        lines = []
        if self.health_url:
            state = health(self.health_url)
            # A change of status code is news; the reason's seconds ticking up is not.
            if self._health is None or state[0] != self._health[0]:
                code, reason = state
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
            if view != self._agent:
                lines.append(f"node agent sees: {view}")
                self._agent = view
        return lines


def describe(snaps: list[Snapshot]) -> list[str]:
    """Final words per rank, for when the run is over."""
    lines = []
    for snap in snaps:
        checkpoint = snap.checkpoint.last_step
        line = (f"rank {snap.rank} {snap.phase} after {snap.steps} steps, last "
                f"checkpoint at step {checkpoint if checkpoint is not None else '-'}")
        if snap.error:
            line += f" ({snap.error})"
        lines.append(line)
    return lines
