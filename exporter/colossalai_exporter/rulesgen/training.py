"""The training rule file (rules/colossalai-training.rules.yml), assembled from its families.

Each family of alerts lives in a module of its own (training_*.py); this one
only orders them into the file's groups. The order is the rule file's, which
``rules --check`` holds to the committed files: change it only on purpose.
Descriptions carry the numbers an on-call engineer needs; where a number is not
the alert's value, the template queries it (``promql.query``).
"""

from __future__ import annotations

from colossalai_exporter.rulesgen.common import (
    AGENT_RANKS,
    AGENT_SERVED_RANKS,
    DOWN_RANKS,
    LOST_RANKS,
    RANK_RUN,
    STALLED_RANKS,
    TROUBLED_RUN,
    agent_ranks,
    agent_served_ranks,
    down_ranks_rule,
    lost_ranks,
    rank_runs,
    stalled_ranks_rule,
    troubled_runs,
)
from colossalai_exporter.rulesgen.config import RulesConfig
from colossalai_exporter.rulesgen.model import Group, Recording, RuleFile
from colossalai_exporter.rulesgen.promql import Selector
from colossalai_exporter.rulesgen.training_deaths import rank_deaths
from colossalai_exporter.rulesgen.training_errors import kernels_not_ready, rank_errors
from colossalai_exporter.rulesgen.training_goodput import (
    checkpoint_overdue,
    goodput_groups,
    restart_loop,
)
from colossalai_exporter.rulesgen.training_hangs import hang_suspects
from colossalai_exporter.rulesgen.training_heartbeats import heartbeats_failing
from colossalai_exporter.rulesgen.training_pace import recording, stragglers
from colossalai_exporter.rulesgen.training_stalls import (
    ANSWERED_SERVERS,
    BUSY_RUNS,
    REPORTED_RANKS,
    UNSTARTED_RUNS,
    answered_servers,
    busy_runs,
    checkpoint_stuck,
    compile_stuck,
    data_start_stuck,
    evaluation_stuck,
    never_started,
    ranks_missing,
    reported_ranks,
    stalled,
    startup_stuck,
    unstarted_runs,
)


def training(config: RulesConfig) -> RuleFile:
    """Recording rules, then goodput's groups, then every training alert."""
    rank_servers = Selector(config.selectors.training)
    node_agents = Selector(config.selectors.node)
    thresholds = config.thresholds
    alerts = Group("colossalai-training.alerts", (
        # First, so that every alert after it reads this evaluation's (a group's rules
        # run in order, each seeing what the ones before it recorded): a rank that
        # appears with an out-of-memory error already counted pages at once.
        Recording(RANK_RUN, rank_runs(rank_servers, node_agents)),
        Recording(AGENT_RANKS, agent_ranks(node_agents)),
        Recording(AGENT_SERVED_RANKS, agent_served_ranks(rank_servers)),
        # What many alerts read of every rank, each once (common.py, DOWN_RANKS).
        Recording(DOWN_RANKS, down_ranks_rule(rank_servers, node_agents)),
        Recording(STALLED_RANKS, stalled_ranks_rule(rank_servers, node_agents)),
        Recording(TROUBLED_RUN, troubled_runs()),
        Recording(LOST_RANKS, lost_ranks(node_agents, thresholds.node_lost_window)),
        Recording(BUSY_RUNS, busy_runs(rank_servers, node_agents)),
        Recording(REPORTED_RANKS, reported_ranks()),
        Recording(UNSTARTED_RUNS, unstarted_runs(rank_servers, node_agents)),
        stalled(rank_servers, node_agents),
        *hang_suspects(rank_servers, node_agents, thresholds.hang_after_timeout_for),
        ranks_missing(node_agents),
        startup_stuck(rank_servers, node_agents),
        checkpoint_stuck(rank_servers, node_agents),
        compile_stuck(rank_servers, node_agents),
        data_start_stuck(rank_servers, node_agents),
        evaluation_stuck(rank_servers, node_agents),
        *rank_deaths(rank_servers, node_agents, thresholds.node_lost_window),
        *rank_errors(rank_servers, node_agents, thresholds),
    ))
    # The alerts whose minutes do not matter (an hour's restarts, warnings that wait 5
    # to 15 minutes), at their own interval. They read the rank sets the group above
    # records, as of its last evaluation (at most one interval older).
    slow = Group("colossalai-training.slow-alerts", (
        restart_loop(rank_servers, node_agents, thresholds),
        checkpoint_overdue(rank_servers, thresholds.checkpoint_interval),
        *stragglers(rank_servers, node_agents, thresholds),
        kernels_not_ready(rank_servers, config.for_["KernelsNotReady"]),
        Recording(ANSWERED_SERVERS, answered_servers(rank_servers)),
        never_started(rank_servers, node_agents, thresholds.training_never_started_after),
        *heartbeats_failing(rank_servers, thresholds.heartbeat_failing_after),
    ), interval=str(thresholds.training_slow_evaluation_interval))
    return RuleFile("colossalai-training", (
        recording(rank_servers, node_agents, str(thresholds.training_slow_evaluation_interval)),
        *goodput_groups(rank_servers, node_agents),
        alerts,
        slow,
    ))
