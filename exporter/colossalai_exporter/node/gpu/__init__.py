"""The gpu collector: NVML in a worker process with a deadline.

``from colossalai_exporter.node.gpu import GpuCollector`` is the public entry
point. It is imported lazily: the NVML worker process imports this package
(for :mod:`.worker` and :mod:`.reader`) and should not pay for
prometheus_client and the catalogue, so it stays small and starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from colossalai_exporter.node.gpu.collector import GpuCollector

__all__ = ["GpuCollector"]


def __getattr__(name: str) -> object:
    if name == "GpuCollector":
        from colossalai_exporter.node.gpu.collector import GpuCollector

        return GpuCollector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
