"""Goodput: the share of a run's time whose work it kept, and the alerts for work lost.

Its recording rules give each run's goodput over an hour and a day
(docs/rules.md, "Goodput", defines it); the alerts watch what lowers it: a run
with no checkpoint for longer than the configured interval (CheckpointOverdue:
its work since is at risk), and one that keeps restarting from the same
checkpoint (TrainingRestartLoop: its work since is lost each time, a cause
alert). Goodput and restarts look back a day, over which a rank of a node may
serve two runs: the counters and start times they read carry ``run`` themselves.
"""

from __future__ import annotations

from colossalai_exporter.rulesgen.common import (
    FINISHED,
    INFO,
    RANK,
    RANK_RUN,
    TRAINING,
    in_phase,
    on_any_rank,
    only_in_phase,
    rank_down,
    runs_with,
    training_dashboard,
)
from colossalai_exporter.rulesgen.config import Duration, Thresholds
from colossalai_exporter.rulesgen.model import Alert, Group, Recording
from colossalai_exporter.rulesgen.promql import (
    Selector,
    expr,
    fill,
    first_sample,
    indent,
    label_is,
    number,
    query,
)

# Goodput's windows and how often each is evaluated: a day's window reads a day of
# samples of two counters a rank, so it is evaluated every 5 minutes, not every 15 s.
GOODPUT_WINDOWS = {"1h": "1m", "24h": "5m"}
START = "colossalai_training_start_timestamp_seconds"
LAST_CHECKPOINT = "colossalai_checkpoint_last_success_timestamp_seconds"
PRODUCED = "colossalai_training_productive_seconds_total"
SAVED = "colossalai_training_checkpointed_seconds_total"
RANK_0 = label_is("rank", "0")


def goodput_ratio(window: str) -> str:
    """``colossalai:job_goodput_ratio:<window>``: per run, see docs/rules.md, "Goodput"."""
    return f"colossalai:job_goodput_ratio:{window}"


def kept_seconds(window: str) -> str:
    """Productive step seconds each rank kept over ``window`` (the goodput's numerator)."""
    return f"run_rank:colossalai_training_kept_seconds:{window}"


def checkpointed_increase(window: str) -> str:
    """Each rank's checkpointed seconds' increase over ``window`` (read by kept_seconds)."""
    return f"rank:colossalai_training_checkpointed_seconds:increase{window}"


def goodput_groups(rank_servers: Selector, node_agents: Selector) -> tuple[Group, ...]:
    """One group a window, each at its own interval."""
    # Goodput needs no 15 s resolution, and at 4,096 ranks the 1 h group alone costs
    # 1.5-2 s an evaluation (bench/RESULTS.md, "Fleet").
    return tuple(
        Group(f"colossalai-training.goodput-{window}",
              goodput(rank_servers, node_agents, window), interval=every)
        for window, every in GOODPUT_WINDOWS.items())


def goodput(rank_servers: Selector, node_agents: Selector,
            window: str) -> tuple[Recording, Recording, Recording]:
    """Goodput over ``window`` per run (docs/rules.md, "Goodput", defines it).

    The checkpointed seconds' increase over the window is recorded first, once for
    both views, and read three times by each view's kept seconds: over 24 h each
    increase() decodes a day of samples a rank, and PromQL computes a repeated
    subexpression again each time (bench/RESULTS.md, "Goodput over a day").
    """
    return (Recording(checkpointed_increase(window),
                      f"increase({node_agents(SAVED)}[{window}])\nor\n"
                      f"increase({rank_servers(SAVED)}[{window}])"),
            Recording(kept_seconds(window), _kept_once(rank_servers, node_agents, window)),
            Recording(goodput_ratio(window), _ratio(rank_servers, node_agents, window)))


def _kept_once(rank_servers: Selector, node_agents: Selector, window: str) -> str:
    """:func:`_kept` of each rank of a run from one view: the node agent's, else the rank
    server's. The agent's kept seconds exist exactly where its checkpointed seconds'
    increase does (the sum is anchored on it), so the rank servers' view leaves out
    the ranks of that recorded set, read once: computing the agent's whole expression
    a second time for it (as one_view_per_rank does) cost about half the group."""
    return (f"{_kept(node_agents, window)}\nor\n(\n{indent(_kept(rank_servers, window))}\n"
            f"  unless on (run, rank)\n    {node_agents(checkpointed_increase(window))}\n)")


def _kept(view: Selector, window: str) -> str:
    """Kept seconds of each rank over the window: what its checkpoints saved within it,
    plus what it has done since its last checkpoint if its process is alive, less what
    it had done since its last checkpoint when the window began (saved within the
    window, or lost). A restart resets both counters, which increase() handles; the
    work a crash loses is in neither term."""
    increase = view(checkpointed_increase(window))
    zero = f"0 * {increase}"  # a series without the term: 0, not no result
    return expr(f"""
        (
            {increase}
          +
            (
                {view(PRODUCED)} - {view(SAVED)}
                unless on (job, instance, rank) {rank_down(view)}
              or
                {zero}
            )
          -
            (
                {view(PRODUCED)} offset {window} - {view(SAVED)} offset {window}
              or
                {zero}
            )
        )
    """)


def _ratio(rank_servers: Selector, node_agents: Selector, window: str) -> str:
    """The run's goodput: its ranks' mean kept seconds over the window, or over the
    run's age where it is younger (its first start within the window), while a rank of
    it has not finished.

    Both terms read few series: the run's first start is its rank 0's (torchrun starts
    and restarts every rank of a job together), and the runs with a rank not finished
    are every rank's run (recorded once by the alerts' group) less the ranks that
    finished, a set empty while a run trains. Read over every rank (each rank's start
    over the window; each rank's phase joined to its run in each view) they cost about
    230 ms of the 1 h group's 620 at 4,096 ranks (bench/RESULTS.md).
    """
    seconds = Duration.parse(window).seconds
    per_rank = kept_seconds(window)

    def first_start(view: Selector) -> str:
        return f"min_over_time({view(START, RANK_0)}[{window}])"

    # A run whose rank 0 no view serves (its node has no agent and serve="none") is
    # dated by its ranks' current processes instead: younger after a restart.
    started = (f"min by (run) ({first_start(rank_servers)} or {first_start(node_agents)})\n"
               f"or on (run)\n"
               f"min by (run) ({rank_servers(START)} or {node_agents(START)})")
    finished = f"{in_phase(node_agents, FINISHED)}\nor\n{in_phase(rank_servers, FINISHED)}"
    live = f"{RANK_RUN}\nunless on (job, instance, rank)\n(\n{indent(finished)}\n)"
    return expr(f"""
        clamp(
            sum by (run) ({per_rank})
          /
            count by (run) (count by (run, rank) ({per_rank}))
          /
            clamp_max(
              time() - (
{indent(started, 16)}
              ),
              {number(seconds)}
            ),
          0, 1
        )
        and on (run)
{indent(runs_with(live), 10)}
    """)


def checkpoint_overdue(rank_servers: Selector, interval: Duration) -> Alert:
    """CheckpointOverdue: no successful checkpoint within ``interval`` while training."""
    last_success = rank_servers(LAST_CHECKPOINT)
    # Before the first checkpoint the run's start (the rank server's process start)
    # stands in for the last success, so a run that never checkpoints fires too.
    since_checkpoint = expr(f"""
        (
          time()
          - (
              {last_success} > 0
            or
              ({last_success} == 0)
              + on (job, instance) group_left ()
                {rank_servers("process_start_time_seconds")}
          )
        )
        > {number(interval.seconds)}
    """)
    return Alert(
        "CheckpointOverdue",
        only_in_phase(rank_servers, since_checkpoint, TRAINING),
        "warning", "No successful checkpoint for longer than the configured interval.",
        fill("Rank [[$rank]] of job [[$job]] ([[$instance]]) has had no successful "
             "checkpoint for {{ $value | humanizeDuration }} while training (expected at "
             "least every [[interval]]); last checkpointed step: [[step]].",
             interval=interval,
             step=query("colossalai_checkpoint_last_step", RANK, "value", otherwise="none")),
        training_dashboard())


def restart_loop(rank_servers: Selector, node_agents: Selector,
                 thresholds: Thresholds) -> Alert:
    """TrainingRestartLoop: a run whose ranks keep restarting and no checkpoint comes of it.

    A restart is a new start time of a rank's monitor (its process), counted on the
    series of its run. The run's busiest rank is taken: every rank restarts with its
    job, and a view that missed a start (a scrape between two) counts one fewer.
    """
    window = thresholds.restart_loop_window
    saved = on_any_rank(lambda view: f"max_over_time({view(LAST_CHECKPOINT)}[{window}])",
                        rank_servers, node_agents)
    rule = expr(f"""
        max by (run) (
            changes({rank_servers(START)}[{window}])
          or
            changes({node_agents(START)}[{window}])
        ) >= {thresholds.restart_loop_restarts}
        unless on (run)
        (
          max by (run) (
{indent(saved, 12)}
          ) > time() - {number(window.seconds)}
        )
    """)
    # The run's earliest last error: the rank that failed first is the likeliest cause,
    # the others die of it (a peer gone from a collective, torchrun's SIGTERM). Over the
    # window, not at the instant: the alert fires as a restart begins, when the new
    # processes have not failed yet and their snapshots (which replace the failed
    # ones') carry no error (a fault-suite crash loop paged without its cause so).
    def last_in_window(series: str) -> str:
        return f"max by (job, instance, rank) (last_over_time({series}[{window}]))"

    error_time = last_in_window("colossalai_training_last_error_timestamp_seconds")
    first_failed = (f"bottomk(1, {error_time} * on (job, instance, rank) group_left () "
                    f"{last_in_window(f'{INFO}{{run=%q}}')})")
    first_failure = first_sample(
        f"last_over_time(colossalai_training_last_error_info[{window}])"
        f" and on (job, instance, rank) {first_failed}",
        "$labels.run",
        " First failure (rank {{ .Labels.rank }}, in {{ .Labels.where }}): "
        "{{ .Labels.type }}: {{ .Labels.message }}")
    return Alert(
        "TrainingRestartLoop", rule, "critical",
        "A training run keeps restarting without writing a checkpoint.",
        fill('Run [[$run]] restarted {{ $value | printf "%.0f" }} times in the last '
             "[[window]] and wrote no checkpoint meanwhile: each restart resumes from the "
             "same checkpoint and loses the work since, so the run makes no progress."
             "[[last_error]]", window=window, last_error=first_failure))
