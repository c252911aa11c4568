"""What the alert families share: the two views of a rank, the run label, phases, links.

A rank is seen twice. The rank servers serve its series (the training
selector); the node agent of its node re-serves them from the snapshot the rank
writes (the node selector), and sees what the first view cannot: ranks the
rank-0 server does not serve, and a rank's last state after its process died or
froze with the GIL held. The helpers here read each rank once from whichever
view sees it, join the ``run`` label Alertmanager inhibits by, and name the
phases and states the families' expressions test. Families import from here;
nothing here knows a family.

Phases are the TrainingMonitor's: init, kernels, training, checkpointing,
evaluating, finished, failed (``colossalai_training_phase{phase}``).
"""

from __future__ import annotations

from collections.abc import Callable

from colossalai_exporter.rankstate.schema import PHASES
from colossalai_exporter.rulesgen.config import Duration
from colossalai_exporter.rulesgen.promql import (
    Selector,
    block,
    expr,
    first_sample,
    indent,
    label_is,
    label_is_not,
    matching,
    query,
    template_args,
)

# The labels that name one rank's series (and an alert about one rank).
RANK = ("job", "instance", "rank")
INFO = "colossalai_training_info"
START = "colossalai_training_start_timestamp_seconds"
PHASE = "colossalai_training_phase"
RANK_UP = "colossalai_rank_up"
STALLED = "colossalai_training_stalled"
ACTIVITY = "colossalai_training_activity_info"


# The alerts' dashboard links, all here: their variables (var-job, var-instance,
# var-rank) are the dashboards' (dashboards/variables.py), a contract a test checks.
def training_dashboard() -> tuple[str, dict[str, str]]:
    """The training dashboard at the alert's job and rank."""
    return ("colossalai-training", {"job": "{{ $labels.job | urlquery }}",
                                    "rank": "{{ $labels.rank | urlquery }}"})


def training_job_dashboard() -> tuple[str, dict[str, str]]:
    """The training dashboard at the alert's job, every rank of it."""
    return ("colossalai-training", {"job": "{{ $labels.job | urlquery }}"})


def nodes_dashboard() -> tuple[str, dict[str, str]]:
    """The nodes dashboard at the alert's job and instance."""
    return ("colossalai-nodes", {"job": "{{ $labels.job | urlquery }}",
                                 "instance": "{{ $labels.instance | urlquery }}"})


def chat_dashboard() -> tuple[str, dict[str, str]]:
    """The chat dashboard at the alert's job and instance."""
    return ("colossalai-chat", {"job": "{{ $labels.job | urlquery }}",
                                "instance": "{{ $labels.instance | urlquery }}"})


def _phases(names: tuple[str, ...]) -> tuple[str, ...]:
    unknown = sorted(set(names) - set(PHASES))
    if unknown:
        raise ValueError(f"not a phase of rankstate.schema.PHASES: {unknown}")
    return names


def phase_is(*names: str) -> str:
    """A matcher for the phases ``names``, which must be the snapshot's (rankstate)."""
    return label_is("phase", *_phases(names))


def phase_is_not(*names: str) -> str:
    """A matcher for any phase but ``names``, which must be the snapshot's (rankstate)."""
    return label_is_not("phase", *_phases(names))


TRAINING = phase_is("training")
FAILED = phase_is("failed")
FINISHED = phase_is("finished")
NOT_FINISHED = phase_is_not("finished")
ENDED = phase_is("finished", "failed")


# The phases with a budget and an alert of their own (TrainingStartupStuck,
# CheckpointStuck, EvaluationStuck, CompileStuck, DataStartStuck) that one rank can be in
# while the others wait for it in training: a save or an evaluation on one rank only (the
# tutorial saves from rank 0 alone), a kernel loaded on first use, a recompile of one
# rank's graph (its shapes changed), one rank's data loader slower to start its epoch.
# Not finished or failed: a rank that ended while others wait for it is the incident
# (TrainingHangSuspect, TrainingRankDown).
BUSY = phase_is("init", "kernels", "checkpointing", "evaluating", "compiling", "data_start")


def in_phase(view: Selector, matcher: str) -> str:
    """The ranks of ``view`` in a phase of ``matcher`` now (the phase series is 1)."""
    return f"{view(PHASE, matcher)} == 1"


def only_in_phase(view: Selector, vector: str, matcher: str) -> str:
    """``vector`` of the ranks in a phase of ``matcher`` only."""
    return f"{vector}\nand ignoring (phase)\n  {in_phase(view, matcher)}"


def except_in_phase(view: Selector, vector: str, matcher: str) -> str:
    """``vector`` less the ranks in a phase of ``matcher`` (a rank that finished is not
    down, nor are its kernels missing)."""
    return f"{vector}\nunless ignoring (phase)\n  {in_phase(view, matcher)}"


def rank_down(view: Selector) -> str:
    """The ranks of ``view`` whose process is gone or publishes nothing."""
    return f"{view(RANK_UP)} == 0"


def rank_stalled(view: Selector) -> str:
    """The ranks of ``view`` that judge themselves stalled (no progress within budget)."""
    return f"{view(STALLED)} == 1"


# What the alerts read of many ranks, recorded once at the head of their group (after
# RANK_RUN), each a set that is empty while the fleet is healthy. Read from a rank's
# own series, each cost a read of every rank's series in each of up to ten rules; read
# from these, a rule reads only the ranks in trouble (bench/RESULTS.md, issue 30).
# Recorded from both views; a rule keeps its view's ranks by the view's own matchers,
# which the recorded series keep (a recording rule keeps the labels it reads).

#: The ranks of either view that are down (rank_down), valued 0 as their up series.
DOWN_RANKS = "job_instance_rank:colossalai_rank_up:down"
#: The ranks of either view that judge themselves stalled (rank_stalled), valued 1.
STALLED_RANKS = "job_instance_rank:colossalai_training_stalled:stalled"


def down_ranks_rule(rank_servers: Selector, node_agents: Selector) -> str:
    """DOWN_RANKS' expression."""
    return f"{rank_down(node_agents)}\nor\n{rank_down(rank_servers)}"


def stalled_ranks_rule(rank_servers: Selector, node_agents: Selector) -> str:
    """STALLED_RANKS' expression."""
    return f"{rank_stalled(node_agents)}\nor\n{rank_stalled(rank_servers)}"


def down(view: Selector) -> str:
    """rank_down's ranks as recorded at the head of the alerts' group (DOWN_RANKS): for the
    rules of that group, after the recording; the other groups read rank_down."""
    return view(DOWN_RANKS)


def stalled_now(view: Selector) -> str:
    """rank_stalled's ranks as recorded at the head of the alerts' group (STALLED_RANKS):
    for the rules of that group, after the recording."""
    return view(STALLED_RANKS)


#: Every rank of either view, with the ``run``, ``world_size`` and ``pipeline_stage`` of
#: its ``colossalai_training_info`` (none where the rank has no info: a monitor older
#: than the label; no stage outside a pipeline): one series a rank, recorded first in
#: the training file so each alert joins it once.
RANK_RUN = "job_instance_rank:colossalai_training_run:max"


def rank_runs(rank_servers: Selector, node_agents: Selector) -> str:
    """RANK_RUN's expression: the info's run, else the rank bare, from one series each
    view serves for every rank it knows: the agent's up for the rank (it serves one for
    every snapshot it reads, with or without the rank's other series), the rank
    server's own phase (a rank server serves no up). Reading the phase in the agent's
    view too, and an up in the rank servers', added two reads of every rank to the
    alerts' first rule for no rank more: 85 against 50 ms at 4,096 ranks
    (bench/RESULTS.md)."""
    info = "\nor\n".join(view(INFO) for view in (node_agents, rank_servers))
    ranks = f"{node_agents(RANK_UP)}\nor\n{rank_servers(PHASE)}"
    return (f"max by (job, instance, rank, run, world_size, pipeline_stage) (\n"
            f"{indent(info)}\n)\n"
            f"or on (job, instance, rank)\n"
            f"group by (job, instance, rank) (\n{indent(ranks)}\n)")


#: The ranks (by run) some node agent reports, from the info each serves with its run
#: (a rank the agent has no readable snapshot of has no run to match): the ranks whose
#: rank-server view :func:`on_any_rank` leaves out, and that TrainingRankDown and the
#: unreachable rank's TrainingHangSuspect ask about. Recorded once, after RANK_RUN.
AGENT_RANKS = "run_rank:colossalai_training_seen_by_agent:group"


def agent_ranks(node_agents: Selector) -> str:
    """AGENT_RANKS' expression."""
    return f"group by (run, rank) (\n  {node_agents(INFO)}\n)"


#: The ranks of AGENT_RANKS that a rank server serves too: all that :func:`on_any_rank`
#: leaves out of the rank servers' view. One series a served rank (with the default
#: ``serve: rank0``, one a job), where AGENT_RANKS has one a rank of the fleet: a read
#: of that cost about 15 ms at 4,096 ranks, and on_any_rank made seven an evaluation.
#: Recorded after AGENT_RANKS; the rank servers' view takes its run from its own info.
AGENT_SERVED_RANKS = "run_rank:colossalai_training_seen_by_agent_and_server:group"


def agent_served_ranks(rank_servers: Selector) -> str:
    """AGENT_SERVED_RANKS' expression."""
    return f"{AGENT_RANKS}\nand on (run, rank)\n  {rank_servers(INFO)}"


#: RANK_RUN's ranks that are down or stalled (DOWN_RANKS, STALLED_RANKS): empty while
#: the fleet is healthy. A rule about ranks in trouble joins its run from these, not
#: from every rank's: each read of RANK_RUN cost about 15-20 ms at 4,096 ranks, and the
#: alerts' group made 29. Recorded after the two sets. Only for a vector whose ranks
#: are all down or stalled (by job, instance and rank): a rank of any other vector
#: would find no run here and drop out of the join, and its alert with it.
TROUBLED_RUN = "job_instance_rank:colossalai_training_run:down_or_stalled"


def troubled_runs() -> str:
    """TROUBLED_RUN's expression."""
    return (f"{RANK_RUN}\nand on (job, instance, rank)\n"
            f"  ({DOWN_RANKS} or {STALLED_RANKS})")


def with_run(vector: str, run_from: str = RANK_RUN, labels: tuple[str, ...] = ("run",)) -> str:
    """``vector`` (a rank's series, of either view) with the ``run`` label of its rank's
    ``colossalai_training_info``, joined from ``run_from``: RANK_RUN, or TROUBLED_RUN
    for a vector of ranks that are down or stalled.

    ``labels`` are the ones joined: ``run``, and for a comparison within a pipeline
    stage ``pipeline_stage`` too (RANK_RUN has it). Values are kept (RANK_RUN is 1).
    Alertmanager inhibits a run's consequence alerts under its cause alert by the
    ``run`` label, so every training alert carries it.
    A rank without the info (a monitor older than the label) still alerts, without
    ``run``. ``vector`` is read once: at 4,096 ranks each read of a rank-wide vector
    is what an evaluation costs (bench/RESULTS.md, issue 30).
    """
    # Parenthesised whole: "or" binds loosest, and callers combine this further.
    return (f"(\n  (\n{indent(vector, 4)}\n  )\n  * on ({', '.join(RANK)}) "
            f"group_left ({', '.join(labels)})\n    {run_from}\n)")


#: The run started last on each node agent's node, valued by its start: one series a
#: node, recorded first in the node alerts' group, which every node-level cause reads.
NODE_RUN = "job_instance:colossalai_training_run:latest"


def node_runs(node_agents: Selector) -> str:
    """NODE_RUN's expression.

    A node may show ranks of two runs for a while (a stale rank of the run before, a
    small job beside another): a join on the node would find two runs and fail the
    whole rule. The run named is the one started last on the node, each node one.
    """
    return (f"topk by (job, instance) (1,\n"
            f"  max by (job, instance, run) ({node_agents(START)})\n)")


def with_node_run(vector: str) -> str:
    """``vector`` (a node's series: a GPU, a port) with the ``run`` of the node's ranks
    (NODE_RUN), as :func:`with_run` joins a rank's; values kept."""
    return (f"(\n  (\n{indent(vector, 4)}\n  )\n  + on (job, instance) group_left (run)\n"
            f"    (0 * {NODE_RUN})\n"
            f"  or\n  (\n{indent(vector, 4)}\n  )\n  unless on (job, instance)\n"
            f"    {NODE_RUN}\n)")


def runs_with(vector: str) -> str:
    """``count by (run)``: the runs with a rank in ``vector``, valued by how many."""
    return block(vector, "count by (run)")


def recent_events(series: str, window: Duration, condition: str = "> 0") -> str:
    """Series of a counter that rose within ``window`` (by ``condition``), valued by how much.

    The second half catches a counter first seen above zero: a rank that hit an
    out-of-memory error in ``booster.boost`` before Prometheus ever scraped it
    at zero has no increase() to show, only a new series.
    """
    return (f"increase({series}[{window}]) {condition}\nor\n"
            f"({series} {condition} unless {series} offset {window})")


def on_any_rank(build: Callable[[Selector], str], rank_servers: Selector,
                node_agents: Selector, *, run_from: str | None = RANK_RUN,
                labels: tuple[str, ...] = ("run",)) -> str:
    """``build``'s vector from whichever view sees the rank, each rank once, with its
    ``run`` (joined from ``run_from`` by :func:`with_run`; None: the series have it).

    The node agent re-serves every local rank's series (rank 0's too) from the
    snapshot the rank writes, synchronously when an exception passes: it sees
    ranks the rank-0 server does not serve, failures that end the process a
    moment later, and the last state of a rank frozen with the GIL held (whose
    own server cannot answer). The rank servers' view counts only where no agent
    reports the same rank of the same run, so nothing is counted twice.
    """
    def join(vector: str) -> str:
        return vector if run_from is None else with_run(vector, run_from, labels)

    return (f"{join(build(node_agents))}\nor\n"
            f"(\n{indent(join(build(rank_servers)))}\n"
            f"  unless on (run, rank)\n    {AGENT_SERVED_RANKS}\n)")


def one_view_per_rank(build: Callable[[Selector], str], rank_servers: Selector,
                      node_agents: Selector) -> str:
    """``build``'s vector over series that carry ``run`` themselves, each rank of a run
    from one view: the node agent's, else the rank server's (see :func:`on_any_rank`,
    which joins ``run`` from the info instead: right for the present, wrong for a range
    over a day in which two runs used the same rank of a node)."""
    node = build(node_agents)
    return (f"{node}\nor\n(\n{indent(build(rank_servers))}\n  unless on (run, rank)\n"
            f"{indent(node)}\n)")


#: lost_ranks' ranks (of the node agents' view only), recorded once at the head of the
#: alerts' group, which three rules read: each read of every rank's info over the window
#: cost about 40 ms at 4,096 ranks; the recorded set is empty while every agent answers.
LOST_RANKS = "job_instance_run_rank:colossalai_training_info:lost"


def lost_ranks(node_agents: Selector, window: Duration) -> str:
    """Ranks last reported, within ``window``, by a node agent Prometheus cannot scrape
    now, and by no agent now: the ranks of a node that is down or cut off."""
    return expr(f"""
        max by (job, instance, run, rank) (last_over_time({node_agents(INFO)}[{window}]))
        and on (job, instance)
          ({node_agents("up")} == 0)
        unless on (run, rank)
          {node_agents(INFO)}
    """)


def last_error() -> str:
    """" Last error (in step): RuntimeError: CUDA out of memory. …" when the rank has one.

    Last in a description: the message ends with its own punctuation. A rank whose
    process died (and its own server with it) has its series marked stale at the next
    failed scrape, while the alert about it still fires from its window: the error is
    then read as last seen in the last 10 minutes.
    """
    body = " Last error (in {{ .Labels.where }}): {{ .Labels.type }}: {{ .Labels.message }}"
    now = matching("colossalai_training_last_error_info", RANK)
    return first_sample(now, template_args(RANK), body,
                        otherwise=first_sample(f"last_over_time({now}[10m])",
                                               template_args(RANK), body))


def ranks_of_run(condition: str, what: str) -> str:
    """" 4096 rank(s) of this run are stalled." for an alert with a ``run`` label: how
    many ranks of its run (either view, each rank once) meet ``condition``, so a page
    for one rank of a 4,096-rank job says how far the trouble reaches."""
    ranks = f"count(count by (rank) ({condition} and on (job, instance, rank) {INFO}{{run=%q}}))"
    return ("{{ with $labels.run }}"
            + first_sample(ranks, ".", ' {{ .Value | printf "%.0f" }} ' + what)
            + "{{ end }}")


def snapshot_age() -> str:
    """How old the rank's last state snapshot is, e.g. "3m 20s"."""
    return query("colossalai_rank_snapshot_age_seconds", RANK, "value | humanizeDuration")
