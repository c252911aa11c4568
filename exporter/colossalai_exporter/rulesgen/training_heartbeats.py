"""Heartbeats: TrainingHeartbeatFailing, a rank's pings to an outside service failing.

A run may ping a heartbeat service (training/heartbeat.py), which reports the run
down when the pings stop. When they fail while the run is healthy, that report is
wrong: these rules say so, from the rank's own counts of its attempts and
successes.
"""

from __future__ import annotations

from colossalai_exporter.rulesgen.common import training_dashboard
from colossalai_exporter.rulesgen.config import Duration
from colossalai_exporter.rulesgen.model import Alert
from colossalai_exporter.rulesgen.promql import Selector, expr, fill, number

SUMMARY = "A training heartbeat ping has not succeeded for several periods."


def heartbeats_failing(rank_servers: Selector, after: Duration) -> tuple[Alert, Alert]:
    """TrainingHeartbeatFailing: no success for ``after`` since the last attempt, or pings
    failing or dropped and none succeeding over ``after``."""
    sends = "colossalai_heartbeat_sends_total"
    return (
        Alert(
            "TrainingHeartbeatFailing",
            expr(f"""
                  {rank_servers("colossalai_heartbeat_last_attempt_timestamp_seconds")}
                - {rank_servers("colossalai_heartbeat_last_success_timestamp_seconds")}
                > {number(after.seconds)}
            """),
            "warning", SUMMARY,
            fill("Heartbeat [[$heartbeat]] of rank [[$rank]] in job [[$job]] last succeeded "
                 "{{ $value | humanizeDuration }} before its last attempt; the heartbeat "
                 "service will report this run down although it may be healthy."),
            training_dashboard(), cause="no_success"),
        Alert(
            "TrainingHeartbeatFailing",
            expr(f"""
                sum by (job, instance, rank, heartbeat) (
                  increase({rank_servers(sends, 'result!="success"')}[{after}])
                ) > 0
                unless
                sum by (job, instance, rank, heartbeat) (
                  increase({rank_servers(sends, 'result="success"')}[{after}])
                ) > 0
            """),
            "warning", SUMMARY,
            fill('Heartbeat [[$heartbeat]] of rank [[$rank]] in job [[$job]]: '
                 '{{ $value | printf "%.0f" }} pings failed or were dropped in the last '
                 "[[window]] and none succeeded.", window=after),
            training_dashboard(), cause="sends_failing"),
    )
