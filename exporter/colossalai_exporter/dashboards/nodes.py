"""ColossalAI nodes: GPUs, host memory, disks, rendezvous, the fabric, collectors.

Variables ``job`` and ``instance`` match the node alerts' links; ``gpu``
narrows the GPU panels. The job list comes from the rules' node selector.
"""

from __future__ import annotations

from colossalai_exporter.dashboards import variables
from colossalai_exporter.dashboards.dashboard import Dashboard
from colossalai_exporter.dashboards.model import (
    Query,
    Row,
    Step,
    ValueText,
    ok_bad,
    stat,
    state_timeline,
    table,
    timeseries,
)
from colossalai_exporter.rulesgen import fabric, rules, verdict
from colossalai_exporter.rulesgen.config import RulesConfig
from colossalai_exporter.rulesgen.promql import Selector, number, si_bytes

UID = "colossalai-nodes"

# Time to full is shown up to this; beyond it (or a disk not filling) reads as the cap.
TIME_TO_FULL_CAP_SECONDS = 30 * 86400

N = Selector('job=~"$job", instance=~"$instance"')
G = Selector('job=~"$job", instance=~"$instance", gpu=~"$gpu"')


def status_row(config: RulesConfig) -> Row:
    limit = config.thresholds.gpu_memory_used_percent
    return Row("Status", (
        table("Firing alerts",
              "Alerts firing now for the selected nodes (Prometheus' ALERTS series).",
              Query('ALERTS{alertstate="firing", job=~"$job", instance=~"$instance"}',
                    table=True), w=12, h=7),
        stat("Agents scraped", "Prometheus' up for each node agent.",
             Query(N("up"), "{{instance}}"), w=4, h=7,
             thresholds=(Step("red"), Step("green", 1)), mappings=ok_bad()),
        stat("GPUs seen", "GPUs NVML reports on each node.",
             Query(N("colossalai_gpu_devices"), "{{instance}}"), w=4, h=7),
        stat("Fullest GPU per node",
             "The highest GPU memory use on each node (recording rule).",
             Query(N(rules.GPU_MEM_MAX), "{{instance}}"), w=4, h=7, unit="percent",
             thresholds=(Step("green"), Step("red", limit))),
    ))


def verdict_row() -> Row:
    # The verdict is recorded by node (the instance without its port), for the whole
    # fleet: the panels show the nodes that are not passing, whichever are selected.
    levels = (ValueText("0", "pass", "green"), ValueText("1", "warn", "orange"),
              ValueText("2", "critical", "red"))
    return Row("Hardware verdict (every node)", (
        state_timeline("Subsystems not passing",
                       "Each node's GPUs, NVLink and fabric that are not passing: warn (a "
                       "warning alert fires) or critical (a critical one does), from the "
                       "hardware alerts firing (recording rule; record-only alerts are "
                       "left out).",
                       Query(f"{verdict.VERDICT} > 0", "{{node}} {{subsystem}}"),
                       w=14, mappings=levels),
        table("What each node needs",
              "The most its firing hardware alerts ask for: restart the job, reset a GPU, "
              "reboot, drain for service, replace a part (the pages' last words); nodes "
              "that need nothing are left out.",
              Query(f"{verdict.REMEDY} > 0", table=True), w=10),
    ))


def gpu_row(config: RulesConfig) -> Row:
    limit = config.thresholds.gpu_memory_used_percent
    return Row("GPUs", (
        timeseries("GPU memory used",
                   f"Memory in use per GPU, percent of total. Above {number(limit)}% for "
                   "5 minutes is GPUMemoryOOMRisk.",
                   Query(G("colossalai_gpu_memory_used_percent"), "{{instance}} GPU {{gpu}}"),
                   unit="percent", min=0, max=100, show_thresholds=True,
                   thresholds=(Step("green"), Step("red", limit))),
        timeseries("GPU utilization",
                   "Fraction of the sample period during which a kernel ran on the GPU.",
                   Query(G("colossalai_gpu_utilization_ratio"), "{{instance}} GPU {{gpu}}"),
                   unit="percentunit", min=0, max=1),
        timeseries("GPU temperature", "GPU core temperature.",
                   Query(G("colossalai_gpu_temperature_celsius"), "{{instance}} GPU {{gpu}}"),
                   w=8, unit="celsius"),
        timeseries("GPU power", "GPU power draw.",
                   Query(G("colossalai_gpu_power_watts"), "{{instance}} GPU {{gpu}}"),
                   w=8, unit="watt", min=0),
        timeseries("GPU errors",
                   "ECC errors by type and critical Xid events per GPU.",
                   Query("sum by (instance, gpu, type) (increase("
                         f"{G('colossalai_gpu_ecc_errors_total')}[$__rate_interval]))",
                         "{{instance}} GPU {{gpu}} ECC {{type}}"),
                   Query("sum by (instance, gpu) (increase("
                         f"{G('colossalai_gpu_xid_errors_total')}[$__rate_interval]))",
                         "{{instance}} GPU {{gpu}} Xid"),
                   w=8, bars=True, min=0, decimals=0),
    ))


def host_row(config: RulesConfig) -> Row:
    low = config.thresholds.host_memory_available_percent
    return Row("Host memory (Gemini CPU offload)", (
        timeseries("Host memory available",
                   f"Memory available to new allocations, percent of total. Below "
                   f"{number(low)}% for 5 minutes is HostMemoryOOMRisk.",
                   Query(N(rules.HOST_MEM_AVAIL), "{{instance}}"),
                   unit="percent", min=0, max=100, show_thresholds=True,
                   thresholds=(Step("red"), Step("green", low))),
        timeseries("Host memory and swap",
                   "Available and installed host memory, and swap in use.",
                   Query(N("colossalai_host_memory_available_bytes"), "{{instance}} available"),
                   Query(N("colossalai_host_memory_total_bytes"), "{{instance}} total"),
                   Query(N("colossalai_host_swap_used_bytes"), "{{instance}} swap used"),
                   unit="bytes", min=0, dashed=("B",)),
    ))


def disk_row(config: RulesConfig) -> Row:
    th = config.thresholds
    free = N("colossalai_disk_free_bytes")
    lookback, horizon = th.disk_filling_lookback, th.disk_filling_horizon
    return Row("Disks (checkpoints, NVMe offload)", (
        timeseries("Disk free, now and predicted",
                   f"Free bytes on each watched path (solid) and a linear fit over "
                   f"{lookback} projected {horizon} ahead (dashed). Below "
                   f"{si_bytes(th.disk_free_bytes)} is CheckpointDiskLow.",
                   Query(free, "{{instance}} {{name}}"),
                   # A disk cannot have less than nothing free: a steep early fit
                   # (a short history, one big checkpoint) would draw far below zero.
                   Query(f"clamp_min(predict_linear({free}[{lookback}], "
                         f"{horizon.seconds:g}), 0)",
                         "{{instance}} {{name}} in " + str(horizon)),
                   unit="bytes", show_thresholds=True, dashed=("B",),
                   thresholds=(Step("red"), Step("green", th.disk_free_bytes))),
        stat("Predicted time to full",
             f"Free bytes divided by the rate they shrank at over {lookback} (the slope "
             f"predict_linear uses). Capped at {TIME_TO_FULL_CAP_SECONDS // 86400} days, "
             "which also means the disk is not filling up.",
             Query(f"clamp_max({free} / clamp_min(-deriv({free}[{lookback}]), 0), "
                   f"{TIME_TO_FULL_CAP_SECONDS})", "{{instance}} {{name}}"),
             unit="s", thresholds=(Step("red"), Step("orange", horizon.seconds),
                                   Step("green", 7 * 86400))),
        state_timeline("Path health",
                       "Whether each watched path exists, is a writable directory (a mount "
                       "point where declared) and answers in time: DiskPathBroken.",
                       Query(N("colossalai_disk_path_ok"), "{{instance}} {{name}} ({{path}})"),
                       mappings=ok_bad(ok="ok", bad="broken")),
        table("Why a path is broken",
              "One row per failing path with its reason: missing, not_directory, "
              "not_writable, not_mounted, permission, timeout, error.",
              Query(N("colossalai_disk_path_failure_info"), table=True)),
    ))


def rendezvous_row() -> Row:
    return Row("Rendezvous and training ranks", (
        state_timeline("NCCL rendezvous reachable",
                       "nccl_up: a TCP connect to the rendezvous or store endpoint succeeded "
                       "within its deadline (NCCLRendezvousDown).",
                       Query(N("colossalai_nccl_up"), "{{instance}} → {{target}}"),
                       w=8, mappings=ok_bad()),
        timeseries("Rendezvous connect time",
                   "How long the last TCP connect to the rendezvous endpoint took.",
                   Query(N("colossalai_nccl_connect_duration_seconds"),
                         "{{instance}} → {{target}}"), w=8, unit="s", min=0),
        table("Rendezvous failures",
              "Why an endpoint is unreachable: refused, timeout, dns, unreachable, error.",
              Query(N("colossalai_nccl_failure_info"), table=True), w=8),
        state_timeline("Training ranks seen from outside",
                       "The node agent's view of each local rank: its process alive and its "
                       "snapshot fresh. Down catches a SIGKILLed or frozen rank "
                       "(TrainingRankDown).",
                       Query(N("colossalai_rank_up"), "{{instance}} rank {{rank}}"),
                       mappings=ok_bad()),
        timeseries("Rank snapshot age",
                   "Seconds since each rank last published its state snapshot.",
                   Query(N("colossalai_rank_snapshot_age_seconds"),
                         "{{instance}} rank {{rank}}"), unit="s", min=0),
    ))


def fabric_row() -> Row:
    # The recorded port series carry the node (both exporters' instance without its
    # port), not the agent's instance: the first two panels show the whole fleet's
    # ports that are down, the third the selected agents' own counters.
    down = f"{fabric.ACTIVE} == 0"
    return Row("Fabric (InfiniBand, RoCE)", (
        stat("RDMA ports active",
             "Ports active now, from the node agents' infiniband collector or "
             "node_exporter's, whichever runs (recording rule, one series a port).",
             Query(f"sum({fabric.ACTIVE})", "active"),
             Query(f"count({down}) or 0 * count({fabric.ACTIVE})", "not active"), w=6,
             decimals=0),
        table("Ports not active",
              "Every port not active now, with its physical state (2 polling: no peer, "
              "the cable or the switch side; 3 disabled; 5 link up: the subnet manager). "
              "One that was active within a day is InfiniBandPortDown.",
              Query(f"{fabric.PHYSICAL_STATE} and on (node, device, port) ({down})",
                    table=True), w=9),
        timeseries("Link downs and symbol errors",
                   "Each port's link going down (a drop or a flap) and symbol errors, "
                   "from the selected node agents.",
                   Query("sum by (instance, device, port) (increase("
                         f"{N('colossalai_infiniband_link_downed_total')}"
                         "[$__rate_interval]))", "{{instance}} {{device}}/{{port}} down"),
                   Query("sum by (instance, device, port) (increase("
                         f"{N('colossalai_infiniband_symbol_error_total')}"
                         "[$__rate_interval]))",
                         "{{instance}} {{device}}/{{port}} symbol errors"),
                   w=9, bars=True, min=0, decimals=0),
    ))


def collector_row() -> Row:
    return Row("Collectors", (
        state_timeline("Collector up",
                       "Each collector's last run: a failing one drops its series and says "
                       "why (GPUCollectorDown for gpu).",
                       Query(N("colossalai_exporter_collector_up"),
                             "{{instance}} {{collector}}"), w=8, mappings=ok_bad()),
        timeseries("Collector duration", "How long each collector's last run took.",
                   Query(N("colossalai_exporter_collector_duration_seconds"),
                         "{{instance}} {{collector}}"), w=8, unit="s", min=0),
        timeseries("Collector errors by reason", "Failed collector runs by reason.",
                   Query("sum by (instance, collector, reason) (increase("
                         f"{N('colossalai_exporter_collector_errors_total')}"
                         "[$__rate_interval]))", "{{instance}} {{collector}} {{reason}}"),
                   w=8, bars=True, min=0, decimals=0),
    ))


def build(config: RulesConfig) -> Dashboard:
    node = Selector(config.selectors.node)
    return Dashboard(
        uid=UID,
        title="ColossalAI nodes",
        description="GPU memory, utilization and temperature, host memory, checkpoint and "
                    "NVMe offload disks, rendezvous and collector health of the nodes "
                    "running colossalai-exporter's node agent.",
        variables=(
            variables.datasource(),
            variables.label_values("job", "job", node("colossalai_exporter_collector_up")),
            variables.label_values("instance", "instance",
                                   Selector('job=~"$job"')("colossalai_exporter_collector_up"),
                                   multi=True, all_value=".*"),
            variables.label_values("gpu", "gpu", N("colossalai_gpu_memory_used_percent"),
                                   multi=True, numeric=True, all_value=".*"),
        ),
        rows=(status_row(config), verdict_row(), gpu_row(config), host_row(config),
              disk_row(config),
              rendezvous_row(), fabric_row(), collector_row()),
        alerts_annotation='ALERTS{alertstate="firing", job=~"$job", instance=~"$instance"}',
        tags=("nodes",),
    )
