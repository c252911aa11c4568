"""Every alerting and recording rule: the four rule files, and the names of their alerts.

Each rule file is built by a module of its own: training.py (from the alert
families in training_*.py), node.py (with gpu.py), chat.py, engines.py (optional:
the inference servers' own queues) and pipeline.py;
shared selectors and helpers are in common.py. This module puts the files in the
order they are written and lists the alerts: every name (the keys ``for`` must
have, read from what the shipped config builds), and which are causes and which
consequences, by which
deploy/alertmanager/alertmanager.yml mutes one under the other. It also
re-exports the recording rules' names the dashboards and tests read.
"""

from __future__ import annotations

import functools

from colossalai_exporter import checkout
from colossalai_exporter.rulesgen import config as rules_config
from colossalai_exporter.rulesgen.chat import chat
from colossalai_exporter.rulesgen.common import INFO
from colossalai_exporter.rulesgen.config import RulesConfig
from colossalai_exporter.rulesgen.engines import engines
from colossalai_exporter.rulesgen.model import Alert, RuleFile
from colossalai_exporter.rulesgen.node import GPU_MEM_MAX, HOST_MEM_AVAIL, node
from colossalai_exporter.rulesgen.pipeline import pipeline
from colossalai_exporter.rulesgen.training import training
from colossalai_exporter.rulesgen.training_goodput import (
    GOODPUT_WINDOWS,
    checkpointed_increase,
    goodput_ratio,
    kept_seconds,
)
from colossalai_exporter.rulesgen.training_pace import (
    STEP_HISTOGRAM,
    STEP_MEAN,
    STEP_RATE,
    STEP_RATE_MEDIAN,
    STEP_RATE_RATIO,
    WAIT_SHARE,
    WAIT_SHARE_MEDIAN,
)

__all__ = [
    "CAUSE_ALERTS", "CONSEQUENCE_ALERTS", "GENERAL_CAUSE_ALERTS",
    "GOODPUT_WINDOWS", "GPU_MEM_MAX", "HOST_MEM_AVAIL", "INFO", "RANK_KILLING_ALERTS",
    "SPECIFIC_CAUSE_ALERTS",
    "STEP_HISTOGRAM", "STEP_MEAN", "STEP_RATE", "STEP_RATE_MEDIAN", "STEP_RATE_RATIO", "WAIT_SHARE",
    "WAIT_SHARE_MEDIAN", "alert_names", "build", "checkpointed_increase", "goodput_ratio",
    "kept_seconds",
]

# The alerts that name the cause of a failure. In deploy/alertmanager/alertmanager.yml
# each mutes, for its run, the alerts that follow from it (docs/rules.md, "One incident,
# one page").
# The rank a hang waits for (TrainingHangSuspect) is a cause to the stalls and the
# rank-down it explains, and itself follows from a named cause (a checkpoint stuck in
# torch.save leaves that rank outside any collective while the others wait).
SPECIFIC_CAUSE_ALERTS = ("GeminiOutOfMemory", "KernelBuildFailed", "CheckpointFailing",
                         "CheckpointStuck", "CompileStuck", "EvaluationStuck",
                         "DataStartStuck", "TrainingRankOOMKilled", "TrainingNodeLost",
                         "GPUXidCritical", "GPURecoveryActionRequired", "GPURowRemapFailure",
                         "GPUNVLinkDown", "GPUEccUncorrectable", "InfiniBandPortDown",
                         "InfiniBandPortsMissing")
# Causes named from the outside (who a hang waits for; a run that keeps restarting): they
# explain the stalls and rank-downs that follow, and a specific cause explains them.
GENERAL_CAUSE_ALERTS = ("TrainingHangSuspect", "TrainingRestartLoop")
CAUSE_ALERTS = (*SPECIFIC_CAUSE_ALERTS, *GENERAL_CAUSE_ALERTS)
# Causes that end ranks from outside: the ranks left wait for the dead one, in a
# checkpoint's collective too, so a CheckpointStuck of their run follows from them.
RANK_KILLING_ALERTS = ("TrainingRankOOMKilled", "TrainingNodeLost", "GPUXidCritical",
                       "GPURecoveryActionRequired", "GPURowRemapFailure", "GPUNVLinkDown",
                       "GPUEccUncorrectable", "InfiniBandPortDown", "InfiniBandPortsMissing")
CONSEQUENCE_ALERTS = ("TrainingRankDown", "TrainingStalled", "NCCLRendezvousDown",
                      "TrainingStartupStuck", "KernelsNotReady")


def build(config: RulesConfig) -> tuple[RuleFile, ...]:
    """Every rule file, in the order they are written."""
    return (training(config), node(config), chat(config), engines(config), pipeline(config))


@functools.cache
def alert_names() -> frozenset[str]:
    """Names of every alert (the keys ``for`` must have in a rules config): the alerting
    rules the shipped rules/config.yml builds. A new alert in a family module is all it
    takes, with its ``for`` in rules/config.yml (without it, building names the key)."""
    shipped = rules_config.load(checkout.rules_config())
    return frozenset(rule.name for file in build(shipped) for group in file.groups
                     for rule in group.rules if isinstance(rule, Alert))
