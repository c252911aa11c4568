"""Small FastAPI apps served by real uvicorn on loopback, standing in for ColossalAI's servers.

These are the fakes of the probe and chat tests, each mimicking one real server:

* :func:`inference_app` mimics Colossal-Inference's API server
  (``colossalai/inference/server/api_server.py``, see ../shared/FACTS.md):
  ``GET /ping`` always answers 200 ``{"status": "Healthy"}``, ``GET /engine_check``
  answers HTTP 200 with ``{"status": "Running"}`` or, once the engine loop died,
  still HTTP 200 with ``{"status": "Error"}``. Tests flip ``state["engine"]``.
* :func:`colossalchat_app` mimics ColossalChat's web chatbot server: only
  ``POST /generate`` and ``POST /generate/stream`` (server-sent events), no health
  route; FastAPI's own ``/openapi.json`` and ``/docs`` unless switched off.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from colossalai_exporter.web import serve
from colossalai_exporter.web.config import TLSConfig, WebConfig


def inference_app(state: dict[str, Any]) -> FastAPI:
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, str]:
        return {"status": "Healthy"}

    @app.get("/engine_check")
    def engine_check() -> dict[str, str]:
        return {"status": state.get("engine", "Running")}

    return app


class Dialogue(BaseModel):
    instruction: str
    response: str = ""


class GenerationTaskReq(BaseModel):
    max_new_tokens: int
    history: list[Dialogue]


def colossalchat_app(state: dict[str, Any], *, openapi: bool = True,
                     stream_delay: float = 0.05) -> FastAPI:
    """ColossalChat-style server; ``state["generated"]`` counts generations."""
    app = FastAPI(openapi_url="/openapi.json" if openapi else None,
                  docs_url="/docs" if openapi else None, redoc_url=None)

    @app.post("/generate")
    def generate(data: GenerationTaskReq, request: Request) -> dict[str, str]:
        state["generated"] = state.get("generated", 0) + 1
        state["authorization"] = request.headers.get("authorization")
        return {"response": "pong " * min(data.max_new_tokens, 4)}

    @app.post("/generate/stream")
    async def generate_stream(data: GenerationTaskReq) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            for i in range(min(data.max_new_tokens, 6)):
                await asyncio.sleep(stream_delay)
                yield f"data: {json.dumps({'token': i})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextmanager
def served(app: Any, web_config: WebConfig | None = None) -> Iterator[str]:
    """Serve ``app`` with real uvicorn on a free loopback port; yields its base URL."""
    handle = serve(app, "127.0.0.1:0", web_config, name="test-target")
    try:
        yield handle.url
    finally:
        handle.stop(5)


@contextmanager
def silent_listener() -> Iterator[int]:
    """A port that accepts TCP connections (the kernel's backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield int(sock.getsockname()[1])


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, made with the openssl CLI."""
    cert, key = directory / "server.crt", directory / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=30)
    return cert, key


def tls_web_config(cert: Path, key: Path) -> WebConfig:
    return WebConfig(tls=TLSConfig(cert_file=cert, key_file=key))


@contextmanager
def raw_server(reply: bytes) -> Iterator[int]:
    """A TCP server that answers every connection with ``reply`` and closes it.

    ``b""`` closes without a byte (what a crashing server does); anything that is
    not an HTTP status line is a broken server or another protocol on the port.
    """
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.settimeout(0.2)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                    if reply:
                        conn.sendall(reply)
                except OSError:
                    pass

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield int(sock.getsockname()[1])
    finally:
        stop.set()
        thread.join(5)
        sock.close()
