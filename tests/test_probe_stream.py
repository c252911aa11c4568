"""The streaming probe (prober stream): a real prober process against real uvicorn servers on
loopback that stream in each server's shape and misbehave in each way a chat server does
while its /health stays 200."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from chat_servers import served, streaming_app
from colossalai_exporter.probe.stream import Done, EngineError, StreamParser, Token
from conftest import ServerProcess, cli_env, free_port, http_get
from test_probe_e2e import (
    assert_clean_and_catalogued,
    assert_failed,
    probe,
    probe_samples,
    value,
)

# Limits far above what a healthy stream on a loaded machine needs (its tokens come at once),
# and never reached by a misbehaving one on a timer: those servers never send again.
CONFIG = """
allow: {loopback: true}
modules:
  openai_stream:
    prober: stream
    timeout: 20s
    stream: {format: openai, first_token_timeout: 3s, max_token_gap: 2s}
  inference_stream:
    prober: stream
    timeout: 20s
    stream: {format: colossal_inference, first_token_timeout: 3s, max_token_gap: 2s}
  chat_stream:
    prober: stream
    timeout: 20s
    stream: {format: colossalchat, first_token_timeout: 3s, max_token_gap: 2s}
  capped_stream:
    prober: stream
    timeout: 20s
    stream: {format: openai, first_token_timeout: 3s, max_token_gap: 2s}
    http: {max_body_bytes: 4096}
  short_stream:
    prober: stream
    timeout: 4s
    stream: {format: openai, first_token_timeout: 3s, max_token_gap: 2s}
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    config = tmp_path_factory.mktemp("stream") / "probe.yml"
    config.write_text(CONFIG)
    state: dict[str, Any] = {}
    port = free_port()
    prober = ServerProcess(["probe", "--config.file", str(config),
                            "--web.listen-address", f"127.0.0.1:{port}"], port, cli_env())
    with served(streaming_app(state)) as url:
        try:
            prober.wait_ready("/health")
            yield {"prober": prober, "url": url, "state": state}
        finally:
            prober.close()


def stream_probe(setup: dict[str, Any], mode: str, module: str) -> dict[Any, float]:
    status, text, samples = probe(setup, f"{setup['url']}/{mode}", module, timeout=30)
    assert status == 200, text
    return samples


@pytest.mark.parametrize("module", ["openai_stream", "inference_stream", "chat_stream"])
def test_a_healthy_stream_succeeds_with_its_timings(setup: dict[str, Any], module: str) -> None:
    samples = stream_probe(setup, "ok", module)
    assert value(samples, "probe_success") == 1.0, samples
    assert value(samples, "colossalai_probe_stream_completed") == 1.0
    assert value(samples, "colossalai_probe_stream_tokens") == 3.0  # role and ping: no token
    first = value(samples, "colossalai_probe_stream_first_token_seconds")
    assert first is not None and 0 < first <= (value(samples, "probe_duration_seconds") or 0)
    assert (value(samples, "colossalai_probe_stream_max_token_gap_seconds") or 0) >= 0
    assert value(samples, "colossalai_probe_stream_tokens_per_second") is not None
    assert value(samples, "colossalai_probe_step_success", step="stream") == 1.0


@pytest.mark.parametrize("module", ["openai_stream", "inference_stream", "chat_stream"])
def test_a_stream_that_wedges_after_its_first_tokens_is_a_token_gap(
        setup: dict[str, Any], module: str) -> None:
    assert http_get(f"{setup['url']}/health")[0] == 200  # what a liveness probe sees
    started = time.monotonic()
    samples = stream_probe(setup, "wedge", module)
    assert_failed(samples, "token_gap")
    assert time.monotonic() - started < 15  # cut at the gap limit, not the module's timeout
    assert (value(samples, "colossalai_probe_stream_tokens") or 0) >= 1
    assert value(samples, "colossalai_probe_stream_completed") == 0.0
    assert value(samples, "colossalai_probe_step_success", step="stream") == 0.0


@pytest.mark.parametrize("module", ["openai_stream", "inference_stream", "chat_stream"])
def test_no_first_token_within_the_limit(setup: dict[str, Any], module: str) -> None:
    samples = stream_probe(setup, "no_first_token", module)
    assert_failed(samples, "first_token_timeout")
    assert value(samples, "colossalai_probe_stream_first_token_seconds") is None
    assert value(samples, "colossalai_probe_stream_tokens") == 0.0


@pytest.mark.parametrize("module", ["openai_stream", "chat_stream"])
def test_a_body_that_ends_before_the_final_event_is_truncated(
        setup: dict[str, Any], module: str) -> None:
    assert_failed(stream_probe(setup, "cut", module), "truncated")


@pytest.mark.parametrize("module", ["openai_stream", "inference_stream", "chat_stream"])
def test_a_connection_dropped_mid_stream_is_truncated(setup: dict[str, Any],
                                                      module: str) -> None:
    samples = stream_probe(setup, "drop", module)
    assert_failed(samples, "truncated")
    assert (value(samples, "colossalai_probe_stream_tokens") or 0) >= 1


@pytest.mark.parametrize("module", ["openai_stream", "inference_stream", "chat_stream"])
def test_a_stream_that_completes_with_no_token_is_empty(setup: dict[str, Any],
                                                        module: str) -> None:
    samples = stream_probe(setup, "empty", module)
    assert_failed(samples, "empty")
    assert value(samples, "colossalai_probe_stream_completed") == 1.0


@pytest.mark.parametrize("module", ["openai_stream", "chat_stream"])
def test_an_error_event_is_an_engine_error(setup: dict[str, Any], module: str) -> None:
    assert_failed(stream_probe(setup, "error", module), "engine_error")


@pytest.mark.parametrize("module", ["openai_stream", "inference_stream", "chat_stream"])
def test_bytes_that_are_not_the_format_are_body_not_a_crash(setup: dict[str, Any],
                                                            module: str) -> None:
    assert_failed(stream_probe(setup, "garbage", module), "body")
    assert http_get(f"{setup['prober'].url}/health")[0] == 200  # the prober is fine


def test_an_endless_stream_is_cut_by_the_body_cap_and_by_the_timeout(
        setup: dict[str, Any]) -> None:
    samples = stream_probe(setup, "forever", "capped_stream")
    assert_failed(samples, "body")
    assert (value(samples, "probe_http_uncompressed_body_length") or 0) <= 4096 + 65536
    started = time.monotonic()
    samples = stream_probe(setup, "forever", "short_stream")
    assert_failed(samples, "timeout")
    assert (value(samples, "colossalai_probe_stream_tokens") or 0) > 3
    assert time.monotonic() - started < 15


def test_the_stream_module_is_refused_a_first_token_limit_past_its_timeout(
        tmp_path: Any) -> None:
    from colossalai_exporter.errors import ConfigError
    from colossalai_exporter.probe.config import parse_module

    with pytest.raises(ConfigError, match=r"first_token_timeout .* must be shorter"):
        parse_module("m", {"prober": "stream", "timeout": "5s",
                           "stream": {"first_token_timeout": "10s"}}, "probe.yml: modules.m",
                     tmp_path)
    with pytest.raises(ConfigError, match="stream is only for prober stream"):
        parse_module("m", {"prober": "http", "stream": {}}, "probe.yml: modules.m", tmp_path)
    module = parse_module("m", {"prober": "stream", "stream": {"format": "colossalchat"}},
                          "probe.yml: modules.m", tmp_path)
    assert (module.http.method, module.http.path) == ("POST", "/generate/stream")


def test_the_parsers_split_reads_anywhere() -> None:
    """Events and UTF-8 characters split across reads at every byte give the same events."""
    streams = {
        "openai": 'data: {"choices":[{"delta":{"role":"assistant"}}]}\r\n\r\n: keep-alive\n\n'
                  'data: {"choices":[{"delta":{"content":"é"},"finish_reason":null}]}\n\n'
                  'data: {"error": {"message": "boom"}}\r\rdata: [DONE]\n\n',
        "colossalchat": "event: generate\r\ndata: ü\r\n\r\n: ping\r\n\r\n"
                        "event: end\r\ndata: \r\n\r\n",
        "colossal_inference": '{"text": "p"}\0{"text": "pé"}\0',
    }
    expected = {
        "openai": [Token("é"), EngineError("boom"), Done()],
        "colossalchat": [Token("ü"), Done()],
        "colossal_inference": [Token("p"), Token("é"), Done()],
    }
    for fmt, text in streams.items():
        data = text.encode()
        for cut in range(len(data) + 1):
            parser = StreamParser(fmt)  # type: ignore[arg-type]
            events = [*parser.feed(data[:cut]), *parser.feed(data[cut:]), *parser.end()]
            assert events == expected[fmt], (fmt, cut)


def test_stream_outputs_are_promtool_clean_and_catalogued(setup: dict[str, Any]) -> None:
    texts = [probe(setup, f"{setup['url']}/{mode}", "openai_stream", timeout=30)[1]
             for mode in ("ok", "no_first_token")]
    texts.append(http_get(setup["prober"].url + "/metrics")[2].decode())
    assert_clean_and_catalogued(texts)
    counters = probe_samples(texts[-1])
    assert (value(counters, "colossalai_probe_probes_total", module="openai_stream",
                  result="first_token_timeout") or 0) >= 1
    assert value(counters, "colossalai_probe_probes_total", module="chat_stream",
                 result="token_gap") is not None  # pre-created for every module
