"""Outbound TLS per bridge target: the ``tls`` block's checks (through ``bridge check``
and the validator) and the real bridge sending to HTTPS loopback servers signed by a
private CA, one of which requires client certificates."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from bridge_payloads import alert, body
from colossalai_exporter.bridge.config import HttpCall, TLSSettings, validate
from colossalai_exporter.bridge.sender import new_session, send
from conftest import openssl, run_cli, wait_until
from fake_vigilmon import FakeVigilmon, fake_vigilmon
from test_bridge_e2e import Start, metric, post, server_process, write_config  # noqa: F401

NAMED_HOST = "vigilmon.internal"


@pytest.fixture(scope="module")
def named_cert(pki: Path) -> Path:
    """A server certificate for vigilmon.internal only (not 127.0.0.1), from the same CA."""
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={NAMED_HOST}",
            "-keyout", "named.key", "-out", "named.csr", cwd=pki)
    (pki / "named.ext").write_text(f"subjectAltName=DNS:{NAMED_HOST}\n")
    openssl("x509", "-req", "-in", "named.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "named.ext", "-out", "named.crt",
            cwd=pki)
    return pki


def server_context(certs: Path, name: str = "server", *, require_client_cert: bool = False,
                   max_version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(certs / f"{name}.crt"), str(certs / f"{name}.key"))
    if require_client_cert:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=str(certs / "ca.crt"))
    if max_version is not None:
        context.maximum_version = max_version
    return context


@pytest.fixture
def private_ca(pki: Path) -> Iterator[FakeVigilmon]:
    """HTTPS with a certificate from the test CA, no client certificate asked for. TLS 1.2
    at most, so that a target asking for min_version TLS13 is refused."""
    with fake_vigilmon(server_context(pki, max_version=ssl.TLSVersion.TLSv1_2)) as fake:
        yield fake


@pytest.fixture
def mutual(pki: Path) -> Iterator[FakeVigilmon]:
    """HTTPS that refuses clients without a certificate from the test CA."""
    with fake_vigilmon(server_context(pki, require_client_cert=True)) as fake:
        yield fake


def webhook(name: str, url: str, **extra: Any) -> dict[str, Any]:
    # No selector: every notification goes to every webhook target.
    return {"name": name, "type": "webhook", "url": url, "timeout": "2s", **extra}


def deliveries(bridge: Any, target: str, *results: str) -> float:
    return sum(metric(bridge, "colossalai_bridge_deliveries_total", target=target,
                      result=r) or 0 for r in results)


def test_private_ca_and_client_certificates_and_nothing_lost_until_fixed(
        server_process: Start, tmp_path: Path, pki: Path,  # noqa: F811
        private_ca: FakeVigilmon, mutual: FakeVigilmon) -> None:
    ca = str(pki / "ca.crt")
    client = {"cert_file": str(pki / "client.crt"), "key_file": str(pki / "client.key")}
    targets = [
        webhook("private", private_ca.url + "/private", tls={"ca_file": ca}),
        webhook("no-ca", private_ca.url + "/no-ca"),  # certifi's bundle: unknown CA
        webhook("with-cert", mutual.url + "/with-cert", tls={"ca_file": ca, **client}),
        webhook("without-cert", mutual.url + "/without-cert", tls={"ca_file": ca}),
    ]
    config = write_config(tmp_path / "bridge.yml", tmp_path / "state", targets)
    bridge = server_process(config)
    answer = post(bridge, body(alert("TrainingStalled", job="tls")))
    assert answer.status_code == 200, answer.text

    # (a) The private CA given as ca_file verifies the server; (c) the client
    # certificate is accepted by the server that requires one.
    private_ca.wait_for("/private", 1)
    mutual.wait_for("/with-cert", 1)

    # (b) Without ca_file the server is not trusted: a tls failure, retried with backoff,
    # kept in the outbox and not dead-lettered.
    wait_until(lambda: deliveries(bridge, "no-ca", "tls") >= 3, timeout=15,
               what="three refused handshakes for no-ca")
    # (c) Without a client certificate the server refuses the handshake (with TLS 1.3
    # the client may learn it only when it reads the answer: a reset, not a TLS error).
    wait_until(lambda: deliveries(bridge, "without-cert", "tls", "connection") >= 3,
               timeout=15, what="three refused handshakes for without-cert")
    assert private_ca.received("/no-ca", include_failed=True) == []
    assert mutual.received("/without-cert", include_failed=True) == []
    assert private_ca.failed_handshakes() >= 3
    assert mutual.failed_handshakes() >= 3
    for name in ("no-ca", "without-cert"):
        assert metric(bridge, "colossalai_bridge_queue_depth", target=name) == 1
        assert metric(bridge, "colossalai_bridge_dead_letters", target=name) == 0
        assert metric(bridge, "colossalai_bridge_deliveries_total", target=name,
                      result="success") == 0
    listed = run_cli("bridge", "outbox", "list", "--target", "no-ca", "--config.file",
                     str(config))
    assert listed.returncode == 0, listed.stderr
    assert "TLS failed (certificate verify failed: unable to get local issuer" in listed.stdout
    address = f"127.0.0.1:{private_ca.port}"
    assert address not in listed.stdout  # no URL in an error text
    assert address not in bridge.output()

    # The operator adds what was missing and restarts: the waiting deliveries go out,
    # each once.
    assert bridge.stop() == 0
    targets[1]["tls"] = {"ca_file": ca}
    targets[3]["tls"] = {"ca_file": ca, **client}
    write_config(config, tmp_path / "state", targets)
    again = server_process(config)
    private_ca.wait_for("/no-ca", 1)
    mutual.wait_for("/without-cert", 1)
    for name in ("no-ca", "without-cert"):
        wait_until(lambda name=name: metric(again, "colossalai_bridge_queue_depth",
                                            target=name) == 0, what=f"{name} to drain")
    assert len(private_ca.received("/no-ca")) == 1
    assert len(mutual.received("/without-cert")) == 1
    assert len(private_ca.received("/private")) == 1
    assert len(mutual.received("/with-cert")) == 1


def test_server_name_min_version_insecure_and_the_fail_url_inherits(
        server_process: Start, tmp_path: Path, named_cert: Path,  # noqa: F811
        private_ca: FakeVigilmon) -> None:
    ca = str(named_cert / "ca.crt")
    with fake_vigilmon(server_context(named_cert, "named")) as named:
        config = write_config(tmp_path / "bridge.yml", tmp_path / "state", [
            webhook("named", named.url + "/named",
                    tls={"ca_file": ca, "server_name": NAMED_HOST}),
            webhook("by-address", named.url + "/by-address", tls={"ca_file": ca}),
            webhook("tls13", private_ca.url + "/tls13",
                    tls={"ca_file": ca, "min_version": "TLS13"}),
            webhook("insecure", private_ca.url + "/insecure",
                    tls={"insecure_skip_verify": True}),
            {"name": "watchdog", "type": "heartbeat", "url": private_ca.heartbeat_url("tok"),
             "timeout": "2s", "tls": {"ca_file": ca}, "headers": {"X-Api-Key": "k1"},
             "fail": {"url": private_ca.heartbeat_url("tok") + "/fail"}},  # no tls of its own
        ])
        bridge = server_process(config)
        assert "insecure_skip_verify: warning: the server's certificate is not verified" in (
            bridge.output())
        assert post(bridge, body(alert())).status_code == 200

        # server_name is sent as SNI and is the name the certificate must match;
        # without it the certificate (for vigilmon.internal only) fails for 127.0.0.1.
        named.wait_for("/named", 1)
        assert NAMED_HOST in named.server_names
        wait_until(lambda: deliveries(bridge, "by-address", "tls") >= 2, timeout=15,
                   what="by-address to fail verification")
        assert named.received("/by-address", include_failed=True) == []
        # The server offers TLS 1.2 at most; the target accepts 1.3 only.
        wait_until(lambda: deliveries(bridge, "tls13", "tls") >= 2, timeout=15,
                   what="tls13 to fail the handshake")
        assert private_ca.received("/tls13", include_failed=True) == []
        private_ca.wait_for("/insecure", 1)
        private_ca.wait_for("/api/heartbeat/tok", 1)
        assert post(bridge, body(alert(status="resolved"))).status_code == 200
        # Verified with the target's CA, and sent with the target's headers.
        fail = private_ca.wait_for("/api/heartbeat/tok/fail", 1)
        assert fail[0].headers["x-api-key"] == "k1"
        assert metric(bridge, "colossalai_bridge_deliveries_total", target="watchdog",
                      result="tls") == 0
        bridge.stop()


def test_check_reports_each_tls_problem_on_its_own_line(tmp_path: Path,
                                                         pki: Path) -> None:
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    url = "https://hooks.example/secret-token"
    client, key = str(pki / "client.crt"), str(pki / "client.key")
    targets = [
        # Keys and types first (the config layer, one per block), then the files.
        webhook("a", url, tls={"ca_file": str(tmp_path / "missing.crt"), "surprise": 1}),
        webhook("k", url, tls={"ca_file": str(tmp_path / "missing.crt")}),
        webhook("b", url, tls={"cert_file": client}),
        webhook("c", url, tls={"key_file": key}),
        webhook("d", "http://hooks.example/secret-token", tls={"ca_file": str(pki / "ca.crt")}),
        webhook("e", url, tls={"ca_file": str(tmp_path)}),  # a folder: cannot be read
        webhook("f", url, tls={"ca_file": "garbage.pem"}),  # relative to the config file
        webhook("g", url, tls={"cert_file": client, "key_file": str(pki / "server.key")}),
        webhook("h", url, tls={"min_version": "TLS13", "insecure_skip_verify": "yes"}),
        webhook("l", url, tls={"min_version": "TLS14"}),
        webhook("i", url, tls="on"),
        {"name": "j", "type": "heartbeat", "url": url,
         "fail": {"url": url + "/fail", "tls": {"ca": "x"}}},
    ]
    config = tmp_path / "bridge.yml"
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"),
                                      "targets": targets}))
    result = run_cli("bridge", "check", "--config.file", str(config))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    expected = [
        "targets[a].tls: unknown key `surprise` (known: ca_file, cert_file, key_file, "
        "server_name, insecure_skip_verify, min_version)",
        f"targets[k].tls.ca_file: cannot read {tmp_path}/missing.crt: No such file or "
        "directory",
        "targets[b].tls.key_file: is required with cert_file: a client certificate and its "
        "private key go together",
        "targets[c].tls.cert_file: is required with key_file: a client certificate and its "
        "private key go together",
        "targets[d].tls: is set but url is http://: TLS settings apply to https:// URLs only",
        f"targets[e].tls.ca_file: cannot read {tmp_path}: Is a directory",
        f"targets[f].tls.ca_file: {tmp_path}/garbage.pem holds no PEM CA certificate "
        "([X509: NO_CERTIFICATE_OR_CRL_FOUND] no certificate or crl found)",
        "targets[g].tls.cert_file: cert_file and key_file must be a PEM certificate and its "
        "unencrypted private key ([X509: KEY_VALUES_MISMATCH] key values mismatch)",
        "targets[h].tls.insecure_skip_verify: expected `bool`, got `str`",
        "targets[i].tls: expected `object | null`, got `str`",
        "targets[l].tls.min_version: invalid enum value 'TLS14' (one of: TLS10, TLS11, TLS12, "
        "TLS13)",
        "targets[j].fail.tls: unknown key `ca` (known: ca_file, cert_file, key_file, "
        "server_name, insecure_skip_verify, min_version)",
    ]
    assert sorted(lines) == sorted(f"{config}: {line}" for line in expected)
    assert "secret-token" not in result.stderr


def test_check_warns_about_insecure_skip_verify_and_paths_are_relative_to_the_config(
        tmp_path: Path, pki: Path) -> None:
    (tmp_path / "ca.crt").write_bytes((pki / "ca.crt").read_bytes())
    config = tmp_path / "bridge.yml"
    data = {"state_dir": "state", "targets": [
        webhook("lab", "https://lab.example/hook",
                tls={"insecure_skip_verify": True, "server_name": "lab"}),
        {"name": "wd", "type": "heartbeat", "url": "https://v.example/api/heartbeat/t",
         "tls": {"ca_file": "ca.crt", "cert_file": str(pki / "client.crt"),
                 "key_file": str(pki / "client.key"), "min_version": "TLS13"},
         "fail": {"url": "https://v.example/api/heartbeat/t/fail"}},
        {"name": "wd2", "type": "heartbeat", "url": "https://v.example/api/heartbeat/u",
         "tls": {"ca_file": "ca.crt"},
         "fail": {"url": "https://other.example/fail", "tls": {}}},  # its own: defaults
    ]}
    config.write_text(yaml.safe_dump(data))
    result = run_cli("bridge", "check", "--config.file", str(config))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{config}: ok"
    assert result.stderr.strip() == (
        f"{config}: targets[lab].tls.insecure_skip_verify: warning: the server's certificate "
        "is not verified: anyone on the network path can pose as this target and receive "
        "its requests (server_name unused)")

    parsed, problems = validate(data, config)
    assert problems == []
    assert parsed is not None
    lab, wd, wd2 = parsed.targets
    assert lab.endpoint.tls == TLSSettings(server_name="lab", insecure_skip_verify=True)
    assert lab.endpoint.tls.verify is False
    assert wd.endpoint.tls is not None
    assert wd.endpoint.tls.verify == str(tmp_path / "ca.crt")
    assert wd.endpoint.tls.cert == (str(pki / "client.crt"), str(pki / "client.key"))
    assert wd.fail_endpoint is not None
    assert wd.fail_endpoint.tls == wd.endpoint.tls  # inherited
    assert wd2.fail_endpoint is not None
    assert wd2.fail_endpoint.tls == TLSSettings()
    assert wd2.fail_endpoint.tls.verify is True
    assert len(parsed.warnings) == 1


def test_a_tls_file_gone_after_start_is_a_tls_result_not_a_crash(tmp_path: Path) -> None:
    """requests raises a bare OSError (outside its exceptions) for a missing ca_file;
    the worker thread must get a result, not an exception that would end it."""
    endpoint = HttpCall(url="https://127.0.0.1:9/api/heartbeat/secret-token", timeout=2.0,
                        tls=TLSSettings(ca_file=str(tmp_path / "gone.crt")))
    with new_session(endpoint.tls) as session:
        result = send(session, endpoint)
    assert result.result == "tls"
    assert "missing" in result.error
    assert "secret-token" not in result.error


def test_insecure_skip_verify_silences_the_warning_for_its_host_only() -> None:
    """urllib3 warns on every unverified request; the filter the bridge installs for a
    target with insecure_skip_verify must not hide the warning for any other host."""
    import re
    import warnings

    import urllib3

    from colossalai_exporter.bridge.sender import endpoint_session

    def silenced(host: str) -> bool:
        text = (f"Unverified HTTPS request is being made to host '{host}'. Adding "
                "certificate verification is strongly advised.")
        for action, message, category, _module, _line in warnings.filters:
            if (issubclass(urllib3.exceptions.InsecureRequestWarning, category)
                    and (message is None or re.compile(message).match(text))):
                return action == "ignore"
        return False

    with warnings.catch_warnings():
        endpoint_session(HttpCall(url="https://lab.example:8443/hook",
                                  tls=TLSSettings(insecure_skip_verify=True))).close()
        endpoint_session(HttpCall(url="https://[fd00::1]/hook",
                                  tls=TLSSettings(insecure_skip_verify=True))).close()
        endpoint_session(HttpCall(url="https://verified.example/hook",
                                  tls=TLSSettings())).close()
        assert silenced("lab.example")
        assert silenced("fd00::1") and silenced("[fd00::1]")
        assert not silenced("verified.example")
        assert not silenced("lab.example.evil")
