"""The training side: :class:`TrainingMonitor` and what it is made of.

Importing this package does not import torch or ColossalAI; the monitor looks
at them only if the training script already did. What a rank publishes, and the
node agent reads, is the contract in :mod:`colossalai_exporter.rankstate`, which
the agent imports instead of this package.
"""

from __future__ import annotations

from colossalai_exporter.training.device_loss import loss_value
from colossalai_exporter.training.monitor import TrainingMonitor
from colossalai_exporter.training.oom import classify_oom
from colossalai_exporter.training.state import Budgets
from colossalai_exporter.training.steps import Step

__all__ = ["Budgets", "Step", "TrainingMonitor", "classify_oom", "loss_value"]
