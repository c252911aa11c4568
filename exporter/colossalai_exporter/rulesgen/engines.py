"""The inference engines' own queues (rules/colossalai-chat-engines.rules.yml): optional.

For sites whose chat servers export their own metrics (vLLM's ``vllm:*``,
SGLang's ``sglang:*``, TGI's ``tgi_*``) or report their queue through the
FastAPI helper (``set_queue``): requests queued while none runs (admission
stalled: the scheduler or the engine is wedged, the failure of vLLM #39863 as
the server itself counts it), and a mean queue time over a limit. The alerts
users wrote for these servers after their own outages, with their thresholds
(../shared/research/health-signals-2026-12.md §3.2): defilantech/LLMKube PR
#1624. A file of its own: a site without such servers leaves it out.
"""

from __future__ import annotations

from colossalai_exporter.rulesgen.common import chat_dashboard
from colossalai_exporter.rulesgen.config import RulesConfig
from colossalai_exporter.rulesgen.model import Alert, Group, RuleFile
from colossalai_exporter.rulesgen.promql import (
    Selector,
    block,
    expr,
    fill,
    histogram_rate,
    number,
)

# Names the servers document, listed with their sources in catalogue.ENGINE_METRICS
# (tests/test_rules_promtool.py holds every rule to the catalogue and that list).
#: (queued, running) gauges of each server, in its own names, and ours (set_queue)
QUEUES = (
    ("vllm:num_requests_waiting", "vllm:num_requests_running"),
    ("sglang:num_queue_reqs", "sglang:num_running_reqs"),
    ("tgi_queue_size", "tgi_batch_current_size"),
    ("colossalai_chat_requests_waiting", "colossalai_chat_requests_running"),
)
#: histograms of the time a request waited before it was scheduled
QUEUE_TIMES = ("vllm:request_queue_time_seconds", "tgi_request_queue_duration")


def engines(config: RulesConfig) -> RuleFile:
    servers = Selector(config.selectors.engine)
    return RuleFile("colossalai-chat-engines", (Group("colossalai-chat-engines.alerts", (
        admission_stalled(servers, config),
        queue_time_high(servers, config),
    )),))


def _by_server(vector: str) -> str:
    return f"sum by (job, instance) ({vector})"


def admission_stalled(servers: Selector, config: RulesConfig) -> Alert:
    stalled = "\nor\n".join(
        f"{_by_server(servers(queued))} > 0\n"
        f"  and on (job, instance) {_by_server(servers(running))} == 0"
        for queued, running in QUEUES)
    return Alert(
        "InferenceAdmissionStalled", stalled,
        "critical", "An inference server has requests queued and none running.",
        fill("[[$instance]] has had {{ $value }} requests queued and none running for "
             "[[for]]: its scheduler or engine is not admitting work.",
             **{"for": config.for_["InferenceAdmissionStalled"]}),
        chat_dashboard())


def queue_time_high(servers: Selector, config: RulesConfig) -> Alert:
    window = config.thresholds.engine_queue_window
    limit = number(config.thresholds.engine_queue_seconds)
    def rate(name: str, part: str) -> str:
        # classic or converted to a native histogram at scrape (promql.histogram_rate)
        return block(histogram_rate(servers, name, part, str(window)), "sum by (job, instance)")

    mean = "\nor\n".join(
        f"{rate(name, 'sum')}\n/\n{rate(name, 'count')}\n> {limit}"
        for name in QUEUE_TIMES)
    return Alert(
        "InferenceQueueTimeHigh", expr(mean),
        "warning", "Requests wait long in an inference server's queue.",
        fill("Requests to [[$instance]] have waited {{ $value | humanizeDuration }} on "
             "average before being scheduled over the last [[window]], above [[limit]]s.",
             window=window, limit=limit,
             **{"for": config.for_["InferenceQueueTimeHigh"]}),
        chat_dashboard())
