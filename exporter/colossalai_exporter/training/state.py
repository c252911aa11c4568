"""A rank's training state: the plain values the hot path updates, and the snapshot.

The hot path (a step finished) only assigns attributes of :class:`RankState`
and bumps list items: no locks, no system calls, no I/O. Everything else —
the budget, stall judgement, the JSON snapshot, metric families — is derived
from it off the hot path, by :meth:`RankState.snapshot`, into a typed
:class:`~colossalai_exporter.rankstate.schema.Snapshot` that is the same
in-process (rank-0 ``/metrics``) and on disk (the node agent's ``ranks``
collector), so both serve the same series.

Reads race benignly with the hot path: under the GIL each assignment is
atomic, and the histogram's count is summed from its buckets at read time so
an exposition is always self-consistent (its ``_sum`` may lag one step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final

import msgspec

from colossalai_exporter.rankstate.schema import (
    DEVICES,
    CheckpointState,
    GeminiState,
    HeartbeatState,
    Interruption,
    LastError,
    Snapshot,
)
from colossalai_exporter.rankstate.verdict import judge

# Step duration buckets, seconds: from 5 ms (small models, CPU tests) through typical
# GPU steps (0.1-10 s) to pipeline-parallel steps of minutes, ending at 600 s, the
# default NCCL collective timeout beyond which a step is a hang, not a slow step.
STEP_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                       60.0, 120.0, 300.0, 600.0)
RECENT_STEPS: Final = 128  # window the learned budget looks at (a power of two: cheap index)


@dataclass(frozen=True)
class Budgets:
    """How long each phase may go without progress before it counts as stalled. In
    phase training, progress is a completed step or the end of a wait for the other
    ranks (RankState.note_place).

    ``step`` is learned unless fixed: ``step_factor`` × the longest of the last
    128 step durations (the first step's only until a second completes; a step that
    held unannounced work is forgotten, training/unannounced.py), never below
    ``step_floor`` (nvidia-resiliency-ext learns about 5 × the longest interval).
    Until a step has completed the ``startup`` budget applies (model load, the first
    step's warm-up, torch.compile's first compile); a kernel load or JIT build (phase
    ``kernels``) has its own, ``kernels``, and so does a torch.compile recompile later
    in the run (phase ``compiling``, training/unannounced.py), ``compile``, and a data
    loader's start at an epoch's boundary (phase ``data_start``), ``data_start``.
    """

    step: float | None = None
    step_factor: float = 5.0
    step_floor: float = 60.0
    startup: float = 1800.0
    # Loading or JIT-building ColossalAI's kernels: 139 s for CPU Adam and the fused
    # optimizer on an H200 node with 16 build jobs (FACTS.md); a stale lock in the
    # build cache makes it wait for ever, which this budget turns into a stall.
    kernels: float = 1800.0
    checkpoint: float = 1800.0
    evaluation: float = 3600.0
    # A recompile mid-run (new shapes, a guard that failed): seconds for a small graph,
    # tens of minutes for a large model's with inductor's autotuning; one that waits on
    # a stale lock in a shared inductor cache never ends, which this budget turns into
    # a stall.
    compile: float = 1800.0
    # A data loader's iterator started again at an epoch's boundary: its workers
    # restarted (spawned ones import torch and get the dataset pickled), the sampler's
    # permutation of the whole dataset, each worker's first shard opened. Seconds to
    # minutes; ten minutes is NCCL's default collective timeout, beyond which the
    # other ranks would not wait for it either.
    data_start: float = 600.0

    def for_phase(self, phase: str, longest_recent_step: float | None) -> float:
        """The budget for ``phase`` given the longest recent step (None before any)."""
        if phase == "init":
            return self.startup
        if phase == "kernels":
            return self.kernels
        if phase == "checkpointing":
            return self.checkpoint
        if phase == "evaluating":
            return self.evaluation
        if phase == "compiling":
            return self.compile
        if phase == "data_start":
            return self.data_start
        if self.step is not None:
            return self.step
        if longest_recent_step is None:
            return self.startup
        return max(self.step_floor, self.step_factor * longest_recent_step)


class RankState:
    """Mutable per-rank state. Plain attributes only; see the module docstring."""

    __slots__ = ("activity_samples", "async_writers", "checkpoint_duration",
                 "checkpoint_failures", "checkpoint_last_failure", "checkpoint_last_step",
                 "checkpoint_last_success", "checkpointed", "checkpointing", "created",
                 "d2h_bytes", "duration_sum", "error", "finished_at_exit",
                 "gemini_chunk_memory", "h2d_bytes", "heartbeats", "hist", "info",
                 "interruption", "kernel_failures", "kernel_last_failure", "kernels_ready",
                 "last_error", "last_step", "local_rank", "loss", "monitor_errors", "oom",
                 "oom_last", "phase", "phase_start", "pid", "pid_ns", "pid_start",
                 "productive", "rank", "recent", "released", "samples", "stalls", "steps",
                 "tokens", "waited", "waiting_samples", "world_size")

    def __init__(self, rank: int, local_rank: int, world_size: int, pid: int,
                 pid_start: float | None, now: float | None = None,
                 pid_ns: int | None = None) -> None:
        now = time.time() if now is None else now
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.pid = pid
        self.pid_start = pid_start
        self.pid_ns = pid_ns
        self.created = now
        self.phase = "init"
        self.phase_start = now
        self.kernels_ready = False
        self.error = ""  # why the run failed, set by fail()
        self.finished_at_exit = False  # finished by a normal exit, not by finish()
        # The last exception the monitor saw leave a step, checkpoint, kernel load or the
        # run: {"time", "where", "type", "device", "message"}; what a page names as cause.
        self.last_error: LastError | None = None
        # SIGTERM or SIGINT received (training/signals.py), until the rank trains on
        self.interruption: Interruption | None = None
        self.kernel_failures = 0
        self.kernel_last_failure: float | None = None
        self.steps = 0
        self.last_step: float | None = None
        self.samples = 0
        self.tokens = 0
        self.loss: float | None = None  # converted off the hot path from the step's loss
        self.hist = [0] * (len(STEP_BUCKETS) + 1)  # last bucket is +Inf
        self.duration_sum = 0.0
        # Goodput (docs/rules.md): seconds of completed steps, each counted up to its
        # stall budget, and how many of them the last successful checkpoint holds.
        self.productive = 0.0
        self.checkpointed = 0.0
        self.recent = [0.0] * RECENT_STEPS
        self.stalls = 0
        # the publisher's samples of the training thread while training, and how many
        # of them found it waiting for other ranks (training/activity.py)
        self.activity_samples = 0
        self.waiting_samples = 0
        # whether the last sample found it waiting, and when one first found it out of a
        # wait again (wall clock): the end of a wait is progress (note_place)
        self.waited = False
        self.released: float | None = None
        self.oom: dict[str, int] = dict.fromkeys(DEVICES, 0)
        self.oom_last: dict[str, float] = {}  # when, for the devices that ran out
        self.checkpointing = False
        self.async_writers = 0
        self.checkpoint_last_success: float | None = None
        self.checkpoint_last_step: int | None = None
        self.checkpoint_duration: float | None = None
        self.checkpoint_failures = 0
        self.checkpoint_last_failure: float | None = None
        self.gemini_chunk_memory: dict[str, float] | None = None
        self.h2d_bytes = 0.0
        self.d2h_bytes = 0.0
        self.heartbeats: dict[str, HeartbeatState] = {}
        self.monitor_errors: dict[str, int] = {}
        self.info: dict[str, str] = {}

    def longest_recent_step(self) -> float | None:
        """The longest of the last 128 steps' durations (step ``n`` is at ``recent[(n -
        1) % 128]``), None before any. The first step (the warm-up, the first compile:
        minutes, under the start-up budget) counts only while it is the only one; it
        would otherwise stretch the next 127 steps' budget to five times itself."""
        steps = self.steps
        if steps == 0:
            return None
        if steps == 1:
            return self.recent[0]
        if steps <= RECENT_STEPS:
            longest = max(self.recent[1:steps])
            # every later step forgotten (forget_step): the first is all there is
            return longest if longest > 0.0 else self.recent[0]
        return max(self.recent)

    def note_place(self, waiting: bool) -> None:
        """A sample of the training thread (the publisher's or a scrape's): waiting for the
        other ranks (a collective, backward) or not. The first sample out of a wait is
        the wait's end, progress as a step is (snapshot): released from a long wait, a
        rank does the rest of its step while ranks not yet released wait for it, and
        judged from its last step it looked stalled and outside any collective, as the
        rank a hang waits for does. Off the training thread; two samplers racing can
        only move the release by a sample."""
        if waiting:
            self.waited = True
        elif self.waited:
            self.waited = False
            self.released = time.time()

    def forget_step(self, number: int) -> None:
        """Leave step ``number`` (1-based, completed) out of the learned budget: it held
        work with a budget of its own (an evaluation, a save, a recompile inside it, or
        between two ``step_done()`` calls), and five times its duration is no step's
        budget. Its duration stays in the histogram. Called off the training thread: a
        step completing meanwhile writes another slot, unless 128 steps went by, which
        the check leaves alone."""
        if 0 <= self.steps - number < RECENT_STEPS and number > 0:
            self.recent[(number - 1) & (RECENT_STEPS - 1)] = 0.0

    def snapshot(self, budgets: Budgets, now: float | None = None) -> Snapshot:
        """A copy of the state, with the current budget and stall judgement."""
        now = time.time() if now is None else now
        phase, phase_start = self.phase, self.phase_start
        last_step = self.last_step
        timeout = budgets.for_phase(phase, self.longest_recent_step())
        # Progress in "training" is a finished step or the end of a wait for the others
        # (note_place); time spent checkpointing before returning to training does not
        # count against the next step.
        progress = max(phase_start, last_step, self.released or 0.0) \
            if (phase == "training" and last_step) else phase_start
        error = self.last_error
        gemini = self.gemini_chunk_memory
        interruption = self.interruption
        if interruption is not None and self.steps > interruption.steps + 1:
            # A handler of the user's took the signal and the loop went on training
            # (the step in flight when it came may still complete): it ended nothing.
            self.interruption = interruption = None
        snap = Snapshot(
            rank=self.rank, local_rank=self.local_rank, world_size=self.world_size,
            pid=self.pid, pid_start=self.pid_start, pid_ns=self.pid_ns,
            created=self.created, written=now,
            phase=phase, phase_start=phase_start, error=self.error,  # type: ignore[arg-type]
            finished_at_exit=self.finished_at_exit,
            kernels_ready=self.kernels_ready, kernel_failures=self.kernel_failures,
            kernel_last_failure=self.kernel_last_failure,
            last_error=error,  # replaced whole, never changed in place
            interruption=interruption,
            steps=self.steps, last_step=last_step,
            samples=self.samples, tokens=self.tokens, loss=self.loss,
            step_buckets=list(STEP_BUCKETS), step_hist=list(self.hist),
            step_sum=self.duration_sum,
            productive=self.productive, checkpointed=self.checkpointed,
            timeout=timeout, progress=progress, stalls=self.stalls,
            activity_samples=self.activity_samples, waiting_samples=self.waiting_samples,
            oom=dict(self.oom), oom_last=dict(self.oom_last),
            checkpoint=CheckpointState(
                in_flight=self.checkpointing or self.async_writers > 0,
                last_success=self.checkpoint_last_success,
                last_step=self.checkpoint_last_step,
                duration=self.checkpoint_duration,
                failures=self.checkpoint_failures,
                last_failure=self.checkpoint_last_failure),
            gemini=None if gemini is None else GeminiState(
                chunk_memory=dict(gemini), h2d=self.h2d_bytes, d2h=self.d2h_bytes),
            heartbeats={name: msgspec.structs.replace(stats)  # a copy: the sender mutates
                        for name, stats in list(self.heartbeats.items())},
            monitor_errors=dict(self.monitor_errors),
            info=dict(self.info),
        )
        snap.stalled, snap.reason = judge(snap, now)
        return snap


