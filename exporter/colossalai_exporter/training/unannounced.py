"""Work the monitor is not told of: an evaluation, a save, a recompile or a data loader's
start, between steps or inside one.

Most scripts evaluate without ``monitor.evaluation()`` and save without
``monitor.checkpoint()`` (the tutorial's loop has neither: rank 0 alone calls its own
``save_checkpoint`` every few hundred steps), and many wrap their loop's whole body,
the periodic evaluation and save included, in ``with monitor.step()``. Either makes no
step for as long as it takes, minutes, longer than a step's budget, while the other
ranks wait for the rank in their next step's collective: paged as a stalled run, and the
busy rank as the one a hang waits for. An epoch's boundary, where no script tells the
monitor anything, can take as long: a data loader started again. Four things tell that
work apart from a hang, read once the rank has made no step for a while:

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
  evaluation's budget, until the model is back in train mode. Inside a step, eval mode
  is an evaluation only if none of the rank's last 128 steps ran in eval mode and ended
  within the idle time: where eval mode is part of every step (an RL rollout that
  generates in eval mode, a script that trains with dropout off), a step that takes
  too long is a step that takes too long, judged by the step's budget.
- **a recompile**: the training thread is in torch.compile's compiler (activity
  ``compile``): a guard failed on new shapes (the epoch's short last batch, a longer
  sequence), and dynamo and inductor compile the graph again, minutes for a large
  model. Phase "compiling", with the compile budget, until the thread is out of the
  compiler: a compile that never ends (a stale lock in a shared inductor cache) is
  CompileStuck, with its frame. Only the rank that recompiles is in it; the ranks that
  wait for it in a collective are not paged while it is within that budget. The first
  compile is the first step's, within the start-up budget.
- **a data loader's start**: the training thread is in the data loader, ending one
  iterator or building the next, or waiting for that iterator's first batch
  (activity.data_loader_starting): an epoch's boundary, where the workers start again
  (imports and a pickled dataset for spawned ones), the sampler draws its permutation
  of the whole dataset, and each worker opens its first shard. Phase "data_start",
  with its own budget, until the first batch is in: the step (or the script) goes on
  with the step's budget from then, and a later batch that never comes is a hang
  within the step's budget, as it was. An evaluation's loader starts in eval mode,
  and that is the evaluation's.

Each phase starts at the rank's last step and lasts until its next step brings it
back to training, or, for an evaluation, a recompile or a data loader's start, until
the work is over: the step (or the script between steps) goes on with the step's
budget from then. The step that held the work is left out of the learned step budget
once it completes (:meth:`RankState.forget_step`): five times an evaluation is no
step's budget.

"A while" is twice the longest recent step, at least :data:`MIN_IDLE_SECONDS`, and at
most half the step budget (before the rank would count as stalled): a script that saves
a little every step steps far more often than that, and never leaves training (each
return to training is a publish on the training thread, which a step must not pay). The
check runs on the publisher's thread, once a publish: one attribute read, and the stack
sample (a few microseconds, the one the publish takes for its snapshot).
"""

from __future__ import annotations

import time
from typing import Any

from colossalai_exporter.rankstate.schema import Activity
from colossalai_exporter.training import activity
from colossalai_exporter.training.phases import Phases
from colossalai_exporter.training.state import RECENT_STEPS, Budgets, RankState
from colossalai_exporter.training.steps import StepCounter

#: What the training thread does after a save that is part of it: an upload, in a
#: network client of the script's own or a child process (``aws s3 cp``)
AFTER_A_SAVE = ("network", "subprocess")
#: The least time without a step that counts as an evaluation or a save
MIN_IDLE_SECONDS = 10.0


class UnannouncedWork:
    def __init__(self, state: RankState, steps: StepCounter, phases: Phases,
                 budgets: Budgets, thread_id: int | None) -> None:
        self._state = state
        self._thread_id = thread_id  # the training thread's
        self._budgets = budgets
        self._steps = steps
        self._phases = phases
        self.model: Any = None  # the watched model, once known
        # The phase this check entered and its start, while it may still be the rank's:
        # an evaluation it entered ends when the model is back in train mode, one the
        # script announced (monitor.evaluation()) only when its block does.
        self._entered: tuple[str, float] | None = None
        # The step in flight (steps completed then) when this check entered a phase: its
        # duration is forgotten once it completes (RankState.forget_step).
        self._forget: int | None = None
        # A step seen in eval mode before the idle time (steps completed then), and the
        # last such step that completed without a phase entered: eval mode is part of
        # this rank's ordinary steps (a rollout), not an evaluation.
        self._eval_mode_in: int | None = None
        self._ordinary_eval_step: int | None = None

    def check(self, where: Activity | None) -> None:
        """Enter phase checkpointing, evaluating or compiling for work the monitor was not
        told of, or leave it once that work is over (module docstring); ``where``: the
        training thread's place, sampled this publish."""
        state = self._state
        self._settle_completed_steps()
        model = self.model
        eval_mode = model is not None and not getattr(model, "training", True)
        if self._entered is not None:
            name, since = self._entered
            if state.phase != name or state.phase_start != since:
                self._entered = None  # the training thread moved on (a step, a phase)
            elif ((name == "compiling" and where is not None and where.kind != "compile")
                  or (name == "evaluating" and not eval_mode)
                  or (name == "data_start" and where is not None
                      and not self._starting_data(where))):
                # The compile, the evaluation or the data loader's start is over and the
                # step (or the script) goes on: the step's own budget again, from now; a
                # hang in what follows must not wait for that phase's budget.
                self._phases.enter_unannounced("training", since=time.time(),
                                               only_from=name)
                self._entered = None
                return
        if state.phase != "training" or state.last_step is None:
            return
        in_step = self._steps.in_step()
        longest = state.longest_recent_step()
        budget = self._budgets.for_phase("training", longest)
        idle = min(max(MIN_IDLE_SECONDS, 2 * (longest or 0.0)), budget / 2)
        if time.time() - state.last_step < idle:
            if in_step and eval_mode:
                self._eval_mode_in = state.steps
            return
        phase = self._doing(where, in_step, eval_mode)
        if phase is not None:
            since = state.last_step
            if self._phases.enter_unannounced(phase, since=since, only_from="training"):
                self._entered = (phase, since)
                self._forget = state.steps
                self._eval_mode_in = None

    def _settle_completed_steps(self) -> None:
        """What the steps completed since the last check leave: the duration of the one
        that held unannounced work forgotten; eval mode seen in an ordinary one."""
        steps = self._state.steps
        if self._forget is not None and steps > self._forget:
            self._state.forget_step(self._forget + 1)
            self._forget = None
        if self._eval_mode_in is not None and steps > self._eval_mode_in:
            self._ordinary_eval_step = self._eval_mode_in + 1
            self._eval_mode_in = None

    def _saved_since_step(self) -> bool:
        """Whether a save (watched, ended well or not) came after the rank's last step."""
        state = self._state
        last_step = state.last_step or 0.0
        return any(at is not None and at >= last_step
                   for at in (state.checkpoint_last_success, state.checkpoint_last_failure))

    def _eval_mode_is_ordinary(self) -> bool:
        """Whether one of the last 128 steps was in eval mode and ended within the idle
        time: the rank's steps run in eval mode (an RL rollout, a script that trains
        with dropout off), so eval mode in a step is no evaluation."""
        seen = self._ordinary_eval_step
        return seen is not None and self._state.steps - seen < RECENT_STEPS

    def _doing(self, where: Activity | None, in_step: bool, eval_mode: bool) -> str | None:
        if where is not None and where.kind == "compile":
            return "compiling"
        # A save first: a script may save with its model still in eval mode.
        if where is not None and (where.kind == "checkpoint"
                                  or (where.kind in AFTER_A_SAVE and self._saved_since_step())):
            return "checkpointing"
        if eval_mode and not (in_step and self._eval_mode_is_ordinary()):
            return "evaluating"
        if where is not None and self._starting_data(where):
            return "data_start"
        return None

    def _starting_data(self, where: Activity) -> bool:
        return where.kind == "data" and activity.data_loader_starting(self._thread_id)
