"""The in-process server: ``/metrics`` and the tutorial's ``/health`` for one rank.

``/health`` keeps the tutorial's contract: HTTP 200 while the phase is
training or checkpointing (and evaluating, see state.HEALTHY_PHASES), not
stalled, and kernels ready; 503 otherwise. The JSON body has ``status``
("ok" or "degraded"), ``training`` with the tutorial's fields (``status``,
``step``, ``loss``, ``pipeline_stage``, ``gemini_oom_events``,
``last_step_time``, ``last_checkpoint_step``, ``world_size``,
``kernels_compiled``) plus a few of ours, ``stalled`` and ``reason``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import Metric as MetricFamily
from prometheus_client.registry import Collector

from colossalai_exporter.rankstate.families import families
from colossalai_exporter.rankstate.schema import Snapshot
from colossalai_exporter.rankstate.verdict import healthy
from colossalai_exporter.web import (
    App,
    Request,
    Response,
    WebConfig,
    json_response,
    metrics_response,
)
from colossalai_exporter.web.auth import BasicAuthenticator

Snapshotter = Callable[[], Snapshot]


class SnapshotCollector(Collector):
    """Builds the rank's families at scrape time from a fresh snapshot."""

    def __init__(self, snapshot: Snapshotter) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[MetricFamily]:
        yield from families(self._snapshot())


def _number(value: Any) -> Any:
    # JSON has no NaN: a diverged loss is reported as null in /health (the metric keeps NaN).
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def health_body(snap: Snapshot) -> tuple[int, dict[str, Any]]:
    """(status code, JSON body) of ``/health`` for a snapshot."""
    ok = healthy(snap)
    training = {
        "status": snap.phase,
        "step": snap.steps,
        "loss": _number(snap.loss),
        "pipeline_stage": snap.info.get("pipeline_stage"),
        "gemini_oom_events": sum(snap.oom.values()),
        "last_step_time": snap.last_step,
        "last_checkpoint_step": snap.checkpoint.last_step or 0,
        "world_size": snap.world_size,
        "kernels_compiled": snap.kernels_ready,
        "rank": snap.rank,
        "phase_since": snap.phase_start,
        "step_timeout_seconds": snap.timeout,
        "oom_events": snap.oom,
    }
    body = {"status": "ok" if ok else "degraded", "training": training,
            "stalled": snap.stalled, "reason": snap.reason}
    return (200 if ok else 503), body


def build_app(snapshot: Snapshotter, registry: CollectorRegistry | None = None,
              web_config: WebConfig | None = None) -> App:
    """The rank server's routes; ``registry`` defaults to this rank plus process metrics.
    ``web_config``'s basic-auth users and headers apply to every route, as on the
    project's other servers (its TLS settings go to :func:`~colossalai_exporter.web.serve`)."""
    if registry is None:
        registry = CollectorRegistry()
        registry.register(SnapshotCollector(snapshot))
        ProcessCollector(registry=registry)
    web_config = web_config or WebConfig()
    app = App(authenticator=BasicAuthenticator(web_config.basic_auth_users),
              extra_headers=web_config.headers, max_body_bytes=0)

    def metrics(request: Request) -> Response:
        return metrics_response(registry, request)

    def health(request: Request) -> Response:
        status, body = health_body(snapshot())
        return json_response(status, body)

    app.add_route("/metrics", metrics)
    app.add_route("/health", health)
    return app
