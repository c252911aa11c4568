"""Rank deaths: TrainingRankDown, TrainingRankOOMKilled, TrainingNodeLost.

The rank where a run's death began, and only that rank (docs/rules.md, "The rank
that died first"). When one rank dies, the others follow: their collectives fail
on its closed connections (``peer_failed``), torchrun sends them SIGTERM
(``interrupted``). The node agent judges how each rank ended
(``colossalai_rank_exit_info``, node/exits.py), so the rules page the rank that
was killed, OOM-killed or failed of its own error, and not the ranks that
followed, whatever order a scrape found them gone in. A run whose every rank
ended by a signal was stopped (a preemption, a cancel, Ctrl-C): no page, unless the
signal ended a rank that had hung (``hung``: stalled outside any collective), which is
the incident the run died of: after a hang the process group's timeout ends the
waiting ranks and torchrun the hung one; or ended, outside any collective with nothing
in flight, the rank that ranks on other nodes timed out waiting for
(:func:`hung_elsewhere`). A node
gone with its agent cannot say any of this: TrainingNodeLost names it from what
Prometheus still sees.
"""

from __future__ import annotations

from colossalai_exporter.rankstate.schema import WAITING as WAITING_ACTIVITIES
from colossalai_exporter.rulesgen.common import (
    ACTIVITY,
    AGENT_RANKS,
    BUSY,
    FINISHED,
    INFO,
    LOST_RANKS,
    PHASE,
    RANK,
    RANK_UP,
    TROUBLED_RUN,
    down,
    except_in_phase,
    in_phase,
    nodes_dashboard,
    phase_is,
    ranks_of_run,
    runs_with,
    snapshot_age,
    stalled_now,
    training_job_dashboard,
    with_run,
)
from colossalai_exporter.rulesgen.config import Duration
from colossalai_exporter.rulesgen.model import Alert
from colossalai_exporter.rulesgen.promql import (
    Selector,
    block,
    expr,
    fill,
    label_is,
    label_is_not,
    matching,
    printf_query,
    query,
    template_args,
    with_first,
)

EXIT = "colossalai_rank_exit_info"
# How a gone rank ended (node/exits.py): the reasons that are the incident itself, and
# those that follow from another rank's end (or are no incident: finished, a signal).
NOT_CAUSE_EXITS = label_is("reason", "finished", "interrupted", "peer_failed", "oom_killed")
# Ends that explain a peer_failed rank: its run's trouble began there.
EXPLAINING_EXITS = label_is("reason", "killed", "failed", "oom_killed", "interrupted",
                            "hung")
OOM_KILLED = label_is("reason", "oom_killed")
IN_FLIGHT = "colossalai_training_collective_in_flight_seconds"
ENDED_PHASES = phase_is("finished", "failed")
PEER_FAILED = label_is("reason", "peer_failed")
FINISHED_EXIT = label_is("reason", "finished")
UNFINISHED_EXITS = label_is_not("reason", "finished")
RANK_DOWN_SUMMARY = "A training rank's process is gone or has stopped publishing its state."
WAITING = label_is("activity", *WAITING_ACTIVITIES)


def rank_deaths(rank_servers: Selector, node_agents: Selector,
                window: Duration) -> tuple[Alert, ...]:
    """Every rule of the family, in the order the rule file lists them."""
    return (killed_or_frozen(node_agents), died_of_a_peer(node_agents),
            unscrapable(rank_servers, node_agents), oom_killed(node_agents),
            node_lost(rank_servers, node_agents, window))


def _down_in_run() -> str:
    """" 3 rank(s) of this run are down in all.": how far a death reached (not counting
    ranks that finished)."""
    return ranks_of_run(f"{RANK_UP} == 0 unless on (job, instance, rank) "
                        f"{EXIT}{{{FINISHED_EXIT}}}",
                        "rank(s) of this run are down in all.")


def _exit_detail() -> str:
    """The node agent's account of how the rank ended (the exit's ``detail``)."""
    return query(EXIT, RANK, 'label "detail"')


def _exits(node_agents: Selector, reasons: str) -> str:
    """The ranks that ended for ``reasons``, one series each (the detail dropped)."""
    return block(node_agents(EXIT, reasons), "max without (reason, detail, collective)")


def live_in_own_phase(node_agents: Selector) -> str:
    """The live ranks (no exit judged) of the node agents' view in a phase with a budget
    and an alert of its own (BUSY): that phase's budget decides about them."""
    return (f"{in_phase(node_agents, BUSY)}\nunless on (job, instance, rank)\n"
            f"  {node_agents(EXIT)}")


def killed_or_frozen(node_agents: Selector) -> Alert:
    """TrainingRankDown from the node agent's outside view: a rank killed, failed of its
    own error, hung then ended, or frozen; not one that finished, was stopped by a
    signal, failed because a peer did, or was OOM-killed (TrainingRankOOMKilled says
    more). A rank stopped by a signal is one only where it hung with the ranks that
    waited for it on other nodes (:func:`hung_elsewhere`), and a rank that finished only
    where the ranks it left waiting failed of it (:func:`left_early`)."""
    how = with_first(
        EXIT, RANK,
        '{{ if eq .Labels.reason "failed" }}died of its own error: {{ .Labels.detail }}'
        '{{ else if eq .Labels.reason "hung" }}hung: {{ .Labels.detail }}'
        '{{ else if eq .Labels.reason "finished" }}left the run early: it '
        "{{ .Labels.detail }}, while "
        f"{listed_ranks(node_agents(EXIT, PEER_FAILED + ',run=%q'))} still waited for it in "
        f"a collective, and failed when it left. {UNEVEN_STEPS}"
        '{{ else if eq .Labels.reason "interrupted" }}hung: '
        f"{timed_out_ranks()} timed out waiting for a peer in a collective, and then this "
        "rank {{ .Labels.detail }}: the rank the others waited for. The process group's "
        "timeout is shorter than the step budget, so the run ended before any rank "
        "counted as stalled"
        "{{ else }}was killed: {{ .Labels.detail }}{{ end }}",
        otherwise=("is not responding: its process is alive but has published nothing for "
                   f"{snapshot_age()} (frozen in a C call holding the GIL, or stopped)"))
    gone = (f"{down(node_agents)}\nunless on (job, instance, rank)\n"
            f"  {node_agents(EXIT, NOT_CAUSE_EXITS)}")
    # A live rank frozen in a phase with a budget of its own (torch.save and torch.load
    # write and read in C++ holding the GIL: a large shard on slow storage freezes the
    # publisher for minutes) is that phase's: its budget decides, and past it its stuck
    # alert names it (CheckpointStuck: "It is in compute at … in save"). Paged here, a
    # healthy save paged a minute in, and a hung one paged before its cause.
    gone = f"{gone}\nunless on (job, instance, rank)\n{block(live_in_own_phase(node_agents))}"
    left_them_failing = left_early(node_agents, node_agents(EXIT, PEER_FAILED))
    return Alert(
        "TrainingRankDown",
        f"{with_run(except_in_phase(node_agents, gone, FINISHED), TROUBLED_RUN)}\n"
        f"or\n{block(hung_elsewhere(node_agents))}\nor\n{block(left_them_failing)}",
        "critical", RANK_DOWN_SUMMARY,
        fill("Rank [[$rank]][[of_run]] on [[$instance]] [[how]].[[reach]]",
             how=how, reach=_down_in_run()),
        nodes_dashboard(), cause="process")


def oom_killed(node_agents: Selector) -> Alert:
    """TrainingRankOOMKilled: the kernel's OOM killer ended a rank (a cause of its own)."""
    return Alert(
        "TrainingRankOOMKilled",
        _exits(node_agents, OOM_KILLED),
        "critical", "The kernel's OOM killer ended a training rank.",
        fill("Rank [[$rank]][[of_run]] on [[$instance]] was killed by the kernel's OOM "
             "killer ([[detail]]): the node's or the job's memory limit was reached, by "
             "this rank or others beside it (host-side offload, CPU Adam, data "
             "loaders).[[reach]]",
             detail=_exit_detail(), reach=_down_in_run()),
        nodes_dashboard())


def died_of_a_peer(node_agents: Selector) -> Alert:
    """TrainingRankDown for a rank that failed because a peer did, where no rank of its run
    is known to have ended first: the cause is out of sight (a rank on a node without an
    agent, the network between nodes). Paged, so that nothing is silent."""
    frozen = (f"{down(node_agents)} and on (job, instance, rank) "
              f"{node_agents('colossalai_rank_process_alive')} == 1")
    any_cause = "\nor\n".join((
        f"count by (run) ({node_agents(EXIT, EXPLAINING_EXITS)})",
        runs_with(with_run(frozen, TROUBLED_RUN)),
        runs_with(LOST_RANKS),
        # the rank its timeout waited for, alive (TrainingHangSuspect names it)
        runs_with(waited_for_by_timed_out(node_agents)),
        # a rank that left the run early, which it waited for (left_early)
        f"count by (run) ({node_agents(EXIT, FINISHED_EXIT)})",
    ))
    return Alert(
        "TrainingRankDown",
        f"{_exits(node_agents, PEER_FAILED)}\nunless on (run)\n{block(any_cause)}",
        "critical", RANK_DOWN_SUMMARY,
        fill("Rank [[$rank]][[of_run]] on [[$instance]] ended because another rank or "
             "the process group failed first ([[detail]]), and no rank of this "
             "run is known to have ended before it: look for a rank on a node without a "
             "node agent, or at the network between the nodes.[[reach]]",
             detail=_exit_detail(), reach=_down_in_run()),
        nodes_dashboard(), cause="peer_failed")


def hung_elsewhere(node_agents: Selector) -> str:
    """The rank a hang waited for, where the ranks that waited are on other nodes:
    stopped by a signal while outside any collective with nothing in flight, in a run
    where a rank timed out waiting in a collective and no rank is known to have hung,
    failed, or been killed.

    What a hang looks like when the process group's timeout is shorter than the step
    budget (the run dies before any rank counts as stalled) and the hung rank has no
    rank that waited for it on its node: no one agent sees both, so the rules join them
    (``collective``, node/exits.py). A preemption stops ranks in compute too, but times
    nobody out: its staggered signals close connections."""
    stopped_idle = label_is("reason", "interrupted") + "," + label_is("collective", "idle")
    return in_runs_timed_out(node_agents, _exits(node_agents, stopped_idle))


# Why a rank leaves its run while the others still wait for it (left_early).
UNEVEN_STEPS = ("Its loop ran fewer steps than theirs: uneven data across ranks (a sampler "
                "or a sharded dataset that gives ranks different numbers of batches), or a "
                "loop that ends on one rank only (a time limit, a break, an exception "
                "caught there)")


def stalled_waiting(node_agents: Selector, run_from: str = TROUBLED_RUN) -> str:
    """The live ranks that are stalled with a collective in flight, or sampled waiting in
    one (on a GPU a rank waiting for NCCL samples as compute in a CUDA sync: its work in
    flight says it), with their run (joined from ``run_from``)."""
    stalled = (f"{stalled_now(node_agents)}\nunless on (job, instance, rank)\n"
               f"  {down(node_agents)}\nand on (job, instance, rank)\n"
               f"  ({node_agents(ACTIVITY, WAITING)} or {node_agents(IN_FLIGHT)} > 0)")
    return with_run(stalled, run_from)


def left_early(node_agents: Selector, waiting: str) -> str:
    """The ranks that finished (``monitor.finish()``, or their script's end) in runs
    where ranks of ``waiting`` were left waiting for them, and no rank hung, failed, or
    was killed (whose own page explains the waiting).

    Its loop ran fewer steps than the others': the classic uneven-data end of a
    data-parallel run. The ranks it leaves fail on its closed connections (gloo; NCCL
    across nodes: TrainingRankDown), or wait until the process group's timeout (NCCL
    within a node: TrainingHangSuspect, then TrainingRankDown once the watchdog ends
    them). A healthy end leaves nobody waiting: every rank finishes after the same
    step."""
    explained = label_is("reason", "hung", "failed", "killed", "oom_killed")
    return (f"{_exits(node_agents, FINISHED_EXIT)}\n"
            f"and on (run)\n{block(waiting, 'count by (run)')}\n"
            f"unless on (run)\n  count by (run) ({node_agents(EXIT, explained)})")


def listed_ranks(promql: str) -> str:
    """"rank 0 on node-a:9466, rank 2 on node-b:9466": the ranks ``promql`` returns, a
    printf format of one ``%q``, the alert's run."""
    one_line = " ".join(promql.split())  # a Go string literal has no line breaks
    ranks = printf_query(one_line, " ".join(["$labels.run"] * one_line.count("%q")))
    return (f'{{{{ range $i, $r := {ranks} | sortByLabel "rank" }}}}{{{{ if $i }}}}, '
            "{{ end }}rank {{ $r.Labels.rank }} on {{ $r.Labels.instance }}{{ end }}")


# A rank whose collective passed the process group's timeout (node/exits.py, collective).
TIMED_OUT = label_is("reason", "peer_failed") + "," + label_is("collective", "timed_out")


def in_runs_timed_out(node_agents: Selector, vector: str) -> str:
    """``vector`` in runs where a rank timed out waiting in a collective, and no rank is
    known to have hung, failed or been killed (whose own page explains the timeout)."""
    explained = label_is("reason", "hung", "failed", "killed", "oom_killed")
    return (f"{vector}\nand on (run)\n  count by (run) ({node_agents(EXIT, TIMED_OUT)})\n"
            f"unless on (run)\n  count by (run) ({node_agents(EXIT, explained)})")


def waited_for_by_timed_out(node_agents: Selector) -> str:
    """The live ranks with nothing in flight (and not finished or failed), in runs where a
    rank timed out waiting in a collective (:func:`in_runs_timed_out`): the ranks it
    waited for (TrainingHangSuspect, cause others_timed_out).

    The runs first: the set is empty while nobody has timed out, and every rank has
    nothing in flight most of the time. Joined after, the down and ended ranks cost a
    join of every rank at each evaluation (95 ms at 4,096 ranks, bench/RESULTS.md)."""
    idle = in_runs_timed_out(node_agents, f"{node_agents(IN_FLIGHT)} == 0")
    return (f"{block(idle)}\nunless on (job, instance, rank)\n  {down(node_agents)}\n"
            f"unless on (job, instance, rank)\n  {in_phase(node_agents, ENDED_PHASES)}")


def timed_out_ranks() -> str:
    """"rank 0 on node-a:9466, rank 2 on node-b:9466": the ranks of the alert's run that
    timed out waiting in a collective."""
    return listed_ranks(f"{EXIT}{{{TIMED_OUT},run=%q}}")


def unscrapable(rank_servers: Selector, node_agents: Selector) -> Alert:
    """TrainingRankDown for a rank server Prometheus cannot scrape.

    Only a rank server that served a run in the last hour, and with that run's label,
    so that a cause alert of the run mutes this one too. A target that has not served
    yet is a run still starting (model load before the monitor exists, minutes at
    scale): not down. Not a rank a node agent reports (it says better how the rank
    ended: finished, stopped, killed), nor one whose server last said it finished (a
    static target outlives its run).
    """
    return Alert(
        "TrainingRankDown",
        expr(f"""
            (
              {rank_servers('up')} == 0
            )
            * on (job, instance) group_left (run, rank)
              max by (job, instance, run, rank) (last_over_time({rank_servers(INFO)}[1h]))
            unless on (run, rank)
              {AGENT_RANKS}
            unless on (job, instance)
              last_over_time({rank_servers(PHASE, FINISHED)}[1h])
        """),
        "critical", RANK_DOWN_SUMMARY,
        fill("Prometheus cannot scrape the rank server [[$instance]] of job [[$job]] (rank "
             "[[$rank]][[of_run]]), and no node agent reports the rank: its process is "
             "gone, wedged or unreachable."),
        training_job_dashboard(), cause="scrape")


def node_lost(rank_servers: Selector, node_agents: Selector, window: Duration) -> Alert:
    """TrainingNodeLost: a node gone with its agent and its ranks, while its run suffers.

    A node that loses power or its network takes its node agent along: nothing on it
    can say its ranks are down, and the surviving ranks die of their peers' closed
    connections (or wait in a collective for them). What Prometheus still sees names
    the node: the agent's target down, the ranks it reported gone from every agent, and
    the run's other ranks failing or stalled since. An agent that restarts, or dies
    alone while the run trains on, is not this (ExporterDown's).
    """
    trouble = "\nor\n".join((
        f"count by (run) ({node_agents(EXIT, UNFINISHED_EXITS)})",
        runs_with(with_run(stalled_now(node_agents), TROUBLED_RUN)),
        runs_with(with_run(stalled_now(rank_servers), TROUBLED_RUN)),
    ))
    node_ranks = ("job", "instance", "run")
    lost = f"max by (rank) (last_over_time({matching(INFO, node_ranks)}[{window}]))"
    lost_pipeline = printf_query(lost, template_args(node_ranks))
    return Alert(
        "TrainingNodeLost",
        f"{block(LOST_RANKS, 'count by (job, instance, run)')}\n"
        f"and on (run)\n{block(trouble)}",
        "critical", "A node running training ranks is gone, with its node agent.",
        fill('Node [[$instance]] stopped answering, and with it {{ $value | printf "%.0f" }} '
             "rank(s) of run [[$run]] ([[ranks]]): it is down, hung or cut off from the "
             "network, and the run's other ranks failed or stalled since.",
             ranks=(f'{{{{ range $i, $r := {lost_pipeline} | sortByLabel "rank" }}}}'
                    "{{ if $i }}, {{ end }}rank {{ $r.Labels.rank }}{{ end }}")),
        nodes_dashboard())
