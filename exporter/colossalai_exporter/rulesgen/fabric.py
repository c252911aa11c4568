"""The fabric: InfiniBand and RoCE ports of the nodes, from either exporter.

The node agent's infiniband collector and node_exporter's serve the same port
series under two prefixes (``colossalai_infiniband_state_id``,
``node_infiniband_state_id`` …) and two instances of one host (``node-7:9466``,
``node-7:9100``). The recording rules first put both on one ``node`` label (the
instance without its port) and keep one series a port, so the alerts work
whichever a site runs, and page once where it runs both.

* InfiniBandPortDown: a port that was active within the memory window (24 h) and
  is not now, for 4 m (gpud's drop: down for 4 minutes). A port that never came up
  (not cabled) is not a drop; InfiniBandPortsMissing counts active ports against
  what the site expects. A cause alert: it names the run on the node and mutes
  the run's stalls, hangs and deaths, which follow from it.
* InfiniBandPortFlapping: ``link_downed`` rose 3 times or more within 12 h (gpud:
  3 flaps in 12 h; NHC: 5 in 24 h), or a RoCE port's interface changed carrier twice
  as often (the agent's only: ``link_downed`` does not count an Ethernet link's
  flaps); the window keeps it firing after the link comes back (the sticky recovery
  the health tools use).
* InfiniBandSymbolErrors: more than 120 symbol errors in an hour (the IBTA bit
  error rate NVSentinel thresholds); record-only.
* InfiniBandTransportErrors: the adapter's transport timed out or gave up
  (hw_counters: acks not received, retries exhausted) within an hour, links up: a
  lossy fabric; record-only.
* InfiniBandPortsMissing: fewer active ports on a node than
  ``infiniband_expected_ports`` (gpud: 8 for H100 and H200 nodes); off at 0.

The group runs every minute (``infiniband_evaluation_interval``): the 24 h memory
reads a day of the one-minute recorded series, not of every scrape.
"""

from __future__ import annotations

from colossalai_exporter.node.infiniband import PHYSICAL_WORDS
from colossalai_exporter.rulesgen.common import INFO, NODE_RUN
from colossalai_exporter.rulesgen.config import RulesConfig, Thresholds
from colossalai_exporter.rulesgen.model import Alert, Group, Recording
from colossalai_exporter.rulesgen.promql import (
    Selector,
    choose,
    expr,
    indent,
    label_is,
    printf_query,
)

STATE = "node_device_port:colossalai_infiniband_state_id:max"
#: One node's fabric, one page (deploy/alertmanager/alertmanager.yml): a port down mutes
#: the node's other fabric alerts, equal on ``node``.
FABRIC_CAUSE = "InfiniBandPortDown"
FABRIC_SYMPTOMS = ("InfiniBandPortFlapping", "InfiniBandSymbolErrors",
                   "InfiniBandTransportErrors", "InfiniBandPortsMissing")
PHYSICAL_STATE = "node_device_port:colossalai_infiniband_physical_state_id:max"
ACTIVE = "node_device_port:colossalai_infiniband_active:max"
#: node_exporter's infiniband collector's names for what the agent serves
NODE_EXPORTER = {
    "colossalai_infiniband_state_id": "node_infiniband_state_id",
    "colossalai_infiniband_physical_state_id": "node_infiniband_physical_state_id",
    "colossalai_infiniband_link_downed_total": "node_infiniband_link_downed_total",
    "colossalai_infiniband_symbol_error_total": "node_infiniband_symbol_error_total",
}


#: label_replace's arguments giving a series a ``node`` label: its instance without
#: the port, the one name both exporters of a host share (node-7:9466, node-7:9100)
NODE_OF_INSTANCE = '"node", "$1", "instance", "(.+?)(?::[0-9]+)?"'


def on_node(vector: str) -> str:
    """``vector`` with a ``node`` label (NODE_OF_INSTANCE)."""
    return f"label_replace(\n{indent(vector)},\n  {NODE_OF_INSTANCE}\n)"


class Ports:
    """One series a port, from the node agents and from node_exporter, by ``node``."""

    def __init__(self, config: RulesConfig) -> None:
        ports = config.selectors.rdma_ports
        self.agents = Selector(config.selectors.node)
        self.node_exporter = Selector(config.selectors.node_exporter)
        self.ports = ports.strip().strip("{}").strip()

    def agent(self, metric: str, *extra: str) -> str:
        """``metric`` from the node agents only, for the rdma_ports selected."""
        return self.agents(metric, *((self.ports,) if self.ports else ()), *extra)

    def either(self, metric: str, over: str = "", also: str = "") -> str:
        """``metric`` from either exporter, by node and port; ``over`` wraps each source's
        series (``increase(%s[12h])``); ``also`` is a third source, of the agent's alone
        (told apart by a label of its own, so that ``or`` keeps it beside the others)."""
        extra = (self.ports,) if self.ports else ()
        sources = [self.agents(metric, *extra), self.node_exporter(NODE_EXPORTER[metric], *extra)]
        if over:
            sources = [over % source for source in sources]
        sources += [also] if also else []
        either = on_node("\nor\n".join(sources))
        return f"max by (node, device, port) (\n{indent(either)}\n)"


def with_node_run_by_name(vector: str) -> str:
    """``vector`` (by ``node``) with the run started last on that node, as
    common.with_node_run does by the agent's instance (from its NODE_RUN, recorded by
    the node alerts' group); values kept."""
    starts = on_node(NODE_RUN)
    latest = f"topk by (node) (1, max by (node, run) (\n{indent(starts, 4)}\n  ))"
    return (f"(\n  (\n{indent(vector, 4)}\n  )\n  + on (node) group_left (run)\n"
            f"    (0 * {latest})\n"
            f"  or\n  (\n{indent(vector, 4)}\n  )\n  unless on (node)\n{indent(starts, 4)}\n)")


def port_and_node(kind: str = "Port") -> str:
    return f"{kind} {{{{ $labels.device }}}}/{{{{ $labels.port }}}} on {{{{ $labels.node }}}}"


def physical_state_words() -> str:
    """" (physical state: polling: it sees no peer …)" for the alert's port."""
    current = printf_query(f'{PHYSICAL_STATE}{{node=%q,device=%q,port=%q}}',
                           "$labels.node $labels.device $labels.port")
    chain = choose(".Value", ((f"{state}.0", words) for state, words in PHYSICAL_WORDS.items()),
                   "{{ .Value }}")
    return (f"{{{{ with {current} }}}}{{{{ with first . }}}} (physical state: {chain})"
            "{{ end }}{{ end }}")


def node_ranks(agents: Selector) -> str:
    """" Ranks of run r on the node: 0 1 2." for an alert with ``node`` and ``run``."""
    info = printf_query(f"label_replace({agents(INFO, 'run=%q')}, {NODE_OF_INSTANCE})",
                        "$labels.run")
    return ("{{ with $labels.run }}{{ $node := $labels.node }} Ranks of run {{ . }} on the "
            f'node:{{{{ range {info} | sortByLabel "rank" }}}}{{{{ if eq .Labels.node $node }}}}'
            " {{ .Labels.rank }}{{ end }}{{ end }}.{{ end }}")


def fabric(config: RulesConfig) -> Group:
    """The recording rules that join the two exporters, then the port alerts."""
    ports = Ports(config)
    th = config.thresholds
    return Group("colossalai-node.fabric", (
        Recording(STATE, ports.either("colossalai_infiniband_state_id")),
        Recording(PHYSICAL_STATE, ports.either("colossalai_infiniband_physical_state_id")),
        # ACTIVE (4) and ACT_DEFER (5) carry traffic.
        Recording(ACTIVE, f"{STATE} >= bool 4"),
        port_down(ports.agents, th),
        Alert(
            "InfiniBandPortFlapping",
            ports.either("colossalai_infiniband_link_downed_total",
                         over=_increase(th.infiniband_flap_window),
                         also=roce_flaps(ports, th.infiniband_flap_window))
            + f"\n  >= {th.infiniband_flaps}",
            "warning", "An InfiniBand or RoCE link keeps going down and coming back.",
            port_and_node("Port") + " went down {{ $value | printf \"%.0f\" }} times in the "
            f"last {th.infiniband_flap_window} ({th.infiniband_flaps} or more): a flapping "
            "link stalls every collective each time it drops. Reseat or replace the cable "
            "at the next drain and read the switch port's errors.",
            subsystem="infiniband", remedy="drain"),
        Alert(
            "InfiniBandSymbolErrors",
            ports.either("colossalai_infiniband_symbol_error_total", over=_increase("1h"))
            + f"\n  > {th.infiniband_symbol_errors_per_hour}",
            "warning", "An InfiniBand or RoCE port receives bit errors.",
            port_and_node("Port") + " received {{ $value | printf \"%.0f\" }} symbol errors "
            f"in the last hour (over {th.infiniband_symbol_errors_per_hour}: the bit error "
            "rate the fabric's health tools act on). Clean or replace the cable or "
            "transceiver at the next drain.",
            subsystem="infiniband", remedy="drain"),
        transport_errors(ports, th),
        *ports_missing(ports, th),
    ), interval=str(th.infiniband_evaluation_interval))


def roce_flaps(ports: Ports, window: object) -> str:
    """A RoCE port's flaps: its interface's carrier changes over ``window``, two a flap
    (``link_downed`` does not count an Ethernet link's)."""
    changes = ports.agent("colossalai_infiniband_carrier_changes_total")
    return f'label_replace(increase({changes}[{window}]) / 2, "via", "carrier", "", "")'


#: the hw_counters that say the transport gave up or timed out (node/infiniband.HW_ERRORS)
TRANSPORT_ERRORS = ("local_ack_timeout_err", "rnr_nak_retry_err",
                    "req_transport_retries_exceeded")


def transport_errors(ports: Ports, th: Thresholds) -> Alert:
    """InfiniBandTransportErrors: the adapter's transport timing out or giving up on its
    peers while the links are up: a lossy fabric (RoCE without PFC, a congested or
    failing switch), which NCCL meets as timeouts. Record-only as shipped."""
    errors = ports.agent("colossalai_infiniband_hw_errors_total",
                         label_is("kind", *TRANSPORT_ERRORS))
    return Alert(
        "InfiniBandTransportErrors",
        on_node(f"sum without (kind) (increase({errors}[1h]))")
        + f"\n  > {th.infiniband_transport_errors_per_hour}",
        "warning", "An InfiniBand or RoCE port's transport keeps timing out.",
        port_and_node("Port") + "'s adapter counted {{ $value | printf \"%.0f\" }} "
        "transport timeouts and give-ups in the last hour (acks not received, retries "
        f"exhausted; over {th.infiniband_transport_errors_per_hour}) while its link is up: "
        "packets are lost on the way. Read the port's hw_counters and the switch's "
        "discards; on RoCE check PFC and ECN on the switch port. Drain the node if only "
        "its ports count them.",
        subsystem="infiniband", remedy="drain")


def _increase(window: object) -> str:
    return f"increase(%s[{window}])"


def port_down(agents: Selector, th: Thresholds) -> Alert:
    down = expr(f"""
        {ACTIVE} == 0
        and on (node, device, port)
          max_over_time({ACTIVE}[{th.infiniband_down_memory}]) == 1
    """)
    return Alert(
        "InfiniBandPortDown", with_node_run_by_name(down),
        "critical", "An InfiniBand or RoCE port that was active is down.",
        port_and_node("Port") + f" is down{physical_state_words()}; it was active within "
        f"the last {th.infiniband_down_memory}. The ranks using it lose their collectives: "
        "drain the node, reseat or replace the cable and check the switch port."
        + node_ranks(agents),
        subsystem="infiniband", remedy="drain")


def ports_missing(ports: Ports, th: Thresholds) -> tuple[Alert, ...]:
    """InfiniBandPortsMissing: ports that stopped reporting on a node whose exporter
    answers (an adapter gone: a firmware fatal error, a failed reset, its PCIe link
    down), and, where the site says how many a node has, fewer active than that."""
    answering = on_node(f"{ports.agents('up')} == 1\nor\n{ports.node_exporter('up')} == 1")
    vanished = with_node_run_by_name(
        f"max_over_time({ACTIVE}[{th.infiniband_down_memory}]) == 1\n"
        f"unless on (node, device, port)\n  {ACTIVE}\n"
        f"and on (node)\n{indent(answering)}")
    rules = [Alert(
        "InfiniBandPortsMissing", vanished,
        "critical", "A node has fewer active InfiniBand or RoCE ports than it should.",
        port_and_node("Port") + " stopped reporting, while its node's exporter answers: its "
        "adapter is gone (a firmware fatal error, a reset that failed, its PCIe link down) "
        "or its driver stopped answering. Drain the node; read `dmesg | grep mlx5` and "
        "reseat or replace the adapter." + node_ranks(ports.agents),
        cause="vanished", subsystem="infiniband", remedy="drain")]
    if th.infiniband_expected_ports > 0:
        # Only where the site says how many: nodes differ, and a port never cabled
        # is not a failure of its own.
        nodes = f"0 * count by (node) ({on_node(ports.agents('up'))})"
        rules.append(Alert(
            "InfiniBandPortsMissing",
            f"(\n  count by (node) ({ACTIVE} == 1)\n  or\n{indent(nodes)}\n)\n"
            f"  < {th.infiniband_expected_ports}",
            "critical", "A node has fewer active InfiniBand or RoCE ports than it should.",
            "{{ $labels.node }} has {{ $value | printf \"%.0f\" }} active RDMA ports, fewer "
            f"than the {th.infiniband_expected_ports} its nodes have: an adapter missing, a "
            "port never cabled or down since boot. Drain it and check `ibstat` and the "
            "cables before it runs a multi-node job.", cause="expected",
            subsystem="infiniband", remedy="drain"))
    return tuple(rules)
