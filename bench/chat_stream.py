"""What streaming costs the chat side: the helper per streamed part, the prober per probe.

Run from the repository root (after `bash scripts/install-dev.sh`):

    .venv/bin/python bench/chat_stream.py [--parts 2000] [--rounds 5] [--probes 200]

1. The FastAPI helper's middleware (chat/instrument.py) around an ASGI app that
   streams ``--parts`` parts into a send that does nothing, against the same app
   bare, alternating, best of ``--rounds``; the peer is what a hand-instrumented
   server does per token: one prometheus_client ``Histogram.observe``.
2. The streaming probe (prober stream, in-process) against a plain http.client
   request reading the same stream to its end, alternating, on a uvicorn server on
   loopback that streams 16 tokens at once: the median of each, and the probe's
   overhead (the difference) against the server's own time (the plain request's).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Histogram

from colossalai_exporter.chat.instrument import CHUNK_GAP_BUCKETS, ChatMetrics, MetricsMiddleware
from colossalai_exporter.probe.config import Module, StreamOptions, parse_module
from colossalai_exporter.probe.modules import Probe
from colossalai_exporter.probe.targets import AllowList, parse_target
from colossalai_exporter.web import serve

PART = b'data: {"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'


def streaming_asgi(parts: int) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(parts):
            await send({"type": "http.response.body", "body": PART, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def nothing(message: Any) -> None:
    return None


async def receive() -> Any:
    return {"type": "http.request", "body": b"", "more_body": False}


def time_requests(app: Any, requests: int) -> float:
    scope = {"type": "http", "method": "GET", "path": "/generate/stream",
             "headers": [], "query_string": b""}

    async def run() -> float:
        start = time.perf_counter()
        for _ in range(requests):
            await app(scope, receive, nothing)
        return time.perf_counter() - start

    return asyncio.run(run())


def helper_per_part(parts: int, rounds: int) -> None:
    bare = streaming_asgi(parts)
    wrapped = MetricsMiddleware(bare, ChatMetrics(), routes=[])
    histogram = Histogram("bench_gap_seconds", "g", buckets=CHUNK_GAP_BUCKETS,
                          registry=CollectorRegistry())
    requests = 20
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, app in (("bare", bare), ("helper", wrapped)):
            seconds = time_requests(app, requests)
            best[name] = min(best.get(name, seconds), seconds)
        start = time.perf_counter()
        for _ in range(requests * parts):
            histogram.observe(0.02)
        best["observe"] = min(best.get("observe", 1e9), time.perf_counter() - start)
    total = requests * parts
    per = {k: v / total * 1e9 for k, v in best.items()}
    print(f"helper, {requests} streams x {parts} parts, best of {rounds}: ns per part")
    print(f"  bare app                         {per['bare']:8.0f}")
    print(f"  with the helper                  {per['helper']:8.0f}")
    print(f"  helper's cost per part           {per['helper'] - per['bare']:8.0f}")
    print(f"  peer: Histogram.observe() once   {per['observe']:8.0f}")


def stand_in() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def completions() -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            for _ in range(16):
                yield PART
            yield b"data: [DONE]\n\n"

        return StreamingResponse(parts(), media_type="text/event-stream")

    return app


def plain_request(host: str, port: int, body: bytes) -> float:
    start = time.perf_counter()
    connection = http.client.HTTPConnection(host, port, timeout=10)
    connection.request("POST", "/v1/chat/completions", body=body,
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    assert data.endswith(b"[DONE]\n\n")
    return time.perf_counter() - start


def probe_overhead(probes: int) -> None:
    handle = serve(stand_in(), "127.0.0.1:0", None, name="bench-stand-in")
    try:
        url = handle.url
        module: Module = parse_module("stream", {"prober": "stream"}, "bench: modules.stream",
                                      Path.cwd())
        assert module.stream == StreamOptions()
        target = parse_target(url, "http")
        host, port = target.host, target.port
        body = module.http.body or json.dumps({}).encode()
        timings: dict[str, list[float]] = {"plain": [], "probe": []}
        for _ in range(probes):
            timings["plain"].append(plain_request(host, port, body))
            probe = Probe(module, target, AllowList(), module.timeout)
            outcome = probe.execute()
            assert outcome.success, outcome.message
            timings["probe"].append(outcome.duration)
    finally:
        handle.stop(5)
    plain, probe_time = (statistics.median(timings[k]) * 1e3 for k in ("plain", "probe"))
    print(f"probe, {probes} of each alternating, 16 tokens a stream: median ms")
    print(f"  plain http.client to the end     {plain:8.3f}")
    print(f"  streaming probe (in-process)     {probe_time:8.3f}")
    print(f"  probe's overhead                 {probe_time - plain:8.3f} "
          f"({(probe_time - plain) / plain:+.0%} of the server's time)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--probes", type=int, default=200)
    args = parser.parse_args()
    helper_per_part(args.parts, args.rounds)
    probe_overhead(args.probes)


if __name__ == "__main__":
    main()
