"""Work the monitor is not told of: an evaluation or a save between steps, a
recompile within one.

Most scripts evaluate without ``monitor.evaluation()`` and save without
``monitor.checkpoint()`` (the tutorial's loop has neither: rank 0 alone calls its own
``save_checkpoint`` every few hundred steps). Either makes no step for as long as it
takes, minutes, longer than a step's budget, while the other ranks wait for the rank
in their next step's collective: paged as a stalled run, and the busy rank as the one
a hang waits for. Two things tell that work apart from a hang, read outside any step
once the rank has made no step for a while:

- **a save**: the training thread is inside ``torch.save`` or safetensors (its sampled
  activity is ``checkpoint``, training/activity.py), or, once the rank has saved since
  its last step, in a network client of its own (``network``: rank 0 pushing the
  checkpoint it just saved through the watched ``booster.save_model`` to S3 or the
  Hub) or waiting for a child process (``subprocess``: ``aws s3 cp``, ``rclone``).
  Phase "checkpointing", with the checkpoint budget: a save or upload that never
  ends is CheckpointStuck, with its frame. It counts as no checkpoint (the monitor
  cannot tell whether it succeeded). A transfer with no save before it (the next data
  shard fetched outside a DataLoader) is not a save: it stays training, and a fetch
  that hangs is paged within the step budget.
- **an evaluation**: PyTorch's convention, ``model.eval()`` before evaluating and
  ``model.train()`` after, sets the watched model's (``monitor.boost()``,
  ``watch(booster, model)``) ``training`` attribute. Phase "evaluating", with
  evaluation's budget.
- **a recompile**, within a step or between steps: the training thread is in
  torch.compile's compiler (activity ``compile``): a guard failed on new shapes (the
  epoch's short last batch, a longer sequence), and dynamo and inductor compile the
  graph again, minutes for a large model. Phase "compiling", with the compile budget:
  a compile that never ends (a stale lock in a shared inductor cache) is CompileStuck,
  with its frame. Only the rank that recompiles is in it; the ranks that wait for it in
  a collective are not paged while it is within that budget. The first compile is the
  first step's, within the start-up budget.

Each phase starts at the rank's last step and lasts until its next step brings it
back to training; "compiling" also ends as soon as a sample finds the thread out of
the compiler (the compiled step goes on, within the step's budget from then).

"A while" is twice the longest recent step, at least :data:`MIN_IDLE_SECONDS`, and at
most half the step budget (before the rank would count as stalled): a script that keeps
its model in eval mode while it trains (dropout off), or saves a little every step,
steps far more often than that, and never leaves training (each return to training is
a publish on the training thread, which a step must not pay). The check runs on the
publisher's thread, once a publish: one attribute read, and the stack sample (a few
microseconds, the one the publish takes for its snapshot).
"""

from __future__ import annotations

import time
from typing import Any

from colossalai_exporter.rankstate.schema import Activity
from colossalai_exporter.training.phases import Phases
from colossalai_exporter.training.state import Budgets, RankState
from colossalai_exporter.training.steps import StepCounter

#: What the training thread does after a save that is part of it: an upload, in a
#: network client of the script's own or a child process (``aws s3 cp``)
AFTER_A_SAVE = ("network", "subprocess")
#: The least time without a step that counts as an evaluation or a save
MIN_IDLE_SECONDS = 10.0


class UnannouncedWork:
    def __init__(self, state: RankState, steps: StepCounter, phases: Phases,
                 budgets: Budgets) -> None:
        self._state = state
        self._budgets = budgets
        self._steps = steps
        self._phases = phases
        self.model: Any = None  # the watched model, once known

    def check(self, where: Activity | None) -> None:
        """Enter phase checkpointing, evaluating or compiling for work the monitor was not
        told of (module docstring); ``where``: the training thread's place, sampled this
        publish."""
        state = self._state
        if state.phase == "compiling" and where is not None and where.kind != "compile":
            # The compile is over and the step goes on: the step's own budget again, from
            # now (a hang in the rest of the step must not wait for the compile budget).
            self._phases.enter_unannounced("training", since=time.time(),
                                           only_from="compiling")
            return
        if state.phase != "training" or state.last_step is None:
            return
        longest = state.longest_recent_step()
        budget = self._budgets.for_phase("training", longest)
        idle = min(max(MIN_IDLE_SECONDS, 2 * (longest or 0.0)), budget / 2)
        if time.time() - state.last_step < idle:
            return
        phase = self._doing(where, self._steps.in_step())
        if phase is not None:
            self._phases.enter_unannounced(phase, since=state.last_step, only_from="training")

    def _saved_since_step(self) -> bool:
        """Whether a save (watched, ended well or not) came after the rank's last step."""
        state = self._state
        last_step = state.last_step or 0.0
        return any(at is not None and at >= last_step
                   for at in (state.checkpoint_last_success, state.checkpoint_last_failure))

    def _doing(self, where: Activity | None, in_step: bool) -> str | None:
        if where is not None and where.kind == "compile":
            return "compiling"
        if in_step:  # a step's own work: its budget decides
            return None
        # A save first: a script may save with its model still in eval mode.
        if where is not None and (where.kind == "checkpoint"
                                  or (where.kind in AFTER_A_SAVE and self._saved_since_step())):
            return "checkpointing"
        model = self.model
        if model is not None and not getattr(model, "training", True):
            return "evaluating"
        return None
