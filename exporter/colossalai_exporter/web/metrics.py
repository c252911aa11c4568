"""Serve a prometheus_client registry: text format, or OpenMetrics when asked through Accept."""

from __future__ import annotations

from prometheus_client.registry import Collector

from colossalai_exporter.web.app import Request, Response
from colossalai_exporter.web.exposition import encode


def metrics_response(registry: Collector, request: Request) -> Response:
    body, content_type = encode(registry, request.header("accept") or "")
    return Response(200, body, content_type=content_type)
