"""Metric families from a rank snapshot: the one mapping from state to exposition.

Used in-process by the rank-0 server's collector and by the node agent's
``ranks`` collector on snapshots read from disk, so both serve the same
catalogued names with the same ``rank`` label. Imports neither torch nor any
training code: the node agent uses it.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.core import Metric as MetricFamily

from colossalai_exporter import catalogue
from colossalai_exporter.training.oom import DEVICES
from colossalai_exporter.training.snapshot import Snapshot
from colossalai_exporter.training.state import HEARTBEAT_RESULTS, PHASES, judge

INFO_LABELS = ("colossalai_version", "torch_version", "plugin", "placement_policy",
               "tp_size", "pp_size", "dp_size", "world_size", "run")
MONITOR_ERROR_PLACES = ("publish", "loss", "heartbeat", "server", "stacks", "hook")


def _fam(name: str) -> Any:
    # catalogue.family() is typed as the Metric base class; each concrete family has
    # its own add_metric() signature.
    return catalogue.family(name)


def _fmt(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))


def _gauge(out: list[MetricFamily], name: str, rank: str, value: float | None,
           *labels: str) -> None:
    fam = _fam(name)
    if value is not None:  # an absent value is an empty family, not a zero
        fam.add_metric([rank, *labels], float(value))
    out.append(fam)


def _counter(out: list[MetricFamily], name: str, rank: str, value: float, created: float,
             *labels: str) -> None:
    fam = _fam(name)
    fam.add_metric([rank, *labels], float(value), created=created)
    out.append(fam)


def families(snap: Snapshot, now: float | None = None) -> list[MetricFamily]:
    """Families for one rank's snapshot; ``now`` re-judges the stall (node agent)."""
    rank = str(snap.rank)
    created = snap.created
    out: list[MetricFamily] = []
    stalled = snap.stalled if now is None else judge(snap, now)[0]

    info = _fam("colossalai_training_info")
    values = dict(snap.info)
    values.setdefault("world_size", str(snap.world_size))
    info.add_metric([rank, *(str(values.get(k, "")) for k in INFO_LABELS)], {})
    out.append(info)

    _counter(out, "colossalai_training_steps_total", rank, snap.steps, created)
    _gauge(out, "colossalai_training_last_step_timestamp_seconds", rank, snap.last_step)
    out.append(_histogram(snap, rank))
    _gauge(out, "colossalai_training_step_timeout_seconds", rank, snap.timeout)
    phase_fam = _fam("colossalai_training_phase")
    for phase in PHASES:
        phase_fam.add_metric([rank, phase], 1.0 if phase == snap.phase else 0.0)
    out.append(phase_fam)
    _gauge(out, "colossalai_training_phase_start_timestamp_seconds", rank, snap.phase_start)
    _counter(out, "colossalai_training_samples_total", rank, snap.samples, created)
    _counter(out, "colossalai_training_tokens_total", rank, snap.tokens, created)
    _gauge(out, "colossalai_training_stalled", rank, 1.0 if stalled else 0.0)
    _counter(out, "colossalai_training_stalls_total", rank, snap.stalls, created)
    _gauge(out, "colossalai_training_loss", rank, snap.loss)
    _gauge(out, "colossalai_kernels_ready", rank, 1.0 if snap.kernels_ready else 0.0)
    _counter(out, "colossalai_kernel_build_failures_total", rank, snap.kernel_failures,
             created)
    out.extend(_last_error(snap, rank))
    out.append(_activity(snap, rank, stalled))
    _counter(out, "colossalai_training_activity_samples_total", rank, snap.activity_samples,
             created)
    _counter(out, "colossalai_training_waiting_samples_total", rank, snap.waiting_samples,
             created)

    oom = _fam("colossalai_gemini_oom_total")
    for device in DEVICES:
        oom.add_metric([rank, device], float(snap.oom.get(device, 0)), created=created)
    out.append(oom)
    out.extend(_checkpoint_and_gemini(snap, rank, created))
    out.extend(_heartbeats(snap, rank, created))
    errors = _fam("colossalai_training_monitor_errors_total")
    for where in MONITOR_ERROR_PLACES:
        errors.add_metric([rank, where], float(snap.monitor_errors.get(where, 0)),
                          created=created)
    out.append(errors)
    return out


def _checkpoint_and_gemini(snap: Snapshot, rank: str, created: float) -> list[MetricFamily]:
    out: list[MetricFamily] = []
    ckpt = snap.checkpoint
    _gauge(out, "colossalai_checkpoint_last_success_timestamp_seconds", rank,
           ckpt.last_success)
    _gauge(out, "colossalai_checkpoint_last_step", rank, ckpt.last_step)
    _gauge(out, "colossalai_checkpoint_duration_seconds", rank, ckpt.duration)
    _counter(out, "colossalai_checkpoint_failures_total", rank, ckpt.failures, created)
    _gauge(out, "colossalai_checkpoint_in_flight", rank, 1.0 if ckpt.in_flight else 0.0)
    gemini = snap.gemini
    if gemini is not None:  # GeminiPlugin only: absent rather than zero elsewhere
        chunk = _fam("colossalai_gemini_chunk_memory_bytes")
        for device, value in sorted(gemini.chunk_memory.items()):
            chunk.add_metric([rank, device], float(value))
        out.append(chunk)
        _counter(out, "colossalai_gemini_h2d_bytes_total", rank, gemini.h2d, created)
        _counter(out, "colossalai_gemini_d2h_bytes_total", rank, gemini.d2h, created)
    return out


def _activity(snap: Snapshot, rank: str, stalled: bool) -> MetricFamily:
    # Only while the rank is stalled: then its place names who a hang waits for, and
    # it does not move. A healthy rank's place changes every second (no series churn).
    info = _fam("colossalai_training_activity_info")
    where = snap.activity
    if stalled and where is not None:
        info.add_metric([rank, where.kind, where.collective, where.frame], {})
    served: MetricFamily = info
    return served


def _last_error(snap: Snapshot, rank: str) -> list[MetricFamily]:
    # Absent (empty families) until the rank has seen an exception.
    info = _fam("colossalai_training_last_error_info")
    when = _fam("colossalai_training_last_error_timestamp_seconds")
    error = snap.last_error
    if error is not None:
        info.add_metric([rank, error.where, error.type, error.device, error.message], {})
        when.add_metric([rank], error.time)
    return [info, when]


def _histogram(snap: Snapshot, rank: str) -> MetricFamily:
    fam = catalogue.histogram("colossalai_training_step_duration_seconds")
    assert isinstance(fam, HistogramMetricFamily)
    bounds = [*snap.step_buckets, float("inf")]
    cumulative, buckets = 0, []
    for bound, count in zip(bounds, snap.step_hist, strict=True):
        cumulative += int(count)
        buckets.append((_fmt(bound), float(cumulative)))
    # The count is the +Inf bucket by construction, so the exposition is consistent
    # even if the hot path bumped a bucket while this was read.
    fam.add_metric([rank], buckets, snap.step_sum)
    return fam


def _heartbeats(snap: Snapshot, rank: str, created: float) -> list[MetricFamily]:
    success = _fam("colossalai_heartbeat_last_success_timestamp_seconds")
    attempt = _fam("colossalai_heartbeat_last_attempt_timestamp_seconds")
    sends = _fam("colossalai_heartbeat_sends_total")
    for name, hb in sorted(snap.heartbeats.items()):
        if hb.last_success is not None:
            success.add_metric([rank, name], hb.last_success)
        if hb.last_attempt is not None:
            attempt.add_metric([rank, name], hb.last_attempt)
        for result in HEARTBEAT_RESULTS:
            sends.add_metric([rank, name, result], float(getattr(hb, result)),
                             created=created)
    return [success, attempt, sends]
