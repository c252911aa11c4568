"""The training side: :class:`TrainingMonitor` and what it is made of.

Importing this package does not import torch or ColossalAI; the monitor looks
at them only if the training script already did. The node agent imports
:mod:`.state`, :mod:`.snapshot` and :mod:`.families` from here; the names
below load on first use, so that doing so does not also load the monitor and
its HTTP client (a tenth of the agent's start-up time, bench/RESULTS.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from colossalai_exporter.training.device_loss import loss_value
    from colossalai_exporter.training.monitor import Step, TrainingMonitor
    from colossalai_exporter.training.oom import classify_oom
    from colossalai_exporter.training.state import Budgets

__all__ = ["Budgets", "Step", "TrainingMonitor", "classify_oom", "loss_value"]

_HOMES = {"Step": "monitor", "TrainingMonitor": "monitor", "loss_value": "device_loss",
          "classify_oom": "oom", "Budgets": "state"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
