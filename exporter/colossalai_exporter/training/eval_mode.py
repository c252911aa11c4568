"""An evaluation the monitor is not told of, seen from the model's own mode.

A script that evaluates without ``monitor.evaluation()`` (most do: the tutorial's
loop has no evaluation phase) makes no step for as long as its validation set takes,
minutes, longer than a step's budget: paged as a stalled run. PyTorch's convention
tells it apart: ``model.eval()`` before evaluating and ``model.train()`` after, which
sets the module's ``training`` attribute. So a rank whose watched model (from
``monitor.boost()`` or ``watch(booster, model)``) is in eval mode, outside any step,
with no step for a while, is in phase "evaluating" from its last step on, with
evaluation's budget, until its next step brings it back to training.

"A while" is twice the longest recent step, at least :data:`MIN_IDLE_SECONDS`, and at
most half the step budget (before the rank would count as stalled): a script that keeps
its model in eval mode while it trains (dropout off) steps far more often than that,
and never leaves training (each return to training is a publish on the training
thread, which a step must not pay). The check runs on the publisher's thread, once a
publish, and reads one attribute.
"""

from __future__ import annotations

import time
from typing import Any

from colossalai_exporter.training.phases import Phases
from colossalai_exporter.training.state import Budgets, RankState
from colossalai_exporter.training.steps import StepCounter

#: The least time without a step, in eval mode, that counts as an evaluation
MIN_IDLE_SECONDS = 10.0


class EvalModeWatch:
    def __init__(self, state: RankState, steps: StepCounter, phases: Phases,
                 budgets: Budgets) -> None:
        self._state = state
        self._budgets = budgets
        self._steps = steps
        self._phases = phases
        self.model: Any = None

    def check(self) -> None:
        """Enter phase evaluating if the model is evaluating (module docstring)."""
        model, state = self.model, self._state
        if model is None or state.phase != "training" or state.last_step is None:
            return
        if getattr(model, "training", True) or self._steps.in_step():
            return
        longest = state.longest_recent_step()
        budget = self._budgets.for_phase("training", longest)
        idle = min(max(MIN_IDLE_SECONDS, 2 * (longest or 0.0)), budget / 2)
        if time.time() - state.last_step < idle:
            return
        self._phases.enter_unannounced("evaluating", since=state.last_step, only_from="training")
