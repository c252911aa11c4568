"""The node rule file (rules/colossalai-node.rules.yml): what the node agent sees of its host.

GPU and host memory running out, checkpoint and offload disks filling up or
broken, the rendezvous endpoint of a running job unreachable, the agent blind to
its GPUs, and the GPUs' Xid errors (gpu.py). Each is about one node, so the
alerts link the nodes dashboard.
"""

from __future__ import annotations

from colossalai_exporter.rulesgen.common import INFO, NODE_RUN, RANK_UP, node_runs, nodes_dashboard
from colossalai_exporter.rulesgen.config import Duration, RulesConfig, Thresholds
from colossalai_exporter.rulesgen.fabric import Ports, fabric
from colossalai_exporter.rulesgen.gpu import gpu_health, gpu_xids
from colossalai_exporter.rulesgen.model import Alert, Group, Recording, RuleFile
from colossalai_exporter.rulesgen.promql import (
    Selector,
    expr,
    fill,
    first_sample,
    number,
    query,
    si_bytes,
)
from colossalai_exporter.rulesgen.training_stalls import REPORTED_RANKS
from colossalai_exporter.rulesgen.verdict import verdict_group

# Recording rules the dashboards use.
GPU_MEM_MAX = "instance:colossalai_gpu_memory_used_percent:max"
HOST_MEM_AVAIL = "instance:colossalai_host_memory_available_bytes:percent"


def node(config: RulesConfig) -> RuleFile:
    """Recording rules, then every node alert."""
    node_agents = Selector(config.selectors.node)
    thresholds = config.thresholds
    recording = Group("colossalai-node.recording", (
        Recording(GPU_MEM_MAX, expr(f"""
            max by (job, instance) ({node_agents("colossalai_gpu_memory_used_percent")})
        """)),
        Recording(HOST_MEM_AVAIL, expr(f"""
              100 * {node_agents("colossalai_host_memory_available_bytes")}
            / {node_agents("colossalai_host_memory_total_bytes")}
        """)),
    ))
    alerts = Group("colossalai-node.alerts", (
        # First, so that the GPU causes after it read this evaluation's (as the
        # training alerts' RANK_RUN).
        Recording(NODE_RUN, node_runs(node_agents)),
        *memory_running_out(node_agents, thresholds, config.for_),
        *disks(node_agents, thresholds),
        rendezvous_down(node_agents),
        gpu_collector_down(node_agents, config.for_["GPUCollectorDown"]),
        *rank_state_unreadable(node_agents, config.for_["RankStateUnreadable"]),
        *gpu_xids(node_agents, thresholds),
        *gpu_health(node_agents, config),
    ))
    return RuleFile("colossalai-node", (recording, alerts, fabric(config),
                                        verdict_group(Ports(config))))


def memory_running_out(node_agents: Selector, thresholds: Thresholds,
                       windows: dict[str, Duration]) -> tuple[Alert, Alert]:
    """GPUMemoryOOMRisk and HostMemoryOOMRisk; ``windows`` are the ``for`` windows their
    descriptions state."""
    gpu = ("job", "instance", "gpu")
    gpu_limit = number(thresholds.gpu_memory_used_percent)
    host_limit = number(thresholds.host_memory_available_percent)
    return (
        Alert(
            "GPUMemoryOOMRisk",
            f"{node_agents('colossalai_gpu_memory_used_percent')} > {gpu_limit}",
            "warning", "A GPU's memory is almost full.",
            fill('GPU [[$gpu]] on [[$instance]] has {{ $value | printf "%.1f" }}% of its memory '
                 "in use ([[used]]B of [[total]]B), above [[limit]]% for [[for]].",
                 used=query("colossalai_gpu_memory_used_bytes", gpu, "value | humanize1024"),
                 total=query("colossalai_gpu_memory_total_bytes", gpu, "value | humanize1024"),
                 limit=gpu_limit, **{"for": windows["GPUMemoryOOMRisk"]}),
            nodes_dashboard()),
        Alert(
            "HostMemoryOOMRisk",
            f"{HOST_MEM_AVAIL} < {host_limit}",
            "warning", "Host memory is almost exhausted.",
            fill('[[$instance]] has only {{ $value | printf "%.1f" }}% of its memory available '
                 "([[avail]]B), below [[limit]]% for [[for]].",
                 avail=query("colossalai_host_memory_available_bytes", ("job", "instance"),
                             "value | humanize1024"),
                 limit=host_limit, **{"for": windows["HostMemoryOOMRisk"]}),
            nodes_dashboard()),
    )


def disks(node_agents: Selector, thresholds: Thresholds) -> tuple[Alert, Alert, Alert]:
    """CheckpointDiskLow (almost full; filling up fast) and DiskPathBroken."""
    disk = ("job", "instance", "name", "path")
    free = node_agents("colossalai_disk_free_bytes")
    path_ok = node_agents("colossalai_disk_path_ok")
    horizon = number(thresholds.disk_filling_horizon.seconds)
    return (
        Alert(
            "CheckpointDiskLow",
            # A broken path reports the free space of whatever is underneath (often the root
            # filesystem): DiskPathBroken covers it, this rule would only mislead.
            expr(f"""
                {free} < {thresholds.disk_free_bytes}
                and
                  {path_ok} == 1
            """),
            "critical", "A checkpoint or offload disk is almost full.",
            fill("[[$name]] ([[$path]]) on [[$instance]] has {{ $value | humanize }}B free, "
                 "below [[limit]]: the next checkpoint or NVMe offload may fail.",
                 limit=si_bytes(thresholds.disk_free_bytes)),
            nodes_dashboard()),
        Alert(
            "CheckpointDiskLow",
            expr(f"""
                (
                    100 * {free} / {node_agents("colossalai_disk_total_bytes")}
                  < {number(thresholds.disk_filling_free_percent)}
                )
                and
                  predict_linear({free}[{thresholds.disk_filling_lookback}], {horizon}) < 0
                and
                  {path_ok} == 1
            """),
            "warning", "A checkpoint or offload disk is almost full.",
            fill('[[$name]] ([[$path]]) on [[$instance]] has {{ $value | printf "%.1f" }}% free '
                 "and, at the rate of the last [[lookback]], fills up within [[horizon]].",
                 lookback=thresholds.disk_filling_lookback,
                 horizon=thresholds.disk_filling_horizon),
            nodes_dashboard(), for_=thresholds.disk_filling_for),
        Alert(
            "DiskPathBroken",
            f"{path_ok} == 0",
            "critical", "A checkpoint or NVMe offload path is missing, read-only or hung.",
            fill("[[$name]] ([[$path]]) on [[$instance]] is not usable: [[reason]].",
                 reason=query("colossalai_disk_path_failure_info", disk, 'label "reason"')),
            nodes_dashboard()),
    )


def rendezvous_down(node_agents: Selector) -> Alert:
    """NCCLRendezvousDown, only while ranks run on the node: between runs nothing listens
    there.

    The run label comes from the ranks live on the node, so a rendezvous that closes
    because its run died (rank 0 hosted the store) pages only if a rank still lives, and
    a cause alert of that run mutes it. When fewer of the run's ranks have reported than
    its world size, the description says so: the endpoint's node, the master's, never
    came up with its ranks, and this page mutes TrainingRanksMissing, which says less.
    """
    short = first_sample(
        f"{REPORTED_RANKS}{{run=%q}}", "$labels.run",
        '{{ if ne .Labels.world_size (printf "%.0f" .Value) }} Only {{ .Value | printf "%.0f" '
        '}} of the run\'s {{ .Labels.world_size }} ranks have reported: the endpoint\'s node '
        "may never have come up, with the ranks that run there.{{ end }}")
    return Alert(
        "NCCLRendezvousDown",
        expr(f"""
            (
              {node_agents("colossalai_nccl_up")} == 0
            )
            * on (job, instance) group_left (run)
              max by (job, instance, run) (
                {node_agents(INFO)}
                * on (job, instance, rank) group_left ()
                  ({node_agents(RANK_UP)} == 1)
              )
        """),
        "critical", "The rendezvous endpoint of a running job is unreachable.",
        fill("[[$instance]] cannot reach the rendezvous endpoint [[$target]] ([[reason]]) "
             "while training ranks run there.",
             reason=query("colossalai_nccl_failure_info", ("job", "instance", "target"),
                          'label "reason"')) + short,
        nodes_dashboard())


# What the node agent's reads of rank snapshots that it cannot trust mean, by reason
# (node/ranks.py, colossalai_rank_snapshot_errors_total), and what fixes each.
_UNTRUSTED = (
    '{{ if eq $labels.reason "shared" }}two live runs write the same ranks\' snapshots '
    "in turn (two jobs on this node publishing into one run directory): each such rank's "
    "series flip between the runs, and a rank of either that dies or hangs is not seen. "
    "Give each job its own COLOSSALAI_EXPORTER_RUN_DIR, read by a node agent of its own"
    '{{ else if eq $labels.reason "version" }}written by a newer TrainingMonitor than '
    "this node agent reads. Upgrade the node agent"
    '{{ else if eq $labels.reason "unreadable" }}an I/O error reading them'
    "{{ else }}not a snapshot this agent can use (truncated, edited, another program's "
    "file){{ end }}")


def rank_state_unreadable(node_agents: Selector, window: Duration) -> tuple[Alert, Alert]:
    """RankStateUnreadable: the agent cannot read its run directory (its ranks collector
    fails), or reads rank snapshots it cannot trust, for ``window``. Either way the
    training alerts that read the agent's view of those ranks are blind: a rank that
    dies or hangs there is not named, or another run's rank stands in for it."""
    why = "Training alerts for the ranks concerned are blind on this node."
    return (
        Alert(
            "RankStateUnreadable",
            node_agents("colossalai_exporter_collector_up", 'collector="ranks"') + " == 0",
            "warning", "The node agent cannot see its training ranks.",
            fill("The node agent on [[$instance]] has not read its run directory for [[for]] "
                 "([[reason]]): none of its training ranks' state is served. " + why,
                 reason=query("colossalai_exporter_collector_failure_info",
                              ("job", "instance", "collector"), 'label "reason"'),
                 **{"for": window}),
            nodes_dashboard(), cause="collector"),
        Alert(
            "RankStateUnreadable",
            f"increase({node_agents('colossalai_rank_snapshot_errors_total')}[5m]) > 0",
            "warning", "The node agent cannot see its training ranks.",
            fill("Reads of rank snapshots on [[$instance]] could not be trusted for [[for]] "
                 "([[$reason]]): " + _UNTRUSTED + ". " + why, **{"for": window}),
            nodes_dashboard(), cause="snapshots"),
    )


def gpu_collector_down(node_agents: Selector, window: Duration) -> Alert:
    """GPUCollectorDown: the agent cannot read its GPUs for ``window`` (the ``for``)."""
    return Alert(
        "GPUCollectorDown",
        node_agents("colossalai_exporter_collector_up", 'collector="gpu"') + " == 0",
        "warning", "The node agent cannot read its GPUs.",
        fill("The GPU collector on [[$instance]] has failed for [[for]] ([[reason]]); GPU "
             "memory alerts are blind on this node.",
             reason=query("colossalai_exporter_collector_failure_info",
                          ("job", "instance", "collector"), 'label "reason"'),
             **{"for": window}),
        nodes_dashboard())
