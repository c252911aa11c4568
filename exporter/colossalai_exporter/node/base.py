"""What every node collector is: a name, its failure reasons, and a bounded collect().

The agent runs each collector with a deadline, times it, and turns a
:class:`CollectorError` into ``colossalai_exporter_collector_up 0`` with the
error's reason — the collector's series are dropped rather than served stale,
except for the ``families`` the error carries (fresh data that is still true,
such as the GPUs that are visible when fewer than expected are).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prometheus_client.core import Metric as MetricFamily


class CollectorError(Exception):
    """A collector run failed for ``reason`` (one of the collector's ``reasons``)."""

    def __init__(self, reason: str, message: str,
                 families: Sequence[MetricFamily] = ()) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.families = list(families)


class NodeCollector(Protocol):
    #: the collector's name in ``--no-collector.NAME`` and in the ``collector`` label
    name: str
    #: every reason its CollectorError may carry; pre-created as zero counters
    reasons: tuple[str, ...]

    def collect(self, deadline: float) -> list[MetricFamily]:
        """Fresh families, returning before ``deadline`` (``time.monotonic()``) or raising."""
        ...

    # A collector that waits on another process or thread (the NVML worker, disk
    # checks) may also define ``begin(deadline) -> None``: the agent calls it, in
    # the scrape's thread, before any collector's collect(), so that the work it
    # hands over runs while the other collectors do theirs. It must not block
    # and must not raise; collect() reports any failure.

    def close(self) -> None:
        """Release workers and handles when the agent stops."""
        ...
