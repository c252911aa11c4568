"""Stall evidence: what a rank leaves behind the moment it is first seen stalled.

The stacks of all its threads (always, where there is a run directory) and
NCCL's flight recorder (where torch has one): the rank the others wait for is
read from these after the run is gone. Written once per stall, from the
publisher's thread, never from the training thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from colossalai_exporter.training import flight_recorder
from colossalai_exporter.training.stacks import write_stacks

log = logging.getLogger("colossalai_exporter.training")


class StallEvidence:
    def __init__(self, rank: int, on_error: Callable[[str, BaseException], None]) -> None:
        """``on_error(where, exc)``: how a failure to write is counted (never raised)."""
        self._rank = rank
        self._on_error = on_error
        self.files: list[Path] = []  # written so far (stacks, flight recorder dumps)

    def write(self, run_dir: Path | None, reason: str) -> None:
        rank = self._rank
        if run_dir is None:
            log.warning("rank %d %s (no run directory: no stack dump)", rank, reason)
            return
        try:
            path = write_stacks(run_dir, rank, reason)
        except Exception as exc:
            self._on_error("stacks", exc)
            return
        self.files.append(path)
        log.warning("rank %d %s; stacks of all threads written to %s", rank, reason, path)
        try:
            recorded = flight_recorder.dump(run_dir, rank)
        except Exception as exc:
            self._on_error("stacks", exc)
            return
        if recorded is not None:
            self.files.append(recorded)
            log.warning("rank %d: NCCL flight recorder dumped to %s", rank, recorded)
