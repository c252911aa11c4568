"""The chat rule file (rules/colossalai-chat.rules.yml): chat and inference servers, probed.

The prober (probe/) asks each server as a user would and reports whether it
answered, how fast, and why not; these rules page on a server that does not
answer or whose engine reports an error, and warn on one that answers slowly.
"""

from __future__ import annotations

from colossalai_exporter.rulesgen.common import chat_dashboard
from colossalai_exporter.rulesgen.config import RulesConfig
from colossalai_exporter.rulesgen.model import Alert, Group, RuleFile
from colossalai_exporter.rulesgen.promql import Selector, expr, fill, number, query

ENGINE_ERROR = 'reason="engine_error"'


def chat(config: RulesConfig) -> RuleFile:
    """Every chat alert, in one group."""
    probes = Selector(config.selectors.probe)
    target = ("job", "instance")
    latency_limit = number(config.thresholds.chat_latency_seconds)
    alerts = Group("colossalai-chat.alerts", (
        Alert(
            "ChatServerDown",
            # An engine error has its own, more precise alert.
            expr(f"""
                {probes("probe_success")} == 0
                unless on (job, instance)
                  {probes("probe_failure_info", ENGINE_ERROR)}
            """),
            "critical", "A chat or inference server does not answer its probe.",
            fill("Probes of [[$instance]] have failed for [[for]]: [[reason]] (HTTP status "
                 "[[status]]).",
                 reason=query("probe_failure_info", target, 'label "reason"'),
                 status=query("probe_http_status_code", target, "value"),
                 **{"for": config.for_["ChatServerDown"]}),
            chat_dashboard()),
        Alert(
            "ChatEngineError",
            probes("probe_failure_info", ENGINE_ERROR) + " == 1",
            "critical", "An inference server answers but its engine reports Error.",
            fill("[[$instance]] answers HTTP 200 but its inference engine reports Error "
                 "(/engine_check) for [[for]].", **{"for": config.for_["ChatEngineError"]}),
            chat_dashboard()),
        Alert(
            "ChatLatencyHigh",
            expr(f"""
                {probes("probe_duration_seconds")} > {latency_limit}
                and
                  {probes("probe_success")} == 1
            """),
            "warning", "A chat or inference server answers slowly.",
            fill("Probes of [[$instance]] take {{ $value | humanizeDuration }}, above [[limit]]s "
                 "for [[for]].", limit=latency_limit,
                 **{"for": config.for_["ChatLatencyHigh"]}),
            chat_dashboard()),
    ))
    return RuleFile("colossalai-chat", (alerts,))
