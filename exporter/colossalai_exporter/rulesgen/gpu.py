"""GPU Xid errors: GPUXidCritical, GPUXidWarning, GPUXidRecurring.

The node agent counts the Xid events the driver logs, by code, with each code's
tier, meaning and action from the catalog (node/gpu/xid.py). A critical Xid is
a cause alert: it names the GPU and the ranks on it, and mutes their deaths,
stalls and hangs (deploy/alertmanager/alertmanager.yml), so it carries the run
of the ranks on its node.
"""

from __future__ import annotations

from colossalai_exporter.node.gpu import xid
from colossalai_exporter.rulesgen.common import INFO, nodes_dashboard, recent_events, with_run
from colossalai_exporter.rulesgen.config import Thresholds
from colossalai_exporter.rulesgen.model import Alert
from colossalai_exporter.rulesgen.promql import (
    Selector,
    fill,
    label_is,
    matching,
    printf_query,
)

XID_EVENTS = "colossalai_gpu_xid_events_total"


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
    chain = "".join(f'{{{{ {"if" if i == 0 else "else if"} eq $labels.action "{key}" }}}}'
                    f"{text}" for i, (key, text) in enumerate(words.items()))
    return chain + "{{ else }}" + fallback + "{{ end }}"


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


def gpu_xids(node_agents: Selector, thresholds: Thresholds) -> tuple[Alert, ...]:
    """Xid events by the catalog's tier: critical pages, naming the GPU, what the code
    means, what to do and the ranks of the run on that node (it mutes their deaths,
    stalls and hangs, alertmanager.yml); warning tells; application-class codes only
    when they keep coming back on one GPU."""
    node_labels = ("job", "instance")
    critical = with_run(recent_events(node_agents(XID_EVENTS, tier_is("critical")),
                                      thresholds.gpu_xid_window), node_agents, node_labels)
    count, window = thresholds.gpu_xid_recurring_count, thresholds.gpu_xid_recurring_window
    return (
        Alert(
            "GPUXidCritical", critical, "critical",
            "A GPU reported an Xid error that needs the node drained.",
            fill("GPU [[$gpu]] on [[$instance]]: Xid [[$xid]], [[$what]] — [[action]]."
                 "[[ranks]]", action=xid_action_words(), ranks=xid_ranks()),
            nodes_dashboard()),
        Alert(
            "GPUXidWarning",
            recent_events(node_agents(XID_EVENTS, tier_is("warning", "unknown")),
                          thresholds.gpu_xid_window),
            "warning", "A GPU reported an Xid error to act on at the next drain.",
            fill("GPU [[$gpu]] on [[$instance]]: Xid [[$xid]], [[$what]] — [[action]].",
                 action=xid_action_words()),
            nodes_dashboard()),
        Alert(
            "GPUXidRecurring",
            recent_events(node_agents(XID_EVENTS, tier_is("application")), window,
                          condition=f">= {count}"),
            "warning", "An application-class Xid keeps coming back on one GPU.",
            fill("GPU [[$gpu]] on [[$instance]]: Xid [[$xid]] ([[$what]]) {{ $value | "
                 'printf "%.0f" }} times in [[window]]. One job\'s bug raises it anywhere; '
                 "on one GPU again and again it points at the GPU: drain the node and run "
                 "the GPU's diagnostics (dcgmi diag -r 3).", window=window),
            nodes_dashboard()),
    )
