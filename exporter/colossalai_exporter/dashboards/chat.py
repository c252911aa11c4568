"""ColossalAI chat: the prober's view of chat and inference servers, and the app's own metrics.

``job`` and ``instance`` are the prober's scrape job and probed target (the
blackbox relabel pattern makes the target the instance), matching the chat
alerts' links. ``app_job`` is the scrape job of chat apps instrumented with
the FastAPI helper: a different target (the app's own /metrics) whose
instance is its host:port, not the probed URL.
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
from colossalai_exporter.rulesgen.config import RulesConfig
from colossalai_exporter.rulesgen.promql import Selector, histogram_quantile, number

UID = "colossalai-chat"

P = Selector('job=~"$job", instance=~"$instance"')
APP = Selector('job=~"$app_job"')


def probe_row(config: RulesConfig) -> Row:
    slow = config.thresholds.chat_latency_seconds
    return Row("Probes", (
        table("Firing alerts",
              "Alerts firing now for the selected targets (Prometheus' ALERTS series).",
              Query('ALERTS{alertstate="firing", job=~"$job", instance=~"$instance"}',
                    table=True), w=12, h=7),
        stat("Probe success", "The last probe of each target: ChatServerDown when failing.",
             Query(P("probe_success"), "{{instance}}"), w=12, h=7,
             thresholds=(Step("red"), Step("green", 1)),
             mappings=(ValueText("1", "ok", "green"), ValueText("0", "failing", "red"))),
        state_timeline("Probe success over time",
                       "Each target's probe result over the time range.",
                       Query(P("probe_success"), "{{instance}}"), w=24, h=6,
                       mappings=(ValueText("1", "ok", "green"),
                                 ValueText("0", "failing", "red"))),
        timeseries("Probe duration",
                   f"How long each probe took, name resolution included. Above "
                   f"{number(slow)}s on a successful probe for 5 minutes is ChatLatencyHigh.",
                   Query(P("probe_duration_seconds"), "{{instance}}"),
                   unit="s", min=0, show_thresholds=True,
                   thresholds=(Step("green"), Step("red", slow))),
        timeseries("Probe phases",
                   "Time the probe's HTTP requests spent in each phase: resolve, connect, "
                   "tls, processing (until the response head), transfer (the body).",
                   Query(P("probe_http_duration_seconds"), "{{instance}} {{phase}}"),
                   unit="s", min=0, stack=True),
        stat("HTTP status code",
             "Status code of each probe's last response; 0 when none arrived.",
             Query(P("probe_http_status_code"), "{{instance}}"), w=8,
             thresholds=(Step("red"), Step("green", 200), Step("orange", 300),
                         Step("red", 500))),
        timeseries("Failing probes by reason",
                   "Targets whose last probe failed, by reason (engine_error: the engine "
                   "reports Error under HTTP 200, ChatEngineError).",
                   Query(f"count by (reason) ({P('probe_failure_info')})", "{{reason}}"),
                   w=8, bars=True, stack=True, min=0, decimals=0),
        table("Current failure reasons",
              "One row per failing target with its reason: dns, refused, unreachable, "
              "timeout, tls, connection, protocol, status, body, engine_error, loading, "
              "config; for streaming probes first_token_timeout, token_gap, truncated, "
              "empty.", Query(P("probe_failure_info"), table=True), w=8),
        state_timeline("Probe steps",
                       "Each step of a multi-request probe (ping, engine_check, openapi, "
                       "docs, root, health, generate, stream, …): tells a dead process from "
                       "a dead engine.",
                       Query(P("colossalai_probe_step_success"), "{{instance}} {{step}}"),
                       w=24, h=6,
                       mappings=(ValueText("1", "pass", "green"),
                                 ValueText("0", "fail", "red"))),
    ))


def stream_row(config: RulesConfig) -> Row:
    """Streaming probes (prober stream): whether the engine generates, and how fast."""
    late = config.thresholds.chat_first_token_seconds
    window = config.thresholds.chat_stream_window
    broken = 'reason=~"truncated|token_gap"'
    return Row("Streamed generations", (
        timeseries("Time to first token",
                   "From the start of each streaming probe's request to its first non-empty "
                   f"token. Above {number(late)}s on a passing probe for 5 minutes is "
                   "ChatTimeToFirstTokenHigh; no token within the module's limit fails the "
                   "probe (ChatGeneratingNothing).",
                   Query(P("colossalai_probe_stream_first_token_seconds"), "{{instance}}"),
                   unit="s", min=0, show_thresholds=True,
                   thresholds=(Step("green"), Step("orange", late))),
        timeseries("Longest gap between tokens",
                   "The longest wait between two tokens of each probe's stream; over the "
                   "module's max_token_gap the probe fails with token_gap.",
                   Query(P("colossalai_probe_stream_max_token_gap_seconds"), "{{instance}}"),
                   unit="s", min=0),
        timeseries("Tokens per second",
                   "Tokens per second after the first, in each probe's stream.",
                   Query(P("colossalai_probe_stream_tokens_per_second"), "{{instance}}"),
                   w=8, min=0),
        timeseries("Streams completed",
                   f"Share of streaming probes over {window} that reached their final event "
                   "([DONE], a finish_reason, end).",
                   Query(f"avg_over_time({P('colossalai_probe_stream_completed')}[{window}])",
                         "{{instance}}"), w=8, unit="percentunit", min=0, max=1),
        timeseries("Streams cut or stalled",
                   f"Share of streaming probes over {window} that ended before their final "
                   "event (truncated) or stalled (token_gap): ChatStreamsUnreliable above "
                   f"{number(config.thresholds.chat_stream_failure_ratio)}.",
                   Query(f"(sum by (instance) (count_over_time({P('probe_failure_info', broken)}"
                         f"[{window}])) or sum by (instance) (0 * count_over_time("
                         f"{P('colossalai_probe_stream_completed')}[{window}])))"
                         f" / sum by (instance) (count_over_time("
                         f"{P('colossalai_probe_stream_completed')}[{window}]))",
                         "{{instance}}"), w=8, unit="percentunit", min=0),
    ))


def app_row() -> Row:
    def quantile(q: float) -> str:
        return histogram_quantile(q, APP, "colossalai_chat_request_duration_seconds",
                                  ("route",), "$__rate_interval")

    return Row("Chat server (FastAPI helper)", (
        timeseries("Requests per second",
                   "Finished requests by route template and status code.",
                   Query("sum by (route, status) (rate("
                         f"{APP('colossalai_chat_requests_total')}[$__rate_interval]))",
                         "{{route}} {{status}}"),
                   unit="reqps", min=0),
        timeseries("Request latency",
                   "Median (solid) and 95th percentile (dashed) time from a request's "
                   "arrival to the end of its response body (a stream to its last event).",
                   Query(quantile(0.5), "{{route}} p50"),
                   Query(quantile(0.95), "{{route}} p95"),
                   unit="s", min=0, dashed=("B",)),
        timeseries("Requests in flight", "Requests being served now, streams included.",
                   Query(f"sum by (route) ({APP('colossalai_chat_requests_in_flight')})",
                         "{{route}}"), w=8, min=0),
        timeseries("Errors by kind",
                   "Requests that raised (exception) or answered 5xx (status_5xx).",
                   Query("sum by (route, kind) (rate("
                         f"{APP('colossalai_chat_request_errors_total')}[$__rate_interval]))",
                         "{{route}} {{kind}}"), w=8, unit="reqps", bars=True, min=0),
        state_timeline("Ready",
                       "The app's ready() check, as its /health answers: loading until the "
                       "model is up.",
                       Query(APP("colossalai_chat_ready"), "{{instance}}"), w=8,
                       mappings=(ValueText("1", "ready", "green"),
                                 ValueText("0", "loading", "orange"))),
    ))


def build(config: RulesConfig) -> Dashboard:
    probe = Selector(config.selectors.probe)
    return Dashboard(
        uid=UID,
        title="ColossalAI chat",
        description="Chat and inference servers as colossalai-exporter's prober sees them "
                    "(success, latency, status codes, failure reasons) and the request "
                    "metrics of apps instrumented with its FastAPI helper.",
        variables=(
            variables.datasource(),
            variables.label_values("job", "job", probe("probe_success")),
            variables.label_values("instance", "instance",
                                   Selector('job=~"$job"')("probe_success"),
                                   multi=True, all_value=".*"),
            variables.label_values("app_job", "job", "colossalai_chat_ready"),
        ),
        rows=(probe_row(config), stream_row(config), app_row()),
        alerts_annotation='ALERTS{alertstate="firing", job=~"$job", instance=~"$instance"}',
        tags=("chat",),
    )
