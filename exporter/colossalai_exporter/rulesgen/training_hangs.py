"""Hangs: TrainingHangSuspect, the rank a stalled run waits for (training/activity.py).

A synchronous run stalls as a whole: every rank but one waits in a collective
for the one that does not arrive. The stall alerts (training_stalls.py) fire on
every rank; this family names the one to look at, from five angles, each a
``cause`` of its own: a stalled rank outside any collective while others wait, a
rank that does not answer at all, NCCL's RAS naming a rank behind or broken,
torch's flight recorder naming the rank behind in its process groups, and a rank
RAS cannot reach on a node no agent reports. A rank that merely waits is never
one. Alertmanager mutes the run's stalls and rank-downs under it.
"""

from __future__ import annotations

from colossalai_exporter.rankstate.schema import PHASES
from colossalai_exporter.rankstate.schema import WAITING as WAITING_ACTIVITIES
from colossalai_exporter.rulesgen.common import (
    ACTIVITY,
    AGENT_RANKS,
    DOWN_RANKS,
    INFO,
    LOST_RANKS,
    RANK,
    RANK_RUN,
    TROUBLED_RUN,
    down,
    in_phase,
    last_error,
    nodes_dashboard,
    on_any_rank,
    one_view_per_rank,
    phase_is,
    runs_with,
    snapshot_age,
    stalled_now,
    training_dashboard,
    with_run,
)
from colossalai_exporter.rulesgen.config import Duration
from colossalai_exporter.rulesgen.model import Alert, Recording
from colossalai_exporter.rulesgen.promql import (
    Selector,
    block,
    expr,
    fill,
    first_sample,
    indent,
    label_is,
    label_is_not,
    matching,
    printf_query,
    template_args,
    with_first,
)
from colossalai_exporter.rulesgen.training_deaths import (
    EXIT,
    UNEVEN_STEPS,
    left_early,
    listed_ranks,
    stalled_waiting,
    timed_out_ranks,
    waited_for_by_timed_out,
)

WAITING = label_is("activity", *WAITING_ACTIVITIES)
NOT_WAITING = label_is_not("activity", *WAITING_ACTIVITIES)
# A rank in one of these is busy with something of its own (starting, a checkpoint) or
# has ended: not waiting for the others, and not stepping.
OWN_PHASES = phase_is(*(p for p in PHASES if p != "training"))
PROBLEM = "colossalai_nccl_rank_problem_info"
# What NCCL's RAS says of a rank it can reach, and of one it cannot.
BROKEN = label_is("problem", "behind", "aborted", "async_error")
UNREACHABLE = label_is("problem", "missing", "unresponsive", "dead")
ENQUEUED = "colossalai_training_collective_enqueued"
SUMMARY = "The rank a stalled training run is waiting for."


def hang_suspects(rank_servers: Selector, node_agents: Selector,
                  after_timeout: Duration) -> tuple[Alert | Recording, ...]:
    """Every rule of the family, in the order the rule file lists them."""
    return (waiting_runs(rank_servers, node_agents),
            outside_collective(rank_servers, node_agents),
            not_responding(rank_servers, node_agents),
            nccl_problem(rank_servers, node_agents),
            collectives_behind(rank_servers, node_agents),
            unreachable(node_agents), others_timed_out(node_agents, after_timeout),
            left_behind(node_agents), last_collectives(node_agents), mismatched())


def answering(view: Selector, vector: str) -> str:
    """``vector`` of the ranks that answer: a dead rank's last snapshot still says where
    it was."""
    return f"{vector}\nunless on (job, instance, rank)\n  {down(view)}"


def outside_own_phases(view: Selector, vector: str) -> str:
    """``vector`` less the ranks in start-up, a checkpoint, an evaluation, a recompile or
    a data loader's start, which have their own budget and alert that say more
    (TrainingStartupStuck, CheckpointStuck, EvaluationStuck, CompileStuck,
    DataStartStuck), and the finished and failed ones, which wait for no one."""
    # on (job, instance, rank), not ignoring (phase): the vectors this excludes from
    # carry labels of their own (activity, pg) that the phase series lacks.
    return f"{vector}\nunless on (job, instance, rank)\n  {in_phase(view, OWN_PHASES)}"


#: The runs where ranks that answer wait for the others (in a collective, in backward),
#: in either view, valued by how many (a rank counted in both still makes a run wait):
#: recorded once, before the family's rules, which three of them read.
WAITING_RUNS = "run:colossalai_training_ranks_waiting:count"


def waiting_ranks(view: Selector) -> str:
    """The ranks of ``view`` that answer and wait for the others, with their run.

    A rank's activity is served only while it is stalled, beside its stalled series in
    the same scrape (rankstate/families.py): its ranks are in STALLED_RANKS, so their
    run comes from TROUBLED_RUN, here and in named_outside."""
    return with_run(answering(view, view(ACTIVITY, WAITING)), TROUBLED_RUN)


def waiting_runs(rank_servers: Selector, node_agents: Selector) -> Recording:
    return Recording(WAITING_RUNS, f"{runs_with(waiting_ranks(node_agents))}\nor\n"
                                   f"{runs_with(waiting_ranks(rank_servers))}")


def while_others_wait(vector: str) -> str:
    """``vector``, only in runs where ranks wait (WAITING_RUNS)."""
    return f"{vector}\nand on (run)\n  {WAITING_RUNS}"


def waiting_text() -> str:
    """" while 3 other rank(s) wait in collective (all_reduce)": the run's waiting ranks,
    largest group first."""
    # Both views, each rank once: the rank servers' scrape may see a waiting rank's
    # stall before the node agent's does, and the alert's expression reads both.
    waiting = ("topk(1, count by (activity, collective) (max by (rank, activity, collective) ("
               f"{ACTIVITY}{{{WAITING}, rank!=%q}}"
               f" * on (job, instance, rank) group_left () {INFO}{{run=%q}})))")
    return first_sample(waiting, "$labels.rank $labels.run",
                        ' while {{ .Value | printf "%.0f" }} other rank(s) wait in '
                        "{{ .Labels.activity }}{{ with .Labels.collective }} ({{ . }}){{ end }}")


def named_outside(rank_servers: Selector, node_agents: Selector) -> str:
    """Stalled ranks outside any collective while others of their run wait."""
    def elsewhere(view: Selector) -> str:
        active = block(view(ACTIVITY, NOT_WAITING), "max without (collective, frame)")
        return outside_own_phases(view, answering(view, active))

    return while_others_wait(block(on_any_rank(elsewhere, rank_servers, node_agents,
                                                run_from=TROUBLED_RUN)))


def outside_collective(rank_servers: Selector, node_agents: Selector) -> Alert:
    """TrainingHangSuspect for a stalled rank outside any collective, where it is."""
    return Alert(
        "TrainingHangSuspect",
        named_outside(rank_servers, node_agents),
        "critical", SUMMARY,
        fill("Rank [[$rank]][[of_run]] on [[$instance]] is the rank the others wait for: "
             "it has made no step within its budget and is outside any collective, in "
             "[[$activity]] at [[frame]][[waiting]].[[last_error]]",
             frame=with_first(ACTIVITY, RANK, "{{ .Labels.frame }}"),
             waiting=waiting_text(), last_error=last_error()),
        training_dashboard(), cause="outside_collective")


def not_responding(rank_servers: Selector, node_agents: Selector) -> Alert:
    """TrainingHangSuspect from the node agent's view: the process exists but publishes
    nothing (a C call holding the GIL, D state) or is stopped, while other ranks of its
    run wait."""
    not_answering = outside_own_phases(node_agents, expr(f"""
        (
            ({down(node_agents)} and on (job, instance, rank)
              {node_agents("colossalai_rank_process_alive")} == 1)
          or
            {node_agents("colossalai_rank_process_stopped")} == 1
        )
    """))
    stopped = printf_query(matching("colossalai_rank_process_stopped", RANK, " == 1"),
                           template_args(RANK))
    return Alert(
        "TrainingHangSuspect",
        while_others_wait(with_run(not_answering)),
        "critical", SUMMARY,
        fill("Rank [[$rank]][[of_run]] on [[$instance]] is the rank the others wait for: "
             "it is not responding ([[why]]; state snapshot [[age]] old)[[waiting]]."
             "[[last_error]]",
             why=(f"{{{{ if {stopped} }}}}process stopped: SIGSTOP or a debugger{{{{ else }}}}"
                  "GIL held by a C call, or the process frozen{{ end }}"),
             age=snapshot_age(), waiting=waiting_text(), last_error=last_error()),
        nodes_dashboard(), cause="not_responding")


def nccl_problem(rank_servers: Selector, node_agents: Selector) -> Alert:
    """TrainingHangSuspect from NCCL's own view (the node agent's nccl collector): a local
    rank behind the others of a communicator in collective counts, or aborted or with an
    asynchronous error, while ranks of its run wait. Names the rank even when every rank
    is inside a collective (mismatched collectives)."""
    reported = block(node_agents(PROBLEM, BROKEN, 'rank!=""'), "max by (job, instance, rank)")
    return Alert(
        "TrainingHangSuspect",
        while_others_wait(with_run(reported)),
        "critical", SUMMARY,
        fill("Rank [[$rank]][[of_run]] on [[$instance]] is the rank the others wait for: "
             "NCCL's RAS service reports it [[what]][[waiting]].[[last_error]]",
             what=with_first(PROBLEM, RANK,
                             '{{ if eq .Labels.problem "behind" }}behind the rest of '
                             "communicator {{ .Labels.comm }} in collectives{{ else }}"
                             "{{ .Labels.problem }} in communicator {{ .Labels.comm }}"
                             "{{ end }}"),
             waiting=waiting_text(), last_error=last_error()),
        nodes_dashboard(), cause="nccl")


def unreachable(node_agents: Selector) -> Alert:
    """TrainingHangSuspect for a rank NCCL's RAS cannot reach and no node agent reports.

    A node that died or dropped off the network takes its agent with it, so nothing
    says its ranks are down; the other nodes' RAS still lists them as missing from
    their communicators. In a communicator spanning the whole run the nccl collector
    knows their training rank and run (node/nccl_ras.py). Every node reports the same
    missing rank: one alert per rank. Only while the run is stalled, and not for a rank
    whose node agent is known down: that is TrainingNodeLost's page, which names the
    node (one page for one lost node).
    """
    missing = node_agents(PROBLEM, UNREACHABLE, 'rank!=""', 'run!=""')
    seen = AGENT_RANKS  # the ranks some agent reports, recorded once (not every rank's up)
    stalled = runs_with(with_run(stalled_now(node_agents), TROUBLED_RUN))
    problem = f"max by (problem) ({PROBLEM}{{run=%q,rank=%q,{UNREACHABLE}}})"
    return Alert(
        "TrainingHangSuspect",
        f"(\n  max by (job, run, rank, rank_host, pid) (\n    {missing}\n  )\n"
        f"  unless on (run, rank)\n{indent(seen, 4)}\n"
        f"  unless on (run, rank)\n  (\n    {LOST_RANKS}\n  )\n)\n"
        f"and on (run)\n{stalled}",
        "critical", SUMMARY,
        fill("Rank [[$rank]][[of_run]] is the rank the others wait for: NCCL's RAS "
             "service on the other nodes reports it [[what]] (pid [[$pid]] on "
             "[[$rank_host]]), and no node agent reports it: its node is down or cut off "
             "from the network.",
             what=first_sample(problem, "$labels.run $labels.rank", "{{ .Labels.problem }}",
                               otherwise="missing")),
        training_dashboard(), cause="unreachable")


def collectives_behind(rank_servers: Selector, node_agents: Selector) -> Alert:
    """TrainingHangSuspect from torch's flight recorder (training/flight_recorder.py).

    A collective completes on no rank before every rank of its process group has
    enqueued it, so in a stalled run a rank that has enqueued fewer collectives in a
    group than another rank of it is the one that rank waits for. This names the
    rank where the activity cannot: with NCCL every rank's thread sits in a CUDA
    synchronisation ("compute"), waiting ranks and culprit alike. Groups are compared
    by the name torch registered (``pg``), which every member shares. A rank behind in
    one group may only be waiting in another, where it is ahead (pairs, then a global
    all-reduce: the partner of a frozen rank is behind in the global group because it
    waits in the pair): a rank ahead of another in any group waits, and is never named.
    The series exist only while a rank is stalled, and carry their run and group
    themselves. A rank the activity already names (outside any collective while others
    wait) is left to that cause, whose description says more (its frame): one alert per
    culprit.
    """
    # Each view's collectives only of the ranks its recorded stalled set holds: every
    # other rule of the family reads the ranks through that set (TROUBLED_RUN, recorded
    # at the head of the group), and Prometheus gives a group's rules no common view of
    # the data (prometheus/prometheus#12275): a node agent's scrape committed between
    # the head's recordings and this rule shows it ranks newly stalled that the rule for
    # the place (outside_collective) cannot see yet, so this rule alone named the rank,
    # with the weaker cause, for one evaluation (the fault suite's 4-rank frozen
    # compute, once in 6 loaded runs).
    def enqueued(view: Selector) -> str:
        return f"{view(ENQUEUED)} and on (job, instance, rank) {stalled_now(view)}"

    both = f"{enqueued(node_agents)}\nor\n{enqueued(rank_servers)}"
    furthest = block(both, "max by (run, pg)")
    least = block(both, "min by (run, pg)")

    def behind(view: Selector) -> str:
        lower = block(f"{block(enqueued(view), 'max without (op)')}\n"
                      f"< on (run, pg) group_left ()\n{furthest}")
        # A rank its place shows waiting waits: behind in one group because it waits in
        # another for a rank that is not stalled (whose collectives are not served: a
        # partner in an evaluation of its own).
        lower = f"{lower}\nunless on (job, instance, rank)\n  {view(ACTIVITY, WAITING)}"
        # One alert per culprit, whatever the number of groups it is behind in (the
        # description lists them): its labels must not change between evaluations.
        return block(outside_own_phases(view, answering(view, lower)),
                     "max without (pg, pg_ranks)")

    def ahead(view: Selector) -> str:
        return f"({enqueued(view)})\n  > on (run, pg) group_left ()\n{indent(least)}"

    waits_somewhere = f"(\n{indent(ahead(node_agents))}\nor\n{indent(ahead(rank_servers))}\n)"

    # Compared only once every stalled rank of the run that answers has said where its
    # collectives are: each rank publishes them when it sees its own stall, a moment
    # apart, and until the lowest member of a group has, a rank ahead of it there looks
    # behind only elsewhere (a 2x2 mesh paged a waiting rank so, for one evaluation).
    def unreported(view: Selector) -> str:
        silent = f"{stalled_now(view)}\nunless on (job, instance, rank)\n  {view(ENQUEUED)}"
        return block(with_run(answering(view, silent), TROUBLED_RUN), "max by (run)")

    incomplete = (f"(\n{indent(unreported(node_agents))}\nor\n"
                  f"{indent(unreported(rank_servers))}\n)")
    return Alert(
        "TrainingHangSuspect",
        f"{block(one_view_per_rank(behind, rank_servers, node_agents))}\n"
        f"unless on (run, rank)\n{waits_somewhere}\n"
        f"unless on (run, rank)\n{block(named_outside(rank_servers, node_agents))}\n"
        f"unless on (run)\n{incomplete}",
        "critical", SUMMARY,
        fill("Rank [[$rank]][[of_run]] on [[$instance]] is the rank the others wait for: "
             "[[behind_in]]; it waits in no process group.[[last_error]]",
             behind_in=_behind_in(), last_error=last_error()),
        training_dashboard(), cause="collectives_behind")


def others_timed_out(node_agents: Selector, wait: Duration) -> Alert:
    """TrainingHangSuspect for a live rank with nothing in flight, in a run where a rank
    timed out waiting in a collective: the one it waited for.

    A process group's timeout shorter than the step budget ends the waiting ranks
    before any rank counts as stalled. On the hung rank's node, torchrun then stops it,
    and the node agent judges it (``hung``, TrainingRankDown); but a launcher with
    static rendezvous (``--master_addr``, ColossalAI's ``colossalai run``) on another
    node never learns of the failure, and the hung rank lives on there. Nothing in
    flight, from the flight recorder's status, tells it from the ranks that still wait:
    on a GPU every rank's thread samples as compute. From start-up on too: a rank
    loading a checkpoint for longer than the timeout while the others wait at a
    barrier. Only once it has lived on for ``wait``: where the launcher does stop it,
    it is gone within seconds, and TrainingRankDown names it from how it ended."""
    return Alert(
        "TrainingHangSuspect",
        waited_for_by_timed_out(node_agents),
        "critical", SUMMARY,
        fill("Rank [[$rank]][[of_run]] on [[$instance]] is the rank the others wait for: "
             "[[waiters]] timed out waiting for a peer in a collective, and this rank, alive, "
             "has nothing in flight. The process group's timeout is shorter than the step "
             "budget, so no rank counted as stalled first.[[last_error]]",
             waiters=timed_out_ranks(), last_error=last_error()),
        nodes_dashboard(), for_=wait, cause="others_timed_out")


def left_behind(node_agents: Selector) -> Alert:
    """TrainingHangSuspect for a rank that finished while ranks of its run, alive, wait
    for it in a collective (training_deaths.left_early): its loop ran fewer steps than
    theirs. NCCL within a node does not see a peer process end: the ranks it left wait
    until the process group's timeout (10 minutes by default), stalled, and this names
    the rank they wait for meanwhile. A finished rank is gone; its node agent still
    reports how it ended."""
    waiters = listed_ranks(stalled_waiting(node_agents, TROUBLED_RUN + "{run=%q}"))
    return Alert(
        "TrainingHangSuspect",
        left_early(node_agents, stalled_waiting(node_agents)),
        "critical", SUMMARY,
        fill("Rank [[$rank]][[of_run]] on [[$instance]] is the rank the others wait for: it "
             "left the run early: it [[detail]], while the ranks it left ([[waiters]]) wait "
             f"for it in a collective, stalled. {UNEVEN_STEPS}.",
             detail=with_first(EXIT, RANK, "{{ .Labels.detail }}"), waiters=waiters),
        nodes_dashboard(), cause="left_early")


#: Each stalled rank's last collective in each process group, from the node agents'
#: view, valued 1, with its sequence number as the ``seq`` label: what
#: :func:`mismatched` compares. Point-to-point work and entries without a name are left
#: out (:func:`last_collectives`). Empty unless ranks are stalled.
LAST_COLLECTIVES = "job_instance_rank_pg:colossalai_training_collective_enqueued:seq"


def last_collectives(node_agents: Selector) -> Recording:
    # Named collectives only: an entry the recorder no longer holds has no name, and
    # NCCL numbers point-to-point work apart from collectives (a send and an all-reduce
    # may share a number in one group), so neither compares.
    collectives = node_agents(ENQUEUED, 'op!=""', 'op!~".*(send|recv)"')
    named = f"{collectives}\nand on (job, instance, rank)\n  {stalled_now(node_agents)}"
    return Recording(LAST_COLLECTIVES,
                     f'count_values by (job, instance, run, rank, pg, op) ("seq",\n'
                     f"{indent(answering(node_agents, named))}\n)")


def mismatched() -> Alert:
    """TrainingHangSuspect for ranks that wait in different collectives at the same place
    of a process group: the flight recorder has them at the same sequence number there,
    under different names (an all-reduce on some, a barrier on another).

    Collectives match by order: a collective called on some ranks only (logging code
    under ``if rank == 0:``, a condition that differs between ranks) or in a different
    order leaves every rank waiting, none behind, and no rank outside a collective, so
    no other cause names one. The ranks named are those of the less common collective;
    where the ranks split evenly (two ranks, one each), all of them, each description
    saying what the others wait in. Collectives only: NCCL numbers point-to-point work
    apart from them, so a send's number says nothing of a collective's. From the node
    agents' view, which sees every rank
    (LAST_COLLECTIVES), once every live rank of the run has reported."""
    each = LAST_COLLECTIVES
    at = "(run, pg, seq)"
    per_op = block(each, f"count by {at[:-1]}, op)")
    most = block(per_op, f"max by {at}")
    fewer = f"{per_op}\n< on {at} group_left ()\n{most}"
    split = block(per_op, f"count by {at}") + " > 1"
    even = (f"({per_op}\n  and on {at}\n{indent(split)})\nunless on {at}\n"
            f"(\n{indent(fewer)}\n)")
    named = f"{each}\nand on {at[:-1]}, op)\n(\n{indent(fewer)}\nor\n{indent(even)}\n)"
    # Compared only once every live rank of the run has said where it waits: ranks see
    # their own stall moments apart, and two of four compared alone split evenly (a
    # 4-rank run paged a rank of the majority so, in the fault suite).
    reported = block(each, "count by (run) (max by (run, rank)") + ")"
    live = block(f"{RANK_RUN}\nunless on (job, instance, rank)\n  {DOWN_RANKS}",
                 "count by (run) (max by (run, rank)") + ")"
    complete = f"{reported}\n== on (run)\n{live}"
    named = f"{named}\nand on (run)\n(\n{indent(complete)}\n)"
    mine = f"{ENQUEUED}{{run=%q,rank=%q,pg=%q}}"
    # each rank once: rank 0 is served by its own server too
    theirs = f"max by (rank, op) ({ENQUEUED}{{run=%q,rank!=%q,pg=%q}})"
    others = printf_query(theirs, "$labels.run $labels.rank $labels.pg")
    return Alert(
        "TrainingHangSuspect",
        block(named, "max by (job, instance, rank, run, pg)"),
        "critical", SUMMARY,
        fill("Rank [[$rank]][[of_run]] on [[$instance]] is in a different collective from "
             "the others: it waits in [[mine]], where [[others]]. The ranks called "
             "different collectives (one called on some ranks only, under a condition such "
             "as `if rank == 0:`, or in a different order), so none completes.",
             mine=first_sample(mine, "$labels.run $labels.rank $labels.pg",
                               "{{ .Labels.op }} #{{ .Value }} of process group "
                               "{{ .Labels.pg }} (ranks {{ .Labels.pg_ranks }})"),
             others=(f'{{{{ range $i, $r := {others} | sortByLabel "rank" }}}}{{{{ if $i }}}}, '
                     "{{ end }}rank {{ $r.Labels.rank }} waits in {{ $r.Labels.op }} "
                     "#{{ $r.Value }}{{ end }}")),
        nodes_dashboard(), cause="mismatch")


def _behind_in() -> str:
    """"in process group 3 (ranks 0,1) it has enqueued collective #41, and other ranks
    wait in #42 (allreduce)": the groups the rank is behind in (either view, each group
    once), and in each the collective the others wait in."""
    groups = (f"max by (pg, pg_ranks) ({ENQUEUED}{{run=%q,rank=%q}}) < on (pg) group_left () "
              f"max by (pg) ({ENQUEUED}{{run=%q}})")
    waited_in = first_sample(f"topk(1, {ENQUEUED}{{run=%q,pg=%q}})", "$labels.run $g.Labels.pg",
                             "#{{ .Value }}{{ with .Labels.op }} ({{ . }}){{ end }}",
                             otherwise="a later one")
    each_group = printf_query(groups, "$labels.run $labels.rank $labels.run")
    return (f'{{{{ range $i, $g := {each_group} | sortByLabel "pg" }}}}'
            "{{ if $i }}; {{ end }}in process group {{ $g.Labels.pg }} (ranks "
            "{{ $g.Labels.pg_ranks }}) it has enqueued collective #{{ $g.Value }}, and other "
            f"ranks wait in {waited_in}{{{{ end }}}}")
