"""Every metric the project serves: the single source of truth.

Each entry names a metric as it appears in the text exposition (counters with
``_total``, info metrics with ``_info``), its type, its base unit, its labels
and its help text. Collectors build their families through :func:`gauge`,
:func:`counter`, :func:`histogram` and :func:`info`, so help texts and label
names cannot drift from this file; ``docs/metrics.md`` is generated from it
(``python tools/metrics_docs.py``); tests check that servers serve, and rules and
dashboards use, only names listed here.

Sections are kept per component so that each part can grow its own list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        InfoMetricFamily,
    )
    from prometheus_client.core import Metric as MetricFamily

MetricType = Literal["counter", "gauge", "histogram", "info"]
Component = Literal["node", "nccl", "training", "ranks", "probe", "chat", "bridge", "process"]

COMPONENT_TITLES: dict[str, str] = {
    "node": "Node agent (`colossalai-exporter node`)",
    "ranks": "Node agent: training ranks seen from outside",
    "nccl": "Node agent: NCCL's RAS service (collector `nccl`)",
    "training": "Training (in-process `TrainingMonitor`, label `rank` on every series)",
    "probe": "Chat prober (`colossalai-exporter probe`), blackbox-exporter compatible",
    "chat": "FastAPI chat-server helper (`colossalai_exporter.chat.instrument`)",
    "bridge": "Bridge (`colossalai-exporter bridge`)",
    "process": "Process metrics of every server (from prometheus_client)",
}


@dataclass(frozen=True)
class Metric:
    """One catalogued metric."""

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""
    component: Component = "node"

    @property
    def family_name(self) -> str:
        """The name prometheus_client families take (without ``_total``/``_info``)."""
        if self.type == "counter":
            return self.name.removesuffix("_total")
        if self.type == "info":
            return self.name.removesuffix("_info")
        return self.name

    def sample_names(self) -> tuple[str, ...]:
        """Names of the samples this metric produces in the text exposition."""
        # No *_created samples: none of our servers writes them (issue 19's budget).
        if self.type == "histogram":
            return (self.name + "_bucket", self.name + "_count", self.name + "_sum")
        return (self.name,)


def _m(
    name: str,
    type_: MetricType,
    help_: str,
    labels: Sequence[str] = (),
    unit: str = "",
    component: Component = "node",
) -> Metric:
    return Metric(name, type_, help_, tuple(labels), unit, component)


# ---------------------------------------------------------------------------
# Node agent: GPU, host, disks, rendezvous, and the agent itself.
# ---------------------------------------------------------------------------
NODE: tuple[Metric, ...] = (
    _m("colossalai_gpu_devices", "gauge",
       "Number of GPUs NVML reports on this node; 0 on a node without GPUs (no NVIDIA "
       "driver, no /dev/nvidia0 and the like, none expected).", ()),
    _m("colossalai_gpu_expected_devices", "gauge",
       "Number of GPUs this node is expected to have (--gpu.expected); absent when not set.", ()),
    _m("colossalai_gpu_info", "info",
       "GPU identity: index, UUID, product name and driver version (always 1).",
       ("gpu", "uuid", "name", "driver_version")),
    _m("colossalai_gpu_memory_used_bytes", "gauge",
       "GPU memory in use, as NVML reports it.", ("gpu",), "bytes"),
    _m("colossalai_gpu_memory_total_bytes", "gauge",
       "GPU memory installed.", ("gpu",), "bytes"),
    _m("colossalai_gpu_memory_used_percent", "gauge",
       "GPU memory in use as a percentage of the total (0-100; the tutorial's pct).",
       ("gpu",), "percent"),
    _m("colossalai_gpu_utilization_ratio", "gauge",
       "Fraction of the last sample period during which a kernel ran on the GPU (0-1).",
       ("gpu",), "ratio"),
    _m("colossalai_gpu_temperature_celsius", "gauge",
       "GPU core temperature.", ("gpu",), "celsius"),
    _m("colossalai_gpu_power_watts", "gauge",
       "GPU power draw (NVML reports milliwatts).", ("gpu",), "watts"),
    _m("colossalai_gpu_recovery_action_info", "info",
       "The recovery action NVML asks for (driver >= 570): none, gpu_reset, node_reboot, "
       "drain_p2p, drain_and_reset, …; absent on drivers that cannot say.", ("gpu", "action")),
    _m("colossalai_gpu_remapped_rows", "gauge",
       "Rows remapped to spares (Ampere and later), by kind correctable|uncorrectable.",
       ("gpu", "kind")),
    _m("colossalai_gpu_row_remap_pending", "gauge",
       "1 while a row remap waits for the next GPU reset (reset it at the next drain).",
       ("gpu",)),
    _m("colossalai_gpu_row_remap_failed", "gauge",
       "1 once a row remap failed: the GPU has no spare rows left (replace it).", ("gpu",)),
    _m("colossalai_gpu_retired_pages", "gauge",
       "Memory pages retired (before Ampere), by kind single_bit_ecc|double_bit_ecc.",
       ("gpu", "kind")),
    _m("colossalai_gpu_retired_pages_pending", "gauge",
       "1 while a page retirement waits for the next reboot.", ("gpu",)),
    _m("colossalai_gpu_pcie_replays_total", "counter",
       "PCIe replays since the driver loaded: link-level retries (a marginal slot, riser "
       "or cable).", ("gpu",)),
    _m("colossalai_gpu_ecc_volatile_errors_total", "counter",
       "ECC errors since the driver loaded (NVML's volatile counters), by type corrected|"
       "uncorrected and location dram|sram (Volta and later).", ("gpu", "type", "location")),
    _m("colossalai_gpu_nvlink_links", "gauge",
       "NVLink links the GPU has (NVML's link count); absent on a GPU without NVLink.",
       ("gpu",)),
    _m("colossalai_gpu_nvlink_links_active", "gauge",
       "NVLink links of the GPU that are active now (nvmlDeviceGetNvLinkState).", ("gpu",)),
    _m("colossalai_gpu_nvlink_errors_total", "counter",
       "NVLink errors since the driver loaded, summed over the GPU's links, by kind "
       "crc_flit|crc_data|replay|recovery.", ("gpu", "kind")),
    _m("colossalai_gpu_clock_slowdown_active", "gauge",
       "1 while the hardware slows the GPU's clocks, by reason hw_slowdown|"
       "sw_thermal_slowdown|hw_thermal_slowdown|hw_power_brake_slowdown (NVML's clocks "
       "event reasons; the power cap and idle left out).", ("gpu", "reason")),
    _m("colossalai_gpu_ecc_errors_total", "counter",
       "ECC memory errors over the GPU's lifetime (aggregate), by type corrected|uncorrected; "
       "absent where the GPU or driver does not report ECC.", ("gpu", "type")),
    _m("colossalai_gpu_xid_errors_total", "counter",
       "Critical Xid events (NVML XidCriticalError) seen by this agent since it started; "
       "absent for GPUs that cannot report them.", ("gpu",)),
    _m("colossalai_gpu_xid_events_total", "counter",
       "Xid events seen by this agent since it started, by code, with what the code means "
       "and what to do (node/gpu/xid_catalog.yml): tier critical|warning|application|"
       "unknown, action drain_reboot|drain_reset_gpu|drain_check_memory|drain_check_nvlink|"
       "replace_gpu|reset_when_drained|read_recovery_action|restart_job|none|look_up.",
       ("gpu", "xid", "tier", "action", "what")),
    _m("colossalai_gpu_rank_info", "info",
       "A training rank of this node whose process ran on the GPU within the last hour "
       "(NVML's compute processes matched to the ranks' pids); kept while the GPU is "
       "lost, so that a GPU fault's page names the ranks it took down.", ("gpu", "rank")),
    _m("colossalai_gpu_xid_boots", "gauge",
       "Boots of this node in which the Xid code was seen on this GPU (by UUID), this one "
       "included, for the codes seen in this boot: 2 or more is an Xid back after a "
       "reboot (kept in the state directory, --state.dir).", ("gpu", "xid")),
    _m("colossalai_gpu_last_xid", "gauge",
       "Code of the last critical Xid event seen on the GPU (48, 79 … are usually fatal); "
       "absent until one is seen.", ("gpu",)),
    _m("colossalai_gpu_last_xid_timestamp_seconds", "gauge",
       "When the agent saw the last critical Xid event on the GPU (read at the scrape "
       "after it happened).", ("gpu",), "seconds"),
    _m("colossalai_host_memory_total_bytes", "gauge",
       "Host memory installed (Gemini offloads parameters and optimizer state here).",
       (), "bytes"),
    _m("colossalai_host_memory_available_bytes", "gauge",
       "Host memory available to new allocations without swapping (MemAvailable).",
       (), "bytes"),
    _m("colossalai_host_oom_kills_total", "counter",
       "Processes the kernel's OOM killer ended on this node since boot (/proc/vmstat "
       "oom_kill, kernel 4.13 or later; node_exporter's node_vmstat_oom_kill).", ()),
    _m("colossalai_infiniband_port_info", "info",
       "An RDMA port of the node (/sys/class/infiniband), with its link layer: InfiniBand, "
       "or Ethernet for RoCE.", ("device", "port", "link_layer")),
    _m("colossalai_infiniband_state_id", "gauge",
       "The port's logical state (1 down, 2 init, 3 armed, 4 active, 5 active defer); "
       "node_exporter's node_infiniband_state_id.", ("device", "port")),
    _m("colossalai_infiniband_physical_state_id", "gauge",
       "The port's physical state (2 polling: no peer, 3 disabled, 5 link up, 6 link error "
       "recovery); node_exporter's node_infiniband_physical_state_id.", ("device", "port")),
    _m("colossalai_infiniband_rate_bytes_per_second", "gauge",
       "The port's link rate in bytes a second (not its traffic).", ("device", "port")),
    _m("colossalai_infiniband_link_downed_total", "counter",
       "Times the port's link went down (counters/link_downed).", ("device", "port")),
    _m("colossalai_infiniband_link_error_recovery_total", "counter",
       "Link error recoveries the port went through (counters/link_error_recovery).",
       ("device", "port")),
    _m("colossalai_infiniband_symbol_error_total", "counter",
       "Symbol (bit) errors the port received (counters/symbol_error).", ("device", "port")),
    _m("colossalai_infiniband_hw_errors_total", "counter",
       "Transport errors the port's adapter counted (hw_counters/<kind>): acks that timed "
       "out, retries exhausted, packets out of sequence, RoCE slow restarts.",
       ("device", "port", "kind")),
    _m("colossalai_infiniband_carrier_changes_total", "counter",
       "Carrier changes of a RoCE port's network interface "
       "(/sys/class/net/<interface>/carrier_changes): two a link flap.", ("device", "port")),
    _m("colossalai_host_swap_total_bytes", "gauge", "Swap space configured.", (), "bytes"),
    _m("colossalai_host_swap_used_bytes", "gauge", "Swap space in use.", (), "bytes"),
    _m("colossalai_disk_free_bytes", "gauge",
       "Bytes available to unprivileged users on the filesystem holding a watched path.",
       ("name", "path"), "bytes"),
    _m("colossalai_disk_total_bytes", "gauge",
       "Size of the filesystem holding a watched path.", ("name", "path"), "bytes"),
    _m("colossalai_disk_path_ok", "gauge",
       "1 when a watched path exists, is a writable directory (and a mount point if "
       "declared so) and answered within the deadline; 0 otherwise.", ("name", "path")),
    _m("colossalai_disk_path_failure_info", "info",
       "Why a watched path is not ok (one series while it fails): missing, not_directory, "
       "not_writable, not_mounted, permission, timeout, error.", ("name", "path", "reason")),
    _m("colossalai_nccl_communicator_size", "gauge",
       "Ranks in an NCCL communicator with a rank on this node, as NCCL's RAS service "
       "reports it (text reports: per communicator group).", ("comm",), component="nccl"),
    _m("colossalai_nccl_communicator_missing_ranks", "gauge",
       "Ranks of the communicator that RAS cannot reach (JSON reports only).", ("comm",),
       component="nccl"),
    _m("colossalai_nccl_communicator_ok", "gauge",
       "1 when RAS reports the communicator complete and every rank without a problem.",
       ("comm",), component="nccl"),
    _m("colossalai_nccl_rank_problem_info", "info",
       "A problem RAS reports for a rank of this node, or for a missing rank of a "
       "communicator reported here (always 1): missing, unresponsive, dead, aborted, "
       "async_error, behind (fewer collectives than the communicator's most advanced "
       "rank); with the communicator rank, its host, pid, and the training rank when the pid "
       "is a local rank's or the communicator spans the whole run (then its ranks are the "
       "training ranks), and the local ranks' run.",
       ("comm", "comm_rank", "rank_host", "pid", "rank", "run", "problem"), component="nccl"),
    _m("colossalai_nccl_rank_collectives_behind", "gauge",
       "Collectives a rank of this node has done fewer than its communicator's most "
       "advanced rank (present only when above 0).", ("comm", "comm_rank", "rank"),
       component="nccl"),
    _m("colossalai_nccl_up", "gauge",
       "1 when a TCP connection to the rendezvous/store endpoint succeeded within the "
       "deadline.", ("target",)),
    _m("colossalai_nccl_connect_duration_seconds", "gauge",
       "Time the last TCP connect to the rendezvous endpoint took (until success or "
       "failure).", ("target",), "seconds"),
    _m("colossalai_nccl_failure_info", "info",
       "Why the rendezvous endpoint is unreachable (one series while it fails): refused, "
       "timeout, dns, unreachable, error.", ("target", "reason")),
    _m("colossalai_exporter_collector_up", "gauge",
       "1 when the collector's last run succeeded, 0 when it failed (its series are then "
       "dropped, not served stale).", ("collector",)),
    _m("colossalai_exporter_collector_duration_seconds", "gauge",
       "How long the collector's last run took.", ("collector",), "seconds"),
    _m("colossalai_exporter_collector_errors_total", "counter",
       "Collector runs that failed, by reason (every reason pre-created at 0).",
       ("collector", "reason")),
    _m("colossalai_exporter_collector_failure_info", "info",
       "Why a collector is down (one series while it fails).", ("collector", "reason")),
    _m("colossalai_exporter_build_info", "info",
       "Version of colossalai-exporter and of the Python running it (always 1).",
       ("version", "python_version")),
)

# ---------------------------------------------------------------------------
# Node agent: each local training rank as seen from outside its process.
# ---------------------------------------------------------------------------
RANKS: tuple[Metric, ...] = (
    _m("colossalai_rank_up", "gauge",
       "1 while the rank's process is alive and its state snapshot is fresh.", ("rank",),
       component="ranks"),
    _m("colossalai_rank_snapshot_age_seconds", "gauge",
       "Seconds since the rank last published its state snapshot.", ("rank",), "seconds",
       "ranks"),
    _m("colossalai_rank_process_alive", "gauge",
       "1 while the rank's process exists (whether or not it answers), 0 once it is gone; "
       "absent for a rank in another PID namespace.",
       ("rank",), component="ranks"),
    _m("colossalai_rank_process_stopped", "gauge",
       "1 while the rank's process exists but is stopped (SIGSTOP, a debugger), 0 otherwise.",
       ("rank",), component="ranks"),
    _m("colossalai_rank_exit_info", "info",
       "How a rank's process ended (always 1; present once it is gone, for as long as its "
       "snapshot is kept): reason finished, interrupted (it received SIGTERM or SIGINT: a "
       "preemption, a cancel, torchrun stopping it after another rank failed, Ctrl-C), "
       "oom_killed (the kernel's OOM killer), failed (an exception of its own), "
       "peer_failed (an error saying another rank or the process group failed first, or "
       "gone without a word with a collective in flight past its group's timeout, or "
       "waiting past its budget: NCCL's watchdog), hung (outside any collective, then "
       "ended by a signal or gone, after the ranks that waited for it stalled or timed "
       "out: the rank a hang waited for) or killed (gone with no error or signal recorded: "
       "SIGKILL, a native crash, whose signal and line the rank's crash report gives); "
       "detail: "
       "the evidence in words (the signal, the error, the memory cgroup and RSS and "
       "whether the kernel log, the cgroup or /proc/vmstat told); collective: where it "
       "stood with its collectives as it ended: timed_out (its collective passed the "
       "process group's timeout: the backend's error, or NCCL's watchdog), waiting (seen "
       "waiting in one, or one in flight for half its group's timeout), idle (outside "
       "any collective with nothing in flight), unknown.",
       ("rank", "run", "reason", "detail", "collective"), component="ranks"),
    _m("colossalai_rank_snapshot_errors_total", "counter",
       "Reads of snapshot files in the run directory that could not be used, by reason: "
       "malformed (not JSON, truncated), invalid (a key missing or of the wrong type), "
       "version (written by a newer monitor than this agent reads), unreadable (an I/O "
       "error); each costs only that rank's series. And shared: a rank's file written in "
       "turn by two live processes (two runs in one run directory), served, though its "
       "series then flip between them.", ("reason",), component="ranks"),
)

# ---------------------------------------------------------------------------
# Training: the in-process TrainingMonitor.
# ---------------------------------------------------------------------------
TRAINING: tuple[Metric, ...] = (
    _m("colossalai_training_info", "info",
       "The run's software and layout (always 1): ColossalAI and torch versions, Booster "
       "plugin, Gemini placement policy, tensor/pipeline/data parallel sizes, the rank's "
       "pipeline stage (from HybridParallelPlugin, or monitor.set_info(pipeline_stage=)), "
       "world size, and the run id every rank of the job shares (alerts carry it as "
       "label run).",
       ("rank", "colossalai_version", "torch_version", "plugin", "placement_policy",
        "tp_size", "pp_size", "dp_size", "pipeline_stage", "world_size", "run"),
       component="training"),
    _m("colossalai_training_steps_total", "counter",
       "Training steps completed.", ("rank",), component="training"),
    _m("colossalai_training_last_step_timestamp_seconds", "gauge",
       "When the rank last completed a step.", ("rank",), "seconds", "training"),
    _m("colossalai_training_step_duration_seconds", "histogram",
       "Wall-clock duration of training steps.", ("rank",), "seconds", "training"),
    _m("colossalai_training_step_timeout_seconds", "gauge",
       "The budget a stall is judged by in the current phase.", ("rank",), "seconds",
       "training"),
    _m("colossalai_training_phase", "gauge",
       "1 for the rank's current phase; the other phases are not served.", ("rank", "phase"),
       component="training"),
    _m("colossalai_training_phase_start_timestamp_seconds", "gauge",
       "When the rank entered its current phase.", ("rank",), "seconds", "training"),
    # These three carry the run as a label of their own: range queries over them (goodput,
    # restarts over a day) must not mix two runs that used the same rank on one node.
    _m("colossalai_training_start_timestamp_seconds", "gauge",
       "When this rank's process started its monitor: a new value is a restart.",
       ("rank", "run"), "seconds", "training"),
    _m("colossalai_training_productive_seconds_total", "counter",
       "Seconds of completed steps, each counted up to its stall budget (the rest of a "
       "step that overran is stall, not training): the numerator of goodput.",
       ("rank", "run"), "seconds", "training"),
    _m("colossalai_training_checkpointed_seconds_total", "counter",
       "The productive seconds that the last successful checkpoint holds: what a restart "
       "now would keep. The difference to productive_seconds_total is lost on a restart.",
       ("rank", "run"), "seconds", "training"),
    _m("colossalai_training_samples_total", "counter",
       "Samples processed, when the training loop reports them.", ("rank",),
       component="training"),
    _m("colossalai_training_tokens_total", "counter",
       "Tokens processed, when the training loop reports them.", ("rank",),
       component="training"),
    _m("colossalai_training_stalled", "gauge",
       "1 while the time since the last progress in the current phase exceeds "
       "colossalai_training_step_timeout_seconds.", ("rank",), component="training"),
    _m("colossalai_training_stalls_total", "counter",
       "Stalls detected by the monitor (each leaves a stack dump in the run directory).",
       ("rank",), component="training"),
    _m("colossalai_training_loss", "gauge",
       "Loss of the last step that reported one.", ("rank",), component="training"),
    _m("colossalai_gemini_oom_total", "counter",
       "Out-of-memory errors raised inside monitored steps and checkpoints, by device.",
       ("rank", "device"), component="training"),
    _m("colossalai_gemini_oom_last_timestamp_seconds", "gauge",
       "When the rank last ran out of memory on the device; present only for the devices "
       "that did (the alerts read it: a set that is empty while all is well is cheap to "
       "select at fleet size; with the rank's run, so no alert joins it).",
       ("rank", "run", "device"), "seconds", "training"),
    _m("colossalai_checkpoint_last_success_timestamp_seconds", "gauge",
       "When the last checkpoint finished successfully.", ("rank",), "seconds", "training"),
    _m("colossalai_checkpoint_last_step", "gauge",
       "Step of the last successful checkpoint.", ("rank",), component="training"),
    _m("colossalai_checkpoint_duration_seconds", "gauge",
       "How long the last checkpoint took.", ("rank",), "seconds", "training"),
    _m("colossalai_checkpoint_failures_total", "counter",
       "Checkpoints that raised.", ("rank",), component="training"),
    _m("colossalai_checkpoint_last_failure_timestamp_seconds", "gauge",
       "When a checkpoint last raised; absent before the first failure.", ("rank", "run"),
       "seconds", "training"),
    _m("colossalai_checkpoint_in_flight", "gauge",
       "1 while a checkpoint is being written, including an async save whose writers the "
       "checkpoint IO still holds.", ("rank",), component="training"),
    _m("colossalai_kernels_ready", "gauge",
       "1 once the rank's kernels are built or loaded.", ("rank",), component="training"),
    _m("colossalai_kernel_build_failures_total", "counter",
       "Kernel loads or JIT builds that raised (ColossalAI's KernelLoader.load, or a "
       "monitor.kernels() block).", ("rank",), component="training"),
    _m("colossalai_kernel_build_last_failure_timestamp_seconds", "gauge",
       "When a kernel load or JIT build last raised; absent before the first failure.",
       ("rank", "run"), "seconds", "training"),
    _m("colossalai_training_last_error_info", "info",
       "The last exception the monitor saw on the rank (always 1): where (step, "
       "checkpoint, kernels, boost, evaluation, run, caught), its type, the device for an "
       "out-of-memory error, and its first line.",
       ("rank", "where", "type", "device", "message"), component="training"),
    _m("colossalai_training_activity_info", "info",
       "Where a stalled rank's training thread is (always 1; present only while the rank "
       "is stalled): activity collective, backward (both: waiting for other ranks when "
       "the run is stalled), data, checkpoint, network (an upload or download of the "
       "script's own), subprocess (waiting for a child process), compile (torch.compile "
       "compiling) or compute; the c10d function of a "
       "collective; the script's innermost frame as file:line in function, then the "
       "library frame the thread is in where that is elsewhere (train.py:88 in upload "
       "(client.py:1009 in send)).",
       ("rank", "activity", "collective", "frame"), component="training"),
    _m("colossalai_training_collective_enqueued", "gauge",
       "Sequence number of the last collective the rank enqueued in process group pg "
       "(the name torch registered for the group, shared by its members; pg_ranks: its "
       "global ranks, like 0-7, 1,3 or 0-254/2; op: the collective, like "
       "gloo:all_reduce), from torch's flight recorder; present only while the rank is "
       "stalled. In a stalled run, a rank behind the others of a group and ahead of none "
       "in any group is the one they wait for.",
       ("rank", "run", "pg", "pg_ranks", "op"), component="training"),
    _m("colossalai_training_collective_in_flight_seconds", "gauge",
       "How long the rank's oldest collective in flight (enqueued, not completed) has "
       "been, from when the monitor first saw it (up to one publish interval late); 0 "
       "when none is; absent where torch's flight recorder status cannot be read. Past "
       "its process group's timeout, NCCL's watchdog ends the rank. A rank with nothing "
       "in flight while another rank of its run timed out waiting in a collective is the "
       "one it waited for.",
       ("rank", "run"), component="training"),
    _m("colossalai_training_activity_samples_total", "counter",
       "Samples of the rank's training thread taken while training (about one a "
       "second, by the monitor's publisher thread).", ("rank",), component="training"),
    _m("colossalai_training_waiting_samples_total", "counter",
       "Of those samples, the ones that found the thread waiting for other ranks (in a "
       "collective or in backward): their rate over the samples' is the share of "
       "time the rank waits.", ("rank",), component="training"),
    _m("colossalai_training_last_error_timestamp_seconds", "gauge",
       "When the rank's last error was raised.", ("rank",), "seconds", "training"),
    _m("colossalai_gemini_chunk_memory_bytes", "gauge",
       "Memory held by Gemini chunks, by device.", ("rank", "device"), "bytes", "training"),
    _m("colossalai_gemini_h2d_bytes_total", "counter",
       "Bytes Gemini moved from host to device.", ("rank",), "bytes", "training"),
    _m("colossalai_gemini_d2h_bytes_total", "counter",
       "Bytes Gemini moved from device to host.", ("rank",), "bytes", "training"),
    _m("colossalai_heartbeat_last_success_timestamp_seconds", "gauge",
       "When a heartbeat ping last succeeded.", ("rank", "heartbeat"), "seconds",
       "training"),
    _m("colossalai_heartbeat_last_attempt_timestamp_seconds", "gauge",
       "When a heartbeat ping was last attempted.", ("rank", "heartbeat"), "seconds",
       "training"),
    _m("colossalai_heartbeat_sends_total", "counter",
       "Heartbeat pings by result (success, failure, dropped).",
       ("rank", "heartbeat", "result"), component="training"),
    _m("colossalai_training_monitor_errors_total", "counter",
       "The monitor's own failures (it never raises into training), by where: publish, "
       "loss, heartbeat, server, stacks, hook.", ("rank", "where"), component="training"),
)

# ---------------------------------------------------------------------------
# Chat prober: blackbox exporter names plus why a probe failed.
# ---------------------------------------------------------------------------
PROBE: tuple[Metric, ...] = (
    # Per probe (GET /probe): a fresh registry each time, blackbox exporter names.
    _m("probe_success", "gauge", "1 when the probe succeeded, 0 when it failed.",
       component="probe"),
    _m("probe_duration_seconds", "gauge",
       "How long the whole probe took, name resolution included.", (), "seconds", "probe"),
    _m("probe_http_status_code", "gauge",
       "HTTP status code of the probe's last response (0 when none arrived).",
       component="probe"),
    _m("probe_failure_info", "info",
       "Why the probe failed (one series when it failed): dns, refused, unreachable, "
       "timeout, tls, connection, protocol, status, body, engine_error, loading, config.",
       ("reason",), component="probe"),
    _m("probe_http_duration_seconds", "gauge",
       "Time the probe's HTTP requests spent in each phase, summed over its requests: "
       "resolve, connect, tls, processing (request sent until the response head), "
       "transfer (reading the body).", ("phase",), "seconds", "probe"),
    _m("probe_dns_lookup_time_seconds", "gauge",
       "How long resolving the target's host name took.", (), "seconds", "probe"),
    _m("probe_ip_protocol", "gauge",
       "IP version of the address probed (4 or 6; 0 when the name did not resolve).",
       component="probe"),
    _m("probe_http_ssl", "gauge",
       "1 when the probe's last request went over TLS.", component="probe"),
    _m("probe_http_uncompressed_body_length", "gauge",
       "Bytes of the last response body the probe read (blackbox exporter's name, "
       "hence no _bytes suffix).", component="probe"),
    _m("probe_ssl_earliest_cert_expiry", "gauge",
       "When the target's certificate expires (Unix time; only when it was verified).",
       component="probe"),
    _m("colossalai_probe_step_success", "gauge",
       "1 for each step of a multi-request probe that passed, 0 for the step that failed "
       "(ping, engine_check, openapi, docs, root, health, generate, stream, request, "
       "connect); steps after a failure are absent.", ("step",), component="probe"),
    # A streamed generation (prober stream, probe/stream.py).
    _m("colossalai_probe_stream_completed", "gauge",
       "1 when the stream reached its final event ([DONE], a finish_reason, ColossalChat's "
       "end event, the end of Colossal-Inference's body), else 0.", component="probe"),
    _m("colossalai_probe_stream_tokens", "gauge",
       "Non-empty tokens (streamed pieces of text) the probe received.", component="probe"),
    _m("colossalai_probe_stream_first_token_seconds", "gauge",
       "Time from the start of the request (connect included) to the first non-empty token; "
       "absent when none came.", unit="seconds", component="probe"),
    _m("colossalai_probe_stream_max_token_gap_seconds", "gauge",
       "The longest wait between two tokens; absent below two tokens.", unit="seconds",
       component="probe"),
    _m("colossalai_probe_stream_tokens_per_second", "gauge",
       "Tokens per second after the first; absent below two tokens.", component="probe"),
    # The prober's own health (GET /metrics).
    _m("colossalai_probe_probes_total", "counter",
       "Probes run, by module and result: success or the failure reason (pre-created at 0 "
       "for every configured module).", ("module", "result"), component="probe"),
    _m("colossalai_probe_rejected_total", "counter",
       "Probe requests refused before probing, by reason: missing_target, bad_target, "
       "missing_module, unknown_module, not_allowed, busy.", ("reason",), component="probe"),
    _m("colossalai_probe_duration_seconds", "histogram",
       "Wall-clock duration of probes, by module.", ("module",), "seconds", "probe"),
    _m("colossalai_probe_in_flight", "gauge",
       "Probes running now.", component="probe"),
    _m("colossalai_probe_max_concurrent", "gauge",
       "Probes the prober runs at once before answering 503 (--probe.max-concurrent).",
       component="probe"),
    _m("colossalai_probe_modules", "gauge",
       "Modules the prober knows (built in and from its config file).", component="probe"),
)

# ---------------------------------------------------------------------------
# FastAPI chat-server helper.
# ---------------------------------------------------------------------------
CHAT: tuple[Metric, ...] = (
    _m("colossalai_chat_requests_total", "counter",
       "HTTP requests the chat app finished, by route template, method and status code.",
       ("route", "method", "status"), component="chat"),
    _m("colossalai_chat_request_duration_seconds", "histogram",
       "Time from a request's arrival to the end of its response body (a streamed "
       "response is timed to its last event), by route template and method.",
       ("route", "method"), "seconds", "chat"),
    _m("colossalai_chat_requests_in_flight", "gauge",
       "Requests being served now (streams included), by route template and method.",
       ("route", "method"), component="chat"),
    _m("colossalai_chat_request_errors_total", "counter",
       "Requests that raised or answered 5xx, by route template, method and kind "
       "(exception or status_5xx).", ("route", "method", "kind"), component="chat"),
    _m("colossalai_chat_ready", "gauge",
       "1 when the app's ready() check passes (GET /health answers 200), 0 while loading.",
       component="chat"),
    _m("colossalai_chat_start_time_seconds", "gauge",
       "When instrument() was called (the start of the /health uptime).", (), "seconds",
       "chat"),
    _m("colossalai_chat_streams_total", "counter",
       "Streamed responses (a first body part saying more follows) by route template.",
       ("route",), component="chat"),
    _m("colossalai_chat_stream_first_chunk_seconds", "histogram",
       "Time from a streamed request's arrival to its response's first non-empty part "
       "(a server's time to first token, queue wait included).", ("route",), "seconds",
       component="chat"),
    _m("colossalai_chat_stream_chunk_gap_seconds", "histogram",
       "Time between two non-empty parts of a streamed response (inter-token latency).",
       ("route",), "seconds", component="chat"),
    _m("colossalai_chat_streams_cut_total", "counter",
       "Streamed responses that ended without their last part, by who cut them: server "
       "(the app raised) or client (it went away); both pre-created per route streamed.",
       ("route", "by"), component="chat"),
    _m("colossalai_chat_last_progress_timestamp_seconds", "gauge",
       "When a streamed part last left (or the app last called mark_progress()): the "
       "generation heartbeat.", unit="seconds", component="chat"),
    _m("colossalai_chat_requests_waiting", "gauge",
       "Requests waiting to be scheduled, as the app reports them (set_queue); absent "
       "until it does.", component="chat"),
    _m("colossalai_chat_requests_running", "gauge",
       "Requests being generated, as the app reports them (set_queue); absent until it "
       "does.", component="chat"),
)

# ---------------------------------------------------------------------------
# Bridge: Alertmanager -> Vigilmon heartbeats and webhooks.
# ---------------------------------------------------------------------------
BRIDGE: tuple[Metric, ...] = (
    _m("colossalai_bridge_notifications_received_total", "counter",
       "Alertmanager notifications accepted and durably stored (each answered 200).",
       component="bridge"),
    _m("colossalai_bridge_notifications_rejected_total", "counter",
       "Alertmanager notifications refused, by reason (every reason pre-created at 0): "
       "bad_request and head_too_large (a malformed or oversized HTTP head, to any path), "
       "unauthorized, unsupported_media_type, too_large, body_timeout, method_not_allowed, "
       "store_unavailable, invalid_utf8, malformed_json, unknown_version, missing_field, "
       "invalid_type, invalid_value.", ("reason",), component="bridge"),
    _m("colossalai_bridge_deliveries_total", "counter",
       "Delivery attempts by target and result: success, status (an answer outside the "
       "target's success codes), timeout, connection, tls (handshake or certificate "
       "failure), error (any other failure, the delivery worker's own included: see its log).",
       ("target", "result"),
       component="bridge"),
    _m("colossalai_bridge_queue_depth", "gauge",
       "Deliveries waiting for a target (read from the outbox).", ("target",),
       component="bridge"),
    _m("colossalai_bridge_oldest_pending_age_seconds", "gauge",
       "Age of the oldest delivery waiting for a target (0 when none waits).", ("target",),
       "seconds", "bridge"),
    _m("colossalai_bridge_last_success_timestamp_seconds", "gauge",
       "When a delivery to the target last succeeded (kept across restarts; absent before "
       "the first success).", ("target",), "seconds", "bridge"),
    _m("colossalai_bridge_dead_letters_total", "counter",
       "Deliveries given up on since the bridge started, by target.", ("target",),
       component="bridge"),
    _m("colossalai_bridge_dead_letters", "gauge",
       "Deliveries in the dead-letter table now, by target (bridge outbox list --dead).",
       ("target",), component="bridge"),
    _m("colossalai_bridge_deduplicated_total", "counter",
       "Notifications not queued for a webhook target because the same one (group key, "
       "status, alerts) was queued within its dedup window.", ("target",),
       component="bridge"),
    _m("colossalai_bridge_heartbeat_pings_dropped_total", "counter",
       "Heartbeat pings dropped unsent, by reason: superseded (a newer ping replaced it) or "
       "expired (older than the target's ttl).", ("target", "reason"), component="bridge"),
    _m("colossalai_bridge_health_heartbeat_firing_alerts", "gauge",
       "Alerts matching a health heartbeat's selector that are firing now (pings pause "
       "while above 0).", ("target",), component="bridge"),
    _m("colossalai_bridge_store_writable", "gauge",
       "1 when the state directory and its database accept a synced write.",
       component="bridge"),
)

# ---------------------------------------------------------------------------
# Standard process metrics (prometheus_client's ProcessCollector).
# ---------------------------------------------------------------------------
PROCESS: tuple[Metric, ...] = (
    _m("process_cpu_seconds_total", "counter", "Total user and system CPU time spent in "
       "seconds.", (), "seconds", "process"),
    _m("process_open_fds", "gauge", "Number of open file descriptors.",
       component="process"),
    _m("process_max_fds", "gauge", "Maximum number of open file descriptors.",
       component="process"),
    _m("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", (),
       "bytes", "process"),
    _m("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", (),
       "bytes", "process"),
    _m("process_start_time_seconds", "gauge",
       "Start time of the process since unix epoch in seconds.", (), "seconds", "process"),
)

CATALOGUE: tuple[Metric, ...] = NODE + RANKS + TRAINING + PROBE + CHAT + BRIDGE + PROCESS
BY_NAME: dict[str, Metric] = {m.name: m for m in CATALOGUE}

def get(name: str) -> Metric:
    """The catalogue entry for ``name``; KeyError names the missing metric."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"metric {name!r} is not in the catalogue") from None


def family(name: str) -> MetricFamily:
    """An empty metric family for a catalogued metric, with its help and labels.

    Typed as the base class: use :func:`gauge`, :func:`counter`, :func:`histogram`
    or :func:`info` to fill one (their ``add_metric`` signatures differ).
    """
    metric = get(name)
    made: MetricFamily = _family_classes()[metric.type](metric.family_name, metric.help,
                                                         labels=list(metric.labels))
    return made


def _typed(name: str, type_: MetricType) -> Any:
    metric = get(name)
    if metric.type != type_:
        raise TypeError(f"metric {name!r} is a {metric.type}, not a {type_}")
    return family(name)


def gauge(name: str) -> GaugeMetricFamily:
    """An empty gauge family for a catalogued gauge (TypeError for any other type).

    >>> f = gauge("colossalai_disk_free_bytes")
    >>> f.add_metric(["checkpoints", "/ckpt"], 1e12)
    """
    made: GaugeMetricFamily = _typed(name, "gauge")
    return made


def counter(name: str) -> CounterMetricFamily:
    """An empty counter family for a catalogued counter (named with ``_total``)."""
    made: CounterMetricFamily = _typed(name, "counter")
    return made


def histogram(name: str) -> HistogramMetricFamily:
    """An empty histogram family for a catalogued histogram."""
    made: HistogramMetricFamily = _typed(name, "histogram")
    return made


def info(name: str) -> InfoMetricFamily:
    """An empty info family for a catalogued info metric (named with ``_info``)."""
    made: InfoMetricFamily = _typed(name, "info")
    return made


_FAMILY_CLASSES: dict[str, Any] = {}


def _family_classes() -> dict[str, Any]:
    """prometheus_client's family class per metric type, imported on first use.

    Not at the top: the node agent reads its configuration (which names catalogued
    metrics) and starts its NVML worker before it loads prometheus_client and the
    HTTP stack, so that the worker boots meanwhile. Kept once loaded: an import
    statement per family would cost a few percent of a scrape.
    """
    if not _FAMILY_CLASSES:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            InfoMetricFamily,
        )

        _FAMILY_CLASSES.update(counter=CounterMetricFamily, gauge=GaugeMetricFamily,
                               histogram=HistogramMetricFamily, info=InfoMetricFamily)
    return _FAMILY_CLASSES


#: node_exporter's infiniband collector's series the fabric rules read besides the
#: agent's own (rulesgen/fabric.py), with where they are defined
NODE_EXPORTER_METRICS: dict[str, str] = dict.fromkeys(
    ("node_infiniband_state_id", "node_infiniband_physical_state_id",
     "node_infiniband_link_downed_total", "node_infiniband_symbol_error_total"),
    "node_exporter collector/infiniband_linux.go")

#: The inference servers' own metrics that the optional engine rules read
#: (rulesgen/engines.py): served by the servers, not by us; each with its source.
ENGINE_METRICS: dict[str, str] = {
    "vllm:num_requests_waiting": "vLLM docs/design/metrics.md",
    "vllm:num_requests_running": "vLLM docs/design/metrics.md",
    "vllm:request_queue_time_seconds_sum": "vLLM docs/design/metrics.md (histogram)",
    "vllm:request_queue_time_seconds_count": "vLLM docs/design/metrics.md (histogram)",
    "vllm:request_queue_time_seconds":
        "vLLM docs/design/metrics.md (histogram, as a native histogram stored at scrape)",
    "sglang:num_queue_reqs": "SGLang docs, production metrics (--enable-metrics)",
    "sglang:num_running_reqs": "SGLang docs, production metrics (--enable-metrics)",
    "tgi_queue_size": "huggingface text-generation-inference reference/metrics",
    "tgi_batch_current_size": "huggingface text-generation-inference reference/metrics",
    "tgi_request_queue_duration_sum": "huggingface text-generation-inference reference/metrics",
    "tgi_request_queue_duration_count":
        "huggingface text-generation-inference reference/metrics",
    "tgi_request_queue_duration": "huggingface text-generation-inference reference/metrics "
                                  "(histogram, as a native histogram stored at scrape)",
}


def known_sample_names() -> set[str]:
    """Every sample name the catalogue allows in an exposition."""
    names: set[str] = set()
    for metric in CATALOGUE:
        names.update(metric.sample_names())
    return names


def native_histogram_names() -> set[str]:
    """The catalogued histograms' own names: the one series each that a Prometheus 3
    stores in place of ``_bucket``, ``_sum`` and ``_count`` when it converts them at
    scrape (convert_classic_histograms_to_nhcb, docs/deploy.md). No server of ours serves
    them; rules and dashboards read them beside the classic parts."""
    return {metric.name for metric in CATALOGUE if metric.type == "histogram"}


def label_names() -> frozenset[str]:
    """Every label name a catalogued metric carries (``run``, ``rank``, ``gpu`` …).

    A target label, relabeling or file_sd group must not set one of these: the
    exporter's own would be renamed ``exported_<name>`` at scrape, and everything keyed
    on it (``run`` joins the alerts of a job, Alertmanager's inhibitions) would misfire.
    """
    return frozenset(label for metric in CATALOGUE for label in metric.labels)
