"""Host memory and swap: what Gemini's CPU offload and the kernel's OOM killer care about.

On Linux the values come from one read of ``/proc/meminfo`` (proc(5)): a file
the kernel generates, which cannot hang like a mount. psutil reads the same
file, and ``/proc/vmstat`` too, for two calls' worth of fields of which four
are served here; it was the agent's most expensive collector per scrape
(bench/RESULTS.md). psutil remains the fallback where the file or one of the
fields is missing (another OS, a kernel older than 3.14 without MemAvailable).
The OOM killer's count since boot is one more small read, of ``/proc/vmstat``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import psutil

from colossalai_exporter import catalogue
from colossalai_exporter.node.base import CollectorError
from colossalai_exporter.node.oom import vmstat_oom_kills

if TYPE_CHECKING:
    from prometheus_client.core import Metric as MetricFamily

    from colossalai_exporter.node.collectors import Built
    from colossalai_exporter.node.config import NodeConfig

MEMINFO = "/proc/meminfo"
_FIELDS = ("MemTotal", "MemAvailable", "SwapTotal", "SwapFree")


def _gauge(name: str, value: float) -> MetricFamily:
    fam = catalogue.gauge(name)
    fam.add_metric([], value)
    return fam


def read_meminfo(path: str = MEMINFO) -> dict[str, float] | None:
    """The fields this collector serves, in bytes; None when any is missing."""
    try:
        with open(path, "rb") as f:
            text = b"\n" + f.read()
    except OSError:
        return None
    # Four lines out of about fifty: looked up with bytes.find (about 8 us)
    # rather than decoding and splitting every line (about 45 us).
    values: dict[str, float] = {}
    for name in _FIELDS:
        key = b"\n" + name.encode() + b":"
        start = text.find(key)
        if start < 0:
            return None
        end = text.find(b"\n", start + 1)
        parts = text[start + len(key):end if end >= 0 else None].split()
        if not parts or not parts[0].isdigit():
            return None
        # The kernel writes every size in kB (KiB), whatever the unit column says.
        values[name] = float(int(parts[0]) * 1024)
    return values


class HostCollector:
    """Total and available memory, total and used swap."""

    name = "host"
    reasons: tuple[str, ...] = ("error",)

    def __init__(self, meminfo: str = MEMINFO, proc_root: str = "/proc") -> None:
        self.meminfo = meminfo
        self.proc_root = proc_root

    def collect(self, deadline: float) -> list[MetricFamily]:
        values = read_meminfo(self.meminfo)
        if values is not None:
            total, available = values["MemTotal"], values["MemAvailable"]
            swap_total, swap_used = values["SwapTotal"], values["SwapTotal"] - values["SwapFree"]
        else:
            try:
                memory, swap = psutil.virtual_memory(), psutil.swap_memory()
            except (OSError, RuntimeError) as exc:
                raise CollectorError("error", f"cannot read host memory: {exc}") from None
            total, available, swap_total, swap_used = (memory.total, memory.available,
                                                       swap.total, swap.used)
        families = [
            _gauge("colossalai_host_memory_total_bytes", total),
            _gauge("colossalai_host_memory_available_bytes", available),
            _gauge("colossalai_host_swap_total_bytes", swap_total),
            _gauge("colossalai_host_swap_used_bytes", swap_used),
        ]
        # The OOM killer's count: absent before kernel 4.13 rather than a false zero.
        kills = vmstat_oom_kills(self.proc_root)
        if kills is not None:
            oom = catalogue.counter("colossalai_host_oom_kills_total")
            oom.add_metric([], float(kills))
            families.append(oom)
        return families

    def close(self) -> None:
        pass


def from_config(config: NodeConfig, built: Built) -> HostCollector:
    """The registry's factory (node/collectors.py)."""
    return HostCollector()
