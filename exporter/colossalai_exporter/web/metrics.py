"""Serve a prometheus_client registry: text format, or OpenMetrics when asked through Accept.

Bodies are gzip-compressed when the scraper accepts gzip (Prometheus always
asks, ``Accept-Encoding: gzip``) and the body is at least
:data:`GZIP_MIN_BYTES`. Below that, compression buys nothing: a body that
fits in TCP's initial congestion window (10 segments, about 14 KB) arrives
in one round trip either way, and compressing it would only spend CPU on
both ends — in the training process too, for rank 0's server. A node
agent with many local ranks, or the bridge with many targets, crosses it.
"""

from __future__ import annotations

import zlib

from prometheus_client.registry import Collector

from colossalai_exporter.web.app import Request, Response
from colossalai_exporter.web.exposition import encode

GZIP_MIN_BYTES = 14 * 1024
# zlib's fastest level: exposition text still shrinks 5-8x (repetitive names
# and labels), at a fraction of the default level's CPU.
GZIP_LEVEL = 1
# The representation depends on these request headers (RFC 9110, section 12.5.5).
VARY = ("Vary", "Accept, Accept-Encoding")


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` value allows gzip (RFC 9110, section 12.5.3).

    ``gzip`` or its alias ``x-gzip`` with a non-zero weight, or ``*`` with a
    non-zero weight when gzip is not listed itself.
    """
    star: bool | None = None
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip().lower()
        if not coding:
            continue
        weight = 1.0
        for param in params.split(";"):
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    weight = float(value.strip())
                except ValueError:
                    weight = 0.0  # a malformed weight: do not guess in the client's favour
        if coding in ("gzip", "x-gzip"):
            return weight > 0
        if coding == "*":
            star = weight > 0
    return bool(star)


def compress(body: bytes, accept_encoding: str) -> tuple[bytes, list[tuple[str, str]]]:
    """``body`` gzip-compressed if the client accepts it and it is worth it; extra headers."""
    if len(body) < GZIP_MIN_BYTES or not accepts_gzip(accept_encoding):
        return body, [VARY]
    # wbits 31: a gzip member (header and CRC), as Content-Encoding: gzip requires.
    packer = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)
    return packer.compress(body) + packer.flush(), [VARY, ("Content-Encoding", "gzip")]


def metrics_response(registry: Collector, request: Request) -> Response:
    body, content_type = encode(registry, request.header("accept") or "")
    body, headers = compress(body, request.header("accept-encoding") or "")
    return Response(200, body, headers, content_type=content_type)
