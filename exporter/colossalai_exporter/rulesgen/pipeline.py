"""The pipeline rule file (rules/colossalai-pipeline.rules.yml): the monitoring itself.

Every other alert depends on Prometheus scraping the project's servers and on
Alertmanager's notifications reaching someone through the bridge. These rules
watch that path: targets Prometheus cannot scrape or does not have, the bridge
failing to deliver or falling behind, and the Watchdog, a dead man's switch the
bridge turns into heartbeat pings.
"""

from __future__ import annotations

from colossalai_exporter.rulesgen.config import RulesConfig, Thresholds
from colossalai_exporter.rulesgen.model import Alert, Group, RuleFile
from colossalai_exporter.rulesgen.promql import Selector, expr, fill, number, query

EXPORTER_DOWN_SUMMARY = "Prometheus cannot scrape a colossalai-exporter target."
DELIVERY_SUMMARY = "The bridge cannot deliver to a heartbeat or webhook target."


def pipeline(config: RulesConfig) -> RuleFile:
    """Every pipeline alert, in one group."""
    alerts = Group("colossalai-pipeline.alerts", (
        *exporter_down(config),
        *bridge(Selector(config.selectors.bridge), config.thresholds),
        Alert(
            "Watchdog",
            "vector(1)",
            "info", "The alerting pipeline's dead man's switch (always firing).",
            "This alert always fires. Alertmanager sends it to the bridge every minute and the "
            "bridge pings a heartbeat; when the pings stop, something between Prometheus, "
            "Alertmanager, the bridge and the heartbeat service is broken."),
    ))
    return RuleFile("colossalai-pipeline", (alerts,))


def exporter_down(config: RulesConfig) -> tuple[Alert, ...]:
    """ExporterDown: any target of the project's own servers that Prometheus cannot scrape
    (node agents, the prober's /probe targets, the bridge), deployed or not by this site's
    choice; a job that must exist and has no target at all only where expected_jobs says
    so (a training-only site deploys no prober: its absence is not news)."""
    scraped = dict.fromkeys(Selector(sel)("up") for sel in (
        config.selectors.node, config.selectors.probe, config.selectors.bridge))
    down = Alert(
        "ExporterDown",
        "\nor\n".join(f"{up} == 0" for up in scraped),
        "warning", EXPORTER_DOWN_SUMMARY,
        fill("Prometheus has failed to scrape [[$instance]] of job [[$job]] for [[for]]: "
             "alerts that depend on it are blind.",
             **{"for": config.for_["ExporterDown"]}),
        cause="target_down")
    if not config.expected_jobs:
        return (down,)
    absent = Alert(
        "ExporterDown",
        "\nor\n".join(f'absent(up{{job="{job}"}})' for job in config.expected_jobs),
        "warning", EXPORTER_DOWN_SUMMARY,
        fill("Prometheus has no target for job [[$job]] (service discovery or scrape "
             "config): alerts that depend on it are blind."),
        cause="absent")
    return (down, absent)


def bridge(bridges: Selector, thresholds: Thresholds) -> tuple[Alert, Alert, Alert]:
    """BridgeDeliveryFailing (no success while deliveries wait; dead letters) and
    BridgeQueueBacklog."""
    target = ("job", "instance", "target")
    depth = query("colossalai_bridge_queue_depth", target, "value")
    dead_letters = bridges("colossalai_bridge_dead_letters_total")
    dead_letter_window = thresholds.bridge_dead_letter_window
    return (
        Alert(
            "BridgeDeliveryFailing",
            expr(f"""
                time() - {bridges("colossalai_bridge_last_success_timestamp_seconds")}
                > {number(thresholds.bridge_no_success_after.seconds)}
                and
                  {bridges("colossalai_bridge_queue_depth")} > 0
            """),
            "critical", DELIVERY_SUMMARY,
            fill("The bridge has [[depth]] deliveries pending for target [[$target]] and no "
                 "success for {{ $value | humanizeDuration }}.", depth=depth),
            None, cause="no_success"),
        Alert(
            "BridgeDeliveryFailing",
            expr(f"""
                increase({dead_letters}[{dead_letter_window}])
                > 0
            """),
            "critical", DELIVERY_SUMMARY,
            fill('The bridge gave up on {{ $value | printf "%.0f" }} deliveries to target '
                 "[[$target]] in the last [[window]] (dead letters).",
                 window=dead_letter_window),
            None, cause="dead_letters"),
        Alert(
            "BridgeQueueBacklog",
            expr(f"""
                {bridges("colossalai_bridge_oldest_pending_age_seconds")}
                > {number(thresholds.bridge_oldest_pending_age.seconds)}
            """),
            "warning", "Deliveries are piling up in the bridge.",
            fill("The oldest of [[depth]] pending deliveries to target [[$target]] is "
                 "{{ $value | humanizeDuration }} old (threshold [[limit]]).",
                 depth=depth, limit=thresholds.bridge_oldest_pending_age),
            None),
    )
