"""The prober as a real process, probing real uvicorn servers on loopback for every reason."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chat_servers import (
    colossalchat_app,
    inference_app,
    raw_server,
    self_signed_cert,
    served,
    silent_listener,
    tls_web_config,
)
from colossalai_exporter import catalogue
from colossalai_exporter.chat import instrument
from conftest import (
    ServerProcess,
    cli_env,
    free_port,
    http_get,
    refused_port,
    require_binary,
)

CONFIG = """
allow:
  loopback: true
modules:
  fast_http:
    prober: http
    timeout: 1s
  tls_insecure:
    prober: http
    http:
      tls_config: {{insecure_skip_verify: true}}
  tls_ca:
    prober: http
    http:
      tls_config: {{ca_file: {cert}}}
  tcp_tls:
    prober: tcp
    tcp: {{tls: true, tls_config: {{ca_file: {cert}}}}}
  json_ready:
    prober: http
    http:
      path: /health
      json:
        - {{field: status, equals: ok}}
  ping_json:
    prober: http
    http:
      path: /ping
      json:
        - {{field: status, equals: ok}}
  json_any:
    prober: http
    http:
      json:
        - {{field: status, equals: ok}}
  secret_gone:
    prober: http
    http:
      header_files: {{Authorization: {gone}}}
  chat_generate:
    prober: generate
    timeout: 10s
    http:
      header_files: {{Authorization: {secret}}}
"""


def probe_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_binary("openssl")
    tmp = tmp_path_factory.mktemp("probe")
    cert, key = self_signed_cert(tmp)
    secret = tmp / "token"
    secret.write_text("Bearer s3cret\n")
    config = tmp / "probe.yml"
    gone = tmp / "rotated-token"
    gone.write_text("Bearer old\n")
    config.write_text(CONFIG.format(cert=cert, secret=secret, gone=gone))
    inference: dict[str, Any] = {"engine": "Running"}
    chat: dict[str, Any] = {}
    loaded = {"ready": False}
    tutorial_chat = colossalchat_app(chat)
    instrument(tutorial_chat, ready=lambda: loaded["ready"])
    port = free_port()
    prober = ServerProcess(["probe", "--config.file", str(config),
                            "--web.listen-address", f"127.0.0.1:{port}"], port, cli_env())
    with served(inference_app(inference)) as inference_url, \
            served(tutorial_chat) as chat_url, \
            served(colossalchat_app({}, openapi=False)) as bare_chat_url, \
            served(inference_app({}), tls_web_config(cert, key)) as tls_url, \
            silent_listener() as silent_port:
        try:
            prober.wait_ready("/health")
            yield {"prober": prober, "inference": inference, "inference_url": inference_url,
                   "chat": chat, "chat_url": chat_url, "loaded": loaded,
                   "bare_chat_url": bare_chat_url, "tls_url": tls_url,
                   "silent_port": silent_port, "config": config, "gone": gone}
        finally:
            prober.close()


def probe(setup: dict[str, Any], target: str, module: str, timeout: float = 10,
          **extra: str) -> tuple[int, str, dict[tuple[str, frozenset[tuple[str, str]]], float]]:
    headers = {k.replace("_", "-"): v for k, v in extra.items()}
    query = urllib.parse.urlencode({"target": target, "module": module})
    status, _, body = http_get(f"{setup['prober'].url}/probe?{query}", timeout=timeout,
                               headers=headers)
    text = body.decode()
    return status, text, probe_samples(text) if status == 200 else {}


def assert_failed(samples: dict[Any, float], reason: str) -> None:
    assert value(samples, "probe_success") == 0.0
    assert value(samples, "probe_failure_info", reason=reason) == 1.0, samples


def test_colossal_inference_running_then_engine_error_under_200(setup: dict[str, Any]) -> None:
    setup["inference"]["engine"] = "Running"
    status, _, samples = probe(setup, setup["inference_url"], "colossal_inference")
    assert status == 200
    assert value(samples, "probe_success") == 1.0
    assert value(samples, "probe_http_status_code") == 200.0
    assert value(samples, "colossalai_probe_step_success", step="ping") == 1.0
    assert value(samples, "colossalai_probe_step_success", step="engine_check") == 1.0
    assert not any(name == "probe_failure_info" for name, _ in samples)
    assert (value(samples, "probe_http_duration_seconds", phase="processing") or 0) > 0
    assert (value(samples, "probe_http_duration_seconds", phase="connect") or 0) > 0
    assert value(samples, "probe_http_duration_seconds", phase="tls") == 0.0
    assert value(samples, "probe_ip_protocol") == 4.0

    setup["inference"]["engine"] = "Error"
    try:
        status, _, samples = probe(setup, setup["inference_url"], "colossal_inference")
    finally:
        setup["inference"]["engine"] = "Running"
    assert status == 200
    assert_failed(samples, "engine_error")
    assert value(samples, "probe_http_status_code") == 200.0  # the trap: 200 and dead
    assert value(samples, "colossalai_probe_step_success", step="ping") == 1.0
    assert value(samples, "colossalai_probe_step_success", step="engine_check") == 0.0


def test_refused_on_a_closed_port(setup: dict[str, Any]) -> None:
    with refused_port() as closed:
        started = time.monotonic()
        _, _, samples = probe(setup, f"http://127.0.0.1:{closed}", "http_2xx")
        assert_failed(samples, "refused")
        assert value(samples, "probe_http_status_code") == 0.0
        assert time.monotonic() - started < 2
        _, _, samples = probe(setup, f"127.0.0.1:{closed}", "tcp_connect")
        assert_failed(samples, "refused")


def test_timeout_is_bounded_by_the_module_and_by_the_scrape_timeout(
        setup: dict[str, Any]) -> None:
    target = f"http://127.0.0.1:{setup['silent_port']}"
    started = time.monotonic()
    _, _, samples = probe(setup, target, "fast_http")  # module timeout 1s
    elapsed = time.monotonic() - started
    assert_failed(samples, "timeout")
    assert 0.9 < (value(samples, "probe_duration_seconds") or 0) < 1.5
    assert elapsed < 2.5
    # http_2xx has 5s, but Prometheus says it gives up after 1.5s (offset 0.5 s).
    started = time.monotonic()
    _, _, samples = probe(setup, target, "http_2xx",
                          X_Prometheus_Scrape_Timeout_Seconds="1.5")
    assert_failed(samples, "timeout")
    assert 0.9 < (value(samples, "probe_duration_seconds") or 0) < 1.5
    assert time.monotonic() - started < 2.5
    assert (value(samples, "probe_http_duration_seconds", phase="processing") or 0) > 0.9


def test_broken_servers_are_protocol_and_connection(setup: dict[str, Any]) -> None:
    with raw_server(b"SSH-2.0-OpenSSH_9.2\r\n") as port:
        _, _, samples = probe(setup, f"http://127.0.0.1:{port}", "http_2xx")
    assert_failed(samples, "protocol")
    with raw_server(b"") as port:
        _, _, samples = probe(setup, f"http://127.0.0.1:{port}", "http_2xx")
    assert_failed(samples, "connection")


def test_unreadable_header_file_at_probe_time_is_config(setup: dict[str, Any]) -> None:
    setup["gone"].unlink()
    _, _, samples = probe(setup, setup["inference_url"] + "/ping", "secret_gone")
    assert_failed(samples, "config")


def test_unresolvable_name_is_dns(setup: dict[str, Any]) -> None:
    _, _, samples = probe(setup, "http://no-such-host.invalid:8080", "http_2xx")
    assert_failed(samples, "dns")
    assert value(samples, "probe_ip_protocol") == 0.0


def test_tls_self_signed_fails_verification_and_passes_when_trusted(
        setup: dict[str, Any]) -> None:
    tls_url = setup["tls_url"]
    assert tls_url.startswith("https://")
    _, _, samples = probe(setup, tls_url + "/ping", "http_2xx")
    assert_failed(samples, "tls")
    _, _, samples = probe(setup, tls_url + "/ping", "tls_insecure")
    assert value(samples, "probe_success") == 1.0
    assert value(samples, "probe_http_ssl") == 1.0
    assert (value(samples, "probe_http_duration_seconds", phase="tls") or 0) > 0
    _, _, samples = probe(setup, tls_url + "/ping", "tls_ca")
    assert value(samples, "probe_success") == 1.0
    expiry = value(samples, "probe_ssl_earliest_cert_expiry") or 0
    assert time.time() + 86400 < expiry < time.time() + 3 * 86400  # -days 2
    _, _, samples = probe(setup, tls_url.removeprefix("https://"), "tcp_tls")
    assert value(samples, "probe_success") == 1.0
    # TLS spoken to a plain-HTTP port.
    plain = setup["inference_url"].replace("http://", "https://") + "/ping"
    _, _, samples = probe(setup, plain, "tls_insecure")
    assert_failed(samples, "tls")


def test_wrong_status_and_body_mismatch(setup: dict[str, Any]) -> None:
    _, _, samples = probe(setup, setup["inference_url"] + "/nope", "http_2xx")
    assert_failed(samples, "status")
    assert value(samples, "probe_http_status_code") == 404.0
    # /ping answers JSON, but not the status: ok this module wants.
    _, _, samples = probe(setup, setup["inference_url"] + "/x", "json_ready")
    assert_failed(samples, "status")
    _, _, samples = probe(setup, setup["chat_url"], "json_ready")
    assert_failed(samples, "status")  # 503 while loading
    setup["loaded"]["ready"] = True
    _, _, samples = probe(setup, setup["chat_url"], "json_ready")
    assert value(samples, "probe_success") == 1.0
    setup["loaded"]["ready"] = False
    # 200, but the JSON field differs (/ping says Healthy) ...
    _, _, samples = probe(setup, setup["inference_url"], "ping_json")
    assert_failed(samples, "body")
    assert value(samples, "probe_http_status_code") == 200.0
    # ... or the body is not JSON at all (FastAPI's HTML /docs under the module's path).
    _, _, samples = probe(setup, setup["chat_url"] + "/docs", "json_any")
    assert_failed(samples, "body")
    assert value(samples, "probe_http_status_code") == 200.0


def test_health_json_loading_then_ok(setup: dict[str, Any]) -> None:
    setup["loaded"]["ready"] = False
    _, _, samples = probe(setup, setup["chat_url"], "health_json")
    assert_failed(samples, "loading")
    assert value(samples, "probe_http_status_code") == 503.0
    setup["loaded"]["ready"] = True
    try:
        _, _, samples = probe(setup, setup["chat_url"], "health_json")
    finally:
        setup["loaded"]["ready"] = False
    assert value(samples, "probe_success") == 1.0
    _, _, samples = probe(setup, setup["inference_url"], "health_json")
    assert_failed(samples, "status")  # no /health there: 404


def test_colossalchat_without_health_route(setup: dict[str, Any]) -> None:
    _, _, samples = probe(setup, setup["chat_url"], "colossalchat")
    assert value(samples, "probe_success") == 1.0
    assert value(samples, "colossalai_probe_step_success", step="openapi") == 1.0
    # openapi and docs switched off: the root's 404 (below 500) still means "listening".
    _, _, samples = probe(setup, setup["bare_chat_url"], "colossalchat")
    assert value(samples, "probe_success") == 1.0
    assert value(samples, "colossalai_probe_step_success", step="openapi") == 0.0
    assert value(samples, "colossalai_probe_step_success", step="root") == 1.0
    assert value(samples, "probe_http_status_code") == 404.0


def test_tcp_connect_open_port(setup: dict[str, Any]) -> None:
    _, _, samples = probe(setup, setup["chat_url"].removeprefix("http://"), "tcp_connect")
    assert value(samples, "probe_success") == 1.0
    assert value(samples, "colossalai_probe_step_success", step="connect") == 1.0
    assert not any(name.startswith("probe_http_") for name, _ in samples)


def test_generate_posts_a_tiny_real_request_with_a_secret_header(
        setup: dict[str, Any]) -> None:
    before = setup["chat"].get("generated", 0)
    _, _, samples = probe(setup, setup["chat_url"], "chat_generate")
    assert value(samples, "probe_success") == 1.0
    assert setup["chat"]["generated"] == before + 1
    assert setup["chat"]["authorization"] == "Bearer s3cret"
    assert (value(samples, "probe_http_uncompressed_body_length") or 0) > 0
    # generate is not built in: without a config module there is nothing to run.
    status, body, _ = probe(setup, setup["chat_url"], "generate")
    assert status == 400
    assert json.loads(body)["error"] == "unknown_module"


@pytest.mark.parametrize(("query", "status", "reason"), [
    ({"module": "http_2xx"}, 400, "missing_target"),
    ({"target": "127.0.0.1:1"}, 400, "missing_module"),
    ({"target": "127.0.0.1:1", "module": "nope"}, 400, "unknown_module"),
    ({"target": "ftp://127.0.0.1/", "module": "http_2xx"}, 400, "bad_target"),
    ({"target": "http://[::1", "module": "http_2xx"}, 400, "bad_target"),
    ({"target": "http://u:p@127.0.0.1/", "module": "http_2xx"}, 400, "bad_target"),
    ({"target": "127.0.0.1", "module": "tcp_connect"}, 400, "bad_target"),
    ({"target": "10.255.255.1:8080", "module": "tcp_connect"}, 403, "not_allowed"),
    ({"target": "http://192.0.2.7/", "module": "http_2xx"}, 403, "not_allowed"),
    ({"target": "http://0.0.0.0:80/", "module": "http_2xx"}, 403, "not_allowed"),
])
def test_bad_requests_get_a_json_reason(setup: dict[str, Any], query: dict[str, str],
                                        status: int, reason: str) -> None:
    got, _, body = http_get(f"{setup['prober'].url}/probe?{urllib.parse.urlencode(query)}")
    assert got == status
    payload = json.loads(body)
    assert payload["error"] == reason
    assert payload["message"]


def test_bad_scrape_timeout_header_is_400(setup: dict[str, Any]) -> None:
    status, body, _ = probe(setup, setup["inference_url"], "http_2xx",
                            X_Prometheus_Scrape_Timeout_Seconds="soon")
    assert status == 400
    assert json.loads(body)["error"] == "bad_timeout"


def test_debug_shows_the_probe_log(setup: dict[str, Any]) -> None:
    query = urllib.parse.urlencode({"target": setup["inference_url"],
                                    "module": "colossal_inference", "debug": "true"})
    status, _, body = http_get(f"{setup['prober'].url}/probe?{query}")
    text = body.decode()
    assert status == 200
    assert "step engine_check: GET /engine_check" in text
    assert "probe_success 1.0" in text


def assert_clean_and_catalogued(texts: list[str]) -> None:
    """Each exposition passes `promtool check metrics` and uses only catalogued names."""
    promtool = require_binary("promtool")
    known = catalogue.known_sample_names()
    for text in texts:
        lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                              text=True, timeout=30, check=False)
        assert lint.returncode == 0, lint.stdout + lint.stderr
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                assert sample.name in known, sample.name


def test_outputs_are_promtool_clean_and_catalogued(setup: dict[str, Any]) -> None:
    with refused_port() as closed:
        texts = [probe(setup, setup["inference_url"], "colossal_inference")[1],
                 probe(setup, f"http://127.0.0.1:{closed}", "http_2xx")[1],
                 probe(setup, setup["tls_url"], "tls_ca")[1],
                 probe(setup, "127.0.0.1:1", "tcp_connect")[1]]
    probe(setup, "10.255.255.1:8080", "tcp_connect")  # a rejection, counted
    status, _, body = http_get(setup["prober"].url + "/metrics")
    assert status == 200
    texts.append(body.decode())
    assert_clean_and_catalogued(texts)
    samples = probe_samples(texts[-1])
    assert (value(samples, "colossalai_probe_probes_total", module="colossal_inference",
                  result="success") or 0) >= 1
    assert (value(samples, "colossalai_probe_probes_total", module="http_2xx",
                  result="refused") or 0) >= 1
    assert value(samples, "colossalai_probe_probes_total", module="tcp_connect",
                 result="engine_error") == 0.0  # pre-created
    assert (value(samples, "colossalai_probe_rejected_total", reason="not_allowed") or 0) >= 1
    assert value(samples, "colossalai_probe_in_flight") == 0.0
    assert (value(samples, "colossalai_probe_duration_seconds_count",
                  module="colossal_inference") or 0) >= 1


def test_health(setup: dict[str, Any]) -> None:
    status, _, body = http_get(setup["prober"].url + "/health")
    assert status == 200
    assert "colossal_inference" in json.loads(body)["modules"]
