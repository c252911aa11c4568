"""The real bridge process receiving Alertmanager-shaped bodies over HTTP, delivering to
the fake Vigilmon on loopback, with its state on a real filesystem."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from bridge_payloads import alert, body
from colossalai_exporter import catalogue
from colossalai_exporter.bridge import signing
from colossalai_exporter.bridge.payload import SCHEMA
from conftest import (
    ServerProcess,
    cli_env,
    free_port,
    http_get,
    is_root,
    require,
    require_binary,
    run_cli,
    wait_until,
)
from fake_vigilmon import FakeVigilmon, fake_vigilmon

TOKEN = "test-token-123"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


class BridgeProcess(ServerProcess):
    """conftest's ServerProcess with the log in a file: a pipe nobody reads would
    block the bridge once its log filled the pipe buffer."""

    def __init__(self, args: list[str], port: int, log_path: Path,
                 env: dict[str, str] | None = None, scheme: str = "http") -> None:
        self.port = port
        self.url = f"{scheme}://127.0.0.1:{port}"
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "colossalai_exporter", *args],
                stdout=log, stderr=subprocess.STDOUT, env=env or cli_env())

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


Start = Callable[..., BridgeProcess]


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[Start]:
    """Start the real bridge (``colossalai-exporter bridge``); all are stopped afterwards.

    ``web_config`` is passed as ``--web.config.file``; with TLS in it the caller waits
    for readiness itself (``ready=False``), with the client certificate it needs.
    """
    started: list[BridgeProcess] = []

    def start(config: Path, *, env: dict[str, str] | None = None,
              web_config: Path | None = None, ready: bool = True,
              extra_args: list[str] | None = None) -> BridgeProcess:
        port = free_port()
        extra = ["--web.config.file", str(web_config)] if web_config else []
        extra += extra_args or []
        proc = BridgeProcess(["bridge", "--config.file", str(config),
                              "--web.listen-address", f"127.0.0.1:{port}", *extra], port,
                             tmp_path / f"bridge-{len(started)}.log", env,
                             "https" if web_config else "http")
        started.append(proc)
        if ready:
            proc.wait_ready("/metrics")
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def vigilmon() -> Iterator[FakeVigilmon]:
    with fake_vigilmon() as fake:
        yield fake


def write_config(path: Path, state_dir: Path, targets: list[dict[str, Any]],
                 **extra: Any) -> Path:
    config = {"state_dir": str(state_dir), "receiver": {"bearer_token": TOKEN},
              "delivery": {"initial_backoff": "100ms", "max_backoff": "1s"},
              "targets": targets, **extra}
    path.write_text(yaml.safe_dump(config))
    return path


def post(bridge: ServerProcess, payload: bytes, headers: dict[str, str] | None = None,
         timeout: float = 10) -> requests.Response:
    return requests.post(bridge.url + "/alertmanager", data=payload,
                         headers=AUTH if headers is None else headers, timeout=timeout)


def metric(bridge: ServerProcess, name: str, **labels: str) -> float | None:
    _, _, text = http_get(bridge.url + "/metrics")
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    prefix = f"{name}{{{want}}} " if labels else f"{name} "
    for line in text.decode().splitlines():
        if line.startswith(f"{name}{{") and labels:
            got = dict(part.split("=", 1) for part in line[len(name) + 1:line.index("}")]
                       .split(","))
            if {k: v.strip('"') for k, v in got.items()} == labels:
                return float(line.rsplit(" ", 1)[1])
        elif line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return None


def webhook_target(vigilmon: FakeVigilmon, **extra: Any) -> dict[str, Any]:
    return {"name": "hook", "type": "webhook", "url": vigilmon.url + "/hook",
            "timeout": "500ms", **extra}


def start_bridge(server_process: Start, config: Path) -> BridgeProcess:
    return server_process(config)


def test_bad_inputs_get_their_status_and_the_bridge_keeps_serving(
        server_process: Start, tmp_path: Path, vigilmon: FakeVigilmon) -> None:
    config = write_config(tmp_path / "bridge.yml", tmp_path / "state",
                          [webhook_target(vigilmon)],
                          receiver={"bearer_token": TOKEN, "max_body_bytes": 1 << 20,
                                    "body_timeout": "1s"})
    bridge = start_bridge(server_process, config)
    good = body(alert(job="x"))
    cases: list[tuple[bytes, dict[str, str], int, str]] = [
        (b"{not json", AUTH, 400, "malformed_json"),
        # Nested 50,000 deep: both JSON decoders give up; a 400, never a 500.
        (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, AUTH, 400, "malformed_json"),
        (b"\xff\xfe\x00", AUTH, 400, "invalid_utf8"),
        (json.dumps({"version": "4", "alerts": "nope"}).encode(), AUTH, 400, "invalid_type"),
        (json.dumps({"version": "4", "status": "firing", "receiver": "r",
                     "alerts": []}).encode(), AUTH, 400, "missing_field"),
        (good.replace(b'"version": "4"', b'"version": "5"'), AUTH, 400, "unknown_version"),
        (good, {"Content-Type": "application/json"}, 401, "unauthorized"),
        (good, {**AUTH, "Authorization": "Bearer wrong"}, 401, "unauthorized"),
        (good, {**AUTH, "Authorization": f"Basic {TOKEN}"}, 401, "unauthorized"),
        (good, {**AUTH, "Content-Type": "text/plain"}, 415, "unsupported_media_type"),
        # Strict JSON, and a 400 for a number Python's json would refuse with a 500.
        (good[:-1] + b', "x": NaN}', AUTH, 400, "malformed_json"),
        (good[:-1] + b', "x": ' + b"9" * 5000 + b"}", AUTH, 400, "invalid_value"),
    ]
    for payload, headers, status, reason in cases:
        response = post(bridge, payload, headers)
        assert response.status_code == status, (reason, response.text)
        assert response.json()["error"] == reason
        assert response.json()["message"]
    assert requests.get(bridge.url + "/alertmanager", timeout=5).status_code == 405
    # Alertmanager's url written with a trailing slash: the same route, not a 404.
    slash = requests.post(bridge.url + "/alertmanager/", data=good, headers=AUTH, timeout=10)
    assert slash.status_code == 200, slash.text
    # Refused by the HTTP layer, before any route: counted too.
    with socket.create_connection(("127.0.0.1", bridge.port), timeout=5) as sock:
        sock.sendall(b"POST /alertmanager HTTP/1.1\r\nNo colon here\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 400 ")

    # 10 MB declared up front: refused without reading it.
    conn = http.client.HTTPConnection("127.0.0.1", bridge.port, timeout=10)
    conn.putrequest("POST", "/alertmanager")
    for key, value in {**AUTH, "Content-Length": str(10 << 20)}.items():
        conn.putheader(key, value)
    conn.endheaders()
    answer = conn.getresponse()
    assert answer.status == 413
    assert json.loads(answer.read())["error"] == "too_large"
    conn.close()
    # Chunked, no length: cut off once over the cap.
    chunks = (b"x" * 65536 for _ in range(40))
    response = requests.post(bridge.url + "/alertmanager", data=chunks, headers=AUTH, timeout=10)
    assert response.status_code == 413

    # Thousands of alerts in one (legal) notification are stored.
    many = body(*[alert("TrainingStalled", job=f"j{i}") for i in range(3000)])
    assert len(many) < 1 << 20
    assert post(bridge, many).status_code == 200

    # A slow client that never finishes its body gets 408; others are served meanwhile.
    slow = socket.create_connection(("127.0.0.1", bridge.port), timeout=5)
    slow.sendall(b"POST /alertmanager HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                 + TOKEN.encode() + b"\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{")
    assert post(bridge, good).status_code == 200
    assert b" 408 " in slow.recv(4096).split(b"\r\n")[0] + b" "
    slow.close()

    assert http_get(bridge.url + "/health")[0] == 200
    for reason, count in [("malformed_json", 3), ("invalid_utf8", 1), ("unauthorized", 3),
                          ("unsupported_media_type", 1), ("too_large", 2),
                          ("unknown_version", 1), ("missing_field", 1), ("invalid_type", 1),
                          ("invalid_value", 1), ("body_timeout", 1), ("method_not_allowed", 1),
                          ("bad_request", 1), ("head_too_large", 0), ("store_unavailable", 0)]:
        assert metric(bridge, "colossalai_bridge_notifications_rejected_total",
                      reason=reason) == count, reason
    assert metric(bridge, "colossalai_bridge_notifications_received_total") == 3
    vigilmon.wait_for("/hook", 2)
    exposition = http_get(bridge.url + "/metrics")[2]
    lint = subprocess.run([require_binary("promtool"), "check", "metrics"], input=exposition,
                          capture_output=True, timeout=30, check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    served = {line.split("{")[0].split(" ")[0] for line in exposition.decode().splitlines()
              if line and not line.startswith("#")}
    assert served <= catalogue.known_sample_names()


def test_webhook_body_is_stable_signed_and_retried_on_5xx_timeouts_and_429(
        server_process: Start, tmp_path: Path, vigilmon: FakeVigilmon) -> None:
    secret = "whsec_" + "c2lnbmluZy1rZXktZm9yLXRlc3Rz"
    (tmp_path / "secret").write_text(secret + "\n")
    config = write_config(tmp_path / "bridge.yml", tmp_path / "state", [
        webhook_target(vigilmon, signing_secret_file=str(tmp_path / "secret"))])
    bridge = start_bridge(server_process, config)

    vigilmon.set(status=500, times=2)
    assert post(bridge, body(alert("TrainingStalled", job="a"))).status_code == 200
    got = vigilmon.wait_for("/hook", 1)[0]
    assert metric(bridge, "colossalai_bridge_deliveries_total", target="hook",
                  result="status") == 2
    sent = json.loads(got.body)
    assert sent["schema"] == SCHEMA
    assert sent["alerts"][0]["labels"] == {"alertname": "TrainingStalled", "job": "a"}
    assert got.headers["webhook-id"] == sent["id"]
    assert signing.verify(secret.encode(), got.headers["webhook-id"],
                          int(got.headers["webhook-timestamp"]), got.body,
                          got.headers["webhook-signature"])
    failed = [r for r in vigilmon.received("/hook", include_failed=True)
              if r.headers["x-fake-answered"] == "500"]
    assert {r.headers["webhook-id"] for r in failed} == {sent["id"]}  # same id on retries

    vigilmon.set(status=200, delay=2.0, times=1)  # a hang past the 500ms timeout
    assert post(bridge, body(alert("TrainingStalled", job="b"))).status_code == 200
    wait_until(lambda: metric(bridge, "colossalai_bridge_deliveries_total", target="hook",
                              result="success") == 2, timeout=15, what="b delivered")
    assert metric(bridge, "colossalai_bridge_deliveries_total", target="hook",
                  result="timeout") == 1

    vigilmon.set(status=429, retry_after="1", times=1)
    assert post(bridge, body(alert("TrainingStalled", job="c"))).status_code == 200
    wait_until(lambda: metric(bridge, "colossalai_bridge_deliveries_total", target="hook",
                              result="success") == 3, timeout=15, what="c delivered")
    last = vigilmon.received("/hook")[-1]
    refused = next(r for r in vigilmon.received("/hook", include_failed=True)
                   if r.headers["x-fake-answered"] == "429")
    assert last.at - refused.at >= 0.9  # Retry-After honoured over the 100ms backoff
    assert json.loads(last.body)["alerts"][0]["labels"]["job"] == "c"
    assert metric(bridge, "colossalai_bridge_queue_depth", target="hook") == 0
    assert metric(bridge, "colossalai_bridge_last_success_timestamp_seconds",
                  target="hook") == pytest.approx(time.time(), abs=30)


def test_dead_letters_and_outbox_cli(server_process: Start, tmp_path: Path,
                                     vigilmon: FakeVigilmon) -> None:
    # max_age well over the worker's 1 s idle poll: the retried delivery (created anew
    # by the CLI) must be seen before it is old enough to be dead-lettered again.
    config = write_config(tmp_path / "bridge.yml", tmp_path / "state", [
        webhook_target(vigilmon, max_age="2500ms", body="alertmanager")])
    bridge = start_bridge(server_process, config)
    vigilmon.set(status=500)
    payload = body(alert("TrainingStalled", job="d"))
    assert post(bridge, payload).status_code == 200
    wait_until(lambda: metric(bridge, "colossalai_bridge_dead_letters", target="hook") == 1,
               what="a dead letter")
    assert metric(bridge, "colossalai_bridge_dead_letters_total", target="hook") == 1
    listed = run_cli("bridge", "outbox", "list", "--dead", "--config.file", str(config))
    assert listed.returncode == 0, listed.stderr
    assert "hook" in listed.stdout
    assert "HTTP 500" in listed.stdout
    vigilmon.set(status=200)
    retried = run_cli("bridge", "outbox", "retry", "--all", "--config", str(config))
    assert retried.returncode == 0, retried.stderr
    assert "moved 1" in retried.stdout
    got = vigilmon.wait_for("/hook", 1)
    assert got[0].body == payload  # body: alertmanager forwards the body unchanged
    wait_until(lambda: metric(bridge, "colossalai_bridge_dead_letters", target="hook") == 0,
               what="dead letters emptied")
    bad = run_cli("bridge", "outbox", "drop", "--config.file", str(config))
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("colossalai-exporter: error: name the delivery ids, "
                                  "or pass --all")


def test_kill_9_with_a_backlog_loses_nothing_and_duplicates_nothing_across_restart(
        server_process: Start, tmp_path: Path, vigilmon: FakeVigilmon) -> None:
    config = write_config(tmp_path / "bridge.yml", tmp_path / "state",
                          [webhook_target(vigilmon)],
                          delivery={"initial_backoff": "60s", "max_backoff": "60s"})
    bridge = start_bridge(server_process, config)
    vigilmon.set(status=503)  # down: everything acknowledged piles up in the outbox
    payloads = [body(alert("TrainingStalled", job=f"job{i}")) for i in range(1000)]
    with requests.Session() as session, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: session.post(
            bridge.url + "/alertmanager", data=p, headers=AUTH, timeout=30), payloads))
    assert [a.status_code for a in answers] == [200] * 1000
    stored_id = {f"job{i}": a.json()["id"] for i, a in enumerate(answers)}
    assert metric(bridge, "colossalai_bridge_queue_depth", target="hook") == 1000
    bridge.proc.kill()  # kill -9: no shutdown code runs
    bridge.proc.wait(10)

    vigilmon.set(status=200)
    again = start_bridge(server_process, config)
    delivered = vigilmon.wait_for("/hook", 1000, timeout=60)
    jobs = [json.loads(r.body)["alerts"][0]["labels"]["job"] for r in delivered]
    assert sorted(set(jobs)) == sorted(f"job{i}" for i in range(1000))
    # In order of arrival (the concurrent posts were stored in some order, which the ids
    # returned with each 200 record), and none twice: nothing was in flight at the kill.
    assert [stored_id[job] for job in jobs] == sorted(stored_id.values())
    wait_until(lambda: metric(again, "colossalai_bridge_queue_depth", target="hook") == 0,
               what="empty outbox")

    # Alertmanager re-sends after its own restart, and an HA peer sends the same group:
    # both deduplicated, also across our restart.
    assert post(again, payloads[0]).json()["deduplicated"] == ["hook"]
    assert post(again, payloads[0].replace(b"colossalai\\\\.bridge", b"peer")).json()[
        "deduplicated"] == ["hook"]
    assert metric(again, "colossalai_bridge_deduplicated_total", target="hook") == 2
    assert len(vigilmon.received("/hook")) == 1000


def test_kill_9_right_after_200_delivers_exactly_once(
        server_process: Start, tmp_path: Path, vigilmon: FakeVigilmon) -> None:
    config = write_config(tmp_path / "bridge.yml", tmp_path / "state", [
        webhook_target(vigilmon, signing_secret="k")],
        delivery={"initial_backoff": "60s", "max_backoff": "60s"})
    bridge = start_bridge(server_process, config)
    vigilmon.set(status=503)  # the target is down when the 200 goes out
    assert post(bridge, body(alert("TrainingStalled", job="once"))).status_code == 200
    bridge.proc.kill()
    bridge.proc.wait(10)
    vigilmon.set(status=200)
    again = start_bridge(server_process, config)
    first = vigilmon.wait_for("/hook", 1, timeout=20)[0]
    # A later notification is a barrier: deliveries go out in order, so once it has
    # arrived nothing older can still be on its way.
    assert post(again, body(alert("TrainingStalled", job="later"))).status_code == 200
    delivered = vigilmon.wait_for("/hook", 2)
    jobs = [json.loads(r.body)["alerts"][0]["labels"]["job"] for r in delivered]
    assert jobs == ["once", "later"]
    refused = [r for r in vigilmon.received("/hook", include_failed=True)
               if r.headers["x-fake-answered"] == "503"]
    # The kill may land before or after the first (refused) attempt; any attempt was the
    # same delivery, and exactly one of them succeeded.
    assert {r.headers["webhook-id"] for r in refused} <= {first.headers["webhook-id"]}


def test_heartbeat_newest_only_ttl_and_min_interval(
        server_process: Start, tmp_path: Path, vigilmon: FakeVigilmon) -> None:
    config = write_config(tmp_path / "bridge.yml", tmp_path / "state", [
        {"name": "watchdog", "type": "heartbeat", "url": vigilmon.heartbeat_url("tok"),
         "timeout": "500ms", "ttl": "1500ms", "min_interval": "400ms", "period": "1m",
         "fail": {"url": vigilmon.heartbeat_url("tok") + "/fail"}}],
        delivery={"initial_backoff": "2s", "max_backoff": "2s"})
    bridge = start_bridge(server_process, config)
    vigilmon.set(status=500)
    for _ in range(3):
        assert post(bridge, body(alert())).status_code == 200
    assert metric(bridge, "colossalai_bridge_queue_depth", target="watchdog") == 1
    assert metric(bridge, "colossalai_bridge_heartbeat_pings_dropped_total",
                  target="watchdog", reason="superseded") == 2
    wait_until(lambda: metric(bridge, "colossalai_bridge_heartbeat_pings_dropped_total",
                              target="watchdog", reason="expired") == 1, timeout=10,
               what="the stale ping to expire")
    vigilmon.set(status=200)
    assert metric(bridge, "colossalai_bridge_queue_depth", target="watchdog") == 0
    assert vigilmon.received("/api/heartbeat/") == []  # the late ping was never sent

    for _ in range(2):
        count = len(vigilmon.received("/api/heartbeat/"))
        assert post(bridge, body(alert())).status_code == 200
        vigilmon.wait_for("/api/heartbeat/tok", count + 1)
    pings = vigilmon.received("/api/heartbeat/tok")
    assert pings[1].at - pings[0].at >= 0.35  # min_interval (less timer slack)
    assert post(bridge, body(alert(status="resolved"))).status_code == 200
    vigilmon.wait_for("/api/heartbeat/tok/fail", 1)
    assert http_get(bridge.url + "/health")[0] == 200


def test_no_log_line_carries_a_target_url_even_at_debug(
        server_process: Start, tmp_path: Path, vigilmon: FakeVigilmon) -> None:
    """A heartbeat URL holds its token; urllib3 logs each URL at debug (a retried one's
    path at warning), so the bridge keeps urllib3 to errors and logs URLs redacted."""
    token = "s3cr3t-heartbeat-token"
    config = write_config(tmp_path / "bridge.yml", tmp_path / "state", [
        {"name": "watchdog", "type": "heartbeat", "url": vigilmon.heartbeat_url(token),
         "timeout": "500ms"}])
    bridge = server_process(config, extra_args=["--log.level", "debug"])
    vigilmon.set(status=500)  # a failed delivery is logged (and retried)
    assert post(bridge, body(alert())).status_code == 200
    wait_until(lambda: metric(bridge, "colossalai_bridge_deliveries_total", target="watchdog",
                              result="status") or None, timeout=10, what="a failed ping")
    vigilmon.set(status=200)
    vigilmon.wait_for(f"/api/heartbeat/{token}", 1)
    wait_until(lambda: metric(bridge, "colossalai_bridge_deliveries_total", target="watchdog",
                              result="success") or None, timeout=10, what="the ping")
    log = bridge.output()
    assert "level=debug" in log, log[-2000:]
    assert token not in log, [line for line in log.splitlines() if token in line]


def test_health_heartbeat_pauses_while_firing_and_the_pause_survives_kill_9(
        server_process: Start, tmp_path: Path, vigilmon: FakeVigilmon) -> None:
    config = write_config(tmp_path / "bridge.yml", tmp_path / "state", [
        {"name": "llama-up", "type": "health_heartbeat", "url": vigilmon.url + "/hh",
         "selector": ['alertname="TrainingStalled"', 'job="llama"'],
         # alert_ttl must outlast the pause checks, the kill and a restart on a
         # loaded machine, or the pause expires before it is checked after restart.
         "interval": "200ms", "alert_ttl": "6s", "timeout": "500ms"}])
    bridge = start_bridge(server_process, config)
    vigilmon.wait_for("/hh", 2)
    other = body(alert("TrainingStalled", job="gpt"))  # another job: no pause
    stalled = body(alert("TrainingStalled", job="llama"))
    assert post(bridge, other).status_code == 200
    assert post(bridge, stalled).status_code == 200

    def pings_stopped(proc: ServerProcess) -> bool:
        before = len(vigilmon.received("/hh"))
        deadline = time.monotonic() + 0.8  # four intervals without a ping
        while time.monotonic() < deadline:
            if proc.proc.poll() is not None:
                raise AssertionError(proc.output())
            time.sleep(0.05)
        return len(vigilmon.received("/hh")) == before

    wait_until(lambda: pings_stopped(bridge), timeout=5, what="pings to pause")
    assert metric(bridge, "colossalai_bridge_health_heartbeat_firing_alerts",
                  target="llama-up") == 1
    bridge.proc.kill()
    bridge.proc.wait(10)
    again = start_bridge(server_process, config)
    assert pings_stopped(again)  # still paused after the restart
    assert post(again, body(alert("TrainingStalled", status="resolved",
                                  job="llama"))).status_code == 200
    count = len(vigilmon.received("/hh"))
    vigilmon.wait_for("/hh", count + 2)  # resumed on resolve

    # A firing alert that Alertmanager stops re-sending expires after alert_ttl.
    assert post(again, stalled).status_code == 200
    wait_until(lambda: pings_stopped(again), timeout=5, what="pings to pause again")
    paused_at = time.monotonic()
    count = len(vigilmon.received("/hh"))
    vigilmon.wait_for("/hh", count + 1, timeout=15)
    assert time.monotonic() - paused_at >= 0.5
    assert http_get(again.url + "/health")[0] == 200


def test_503_when_the_state_disk_is_full_and_recovery(
        server_process: Start, tmp_path: Path, vigilmon: FakeVigilmon) -> None:
    require(is_root(), "root, to mount a small tmpfs as a full disk")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True)
    bridge: BridgeProcess | None = None
    try:
        config = write_config(tmp_path / "bridge.yml", mount / "state",
                              [webhook_target(vigilmon)])
        bridge = start_bridge(server_process, config)
        assert post(bridge, body(alert("TrainingStalled", job="ok"))).status_code == 200
        vigilmon.wait_for("/hook", 1)
        filler = mount / "filler"
        with filler.open("wb") as out:
            try:
                while True:
                    out.write(b"\0" * 65536)
                    out.flush()
            except OSError:
                pass
        big = body(*[alert("TrainingStalled", job=f"big{i}") for i in range(2000)])
        response = post(bridge, big)
        assert response.status_code == 503
        assert response.json()["error"] == "store_unavailable"
        status, _, health = http_get(bridge.url + "/health")
        assert status == 503
        assert "store not writable" in json.loads(health)["problems"][0]
        assert metric(bridge, "colossalai_bridge_store_writable") == 0
        assert metric(bridge, "colossalai_bridge_notifications_rejected_total",
                      reason="store_unavailable") == 1
        filler.unlink()
        assert post(bridge, big).status_code == 200  # Alertmanager's retry now succeeds
        vigilmon.wait_for("/hook", 2)
        assert http_get(bridge.url + "/health")[0] == 200
    finally:
        if bridge is not None:
            bridge.stop()
        subprocess.run(["umount", str(mount)], check=False)


def test_health_is_503_when_a_heartbeat_never_succeeds(
        server_process: Start, tmp_path: Path, vigilmon: FakeVigilmon) -> None:
    config = write_config(tmp_path / "bridge.yml", tmp_path / "state", [
        {"name": "watchdog", "type": "heartbeat", "url": vigilmon.heartbeat_url("t"),
         "period": "300ms"}], health={"unhealthy_after_periods": 2})
    bridge = start_bridge(server_process, config)
    def unhealthy() -> bytes | None:
        status, _, text = http_get(bridge.url + "/health")
        return text if status == 503 else None

    text = wait_until(unhealthy, timeout=5, what="/health 503")
    assert "target watchdog: no success" in json.loads(text)["problems"][0]
    assert post(bridge, body(alert())).status_code == 200
    vigilmon.wait_for("/api/heartbeat/t", 1)
    assert http_get(bridge.url + "/health")[0] == 200


def test_sigterm_finishes_in_flight_and_exits_0(server_process: Start, tmp_path: Path,
                                                vigilmon: FakeVigilmon) -> None:
    config = write_config(tmp_path / "bridge.yml", tmp_path / "state",
                          [webhook_target(vigilmon, timeout="2s")])
    bridge = start_bridge(server_process, config)
    vigilmon.set(status=200, delay=1.0)
    assert post(bridge, body(alert("TrainingStalled", job="t"))).status_code == 200
    wait_until(lambda: vigilmon.received("/hook", include_failed=True) or
               metric(bridge, "colossalai_bridge_queue_depth", target="hook") == 1)
    started = time.monotonic()
    bridge.proc.terminate()
    assert bridge.proc.wait(15) == 0
    assert time.monotonic() - started < 10
    assert "bridge stopped" in bridge.output()


def test_check_prints_every_problem_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump({"targets": [
        {"name": "x", "type": "heartbeat", "url": "nope"},
        {"name": "x", "type": "webhook", "url": "http://h/", "body": "xml"}]}))
    result = run_cli("bridge", "check", "--config.file", str(bad))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 4, lines
    assert all(line.startswith(str(bad)) for line in lines)
    run = run_cli("bridge", "--config.file", str(bad))
    assert run.returncode == 2
    assert len(run.stderr.strip().splitlines()) == 1
    assert "and 3 more; run 'bridge check'" in run.stderr
    example = Path(__file__).resolve().parents[1] / "deploy" / "bridge" / "bridge.example.yml"
    data = yaml.safe_load(example.read_text())
    assert {t["type"] for t in data["targets"]} == {"heartbeat", "health_heartbeat", "webhook"}


def hook_jobs(records: list[Any]) -> list[str]:
    return [json.loads(r.body)["alerts"][0]["labels"]["job"] for r in records]


def test_target_down_then_back_gets_everything_in_arrival_order_and_heartbeat_ttl(
        server_process: Start, tmp_path: Path, vigilmon: FakeVigilmon) -> None:
    """First 503s, then connections refused; after it comes back every notification
    arrives once, in the order stored, and the heartbeat sends only its newest ping
    that is still within its TTL."""
    config = write_config(tmp_path / "bridge.yml", tmp_path / "state", [
        webhook_target(vigilmon, selector=['alertname!="Watchdog"']),
        {"name": "watchdog", "type": "heartbeat", "url": vigilmon.heartbeat_url("tok"),
         "timeout": "500ms", "ttl": "2s", "period": "1m"}])
    bridge = start_bridge(server_process, config)

    vigilmon.set(status=503)
    assert post(bridge, body(alert())).status_code == 200  # ping A, left to expire
    ids = []
    for i in range(30):
        answer = post(bridge, body(alert("TrainingStalled", job=f"job{i}")))
        assert answer.status_code == 200
        ids.append(answer.json()["id"])
    # Retried with backoff, and only the oldest: the others wait behind it.
    wait_until(lambda: len(vigilmon.received("/hook", include_failed=True)) >= 3,
               timeout=10, what="three refused attempts")
    wait_until(lambda: metric(bridge, "colossalai_bridge_heartbeat_pings_dropped_total",
                              target="watchdog", reason="expired") == 1,
               timeout=10, what="ping A to expire unsent")

    vigilmon.go_down()
    for i in range(30, 60):
        answer = post(bridge, body(alert("TrainingStalled", job=f"job{i}")))
        assert answer.status_code == 200
        ids.append(answer.json()["id"])
    wait_until(lambda: (metric(bridge, "colossalai_bridge_deliveries_total", target="hook",
                               result="connection") or 0) >= 1,
               timeout=10, what="a refused connection")
    assert post(bridge, body(alert())).status_code == 200  # ping B, superseded by C
    assert post(bridge, body(alert())).status_code == 200  # ping C
    assert metric(bridge, "colossalai_bridge_heartbeat_pings_dropped_total",
                  target="watchdog", reason="superseded") == 1
    assert metric(bridge, "colossalai_bridge_queue_depth", target="hook") == 60

    back_at = time.time()
    vigilmon.set(status=200)
    vigilmon.come_back()
    delivered = vigilmon.wait_for("/hook", 60, timeout=60)
    assert hook_jobs(delivered) == [f"job{i}" for i in range(60)]  # each once, in order
    assert ids == sorted(ids)
    refused = vigilmon.received("/hook", include_failed=True)[:-60]
    assert set(hook_jobs(refused)) == {"job0"}  # head of line: nothing overtook job0
    pings = vigilmon.wait_for("/api/heartbeat/tok", 1)
    wait_until(lambda: metric(bridge, "colossalai_bridge_queue_depth", target="watchdog") == 0,
               what="the ping queue to empty")
    assert len(vigilmon.received("/api/heartbeat/tok")) == 1  # C only: A expired, B replaced
    assert pings[0].at >= back_at
    assert metric(bridge, "colossalai_bridge_heartbeat_pings_dropped_total",
                  target="watchdog", reason="expired") == 1
    wait_until(lambda: metric(bridge, "colossalai_bridge_queue_depth", target="hook") == 0,
               what="an empty outbox")


def test_tls_and_client_certificates_through_the_web_config(
        server_process: Start, tmp_path: Path, vigilmon: FakeVigilmon,
        pki: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {pki}/server.crt\n"
                   f"  key_file: {pki}/server.key\n"
                   "  client_auth_type: RequireAndVerifyClientCert\n"
                   f"  client_ca_file: {pki}/ca.crt\n")
    config = write_config(tmp_path / "bridge.yml", tmp_path / "state",
                          [webhook_target(vigilmon)])
    bridge = server_process(config, web_config=web, ready=False)
    ca, cert = str(pki / "ca.crt"), (str(pki / "client.crt"), str(pki / "client.key"))

    def ready() -> bool:
        if bridge.proc.poll() is not None:
            raise AssertionError(bridge.output())
        try:
            return requests.get(bridge.url + "/health", verify=ca, cert=cert,
                                timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    wait_until(ready, timeout=15, what="the bridge over TLS")
    assert bridge.url.startswith("https://")
    payload = body(alert("TrainingStalled", job="tls"))
    # verify= on each request: a Session's own verify loses to $REQUESTS_CA_BUNDLE.
    with requests.Session() as client:
        answer = client.post(bridge.url + "/alertmanager", data=payload, headers=AUTH,
                             verify=ca, cert=cert, timeout=10)
        assert answer.status_code == 200, answer.text
        # TLS does not replace the bearer token: both are required.
        assert client.post(bridge.url + "/alertmanager", data=payload,
                           headers={"Content-Type": "application/json"}, verify=ca,
                           cert=cert, timeout=10).status_code == 401
    assert hook_jobs(vigilmon.wait_for("/hook", 1)) == ["tls"]
    # No client certificate: refused in the handshake. With TLS 1.3 the client may only
    # learn it when it reads (a reset, not an SSLError); either way no HTTP answer.
    with pytest.raises(requests.ConnectionError):
        requests.post(bridge.url + "/alertmanager", data=payload, headers=AUTH, verify=ca,
                      timeout=10)
    # Plain HTTP on the TLS port gets no HTTP answer.
    with pytest.raises(requests.ConnectionError):
        requests.post(f"http://127.0.0.1:{bridge.port}/alertmanager", data=payload,
                      headers=AUTH, timeout=10)
    assert bridge.proc.poll() is None
    assert metric_tls(bridge, ca, cert, "colossalai_bridge_notifications_received_total") == 1


def metric_tls(bridge: BridgeProcess, ca: str, cert: tuple[str, str], name: str) -> float:
    text = requests.get(bridge.url + "/metrics", verify=ca, cert=cert, timeout=5).text
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(name + " "))


def test_proxy_variables_and_netrc_in_the_environment_are_ignored(
        server_process: Start, tmp_path: Path, vigilmon: FakeVigilmon) -> None:
    """requests would route every delivery through $HTTP_PROXY (and send the heartbeat
    token there in the URL) and add ~/.netrc credentials; the bridge's sessions do not."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine 127.0.0.1 login netrc-user password netrc-pass\n")
    (home / ".netrc").chmod(0o600)
    with fake_vigilmon() as proxy:
        env = cli_env(HOME=str(home), HTTP_PROXY=proxy.url, HTTPS_PROXY=proxy.url,
                      ALL_PROXY=proxy.url, http_proxy=proxy.url, https_proxy=proxy.url)
        for name in ("NO_PROXY", "no_proxy"):
            env.pop(name, None)
        config = write_config(tmp_path / "bridge.yml", tmp_path / "state", [
            webhook_target(vigilmon),
            {"name": "watchdog", "type": "heartbeat", "url": vigilmon.heartbeat_url("tok")}])
        bridge = server_process(config, env=env)
        assert post(bridge, body(alert())).status_code == 200
        assert post(bridge, body(alert("TrainingStalled", job="p"))).status_code == 200
        vigilmon.wait_for("/hook", 1)
        vigilmon.wait_for("/api/heartbeat/tok", 1)
        assert proxy.requests == []
        assert all("authorization" not in r.headers for r in vigilmon.requests)
