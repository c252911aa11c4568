"""GPU hardware: Xid errors and the GPU's own health verdicts.

GPUXidCritical, GPUXidWarning and GPUXidRecurring from the Xid events;
GPURecoveryActionRequired, GPURowRemapFailure, GPURowRemapPending,
GPURetiredPagesHigh, GPUPCIeReplaysHigh and GPUClockSlowdown from what NVML
reports of the GPU (node/gpu/health.py). The critical ones are cause alerts, as
a critical Xid is.

The node agent counts the Xid events the driver logs, by code, with each code's
tier, meaning and action from the catalog (node/gpu/xid.py). A critical Xid is
a cause alert: it names the GPU and the ranks on it, and mutes their deaths,
stalls and hangs (deploy/alertmanager/alertmanager.yml), so it carries the run
of the ranks on its node.
"""

from __future__ import annotations

from colossalai_exporter.node.gpu import xid
from colossalai_exporter.node.gpu.health import RECOVERY_ACTION_WORDS
from colossalai_exporter.rulesgen.common import (
    INFO,
    nodes_dashboard,
    recent_events,
    with_node_run,
)
from colossalai_exporter.rulesgen.config import Duration, RulesConfig, Thresholds
from colossalai_exporter.rulesgen.model import Alert
from colossalai_exporter.rulesgen.promql import (
    Selector,
    choose,
    expr,
    fill,
    label_is,
    label_is_not,
    matching,
    number,
    printf_query,
    quoted,
)
from colossalai_exporter.rulesgen.verdict import recovery_remedy, xid_remedy

XID_EVENTS = "colossalai_gpu_xid_events_total"
# One GPU, one page (deploy/alertmanager/alertmanager.yml): a GPU that needs action
# before it runs a job again mutes its own warnings, which that action covers.
GPU_CAUSE_ALERTS = ("GPUXidCritical", "GPURecoveryActionRequired", "GPURowRemapFailure",
                    "GPUNVLinkDown")
GPU_WARNING_ALERTS = ("GPUXidWarning", "GPUXidRecurring", "GPURowRemapPending",
                      "GPURetiredPagesHigh", "GPUNVLinkErrors", "GPUSramErrorsHigh")
# An uncorrectable ECC error is what Xid 48, 94 and 95 report too: the Xid's page, with
# its code, is the one; the counter pages alone where the agent missed the event (it
# was restarted after it).
ECC_ALERT = "GPUEccUncorrectable"
# "GPU recovery action changed" (driver 570 and later): its action is "read the GPU's
# recovery action and do what it says". Where the agent reads that action
# (colossalai_gpu_recovery_action_info), GPURecoveryActionRequired says it, with
# the ranks: the Xid would be a second page for the same thing, so it tells only
# where the action cannot be read.
RECOVERY_ACTION_XID = "154"


def tier_is(*tiers: str) -> str:
    """A matcher for the Xid tiers ``tiers``, which must be the catalog's (node/gpu/xid.py)."""
    unknown = sorted(set(tiers) - set(xid.TIERS))
    if unknown:
        raise ValueError(f"not a tier of node.gpu.xid.TIERS: {unknown}")
    return label_is("tier", *tiers)


def xid_action_words() -> str:
    """The alert's ``action`` label in words (a Go template chain)."""
    words = xid.actions()
    fallback = words.pop(xid.LOOK_UP)
    return choose("$labels.action", ((quoted(key), text) for key, text in words.items()),
                  fallback)


def xid_after_reboot() -> str:
    """" It came back after a reboot: seen in 2 boots …" where the agent's state directory
    shows the GPU had the same code in an earlier boot (node/gpu/xid_history.py)."""
    boots = printf_query(
        matching("colossalai_gpu_xid_boots", ("job", "instance", "gpu", "xid"), " >= 2"),
        "$labels.job $labels.instance $labels.gpu $labels.xid")
    return (f"{{{{ with {boots} }}}}{{{{ with first . }}}} It came back after a reboot: seen "
            'in {{ .Value | printf "%.0f" }} boots of this node, so the reboot did not fix '
            "it: replace the GPU (RMA).{{ end }}{{ end }}")


def xid_ranks() -> str:
    """" Ranks on this GPU: 5." where the agent saw which ranks ran on the GPU (NVML's
    processes), else " Ranks of this run on the node: 0 1 2 3." for an alert with a
    ``run`` label."""
    on_gpu = printf_query(matching("colossalai_gpu_rank_info", ("job", "instance", "gpu")),
                          "$labels.job $labels.instance $labels.gpu")
    on_node = printf_query(matching(INFO, ("job", "instance", "run")),
                           "$labels.job $labels.instance .")
    return (f'{{{{ with {on_gpu} | sortByLabel "rank" }}}} Ranks on this GPU:{{{{ range . }}}} '
            "{{ .Labels.rank }}{{ end }}.{{ else }}"
            f'{{{{ with $labels.run }}}}{{{{ with {on_node} | sortByLabel "rank" }}}} Ranks of '
            "this run on the node:{{ range . }} {{ .Labels.rank }}{{ end }}.{{ end }}{{ end }}"
            "{{ end }}")


def xid_warnings(node_agents: Selector, window: Duration) -> str:
    """Warning-tier (and unknown) Xids within ``window``; the recovery-action Xid only
    on a GPU whose recovery action the agent cannot read."""
    warning = tier_is("warning", "unknown")
    others = recent_events(node_agents(XID_EVENTS, warning,
                                       label_is_not("xid", RECOVERY_ACTION_XID)), window)
    recovery = recent_events(node_agents(XID_EVENTS, warning,
                                         label_is("xid", RECOVERY_ACTION_XID)), window)
    readable = node_agents("colossalai_gpu_recovery_action_info")
    return (f"(\n{others}\n)\nor\n(\n(\n{recovery}\n)\n"
            f"unless on (job, instance, gpu) {readable}\n)")


def gpu_xids(node_agents: Selector, thresholds: Thresholds) -> tuple[Alert, ...]:
    """Xid events by the catalog's tier: critical pages, naming the GPU, what the code
    means, what to do and the ranks of the run on that node (it mutes their deaths,
    stalls and hangs, alertmanager.yml); warning tells; application-class codes only
    when they keep coming back on one GPU."""
    critical = with_node_run(recent_events(node_agents(XID_EVENTS, tier_is("critical")),
                                           thresholds.gpu_xid_window))
    count, window = thresholds.gpu_xid_recurring_count, thresholds.gpu_xid_recurring_window
    return (
        Alert(
            "GPUXidCritical", critical, "critical",
            "A GPU reported an Xid error that needs the node drained.",
            fill("GPU [[$gpu]] on [[$instance]]: Xid [[$xid]], [[$what]] — [[action]]."
                 "[[reboots]][[ranks]]", action=xid_action_words(), reboots=xid_after_reboot(),
                 ranks=xid_ranks()),
            nodes_dashboard(), subsystem="gpu", remedy=xid_remedy()),
        Alert(
            "GPUXidWarning",
            xid_warnings(node_agents, thresholds.gpu_xid_window),
            "warning", "A GPU reported an Xid error to act on at the next drain.",
            fill("GPU [[$gpu]] on [[$instance]]: Xid [[$xid]], [[$what]] — [[action]].",
                 action=xid_action_words()),
            nodes_dashboard(), subsystem="gpu", remedy=xid_remedy()),
        Alert(
            "GPUXidRecurring",
            recent_events(node_agents(XID_EVENTS, tier_is("application")), window,
                          condition=f">= {count}"),
            "warning", "An application-class Xid keeps coming back on one GPU.",
            fill("GPU [[$gpu]] on [[$instance]]: Xid [[$xid]] ([[$what]]) {{ $value | "
                 'printf "%.0f" }} times in [[window]]. One job\'s bug raises it anywhere; '
                 "on one GPU again and again it points at the GPU: drain the node and run "
                 "the GPU's diagnostics (dcgmi diag -r 3).", window=window),
            nodes_dashboard(), subsystem="gpu", remedy="drain"),
    )


def recovery_action_words() -> str:
    """The alert's ``action`` label as an instruction (a Go template chain)."""
    return choose("$labels.action",
                  ((quoted(key), text) for key, text in RECOVERY_ACTION_WORDS.items()),
                  "see NVIDIA's documentation of this recovery action")


#: the clock event reasons the agent exports (node/gpu/health.SLOWDOWN_REASONS), in words
SLOWDOWN_WORDS = {
    "hw_slowdown": "hardware slowdown (HW_SLOWDOWN: the board's thermal or power limit)",
    "sw_thermal_slowdown": "thermal slowdown (the driver's temperature limit)",
    "hw_thermal_slowdown": "hardware thermal slowdown",
    "hw_power_brake_slowdown": "power brake slowdown (the power supply asserted it)",
}


def rank_gpu_slowdowns(by_run: bool) -> str:
    """Template text: " Its GPU 5 on node-7:9466 is in thermal slowdown (…)." for each
    slowdown active now on a GPU the alert's rank ran on (NVML's processes matched to the
    rank's pid, colossalai_gpu_rank_info); nothing when there is none. ``by_run``: the
    alert has a ``run`` label, which picks the rank's node when several runs share ranks'
    numbers; without it, every node where a rank of that number runs is looked at."""
    run = ', run="%s"' if by_run else ""
    promql = ("colossalai_gpu_clock_slowdown_active == 1 "
              'and on (job, instance, gpu) colossalai_gpu_rank_info{rank="%s"} '
              f'and on (job, instance) {INFO}{{rank="%s"{run}}}')
    args = "$labels.rank $labels.rank" + (" $labels.run" if by_run else "")
    words = choose(".Labels.reason", ((quoted(key), text) for key, text in SLOWDOWN_WORDS.items()),
                   "{{ .Labels.reason }}")
    return (f"{{{{ range {printf_query(promql, args)} }}}} Its GPU {{{{ .Labels.gpu }}}} on "
            f"{{{{ .Labels.instance }}}} is in {words}.{{{{ end }}}}")


def nvlink_down(node_agents: Selector, th: Thresholds) -> Alert:
    """GPUNVLinkDown: fewer links active than a peer GPU of the node has (every GPU of an
    HGX board has all its links up), or than the GPU itself had lately (a link that
    went down on every GPU at once: an NVSwitch). A cause alert, as a critical Xid."""
    active = node_agents("colossalai_gpu_nvlink_links_active")
    condition = expr(f"""
        (
          {active}
            < on (job, instance) group_left ()
              max by (job, instance) ({active})
        )
        or
        (
          {active}
            < max_over_time({active}[{th.gpu_nvlink_down_memory}])
        )
    """)
    links = printf_query(matching("colossalai_gpu_nvlink_links", ("job", "instance", "gpu")),
                         "$labels.job $labels.instance $labels.gpu")
    return Alert(
        "GPUNVLinkDown", with_node_run(condition),
        "critical", "NVLink links of a GPU are down.",
        fill("GPU [[$gpu]] on [[$instance]]: {{ $value }} of {{ with " + links +
             " }}{{ . | first | value }}{{ else }}its{{ end }} NVLink links active — drain "
             "the node and reset the GPU (nvidia-smi -r); if a link stays down, the GPU or "
             "its NVSwitch board needs service.[[ranks]]", ranks=xid_ranks()),
        nodes_dashboard(), subsystem="nvlink", remedy="reset_gpu")


def ecc_errors(node_agents: Selector, th: Thresholds) -> tuple[Alert, Alert]:
    """GPUEccUncorrectable: an uncorrectable ECC error since the driver loaded, in the
    HBM or on chip (healthagent: any is an error; NHC fails an H100 on one in SRAM); it
    stays until the GPU is reset. Muted under GPUXidCritical of its GPU (Xid 48, 94, 95
    say the same with the code). GPUSramErrorsHigh: many correctable SRAM errors (NHC's
    H100 limit, 10,000), which ends in uncorrectable ones."""
    ecc = "colossalai_gpu_ecc_volatile_errors_total"
    uncorrected = with_node_run(
        f"sum without (location) ({node_agents(ecc, label_is('type', 'uncorrected'))}) > 0")
    locations = printf_query(f'{ecc}{{job=%q,instance=%q,gpu=%q,type="uncorrected"}} > 0',
                             "$labels.job $labels.instance $labels.gpu")
    return (
        Alert(
            "GPUEccUncorrectable", uncorrected,
            "critical", "A GPU had an uncorrectable ECC error since its driver loaded.",
            fill("GPU [[$gpu]] on [[$instance]]: {{ $value | printf \"%.0f\" }} "
                 "uncorrectable ECC error(s) since the driver loaded (in "
                 "{{ range $i, $s := " + locations + ' | sortByLabel "location" }}'
                 "{{ if $i }}, {{ end }}"
                 "{{ $s.Labels.location }}{{ end }}) — drain the node and reset the GPU; "
                 "if it comes back, replace the GPU.[[ranks]]", ranks=xid_ranks()),
            nodes_dashboard(), subsystem="gpu", remedy="reset_gpu"),
        Alert(
            "GPUSramErrorsHigh",
            f"{node_agents(ecc, label_is('type', 'corrected'), label_is('location', 'sram'))}"
            f"\n  > {th.gpu_sram_corrected_errors}",
            "warning", "A GPU's on-chip memory (SRAM) corrects many errors.",
            fill("GPU [[$gpu]] on [[$instance]]: {{ $value | printf \"%.0f\" }} correctable "
                 "SRAM errors since the driver loaded (over [[limit]]): on-chip memory "
                 "failing; drain the node at the next chance and replace the GPU if it "
                 "keeps counting after a reset.", limit=th.gpu_sram_corrected_errors),
            nodes_dashboard(), subsystem="gpu", remedy="reset_gpu"),
    )


def nvlink_errors(node_agents: Selector, th: Thresholds) -> Alert:
    """GPUNVLinkErrors: NVLink error counters that keep rising (NVRx's windowed test).
    Counters alone warn; they do not page (DCGM dropped its BER checks as false
    positives), so it ships record-only."""
    errors = node_agents("colossalai_gpu_nvlink_errors_total")
    minutes, window = th.gpu_nvlink_error_minutes, th.gpu_nvlink_error_window
    # "Higher than a minute before", not increase(x[1m]): Prometheus 3's ranges leave
    # out their first instant, so a 1m range over an agent scraped every minute holds
    # one sample, and increase() of one sample is nothing: the alert would never fire.
    # A reset reads negative here and skips that one minute, which a warning can lose.
    return Alert(
        "GPUNVLinkErrors",
        expr(f"""
            count_over_time(({errors} - {errors} offset 1m > 0)[{window}:1m])
              > {minutes}
        """),
        "warning", "A GPU's NVLink keeps counting errors.",
        fill("GPU [[$gpu]] on [[$instance]]: NVLink {{ $labels.kind }} errors in "
             "{{ $value }} of the last [[window]]'s minutes (over [[minutes]]): read them "
             "per link (nvidia-smi nvlink -e -i <gpu>) and reset the GPU at the next drain; "
             "a link that keeps counting needs service.", window=window, minutes=minutes),
        nodes_dashboard(), subsystem="nvlink", remedy="reset_gpu")


def gpu_health(node_agents: Selector, config: RulesConfig) -> tuple[Alert, ...]:
    """What NVML says of the GPU itself: the recovery action it asks for and a failed
    row remap page (and, with the ranks of the run, mute their consequences); a pending
    remap, many retired pages, PCIe replays and hardware slowdowns tell."""
    th = config.thresholds
    action = node_agents("colossalai_gpu_recovery_action_info", label_is_not("action", "none"))
    return (
        Alert(
            "GPURecoveryActionRequired", with_node_run(action),
            "critical", "NVML asks for a recovery action on a GPU.",
            fill("GPU [[$gpu]] on [[$instance]]: NVML asks for {{ $labels.action }} — "
                 "[[words]].[[ranks]]", words=recovery_action_words(), ranks=xid_ranks()),
            nodes_dashboard(), subsystem="gpu", remedy=recovery_remedy()),
        Alert(
            "GPURowRemapFailure",
            with_node_run(node_agents("colossalai_gpu_row_remap_failed") + " == 1"),
            "critical", "A GPU failed to remap a memory row: it has no spare rows left.",
            fill("GPU [[$gpu]] on [[$instance]]: a row remap failed, the GPU's memory has no "
                 "spare rows left — drain the node and replace the GPU (RMA).[[ranks]]",
                 ranks=xid_ranks()),
            nodes_dashboard(), subsystem="gpu", remedy="replace"),
        nvlink_down(node_agents, th),
        *ecc_errors(node_agents, th),
        Alert(
            "GPURowRemapPending", node_agents("colossalai_gpu_row_remap_pending") + " == 1",
            "warning", "A GPU has a row remap waiting for its next reset.",
            fill("GPU [[$gpu]] on [[$instance]]: a memory row remap waits for the next GPU "
                 "reset — reset the GPU at the next drain (until then the bad row is "
                 "still in use)."),
            nodes_dashboard(), subsystem="gpu", remedy="reset_gpu"),
        Alert(
            "GPURetiredPagesHigh",
            expr(f"""
                sum without (kind) ({node_agents("colossalai_gpu_retired_pages")})
                  >= {th.gpu_retired_pages}
            """),
            "warning", "A GPU has retired many memory pages.",
            fill("GPU [[$gpu]] on [[$instance]] has retired {{ $value }} memory pages "
                 "(at [[limit]] or more; the table holds about 64): drain the node and run "
                 "the GPU's diagnostics; replace it when the table is full.",
                 limit=th.gpu_retired_pages),
            nodes_dashboard(), subsystem="gpu", remedy="drain"),
        Alert(
            "GPUPCIeReplaysHigh",
            expr(f"""
                rate({node_agents("colossalai_gpu_pcie_replays_total")}[5m]) * 60
                  > {number(th.gpu_pcie_replays_per_minute)}
            """),
            "warning", "A GPU's PCIe link retries often.",
            fill("GPU [[$gpu]] on [[$instance]]: {{ $value | printf \"%.0f\" }} PCIe replays "
                 "a minute (above [[limit]]): a marginal slot, riser or cable — reseat or "
                 "replace it at the next drain.",
                 limit=number(th.gpu_pcie_replays_per_minute)),
            nodes_dashboard(), subsystem="gpu", remedy="drain"),
        Alert(
            "GPUClockSlowdown",
            expr(f"""
                avg_over_time((
                  max without (reason) ({node_agents("colossalai_gpu_clock_slowdown_active")})
                )[{th.gpu_clock_slowdown_window}:1m])
                  >= {number(th.gpu_clock_slowdown_share)}
            """),
            "warning", "The hardware keeps slowing a GPU down.",
            fill("GPU [[$gpu]] on [[$instance]] was slowed down by the hardware (thermal, "
                 "power brake or HW slowdown) {{ $value | humanizePercentage }} of the last "
                 "[[window]]: check its cooling and power; every rank of a synchronous job "
                 "waits for it.", window=th.gpu_clock_slowdown_window),
            nodes_dashboard(), subsystem="gpu", remedy="drain"),
        nvlink_errors(node_agents, th),
    )
