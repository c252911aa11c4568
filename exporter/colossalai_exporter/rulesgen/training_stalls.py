"""Stalls: TrainingStalled, TrainingStartupStuck, TrainingRanksMissing,
TrainingNeverStarted, CheckpointStuck, CompileStuck, EvaluationStuck, DataStartStuck.

A rank that stays in one phase beyond that phase's budget. In every phase
``colossalai_training_step_timeout_seconds`` is the budget of that phase
(start-up, step or checkpoint), so these rules compare against it rather than
against one fixed number for every model size. Stalls are consequences: the
rank a stalled run waits for is named by training_hangs.py, and a cause alert
of the run (a checkpoint stuck in torch.save, a failed kernel build) mutes them.
"""

from __future__ import annotations

from colossalai_exporter.rulesgen.common import (
    ACTIVITY,
    BUSY,
    FINISHED,
    INFO,
    RANK,
    RANK_RUN,
    STALLED,
    TRAINING,
    TROUBLED_RUN,
    down,
    except_in_phase,
    in_phase,
    last_error,
    on_any_rank,
    only_in_phase,
    phase_is,
    ranks_of_run,
    runs_with,
    stalled_now,
    training_dashboard,
    with_run,
)
from colossalai_exporter.rulesgen.config import Duration
from colossalai_exporter.rulesgen.model import Alert
from colossalai_exporter.rulesgen.promql import (
    Selector,
    block,
    choose,
    expr,
    fill,
    indent,
    label_is,
    printf_query,
    query,
    with_first,
)
from colossalai_exporter.rulesgen.training_deaths import (
    EXIT,
    FINISHED_EXIT,
    live_in_own_phase,
    stalled_waiting,
)
from colossalai_exporter.rulesgen.training_hangs import NOT_WAITING, waiting_ranks, waiting_text

BUDGET = "colossalai_training_step_timeout_seconds"
PHASE_START = "colossalai_training_phase_start_timestamp_seconds"


#: " 2 rank(s) of this run are stalled.": how far a stall reaches, in its page
STALLED_REACH = ranks_of_run(f"{STALLED} == 1", "rank(s) of this run are stalled.")


def _budget() -> str:
    """The rank's budget for its phase, e.g. "10m"."""
    return query(BUDGET, RANK, "value | humanizeDuration")



#: The ends of a rank that its own page names (TrainingRankDown: killed, failed of its
#: own error, hung then ended; TrainingRankOOMKilled): a rank of its run left waiting
#: for it in a collective is its consequence.
PAGED_EXITS = label_is("reason", "killed", "failed", "hung", "oom_killed")


def waiting_for_the_dead(rank_servers: Selector, node_agents: Selector) -> str:
    """The stalled ranks that wait in a collective (rank servers' view) in runs where a
    rank ended in a way its own page names (PAGED_EXITS).

    Inhibition alone left a gap: a hung job stopped by its operator (scancel: SIGTERM to
    the launcher) ends the hung rank at once, and TrainingHangSuspect with it, while the
    rank that waited lives on in its collective until the launcher kills it; for the
    minute TrainingRankDown waits before it names the hung rank's end, nothing muted the
    waiting rank's TrainingStalled, which paged it as a second culprit (found by a first
    user's walk through the docs; fault case hang-then-stopped). A rank that ends without
    a page of its own (interrupted alone, failed of a peer) still leaves its waiting
    ranks to this alert: nothing else would say the run is stuck."""
    ended = f"count by (run) ({node_agents(EXIT, PAGED_EXITS)})"
    return f"{block(stalled_waiting(rank_servers))}\nand on (run)\n  {ended}"


def waiting_for_own_phase(rank_servers: Selector, node_agents: Selector) -> str:
    """The stalled ranks that wait in a collective (rank servers' view) in runs where a
    live rank is in a phase with a budget and an alert of its own (BUSY: a save, an
    evaluation, a recompile, start-up), within that budget or beyond it.

    Within it, the busy rank's budget decides (waiting_for_busy). Beyond it, its own
    alert names it (CheckpointStuck, EvaluationStuck, CompileStuck,
    TrainingStartupStuck), and the waiting ranks are its consequence. Left to
    Alertmanager's inhibition, the consequence paged first: the shipped `for` of
    TrainingStalled (30s) is half of the stuck phases' (1m), so a rank waiting behind a
    stuck recompile paged as the culprit 30 seconds before CompileStuck named the rank
    that recompiled (fault case recompile-hangs, once the suite's shortened windows kept
    the shipped order). A rank that died in such a phase counts no more (its exit has
    its own page, waiting_for_the_dead)."""
    runs = runs_with(with_run(f"{live_in_own_phase(node_agents)}\nor\n"
                              f"{in_phase(rank_servers, BUSY)}"))
    return f"{block(stalled_waiting(rank_servers))}\nand on (run)\n{block(runs)}"


def stalled(rank_servers: Selector, node_agents: Selector) -> Alert:
    """TrainingStalled: a rank in phase training with no step within its step budget,
    unless it waits in a collective for a rank of its run that is in a phase of its own,
    busy within its budget or stuck beyond it (waiting_for_own_phase), or that ended in
    a way its own page names (waiting_for_the_dead), or its run's loop is over
    (after_the_loop)."""
    phase_start = rank_servers(PHASE_START)
    # Time in phase training without a step: since the last step, or since the
    # rank (re-)entered training (after start-up or a checkpoint), whichever is later.
    # As of the scrape that read them (the sample's timestamp), not now: a restarted
    # Prometheus reads the samples from before its restart until its first scrape of the
    # rank (no staleness marker crosses a restart), and now would count the restart as
    # time without a step. A healthy run's Prometheus restart paged so, in the fault
    # suite. A rank server that stops answering marks its series stale at once.
    without_step = expr(f"""
        (
          timestamp({phase_start})
          - (
              {rank_servers("colossalai_training_last_step_timestamp_seconds")} > {phase_start}
            or
              {phase_start}
          )
        )
        > {rank_servers(BUDGET)}
    """)
    return Alert(
        "TrainingStalled",
        f"{block(with_run(only_in_phase(rank_servers, without_step, TRAINING)))}\n"
        f"unless on (run, rank)\n{block(waiting_for_own_phase(rank_servers, node_agents))}\n"
        f"unless on (run, rank)\n{block(waiting_for_the_dead(rank_servers, node_agents))}\n"
        f"unless on (run)\n{block(after_the_loop(rank_servers, node_agents))}",
        "critical", "A training rank has made no step for longer than its step budget.",
        fill("Rank [[$rank]] of job [[$job]] ([[$instance]]) has made no training step "
             "for {{ $value | humanizeDuration }} (step budget [[budget]]).[[where]]"
             "[[reach]]",
             budget=_budget(),
             # Where its training thread is: the stalled function, when every rank
             # stalls alike (no rank to name as the one the others wait for).
             where=with_first(ACTIVITY, RANK,
                              " It is in {{ .Labels.activity }} at {{ .Labels.frame }}."),
             reach=STALLED_REACH),
        training_dashboard())


#: The runs with a rank in a phase of BUSY and not stalled, valued by how many: recorded
#: once an evaluation (before the alerts of its group) for the alerts that leave out the
#: ranks waiting for such a rank (TrainingStalled, TrainingStartupStuck, EvaluationStuck).
BUSY_RUNS = "run:colossalai_training_ranks_busy:count"


def busy_runs(rank_servers: Selector, node_agents: Selector) -> str:
    """BUSY_RUNS' expression: a rank busy within its own budget, in either view."""
    def busy(view: Selector) -> str:
        return (f"{in_phase(view, BUSY)}\nunless on (job, instance, rank)\n"
                f"  {stalled_now(view)}")

    return runs_with(with_run(f"{busy(node_agents)}\nor\n{busy(rank_servers)}"))


def waiting_for_busy(waiting: str) -> str:
    """The ranks of ``waiting`` (stalled ranks that wait in a collective, with their run)
    in runs where another rank is busy within its own budget (BUSY_RUNS): a save or an
    evaluation on one rank, which the others wait for in their next step's collective,
    or a rank still starting, which the others wait for in the rendezvous. Its budget
    decides (CheckpointStuck, EvaluationStuck, TrainingStartupStuck); the waiting ranks'
    does not: paged, a run that saved from rank 0 for longer than a step's budget paged
    the ranks that waited for it. A rank that waits counts by its activity or its
    collective in flight (training_deaths.stalled_waiting)."""
    return f"{block(waiting)}\nand on (run)\n  {BUSY_RUNS}"


def after_the_loop(rank_servers: Selector, node_agents: Selector) -> str:
    """The runs where a rank finished (``monitor.finish()``, or its script's end) and no
    rank waits for another: the loop is over, and a rank still in phase training does
    work after it that the monitor was not told of (a final ``torch.save`` on rank 0, an
    upload). Nobody waits for it, so its lack of steps stalls no training: paged, a run
    that completed cleanly paged its rank 0 for its final save. A rank that finished
    while others wait for it is the incident (TrainingHangSuspect ``left_early``)."""
    waiting = (f"{runs_with(stalled_waiting(node_agents))}\nor\n"
               f"{runs_with(stalled_waiting(rank_servers))}")
    return (f"count by (run) ({node_agents(EXIT, FINISHED_EXIT)})\n"
            f"unless on (run)\n{block(waiting)}")


# Where a stuck rank's training thread is (its activity, served while it is stalled):
# the frame a save or a start-up is stuck in, the collective when it waits in one, and
# the ranks of its run that wait for it.
WHERE_STUCK = with_first(
    ACTIVITY, RANK,
    " It is in {{ .Labels.activity }}{{ with .Labels.collective }} ({{ . }}){{ end }}"
    f" at {{{{ .Labels.frame }}}}{waiting_text()}.")


def over_budget_text(what: str) -> str:
    """"Rank 0 of run R on N has been in phase P for 8s, beyond its budget of 5s: <what>.
    It is in …", with its last error: the description of a rank stuck in one phase."""
    return fill("Rank [[$rank]][[of_run]] on [[$instance]] has been in phase "
                "[[$phase]] for [[in_phase]], beyond its budget of [[budget]]: [[what]]."
                "[[where]][[last_error]]", budget=_budget(), what=what, where=WHERE_STUCK,
                in_phase=query(PHASE_START, RANK, "value | humanizeDuration",
                               before="time() - "),
                last_error=last_error())


def over_budget_in(phases: tuple[str, ...], rank_servers: Selector,
                   node_agents: Selector) -> str:
    """The ranks in one of ``phases`` for longer than their budget, in either view, each
    rank once, with their run and ``phase``.

    A rank frozen with the GIL held (a checkpoint write into a hung mount inside
    torch.save) cannot answer its own scrape; its last snapshot, which the node agent
    serves, still says which phase it is stuck in, and since when.
    """
    matcher = phase_is(*phases)

    # Beyond its budget in the phase is what the rank's stall verdict says in these
    # phases (rankstate/verdict.py: no progress since the phase began, judged at each
    # scrape), so the rule reads the ranks recorded stalled, not every rank's phase
    # start and budget: at 4,096 ranks those two reads were most of its cost.
    def over_budget(view: Selector) -> str:
        return (f"{stalled_now(view)}\n* ignoring (phase) group_left (phase)\n"
                f"  ({in_phase(view, matcher)})")

    # A rank whose process is gone is not stuck: the node agent serves its last
    # snapshot, judged now, until it forgets it, and a rank that died in the phase
    # (a hung evaluation's rank ended by scancel) paged as stuck after its end.
    # TrainingRankDown names how it ended.
    return (f"{block(on_any_rank(over_budget, rank_servers, node_agents, run_from=TROUBLED_RUN))}"
            f"\nunless on (job, instance, rank)\n  {node_agents(EXIT)}")


def phase_over_budget(name: str, phases: tuple[str, ...], summary: str, description: str,
                      rank_servers: Selector, node_agents: Selector,
                      unless: str | None = None, unless_runs: str | None = None) -> Alert:
    """``name``: a rank in one of ``phases`` for longer than its budget (over_budget_in),
    less the ranks (by run and rank) of ``unless`` and the runs of ``unless_runs``."""
    stuck = over_budget_in(phases, rank_servers, node_agents)
    if unless is not None:
        # Parenthesised: "unless" binds tighter than on_any_rank's "or".
        stuck = f"{block(stuck)}\nunless on (run, rank)\n{block(unless)}"
    if unless_runs is not None:
        stuck = f"{block(stuck)}\nunless on (run)\n  {unless_runs}"
    return Alert(name, stuck, "critical", summary, description, training_dashboard())


#: Each run's count of ranks that have reported (either view, each rank once), by the
#: world size its info declares: recorded once, read twice by UNSTARTED_RUNS.
REPORTED_RANKS = "run_world_size:colossalai_training_ranks:reported"
#: The runs with fewer ranks reported than their world size while a rank of theirs is
#: stuck in start-up: one series a run, ``reported`` and ``world_size`` its labels.
UNSTARTED_RUNS = "run_world_size_reported:colossalai_training_ranks:unstarted"
START_UP = ("init", "kernels")


def reported_ranks() -> str:
    """REPORTED_RANKS' expression, from RANK_RUN (recorded before it)."""
    each = block(f'{RANK_RUN}{{world_size!=""}}', "count by (run, world_size, rank)")
    return block(each, "count by (run, world_size)")


def unstarted_runs(rank_servers: Selector, node_agents: Selector) -> str:
    """UNSTARTED_RUNS' expression.

    A rank waits in ``init_process_group`` until every rank of the world has joined. A
    launcher that starts every rank itself (``srun``, ``mpirun``) leaves the ranks that
    did start waiting there when a node never comes up: nothing of the missing ranks
    reaches Prometheus, so only their count says what the waiting ones wait for.
    (torchrun starts no rank until every node's launcher has joined its own
    rendezvous.) PromQL compares values, not a label with a value: ``count_values``
    turns the count into the label ``reported``, ``label_replace`` copies that into
    ``world_size``, and a run whose two labels differ finds no copy of itself."""
    counted = f'count_values by (run, world_size) ("reported", {REPORTED_RANKS})'
    as_if_complete = (f'label_replace(\n  {counted},\n'
                      f'  "world_size", "$1", "reported", "(.+)"\n)')
    short = f"{counted}\nunless on (run, world_size, reported)\n{as_if_complete}"
    starting = runs_with(over_budget_in(START_UP, rank_servers, node_agents))
    return f"{block(short)}\nand on (run)\n{block(starting)}"


def ranks_missing(node_agents: Selector) -> Alert:
    """TrainingRanksMissing: a run stuck in start-up because ranks of its world never
    reported (UNSTARTED_RUNS). A run, not a rank: the ranks that did start all wait for
    the missing ones, and none of those is the cause (paged as TrainingStartupStuck of
    rank 0, the rank the Slack title named was one that waited)."""
    started_on = (
        "{{ range $i, $node := "
        + printf_query(f"sort_desc(count by (instance) ({node_agents(INFO, 'run=%q')}))",
                       "$labels.run")
        + ' }}{{ if lt $i 8 }}{{ if $i }}, {{ end }}{{ $node.Labels.instance }} '
        '({{ $node.Value | printf "%.0f" }}){{ else if eq $i 8 }}, …{{ end }}{{ end }}')
    return Alert(
        "TrainingRanksMissing", UNSTARTED_RUNS, "critical",
        "A training run cannot start: ranks of its world never reported.",
        "Run {{ $labels.run }} has not started: only {{ $labels.reported }} of its "
        "{{ $labels.world_size }} ranks have reported, and the others never started (a "
        "node or its launcher that did not come up) or no Prometheus target reads them. "
        "The ranks that did start wait for them in start-up beyond its budget. Ranks "
        "reported by node: " + started_on + ".",
        # No dashboard: the run has no job or rank the dashboards select by yet, and the
        # nodes that reported are in the description.
        None)


#: How far back TrainingNeverStarted looks for a rank server that answered: longer than
#: TrainingRankDown's hour (a server that answered, then died, is that alert's), and no
#: longer than Prometheus' head block: every minute it reads this much of every training
#: target's `up` (4,096 targets where every rank serves), from memory.
NEVER_UP_WINDOW = "2h"
#: The prolog's rank server targets that have answered once, for as long as the target
#: is there: one series a target, latched (each evaluation reads its own last one).
ANSWERED_SERVERS = "job_instance_slurm_job_id:colossalai_training_rank_server:answered"


def answered_servers(rank_servers: Selector) -> str:
    """A Slurm job's rank server that answered once, then died, with the job running on
    (a wedged node, a launcher waiting on a dead rank): past NEVER_UP_WINDOW its `up`
    has been 0 for the whole window, and TrainingNeverStarted alone would call it a job
    that never started. The latch keeps what the window forgets: the rule reads its own
    series of the last evaluation (within the 5-minute lookback, so its group's interval
    must be shorter: the slow group's is 1m), and drops it with the target (the
    epilog). A Prometheus down for more than 5 minutes forgets it; the window still
    holds the last two hours."""
    target = rank_servers("up", 'slurm_job_id!=""')
    return expr(f"""
        max by (job, instance, slurm_job_id) ({target} == 1)
        or
        (
          {ANSWERED_SERVERS}
          and on (job, instance, slurm_job_id)
            {target}
        )
    """)


def never_started(rank_servers: Selector, node_agents: Selector, after: Duration) -> Alert:
    """TrainingNeverStarted: a Slurm training job whose ranks never reported at all.

    Every rank of a job can be stuck before it creates its monitor: an import or a
    dataset on a network filesystem that hangs, a container image still pulling, a
    launcher waiting for its nodes. No rank writes a snapshot or serves, so nothing of
    the job reaches Prometheus but the rank server's target that the Slurm prolog wrote
    for a training job (``sbatch --comment=colossalai``, labelled ``slurm_job_id``),
    which never answers: TrainingRankDown's ``scrape`` form needs a server that served,
    and TrainingRanksMissing needs ranks that reported. Only such targets: the prolog
    writes them when the job starts and the epilog removes them when it ends, so a
    target that has been there ``after`` and never answered is a job that never
    started; a static target outlives its runs and says nothing of the kind. Not when
    a node agent of the job reports any rank of it (those ranks' own alerts say more).
    """
    target = rank_servers("up", 'slurm_job_id!=""')
    return Alert(
        "TrainingNeverStarted",
        expr(f"""
            max_over_time({target}[{NEVER_UP_WINDOW}]) == 0
            and on (job, instance, slurm_job_id)
              ({target} offset {after})
            unless on (job, instance, slurm_job_id)
              {ANSWERED_SERVERS}
            unless on (slurm_job_id)
              {node_agents(INFO, 'slurm_job_id!=""')}
        """),
        "critical", "A Slurm training job has not started: no rank has reported.",
        "Slurm job {{ $labels.slurm_job_id }}{{ with $labels.slurm_job_name }} ({{ . }})"
        "{{ end }} has run for more than " + after.text + " and its rank server "
        "{{ $labels.instance }} has never answered, nor does any node agent of the job "
        "report a rank of it: no rank has created its TrainingMonitor. The job is stuck "
        "before training starts (an import or a dataset on a network filesystem that "
        "hangs, a container image still pulling, the launcher waiting for its nodes), "
        "or its script creates the monitor late or serves elsewhere.",
        None)


def startup_stuck(rank_servers: Selector, node_agents: Selector) -> Alert:
    """TrainingStartupStuck: model set-up, the rendezvous or a kernel build beyond the
    start-up budget, not for a rank that waits in a collective (the rendezvous, a model
    broadcast) for another rank of its run that is stuck itself or down
    (waiting_for_another), or still busy within its own budget (waiting_for_busy: ranks
    start minutes apart where a node pulls its image late): paged, a rank waiting in
    ``init_process_group`` for a rank blocked before it was a second culprit, and the
    first one the page named. Nor in a run whose world has ranks that never reported
    (UNSTARTED_RUNS): TrainingRanksMissing's."""
    stuck = over_budget_text(choose(
        "$labels.phase", [('"kernels"', "a JIT kernel build or load that does not finish")],
        "start-up that does not finish (the process group's rendezvous, model set-up, "
        "data preparation)"))
    return phase_over_budget(
        "TrainingStartupStuck", START_UP,
        "A training rank is stuck in start-up (init or kernel build) beyond its budget.",
        stuck, rank_servers, node_agents, unless=waits_for_others(rank_servers, node_agents),
        unless_runs=UNSTARTED_RUNS)


def compile_stuck(rank_servers: Selector, node_agents: Selector) -> Alert:
    """CompileStuck: a torch.compile recompile beyond the compile budget (a cause alert:
    the ranks that wait for it in a collective stall because of it), not for a rank
    that has compiled and waits in a collective for another rank of its run that is
    stuck, down or busy within its own budget (waits_for_others, as the other stuck
    phases). Without the phase, a recompile longer than a step's budget paged a healthy
    run as stalled (training/unannounced.py)."""
    return phase_over_budget(
        "CompileStuck", ("compiling",), "A torch.compile recompile has run longer than its "
        "budget.",
        over_budget_text("a torch.compile recompile that does not finish"),
        rank_servers, node_agents, unless=waits_for_others(rank_servers, node_agents))


def evaluation_stuck(rank_servers: Selector, node_agents: Selector) -> Alert:
    """EvaluationStuck: an evaluation beyond the evaluation budget, on a rank that does not
    wait in a collective for another rank of its run that is stuck, down
    (waiting_for_another) or busy within its budget (waiting_for_busy). A cause alert,
    as CheckpointStuck and CompileStuck: the ranks that wait for the evaluation are its
    consequence (TrainingStalled leaves them out, TrainingHangSuspect names no rank in
    a phase of its own).

    Without it a hang inside an evaluation paged nobody: TrainingStalled reads phase
    training only, and TrainingHangSuspect needs ranks that wait for the one it names,
    so every rank stuck in its own part of the evaluation (a validation read from a
    shared filesystem that hangs, a generation loop that never ends) was silent. It was
    once a consequence, muted by TrainingHangSuspect naming the evaluating rank: when a
    hung job was stopped, the waiting ranks ended first, TrainingHangSuspect resolved,
    and this paged the hung rank a second time in the moment before its own end."""
    return phase_over_budget(
        "EvaluationStuck", ("evaluating",), "An evaluation has run longer than its budget.",
        over_budget_text("an evaluation that does not finish")
        + STALLED_REACH,
        rank_servers, node_agents, unless=waits_for_others(rank_servers, node_agents))


def data_start_stuck(rank_servers: Selector, node_agents: Selector) -> Alert:
    """DataStartStuck: a data loader's start at an epoch's boundary beyond its budget
    (training/unannounced.py: the last iterator's workers stopped, the next one built,
    its first batch awaited), a cause alert as CompileStuck, and not for a rank that
    waits in a collective for another rank of its run that is stuck, down or busy
    within its own budget (waits_for_others). Without the phase, an epoch whose workers
    took longer to start than a step's budget paged a healthy run as stalled, and the
    rank still starting as the one a hang waits for."""
    return phase_over_budget(
        "DataStartStuck", ("data_start",), "A data loader's start at an epoch's boundary has "
        "run longer than its budget.",
        over_budget_text("a data loader's start that does not finish (its workers, its "
                         "sampler's indices, its first batch)") + STALLED_REACH,
        rank_servers, node_agents, unless=waits_for_others(rank_servers, node_agents))


def waits_for_others(rank_servers: Selector, node_agents: Selector) -> str:
    """The ranks (by run and rank) that wait in a collective for another rank of their
    run that is stuck itself, down (waiting_for_another), or busy within its own budget
    (waiting_for_busy): a stuck phase's page is not theirs."""
    busy = waiting_for_busy(f"{stalled_waiting(node_agents)}\nor\n"
                            f"{stalled_waiting(rank_servers)}")
    return f"{block(waiting_for_another(rank_servers, node_agents))}\nor\n{block(busy)}"


def checkpoint_stuck(rank_servers: Selector, node_agents: Selector) -> Alert:
    """CheckpointStuck: a checkpoint save beyond the checkpoint budget (a cause alert),
    not for a rank whose save waits in a collective for another rank of its run that is
    stuck, down or busy within its own budget (waits_for_others, as the other stuck
    phases)."""
    return phase_over_budget(
        "CheckpointStuck", ("checkpointing",),
        "A checkpoint save has run longer than its budget.",
        over_budget_text("a checkpoint save or upload that does not finish"),
        rank_servers, node_agents, unless=waits_for_others(rank_servers, node_agents))


def waiting_for_another(rank_servers: Selector, node_agents: Selector) -> str:
    """The ranks (by run and rank) that answer and wait in a collective while another
    rank of their run is down (not finished) or stalled outside any collective.

    A save gathers state collectively (Gemini, the hybrid plugins), so a checkpoint
    that waits for a rank that was killed, failed or froze is that rank's consequence:
    the rank's own alert names it (TrainingRankDown, TrainingRankOOMKilled,
    TrainingNodeLost, TrainingHangSuspect, or CheckpointStuck for a rank stuck in
    torch.save itself). Paged as CheckpointStuck, the waiting rank was a second culprit,
    and as a cause alert it muted the first (Alertmanager's inhibition cannot order
    the two: TrainingRankDown cannot mute CheckpointStuck and be muted by it). A rank
    that is down itself is never one of these: it does not answer, and its last
    snapshot may predate what it froze in. Both sets exist only while ranks are in
    trouble; with NCCL a waiting rank sits in a CUDA synchronisation ("compute") and
    is not one of them: its CheckpointStuck pages as before.
    """
    def culprits(view: Selector) -> str:
        gone = except_in_phase(view, down(view), FINISHED)
        return (f"{runs_with(with_run(gone, TROUBLED_RUN))}\nor\n"
                f"{runs_with(with_run(view(ACTIVITY, NOT_WAITING), TROUBLED_RUN))}")

    return (f"(\n{indent(waiting_ranks(node_agents))}\nor\n"
            f"{indent(waiting_ranks(rank_servers))}\n)\n"
            f"and on (run)\n(\n{indent(culprits(node_agents))}\nor\n"
            f"{indent(culprits(rank_servers))}\n)")
