"""colossalai_exporter.chat.instrument on a real FastAPI app served by real uvicorn."""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from prometheus_client.parser import text_string_to_metric_families

from chat_servers import colossalchat_app, served
from colossalai_exporter import catalogue
from colossalai_exporter.chat import instrument
from conftest import http_get, require_binary, wait_until

BODY = json.dumps({"max_new_tokens": 4, "history": [{"instruction": "hi"}]}).encode()


def samples(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, _, body = http_get(url + "/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def post(url: str, path: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url + path, data=BODY,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.read()


@pytest.fixture(scope="module")
def chat() -> Iterator[dict[str, Any]]:
    state: dict[str, Any] = {"loaded": False}
    app = colossalchat_app(state, stream_delay=0.1)

    @app.get("/items/{item_id}")
    def item(item_id: int) -> dict[str, int]:
        return {"item": item_id}

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("engine exploded")

    metrics = instrument(app, ready=lambda: state["loaded"])
    with served(app) as url:
        yield {"url": url, "state": state, "metrics": metrics, "app": app}


def test_health_loading_then_ok(chat: dict[str, Any]) -> None:
    chat["state"]["loaded"] = False
    status, _, body = http_get(chat["url"] + "/health")
    payload = json.loads(body)
    assert status == 503
    assert payload["status"] == "loading"
    assert payload["uptime_seconds"] >= 0
    assert samples(chat["url"])[("colossalai_chat_ready", frozenset())] == 0.0
    chat["state"]["loaded"] = True
    status, _, body = http_get(chat["url"] + "/health")
    assert status == 200
    assert json.loads(body)["status"] == "ok"
    assert samples(chat["url"])[("colossalai_chat_ready", frozenset())] == 1.0


def test_app_routes_untouched_and_counted_by_template(chat: dict[str, Any]) -> None:
    status, body = post(chat["url"], "/generate")
    assert status == 200
    assert json.loads(body)["response"].startswith("pong")
    for n in (1, 2, 3):
        assert http_get(f"{chat['url']}/items/{n}")[0] == 200
    assert http_get(chat["url"] + "/no/such/path")[0] == 404
    # FastAPI's own schema still lists only the app's routes.
    _, _, schema = http_get(chat["url"] + "/openapi.json")
    assert "/health" not in json.loads(schema)["paths"]
    got = samples(chat["url"])
    key = frozenset({"route": "/generate", "method": "POST", "status": "200"}.items())
    assert got[("colossalai_chat_requests_total", key)] >= 1
    key = frozenset({"route": "/items/{item_id}", "method": "GET", "status": "200"}.items())
    assert got[("colossalai_chat_requests_total", key)] == 3
    assert not any("/items/1" in dict(labels).get("route", "") for _, labels in got)
    key = frozenset({"route": "unmatched", "method": "GET", "status": "404"}.items())
    assert got[("colossalai_chat_requests_total", key)] >= 1


def test_exceptions_count_as_errors(chat: dict[str, Any]) -> None:
    # A route seen without an error, in this test itself: xdist may run it on another
    # worker than the test that requests /generate first (the fixture is per worker).
    assert post(chat["url"], "/generate")[0] == 200
    assert http_get(chat["url"] + "/boom")[0] == 500
    got = samples(chat["url"])
    key = frozenset({"route": "/boom", "method": "GET", "kind": "exception"}.items())
    assert got[("colossalai_chat_request_errors_total", key)] == 1
    key = frozenset({"route": "/boom", "method": "GET", "status": "500"}.items())
    assert got[("colossalai_chat_requests_total", key)] == 1
    key = frozenset({"route": "/generate", "method": "POST", "kind": "exception"}.items())
    assert got[("colossalai_chat_request_errors_total", key)] == 0  # created at 0 once seen


def test_stream_is_in_flight_and_timed_to_its_end(chat: dict[str, Any]) -> None:
    host, port = chat["url"].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/generate/stream", body=BODY,
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.getheader("content-type", "").startswith("text/event-stream")
    first = response.read1(256)
    assert first.startswith(b"data: ")
    in_flight = ("colossalai_chat_requests_in_flight",
                 frozenset({"route": "/generate/stream", "method": "POST"}.items()))
    assert samples(chat["url"])[in_flight] == 1.0  # headers sent, stream still open
    rest = response.read()
    conn.close()
    assert b"[DONE]" in first + rest
    wait_until(lambda: samples(chat["url"])[in_flight] == 0.0, 5, what="stream finished")
    got = samples(chat["url"])
    labels = frozenset({"route": "/generate/stream", "method": "POST"}.items())
    # 4 tokens at 0.1 s each: the stream took at least 0.4 s, not the time to its first byte.
    assert got[("colossalai_chat_request_duration_seconds_count", labels)] == 1
    assert got[("colossalai_chat_request_duration_seconds_sum", labels)] >= 0.38


def test_metrics_promtool_clean_and_catalogued(chat: dict[str, Any]) -> None:
    promtool = require_binary("promtool")
    post(chat["url"], "/generate")
    _, _, body = http_get(chat["url"] + "/metrics")
    text = body.decode()
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=30, check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    known = catalogue.known_sample_names()
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            assert sample.name in known, sample.name


def test_concurrent_requests_are_all_counted(chat: dict[str, Any]) -> None:
    before = samples(chat["url"]).get(("colossalai_chat_requests_total", frozenset(
        {"route": "/items/{item_id}", "method": "GET", "status": "200"}.items())), 0)
    threads = [threading.Thread(target=http_get, args=(f"{chat['url']}/items/{i}",))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    after = samples(chat["url"])[("colossalai_chat_requests_total", frozenset(
        {"route": "/items/{item_id}", "method": "GET", "status": "200"}.items()))]
    assert after - before == 8


def test_existing_health_route_is_left_alone() -> None:
    app = FastAPI()

    @app.get("/health")
    def own_health() -> dict[str, str]:
        return {"mine": "yes"}

    with pytest.raises(ValueError, match="already has a route on /health"):
        instrument(app)
    instrument(app, health_path=None)
    with served(app) as url:
        assert json.loads(http_get(url + "/health")[2]) == {"mine": "yes"}
        assert http_get(url + "/metrics")[0] == 200


def test_ready_that_raises_is_503_error() -> None:
    def broken() -> bool:
        raise RuntimeError("no GPU")

    app = FastAPI()
    instrument(app, ready=broken)
    with served(app) as url:
        status, _, body = http_get(url + "/health")
    assert status == 503
    payload = json.loads(body)
    assert payload["status"] == "error"
    assert "no GPU" in payload["error"]


def _stream_app(release: threading.Event) -> tuple[FastAPI, Any]:
    """Streams three parts, or wedges after one (``/wedge``) until ``release``, or raises
    after one (``/die``): a live API process over a generation that stopped."""
    import asyncio

    from fastapi.responses import StreamingResponse

    app = FastAPI()

    async def parts(mode: str, request: Request) -> Any:
        yield "data: a\n\n"
        if mode == "wedge":
            # As real servers do (ColossalChat's event generator): stop when the client
            # has gone.
            while not release.is_set():
                if await request.is_disconnected():
                    return
                await asyncio.sleep(0.01)
        if mode == "die":
            raise RuntimeError("the engine died mid-stream")
        yield "data: b\n\n"
        yield "data: [DONE]\n\n"

    @app.get("/stream/{mode}")
    def stream(mode: str, request: Request) -> StreamingResponse:
        return StreamingResponse(parts(mode, request), media_type="text/event-stream")

    return app, instrument(app, progress_timeout=0.5)


def test_streams_are_measured_as_generations_and_cuts_say_who_cut() -> None:
    release = threading.Event()
    app, _ = _stream_app(release)
    with served(app) as url:
        status, _, body = http_get(url + "/stream/ok")
        assert status == 200 and body.endswith(b"[DONE]\n\n")
        # The server raising after a first part: cut by the server.
        connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
        connection.request("GET", "/stream/die")
        response = connection.getresponse()
        with pytest.raises(http.client.IncompleteRead):
            response.read()
        connection.close()
        # The client going away in the middle: cut by the client.
        connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
        connection.request("GET", "/stream/wedge")
        response = connection.getresponse()
        assert response.read1(64).startswith(b"data: a")
        connection.close()  # the server sees it gone and stops: no release needed
        route = "/stream/{mode}"

        def counted() -> dict[Any, float] | None:
            got = samples(url)
            cut = {by: got.get(("colossalai_chat_streams_cut_total",
                                frozenset({"route": route, "by": by}.items()))) for by in
                   ("client", "server")}
            return got if cut == {"client": 1.0, "server": 1.0} else None

        got = wait_until(counted, timeout=30, what="both cut streams counted")
        assert got[("colossalai_chat_streams_total", frozenset({"route": route}.items()))] == 3
        first = ("colossalai_chat_stream_first_chunk_seconds_count",
                 frozenset({"route": route}.items()))
        gaps = ("colossalai_chat_stream_chunk_gap_seconds_count",
                frozenset({"route": route}.items()))
        assert got[first] == 3  # every stream's first part
        assert got[gaps] >= 2  # the complete stream's b and [DONE]
        # the client that went away is not a server error
        errors = sum(v for (name, labels), v in got.items()
                     if name == "colossalai_chat_request_errors_total"
                     and dict(labels)["kind"] == "exception")
        assert errors == 1  # the server's own raise only


def test_health_says_stalled_while_work_is_in_flight_and_nothing_is_produced() -> None:
    release = threading.Event()
    app, metrics = _stream_app(release)
    with served(app) as url:
        assert http_get(url + "/health")[0] == 200  # idle is not stalled
        connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
        connection.request("GET", "/stream/wedge")
        response = connection.getresponse()
        assert response.read1(64).startswith(b"data: a")

        def stalled() -> dict[str, Any] | None:
            status, _, body = http_get(url + "/health")
            payload = json.loads(body)
            return payload if status == 503 else None

        payload = wait_until(stalled, timeout=30, what="/health to say stalled")
        assert payload["status"] == "stalled" and payload["in_flight"] == 1
        assert payload["stalled_seconds"] > 0.5
        release.set()
        assert response.read().endswith(b"[DONE]\n\n")
        connection.close()
        wait_until(lambda: http_get(url + "/health")[0] == 200, timeout=30,
                   what="/health ok once the stream ended")
        metrics.set_queue(waiting=3, running=0)
        got = samples(url)
        assert got[("colossalai_chat_requests_waiting", frozenset())] == 3
        assert got[("colossalai_chat_requests_running", frozenset())] == 0
        assert got[("colossalai_chat_last_progress_timestamp_seconds", frozenset())] > 0
    with pytest.raises(ValueError, match="progress_timeout"):
        instrument(FastAPI(), progress_timeout=0)
