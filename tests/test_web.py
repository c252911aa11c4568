"""The shared web layer against real clients: TLS, client certificates, basic auth, limits."""

from __future__ import annotations

import socket
import ssl
import subprocess
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
from conftest import require_binary


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run([require_binary("openssl"), *args], cwd=cwd, check=True,
                   capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.crt", cwd=d)
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
                "-out", f"{name}.crt", cwd=d)
    return d


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


def test_silent_client_is_disconnected_after_header_timeout(
        monkeypatch: pytest.MonkeyPatch, stop_later: list[web_server.ServerHandle]) -> None:
    monkeypatch.setattr(web_server, "HEADER_TIMEOUT_SECONDS", 0.3)
    app, config = hello_app()
    handle = serve(app, "127.0.0.1:0", config)  # type: ignore[arg-type]
    stop_later.append(handle)
    with socket.create_connection(("127.0.0.1", handle.port), timeout=5) as sock:
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n")  # head never finished
        start = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server
        assert time.monotonic() - start < 3


@pytest.mark.parametrize(("text", "needle"), [
    ("tls_server_config:\n  cert_file: a.crt\n", "key_file is required"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: Maybe\n",
     "client_auth_type 'Maybe'"),
    ("basic_auth_users:\n  u: '$2b$short'\n", "is not a bcrypt hash"),
    ("tls_server_config:\n  cert_file: /nonexistent.crt\n  key_file: /nonexistent.key\n",
     "cannot load cert_file"),
    ("bogus: 1\n", "unknown key 'bogus'"),
])
def test_web_config_errors_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "web.yml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
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
