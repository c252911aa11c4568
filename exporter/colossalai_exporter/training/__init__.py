"""The training side: :class:`TrainingMonitor` and what it is made of.

Importing this package does not import torch or ColossalAI; the monitor looks
at them only if the training script already did. The node agent imports
:mod:`.state`, :mod:`.snapshot` and :mod:`.families` from here.
"""

from colossalai_exporter.training.monitor import Step, TrainingMonitor, loss_value
from colossalai_exporter.training.oom import classify_oom
from colossalai_exporter.training.state import Budgets

__all__ = ["Budgets", "Step", "TrainingMonitor", "classify_oom", "loss_value"]
