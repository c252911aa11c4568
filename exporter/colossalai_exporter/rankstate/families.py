"""Metric families from a rank snapshot: the one mapping from state to exposition.

Used in-process by the rank-0 server's collector (every series) and by the node
agent's ``ranks`` collector on snapshots read from disk (the outside view: what
the rules need, :data:`INSIDE_ONLY` left out), so both serve the same catalogued
names with the same ``rank`` label. Imports neither torch nor any training code:
the node agent uses it.
"""

from __future__ import annotations

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.core import Metric as MetricFamily

from colossalai_exporter import catalogue
from colossalai_exporter.rankstate.schema import DEVICES, HEARTBEAT_RESULTS, Snapshot
from colossalai_exporter.rankstate.verdict import judge

# The info's labels after rank, in the catalogue's order, which the family's samples
# are given in: a list kept here as well once served every value under its neighbour's
# name when the catalogue gained a label.
INFO_LABELS = catalogue.get("colossalai_training_info").labels[1:]
MONITOR_ERROR_PLACES = ("publish", "loss", "heartbeat", "server", "stacks", "hook")
_INF = float("inf")
_OUTSIDE = (
    "colossalai_training_info", "colossalai_training_steps_total",
    "colossalai_training_last_step_timestamp_seconds",
    "colossalai_training_step_timeout_seconds", "colossalai_training_phase",
    "colossalai_training_phase_start_timestamp_seconds",
    "colossalai_training_start_timestamp_seconds",
    "colossalai_training_productive_seconds_total",
    "colossalai_training_checkpointed_seconds_total", "colossalai_training_stalled",
    "colossalai_kernels_ready", "colossalai_kernel_build_failures_total",
    "colossalai_kernel_build_last_failure_timestamp_seconds",
    "colossalai_training_last_error_info", "colossalai_training_last_error_timestamp_seconds",
    "colossalai_training_activity_info", "colossalai_training_collective_enqueued",
    "colossalai_training_collective_in_flight_seconds",
    "colossalai_training_activity_samples_total",
    "colossalai_training_waiting_samples_total", "colossalai_gemini_oom_total",
    "colossalai_gemini_oom_last_timestamp_seconds",
    "colossalai_checkpoint_last_success_timestamp_seconds", "colossalai_checkpoint_last_step",
    "colossalai_checkpoint_failures_total", "colossalai_checkpoint_last_failure_timestamp_seconds",
    "colossalai_heartbeat_last_success_timestamp_seconds",
    "colossalai_heartbeat_last_attempt_timestamp_seconds", "colossalai_heartbeat_sends_total",
    "colossalai_training_monitor_errors_total",
)
_INSIDE = (
    "colossalai_training_step_duration_seconds", "colossalai_training_samples_total",
    "colossalai_training_tokens_total", "colossalai_training_stalls_total",
    "colossalai_training_loss", "colossalai_checkpoint_duration_seconds",
    "colossalai_checkpoint_in_flight",
)
_GEMINI = ("colossalai_gemini_chunk_memory_bytes", "colossalai_gemini_h2d_bytes_total",
           "colossalai_gemini_d2h_bytes_total")
# Served by the in-process server only: dashboards read them, no rule does, and the node
# agent's view of every rank stays within 25 series a rank (docs/metrics.md marks them).
INSIDE_ONLY = frozenset((*_INSIDE, *_GEMINI))


class RankFamilies:
    """The families of any number of ranks, each family made once (a node's eight ranks
    share them: the agent builds one set per scrape, not one per rank).

    ``outside`` is the node agent's view: only what the rules need from outside the
    process (at most 25 series per rank with the agent's own four;
    tests/test_series_budget.py). The in-process view adds what only dashboards
    read (:data:`INSIDE_ONLY`). Counters carry no created timestamp: a ``*_created``
    series per counter would double every rank's series at fleet size, for a value
    Prometheus does not use.
    """

    def __init__(self, *, outside: bool = False) -> None:
        self.outside = outside
        self.ranks = 0  # added so far
        names = _OUTSIDE if outside else (*_OUTSIDE, *_INSIDE, *_GEMINI)
        self._fams: dict[str, MetricFamily] = {n: catalogue.family(n) for n in names}
        # The same families, by the shape of their samples (typed add_metric).
        self._values: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            n: f for n, f in self._fams.items()
            if isinstance(f, GaugeMetricFamily | CounterMetricFamily)}
        self._infos: dict[str, InfoMetricFamily] = {
            n: f for n, f in self._fams.items() if isinstance(f, InfoMetricFamily)}

    def _add(self, name: str, labels: list[str], value: float | None) -> None:
        if value is not None:  # an absent value is an empty family, not a zero
            self._values[name].add_metric(labels, float(value))

    def add(self, snap: Snapshot, now: float | None = None) -> None:
        """One rank's series; ``now`` judges the stall again (the agent's view)."""
        self.ranks += 1
        rank = str(snap.rank)
        add = self._add
        stalled = snap.stalled if now is None else judge(snap, now)[0]
        values = dict(snap.info)
        values.setdefault("world_size", str(snap.world_size))
        self._infos["colossalai_training_info"].add_metric(
            [rank, *(str(values.get(k, "")) for k in INFO_LABELS)], {})
        run = values.get("run", "")
        add("colossalai_training_steps_total", [rank], snap.steps)
        add("colossalai_training_last_step_timestamp_seconds", [rank], snap.last_step)
        add("colossalai_training_step_timeout_seconds", [rank], snap.timeout)
        # The current phase only (1): the others' zeros would be 6 series a rank that no
        # rule or panel needs, since every query selects the phase it asks about == 1.
        add("colossalai_training_phase", [rank, snap.phase], 1.0)
        add("colossalai_training_phase_start_timestamp_seconds", [rank], snap.phase_start)
        add("colossalai_training_start_timestamp_seconds", [rank, run], snap.created)
        add("colossalai_training_productive_seconds_total", [rank, run], snap.productive)
        add("colossalai_training_checkpointed_seconds_total", [rank, run], snap.checkpointed)
        add("colossalai_training_stalled", [rank], 1.0 if stalled else 0.0)
        add("colossalai_kernels_ready", [rank], 1.0 if snap.kernels_ready else 0.0)
        add("colossalai_kernel_build_failures_total", [rank], snap.kernel_failures)
        # The failures' times exist only once something failed: what the alerts select,
        # with the run, which they would otherwise join from every rank's info.
        add("colossalai_kernel_build_last_failure_timestamp_seconds", [rank, run],
            snap.kernel_last_failure)
        self._last_error(snap, rank)
        self._activity(snap, rank, stalled)
        if stalled:  # like the activity: only while stalled, when it does not move
            for group in snap.collectives or ():
                add("colossalai_training_collective_enqueued",
                    [rank, run, group.pg, group.ranks, group.op], group.enqueued)
        if snap.in_flight_known:
            pending = snap.pending
            add("colossalai_training_collective_in_flight_seconds", [rank, run],
                0.0 if pending is None else max(0.0, (now or snap.written) - pending.since))
        add("colossalai_training_activity_samples_total", [rank], snap.activity_samples)
        add("colossalai_training_waiting_samples_total", [rank], snap.waiting_samples)
        for device in DEVICES:  # each device from 0, so the first OOM is an increase
            add("colossalai_gemini_oom_total", [rank, device], snap.oom.get(device, 0))
            add("colossalai_gemini_oom_last_timestamp_seconds", [rank, run, device],
                snap.oom_last.get(device))
        ckpt = snap.checkpoint
        add("colossalai_checkpoint_last_success_timestamp_seconds", [rank], ckpt.last_success)
        add("colossalai_checkpoint_last_step", [rank], ckpt.last_step)
        add("colossalai_checkpoint_failures_total", [rank], ckpt.failures)
        add("colossalai_checkpoint_last_failure_timestamp_seconds", [rank, run],
            ckpt.last_failure)
        self._heartbeats(snap, rank)  # only on ranks that send them (rank 0 by default)
        for where in MONITOR_ERROR_PLACES:
            # Outside, only the places that failed: six zeros a rank are for the
            # dashboards of the in-process view.
            count = snap.monitor_errors.get(where, 0)
            if count or not self.outside:
                add("colossalai_training_monitor_errors_total", [rank, where], count)
        if not self.outside:
            self._inside_only(snap, rank)

    def families(self) -> list[MetricFamily]:
        """Every family, in catalogue order; Gemini's only when a rank has Gemini."""
        return [f for n, f in self._fams.items() if f.samples or n not in _GEMINI]

    def _inside_only(self, snap: Snapshot, rank: str) -> None:
        add = self._add
        self._histogram(snap, rank)
        add("colossalai_training_samples_total", [rank], snap.samples)
        add("colossalai_training_tokens_total", [rank], snap.tokens)
        add("colossalai_training_stalls_total", [rank], snap.stalls)
        add("colossalai_training_loss", [rank], snap.loss)
        add("colossalai_checkpoint_duration_seconds", [rank], snap.checkpoint.duration)
        add("colossalai_checkpoint_in_flight", [rank], 1.0 if snap.checkpoint.in_flight else 0.0)
        gemini = snap.gemini
        if gemini is not None:  # GeminiPlugin only: absent rather than zero elsewhere
            for device, value in sorted(gemini.chunk_memory.items()):
                add("colossalai_gemini_chunk_memory_bytes", [rank, device], value)
            add("colossalai_gemini_h2d_bytes_total", [rank], gemini.h2d)
            add("colossalai_gemini_d2h_bytes_total", [rank], gemini.d2h)

    def _activity(self, snap: Snapshot, rank: str, stalled: bool) -> None:
        # Only while the rank is stalled: then its place names who a hang waits for,
        # and it does not move. A healthy rank's place changes every second (no churn).
        where = snap.activity
        if stalled and where is not None:
            self._infos["colossalai_training_activity_info"].add_metric(
                [rank, where.kind, where.collective, where.frame], {})

    def _last_error(self, snap: Snapshot, rank: str) -> None:
        # Absent until the rank has seen an exception.
        error = snap.last_error
        if error is not None:
            self._infos["colossalai_training_last_error_info"].add_metric(
                [rank, error.where, error.type, error.device, error.message], {})
            self._add("colossalai_training_last_error_timestamp_seconds", [rank], error.time)

    def _histogram(self, snap: Snapshot, rank: str) -> None:
        bounds = [*snap.step_buckets, _INF]
        cumulative, buckets = 0, []
        for bound, count in zip(bounds, snap.step_hist, strict=True):
            cumulative += int(count)
            buckets.append(("+Inf" if bound == _INF else repr(float(bound)), float(cumulative)))
        # The count is the +Inf bucket by construction, so the exposition is consistent
        # even if the hot path bumped a bucket while this was read.
        histogram = self._fams["colossalai_training_step_duration_seconds"]
        assert isinstance(histogram, HistogramMetricFamily)
        histogram.add_metric([rank], buckets, snap.step_sum)

    def _heartbeats(self, snap: Snapshot, rank: str) -> None:
        for name, hb in sorted(snap.heartbeats.items()):
            self._add("colossalai_heartbeat_last_success_timestamp_seconds", [rank, name],
                      hb.last_success)
            self._add("colossalai_heartbeat_last_attempt_timestamp_seconds", [rank, name],
                      hb.last_attempt)
            for result in HEARTBEAT_RESULTS:
                self._add("colossalai_heartbeat_sends_total", [rank, name, result],
                          getattr(hb, result))


def families(snap: Snapshot, now: float | None = None, *,
             outside: bool = False) -> list[MetricFamily]:
    """Families for one rank's snapshot (see :class:`RankFamilies`)."""
    built = RankFamilies(outside=outside)
    built.add(snap, now)
    return built.families()
