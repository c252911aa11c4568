"""The node's hardware verdict: per subsystem pass, warn or critical, and what the node needs.

Every hardware alert carries two labels: ``subsystem`` (the part of the node it
judges: ``gpu``, ``nvlink``, ``infiniband``) and ``remedy`` (what the node needs,
a key of :data:`REMEDIES`, least to most). The pages show the remedy in their first
line (deploy/alertmanager/templates/slack.tmpl), and a site may route on it (a
``remedy="replace"`` page to the team that swaps parts).

The verdict is not judged a second time: it is the summary of the hardware alerts
firing now, recorded per node (the alerts already hold the history, windows and
recurrence a one-off look cannot):

* ``node_subsystem:colossalai_hardware_verdict:max{node, subsystem}``: 0 pass, 1 warn,
  2 critical, for every node whose agent or node_exporter answers and every subsystem;
* ``node:colossalai_hardware_remedy:max{node, remedy}``: one series a node, the most
  its firing alerts ask for (``none`` when nothing does); its value is the remedy's
  place in :data:`REMEDIES`, so ``> 1`` selects the nodes that need hands on them.

Record-only alerts are left out (they are visible, not acted on, until promoted),
as are alerts about the agent itself. ``colossalai-exporter node check`` is the
same judgement once, without history, for a scheduler's health check.
"""

from __future__ import annotations

from collections.abc import Mapping

from colossalai_exporter.node.gpu import xid
from colossalai_exporter.rulesgen.fabric import NODE_OF_INSTANCE, Ports, on_node
from colossalai_exporter.rulesgen.model import Group, Recording
from colossalai_exporter.rulesgen.promql import choose, indent, matching, printf_query, quoted

SUBSYSTEMS = ("gpu", "nvlink", "infiniband")
#: what a node needs, least to most, with the words of a page's first line
REMEDIES = {
    "none": "no action",
    "restart_job": "restart the job",
    "reset_gpu": "drain, reset the GPU",
    "reboot": "drain, reboot",
    "drain": "drain for service",
    "replace": "drain, replace the part",
}
#: the Xid catalog's actions (node/gpu/xid_catalog.yml) as remedies
XID_REMEDIES = {
    "drain_reboot": "reboot",
    "drain_reset_gpu": "reset_gpu",
    "drain_check_memory": "reset_gpu",
    "drain_check_nvlink": "reset_gpu",
    "replace_gpu": "replace",
    "reset_when_drained": "reset_gpu",
    "read_recovery_action": "drain",
    "restart_job": "restart_job",
    "none": "none",
    xid.LOOK_UP: "drain",
}
#: NVML's recovery actions (node/gpu/health.py) as remedies
RECOVERY_REMEDIES = {
    "gpu_reset": "reset_gpu",
    "node_reboot": "reboot",
    "drain_p2p": "reset_gpu",
    "drain_and_reset": "reset_gpu",
    "bus_reset": "reboot",
    "system_reboot": "reboot",
}
VERDICT = "node_subsystem:colossalai_hardware_verdict:max"
REMEDY = "node:colossalai_hardware_remedy:max"
_FIRING = 'ALERTS{alertstate="firing", subsystem!="", record_only!="true"'


def remedy_of(label: str, mapping: Mapping[str, str], otherwise: str) -> str:
    """A label template: the remedy for the alert's ``label`` by ``mapping``."""
    by_remedy: dict[str, list[str]] = {}
    for value, remedy in mapping.items():
        by_remedy.setdefault(remedy, []).append(value)
    return choose(f"$labels.{label}",
                  ((quoted(*values), remedy) for remedy, values in by_remedy.items()), otherwise)


def xid_remedy() -> str:
    """GPUXidCritical's and GPUXidWarning's remedy: the catalog action's, or ``replace``
    where the same code on the same GPU came back after a reboot (gpu.xid_after_reboot)."""
    boots = printf_query(
        matching("colossalai_gpu_xid_boots", ("job", "instance", "gpu", "xid"), " >= 2"),
        "$labels.job $labels.instance $labels.gpu $labels.xid")
    return (f"{{{{ with {boots} }}}}replace{{{{ else }}}}"
            f"{remedy_of('action', XID_REMEDIES, 'drain')}{{{{ end }}}}")


def recovery_remedy() -> str:
    return remedy_of("action", RECOVERY_REMEDIES, "drain")


def verdict_group(ports: Ports, interval: str | None = None) -> Group:
    """The two recording rules of the module docstring."""
    nodes = on_node(f"{ports.agents('up')}\nor\n{ports.node_exporter('up')}")
    every = "\nor\n".join(
        f'label_replace(0 * group by (node) (\n{indent(nodes, 2)}\n), '
        f'"subsystem", "{s}", "", "")' for s in SUBSYSTEMS)
    levels = f'2 * {_FIRING}, severity="critical"}}\nor\n{_FIRING}, severity="warning"}}'
    verdict = (f"max by (node, subsystem) (\n  label_replace(\n{indent(levels, 4)},\n"
               f"    {NODE_OF_INSTANCE}\n  )\n)\nor\n{every}")
    ranked = "\nor\n".join(f'{rank} * {_FIRING}, remedy="{remedy}"}}'
                           for rank, remedy in enumerate(REMEDIES) if rank)
    none = (f'label_replace(0 * group by (node) (\n{indent(nodes, 2)}\n), '
            '"remedy", "none", "", "")')
    remedy = (f"topk by (node) (1,\n  max by (node, remedy) (\n    label_replace(\n"
              f"{indent(ranked, 6)},\n      {NODE_OF_INSTANCE}\n    )\n  )\n)\n"
              f"or on (node)\n{none}")
    return Group("colossalai-node.verdict",
                 (Recording(VERDICT, verdict), Recording(REMEDY, remedy)), interval=interval)

