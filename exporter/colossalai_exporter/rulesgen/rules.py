"""Every alerting and recording rule, built from the rules config.

Phases are the TrainingMonitor's: init, kernels, training, checkpointing,
evaluating, finished, failed (``colossalai_training_phase{phase}``). In every
phase ``colossalai_training_step_timeout_seconds`` is the budget of that phase
(start-up, step or checkpoint), so the stall rules compare against it rather
than against one fixed number for every model size.

Descriptions carry the numbers an on-call engineer needs; where a number is
not the alert's value, the template queries it (``promql.query``).
"""

from __future__ import annotations

from collections.abc import Callable

from colossalai_exporter.node.gpu import xid
from colossalai_exporter.rankstate.schema import PHASES
from colossalai_exporter.rankstate.schema import WAITING as WAITING_ACTIVITIES
from colossalai_exporter.rulesgen.config import Duration, RulesConfig, Thresholds
from colossalai_exporter.rulesgen.model import Alert, Group, Recording, RuleFile
from colossalai_exporter.rulesgen.promql import (
    Selector,
    expr,
    fill,
    indent,
    number,
    query,
    si_bytes,
    with_first,
)

RANK = ("job", "instance", "rank")
INFO = "colossalai_training_info"
# The alerts that name the cause of a failure. In deploy/alertmanager/alertmanager.yml
# each mutes, for its run, the alerts that follow from it (docs/rules.md, "One incident,
# one page").
# The rank a hang waits for (TrainingHangSuspect) is a cause to the stalls and the
# rank-down it explains, and itself follows from a named cause (a checkpoint stuck in
# torch.save leaves that rank outside any collective while the others wait).
SPECIFIC_CAUSE_ALERTS = ("GeminiOutOfMemory", "KernelBuildFailed", "CheckpointFailing",
                         "CheckpointStuck", "TrainingRankOOMKilled", "TrainingNodeLost",
                         "GPUXidCritical")
# Causes named from the outside (who a hang waits for; a run that keeps restarting): they
# explain the stalls and rank-downs that follow, and a specific cause explains them.
GENERAL_CAUSE_ALERTS = ("TrainingHangSuspect", "TrainingRestartLoop")
CAUSE_ALERTS = (*SPECIFIC_CAUSE_ALERTS, *GENERAL_CAUSE_ALERTS)
CONSEQUENCE_ALERTS = ("TrainingRankDown", "TrainingStalled", "NCCLRendezvousDown",
                      "TrainingStartupStuck", "KernelsNotReady")

# Recording rules other rules and the dashboards use.
STEP_RATE = "job_rank:colossalai_training_steps:rate5m"
STEP_RATE_MEDIAN = "job:colossalai_training_steps:median_rate5m"
STEP_RATE_RATIO = "job_rank:colossalai_training_steps:rate5m_ratio_to_median"
STEP_MEAN = "job_rank:colossalai_training_step_duration_seconds:mean5m"
WAIT_SHARE = "run_rank:colossalai_training_waiting:ratio5m"
WAIT_SHARE_MEDIAN = "run:colossalai_training_waiting:median_ratio5m"
# Goodput's windows and how often each is evaluated: a day's window reads a day of
# samples of two counters a rank, so it is evaluated every 5 minutes, not every 15 s.
GOODPUT_WINDOWS = {"1h": "1m", "24h": "5m"}


def goodput_ratio(window: str) -> str:
    """``colossalai:job_goodput_ratio:<window>``: per run, see docs/rules.md, "Goodput"."""
    return f"colossalai:job_goodput_ratio:{window}"


def kept_seconds(window: str) -> str:
    """Productive step seconds each rank kept over ``window`` (the goodput's numerator)."""
    return f"run_rank:colossalai_training_kept_seconds:{window}"


def checkpointed_increase(window: str) -> str:
    """Each rank's checkpointed seconds' increase over ``window`` (read by kept_seconds)."""
    return f"rank:colossalai_training_checkpointed_seconds:increase{window}"

GPU_MEM_MAX = "instance:colossalai_gpu_memory_used_percent:max"
HOST_MEM_AVAIL = "instance:colossalai_host_memory_available_bytes:percent"


def _training_dash() -> tuple[str, dict[str, str]]:
    return ("colossalai-training", {"job": "{{ $labels.job | urlquery }}",
                                    "rank": "{{ $labels.rank | urlquery }}"})


def _nodes_dash() -> tuple[str, dict[str, str]]:
    return ("colossalai-nodes", {"job": "{{ $labels.job | urlquery }}",
                                 "instance": "{{ $labels.instance | urlquery }}"})


def _chat_dash() -> tuple[str, dict[str, str]]:
    return ("colossalai-chat", {"job": "{{ $labels.job | urlquery }}",
                                "instance": "{{ $labels.instance | urlquery }}"})


def with_run(vector: str, sel: Selector, on: tuple[str, ...] = RANK) -> str:
    """``vector`` with the ``run`` label of its ranks' ``colossalai_training_info``.

    Values are kept (the info is 1). Alertmanager inhibits a run's consequence
    alerts under its cause alert by this label, so every training alert carries it.
    A rank without the info (a monitor older than the label) still alerts, without
    ``run``.
    """
    labels = ", ".join(on)
    info = sel(INFO)
    # Parenthesised whole: "or" binds loosest, and callers combine this further.
    return (f"(\n  (\n{indent(vector, 4)}\n  )\n  * on ({labels}) group_left (run)\n"
            f"    max by ({labels}, run) ({info})\n"
            f"  or\n  (\n{indent(vector, 4)}\n  )\n  unless on ({labels})\n    {info}\n)")


def recent_events(series: str, window: Duration) -> str:
    """Series of a counter that rose within ``window``, valued by how much.

    The second half catches a counter first seen above zero: a rank that hit an
    out-of-memory error in ``booster.boost`` before Prometheus ever scraped it
    at zero has no increase() to show, only a new series.
    """
    return (f"increase({series}[{window}]) > 0\nor\n"
            f"({series} > 0 unless {series} offset {window})")


def on_any_rank(build: Callable[[Selector], str], t: Selector, n: Selector) -> str:
    """``build``'s vector from whichever view sees the rank, each rank once.

    The node agent re-serves every local rank's series (rank 0's too) from the
    snapshot the rank writes, synchronously when an exception passes: it sees
    ranks the rank-0 server does not serve, failures that end the process a
    moment later, and the last state of a rank frozen with the GIL held (whose
    own server cannot answer). The rank servers' view counts only where no agent
    reports the same rank of the same run, so nothing is counted twice.
    """
    seen_by_agent = with_run(n("colossalai_training_phase"), n)
    return (f"{with_run(build(n), n)}\nor\n(\n{indent(with_run(build(t), t))}\n"
            f"  unless on (run, rank)\n{indent(seen_by_agent)}\n)")


def events_on_any_rank(metric: str, window: Duration, t: Selector, n: Selector) -> str:
    """Recent events of a per-rank counter (see :func:`recent_events`), on any rank."""
    return on_any_rank(lambda sel: recent_events(sel(metric), window), t, n)


def _last_error() -> str:
    """" Last error (in step): RuntimeError: CUDA out of memory. …" when the rank has one.

    Last in a description: the message ends with its own punctuation.
    """
    return with_first("colossalai_training_last_error_info", RANK,
                      " Last error (in {{ .Labels.where }}): {{ .Labels.type }}: "
                      "{{ .Labels.message }}")


def _ranks_of_run(condition: str, what: str) -> str:
    """" 4096 rank(s) of this run are stalled." for an alert with a ``run`` label: how
    many ranks of its run (either view, each rank once) meet ``condition``, so a page
    for one rank of a 4,096-rank job says how far the trouble reaches."""
    promql = (f"count(count by (rank) ({condition} and on (job, instance, rank) "
              f"colossalai_training_info{{run=%q}}))").replace('"', '\\"')
    return ('{{ with $labels.run }}{{ with printf "' + promql + '" . | query }}'
            '{{ with first . }} {{ .Value | printf "%.0f" }} ' + what +
            "{{ end }}{{ end }}{{ end }}")


def _since_died() -> str:
    return with_first("colossalai_rank_up", RANK, " The rank's process has since died.",
                      extra=" == 0")


def phase_is(*names: str) -> str:
    """A matcher for the phases ``names``, which must be the snapshot's (rankstate)."""
    unknown = sorted(set(names) - set(PHASES))
    if unknown:
        raise ValueError(f"not a phase of rankstate.schema.PHASES: {unknown}")
    return f'phase="{names[0]}"' if len(names) == 1 else f'phase=~"{"|".join(names)}"'


WAITING = f'activity=~"{"|".join(WAITING_ACTIVITIES)}"'
NOT_WAITING = f'activity!~"{"|".join(WAITING_ACTIVITIES)}"'
# A rank in one of these is busy with something of its own (starting, a checkpoint) or
# has ended: not waiting for the others, and not stepping.
OWN_PHASES = phase_is(*(p for p in PHASES if p not in ("training", "evaluating")))
TRAINING = phase_is("training")
FAILED = phase_is("failed")
FINISHED = phase_is("finished")
ENDED = phase_is("finished", "failed")
NOT_FINISHED = FINISHED.replace("=", "!=", 1)


def _waiting_text() -> str:
    """" while 3 other rank(s) wait in collective (all_reduce)": the run's waiting ranks,
    largest group first."""
    # Both views, each rank once: the rank servers' scrape may see a waiting rank's
    # stall before the node agent's does, and the alert's expression reads both.
    waiting = ("topk(1, count by (activity, collective) (max by (rank, activity, collective) ("
               f"colossalai_training_activity_info{{{WAITING}, rank!=%q}}"
               f" * on (job, instance, rank) group_left () {INFO}{{run=%q}})))")
    fmt = waiting.replace('"', '\\"')
    return (f'{{{{ with printf "{fmt}" $labels.rank $labels.run | query }}}}'
            "{{ with first . }}"
            " while {{ .Value | printf \"%.0f\" }} other rank(s) wait in "
            "{{ .Labels.activity }}{{ with .Labels.collective }} ({{ . }}){{ end }}"
            "{{ end }}{{ end }}")


EXIT = "colossalai_rank_exit_info"
# How a gone rank ended (node/exits.py): the reasons that are the incident itself, and
# those that follow from another rank's end (or are no incident: finished, a signal).
NOT_CAUSE_EXITS = 'reason=~"finished|interrupted|peer_failed|oom_killed"'
# Ends that explain a peer_failed rank: its run's trouble began there.
EXPLAINING_EXITS = 'reason=~"killed|failed|oom_killed|interrupted"'
OOM_KILLED = 'reason="oom_killed"'
PEER_FAILED = 'reason="peer_failed"'


def rank_deaths(t: Selector, n: Selector, window: Duration) -> tuple[Alert, ...]:
    """The rank where a run's death began, and only that rank (docs/rules.md, "The rank
    that died first").

    When one rank dies, the others follow: their collectives fail on its closed
    connections (``peer_failed``), torchrun sends them SIGTERM (``interrupted``). The
    node agent judges how each rank ended (``colossalai_rank_exit_info``), so the rules
    page the rank that was killed, OOM-killed or failed of its own error, and not the
    ranks that followed, whatever order a scrape found them gone in. A run whose every
    rank ended by a signal was stopped (a preemption, a cancel, Ctrl-C): no page.
    """
    phase = "colossalai_training_phase"
    exit_query = f"{EXIT}{{job=%q,instance=%q,rank=%q}}".replace('"', '\\"')
    how = (f'{{{{ with printf "{exit_query}" $labels.job $labels.instance $labels.rank '
           "| query }}{{ with first . }}{{ if eq .Labels.reason \"failed\" }}died of its own "
           "error: {{ .Labels.detail }}{{ else }}was killed: {{ .Labels.detail }}{{ end }}"
           "{{ end }}{{ else }}is not responding: its process is alive but has published "
           "nothing for [[age]] (frozen in a C call holding the GIL, or stopped){{ end }}")
    down = Alert(
        "TrainingRankDown",
        # The node agent's outside view: a rank killed, failed of its own error, or
        # frozen; not one that finished, was stopped by a signal, failed because a
        # peer did, or was OOM-killed (TrainingRankOOMKilled says more).
        with_run(expr(f"""
            {n("colossalai_rank_up")} == 0
            unless on (job, instance, rank)
              {n(EXIT, NOT_CAUSE_EXITS)}
            unless ignoring (phase)
              {n(phase, FINISHED)} == 1
        """), n),
        "critical", "A training rank's process is gone or has stopped publishing its state.",
        fill("Rank [[$rank]][[of_run]] on [[$instance]] [[how]].[[reach]]",
             how=fill(how, age=query("colossalai_rank_snapshot_age_seconds", RANK,
                                     "value | humanizeDuration")),
             reach=_down_in_run()),
        _nodes_dash(), cause="process")
    oom = Alert(
        "TrainingRankOOMKilled",
        f"max without (reason, detail) (\n  {n(EXIT, OOM_KILLED)}\n)",
        "critical", "The kernel's OOM killer ended a training rank.",
        fill("Rank [[$rank]][[of_run]] on [[$instance]] was killed by the kernel's OOM "
             "killer ([[detail]]): the node's or the job's memory limit was reached, by "
             "this rank or others beside it (host-side offload, CPU Adam, data "
             "loaders).[[reach]]",
             detail=query(EXIT, RANK, 'label "detail"'), reach=_down_in_run()),
        _nodes_dash())
    lost = node_lost(t, n, window)
    # A rank that failed because a peer did, where no rank of its run is known to have
    # ended first: the cause is out of sight (a rank on a node without an agent, the
    # network between nodes). Paged, so that nothing is silent.
    any_cause = expr(f"""
        count by (run) ({n(EXIT, EXPLAINING_EXITS)})
        or
        count by (run) (
{indent(with_run(f"{n('colossalai_rank_up')} == 0 and on (job, instance, rank) "
                 f"{n('colossalai_rank_process_alive')} == 1", n), 10)}
        )
        or
        count by (run) (
{indent(lost_ranks(n, window), 10)}
        )
    """)
    peer = Alert(
        "TrainingRankDown",
        f"max without (reason, detail) (\n  {n(EXIT, PEER_FAILED)}\n)\n"
        f"unless on (run)\n(\n{indent(any_cause)}\n)",
        "critical", "A training rank's process is gone or has stopped publishing its state.",
        fill("Rank [[$rank]][[of_run]] on [[$instance]] died of an error saying another "
             "rank or the process group failed first ([[detail]]), and no rank of this "
             "run is known to have ended before it: look for a rank on a node without a "
             "node agent, or at the network between the nodes.[[reach]]",
             detail=query(EXIT, RANK, 'label "detail"'), reach=_down_in_run()),
        _nodes_dash(), cause="peer_failed")
    scrape = Alert(
        "TrainingRankDown",
        # Only a rank server that served a run in the last hour, and with that run's
        # label, so that a cause alert of the run mutes this one too. A target that
        # has not served yet is a run still starting (model load before the
        # monitor exists, minutes at scale): not down. Not a rank a node agent reports
        # (it says better how the rank ended: finished, stopped, killed), nor one whose
        # server last said it finished (a static target outlives its run).
        expr(f"""
            (
              {t('up')} == 0
            )
            * on (job, instance) group_left (run, rank)
              max by (job, instance, run, rank) (last_over_time({t(INFO)}[1h]))
            unless on (run, rank)
{indent(with_run(n("colossalai_rank_up"), n), 14)}
            unless on (job, instance)
              last_over_time({t(phase, FINISHED)}[1h])
        """),
        "critical", "A training rank's process is gone or has stopped publishing its state.",
        fill("Prometheus cannot scrape the rank server [[$instance]] of job [[$job]] (rank "
             "[[$rank]][[of_run]]), and no node agent reports the rank: its process is "
             "gone, wedged or unreachable."),
        ("colossalai-training", {"job": "{{ $labels.job | urlquery }}"}), cause="scrape")
    return down, peer, scrape, oom, lost


def _down_in_run() -> str:
    """" 3 rank(s) of this run are down in all.": how far a death reached (not counting
    ranks that finished)."""
    return _ranks_of_run(f'colossalai_rank_up == 0 unless on (job, instance, rank) '
                         f'{EXIT}{{reason="finished"}}', "rank(s) of this run are down in all.")


def lost_ranks(n: Selector, window: Duration) -> str:
    """Ranks last reported, within ``window``, by a node agent Prometheus cannot scrape
    now, and by no agent now: the ranks of a node that is down or cut off."""
    return expr(f"""
        max by (job, instance, run, rank) (last_over_time({n(INFO)}[{window}]))
        and on (job, instance)
          ({n("up")} == 0)
        unless on (run, rank)
          {n(INFO)}
    """)


def node_lost(t: Selector, n: Selector, window: Duration) -> Alert:
    """TrainingNodeLost: a node gone with its agent and its ranks, while its run suffers.

    A node that loses power or its network takes its node agent along: nothing on it
    can say its ranks are down, and the surviving ranks die of their peers' closed
    connections (or wait in a collective for them). What Prometheus still sees names
    the node: the agent's target down, the ranks it reported gone from every agent, and
    the run's other ranks failing or stalled since. An agent that restarts, or dies
    alone while the run trains on, is not this (ExporterDown's).
    """
    trouble = expr(f"""
        count by (run) ({n(EXIT, 'reason!="finished"')})
        or
        count by (run) (
{indent(with_run(n("colossalai_training_stalled") + " == 1", n), 10)}
        )
        or
        count by (run) (
{indent(with_run(t("colossalai_training_stalled") + " == 1", t), 10)}
        )
    """)
    lost_query = (f'max by (rank) (last_over_time(colossalai_training_info{{job=%q,instance=%q,'
                  f'run=%q}}[{window}]))').replace('"', '\\"')
    return Alert(
        "TrainingNodeLost",
        f"count by (job, instance, run) (\n{indent(lost_ranks(n, window))}\n)\n"
        f"and on (run)\n(\n{indent(trouble)}\n)",
        "critical", "A node running training ranks is gone, with its node agent.",
        fill('Node [[$instance]] stopped answering, and with it {{ $value | printf "%.0f" }} '
             "rank(s) of run [[$run]] ([[ranks]]): it is down, hung or cut off from the "
             "network, and the run's other ranks failed or stalled since.",
             ranks=(f'{{{{ range $i, $r := printf "{lost_query}" $labels.job $labels.instance '
                    "$labels.run | query | sortByLabel \"rank\" }}{{ if $i }}, {{ end }}rank "
                    "{{ $r.Labels.rank }}"
                    "{{ end }}")),
        _nodes_dash())


def hang_suspects(t: Selector, n: Selector,
                  window: Duration) -> tuple[Alert, Alert, Alert, Alert, Alert]:
    """TrainingHangSuspect: the rank a stalled run waits for (training/activity.py).

    Waiting ranks are inside a collective or inside backward (where gradient
    all-reduces wait); the suspect is a stalled rank elsewhere while others
    wait, or a rank that does not answer at all while others wait. A rank that
    merely waits is never one.
    """
    info = "colossalai_training_activity_info"

    def answering(sel: Selector, vector: str) -> str:
        # A dead rank's last snapshot still says where it was: only ranks that answer.
        return f"{vector}\nunless on (job, instance, rank)\n  ({sel('colossalai_rank_up')} == 0)"

    def waiting_ranks(sel: Selector) -> str:
        return f"count by (run) (\n{indent(with_run(answering(sel, sel(info, WAITING)), sel))}\n)"

    # A rank in start-up or a checkpoint has its own budget and alert, which say more
    # (TrainingStartupStuck, CheckpointStuck); finished and failed ranks wait for no one.
    def in_own_phase(sel: Selector) -> str:
        # on (job, instance, rank), not ignoring (phase): the vectors this excludes from
        # carry labels of their own (activity, pg) that the phase series lacks.
        return (f"unless on (job, instance, rank)\n  "
                f"{sel('colossalai_training_phase', OWN_PHASES)} == 1")

    def elsewhere(sel: Selector) -> str:
        active = sel(info, NOT_WAITING)
        return (answering(sel, f"max without (collective, frame) (\n  {active}\n)")
                + "\n" + in_own_phase(sel))

    # Ranks that wait, in either view (a rank counted in both still makes a run wait).
    others_wait = (f"and on (run)\n(\n{indent(waiting_ranks(n))}\n  or\n"
                   f"{indent(waiting_ranks(t))}\n)")
    not_answering = expr(f"""
        (
            ({n("colossalai_rank_up")} == 0 and on (job, instance, rank)
              {n("colossalai_rank_process_alive")} == 1)
          or
            {n("colossalai_rank_process_stopped")} == 1
        )
    """) + "\n" + in_own_phase(n)

    outside_named = f"(\n{indent(on_any_rank(elsewhere, t, n))}\n)\n{others_wait}"
    outside = Alert(
        "TrainingHangSuspect",
        outside_named,
        "critical", "The rank a stalled training run is waiting for.",
        fill("Rank [[$rank]][[of_run]] on [[$instance]] is the rank the others wait for: "
             "it has made no step within its budget and is outside any collective, in "
             "[[$activity]] at [[frame]][[waiting]].[[last_error]]",
             frame=with_first(info, RANK, "{{ .Labels.frame }}"),
             waiting=_waiting_text(), last_error=_last_error()),
        _training_dash(), cause="outside_collective")
    stopped_query = "colossalai_rank_process_stopped{job=%q,instance=%q,rank=%q} == 1"
    not_responding = Alert(
        "TrainingHangSuspect",
        # The node agent's view: the process exists but publishes nothing (a C call
        # holding the GIL, D state) or is stopped, while other ranks of its run wait.
        f"{with_run(not_answering, n)}\n{others_wait}",
        "critical", "The rank a stalled training run is waiting for.",
        fill("Rank [[$rank]][[of_run]] on [[$instance]] is the rank the others wait for: "
             "it is not responding ([[why]]; state snapshot [[age]] old)[[waiting]]."
             "[[last_error]]",
             why=(f'{{{{ if printf "{stopped_query}" $labels.job $labels.instance '
                  "$labels.rank | query }}process stopped: SIGSTOP or a debugger{{ else }}"
                  "GIL held by a C call, or the process frozen{{ end }}"),
             age=query("colossalai_rank_snapshot_age_seconds", RANK,
                       "value | humanizeDuration"),
             waiting=_waiting_text(), last_error=_last_error()),
        _nodes_dash(), cause="not_responding")
    problem = "colossalai_nccl_rank_problem_info"
    problems = n(problem, 'problem=~"behind|aborted|async_error"', 'rank!=""')
    reported = f"max by (job, instance, rank) (\n  {problems}\n)"
    nccl = Alert(
        "TrainingHangSuspect",
        # NCCL's own view (the node agent's nccl collector): a local rank behind the
        # others of a communicator in collective counts, or aborted or with an
        # asynchronous error, while ranks of its run wait. Names the rank even when every
        # rank is inside a collective (mismatched collectives).
        f"{with_run(reported, n)}\n{others_wait}",
        "critical", "The rank a stalled training run is waiting for.",
        fill("Rank [[$rank]][[of_run]] on [[$instance]] is the rank the others wait for: "
             "NCCL's RAS service reports it [[what]][[waiting]].[[last_error]]",
             what=with_first(problem, RANK,
                             '{{ if eq .Labels.problem "behind" }}behind the rest of '
                             "communicator {{ .Labels.comm }} in collectives{{ else }}"
                             "{{ .Labels.problem }} in communicator {{ .Labels.comm }}"
                             "{{ end }}"),
             waiting=_waiting_text(), last_error=_last_error()),
        _nodes_dash(), cause="nccl")
    behind = collectives_behind(t, n, answering, in_own_phase, outside_named)
    return outside, not_responding, nccl, behind, unreachable(n, problem, window)


def unreachable(n: Selector, problem: str, window: Duration) -> Alert:
    """TrainingHangSuspect for a rank NCCL's RAS cannot reach and no node agent reports.

    A node that died or dropped off the network takes its agent with it, so nothing
    says its ranks are down; the other nodes' RAS still lists them as missing from
    their communicators. In a communicator spanning the whole run the nccl collector
    knows their training rank and run (node/nccl_ras.py). Every node reports the same
    missing rank: one alert per rank. Only while the run is stalled, and not for a rank
    whose node agent is known down: that is TrainingNodeLost's page, which names the
    node (one page for one lost node).
    """
    missing = n(problem, 'problem=~"missing|unresponsive|dead"', 'rank!=""', 'run!=""')
    seen = with_run(n("colossalai_rank_up"), n)
    stalled_ranks = with_run(n("colossalai_training_stalled") + " == 1", n)
    stalled = f"count by (run) (\n{indent(stalled_ranks)}\n)"
    problem_query = (f'max by (problem) ({problem}{{run=%q,rank=%q,'
                     f'problem=~"missing|unresponsive|dead"}})').replace('"', '\\"')
    return Alert(
        "TrainingHangSuspect",
        f"(\n  max by (job, run, rank, rank_host, pid) (\n    {missing}\n  )\n"
        f"  unless on (run, rank)\n{indent(seen, 4)}\n"
        f"  unless on (run, rank)\n  (\n{indent(lost_ranks(n, window), 4)}\n  )\n)\n"
        f"and on (run)\n{stalled}",
        "critical", "The rank a stalled training run is waiting for.",
        fill("Rank [[$rank]][[of_run]] is the rank the others wait for: NCCL's RAS "
             "service on the other nodes reports it [[what]] (pid [[$pid]] on "
             "[[$rank_host]]), and no node agent reports it: its node is down or cut off "
             "from the network.",
             what=(f'{{{{ with printf "{problem_query}" $labels.run $labels.rank | query }}}}'
                   "{{ with first . }}{{ .Labels.problem }}{{ end }}{{ else }}missing"
                   "{{ end }}")),
        _training_dash(), cause="unreachable")


def collectives_behind(t: Selector, n: Selector, answering: Callable[[Selector, str], str],
                       in_own_phase: Callable[[Selector], str], outside_named: str) -> Alert:
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
    enqueued = "colossalai_training_collective_enqueued"
    both = f"{n(enqueued)}\n  or\n  {t(enqueued)}"
    furthest = f"max by (run, pg) (\n  {both}\n)"
    least = f"min by (run, pg) (\n  {both}\n)"

    def behind(sel: Selector) -> str:
        lower = (f"(\n  max without (op) (\n    {sel(enqueued)}\n  )\n"
                 f"  < on (run, pg) group_left ()\n{indent(furthest)}\n)")
        excluded = answering(sel, lower) + "\n" + in_own_phase(sel)
        # One alert per culprit, whatever the number of groups it is behind in (the
        # description lists them): its labels must not change between evaluations.
        return f"max without (pg, pg_ranks) (\n{indent(excluded)}\n)"

    def ahead(sel: Selector) -> str:
        return f"{sel(enqueued)}\n  > on (run, pg) group_left ()\n{indent(least)}"

    waits_somewhere = f"(\n{indent(ahead(n))}\nor\n{indent(ahead(t))}\n)"

    # Compared only once every stalled rank of the run that answers has said where its
    # collectives are: each rank publishes them when it sees its own stall, a moment
    # apart, and until the lowest member of a group has, a rank ahead of it there looks
    # behind only elsewhere (a 2x2 mesh paged a waiting rank so, for one evaluation).
    def unreported(sel: Selector) -> str:
        silent = (f"{sel('colossalai_training_stalled')} == 1\n"
                  f"unless on (job, instance, rank)\n  {sel(enqueued)}")
        return f"max by (run) (\n{indent(with_run(answering(sel, silent), sel))}\n)"

    incomplete = f"(\n{indent(unreported(n))}\nor\n{indent(unreported(t))}\n)"
    # The groups the rank is behind in (either view, each group once), and in each the
    # collective the others wait in.
    groups = (f"max by (pg, pg_ranks) ({enqueued}{{run=%q,rank=%q}}) < on (pg) group_left () "
              f"max by (pg) ({enqueued}{{run=%q}})").replace('"', '\\"')
    waited_in = f"topk(1, {enqueued}{{run=%q,pg=%q}})".replace('"', '\\"')
    behind_in = (
        f'{{{{ range $i, $g := printf "{groups}" $labels.run $labels.rank $labels.run '
        '| query | sortByLabel "pg" }}{{ if $i }}; {{ end }}in process group '
        "{{ $g.Labels.pg }} (ranks {{ $g.Labels.pg_ranks }}) it has enqueued collective "
        "#{{ $g.Value }}, and other "
        f'ranks wait in {{{{ with printf "{waited_in}" $labels.run $g.Labels.pg | query }}}}'
        "{{ with first . }}#{{ .Value }}{{ with .Labels.op }} ({{ . }}){{ end }}{{ end }}"
        "{{ else }}a later one{{ end }}{{ end }}")
    return Alert(
        "TrainingHangSuspect",
        f"(\n{indent(one_view_per_rank(behind, t, n))}\n)\nunless on (run, rank)\n"
        f"{waits_somewhere}\nunless on (run, rank)\n(\n{indent(outside_named)}\n)\n"
        f"unless on (run)\n{incomplete}",
        "critical", "The rank a stalled training run is waiting for.",
        fill("Rank [[$rank]][[of_run]] on [[$instance]] is the rank the others wait for: "
             "[[behind_in]]; it waits in no process group.[[last_error]]",
             behind_in=behind_in, last_error=_last_error()),
        _training_dash(), cause="collectives_behind")


def one_view_per_rank(build: Callable[[Selector], str], t: Selector, n: Selector) -> str:
    """``build``'s vector over series that carry ``run`` themselves, each rank of a run
    from one view: the node agent's, else the rank server's (see :func:`on_any_rank`,
    which joins ``run`` from the info instead: right for the present, wrong for a range
    over a day in which two runs used the same rank of a node)."""
    node = build(n)
    return f"{node}\nor\n(\n{indent(build(t))}\n  unless on (run, rank)\n{indent(node)}\n)"


def goodput(t: Selector, n: Selector, window: str) -> tuple[Recording, Recording, Recording]:
    """Goodput over ``window`` per run (docs/rules.md, "Goodput", defines it).

    Kept seconds of each rank over the window: what its checkpoints saved within it,
    plus what it has done since its last checkpoint if its process is alive, less
    what it had done since its last checkpoint when the window began (saved within
    the window, or lost). A restart resets both counters, which increase()
    handles; the work a crash loses is in neither term. The run's goodput is its
    ranks' mean kept seconds over the window, or over the run's age where it is
    younger (its first start within the window).

    The checkpointed seconds' increase over the window is recorded first, once for
    both views, and read three times by each view's kept seconds: over 24 h each
    increase() decodes a day of samples a rank, and PromQL computes a repeated
    subexpression again each time (bench/RESULTS.md, "Goodput over a day").
    """
    seconds = Duration.parse(window).seconds
    produced = "colossalai_training_productive_seconds_total"
    saved = "colossalai_training_checkpointed_seconds_total"
    start = "colossalai_training_start_timestamp_seconds"
    saved_increase = checkpointed_increase(window)

    def kept(sel: Selector) -> str:
        increase = sel(saved_increase)
        zero = f"0 * {increase}"  # a series without the term: 0, not no result
        return expr(f"""
            (
                {increase}
              +
                (
                    {sel(produced)} - {sel(saved)}
                    unless on (job, instance, rank) {sel("colossalai_rank_up")} == 0
                  or
                    {zero}
                )
              -
                (
                    {sel(produced)} offset {window} - {sel(saved)} offset {window}
                  or
                    {zero}
                )
            )
        """)

    per_rank = kept_seconds(window)
    live = on_any_rank(lambda sel: sel("colossalai_training_phase", NOT_FINISHED), t, n)
    ratio = expr(f"""
        clamp(
            sum by (run) ({per_rank})
          /
            count by (run) (count by (run, rank) ({per_rank}))
          /
            clamp_max(
              time() - min by (run) (min_over_time({t(start)}[{window}]) or min_over_time({n(start)}[{window}])),
              {number(seconds)}
            ),
          0, 1
        )
        and on (run)
          count by (run) (
{indent(live, 12)}
          )
    """)  # noqa: E501 - one selector a line reads better unbroken
    return (Recording(saved_increase, f"increase({n(saved)}[{window}])\nor\n"
                                      f"increase({t(saved)}[{window}])"),
            Recording(per_rank, one_view_per_rank(kept, t, n)),
            Recording(goodput_ratio(window), ratio))


def restart_loop(t: Selector, n: Selector, restarts: int, window: Duration) -> Alert:
    """A run whose ranks keep restarting and no checkpoint comes of it.

    A restart is a new start time of a rank's monitor (its process), counted on the
    series of its run. The run's busiest rank is taken: every rank restarts with its
    job, and a view that missed a start (a scrape between two) counts one fewer.
    """
    start = "colossalai_training_start_timestamp_seconds"
    last_success = "colossalai_checkpoint_last_success_timestamp_seconds"
    saved = on_any_rank(lambda sel: f"max_over_time({sel(last_success)}[{window}])", t, n)
    rule = expr(f"""
        max by (run) (
            changes({t(start)}[{window}])
          or
            changes({n(start)}[{window}])
        ) >= {restarts}
        unless on (run)
        (
          max by (run) (
{indent(saved, 12)}
          ) > time() - {number(window.seconds)}
        )
    """)
    # The run's earliest last error: the rank that failed first is the likeliest cause,
    # the others die of it (a peer gone from a collective, torchrun's SIGTERM).
    first_failed = ("bottomk(1, colossalai_training_last_error_timestamp_seconds "
                    "* on (job, instance, rank) group_left () max by (job, instance, rank) "
                    "(colossalai_training_info{run=%q}))")
    last_error = (
        '{{ with printf "colossalai_training_last_error_info and on (job, instance, rank) '
        + first_failed.replace('"', '\\"') + '" $labels.run | query }}{{ with first . }}'
        " First failure (rank {{ .Labels.rank }}, in {{ .Labels.where }}): "
        "{{ .Labels.type }}: {{ .Labels.message }}{{ end }}{{ end }}")
    return Alert(
        "TrainingRestartLoop", rule, "critical",
        "A training run keeps restarting without writing a checkpoint.",
        fill('Run [[$run]] restarted {{ $value | printf "%.0f" }} times in the last '
             "[[window]] and wrote no checkpoint meanwhile: each restart resumes from the "
             "same checkpoint and loses the work since, so the run makes no progress."
             "[[last_error]]", window=window, last_error=last_error))


def _budget() -> str:
    return query("colossalai_training_step_timeout_seconds", RANK, "value | humanizeDuration")


def training(config: RulesConfig) -> RuleFile:
    t = Selector(config.selectors.training)
    n = Selector(config.selectors.node)
    th = config.thresholds
    phase = "colossalai_training_phase"
    phase_start = t("colossalai_training_phase_start_timestamp_seconds")
    timeout = t("colossalai_training_step_timeout_seconds")

    recording = Group("colossalai-training.recording", (
        Recording(STEP_RATE, expr(f"""
            sum by (job, rank) (rate({t("colossalai_training_steps_total")}[5m]))
        """)),
        Recording(STEP_RATE_MEDIAN, f"quantile by (job) (0.5, {STEP_RATE})"),
        Recording(STEP_RATE_RATIO, f"{STEP_RATE} / on (job) group_left () {STEP_RATE_MEDIAN}"),
        Recording(STEP_MEAN, expr(f"""
              sum by (job, rank) (rate({t("colossalai_training_step_duration_seconds_sum")}[5m]))
            /
              sum by (job, rank) (rate({t("colossalai_training_step_duration_seconds_count")}[5m]))
        """)),
        # The share of time each rank waits for the others, from its monitor's samples of
        # the training thread (training/activity.py), on any rank, by run.
        # Only ranks training now and answering: a dead rank's counters stay served
        # (its last snapshot) and their rates would say it never waits.
        Recording(WAIT_SHARE, on_any_rank(lambda sel: (
            f"(\n  rate({sel('colossalai_training_waiting_samples_total')}[5m])\n  /\n"
            f"  rate({sel('colossalai_training_activity_samples_total')}[5m])\n)\n"
            f"and ignoring (phase) {sel(phase, TRAINING)} == 1\n"
            f"unless on (job, instance, rank) {sel('colossalai_rank_up')} == 0"), t, n)),
        Recording(WAIT_SHARE_MEDIAN, f"quantile by (run) (0.5, {WAIT_SHARE})"),
    ))

    def phase_over_budget(name: str, phases: tuple[str, ...], summary: str, what: str,
                          severity: str) -> Alert:
        matcher = phase_is(*phases)

        # From either view: a rank frozen with the GIL held (a checkpoint write into
        # a hung mount inside torch.save) cannot answer its own scrape; its last
        # snapshot still says which phase it is stuck in, and since when.
        def over_budget(sel: Selector) -> str:
            return expr(f"""
                (
                    time() - {sel("colossalai_training_phase_start_timestamp_seconds")}
                  > {sel("colossalai_training_step_timeout_seconds")}
                )
                * ignoring (phase) group_left (phase)
                  ({sel(phase, matcher)} == 1)
            """)

        return Alert(
            name, on_any_rank(over_budget, t, n), severity, summary,
            fill("Rank [[$rank]][[of_run]] on [[$instance]] has been in phase "
                 "[[$phase]] for {{ $value | humanizeDuration }}, beyond its budget of "
                 "[[budget]]: [[what]].[[last_error]]", budget=_budget(), what=what,
                 last_error=_last_error()),
            _training_dash())

    # A run with a stalled, failed or unanswering rank hangs or dies (the hang and
    # rank-down alerts'): its ranks' shares of time waiting say nothing about a
    # straggler then.
    stalled_runs = "count by (run) (\n" + indent(on_any_rank(
        lambda sel: (f"{sel('colossalai_training_stalled')} == 1\n"
                     f"or ignoring (phase) {sel(phase, FAILED)} == 1\n"
                     f"or {sel('colossalai_rank_up')} == 0"), t, n)) + "\n)"

    alerts = Group("colossalai-training.alerts", (
        Alert(
            "TrainingStalled",
            # Time in phase training without a step: since the last step, or since the
            # rank (re-)entered training (after start-up or a checkpoint), whichever is later.
            with_run(expr(f"""
                (
                  time()
                  - (
                      {t("colossalai_training_last_step_timestamp_seconds")} > {phase_start}
                    or
                      {phase_start}
                  )
                )
                > {timeout}
                and ignoring (phase)
                  {t(phase, TRAINING)} == 1
            """), t),
            "critical", "A training rank has made no step for longer than its step budget.",
            fill("Rank [[$rank]] of job [[$job]] ([[$instance]]) has made no training step "
                 "for {{ $value | humanizeDuration }} (step budget [[budget]]).[[where]]"
                 "[[reach]]",
                 budget=_budget(),
                 # Where its training thread is: the stalled function, when every rank
                 # stalls alike (no rank to name as the one the others wait for).
                 where=with_first("colossalai_training_activity_info", RANK,
                                  " It is in {{ .Labels.activity }} at {{ .Labels.frame }}."),
                 reach=_ranks_of_run("colossalai_training_stalled == 1",
                                     "rank(s) of this run are stalled.")),
            _training_dash()),
        *hang_suspects(t, n, th.node_lost_window),
        phase_over_budget(
            "TrainingStartupStuck", ("init", "kernels"),
            "A training rank is stuck in start-up (init or kernel build) beyond its budget.",
            "model set-up or a JIT kernel build that does not finish", "critical"),
        phase_over_budget(
            "CheckpointStuck", ("checkpointing",),
            "A checkpoint save has run longer than its budget.",
            "a checkpoint save that does not finish", "critical"),
        restart_loop(t, n, th.restart_loop_restarts, th.restart_loop_window),
        Alert(
            "CheckpointOverdue",
            # Before the first checkpoint the run's start (the rank server's process start)
            # stands in for the last success, so a run that never checkpoints fires too.
            expr(f"""
                (
                  time()
                  - (
                      {t("colossalai_checkpoint_last_success_timestamp_seconds")} > 0
                    or
                      ({t("colossalai_checkpoint_last_success_timestamp_seconds")} == 0)
                      + on (job, instance) group_left ()
                        {t("process_start_time_seconds")}
                  )
                )
                > {number(th.checkpoint_interval.seconds)}
                and ignoring (phase)
                  {t(phase, TRAINING)} == 1
            """),
            "warning", "No successful checkpoint for longer than the configured interval.",
            fill("Rank [[$rank]] of job [[$job]] ([[$instance]]) has had no successful "
                 "checkpoint for {{ $value | humanizeDuration }} while training (expected at "
                 "least every [[interval]]); last checkpointed step: [[step]].",
                 interval=th.checkpoint_interval,
                 step=query("colossalai_checkpoint_last_step", RANK, "value", otherwise="none")),
            _training_dash()),
        *rank_deaths(t, n, th.node_lost_window),
        Alert(
            "TrainingStraggler",
            f"{STEP_RATE_RATIO} < {number(th.straggler_ratio)}",
            "warning", "A training rank is much slower than the rest of its job.",
            fill("Rank [[$rank]] of job [[$job]] steps at {{ $value | humanizePercentage }} of "
                 "the job's median rate ([[median]] steps/s), below [[ratio]].",
                 median=query(STEP_RATE_MEDIAN, ("job",), 'value | printf "%.3g"'),
                 ratio=f"{th.straggler_ratio:.0%}"),
            _training_dash(), cause="step_rate"),
        Alert(
            "TrainingStraggler",
            # In a synchronous job every rank steps at the slowest one's rate: the
            # straggler is the rank that hardly waits while the others wait for it.
            expr(f"""
                {WAIT_SHARE}
                  < on (run) group_left ()
                    ({number(th.straggler_wait_ratio)} * {WAIT_SHARE_MEDIAN})
                and on (run)
                  ({WAIT_SHARE_MEDIAN} > {number(th.straggler_min_waiting)})
                and on (run)
                  (count by (run) ({WAIT_SHARE}) > 1)
            """) + f"\nunless on (run)\n{indent(stalled_runs)}",
            "warning", "A training rank is much slower than the rest of its job.",
            fill("Rank [[$rank]][[of_run]] on [[$instance]] is the rank the others wait for at "
                 "every step: it waits for them {{ $value | humanizePercentage }} of the time, "
                 "while the run's median rank waits [[median]] (in a synchronous job every "
                 "rank steps at the slowest one's rate).",
                 median=(f'{{{{ with printf "{WAIT_SHARE_MEDIAN}{{run=%q}}" $labels.run '
                         "| query }}{{ with first . }}{{ .Value | humanizePercentage }}"
                         "{{ end }}{{ end }}")),
            _training_dash(), cause="waits_least"),
        Alert(
            "GeminiOutOfMemory",
            events_on_any_rank("colossalai_gemini_oom_total", th.gemini_oom_window, t, n),
            "critical", "A training rank ran out of memory.",
            # The count is the counter itself, not the alert's value: increase()
            # extrapolates (one error read 1.89 the evaluation after it was scraped).
            fill("Rank [[$rank]][[of_run]] on [[$instance]] ran out of [[memory]]: [[count]] "
                 "out-of-memory error(s) since the rank started, the last within [[window]]."
                 "[[died]][[last_error]]",
                 count=query("colossalai_gemini_oom_total", (*RANK, "device"),
                             'value | printf "%.0f"'),
                 memory='{{ if eq $labels.device "cuda" }}GPU memory (CUDA){{ else if eq '
                        '$labels.device "cpu" }}host memory{{ else }}NVMe offload space'
                        "{{ end }}",
                 window=th.gemini_oom_window, last_error=_last_error(), died=_since_died()),
            _training_dash()),
        Alert(
            "CheckpointFailing",
            events_on_any_rank("colossalai_checkpoint_failures_total",
                               th.checkpoint_failure_window, t, n),
            "critical", "A checkpoint save raised an error.",
            fill("Rank [[$rank]][[of_run]] on [[$instance]]: [[count]] checkpoint save(s) failed "
                 "since the rank started, the last within [[window]].[[died]][[last_error]]",
                 count=query("colossalai_checkpoint_failures_total", RANK,
                             'value | printf "%.0f"'),
                 window=th.checkpoint_failure_window, last_error=_last_error(),
                 died=_since_died()),
            _training_dash()),
        Alert(
            "KernelBuildFailed",
            events_on_any_rank("colossalai_kernel_build_failures_total",
                               th.kernel_failure_window, t, n),
            "critical", "Loading or building a ColossalAI kernel failed.",
            fill("Rank [[$rank]][[of_run]] on [[$instance]]: [[count]] kernel load(s) or JIT "
                 "build(s) failed since the rank started, the last within [[window]].[[died]]"
                 "[[last_error]]",
                 count=query("colossalai_kernel_build_failures_total", RANK,
                             'value | printf "%.0f"'),
                 window=th.kernel_failure_window, last_error=_last_error(), died=_since_died()),
            _training_dash()),
        Alert(
            "KernelsNotReady",
            with_run(expr(f"""
                {t("colossalai_kernels_ready")} == 0
                unless ignoring (phase)
                  {t(phase, ENDED)} == 1
            """), t),
            "warning", "A training rank's ColossalAI kernels are not ready.",
            fill("Rank [[$rank]] of job [[$job]] ([[$instance]]) has reported its kernels not "
                 "ready for more than [[for]] (phase [[phase]]).",
                 phase=query(phase, RANK, 'label "phase"', extra=" == 1"),
                 **{"for": config.for_["KernelsNotReady"]}),
            _training_dash()),
        Alert(
            "TrainingHeartbeatFailing",
            expr(f"""
                  {t("colossalai_heartbeat_last_attempt_timestamp_seconds")}
                - {t("colossalai_heartbeat_last_success_timestamp_seconds")}
                > {number(th.heartbeat_failing_after.seconds)}
            """),
            "warning", "A training heartbeat ping has not succeeded for several periods.",
            fill("Heartbeat [[$heartbeat]] of rank [[$rank]] in job [[$job]] last succeeded "
                 "{{ $value | humanizeDuration }} before its last attempt; the heartbeat "
                 "service will report this run down although it may be healthy."),
            _training_dash(), cause="no_success"),
        Alert(
            "TrainingHeartbeatFailing",
            expr(f"""
                sum by (job, instance, rank, heartbeat) (
                  increase({t("colossalai_heartbeat_sends_total", 'result!="success"')}[{th.heartbeat_failing_after}])
                ) > 0
                unless
                sum by (job, instance, rank, heartbeat) (
                  increase({t("colossalai_heartbeat_sends_total", 'result="success"')}[{th.heartbeat_failing_after}])
                ) > 0
            """),  # noqa: E501 - one PromQL selector per line reads better unbroken
            "warning", "A training heartbeat ping has not succeeded for several periods.",
            fill('Heartbeat [[$heartbeat]] of rank [[$rank]] in job [[$job]]: '
                 '{{ $value | printf "%.0f" }} pings failed or were dropped in the last '
                 "[[window]] and none succeeded.", window=th.heartbeat_failing_after),
            _training_dash(), cause="sends_failing"),
    ))
    # Goodput needs no 15 s resolution, and at 4,096 ranks the 1 h group alone costs
    # 1.5-2 s an evaluation (bench/RESULTS.md, "Fleet").
    goodput_groups = tuple(
        Group(f"colossalai-training.goodput-{window}", goodput(t, n, window), interval=every)
        for window, every in GOODPUT_WINDOWS.items())
    return RuleFile("colossalai-training", (recording, *goodput_groups, alerts))


XID_EVENTS = "colossalai_gpu_xid_events_total"
def xid_action_words() -> str:
    """The alert's ``action`` label in words (a Go template chain)."""
    words = xid.actions()
    fallback = words.pop(xid.LOOK_UP)
    chain = "".join(f'{{{{ {"if" if i == 0 else "else if"} eq $labels.action "{key}" }}}}'
                    f"{text}" for i, (key, text) in enumerate(words.items()))
    return chain + "{{ else }}" + fallback + "{{ end }}"


def xid_ranks() -> str:
    """" Ranks on this GPU: 5." where the agent saw which ranks ran on the GPU (NVML's
    processes), else " Ranks of this run on the node: 0 1 2 3." for an alert with a
    ``run`` label."""
    on_gpu = "colossalai_gpu_rank_info{job=%q,instance=%q,gpu=%q}".replace('"', '\\"')
    on_node = "colossalai_training_info{job=%q,instance=%q,run=%q}".replace('"', '\\"')
    return ('{{ with printf "' + on_gpu + '" $labels.job $labels.instance $labels.gpu '
            '| query | sortByLabel "rank" }} Ranks on this GPU:{{ range . }} '
            "{{ .Labels.rank }}{{ end }}.{{ else }}"
            '{{ with $labels.run }}{{ with printf "' + on_node + '" $labels.job '
            '$labels.instance . | query | sortByLabel "rank" }} Ranks of this run on the '
            "node:{{ range . }} {{ .Labels.rank }}{{ end }}.{{ end }}{{ end }}{{ end }}")


def gpu_xids(n: Selector, th: Thresholds) -> tuple[Alert, ...]:
    """Xid events by the catalog's tier: critical pages, naming the GPU, what the code
    means, what to do and the ranks of the run on that node (it mutes their deaths,
    stalls and hangs, alertmanager.yml); warning tells; application-class codes only
    when they keep coming back on one GPU."""
    node_labels = ("job", "instance")
    critical = with_run(recent_events(n(XID_EVENTS, 'tier="critical"'), th.gpu_xid_window),
                        n, node_labels)
    recurring = n(XID_EVENTS, 'tier="application"')
    count, window = th.gpu_xid_recurring_count, th.gpu_xid_recurring_window
    return (
        Alert(
            "GPUXidCritical", critical, "critical",
            "A GPU reported an Xid error that needs the node drained.",
            fill("GPU [[$gpu]] on [[$instance]]: Xid [[$xid]], [[$what]] — [[action]]."
                 "[[ranks]]", action=xid_action_words(), ranks=xid_ranks()),
            _nodes_dash()),
        Alert(
            "GPUXidWarning",
            recent_events(n(XID_EVENTS, 'tier=~"warning|unknown"'), th.gpu_xid_window),
            "warning", "A GPU reported an Xid error to act on at the next drain.",
            fill("GPU [[$gpu]] on [[$instance]]: Xid [[$xid]], [[$what]] — [[action]].",
                 action=xid_action_words()),
            _nodes_dash()),
        Alert(
            "GPUXidRecurring",
            f"increase({recurring}[{window}]) >= {count}\nor\n"
            f"({recurring} >= {count} unless {recurring} offset {window})",
            "warning", "An application-class Xid keeps coming back on one GPU.",
            fill("GPU [[$gpu]] on [[$instance]]: Xid [[$xid]] ([[$what]]) {{ $value | "
                 'printf "%.0f" }} times in [[window]]. One job\'s bug raises it anywhere; '
                 "on one GPU again and again it points at the GPU: drain the node and run "
                 "the GPU's diagnostics (dcgmi diag -r 3).", window=window),
            _nodes_dash()),
    )


def node(config: RulesConfig) -> RuleFile:
    n = Selector(config.selectors.node)
    th = config.thresholds
    disk = ("job", "instance", "name", "path")

    recording = Group("colossalai-node.recording", (
        Recording(GPU_MEM_MAX, expr(f"""
            max by (job, instance) ({n("colossalai_gpu_memory_used_percent")})
        """)),
        Recording(HOST_MEM_AVAIL, expr(f"""
              100 * {n("colossalai_host_memory_available_bytes")}
            / {n("colossalai_host_memory_total_bytes")}
        """)),
    ))
    gpu = ("job", "instance", "gpu")
    alerts = Group("colossalai-node.alerts", (
        Alert(
            "GPUMemoryOOMRisk",
            f"{n('colossalai_gpu_memory_used_percent')} > {number(th.gpu_memory_used_percent)}",
            "warning", "A GPU's memory is almost full.",
            fill('GPU [[$gpu]] on [[$instance]] has {{ $value | printf "%.1f" }}% of its memory '
                 "in use ([[used]]B of [[total]]B), above [[limit]]% for [[for]].",
                 used=query("colossalai_gpu_memory_used_bytes", gpu, "value | humanize1024"),
                 total=query("colossalai_gpu_memory_total_bytes", gpu, "value | humanize1024"),
                 limit=number(th.gpu_memory_used_percent),
                 **{"for": config.for_["GPUMemoryOOMRisk"]}),
            _nodes_dash()),
        Alert(
            "HostMemoryOOMRisk",
            f"{HOST_MEM_AVAIL} < {number(th.host_memory_available_percent)}",
            "warning", "Host memory is almost exhausted.",
            fill('[[$instance]] has only {{ $value | printf "%.1f" }}% of its memory available '
                 "([[avail]]B), below [[limit]]% for [[for]].",
                 avail=query("colossalai_host_memory_available_bytes", ("job", "instance"),
                             "value | humanize1024"),
                 limit=number(th.host_memory_available_percent),
                 **{"for": config.for_["HostMemoryOOMRisk"]}),
            _nodes_dash()),
        Alert(
            "CheckpointDiskLow",
            # A broken path reports the free space of whatever is underneath (often the root
            # filesystem): DiskPathBroken covers it, this rule would only mislead.
            expr(f"""
                {n("colossalai_disk_free_bytes")} < {th.disk_free_bytes}
                and
                  {n("colossalai_disk_path_ok")} == 1
            """),
            "critical", "A checkpoint or offload disk is almost full.",
            fill("[[$name]] ([[$path]]) on [[$instance]] has {{ $value | humanize }}B free, "
                 "below [[limit]]: the next checkpoint or NVMe offload may fail.",
                 limit=si_bytes(th.disk_free_bytes)),
            _nodes_dash()),
        Alert(
            "CheckpointDiskLow",
            expr(f"""
                (
                    100 * {n("colossalai_disk_free_bytes")} / {n("colossalai_disk_total_bytes")}
                  < {number(th.disk_filling_free_percent)}
                )
                and
                  predict_linear({n("colossalai_disk_free_bytes")}[{th.disk_filling_lookback}], {number(th.disk_filling_horizon.seconds)}) < 0
                and
                  {n("colossalai_disk_path_ok")} == 1
            """),  # noqa: E501 - one PromQL selector per line reads better unbroken
            "warning", "A checkpoint or offload disk is almost full.",
            fill('[[$name]] ([[$path]]) on [[$instance]] has {{ $value | printf "%.1f" }}% free '
                 "and, at the rate of the last [[lookback]], fills up within [[horizon]].",
                 lookback=th.disk_filling_lookback, horizon=th.disk_filling_horizon),
            _nodes_dash(), for_=th.disk_filling_for),
        Alert(
            "DiskPathBroken",
            f"{n('colossalai_disk_path_ok')} == 0",
            "critical", "A checkpoint or NVMe offload path is missing, read-only or hung.",
            fill("[[$name]] ([[$path]]) on [[$instance]] is not usable: [[reason]].",
                 reason=query("colossalai_disk_path_failure_info", disk, 'label "reason"')),
            _nodes_dash()),
        Alert(
            "NCCLRendezvousDown",
            # Only while ranks run on the node: between runs nothing listens there.
            # The run label comes from the ranks live on the node, so a rendezvous that
            # closes because its run died (rank 0 hosted the store) pages only if a rank
            # still lives, and a cause alert of that run mutes it.
            expr(f"""
                (
                  {n("colossalai_nccl_up")} == 0
                )
                * on (job, instance) group_left (run)
                  max by (job, instance, run) (
                    {n(INFO)}
                    * on (job, instance, rank) group_left ()
                      ({n("colossalai_rank_up")} == 1)
                  )
            """),
            "critical", "The rendezvous endpoint of a running job is unreachable.",
            fill("[[$instance]] cannot reach the rendezvous endpoint [[$target]] ([[reason]]) "
                 "while training ranks run there.",
                 reason=query("colossalai_nccl_failure_info", ("job", "instance", "target"),
                              'label "reason"')),
            _nodes_dash()),
        Alert(
            "GPUCollectorDown",
            n("colossalai_exporter_collector_up", 'collector="gpu"') + " == 0",
            "warning", "The node agent cannot read its GPUs.",
            fill("The GPU collector on [[$instance]] has failed for [[for]] ([[reason]]); GPU "
                 "memory alerts are blind on this node.",
                 reason=query("colossalai_exporter_collector_failure_info",
                              ("job", "instance", "collector"), 'label "reason"'),
                 **{"for": config.for_["GPUCollectorDown"]}),
            _nodes_dash()),
        *gpu_xids(n, th),
    ))
    return RuleFile("colossalai-node", (recording, alerts))


def chat(config: RulesConfig) -> RuleFile:
    p = Selector(config.selectors.probe)
    th = config.thresholds
    target = ("job", "instance")
    alerts = Group("colossalai-chat.alerts", (
        Alert(
            "ChatServerDown",
            # An engine error has its own, more precise alert.
            expr(f"""
                {p("probe_success")} == 0
                unless on (job, instance)
                  {p("probe_failure_info", 'reason="engine_error"')}
            """),
            "critical", "A chat or inference server does not answer its probe.",
            fill("Probes of [[$instance]] have failed for [[for]]: [[reason]] (HTTP status "
                 "[[status]]).",
                 reason=query("probe_failure_info", target, 'label "reason"'),
                 status=query("probe_http_status_code", target, "value"),
                 **{"for": config.for_["ChatServerDown"]}),
            _chat_dash()),
        Alert(
            "ChatEngineError",
            p("probe_failure_info", 'reason="engine_error"') + " == 1",
            "critical", "An inference server answers but its engine reports Error.",
            fill("[[$instance]] answers HTTP 200 but its inference engine reports Error "
                 "(/engine_check) for [[for]].", **{"for": config.for_["ChatEngineError"]}),
            _chat_dash()),
        Alert(
            "ChatLatencyHigh",
            expr(f"""
                {p("probe_duration_seconds")} > {number(th.chat_latency_seconds)}
                and
                  {p("probe_success")} == 1
            """),
            "warning", "A chat or inference server answers slowly.",
            fill("Probes of [[$instance]] take {{ $value | humanizeDuration }}, above [[limit]]s "
                 "for [[for]].", limit=number(th.chat_latency_seconds),
                 **{"for": config.for_["ChatLatencyHigh"]}),
            _chat_dash()),
    ))
    return RuleFile("colossalai-chat", (alerts,))


def pipeline(config: RulesConfig) -> RuleFile:
    b = Selector(config.selectors.bridge)
    th = config.thresholds
    # Any target of the project's own servers that Prometheus cannot scrape (node agents,
    # the prober's /probe targets, the bridge), deployed or not by this site's choice;
    # a job that must exist and has no target at all only where expected_jobs says so
    # (a training-only site deploys no prober: its absence is not news).
    scraped = dict.fromkeys(Selector(sel)("up") for sel in (
        config.selectors.node, config.selectors.probe, config.selectors.bridge))
    exporter_down = [Alert(
        "ExporterDown",
        "\nor\n".join(f"{up} == 0" for up in scraped),
        "warning", "Prometheus cannot scrape a colossalai-exporter target.",
        fill("Prometheus has failed to scrape [[$instance]] of job [[$job]] for [[for]]: "
             "alerts that depend on it are blind.",
             **{"for": config.for_["ExporterDown"]}),
        cause="target_down")]
    if config.expected_jobs:
        exporter_down.append(Alert(
            "ExporterDown",
            "\nor\n".join(f'absent(up{{job="{job}"}})' for job in config.expected_jobs),
            "warning", "Prometheus cannot scrape a colossalai-exporter target.",
            fill("Prometheus has no target for job [[$job]] (service discovery or scrape "
                 "config): alerts that depend on it are blind."),
            cause="absent"))
    target = ("job", "instance", "target")
    alerts = Group("colossalai-pipeline.alerts", (
        *exporter_down,
        Alert(
            "BridgeDeliveryFailing",
            expr(f"""
                time() - {b("colossalai_bridge_last_success_timestamp_seconds")}
                > {number(th.bridge_no_success_after.seconds)}
                and
                  {b("colossalai_bridge_queue_depth")} > 0
            """),
            "critical", "The bridge cannot deliver to a heartbeat or webhook target.",
            fill("The bridge has [[depth]] deliveries pending for target [[$target]] and no "
                 "success for {{ $value | humanizeDuration }}.",
                 depth=query("colossalai_bridge_queue_depth", target, "value")),
            None, cause="no_success"),
        Alert(
            "BridgeDeliveryFailing",
            expr(f"""
                increase({b("colossalai_bridge_dead_letters_total")}[{th.bridge_dead_letter_window}])
                > 0
            """),
            "critical", "The bridge cannot deliver to a heartbeat or webhook target.",
            fill('The bridge gave up on {{ $value | printf "%.0f" }} deliveries to target '
                 "[[$target]] in the last [[window]] (dead letters).",
                 window=th.bridge_dead_letter_window),
            None, cause="dead_letters"),
        Alert(
            "BridgeQueueBacklog",
            expr(f"""
                {b("colossalai_bridge_oldest_pending_age_seconds")}
                > {number(th.bridge_oldest_pending_age.seconds)}
            """),
            "warning", "Deliveries are piling up in the bridge.",
            fill("The oldest of [[depth]] pending deliveries to target [[$target]] is "
                 "{{ $value | humanizeDuration }} old (threshold [[limit]]).",
                 depth=query("colossalai_bridge_queue_depth", target, "value"),
                 limit=th.bridge_oldest_pending_age),
            None),
        Alert(
            "Watchdog",
            "vector(1)",
            "info", "The alerting pipeline's dead man's switch (always firing).",
            "This alert always fires. Alertmanager sends it to the bridge every minute and the "
            "bridge pings a heartbeat; when the pings stop, something between Prometheus, "
            "Alertmanager, the bridge and the heartbeat service is broken."),
    ))
    return RuleFile("colossalai-pipeline", (alerts,))


def build(config: RulesConfig) -> tuple[RuleFile, ...]:
    """Every rule file, in the order they are written."""
    return (training(config), node(config), chat(config), pipeline(config))


def alert_names() -> set[str]:
    """Names of every alert (the keys ``for`` must have)."""
    return set(ALERT_NAMES)


ALERT_NAMES = (
    "TrainingStalled", "TrainingHangSuspect", "TrainingStartupStuck", "CheckpointStuck",
    "CheckpointOverdue", "TrainingRestartLoop", "TrainingRankDown", "TrainingRankOOMKilled",
    "TrainingNodeLost", "TrainingStraggler",
    "GeminiOutOfMemory",
    "CheckpointFailing", "KernelBuildFailed", "KernelsNotReady",
    "TrainingHeartbeatFailing", "GPUMemoryOOMRisk", "HostMemoryOOMRisk", "CheckpointDiskLow",
    "DiskPathBroken", "NCCLRendezvousDown", "GPUCollectorDown", "GPUXidCritical",
    "GPUXidWarning", "GPUXidRecurring", "ChatServerDown",
    "ChatEngineError", "ChatLatencyHigh", "ExporterDown", "BridgeDeliveryFailing",
    "BridgeQueueBacklog", "Watchdog",
)
