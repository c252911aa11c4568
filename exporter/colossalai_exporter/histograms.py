"""A labelled histogram kept by our own code and written out as a catalogue family.

Why not prometheus_client's ``Histogram``: its children add a ``_created``
series each in the text format unless a process-wide switch is flipped, and
the chat helper runs inside its owner's process, where that switch is theirs.
The prober and the chat helper both need the same thing (observations by
label values, read under a lock at scrape), so it is written once, here.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from prometheus_client.core import HistogramMetricFamily

from colossalai_exporter import catalogue

Labels = tuple[str, ...]


@dataclass
class _Counts:
    #: observations per bucket, not cumulative (the last is over every bound): an
    #: observation is one increment; the family cumulates them at scrape
    buckets: list[int]
    total: float = 0.0
    count: int = 0


@dataclass
class LabelledHistogram:
    """Observations by label values; not locked itself: its owner holds its lock around
    :meth:`observe` and :meth:`snapshot`, which it shares with its other counters."""

    bounds: Sequence[float]
    _series: dict[Labels, _Counts] = field(default_factory=dict)

    def observe(self, labels: Labels, value: float) -> None:
        counts = self._series.get(labels)
        if counts is None:
            counts = self._series[labels] = _Counts([0] * (len(self.bounds) + 1))
        counts.buckets[bisect_left(self.bounds, value)] += 1  # le: the first bound >= value
        counts.total += value
        counts.count += 1

    def snapshot(self) -> dict[Labels, _Counts]:
        return {labels: _Counts(list(c.buckets), c.total, c.count)
                for labels, c in self._series.items()}

    def family(self, name: str, snapshot: dict[Labels, _Counts],
               also: Iterable[Labels] = ()) -> HistogramMetricFamily:
        """The catalogue's family ``name`` with every series of ``snapshot``, sorted, and
        the label values in ``also`` at zero where nothing was observed yet."""
        family = catalogue.histogram(name)
        empty = _Counts([0] * (len(self.bounds) + 1))
        for labels in sorted(set(snapshot) | set(also)):
            counts = snapshot.get(labels, empty)
            cumulative = list(accumulate(counts.buckets))
            pairs = [(repr(float(b)), float(n))
                     for b, n in zip(self.bounds, cumulative, strict=False)]
            pairs.append(("+Inf", float(counts.count)))
            family.add_metric(list(labels), pairs, counts.total)
        return family
