"""Pace: how fast each rank steps and how much it waits, and TrainingStraggler.

The recording rules (step rates, mean step time, the share of time each rank
waits for the others) feed the training dashboard and the straggler rules, which
compare each rank with the median of its job or run: a rank much slower than the
rest, or, in a synchronous job where every rank steps at the slowest one's rate,
the rank that hardly waits while the others wait for it.
"""

from __future__ import annotations

from colossalai_exporter.rulesgen.common import (
    FAILED,
    TRAINING,
    down,
    in_phase,
    on_any_rank,
    rank_down,
    runs_with,
    stalled_now,
    training_dashboard,
)
from colossalai_exporter.rulesgen.config import Thresholds
from colossalai_exporter.rulesgen.gpu import rank_gpu_slowdowns
from colossalai_exporter.rulesgen.model import Alert, Group, Recording
from colossalai_exporter.rulesgen.promql import (
    Selector,
    block,
    expr,
    fill,
    first_sample,
    histogram_rate,
    indent,
    number,
    query,
)

#: the step histogram the mean is taken from (and the dashboard's percentile)
STEP_HISTOGRAM = "colossalai_training_step_duration_seconds"
LAST_STEP = "colossalai_training_last_step_timestamp_seconds"

# Recording rules other rules and the dashboards use.
STEP_RATE = "job_rank:colossalai_training_steps:rate5m"
STEP_RATE_MEDIAN = "job:colossalai_training_steps:median_rate5m"
STEP_RATE_RATIO = "job_rank:colossalai_training_steps:rate5m_ratio_to_median"
STEP_MEAN = "job_rank:colossalai_training_step_duration_seconds:mean5m"
WAIT_SHARE = "run_rank:colossalai_training_waiting:ratio5m"
WAIT_SHARE_MEDIAN = "run_pipeline_stage:colossalai_training_waiting:median_ratio5m"
SUMMARY = "A training rank is much slower than the rest of its job."
#: The ranks that do the same work, which a rank's waiting is compared with: its run's,
#: within its pipeline stage where the monitor knows it (the info's ``pipeline_stage``).
#: Stages of a pipeline do different work, and the one with most of it (the last, with
#: the LM head and the loss) waits least at every step: compared across stages, every
#: unbalanced pipeline paged its heaviest stage as a straggler for its whole run.
PEERS = "(run, pipeline_stage)"


def recording(rank_servers: Selector, node_agents: Selector, interval: str) -> Group:
    """The training file's recording group: step rates and waiting shares, every
    ``interval``. Rates over 5 minutes, read by TrainingStraggler (in the slower alerts'
    group) and the dashboards, not by an alert that pages within a minute: at 4,096
    ranks the waiting share alone cost about 200 ms an evaluation."""
    # The share of time each rank waits for the others, from its monitor's samples of
    # the training thread (training/activity.py), on any rank, by run.
    # Only ranks training now and answering: a dead rank's counters stay served
    # (its last snapshot) and their rates would say it never waits.
    def waiting_share(view: Selector) -> str:
        return (f"(\n  rate({view('colossalai_training_waiting_samples_total')}[5m])\n  /\n"
                f"  rate({view('colossalai_training_activity_samples_total')}[5m])\n)\n"
                f"and ignoring (phase) {in_phase(view, TRAINING)}\n"
                f"unless on (job, instance, rank) {rank_down(view)}")

    return Group("colossalai-training.recording", (
        Recording(STEP_RATE, expr(f"""
            sum by (job, rank) (rate({rank_servers("colossalai_training_steps_total")}[5m]))
        """)),
        Recording(STEP_RATE_MEDIAN, f"quantile by (job) (0.5, {STEP_RATE})"),
        Recording(STEP_RATE_RATIO, f"{STEP_RATE} / on (job) group_left () {STEP_RATE_MEDIAN}"),
        Recording(STEP_MEAN, step_mean(rank_servers)),
        Recording(WAIT_SHARE, on_any_rank(waiting_share, rank_servers, node_agents,
                                          labels=("run", "pipeline_stage"))),
        Recording(WAIT_SHARE_MEDIAN, f"quantile by {PEERS} (0.5, {WAIT_SHARE})"),
    ), interval=interval)


def step_mean(rank_servers: Selector) -> str:
    """Each rank's mean step time over 5m, from its step histogram stored classic or
    native (:func:`~colossalai_exporter.rulesgen.promql.histogram_rate`)."""
    def rate(part: str) -> str:
        return block(histogram_rate(rank_servers, STEP_HISTOGRAM, part, "5m"), "sum by (job, rank)")
    return f"{rate('sum')}\n/\n{rate('count')}"


def not_stepping_on(view: Selector) -> str:
    """The ranks of ``view`` that are stalled, failed or down: a job or run with one
    hangs or dies, and its ranks' pace says nothing of a straggler."""
    return (f"{stalled_now(view)}\n"
            f"or ignoring (phase) {in_phase(view, FAILED)}\n"
            f"or {down(view)}")


def stragglers(rank_servers: Selector, node_agents: Selector,
               thresholds: Thresholds) -> tuple[Alert, Alert]:
    """TrainingStraggler by step rate, then by the share of time waiting."""
    # As for waits_least: a job with a stalled, failed or unanswering rank hangs or dies,
    # and the step rates of its ranks, all falling, say nothing of a straggler. Where
    # every rank serves (serve="local"), a hung rank's rate fell first and paged it a
    # second time, as a straggler, under its hang's page (the fault suite, once).
    stalled_jobs = block(not_stepping_on(rank_servers), "count by (job)")
    return (
        Alert(
            "TrainingStraggler",
            f"{STEP_RATE_RATIO} < {number(thresholds.straggler_ratio)}\n"
            f"unless on (job)\n{indent(stalled_jobs)}",
            "warning", SUMMARY,
            fill("Rank [[$rank]] of job [[$job]] steps at {{ $value | humanizePercentage }} of "
                 "the job's median rate ([[median]] steps/s), below [[ratio]].",
                 median=query(STEP_RATE_MEDIAN, ("job",), 'value | printf "%.3g"'),
                 ratio=f"{thresholds.straggler_ratio:.0%}")
            + rank_gpu_slowdowns(by_run=False),
            training_dashboard(), cause="step_rate"),
        waits_least(rank_servers, node_agents, thresholds),
    )


def waits_least(rank_servers: Selector, node_agents: Selector, thresholds: Thresholds) -> Alert:
    """TrainingStraggler: in a synchronous job every rank steps at the slowest one's
    rate: the straggler is the rank that hardly waits while the others wait for it."""
    # A run with a stalled, failed or unanswering rank hangs or dies (the hang and
    # rank-down alerts'): its ranks' shares of time waiting say nothing about a
    # straggler then.
    stalled_runs = runs_with(on_any_rank(not_stepping_on, rank_servers, node_agents))
    # Nor before its stall: a rank frozen in compute waits least from the moment it
    # freezes, and a stall budget or a process group's timeout can outlast this alert's
    # `for` (a 40 s budget, a 15 s timeout: the fault suite paged the frozen rank as the
    # straggler). A straggler steps.
    within = thresholds.straggler_stepped_within
    stepping = "\nor\n".join(f"(time() - {view(LAST_STEP)} < {within.seconds:g})"
                              for view in (node_agents, rank_servers))
    return Alert(
        "TrainingStraggler",
        expr(f"""
            {WAIT_SHARE}
              < on {PEERS} group_left ()
                ({number(thresholds.straggler_wait_ratio)} * {WAIT_SHARE_MEDIAN})
            and on {PEERS}
              ({WAIT_SHARE_MEDIAN} > {number(thresholds.straggler_min_waiting)})
            and on {PEERS}
              (count by {PEERS} ({WAIT_SHARE}) > 1)
        """) + f"\nand on (job, instance, rank)\n(\n{indent(stepping)}\n)"
        + f"\nunless on (run)\n{indent(stalled_runs)}",
        "warning", SUMMARY,
        fill("Rank [[$rank]][[of_run]] on [[$instance]] is the rank the others wait for at "
             "every step: it waits for them {{ $value | humanizePercentage }} of the time, "
             "while the median rank of its run[[stage]] waits [[median]] (in a synchronous "
             "job every rank steps at the slowest one's rate).",
             stage="{{ with $labels.pipeline_stage }}'s pipeline stage {{ . }}{{ end }}",
             median=first_sample(f"{WAIT_SHARE_MEDIAN}{{run=%q,pipeline_stage=%q}}",
                                 "$labels.run $labels.pipeline_stage",
                                 "{{ .Value | humanizePercentage }}"))
        + rank_gpu_slowdowns(by_run=True),
        training_dashboard(), cause="waits_least")
