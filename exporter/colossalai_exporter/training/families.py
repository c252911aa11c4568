"""Metric families from a rank snapshot: the one mapping from state to exposition.

Used in-process by the rank-0 server's collector (every series) and by the node
agent's ``ranks`` collector on snapshots read from disk (the outside view: what
the rules need, :data:`INSIDE_ONLY` left out), so both serve the same catalogued
names with the same ``rank`` label. Imports neither torch nor any training code:
the node agent uses it.
"""

from __future__ import annotations

from prometheus_client.core import Metric as MetricFamily

from colossalai_exporter import catalogue
from colossalai_exporter.training.oom import DEVICES
from colossalai_exporter.training.snapshot import Snapshot
from colossalai_exporter.training.state import HEARTBEAT_RESULTS, judge

INFO_LABELS = ("colossalai_version", "torch_version", "plugin", "placement_policy",
               "tp_size", "pp_size", "dp_size", "world_size", "run")
MONITOR_ERROR_PLACES = ("publish", "loss", "heartbeat", "server", "stacks", "hook")
# Served by the in-process server only: dashboards read them, no rule does, and the node
# agent's view of every rank stays within 25 series a rank (docs/metrics.md marks them).
INSIDE_ONLY = frozenset({
    "colossalai_training_step_duration_seconds", "colossalai_training_samples_total",
    "colossalai_training_tokens_total", "colossalai_training_stalls_total",
    "colossalai_training_loss", "colossalai_checkpoint_duration_seconds",
    "colossalai_checkpoint_in_flight", "colossalai_gemini_chunk_memory_bytes",
    "colossalai_gemini_h2d_bytes_total", "colossalai_gemini_d2h_bytes_total",
})


def _fmt(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))


def _gauge(out: list[MetricFamily], name: str, rank: str, value: float | None,
           *labels: str) -> None:
    fam = catalogue.gauge(name)
    if value is not None:  # an absent value is an empty family, not a zero
        fam.add_metric([rank, *labels], float(value))
    out.append(fam)


def _counter(out: list[MetricFamily], name: str, rank: str, value: float,
             *labels: str) -> None:
    # No created timestamp: a *_created series per counter would double the series
    # of every rank at fleet size for a value Prometheus does not use (issue 19).
    fam = catalogue.counter(name)
    fam.add_metric([rank, *labels], float(value))
    out.append(fam)


def families(snap: Snapshot, now: float | None = None, *,
             outside: bool = False) -> list[MetricFamily]:
    """Families for one rank's snapshot.

    ``outside`` is the node agent's view of every local rank: ``now`` re-judges
    the stall, and only what the rules need from outside the process is served
    (at most 25 series per rank with the agent's own four; tests/test_series_budget.py).
    The in-process server (``outside=False``) adds what only dashboards read: the
    step histogram's buckets, samples, tokens, loss, stalls, checkpoint duration and
    in-flight, Gemini's chunk memory and traffic, and every monitor error place.
    """
    rank = str(snap.rank)
    out: list[MetricFamily] = []
    stalled = snap.stalled if now is None else judge(snap, now)[0]

    info = catalogue.info("colossalai_training_info")
    values = dict(snap.info)
    values.setdefault("world_size", str(snap.world_size))
    info.add_metric([rank, *(str(values.get(k, "")) for k in INFO_LABELS)], {})
    out.append(info)

    _counter(out, "colossalai_training_steps_total", rank, snap.steps)
    _gauge(out, "colossalai_training_last_step_timestamp_seconds", rank, snap.last_step)
    _gauge(out, "colossalai_training_step_timeout_seconds", rank, snap.timeout)
    # The current phase only (1): the others' zeros are 6 series a rank that no rule
    # or panel needs, since every query selects the phase it asks about with == 1.
    _gauge(out, "colossalai_training_phase", rank, 1.0, snap.phase)
    _gauge(out, "colossalai_training_phase_start_timestamp_seconds", rank, snap.phase_start)
    _gauge(out, "colossalai_training_stalled", rank, 1.0 if stalled else 0.0)
    _gauge(out, "colossalai_kernels_ready", rank, 1.0 if snap.kernels_ready else 0.0)
    _counter(out, "colossalai_kernel_build_failures_total", rank, snap.kernel_failures)
    out.extend(_last_error(snap, rank))
    out.append(_activity(snap, rank, stalled))
    _counter(out, "colossalai_training_activity_samples_total", rank, snap.activity_samples)
    _counter(out, "colossalai_training_waiting_samples_total", rank, snap.waiting_samples)
    oom = catalogue.counter("colossalai_gemini_oom_total")
    for device in DEVICES:  # each device from 0, so the first OOM is an increase
        oom.add_metric([rank, device], float(snap.oom.get(device, 0)))
    out.append(oom)
    ckpt = snap.checkpoint
    _gauge(out, "colossalai_checkpoint_last_success_timestamp_seconds", rank,
           ckpt.last_success)
    _gauge(out, "colossalai_checkpoint_last_step", rank, ckpt.last_step)
    _counter(out, "colossalai_checkpoint_failures_total", rank, ckpt.failures)
    out.extend(_heartbeats(snap, rank))  # only on ranks that send them (rank 0 by default)
    out.append(_monitor_errors(snap, rank, every_place=not outside))
    if not outside:
        out.extend(_inside_only(snap, rank))
    return out


def _inside_only(snap: Snapshot, rank: str) -> list[MetricFamily]:
    out: list[MetricFamily] = [_histogram(snap, rank)]
    _counter(out, "colossalai_training_samples_total", rank, snap.samples)
    _counter(out, "colossalai_training_tokens_total", rank, snap.tokens)
    _counter(out, "colossalai_training_stalls_total", rank, snap.stalls)
    _gauge(out, "colossalai_training_loss", rank, snap.loss)
    _gauge(out, "colossalai_checkpoint_duration_seconds", rank, snap.checkpoint.duration)
    _gauge(out, "colossalai_checkpoint_in_flight", rank,
           1.0 if snap.checkpoint.in_flight else 0.0)
    gemini = snap.gemini
    if gemini is not None:  # GeminiPlugin only: absent rather than zero elsewhere
        chunk = catalogue.gauge("colossalai_gemini_chunk_memory_bytes")
        for device, value in sorted(gemini.chunk_memory.items()):
            chunk.add_metric([rank, device], float(value))
        out.append(chunk)
        _counter(out, "colossalai_gemini_h2d_bytes_total", rank, gemini.h2d)
        _counter(out, "colossalai_gemini_d2h_bytes_total", rank, gemini.d2h)
    return out


def _monitor_errors(snap: Snapshot, rank: str, every_place: bool) -> MetricFamily:
    # Outside, only the places that failed: six zeros a rank are for the dashboards of
    # the in-process view; a failing place still shows on every rank.
    errors = catalogue.counter("colossalai_training_monitor_errors_total")
    for where in MONITOR_ERROR_PLACES:
        count = snap.monitor_errors.get(where, 0)
        if every_place or count:
            errors.add_metric([rank, where], float(count))
    return errors


def _activity(snap: Snapshot, rank: str, stalled: bool) -> MetricFamily:
    # Only while the rank is stalled: then its place names who a hang waits for, and
    # it does not move. A healthy rank's place changes every second (no series churn).
    info = catalogue.info("colossalai_training_activity_info")
    where = snap.activity
    if stalled and where is not None:
        info.add_metric([rank, where.kind, where.collective, where.frame], {})
    return info


def _last_error(snap: Snapshot, rank: str) -> list[MetricFamily]:
    # Absent (empty families) until the rank has seen an exception.
    info = catalogue.info("colossalai_training_last_error_info")
    when = catalogue.gauge("colossalai_training_last_error_timestamp_seconds")
    error = snap.last_error
    if error is not None:
        info.add_metric([rank, error.where, error.type, error.device, error.message], {})
        when.add_metric([rank], error.time)
    return [info, when]


def _histogram(snap: Snapshot, rank: str) -> MetricFamily:
    fam = catalogue.histogram("colossalai_training_step_duration_seconds")
    bounds = [*snap.step_buckets, float("inf")]
    cumulative, buckets = 0, []
    for bound, count in zip(bounds, snap.step_hist, strict=True):
        cumulative += int(count)
        buckets.append((_fmt(bound), float(cumulative)))
    # The count is the +Inf bucket by construction, so the exposition is consistent
    # even if the hot path bumped a bucket while this was read.
    fam.add_metric([rank], buckets, snap.step_sum)
    return fam


def _heartbeats(snap: Snapshot, rank: str) -> list[MetricFamily]:
    success = catalogue.gauge("colossalai_heartbeat_last_success_timestamp_seconds")
    attempt = catalogue.gauge("colossalai_heartbeat_last_attempt_timestamp_seconds")
    sends = catalogue.counter("colossalai_heartbeat_sends_total")
    for name, hb in sorted(snap.heartbeats.items()):
        if hb.last_success is not None:
            success.add_metric([rank, name], hb.last_success)
        if hb.last_attempt is not None:
            attempt.add_metric([rank, name], hb.last_attempt)
        for result in HEARTBEAT_RESULTS:
            sends.add_metric([rank, name, result], float(getattr(hb, result)))
    return [success, attempt, sends]
