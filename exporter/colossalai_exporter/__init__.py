"""colossalai-exporter: Prometheus monitoring for ColossalAI training and chat servers.

The package root imports nothing heavy, so that the node agent, the prober and
the bridge never pull in torch. ``from colossalai_exporter import
TrainingMonitor`` loads the training side on first use (it imports no torch
either).
"""

from typing import Any

from colossalai_exporter.version import __version__

__all__ = ["Budgets", "TrainingMonitor", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("TrainingMonitor", "Budgets"):
        from colossalai_exporter import training

        return getattr(training, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
