"""ColossalAI training: where each rank is, how fast it steps, and what is going wrong.

Variables ``job`` and ``rank`` match the alerts' links (``var-job``,
``var-rank``). The job list comes from the rules' training selector, so the
node agent's re-served copies of the same series (another job) never double
the lines, and a site that selects its runs by a regex gets them here too.
"""

from __future__ import annotations

from colossalai_exporter.dashboards import variables
from colossalai_exporter.dashboards.dashboard import Dashboard
from colossalai_exporter.dashboards.model import (
    Query,
    Row,
    Step,
    ValueText,
    stat,
    state_timeline,
    table,
    timeseries,
)
from colossalai_exporter.rankstate.schema import PHASES
from colossalai_exporter.rulesgen import rules
from colossalai_exporter.rulesgen.config import RulesConfig
from colossalai_exporter.rulesgen.promql import Selector, histogram_quantile

UID = "colossalai-training"

_PHASE_COLORS = {"init": "blue", "kernels": "purple", "training": "green",
                 "checkpointing": "yellow", "evaluating": "light-green", "compiling": "orange",
                 "data_start": "light-blue", "finished": "text", "failed": "red"}

R = Selector('job=~"$job", rank=~"$rank"')
JOB = Selector('job=~"$job"')


def phase_code() -> str:
    """One number per rank for its current phase (1 + its index in PHASES).

    ``colossalai_training_phase`` is served for the current phase only (value 1);
    weighting each phase's series by its code and taking the max gives a single
    series per rank that a state timeline maps back to phase names.
    """
    terms = "\n  or ".join(
        R("colossalai_training_phase", 'phase="' + name + '"') + f" * {i + 1}"
        for i, name in enumerate(PHASES))
    return f"max by (job, rank) (\n    {terms}\n)"


def phase_mappings() -> tuple[ValueText, ...]:
    return tuple(ValueText(str(i + 1), name, _PHASE_COLORS[name])
                 for i, name in enumerate(PHASES))


def status_row() -> Row:
    return Row("Status", (
        table("Firing alerts",
              "Alerts of this job firing now (Prometheus' ALERTS series); the runbook "
              "and description are in Alertmanager or Slack.",
              Query('ALERTS{alertstate="firing", job=~"$job"}', table=True), w=12, h=7),
        stat("Rank servers scraped",
             "Prometheus' up for each rank server of the job: 0 is TrainingRankDown.",
             Query(JOB("up"), "{{instance}}"), w=4, h=7,
             thresholds=(Step("red"), Step("green", 1)),
             mappings=(ValueText("1", "up", "green"), ValueText("0", "down", "red"))),
        stat("Stalled",
             "The monitor's own stall judgement: no progress in the current phase for "
             "longer than the phase's budget.",
             Query(R("colossalai_training_stalled"), "rank {{rank}}"), w=4, h=7,
             thresholds=(Step("green"), Step("red", 1)),
             mappings=(ValueText("0", "ok", "green"), ValueText("1", "stalled", "red"))),
        stat("Kernels ready",
             "Whether each rank's ColossalAI kernels are built or loaded; a JIT build "
             "that never ends keeps this at 0 (KernelsNotReady).",
             Query(R("colossalai_kernels_ready"), "rank {{rank}}"), w=4, h=7,
             thresholds=(Step("red"), Step("green", 1)),
             mappings=(ValueText("1", "ready", "green"), ValueText("0", "not ready", "red"))),
    ))


def waiting_row(node: Selector) -> Row:
    """Who the job is waiting for: TrainingHangSuspect and where each stalled rank is.

    Both come from the node agents (the only view of every rank), joined to the
    selected job through the ``run`` its rank servers report.
    """
    runs = f'max by (run) ({JOB("colossalai_training_info")})'
    where = (f"{node('colossalai_training_activity_info')}\n"
             f"  * on (job, instance, rank) group_left (run)\n"
             f"    max by (job, instance, rank, run) ({node('colossalai_training_info')})\n"
             f"  * on (run) group_left () {runs}")
    return Row("Who the job is waiting for", (
        table("Who the job is waiting for",
              "TrainingHangSuspect: the rank a stalled run waits for (outside any collective "
              "while others wait inside one, or alive but not answering, or stopped). "
              "Empty while the job runs; see the runbook.",
              Query('ALERTS{alertname="TrainingHangSuspect", alertstate="firing"}\n'
                    f"  * on (run) group_left () {runs}", table=True), w=12, h=7),
        table("Where each stalled rank is",
              "Every stalled rank's activity (collective and backward: waiting for others; "
              "compute, data, checkpoint: not), the collective it is in and its innermost "
              "Python frame, sampled by its monitor about once a second.",
              Query(where, table=True), w=12, h=7),
        timeseries("Share of time waiting for other ranks",
                   "Each rank's share of training time spent waiting for the others (in a "
                   "collective or in backward), and the run's median (each pipeline "
                   "stage's, where the monitor knows the stages). In a synchronous job "
                   "every rank steps at the slowest one's rate: the straggler is the rank "
                   "that hardly waits while the others wait (TrainingStraggler, cause "
                   "waits_least).",
                   Query(f"{rules.WAIT_SHARE}\n  * on (run) group_left () {runs}",
                         "rank {{rank}}"),
                   Query(f"{rules.WAIT_SHARE_MEDIAN}\n  * on (run) group_left () {runs}",
                         "median {{pipeline_stage}}"),
                   w=24, h=7, unit="percentunit"),
    ))


def progress_row(config: RulesConfig) -> Row:
    ratio = config.thresholds.straggler_ratio
    return Row("Progress", (
        state_timeline("Phase per rank",
                       "The phase each rank is in: init, kernels (JIT build), training, "
                       "checkpointing, evaluating, compiling, data_start (a data loader's "
                       "start at an epoch's boundary), finished, failed.",
                       Query(phase_code(), "rank {{rank}}"), w=24, h=7,
                       mappings=phase_mappings()),
        timeseries("Steps per second per rank",
                   "Training steps completed per second by each rank, and the job's "
                   "median rank (5m rate) that the straggler alert compares against.",
                   Query("sum by (job, rank) (rate("
                         f"{R('colossalai_training_steps_total')}[$__rate_interval]))",
                         "rank {{rank}}"),
                   Query(JOB(rules.STEP_RATE_MEDIAN), "job median (5m)"),
                   unit="ops", min=0, dashed=("B",)),
        timeseries("Time since last step vs step budget",
                   "Seconds since each rank finished a step (solid) and the budget a stall "
                   "is judged by (dashed). Solid above dashed while training is "
                   "TrainingStalled.",
                   Query(f"time() - ({R('colossalai_training_last_step_timestamp_seconds')}"
                         " > 0)", "rank {{rank}}"),
                   Query(R("colossalai_training_step_timeout_seconds"),
                         "rank {{rank}} budget"),
                   unit="s", min=0, dashed=("B",)),
        timeseries("Straggler ratio vs job median",
                   f"Each rank's 5m step rate divided by the job's median rank. Below "
                   f"{ratio:g} for 10 minutes is TrainingStraggler.",
                   Query(R(rules.STEP_RATE_RATIO), "rank {{rank}}"),
                   unit="percentunit", min=0, show_thresholds=True,
                   thresholds=(Step("red"), Step("green", ratio))),
        timeseries("Loss",
                   "Loss of the last step that reported one, per rank.",
                   Query(R("colossalai_training_loss"), "rank {{rank}}")),
        timeseries("Step duration",
                   "Mean step time over 5m (solid, the recording rule) and the 90th "
                   "percentile from the step histogram (dashed).",
                   Query(R(rules.STEP_MEAN), "rank {{rank}} mean (5m)"),
                   Query(histogram_quantile(0.9, R, rules.STEP_HISTOGRAM, ("job", "rank"),
                                            "$__rate_interval"), "rank {{rank}} p90"),
                   unit="s", min=0, dashed=("B",)),
        timeseries("Time in current phase vs budget",
                   "Seconds since each rank entered its current phase (solid) and the "
                   "budget the rank is judged by now (dashed). Before training and while "
                   "checkpointing the time in the phase itself is judged: start-up and "
                   "checkpoint stalls show here. While training the budget applies to "
                   "the time since the last step (above), so a training phase running "
                   "past the line is normal.",
                   Query(f"time() - {R('colossalai_training_phase_start_timestamp_seconds')}",
                         "rank {{rank}}"),
                   Query(R("colossalai_training_step_timeout_seconds"),
                         "rank {{rank}} budget"),
                   unit="s", min=0, dashed=("B",)),
    ))


def goodput_row(config: RulesConfig) -> Row:
    """The run's effective training time, and the restarts that eat it."""
    runs = 'group by (run) (colossalai_training_info{job=~"$job"})'
    restarts = config.thresholds.restart_loop_restarts
    return Row("Goodput", (
        timeseries("Goodput",
                   "Share of wall time each run spent in training steps whose work was "
                   "kept: start-up, kernel builds, checkpoints, stalls past the budget, "
                   "time down and work lost to restarts count against it (docs/rules.md, "
                   "Goodput). Over 1h (solid) and 24h (dashed).",
                   Query(f"{rules.goodput_ratio('1h')} and on (run) {runs}", "{{run}} 1h"),
                   Query(f"{rules.goodput_ratio('24h')} and on (run) {runs}", "{{run}} 24h"),
                   w=12, unit="percentunit", min=0, max=1, dashed=("B",)),
        timeseries("Restarts in the last hour",
                   f"New processes on each run's busiest rank over the past hour. "
                   f"{restarts} or more without a checkpoint is TrainingRestartLoop.",
                   Query("max by (run) (\n  changes("
                         f"{JOB('colossalai_training_start_timestamp_seconds')}[1h])\n"
                         "  * on (job, instance, rank) group_left (run)\n"
                         f"    max by (job, instance, rank, run) ({JOB(rules.INFO)})\n)",
                         "{{run}}"),
                   w=12, min=0, decimals=0, show_thresholds=True,
                   thresholds=(Step("green"), Step("red", restarts))),
    ))


def checkpoint_row(config: RulesConfig) -> Row:
    interval = config.thresholds.checkpoint_interval
    return Row("Checkpoints", (
        timeseries("Checkpoint age",
                   f"Time since the last successful checkpoint. Above {interval} while "
                   "training is CheckpointOverdue.",
                   Query(f"time() - ({R('colossalai_checkpoint_last_success_timestamp_seconds')}"
                         " > 0)", "rank {{rank}}"),
                   w=8, unit="s", min=0, show_thresholds=True,
                   thresholds=(Step("green"), Step("red", interval.seconds))),
        timeseries("Checkpoint duration",
                   "How long the last checkpoint took, per rank.",
                   Query(R("colossalai_checkpoint_duration_seconds"), "rank {{rank}}"),
                   w=8, unit="s", min=0),
        stat("Last checkpointed step",
             "Step of the last successful checkpoint: where a restart resumes.",
             Query(R("colossalai_checkpoint_last_step"), "rank {{rank}}"), w=8),
        timeseries("Checkpoint failures",
                   "Checkpoints that raised, per rank.",
                   Query("sum by (rank) (increase("
                         f"{R('colossalai_checkpoint_failures_total')}[$__rate_interval]))",
                         "rank {{rank}}"),
                   bars=True, min=0, decimals=0),
        state_timeline("Checkpoint in flight (async included)",
                       "1 while a checkpoint is being written, including an async save "
                       "whose writers the checkpoint IO still holds.",
                       Query(R("colossalai_checkpoint_in_flight"), "rank {{rank}}"),
                       mappings=(ValueText("0", "idle", "transparent"),
                                 ValueText("1", "writing", "yellow"))),
    ))


def gemini_row() -> Row:
    return Row("Gemini", (
        timeseries("Gemini OOM events by device",
                   "Out-of-memory errors raised inside monitored steps and checkpoints, by "
                   "device (cuda, cpu, nvme): GeminiOutOfMemory.",
                   Query("sum by (device) (increase("
                         f"{R('colossalai_gemini_oom_total')}[$__rate_interval]))",
                         "{{device}}"),
                   w=8, bars=True, min=0, decimals=0),
        timeseries("Gemini chunk memory by device",
                   "Memory held by Gemini chunks per rank and device: where placement and "
                   "offload put the parameters.",
                   Query(f"sum by (rank, device) ({R('colossalai_gemini_chunk_memory_bytes')})",
                         "rank {{rank}} {{device}}"),
                   w=8, unit="bytes", min=0),
        timeseries("Gemini host↔device traffic",
                   "Bytes per second Gemini moves from host to device and back.",
                   Query("sum by (rank) (rate("
                         f"{R('colossalai_gemini_h2d_bytes_total')}[$__rate_interval]))",
                         "rank {{rank}} host→device"),
                   Query("sum by (rank) (rate("
                         f"{R('colossalai_gemini_d2h_bytes_total')}[$__rate_interval]))",
                         "rank {{rank}} device→host"),
                   w=8, unit="Bps", min=0),
    ))


def heartbeat_row(config: RulesConfig) -> Row:
    after = config.thresholds.heartbeat_failing_after
    return Row("Heartbeats and the monitor", (
        timeseries("Time since last successful heartbeat",
                   f"Per rank and heartbeat (step, checkpoint). The alert fires when the "
                   f"last success is more than {after} older than the last attempt.",
                   Query(f"time() - {R('colossalai_heartbeat_last_success_timestamp_seconds')}",
                         "rank {{rank}} {{heartbeat}}"),
                   w=8, unit="s", min=0, show_thresholds=True,
                   thresholds=(Step("green"), Step("red", after.seconds))),
        timeseries("Heartbeat sends by result",
                   "Heartbeat pings by result: success, failure, dropped (queue full).",
                   Query("sum by (heartbeat, result) (increase("
                         f"{R('colossalai_heartbeat_sends_total')}[$__rate_interval]))",
                         "{{heartbeat}} {{result}}"),
                   w=8, bars=True, stack=True, min=0),
        timeseries("Monitor errors",
                   "The monitor's own failures by where (it never raises into training).",
                   Query("sum by (where) (increase("
                         f"{R('colossalai_training_monitor_errors_total')}[$__rate_interval]))",
                         "{{where}}"),
                   w=8, bars=True, min=0, decimals=0),
    ))


def build(config: RulesConfig) -> Dashboard:
    training = Selector(config.selectors.training)
    return Dashboard(
        uid=UID,
        title="ColossalAI training",
        description="Phases, step rates, stalls, stragglers, checkpoints, Gemini and "
                    "heartbeats of ColossalAI training runs (colossalai-exporter).",
        variables=(
            variables.datasource(),
            variables.label_values("job", "job", training("colossalai_training_phase")),
            variables.label_values("rank", "rank", JOB("colossalai_training_phase"),
                                   multi=True, numeric=True, all_value=".*"),
        ),
        rows=(status_row(), waiting_row(Selector(config.selectors.node)), progress_row(config),
              goodput_row(config), checkpoint_row(config), gemini_row(), heartbeat_row(config)),
        alerts_annotation='ALERTS{alertstate="firing", job=~"$job"}',
        tags=("training",),
    )
