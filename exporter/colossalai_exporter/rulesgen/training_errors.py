"""Errors a rank reports of itself: GeminiOutOfMemory, CheckpointFailing,
KernelBuildFailed, KernelsNotReady.

The rank counts each failure as it happens and keeps the time of the last one
(training/state.py), so the first three name the cause of an incident directly:
cause alerts that mute their run's stalls and rank-downs (docs/rules.md, "One
incident, one page"). They read either view, since the error is often the rank's
last act: the node agent serves the snapshot the rank wrote as the exception
passed. KernelsNotReady, the rank server's report that its kernels are not loaded,
is a consequence a failed build explains.

The alerts select the failure's time, not the counter. The time exists only on the
ranks and devices that failed, so the selection is empty while the fleet is healthy;
the counters exist on every rank and device, and reading three of them over their
windows cost about 350 ms an evaluation at 4,096 ranks (bench/RESULTS.md). A rank
restarted under the same labels serves a new time when it fails again, and the old
process' time stays in the window's range: neither hides behind the other. The times
carry the rank's run, so no alert joins it from every rank's info.
"""

from __future__ import annotations

from colossalai_exporter.rulesgen.common import (
    ENDED,
    PHASE,
    RANK,
    RANK_UP,
    except_in_phase,
    last_error,
    on_any_rank,
    training_dashboard,
    with_run,
)
from colossalai_exporter.rulesgen.config import Duration, Thresholds
from colossalai_exporter.rulesgen.model import Alert
from colossalai_exporter.rulesgen.promql import Selector, fill, query, with_first


def rank_errors(rank_servers: Selector, node_agents: Selector,
                thresholds: Thresholds) -> tuple[Alert, ...]:
    """The family's error alerts, in the order the rule file lists them (KernelsNotReady,
    :func:`kernels_not_ready`, evaluates in the slower group)."""
    return (
        _error_alert(
            "GeminiOutOfMemory", "colossalai_gemini_oom_total",
            "colossalai_gemini_oom_last_timestamp_seconds", thresholds.gemini_oom_window,
            "A training rank ran out of memory.",
            "Rank [[$rank]][[of_run]] on [[$instance]] ran out of [[memory]]: [[count]] "
            "out-of-memory error(s) since the rank started, the last within [[window]]."
            "[[died]][[last_error]]",
            rank_servers, node_agents, match=(*RANK, "device"),
            memory='{{ if eq $labels.device "cuda" }}GPU memory (CUDA){{ else if eq '
                   '$labels.device "cpu" }}host memory{{ else }}NVMe offload space'
                   "{{ end }}"),
        _error_alert(
            "CheckpointFailing", "colossalai_checkpoint_failures_total",
            "colossalai_checkpoint_last_failure_timestamp_seconds",
            thresholds.checkpoint_failure_window, "A checkpoint save raised an error.",
            "Rank [[$rank]][[of_run]] on [[$instance]]: [[count]] checkpoint save(s) failed "
            "since the rank started, the last within [[window]].[[died]][[last_error]]",
            rank_servers, node_agents),
        _error_alert(
            "KernelBuildFailed", "colossalai_kernel_build_failures_total",
            "colossalai_kernel_build_last_failure_timestamp_seconds",
            thresholds.kernel_failure_window, "Loading or building a ColossalAI kernel failed.",
            "Rank [[$rank]][[of_run]] on [[$instance]]: [[count]] kernel load(s) or JIT "
            "build(s) failed since the rank started, the last within [[window]].[[died]]"
            "[[last_error]]",
            rank_servers, node_agents),
    )


def _since_died() -> str:
    """" The rank's process has since died." when it has: the error was its last act."""
    return with_first(RANK_UP, RANK, " The rank's process has since died.",
                      extra=" == 0")


def _error_alert(name: str, counter: str, last: str, window: Duration, summary: str,
                 text: str, rank_servers: Selector, node_agents: Selector,
                 match: tuple[str, ...] = RANK, **values: str) -> Alert:
    """``name``: a rank's ``last`` failure time (the gauge beside ``counter``) fell
    within ``window``, valued by that time.

    Read over the window, not at the instant: a rank whose process died after the
    failure keeps the time in range until the window has passed. ``text`` fills
    ``[[count]]`` (the counter, for the firing alert only), ``[[window]]``, ``[[died]]``,
    ``[[last_error]]`` and ``values``.
    """
    return Alert(
        name,
        on_any_rank(lambda view: f"max_over_time({view(last)}[{window}])"
                                 f" > time() - {window.seconds}",
                    rank_servers, node_agents, run_from=None),
        "critical", summary,
        # over the window too: a dead rank's own server is stale from its next scrape
        fill(text, count=query(counter, match, 'value | printf "%.0f"',
                               before="last_over_time(", extra=f"[{window}])"),
             window=window,
             died=_since_died(), last_error=last_error(), **values),
        training_dashboard())


def kernels_not_ready(rank_servers: Selector, kernels_for: Duration) -> Alert:
    """KernelsNotReady: a rank still running whose kernels are not loaded."""
    not_ready = f"{rank_servers('colossalai_kernels_ready')} == 0"
    return Alert(
        "KernelsNotReady",
        with_run(except_in_phase(rank_servers, not_ready, ENDED)),
        "warning", "A training rank's ColossalAI kernels are not ready.",
        fill("Rank [[$rank]] of job [[$job]] ([[$instance]]) has reported its kernels not "
             "ready for more than [[for]] (phase [[phase]]).",
             phase=query(PHASE, RANK, 'label "phase"', extra=" == 1"),
             **{"for": kernels_for}),
        training_dashboard())
