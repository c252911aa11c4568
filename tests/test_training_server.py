"""The in-process server over real HTTP: /metrics (promtool-clean) and the tutorial's /health."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
from pathlib import Path

import pytest

from colossalai_exporter import TrainingMonitor, catalogue
from conftest import free_port, http_get, require_binary, wait_until


def health(monitor: TrainingMonitor) -> tuple[int, dict[str, object]]:
    assert monitor.url is not None
    status, _, body = http_get(monitor.url + "/health")
    return status, json.loads(body)


def test_health_follows_the_tutorial_contract_and_a_stall_leaves_stacks(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A step budget a loaded machine meets between a step and the /health asked after
    # it: the healthy answers below must not depend on how soon the request is served.
    monitor = TrainingMonitor(port=0, host="127.0.0.1", run_dir=tmp_path, step_timeout=5.0,
                              publish_interval=0.05)
    try:
        status, body = health(monitor)
        assert status == 503
        assert body["status"] == "degraded"
        assert body["reason"] == "phase is init"
        training = body["training"]
        assert isinstance(training, dict)
        # The tutorial's training-state fields, all present.
        assert {"status", "step", "loss", "pipeline_stage", "gemini_oom_events",
                "last_step_time", "last_checkpoint_step", "world_size",
                "kernels_compiled"} <= set(training)

        with monitor.step() as step:
            step.loss = 0.5
        status, body = health(monitor)
        assert status == 200
        assert body["status"] == "ok"
        assert body["stalled"] is False
        assert body["training"]["step"] == 1  # type: ignore[index]
        assert body["training"]["kernels_compiled"] is True  # type: ignore[index]

        with caplog.at_level(logging.WARNING, "colossalai_exporter.training"):
            # No step for longer than the budget: the publisher sees the stall.
            stacks = wait_until(lambda: list(tmp_path.glob("stacks-rank0-*.txt")),
                                timeout=30, what="stacks file")
        status, body = health(monitor)
        assert status == 503
        assert body["stalled"] is True
        assert str(body["reason"]).startswith("stalled in phase training: no step completed")
        text = stacks[0].read_text()
        assert "MainThread" in text
        assert "test_health_follows_the_tutorial_contract" in text  # where the loop is
        assert any(str(stacks[0]) in r.getMessage() for r in caplog.records)
        _, _, metrics = http_get(monitor.url + "/metrics")  # type: ignore[operator]
        assert b'colossalai_training_stalled{rank="0"} 1.0' in metrics
        assert b'colossalai_training_stalls_total{rank="0"} 1.0' in metrics

        monitor.step_done(0.01)  # progress again: healthy, and the stall was counted once
        assert health(monitor)[0] == 200
        monitor.finish()
        status, body = health(monitor)
        assert (status, body["reason"]) == (503, "run finished")
    finally:
        monitor.close()


def test_metrics_are_catalogued_and_promtool_clean(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    monitor = TrainingMonitor(port=0, host="127.0.0.1", run_dir=tmp_path)
    try:
        with monitor.checkpoint(step=0):
            pass
        for _ in range(3):
            with monitor.step(samples=2, tokens=64) as step:
                step.loss = 1.25
        monitor.record_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        assert monitor.url is not None
        status, _, body = http_get(monitor.url + "/metrics")
        assert status == 200
        check = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                               timeout=30, check=False)
        assert check.returncode == 0, check.stdout + check.stderr
        known = catalogue.known_sample_names()
        names = {line.split("{")[0].split(" ")[0] for line in body.decode().splitlines()
                 if line and not line.startswith("#")}
        assert names <= known, names - known
        assert 'colossalai_gemini_oom_total{device="cuda",rank="0"} 1.0' in body.decode()
        # OpenMetrics when asked for it.
        status, headers, _ = http_get(monitor.url + "/metrics",
                                      headers={"Accept": "application/openmetrics-text"})
        assert headers["content-type"].startswith("application/openmetrics-text")
    finally:
        monitor.close()


def test_port_in_use_is_a_warning_and_training_continues(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with caplog.at_level(logging.WARNING, "colossalai_exporter.training"):
            monitor = TrainingMonitor(port=port, host="127.0.0.1", run_dir=tmp_path)
        try:
            assert monitor.url is None
            messages = [r.getMessage() for r in caplog.records]
            assert any("cannot serve /metrics and /health" in m and str(port) in m
                       and "training continues" in m for m in messages), messages
            # It names what a training script sets, not the daemons' flag.
            assert any("TrainingMonitor(port=" in m and "COLOSSALAI_EXPORTER_PORT" in m
                       and "--web" not in m for m in messages), messages
            monitor.step_done(0.01)
            assert monitor.snapshot().steps == 1
            assert monitor.snapshot().monitor_errors["server"] == 1
        finally:
            monitor.close()


def test_the_monitor_says_where_it_serves(tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "colossalai_exporter.training"):
        monitor = TrainingMonitor(port=0, host="127.0.0.1", run_dir=tmp_path)
    try:
        assert monitor.url is not None
        assert any(f"rank 0 serves /metrics and /health on {monitor.url}" in r.getMessage()
                   and str(tmp_path) in r.getMessage() for r in caplog.records), caplog.text
    finally:
        monitor.close()


def test_serve_modes_choose_ranks_and_ports(tmp_path: Path) -> None:
    base = free_port()
    other = TrainingMonitor(rank=1, local_rank=1, serve="rank0", port=base, run_dir=tmp_path)
    local = TrainingMonitor(rank=3, local_rank=1, serve="local", port=base - 1,
                            host="127.0.0.1", run_dir=tmp_path)
    try:
        assert other.url is None  # only rank 0 serves by default
        assert local.url == f"http://127.0.0.1:{base}"  # base + local rank
        status, body = health(local)
        assert body["training"]["rank"] == 3  # type: ignore[index]
        assert status == 503
    finally:
        other.close()
        local.close()


def test_the_rank_server_takes_the_web_config_tls_client_certificates_and_basic_auth(
        tmp_path: Path, pki: Path) -> None:
    """As every other server of the project: TLS with a required client certificate and
    bcrypt basic auth, from TrainingMonitor(web_config=…)."""
    import ssl
    import urllib.error
    import urllib.request
    from base64 import b64encode

    import bcrypt

    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {pki}/server.crt\n"
                   f"  key_file: {pki}/server.key\n"
                   "  client_auth_type: RequireAndVerifyClientCert\n"
                   f"  client_ca_file: {pki}/ca.crt\n"
                   f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    monitor = TrainingMonitor(port=free_port(), host="127.0.0.1", run_dir=tmp_path / "run",
                              web_config=web)
    try:
        assert monitor.url is not None and monitor.url.startswith("https://127.0.0.1:")
        client = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        client.load_cert_chain(str(pki / "client.crt"), str(pki / "client.key"))

        def get(auth: str | None) -> int:
            headers = {"Authorization": "Basic " + b64encode(auth.encode()).decode()} \
                if auth else {}
            request = urllib.request.Request(monitor.url + "/metrics", headers=headers)
            try:
                with urllib.request.urlopen(request, context=client, timeout=5) as response:
                    return int(response.status)
            except urllib.error.HTTPError as exc:
                exc.close()
                return exc.code

        assert get("prometheus:s3cret") == 200
        assert get(None) == 401
        assert get("prometheus:wrong") == 401
        no_cert = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionResetError)):
            urllib.request.urlopen(monitor.url + "/health", context=no_cert, timeout=5).read()
    finally:
        monitor.close()


def test_the_web_config_from_the_environment_and_a_bad_one_serves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """COLOSSALAI_EXPORTER_WEB_CONFIG, for launchers that set the environment; a file
    that cannot be read or parsed leaves the rank without a server (never an open one),
    with a warning, and training goes on."""
    import bcrypt

    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    monkeypatch.setenv("COLOSSALAI_EXPORTER_WEB_CONFIG", str(web))
    monitor = TrainingMonitor(port=free_port(), host="127.0.0.1", run_dir=tmp_path / "run")
    try:
        assert monitor.url is not None
        assert http_get(monitor.url + "/metrics")[0] == 401
    finally:
        monitor.close()

    web.write_text("basic_auth_users: [not, a, mapping]\n")
    with caplog.at_level(logging.WARNING, "colossalai_exporter.training"):
        monitor = TrainingMonitor(port=free_port(), host="127.0.0.1", run_dir=tmp_path / "run")
    try:
        assert monitor.url is None
        messages = [r.getMessage() for r in caplog.records]
        assert any("cannot serve /metrics and /health" in m and str(web) in m
                   for m in messages), messages
        monitor.step_done(0.01)
        assert monitor.snapshot().steps == 1
        assert monitor.snapshot().monitor_errors["server"] == 1
    finally:
        monitor.close()
