"""Host memory and swap: what Gemini's CPU offload and the kernel's OOM killer care about."""

from __future__ import annotations

from typing import cast

import psutil
from prometheus_client.core import Metric as MetricFamily

from colossalai_exporter.catalogue import family
from colossalai_exporter.node.base import CollectorError


def _gauge(name: str, value: float) -> MetricFamily:
    fam = family(name)
    fam.add_metric([], value)
    return cast(MetricFamily, fam)


class HostCollector:
    """Reads /proc/meminfo through psutil (a file read: it cannot hang like a mount)."""

    name = "host"
    reasons: tuple[str, ...] = ("error",)

    def collect(self, deadline: float) -> list[MetricFamily]:
        try:
            memory = psutil.virtual_memory()
            swap = psutil.swap_memory()
        except (OSError, RuntimeError) as exc:
            raise CollectorError("error", f"cannot read host memory: {exc}") from None
        return [
            _gauge("colossalai_host_memory_total_bytes", memory.total),
            _gauge("colossalai_host_memory_available_bytes", memory.available),
            _gauge("colossalai_host_swap_total_bytes", swap.total),
            _gauge("colossalai_host_swap_used_bytes", swap.used),
        ]

    def close(self) -> None:
        pass
