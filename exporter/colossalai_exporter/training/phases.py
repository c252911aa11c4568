"""What a rank is doing besides stepping: its phase, and the blocks that set one.

init, kernels, training, checkpointing, evaluating, finished, failed
(:data:`~colossalai_exporter.rankstate.schema.PHASES`). Each phase has its own
stall budget (a checkpoint may take minutes, a step seconds), so entering one is
published at once. Kernel builds and checkpoints count their failures and record
their duration; finished and failed are final. TrainingMonitor's ``phase``,
``kernels``, ``evaluation``, ``checkpoint``, ``finish`` and ``fail`` are these.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from colossalai_exporter.rankstate.schema import PHASES
from colossalai_exporter.training.errors import space_note
from colossalai_exporter.training.publisher import Publisher
from colossalai_exporter.training.state import RankState

_perf = time.perf_counter
_wall = time.time


class RecordException(Protocol):
    def __call__(self, exc: BaseException, where: str, publish: bool = True,
                 note: str = "") -> None: ...


class Phases:
    def __init__(self, state: RankState, publisher: Publisher, *,
                 record_exception: RecordException,
                 error: Callable[[str, str], None],
                 checkpoint_done: Callable[[], None]) -> None:
        """``record_exception``: count an exception and make it the rank's last error;
        ``error``: a misuse of the monitor, counted and logged, never raised;
        ``checkpoint_done``: a checkpoint succeeded (its heartbeat)."""
        self._state = state
        self._publisher = publisher
        self._record_exception = record_exception
        self._error = error
        self._checkpoint_done = checkpoint_done
        self._kernel_depth = 0  # nested kernels() blocks (a loader that loads another)
        self._lock = threading.Lock()
        self._checkpoint_path: str | os.PathLike[str] | None = None

    def enter(self, name: str) -> None:
        if name not in PHASES:
            self._error("hook", f"unknown phase {name!r} (phases: {', '.join(PHASES)})")
            return
        state = self._state
        if state.phase in ("finished", "failed") and name not in ("finished", "failed"):
            return  # the run's outcome is final
        if name == "kernels":
            state.kernels_ready = False
        with self._lock:  # not against enter_unannounced's check, on the publisher's thread
            state.phase_start = _wall()
            state.phase = name
        # Every phase change is written by the thread making it, before it goes on: a
        # process that freezes holding the GIL right after (torch.save opening a file on
        # a hung mount, the first step after a checkpoint hung in a C call) never lets
        # the publisher thread run again, and the rules read the phase from the last
        # snapshot. Phase changes are rare (the first step, checkpoints, evaluations,
        # kernel builds: minutes apart), so the ~50 us write to the run directory costs
        # nothing a step would notice; steps never publish.
        if self._publisher.started:
            self._publisher.publish_now()

    def enter_unannounced(self, name: str, *, since: float, only_from: str) -> bool:
        """Enter ``name`` as of ``since`` (wall clock), if the phase is still ``only_from``,
        without publishing: for the publisher's own thread, in the publish that writes
        it (training/unannounced.py). The check and the change are one step against a
        phase the training thread enters meanwhile (a checkpoint), which must win. Whether
        it entered."""
        with self._lock:
            state = self._state
            if state.phase != only_from:
                return False
            state.phase_start = since
            state.phase = name
            return True

    @contextlib.contextmanager
    def kernels(self) -> Iterator[None]:
        state = self._state
        self._kernel_depth += 1
        outer = self._kernel_depth == 1
        previous, was_ready = state.phase, state.kernels_ready
        if outer:
            self.enter("kernels")
        try:
            yield
        except BaseException as exc:
            if outer:
                state.kernel_failures += 1
                state.kernel_last_failure = _wall()
                state.kernels_ready = was_ready
                # The error first: leaving the phase writes the snapshot too, and one that
                # counts the failure without its error, if it is the last (the rank killed
                # a moment later), pages without the cause.
                self._record_exception(exc, "kernels")
                self.enter(previous if previous != "kernels" else "init")
            raise
        else:
            if outer:
                state.kernels_ready = True
                self.enter(previous if previous != "kernels" else "init")
        finally:
            self._kernel_depth -= 1

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        self.enter("evaluating")
        try:
            yield
        except BaseException as exc:
            self._record_exception(exc, "evaluation")
            raise
        finally:
            self.enter("training")

    @contextlib.contextmanager
    def checkpoint(self, step: int | None,
                   path: str | os.PathLike[str] | None) -> Iterator[None]:
        state = self._state
        if state.checkpointing:  # nested: a watched booster's save inside the block
            if path is not None:
                self._checkpoint_path = path
            yield
            return
        previous = state.phase
        state.checkpointing = True
        self._checkpoint_path = path
        self.enter("checkpointing")
        started = _perf()
        kept = state.productive  # the steps this checkpoint saves
        try:
            yield
        except BaseException as exc:
            state.checkpoint_failures += 1
            state.checkpoint_last_failure = _wall()
            note = space_note(self._checkpoint_path)
            self._record_exception(exc, "checkpoint", note=note)
            raise
        else:
            state.checkpoint_duration = _perf() - started
            state.checkpoint_last_step = state.steps if step is None else step
            state.checkpoint_last_success = _wall()
            state.checkpointed = max(state.checkpointed, kept)
            self._checkpoint_done()
        finally:
            state.checkpointing = False
            self.enter(previous if previous != "checkpointing" else "training")

    def finish(self) -> None:
        self.enter("finished")
        self._publisher.publish()

    def fail(self, exc: BaseException | str | None) -> None:
        if isinstance(exc, BaseException):
            self._record_exception(exc, "run", publish=False)
            reason = f"{type(exc).__name__}: {exc}"
        else:
            reason = exc or "failed"
        self._state.error = reason[:500]
        self.enter("failed")
        self._publisher.publish()
