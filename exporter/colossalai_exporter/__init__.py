"""colossalai-exporter: Prometheus monitoring for ColossalAI training and chat servers.

The package root imports nothing heavy, so that the node agent, the prober and
the bridge never pull in torch.
"""

from colossalai_exporter.version import __version__

__all__ = ["__version__"]
