"""The chat rule file (rules/colossalai-chat.rules.yml): chat and inference servers, probed.

The prober (probe/) asks each server as a user would and reports whether it
answered, how fast, and why not; these rules page on a server that does not
answer, on one that answers but whose engine reports an error, and on one that
answers but generates nothing (a streaming probe's first token never came, the
stream stalled, or it completed empty: the engine wedged behind a liveness check
that still says 200); they warn on a slow answer, a late first token, and
streams that are cut or stall in more than a share of probes.
"""

from __future__ import annotations

from colossalai_exporter.rulesgen.common import chat_dashboard
from colossalai_exporter.rulesgen.config import RulesConfig
from colossalai_exporter.rulesgen.model import Alert, Group, RuleFile
from colossalai_exporter.rulesgen.promql import (
    Selector,
    expr,
    fill,
    label_is,
    label_is_not,
    number,
    query,
)

ENGINE_ERROR = label_is("reason", "engine_error")
#: a streaming probe got an answer but no generation: ChatGeneratingNothing's
NOTHING_GENERATED = ("first_token_timeout", "token_gap", "empty")
#: a stream that stalled or was cut short: ChatStreamsUnreliable counts them
STREAM_BROKEN = ("truncated", "token_gap")
#: reasons another alert tells better than "does not answer"
NOT_DOWN = ("engine_error", *NOTHING_GENERATED, "truncated")
TARGET = ("job", "instance")
# In deploy/alertmanager/alertmanager.yml each of these mutes the others' symptoms of
# the same server (job and instance): one incident, one page.
CHAT_CAUSE_ALERTS = ("ChatServerDown", "ChatEngineError", "ChatGeneratingNothing")
CHAT_SYMPTOM_ALERTS = ("ChatLatencyHigh", "ChatTimeToFirstTokenHigh", "ChatStreamsUnreliable")


def chat(config: RulesConfig) -> RuleFile:
    """Every chat alert, in one group."""
    probes = Selector(config.selectors.probe)
    apps = Selector(config.selectors.chat_app)
    return RuleFile("colossalai-chat", (Group("colossalai-chat.alerts", (
        server_down(probes, config),
        engine_error(probes, config),
        generating_nothing(probes, config),
        no_progress(apps, config),
        latency_high(probes, config),
        first_token_late(probes, config),
        streams_unreliable(probes, config),
    )),))


def server_down(probes: Selector, config: RulesConfig) -> Alert:
    return Alert(
        "ChatServerDown",
        # An engine error, a generation that never comes and a cut stream have their
        # own, more precise alerts: the server answered those probes.
        expr(f"""
            {probes("probe_success")} == 0
            unless on (job, instance)
              {probes("probe_failure_info", label_is("reason", *NOT_DOWN))}
        """),
        "critical", "A chat or inference server does not answer its probe.",
        fill("Probes of [[$instance]] have failed for [[for]]: [[reason]] (HTTP status "
             "[[status]]).",
             reason=query("probe_failure_info", TARGET, 'label "reason"'),
             status=query("probe_http_status_code", TARGET, "value"),
             **{"for": config.for_["ChatServerDown"]}),
        chat_dashboard())


def engine_error(probes: Selector, config: RulesConfig) -> Alert:
    return Alert(
        "ChatEngineError",
        probes("probe_failure_info", ENGINE_ERROR) + " == 1",
        "critical", "An inference server answers but its engine reports Error.",
        fill("[[$instance]] answers HTTP 200 but its inference engine reports an error "
             "(/engine_check, or an error event in a stream) for [[for]].",
             **{"for": config.for_["ChatEngineError"]}),
        chat_dashboard())


def generating_nothing(probes: Selector, config: RulesConfig) -> Alert:
    return Alert(
        "ChatGeneratingNothing",
        probes("probe_failure_info", label_is("reason", *NOTHING_GENERATED)) + " == 1",
        "critical", "A chat server answers but generates nothing.",
        fill("[[$instance]] answers, but its streamed generations have failed for [[for]]: "
             "{{ $labels.reason }} (first_token_timeout: no token within the module's "
             "limit; token_gap: the stream stalled; empty: it completed with no token); "
             "tokens in the last probe: [[tokens]]. The server's own liveness check may "
             "still say 200.",
             tokens=query("colossalai_probe_stream_tokens", TARGET, "value"),
             **{"for": config.for_["ChatGeneratingNothing"]}),
        chat_dashboard(), cause="probe")


def no_progress(apps: Selector, config: RulesConfig) -> Alert:
    """ChatGeneratingNothing from inside: the FastAPI helper's generation heartbeat."""
    timeout = config.thresholds.chat_progress_timeout
    working = label_is_not("route", "/health", "/metrics")  # the helper's own routes
    return Alert(
        "ChatGeneratingNothing",
        expr(f"""
            time() - {apps("colossalai_chat_last_progress_timestamp_seconds")} > {timeout.seconds:g}
            and on (job, instance)
              sum by (job, instance) ({apps("colossalai_chat_requests_in_flight", working)}) > 0
        """),
        "critical", "A chat server answers but generates nothing.",
        fill("[[$instance]] has had requests in flight and sent no streamed part for "
             "{{ $value | humanizeDuration }} (more than [[timeout]]), for [[for]]: its "
             "engine is wedged behind a live API. The server's own liveness check may "
             "still say 200 unless it uses the helper's progress_timeout.",
             timeout=timeout, **{"for": config.for_["ChatGeneratingNothing"]}),
        chat_dashboard(), cause="heartbeat")


def latency_high(probes: Selector, config: RulesConfig) -> Alert:
    limit = number(config.thresholds.chat_latency_seconds)
    return Alert(
        "ChatLatencyHigh",
        # A streaming probe lasts a whole generation; its latency is the first token's.
        expr(f"""
            {probes("probe_duration_seconds")} > {limit}
            and
              {probes("probe_success")} == 1
            unless on (job, instance)
              {probes("colossalai_probe_stream_tokens")}
        """),
        "warning", "A chat or inference server answers slowly.",
        fill("Probes of [[$instance]] take {{ $value | humanizeDuration }}, above [[limit]]s "
             "for [[for]].", limit=limit, **{"for": config.for_["ChatLatencyHigh"]}),
        chat_dashboard())


def first_token_late(probes: Selector, config: RulesConfig) -> Alert:
    limit = number(config.thresholds.chat_first_token_seconds)
    return Alert(
        "ChatTimeToFirstTokenHigh",
        expr(f"""
            {probes("colossalai_probe_stream_first_token_seconds")} > {limit}
            and on (job, instance)
              {probes("probe_success")} == 1
        """),
        "warning", "A chat server's first token comes late.",
        fill("The first token of [[$instance]]'s streamed answers comes after "
             "{{ $value | humanizeDuration }}, above [[limit]]s for [[for]]: requests wait "
             "in its queue.", limit=limit, **{"for": config.for_["ChatTimeToFirstTokenHigh"]}),
        chat_dashboard())


def streams_unreliable(probes: Selector, config: RulesConfig) -> Alert:
    window = config.thresholds.chat_stream_window
    ratio = number(config.thresholds.chat_stream_failure_ratio)
    broken = probes("probe_failure_info", label_is("reason", *STREAM_BROKEN))
    return Alert(
        "ChatStreamsUnreliable",
        # probe_failure_info exists only while a probe fails; every streaming probe
        # reports colossalai_probe_stream_completed: the share of probes, not of time.
        expr(f"""
            sum by (job, instance) (count_over_time({broken}[{window}]))
            /
            sum by (job, instance) (
              count_over_time({probes("colossalai_probe_stream_completed")}[{window}])
            )
            > {ratio}
        """),
        "warning", "A chat server's streams are cut short or stall too often.",
        fill("{{ $value | humanizePercentage }} of the streamed generations probed on "
             "[[$instance]] in the last [[window]] were cut short or stalled (more than "
             "[[share]]).", window=window, share=f"{float(ratio):.0%}",
             **{"for": config.for_["ChatStreamsUnreliable"]}),
        chat_dashboard())
