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
* :func:`streaming_app` streams generations in the three shapes the streaming
  probe reads (probe/stream.py), and misbehaves on request: the first path
  segment picks how (``/wedge/v1/chat/completions``), so that one probe module per
  format meets every failure through the target's path prefix.
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


#: How streaming_app's streams behave, by the first segment of the path.
STREAM_MODES = ("ok", "wedge", "no_first_token", "cut", "drop", "empty", "error", "garbage",
                "forever")


def _openai_chunk(content: str | None = None, finish: str | None = None) -> str:
    delta = {"content": content} if content is not None else {"role": "assistant"}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return f"data: {json.dumps({'object': 'chat.completion.chunk', 'choices': [choice]})}\n\n"


def streaming_app(state: dict[str, Any]) -> FastAPI:
    """Streams in each shape the real servers use; ``state["health"]`` stays 200 whatever the
    streams do (the failure the probe exists for: vLLM #39863).

    * OpenAI-compatible (vLLM, SGLang, TGI): ``POST …/v1/chat/completions``, SSE chunks,
      a role-only first chunk, ``finish_reason`` then ``data: [DONE]``.
    * Colossal-Inference's ``POST …/generate`` with ``"stream": true``: ``{"text": …}``
      objects, the text so far each time, each followed by NUL; no final event.
    * ColossalChat's ``POST …/generate/stream`` (sse-starlette): ``event: generate`` per
      piece of text, ``event: end``, CRLF line ends, ``: ping`` comments.

    Modes: ``ok``; ``wedge`` (two tokens, then nothing, the connection open);
    ``no_first_token`` (the head, then nothing); ``cut`` (two tokens, then the body ends
    without the final event); ``drop`` (two tokens, then the connection is dropped in
    the middle of the chunked body); ``empty`` (the final event, no token); ``error``
    (an error event); ``garbage`` (not the format); ``forever`` (tokens without end,
    50 a second).
    A stream that waits, waits until the client goes: never on a timer.
    """
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    async def hold() -> None:
        await asyncio.Event().wait()  # until the client goes and the task is cancelled

    async def tokens(mode: str, pieces: list[str], final: list[str],
                     error: str, garbage: str | bytes) -> AsyncIterator[str | bytes]:
        state.setdefault("streams", []).append(mode)
        if mode == "no_first_token":
            await hold()
        if mode in ("empty",):
            for piece in final:
                yield piece
            return
        if mode == "error":
            yield error
            await hold()
        if mode == "garbage":
            yield garbage
            await hold()
        while True:
            for piece in pieces if mode in ("ok", "forever") else pieces[:2]:
                yield piece
                # an endless stream paced as a slow model is: it meets the probe's timeout
                await asyncio.sleep(0.02 if mode == "forever" else 0)
            if mode != "forever":
                break
        if mode == "wedge":
            await hold()
        if mode == "drop":
            raise RuntimeError("the engine process died in the middle of the stream")
        if mode == "ok":
            for piece in final:
                yield piece

    def stream(mode: str, body: AsyncIterator[str | bytes], media: str) -> StreamingResponse:
        if mode not in STREAM_MODES:
            raise ValueError(mode)
        return StreamingResponse(body, media_type=media)

    @app.post("/{mode}/v1/chat/completions")
    async def openai(mode: str) -> StreamingResponse:
        pieces = [_openai_chunk(), *(_openai_chunk(t) for t in ("po", "n", "g"))]
        final = [_openai_chunk(finish="stop"), "data: [DONE]\n\n"]
        return stream(mode, tokens(mode, pieces, final,
                                   'data: {"error": {"message": "engine is dead"}}\n\n',
                                   "data: <html>502 Bad Gateway</html>\n\n"),
                      "text/event-stream")

    @app.post("/{mode}/generate")
    async def colossal_inference(mode: str) -> StreamingResponse:
        so_far = ["po", "pon", "pong"]
        pieces = [json.dumps({"text": text}) + "\0" for text in so_far]
        return stream(mode, tokens(mode, pieces, [], "", "not json\0"), "text/plain")

    @app.post("/{mode}/generate/stream")
    async def colossalchat(mode: str) -> StreamingResponse:
        pieces = [": ping\r\n\r\n", *(f"event: generate\r\ndata: {t}\r\n\r\n"
                                        for t in ("po", "n", "g"))]
        final = ["event: end\r\ndata: \r\n\r\n"]
        return stream(mode, tokens(mode, pieces, final, "event: error\r\ndata: engine is "
                                   "dead\r\n\r\n", b"event: generate\r\ndata: \xff\xfe\r\n\r\n"),
                      "text/event-stream")

    return app
