"""Serve a prometheus_client registry: text format, or OpenMetrics when asked through Accept."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from colossalai_exporter.web.app import Request, Response


def metrics_response(registry: CollectorRegistry, request: Request) -> Response:
    encoder, content_type = choose_encoder(request.header("accept") or "")
    return Response(200, encoder(registry), content_type=content_type)
