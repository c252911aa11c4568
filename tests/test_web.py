"""The shared web layer against real clients: TLS, client certificates, basic auth, limits."""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest

from colossalai_exporter.errors import ConfigError
from colossalai_exporter.web import App, json_response, load_web_config, serve
from colossalai_exporter.web import server as web_server
from colossalai_exporter.web.auth import BasicAuthenticator


def hello_app(web_config_path: Path | None = None, max_body: int = 1 << 20) -> tuple[App, object]:
    config = load_web_config(web_config_path)
    app = App(authenticator=BasicAuthenticator(config.basic_auth_users), max_body_bytes=max_body,
              extra_headers=config.headers)
    app.add_route("/hello", lambda r: json_response(200, {"hello": len(r.body)}), ("GET", "POST"))
    return app, config


@pytest.fixture
def stop_later() -> Iterator[list[web_server.ServerHandle]]:
    handles: list[web_server.ServerHandle] = []
    yield handles
    for handle in handles:
        handle.stop()


def test_tls_with_required_client_certificate(pki: Path, tmp_path: Path,
                                              stop_later: list[web_server.ServerHandle]) -> None:
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {pki}/server.crt\n"
                   f"  key_file: {pki}/server.key\n"
                   "  client_auth_type: RequireAndVerifyClientCert\n"
                   f"  client_ca_file: {pki}/ca.crt\n  min_version: TLS12\n")
    app, config = hello_app(web)
    handle = serve(app, "127.0.0.1:0", config)  # type: ignore[arg-type]
    stop_later.append(handle)
    assert handle.url.startswith("https://")

    client = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    client.load_cert_chain(str(pki / "client.crt"), str(pki / "client.key"))
    with urllib.request.urlopen(handle.url + "/hello", context=client, timeout=5) as response:
        assert response.status == 200

    no_cert = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionResetError)):
        urllib.request.urlopen(handle.url + "/hello", context=no_cert, timeout=5).read()


def test_basic_auth_401_with_www_authenticate(tmp_path: Path,
                                              stop_later: list[web_server.ServerHandle]) -> None:
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n"
                   "http_server_config:\n  headers:\n    X-Frame-Options: deny\n")
    app, config = hello_app(web)
    handle = serve(app, "127.0.0.1:0", config)  # type: ignore[arg-type]
    stop_later.append(handle)

    def get(user_pass: str | None) -> tuple[int, dict[str, str]]:
        headers = {"Authorization": "Basic " + b64encode(user_pass.encode()).decode()} \
            if user_pass else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(handle.url + "/hello",
                                                               headers=headers), timeout=5) as r:
                return r.status, r.headers  # type: ignore[return-value]
        except urllib.error.HTTPError as exc:
            exc.close()
            return exc.code, exc.headers  # type: ignore[return-value]

    assert get("prometheus:s3cret")[0] == 200
    assert get("prometheus:s3cret")[0] == 200  # the cached path
    for creds in (None, "prometheus:wrong", "nobody:s3cret", "garbage"):
        status, headers = get(creds)
        assert status == 401, creds
        assert headers["WWW-Authenticate"] == 'Basic realm="colossalai-exporter"'
    assert get("prometheus:s3cret")[1]["X-Frame-Options"] == "deny"


def test_body_cap_method_and_unknown_route(stop_later: list[web_server.ServerHandle]) -> None:
    app, config = hello_app(max_body=16)
    handle = serve(app, "127.0.0.1:0", config)  # type: ignore[arg-type]
    stop_later.append(handle)
    request = urllib.request.Request(handle.url + "/hello", data=b"x" * 17, method="POST")
    with pytest.raises(urllib.error.HTTPError) as too_large:
        urllib.request.urlopen(request, timeout=5)
    assert too_large.value.code == 413
    too_large.value.close()
    with pytest.raises(urllib.error.HTTPError) as wrong_method:
        urllib.request.urlopen(urllib.request.Request(handle.url + "/hello", method="DELETE"),
                               timeout=5)
    assert wrong_method.value.code == 405
    assert wrong_method.value.headers["Allow"] == "GET, HEAD, POST"
    wrong_method.value.close()
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(handle.url + "/nope", timeout=5)
    assert missing.value.code == 404
    missing.value.close()


def test_bodies_are_read_by_length_or_chunks_and_only_then(
        stop_later: list[web_server.ServerHandle]) -> None:
    """A request without Content-Length or Transfer-Encoding has no body (a scrape):
    it is answered without a read; a chunked body is read whole, under the cap, and
    one that stops coming is a 408 within the body deadline."""
    app = App(max_body_bytes=16, body_timeout=0.5)
    app.add_route("/hello", lambda r: json_response(200, {"hello": len(r.body)}), ("GET", "POST"))
    handle = serve(app, "127.0.0.1:0", None)  # type: ignore[arg-type]
    stop_later.append(handle)
    host, port = handle.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        head, body = recv_response(sock)
        assert head.startswith(b"HTTP/1.1 200") and body == b'{"hello": 0}\n'
        sock.sendall(b"POST /hello HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n3\r\nabc\r\n0\r\n\r\n")
        head, body = recv_response(sock)
        assert head.startswith(b"HTTP/1.1 200") and body == b'{"hello": 8}\n'
        sock.sendall(b"POST /hello HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"11\r\n" + b"x" * 17 + b"\r\n0\r\n\r\n")
        head, _ = recv_response(sock)
        assert head.startswith(b"HTTP/1.1 413"), head
    with socket.create_connection((host, int(port)), timeout=5) as slow:
        slow.sendall(b"POST /hello HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhel")
        head, body = recv_response(slow)
        assert head.startswith(b"HTTP/1.1 408") and b"body_timeout" in body


def recv_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def recv_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response with a Content-Length body from a kept-alive connection: (head, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def still_serving(handle: web_server.ServerHandle) -> bool:
    with urllib.request.urlopen(handle.url + "/hello", timeout=5) as response:
        return response.status == 200


def test_silent_client_is_disconnected_after_header_timeout(
        monkeypatch: pytest.MonkeyPatch,
        stop_later: list[web_server.ServerHandle]) -> None:
    monkeypatch.setattr(web_server, "HEADER_TIMEOUT_SECONDS", 0.3)
    app, config = hello_app()
    handle = serve(app, "127.0.0.1:0", config)
    stop_later.append(handle)
    with socket.create_connection(("127.0.0.1", handle.port), timeout=5) as sock:
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n")  # head never finished
        start = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server
        assert time.monotonic() - start < 3
    assert still_serving(handle)


def test_every_head_on_a_kept_alive_connection_has_a_deadline(
        monkeypatch: pytest.MonkeyPatch, stop_later: list[web_server.ServerHandle]) -> None:
    """After a first request, idling is the keep-alive timeout's, but a head that has
    started to arrive must finish within the deadline, even if it trickles in."""
    monkeypatch.setattr(web_server, "HEADER_TIMEOUT_SECONDS", 0.5)
    app, config = hello_app()
    handle = serve(app, "127.0.0.1:0", config)  # type: ignore[arg-type]
    stop_later.append(handle)
    with socket.create_connection(("127.0.0.1", handle.port), timeout=5) as sock:
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        assert recv_response(sock)[0].startswith(b"HTTP/1.1 200 ")
        time.sleep(0.7)  # idle past the head deadline: still open (keep-alive)
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        assert recv_response(sock)[0].startswith(b"HTTP/1.1 200 ")
        start = time.monotonic()
        sock.sendall(b"GET /hello HTTP/1.1\r\n")
        for _ in range(20):  # a byte every 0.1 s resets no timer
            time.sleep(0.1)
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                break
        assert recv_all(sock) == b""
        assert time.monotonic() - start < 2.5


@pytest.mark.parametrize("trickled", [False, True])
def test_oversized_request_head_is_refused(trickled: bool,
                                           stop_later: list[web_server.ServerHandle]) -> None:
    """Over MAX_HEAD_BYTES a head is refused (431, as Go's net/http) and the connection
    closed, whether it comes at once or never completes; on_refused is told."""
    status = 431
    app, config = hello_app()
    refused: list[str] = []
    handle = serve(app, "127.0.0.1:0", config, on_refused=refused.append)
    stop_later.append(handle)
    big = b"a" * (web_server.MAX_HEAD_BYTES + 1024)
    with socket.create_connection(("127.0.0.1", handle.port), timeout=5) as sock:
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:
            if trickled:  # one header value in small reads, never finished
                for i in range(0, len(big), 4096):
                    sock.sendall(big[i:i + 4096])
                    time.sleep(0.002)
            else:
                sock.sendall(big + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the rest was sent
        try:
            answer = recv_all(sock)
        except ConnectionResetError:
            answer = b""  # the unread rest of our head reset the connection
        if answer:
            assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:100]
    assert still_serving(handle)
    assert refused == ["head_too_large"]


def test_a_large_head_under_the_cap_is_served(stop_later: list[web_server.ServerHandle]) -> None:
    """Neither count of head bytes refuses a legal head, at once or in small reads."""
    app, config = hello_app()
    handle = serve(app, "127.0.0.1:0", config)  # type: ignore[arg-type]
    stop_later.append(handle)
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(50))  # ~50 KiB
    request = b"GET /hello HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
    assert len(request) < web_server.MAX_HEAD_BYTES
    with socket.create_connection(("127.0.0.1", handle.port), timeout=5) as sock:
        sock.sendall(request)
        assert recv_response(sock)[0].startswith(b"HTTP/1.1 200 ")
        for i in range(0, len(request), 2048):
            sock.sendall(request[i:i + 2048])
            time.sleep(0.001)
        assert recv_response(sock)[0].startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize("garbage", [
    b"NOT A REQUEST\r\n\r\n",
    b"GET / HTTP/1.1\r\nNo colon\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
])
def test_malformed_request_gets_400_and_the_server_keeps_serving(
        garbage: bytes, stop_later: list[web_server.ServerHandle]) -> None:
    app, config = hello_app()
    refused: list[str] = []
    handle = serve(app, "127.0.0.1:0", config, on_refused=refused.append)
    stop_later.append(handle)
    with socket.create_connection(("127.0.0.1", handle.port), timeout=5) as sock:
        sock.sendall(garbage)  # the last: a TLS ClientHello sent to a plain-HTTP port
        assert recv_all(sock).startswith(b"HTTP/1.1 400 ")
    assert still_serving(handle)
    assert refused == ["bad_request"]


@pytest.mark.parametrize("upgrade", [b"websocket", b"h2c"])
def test_an_upgrade_request_is_served_as_http_without_warnings(
        upgrade: bytes, stop_later: list[web_server.ServerHandle],
        caplog: pytest.LogCaptureFixture) -> None:
    app, config = hello_app()
    handle = serve(app, "127.0.0.1:0", config)
    stop_later.append(handle)
    with caplog.at_level("DEBUG", logger="uvicorn"), \
            socket.create_connection(("127.0.0.1", handle.port), timeout=5) as sock:
        for _ in range(2):  # and the connection stays usable
            sock.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                         b"Upgrade: " + upgrade + b"\r\n\r\n")
            head, body = recv_response(sock)
            assert head.startswith(b"HTTP/1.1 200 ") and json.loads(body) == {"hello": 0}
    logged = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("uvicorn")]
    assert [level for level, _ in logged if level != "DEBUG"] == [], logged
    assert any("ignored a request's Upgrade header" in message for _, message in logged)


def test_head_requests_and_keep_alive(stop_later: list[web_server.ServerHandle]) -> None:
    """HEAD: the GET's headers (length included) and no body; the connection goes on."""
    app, config = hello_app()
    handle = serve(app, "127.0.0.1:0", config)
    stop_later.append(handle)
    with socket.create_connection(("127.0.0.1", handle.port), timeout=5) as sock:
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        _, get_body = recv_response(sock)
        assert json.loads(get_body) == {"hello": 0}
        sock.sendall(b"HEAD /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and rest == b""
        assert f"content-length: {len(get_body)}".encode() in head.lower()
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")  # same connection
        assert recv_response(sock)[1] == get_body


def test_stop_finishes_the_request_in_flight() -> None:
    config = load_web_config(None)
    app = App(authenticator=BasicAuthenticator(config.basic_auth_users))
    entered = threading.Event()

    def slow(request: object) -> object:
        entered.set()
        time.sleep(0.5)
        return json_response(200, {"slow": True})

    app.add_route("/slow", slow)  # type: ignore[arg-type]
    handle = serve(app, "127.0.0.1:0", config)
    answers: list[int] = []

    def client() -> None:
        with urllib.request.urlopen(handle.url + "/slow", timeout=10) as response:
            answers.append(response.status)

    thread = threading.Thread(target=client)
    thread.start()
    assert entered.wait(5)
    handle.stop()
    thread.join(10)
    assert answers == [200]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", handle.port), timeout=2).close()


@pytest.mark.parametrize(("text", "needle"), [
    ("tls_server_config:\n  cert_file: a.crt\n", "key_file is required"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: Maybe\n",
     "client_auth_type: invalid enum value 'Maybe' (one of: NoClientCert,"),
    ("basic_auth_users:\n  u: '$2b$short'\n", "is not a bcrypt hash"),
    ("tls_server_config:\n  cert_file: /nonexistent.crt\n  key_file: /nonexistent.key\n",
     "cannot load cert_file"),
    ("bogus: 1\n", "unknown key `bogus`"),
    ("http_server_config:\n  header: {X: y}\n", "http_server_config: unknown key `header`"),
    ("tls_server_config:\n  min_version: TLS14\n", "tls_server_config.min_version: invalid"),
])
def test_web_config_errors_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "web.yml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_web_config(path)


def test_keep_alive_responses_are_not_held_back_by_nagle(
        stop_later: list[web_server.ServerHandle]) -> None:
    """Head and body leave in two writes: without TCP_NODELAY each keep-alive response
    waits for the client's delayed ACK (~40 ms), 20 of them ~0.8 s. Prometheus keeps
    connections alive, so this guards a protocol bug, not a speed goal."""
    import http.client

    app, config = hello_app()
    handle = serve(app, "127.0.0.1:0", config)  # type: ignore[arg-type]
    stop_later.append(handle)
    conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=5)
    try:
        start = time.monotonic()
        for _ in range(20):
            conn.request("GET", "/hello")
            assert conn.getresponse().read()
        assert time.monotonic() - start < 0.4
    finally:
        conn.close()


def test_exporter_toolkit_cipher_keys_are_accepted_but_said_to_be_ignored(
        pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One web config can serve Go exporters and ours; a no-op cipher list is not silent."""
    path = tmp_path / "web.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {pki}/server.crt\n"
                    f"  key_file: {pki}/server.key\n"
                    "  cipher_suites: [TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384]\n"
                    "  curve_preferences: [X25519]\n")
    with caplog.at_level("WARNING", logger="colossalai_exporter.web.config"):
        config = load_web_config(path)
    assert config.tls is not None
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert "cipher_suites is accepted for compatibility" in warned[0]
    assert "curve_preferences" in warned[1]


def test_unknown_users_cost_a_bcrypt_check_at_the_configured_cost() -> None:
    """An unknown user name must not answer faster than a known one with a wrong password."""
    hashed = bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=11))
    auth = BasicAuthenticator({"prometheus": hashed})
    assert auth._dummy_hash.startswith(b"$2b$11$")
    header = "Basic " + b64encode(b"nobody:secret").decode()
    assert auth.check(header) is False
    assert auth.check("Basic " + b64encode(b"prometheus:secret").decode()) is True
    assert BasicAuthenticator({})._dummy_hash == b""  # no users: nothing hashed at start-up


@pytest.mark.parametrize(("header", "gzip_ok"), [
    ("gzip", True),
    ("deflate, gzip;q=1.0, *;q=0.5", True),
    ("GZIP", True),
    ("x-gzip", True),
    ("*", True),
    ("gzip;q=0", False),
    ("gzip;q=0.000, *", False),  # gzip refused by name wins over the wildcard
    ("*;q=0", False),
    ("deflate, br", False),
    ("identity", False),
    ("gzip;q=oops", False),
    ("", False),
])
def test_gzip_is_offered_only_where_accept_encoding_allows_it(header: str,
                                                              gzip_ok: bool) -> None:
    from colossalai_exporter.web.metrics import accepts_gzip

    assert accepts_gzip(header) is gzip_ok


def test_metrics_are_gzipped_over_the_threshold_as_prometheus_asks(
        stop_later: list[web_server.ServerHandle]) -> None:
    import gzip

    from prometheus_client import CollectorRegistry, Gauge

    from colossalai_exporter.web import metrics_response
    from colossalai_exporter.web.metrics import GZIP_MIN_BYTES

    registry = CollectorRegistry()
    gauge = Gauge("colossalai_test_series", "A series per label value.", ["rank"],
                  registry=registry)
    size = {"series": 1}

    def metrics(request):  # type: ignore[no-untyped-def]
        for rank in range(size["series"]):
            gauge.labels(str(rank)).set(rank)
        return metrics_response(registry, request)

    app = App()
    app.add_route("/metrics", metrics)
    handle = serve(app, "127.0.0.1:0")
    stop_later.append(handle)

    def get(encoding: str) -> tuple[dict[str, str], bytes]:
        request = urllib.request.Request(handle.url + "/metrics",
                                         headers={"Accept-Encoding": encoding})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200
            return {k.title(): v for k, v in response.headers.items()}, response.read()

    # Small: sent as it is, even though gzip is accepted.
    headers, body = get("gzip")
    assert "Content-Encoding" not in headers
    assert headers["Vary"] == "Accept, Accept-Encoding"
    assert len(body) < GZIP_MIN_BYTES

    size["series"] = 1000
    plain_headers, plain = get("identity")
    assert "Content-Encoding" not in plain_headers
    assert len(plain) >= GZIP_MIN_BYTES
    headers, packed = get("gzip")
    assert headers["Content-Encoding"] == "gzip"
    assert int(headers["Content-Length"]) == len(packed) < len(plain) / 4
    assert gzip.decompress(packed) == plain
    _, refused = get("gzip;q=0, identity")
    assert refused == plain


def test_canary_the_installed_uvicorn_is_one_the_http_layer_was_tested_on() -> None:
    """web/server.py extends uvicorn's httptools protocol through parts uvicorn does not
    promise to keep; pyproject.toml pins the range this file passed on. This fails first,
    and says what is missing, when another uvicorn is installed (a resolver that ignored
    the pin, or a maintainer widening it: scripts/check-uvicorn.sh)."""
    import inspect
    from importlib.metadata import version

    from packaging.requirements import Requirement
    from uvicorn.protocols.http import httptools_impl

    from conftest import REPO

    if os.environ.get("COLOSSALAI_EXPORTER_TRY_UVICORN"):
        pytest.skip("scripts/check-uvicorn.sh is trying a uvicorn outside the pin")
    protocol = httptools_impl.HttpToolsProtocol
    methods = ("connection_made", "connection_lost", "data_received", "on_message_begin",
               "on_url", "on_header", "on_headers_complete", "send_400_response",
               "_unsupported_upgrade_warning")
    missing = [name for name in methods if not callable(getattr(protocol, name, None))]
    init = inspect.getsource(protocol.__init__)
    missing += [name for name in ("self.cycle", "self.server_state", "self.logger",
                                  "self.loop", "self.transport")
                if name not in init and name not in inspect.getsource(protocol)]
    missing += [] if hasattr(httptools_impl, "STATUS_LINE") else ["STATUS_LINE"]
    installed = version("uvicorn")
    assert not missing, f"uvicorn {installed} lacks what web/server.py uses: {missing}"
    (pin,) = [Requirement(r) for r in re.findall(r'^  "(uvicorn[^"]*)",$',
                                                 (REPO / "pyproject.toml").read_text(),
                                                 re.MULTILINE)]
    assert pin.specifier.contains(installed), (
        f"uvicorn {installed} is outside the tested range {pin.specifier}: run "
        f"scripts/check-uvicorn.sh {installed} and widen the pin if it passes")
