"""Step accounting, on the training thread: the only code of the monitor a step runs.

``with monitor.step() as step:`` and ``monitor.step_done()`` end here. Finishing a
step reads two clocks (vDSO, no system call) and assigns plain attributes of
:class:`~colossalai_exporter.training.state.RankState`: no lock, no I/O, no
queue, no CUDA synchronisation, no collective (bench/training_overhead.py). A
loss tensor is only referenced; the publisher thread reads it
(:mod:`.device_loss`). What happens on the way into training (the phase, which
publishes) and when a step raises (the error is classified and published) is
the monitor's, through the two callbacks: both are rare.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

from colossalai_exporter.training.state import RECENT_STEPS, STEP_BUCKETS, RankState

_RING_MASK = RECENT_STEPS - 1
_perf = time.perf_counter
_wall = time.time


class Step:
    """One monitored step: ``with monitor.step() as step: … step.loss = loss``.

    Set ``loss`` (a float or a tensor), and ``samples`` / ``tokens`` if not
    given to :meth:`TrainingMonitor.step`. An exception leaving the block is
    classified (out-of-memory by device), counted and re-raised unchanged; the
    step is then not counted as completed.
    """

    __slots__ = ("_busy", "_steps", "_t0", "loss", "samples", "tokens")

    def __init__(self, steps: StepCounter) -> None:
        self._steps = steps
        self._busy = False
        self._t0 = 0.0
        self.loss: Any = None
        self.samples = 0
        self.tokens = 0

    def __enter__(self) -> Step:
        steps = self._steps
        if steps.state.phase != "training":
            steps.enter_training()
        self._busy = True
        self._t0 = _perf()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        duration = _perf() - self._t0
        steps = self._steps
        self._busy = False
        if exc is None:
            steps.completed(duration, self.samples, self.tokens, self.loss)
        else:
            steps.raised(exc)
        return False  # never swallow the training loop's exception


class StepCounter:
    """Counts steps into ``state``: durations (ring and histogram), samples, tokens,
    the productive seconds goodput reads, the time of the last step, the loss."""

    def __init__(self, state: RankState, *, start_training: Callable[[], None],
                 raised: Callable[[BaseException], None]) -> None:
        """``start_training()``: enter phase "training" (the first step, or the first
        after a checkpoint or evaluation left it). ``raised(exc)``: a step raised
        ``exc``; it must not raise itself, the user's exception goes on unchanged."""
        self.state = state
        self._start_training = start_training
        self.raised = raised
        self._step = Step(self)  # reused: no allocation per step
        self._last_done: float | None = None  # perf_counter of the last step_done()
        #: The training phase's stall budget, as the last snapshot computed it
        #: (TrainingMonitor.snapshot sets it): a step's productive seconds stop there,
        #: one comparison on the hot path.
        self.cap = float("inf")
        #: the last step's loss, as given (maybe a device tensor), for the publisher
        self.loss_ref: Any = None

    def in_step(self) -> bool:
        """Whether the training thread is inside a step now (for other threads)."""
        return self._step._busy

    def step(self, samples: int, tokens: int) -> Step:
        step = self._step
        if step._busy:  # a step inside a step: give it its own object
            step = Step(self)
        step.loss = None
        step.samples = samples
        step.tokens = tokens
        return step

    def step_done(self, duration: float | None, samples: int, tokens: int, loss: Any) -> None:
        """A step finished; without ``duration``, it lasted since the previous call
        (or since training started, for the first)."""
        now = _perf()
        if self.state.phase != "training":
            self.enter_training()
        if duration is None:
            last = self._last_done
            duration = now - (last if last is not None else now)
        self._last_done = now
        self.completed(duration, samples, tokens, loss)

    def enter_training(self) -> None:
        # The first step means the kernels the run needs are loaded (they build
        # lazily on first use otherwise, and the step's own budget covers that).
        self.state.kernels_ready = True
        if self._last_done is None:
            self._last_done = _perf()
        self._start_training()

    def completed(self, duration: float, samples: int, tokens: int, loss: Any) -> None:
        state = self.state
        done = state.steps
        steps = done + 1
        state.recent[done & _RING_MASK] = duration  # step n at (n - 1) % 128
        state.hist[bisect_left(STEP_BUCKETS, duration)] += 1
        state.duration_sum += duration
        cap = self.cap
        state.productive += duration if duration < cap else cap
        if samples:
            state.samples += samples
        if tokens:
            state.tokens += tokens
        if loss is not None:
            self.loss_ref = loss
        state.last_step = _wall()
        state.steps = steps  # last: a reader that sees the step sees its duration
