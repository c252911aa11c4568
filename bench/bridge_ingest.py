"""Bridge ingest and delivery throughput, next to a do-nothing endpoint on the same HTTP stack.

In one run on this machine, alternating in every round:

* **do-nothing**: the project's uvicorn setup (``colossalai_exporter.web.serve``:
  same protocol class, keep-alive, timeouts) running a bare ASGI app that reads
  the body and answers 200: the ceiling of the HTTP stack itself. The goal's
  ratio is against this one.
* **App route** (``--app-route``): the same server running the project's
  ``web.App`` with the bridge's guards (bearer token, content type) and a
  route that answers a stored-shaped JSON body without parsing or storing
  anything: what the App costs on top of the server, so that the bridge's own
  work per notification can be told apart from it.
* **bridge**: the real ``colossalai-exporter bridge`` process with a real config
  (bearer token, three targets: a Watchdog heartbeat, a signed webhook for
  critical/warning alerts, an ``body: alertmanager`` webhook for everything but
  the Watchdog), its SQLite outbox on this machine's disk, every 200 after the
  commit is fsynced. Its targets are down during ingest (connection refused, and a
  one-hour backoff), so the deliveries pile up in the outbox as during an outage.
* **delivery**: the bridge restarted with a loopback sink up; the time from the
  sink's first to its last request while the outbox drains.

Both ingest measurements use the same load generator: a separate process with
one asyncio task per keep-alive connection, requests pre-encoded before the
clock starts, so that the client takes as little of the shared CPUs as we can
make it. Payloads are Alertmanager webhook version 4 bodies shaped like
Alertmanager 0.25 sends them: 1 to 8 alerts per notification with labels and
annotations as our rules produce, every one a new group or alert (nothing is
deduplicated away), one in a hundred a Watchdog (Alertmanager sends it once
a minute; at hundreds of notifications a second even 1 % over-represents it).

    python bench/bridge_ingest.py --rounds 3 --notifications 10000 --connections 16 --app-route

10,000 timed notifications by default: with 3,000, the do-nothing endpoint's run
lasted 0.1 s and its rate moved by a third from one run to the next.

``--client wrk`` loads every server with wrk (Debian package ``wrk``) instead:
a C load generator that takes 10-14 µs of CPU per request where the Python one
takes 27-29, to show whether the client's share of a two-core machine shapes
the rates (it does not: bench/RESULTS.md). Each run then lasts ``--duration``
seconds instead of a count of notifications; its Lua script (:data:`WRK_SCRIPT`)
builds ``--wrk-requests`` distinct notifications before the clock starts. The
Python client stays the default so that results stay comparable with the
earlier ones in bench/RESULTS.md.

"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-bearer-token-0123456789abcdef"
ZERO_TIME = "0001-01-01T00:00:00Z"
RULES = [  # (alertname, severity, summary) as the project's rules name them
    ("TrainingStalled", "critical", "Training job {job} stalled in phase {phase}"),
    ("GPUMemoryHigh", "warning", "GPU memory above 95% on {instance}"),
    ("CheckpointDiskFilling", "warning", "Checkpoint disk on {instance} fills within 4h"),
    ("RankDown", "critical", "Rank {rank} of {job} is down"),
    ("NCCLUnreachable", "critical", "Rendezvous of {job} unreachable from {instance}"),
    ("ChatServerEngineDown", "critical", "Chat engine behind {instance} reports Error"),
    ("HostMemoryLow", "info", "Host memory below 5% on {instance}"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- payloads ---------------------------------------------------------------------------


def notification(index: int, rng: random.Random) -> dict[str, Any]:
    """One realistic version 4 body; ``index`` makes its group and alerts new."""
    started = (f"2026-12-02T{index // 3600 % 24:02d}:{index // 60 % 60:02d}:"
               f"{index % 60:02d}.{index % 1000:03d}Z")
    if index % 100 == 0:
        names = [("Watchdog", "none", "Alerting pipeline is alive")]
        count = 1
    else:
        names = [RULES[index % len(RULES)]]
        count = 1 + index % 8
    alertname, severity, summary = names[0]
    job = f"{rng.choice(['llama', 'gpt', 'opt', 'bloom'])}-{index % 97}"
    alerts: list[dict[str, Any]] = []
    for n in range(count):
        labels = {"alertname": alertname, "severity": severity,
                  "job": job, "instance": f"node-{(index + n) % 64:02d}.gpu.internal:9466",
                  "rank": str(n), "namespace": "training", "phase": "step",
                  "prometheus": "monitoring/k8s", "run_id": f"run-{index:06d}"}
        if alertname == "Watchdog":
            labels = {"alertname": "Watchdog", "severity": "none",
                      "prometheus": "monitoring/k8s", "run_id": f"run-{index:06d}"}
        fingerprint = hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()
        alerts.append({
            "status": "firing",
            "labels": labels,
            "annotations": {
                "summary": summary.format(**{**labels, "job": job, "phase": "step",
                                             "instance": labels.get("instance", ""),
                                             "rank": labels.get("rank", "")}),
                "description": (f"{alertname} on {labels.get('instance', 'the pipeline')}: "
                                f"no step for 612s (budget 300s, learned from the last 1000 "
                                f"steps); last checkpoint 41m ago at step 18400."),
                "runbook_url": "https://github.com/example/colossalai-exporter/blob/main/"
                               f"docs/runbooks.md#{alertname.lower()}",
            },
            "startsAt": started,
            "endsAt": ZERO_TIME,
            "generatorURL": "http://prometheus-k8s-0:9090/graph?g0.expr=colossalai_training_"
                            "last_step_timestamp_seconds&g0.tab=1",
            "fingerprint": fingerprint[:16],
        })
    common = {k: v for k, v in alerts[0]["labels"].items()
              if all(a["labels"].get(k) == v for a in alerts)}
    return {
        "receiver": "colossalai\\.bridge",
        "status": "firing",
        "alerts": alerts,
        "groupLabels": {"alertname": alertname, "job": job},
        "commonLabels": common,
        "commonAnnotations": {"runbook_url": alerts[0]["annotations"]["runbook_url"]},
        "externalURL": "http://alertmanager-main-0:9093",
        "version": "4",
        "groupKey": f'{{}}/{{severity=~"critical|warning"}}:{{alertname="{alertname}", '
                    f'job="{job}", run_id="run-{index:06d}"}}',
        "truncatedAlerts": 0,
    }


def encoded_requests(port: int, start: int, count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for index in range(start, start + count):
        body = json.dumps(notification(index, rng)).encode()
        head = (f"POST /alertmanager HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"User-Agent: Alertmanager/0.25.0\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        out.append(head.encode() + body)
    return out


# -- the load generator (its own process) -----------------------------------------------


async def _connection(port: int, queue: list[bytes], latencies: list[float],
                      statuses: dict[int, int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while queue:
            request = queue.pop()
            started = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            statuses[status] = statuses.get(status, 0) + 1
    finally:
        writer.close()


async def _load(port: int, requests: list[bytes], connections: int) -> dict[str, Any]:
    queue = list(reversed(requests))
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    started = time.perf_counter()
    await asyncio.gather(*(_connection(port, queue, latencies, statuses)
                           for _ in range(connections)))
    elapsed = time.perf_counter() - started
    return {"elapsed": elapsed, "latencies": latencies, "statuses": statuses}


def client_main(spec: dict[str, Any]) -> None:
    """Warm up, then send ``count`` notifications; print the result as JSON."""
    port = spec["port"]
    warm = encoded_requests(port, spec["start"], spec["warmup"], spec["seed"])
    timed = encoded_requests(port, spec["start"] + spec["warmup"], spec["count"],
                             spec["seed"] + 1)
    asyncio.run(_load(port, warm, spec["connections"]))
    result = asyncio.run(_load(port, timed, spec["connections"]))
    json.dump(result, sys.stdout)


def run_client(port: int, start: int, count: int, warmup: int, connections: int,
               seed: int) -> dict[str, Any]:
    spec = {"port": port, "start": start, "count": count, "warmup": warmup,
            "connections": connections, "seed": seed}
    out = subprocess.run([sys.executable, __file__, "_client", json.dumps(spec)],
                         capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


# -- the wrk load generator ------------------------------------------------------------

# Replaced in every request by a 12-digit id of its own ("@" is no magic character
# in a Lua pattern, so the script can use it as one as it is).
RUN_ID_SLOT = "@" * 12
# Bodies are templates from notification(), one per line, whose run id (in every
# alert's labels, the group labels and the group key) the script replaces, so that
# no two requests share a group key and nothing is deduplicated away, as with the
# Python client. A thread's ids start with its run's base plus its number.
WRK_SCRIPT = r"""
local threads = {}
function setup(thread)
  thread:set("thread_number", #threads)
  threads[#threads + 1] = thread
end

-- Every request is built here, before the clock starts: building it in request()
-- took wrk from 8 to 29 us of CPU per request, as much as the Python client.
local requests, count, sent = {}, 0, 0
function init(args)
  local templates = {}
  for line in io.lines(args[1]) do
    templates[#templates + 1] = line
  end
  local prefix = string.format("%04d", tonumber(args[2]) + thread_number)
  wrk.method = "POST"
  wrk.path = "/alertmanager"
  wrk.headers["Authorization"] = "Bearer " .. args[3]
  wrk.headers["Content-Type"] = "application/json"
  wrk.headers["User-Agent"] = "Alertmanager/0.25.0"
  count = tonumber(args[4])
  for n = 1, count do
    local id = prefix .. string.format("%08d", n)
    local body = templates[n % #templates + 1]:gsub(args[5], id)
    requests[n] = wrk.format(nil, nil, nil, body)
  end
  cpu_ready = os.clock()  -- wrk's CPU seconds so far: done() reports the run's
end

function request()
  -- Past the end it starts again: repeats, which the bridge deduplicates, and
  -- which run_wrk refuses for it.
  sent = sent + 1
  return requests[(sent - 1) % count + 1]
end

function done(summary, latency, _)
  local e = summary.errors
  local ready = 0
  for _, thread in ipairs(threads) do
    ready = math.max(ready, thread:get("cpu_ready"))
  end
  io.write(string.format(
    "WRK_RESULT {\"requests\": %d, \"duration_us\": %d, \"p50_us\": %d, " ..
    "\"p99_us\": %d, \"errors\": %d, \"client_cpu_s\": %.6f}\n", summary.requests,
    summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.status + e.timeout, os.clock() - ready))
end
"""


def wrk_templates(path: Path, count: int = 1000) -> None:
    """``count`` notification bodies with their run id left as :data:`RUN_ID_SLOT`."""
    rng = random.Random(0)
    with path.open("w") as out:
        for index in range(count):
            body = json.dumps(notification(index, rng))
            out.write(body.replace(f"run-{index:06d}", f"run-{RUN_ID_SLOT}") + "\n")


def run_wrk(port: int, seconds: float, base: int, connections: int, workdir: Path,
            unique: int) -> dict[str, Any]:
    """One wrk run against ``port``: requests, duration, latency, error counts and
    wrk's CPU per request; ``unique``: how many distinct requests to build."""
    script, templates = workdir / "notifications.lua", workdir / "notifications.jsonl"
    if not script.exists():
        script.write_text(WRK_SCRIPT)
        wrk_templates(templates)
    out = subprocess.run(
        ["wrk", "--threads", "1", "--connections", str(connections), "--duration",
         f"{seconds:g}s", "--timeout", "10s", "--script", str(script),
         f"http://127.0.0.1:{port}", "--", str(templates), str(base), TOKEN, str(unique),
         RUN_ID_SLOT],
        capture_output=True, text=True, timeout=seconds + 120, check=True)
    for line in out.stdout.splitlines():
        if line.startswith("WRK_RESULT "):
            result: dict[str, Any] = json.loads(line.split(" ", 1)[1])
            # wrk's CPU from the end of building its requests to the end of the run.
            cpu_us = result["client_cpu_s"] / max(1, result["requests"]) * 1e6
            return {**result, "client_cpu_us": cpu_us}
    raise SystemExit(f"wrk printed no result:\n{out.stdout}\n{out.stderr}")


# -- the do-nothing server and the sink (their own processes) ---------------------------


async def do_nothing(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body and answers 200: the HTTP stack and nothing else."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


def noop_main(port: int) -> None:
    from colossalai_exporter.web import serve, stop_on_signals

    stop = stop_on_signals()
    serve(do_nothing, f"127.0.0.1:{port}", name="do-nothing").wait(stop)


def app_route_main(port: int) -> None:
    """The project's App with the bridge's guards and a route that stores nothing."""
    from colossalai_exporter.bridge.app import INGEST_PATH, bearer_guard, content_type_guard
    from colossalai_exporter.web import (
        App,
        Request,
        Response,
        json_response,
        serve,
        stop_on_signals,
    )

    app = App(max_body_bytes=4 << 20, body_timeout=10.0, realm="colossalai-bridge")
    answer = {"status": "stored", "id": 1, "queued": ["audit", "oncall"], "deduplicated": []}

    async def route(request: Request) -> Response:
        return json_response(200, answer)

    bearer = bearer_guard(TOKEN)

    def guard(request: Request) -> Response | None:  # the bridge's two guards, in its order
        return bearer(request) or content_type_guard(request)

    app.add_route(INGEST_PATH, route, ("POST",), guard=guard)
    stop = stop_on_signals()
    serve(app, f"127.0.0.1:{port}", name="app-route").wait(stop)


def bridge_main(argv: list[str]) -> int:
    """The bridge's own CLI."""
    from colossalai_exporter.cli import main as cli_main

    return cli_main(argv)


def sink_main(port: int) -> None:
    """A loopback receiver that answers 200 and counts; GET /stats reports."""
    lock = threading.Lock()
    stats: dict[str, Any] = {"count": 0, "first": None, "last": None, "paths": {}}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        wbufsize = 65536
        disable_nagle_algorithm = True

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            if self.path == "/stats":
                with lock:
                    body = json.dumps(stats).encode()
            else:
                now = time.time()
                with lock:
                    stats["count"] += 1
                    stats["first"] = stats["first"] or now
                    stats["last"] = now
                    key = self.path.split("/")[1]
                    stats["paths"][key] = stats["paths"].get(key, 0) + 1
                body = b"OK"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()


# -- orchestration ----------------------------------------------------------------------


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO / "exporter"))


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: server exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # an answer, if not a 200: the server is up
        except OSError:
            time.sleep(0.02)
    raise SystemExit(f"{url} did not answer within {timeout}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def metric(port: int, name: str) -> float:
    """The sum of a metric's samples over all its label values."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((f"{name} ", f"{name}{{")))


def write_config(workdir: Path, sink_port: int) -> Path:
    import yaml

    sink = f"http://127.0.0.1:{sink_port}"
    config = {
        "state_dir": str(workdir / "state"),
        "receiver": {"bearer_token_file": str(workdir / "token")},
        # One attempt against the refused sink, then the targets wait: the outbox
        # fills as it would while they are down. A restart makes everything due.
        "delivery": {"initial_backoff": "1h", "max_backoff": "1h"},
        "targets": [
            {"name": "watchdog", "type": "heartbeat", "url": f"{sink}/hb/vtk_secret",
             "timeout": "5s"},
            {"name": "oncall", "type": "webhook", "url": f"{sink}/oncall",
             "selector": ['severity=~"critical|warning"'], "signing_secret": "whsec_"
             "YmVuY2gtc2lnbmluZy1rZXk=", "timeout": "5s"},
            {"name": "audit", "type": "webhook", "url": f"{sink}/audit",
             "selector": ['alertname!="Watchdog"'], "body": "alertmanager", "timeout": "5s"},
        ],
    }
    (workdir / "token").write_text(TOKEN + "\n")
    path = workdir / "bridge.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_bridge(config: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, __file__, "_bridge", "bridge", "--config.file",
             str(config), "--web.listen-address", f"127.0.0.1:{port}", "--log.level",
             "error"], stdout=out, stderr=subprocess.STDOUT, env=env())
    wait_http(f"http://127.0.0.1:{port}/metrics", proc)
    return proc


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(result: dict[str, Any], count: int) -> dict[str, float]:
    lat = result["latencies"]
    if result["statuses"] != {"200": count}:
        raise SystemExit(f"not every request was answered 200: {result['statuses']}")
    return {"rate": count / result["elapsed"], "p50": statistics.median(lat) * 1e3,
            "p99": percentile(lat, 0.99) * 1e3}


def load(proc: subprocess.Popen[bytes], port: int, number: int,
         args: argparse.Namespace, workdir: Path, stores: bool = False) -> dict[str, float]:
    """Run the client against a server; its rate and latency, the server's CPU (user
    and system, all its threads) per request, and how many requests were sent.
    ``stores``: the server is the bridge, for which repeats would be less work."""
    import psutil

    server = psutil.Process(proc.pid)

    def server_cpu() -> float:
        times = server.cpu_times()
        return times.user + times.system

    if args.client == "wrk":
        return load_wrk(server_cpu, port, number, args, workdir, stores)
    before = server_cpu()
    result = run_client(port, 0, args.notifications, args.warmup, args.connections, number)
    cpu = server_cpu() - before
    return {**summary(result, args.notifications),
            "cpu_us": cpu / (args.notifications + args.warmup) * 1e6,
            "sent": args.notifications + args.warmup, "in_flight": 0}


def load_wrk(server_cpu: Callable[[], float], port: int, number: int,
             args: argparse.Namespace, workdir: Path, stores: bool) -> dict[str, float]:
    """:func:`load` with wrk: 1 s of warm-up, then ``--duration`` seconds timed."""
    unique = args.wrk_requests
    warm = run_wrk(port, 1, number * 100, args.connections, workdir, unique)
    before = server_cpu()
    timed = run_wrk(port, args.duration, number * 100 + 50, args.connections, workdir, unique)
    cpu = server_cpu() - before
    if warm["errors"] or timed["errors"]:
        raise SystemExit(f"wrk saw errors or non-2xx answers: {warm}, {timed}")
    if stores and max(warm["requests"], timed["requests"]) > unique:
        raise SystemExit(f"wrk sent more than the {unique} distinct notifications it "
                         "built: raise --wrk-requests")
    return {"rate": timed["requests"] / (timed["duration_us"] / 1e6),
            "p50": timed["p50_us"] / 1e3, "p99": timed["p99_us"] / 1e3,
            "cpu_us": cpu / timed["requests"] * 1e6,
            "client_cpu_us": timed["client_cpu_us"],
            # wrk counts answered requests; those in flight when it stopped (at most
            # one per connection and run) reached the server too.
            "sent": warm["requests"] + timed["requests"],
            "in_flight": 2 * args.connections}


def measure_server(mode: str, number: int, args: argparse.Namespace,
                   workdir: Path) -> dict[str, float]:
    """Start the ``_noop`` or ``_app_route`` server, load it, stop it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, mode, str(port)], env=env())
    try:
        wait_http(f"http://127.0.0.1:{port}/", proc)
        return load(proc, port, number, args, workdir)
    finally:
        stop(proc)


def one_round(number: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    me = [sys.executable, __file__]
    base = measure_server("_noop", number, args, workdir)
    app_route = (measure_server("_app_route", number, args, workdir) if args.app_route
                 else None)

    rdir = workdir / f"round{number}"
    rdir.mkdir()
    sink_port = free_port()  # nothing listens yet: the targets are down during ingest
    config = write_config(rdir, sink_port)
    bridge_port = free_port()
    bridge = start_bridge(config, bridge_port, rdir / "bridge.log")
    try:
        ours = load(bridge, bridge_port, number, args, workdir, stores=True)
        received = metric(bridge_port, "colossalai_bridge_notifications_received_total")
        pending = metric(bridge_port, "colossalai_bridge_queue_depth")
    finally:
        stop(bridge)
    if not ours["sent"] <= received <= ours["sent"] + ours["in_flight"]:
        raise SystemExit(f"bridge counted {received} notifications of {ours['sent']} sent")

    sink = subprocess.Popen([*me, "_sink", str(sink_port)], env=env())
    try:
        wait_http(f"http://127.0.0.1:{sink_port}/stats", sink)
        bridge = start_bridge(config, bridge_port, rdir / "bridge.log")
        try:
            deadline = time.monotonic() + 600
            while True:
                with urllib.request.urlopen(f"http://127.0.0.1:{sink_port}/stats") as r:
                    stats = json.loads(r.read())
                if stats["count"] >= pending:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"only {stats['count']} of {pending} delivered")
                time.sleep(0.2)
            left = metric(bridge_port, "colossalai_bridge_queue_depth")
        finally:
            stop(bridge)
    finally:
        stop(sink)
    if stats["count"] != pending or left != 0:
        raise SystemExit(f"delivered {stats['count']} of {pending}, {left} left")
    spread = stats["last"] - stats["first"]
    delivery = {"count": stats["count"], "rate": (stats["count"] - 1) / spread,
                "paths": stats["paths"]}
    return {"noop": base, "app_route": app_route, "bridge": ours, "delivery": delivery}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--notifications", type=int, default=10000,
                        help="timed notifications per ingest run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--connections", type=int, default=16,
                        help="concurrent keep-alive client connections")
    parser.add_argument("--app-route", action="store_true",
                        help="also measure the App with a route that stores nothing")
    parser.add_argument("--client", choices=("python", "wrk"), default="python",
                        help="load generator: this script's asyncio client, or wrk")
    parser.add_argument("--duration", type=float, default=5.0,
                        help="seconds per timed run with --client wrk (after 1 s of "
                        "warm-up); --notifications and --warmup apply to the Python client")
    parser.add_argument("--wrk-requests", type=int, default=60000,
                        help="distinct notifications wrk builds per run (about 4.5 KB of "
                        "memory each): more than the bridge takes in one run")
    args = parser.parse_args()
    if args.client == "wrk" and shutil.which("wrk") is None:
        parser.error("--client wrk needs wrk on PATH (apt-get install wrk)")
    sizes = [len(r) for r in encoded_requests(1, 0, 1000, 0)]
    alerts = [len(notification(i, random.Random(0))["alerts"]) for i in range(1000)]
    runs = (f"wrk, {args.duration:g} s per run after 1 s warm-up" if args.client == "wrk"
            else f"Python client, {args.notifications} timed notifications per run after "
            f"{args.warmup} warm-up")
    print(f"{os.cpu_count()} cores, Python {sys.version.split()[0]}; {runs}, "
          f"{args.connections} keep-alive connections; "
          f"request size median "
          f"{statistics.median(sizes):.0f} B "
          f"(max {max(sizes)}), alerts per notification mean {statistics.mean(alerts):.1f}\n")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bridge-bench-", dir=args_dir()) as tmp:
        for number in range(1, args.rounds + 1):
            row = one_round(number, args, Path(tmp))
            rows.append(row)
            app_route = (f"App route {row['app_route']['rate']:.0f}/s "
                         f"{row['app_route']['cpu_us']:.0f} us CPU/req | "
                         if row["app_route"] else "")
            client = ("" if "client_cpu_us" not in row["bridge"] else
                      f" | wrk CPU/req {row['noop']['client_cpu_us']:.0f} us (do-nothing), "
                      f"{row['bridge']['client_cpu_us']:.0f} us (bridge)")
            print(f"round {number}: do-nothing {row['noop']['rate']:.0f}/s "
                  f"p99 {row['noop']['p99']:.1f} ms {row['noop']['cpu_us']:.0f} us CPU/req | "
                  f"{app_route}bridge {row['bridge']['rate']:.0f}/s "
                  f"{row['bridge']['cpu_us']:.0f} us CPU/req "
                  f"p50 {row['bridge']['p50']:.1f} ms p99 {row['bridge']['p99']:.1f} ms "
                  f"| ratio {row['bridge']['rate'] / row['noop']['rate']:.2f} | delivery "
                  f"{row['delivery']['rate']:.0f}/s ({row['delivery']['count']} deliveries)"
                  f"{client}", flush=True)
    print("\n| round | do-nothing rate | do-nothing p99 | App route rate | bridge rate | "
          "bridge p50 | bridge p99 | ratio | delivery rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for number, row in enumerate(rows, 1):
        app_route = f"{row['app_route']['rate']:.0f}/s" if row["app_route"] else "-"
        print(f"| {number} | {row['noop']['rate']:.0f}/s | {row['noop']['p99']:.1f} ms "
              f"| {app_route} | {row['bridge']['rate']:.0f}/s | {row['bridge']['p50']:.1f} ms "
              f"| {row['bridge']['p99']:.1f} ms "
              f"| {row['bridge']['rate'] / row['noop']['rate']:.2f} "
              f"| {row['delivery']['rate']:.0f}/s |")
    ratios = [r["bridge"]["rate"] / r["noop"]["rate"] for r in rows]
    noop_median = statistics.median(r["noop"]["rate"] for r in rows)
    print(f"\nmedian of rounds: do-nothing {noop_median:.0f}/s, "
          f"bridge {statistics.median(r['bridge']['rate'] for r in rows):.0f}/s, ratio "
          f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}), "
          f"bridge p99 {statistics.median(r['bridge']['p99'] for r in rows):.1f} ms, delivery "
          f"{statistics.median(r['delivery']['rate'] for r in rows):.0f}/s")
    return 0


def args_dir() -> str | None:
    """Where the outbox lives: BENCH_STATE_DIR, or the system's temporary directory."""
    return os.environ.get("BENCH_STATE_DIR") or None


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_client":
        client_main(json.loads(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_noop":
        noop_main(int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_app_route":
        app_route_main(int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_bridge":
        sys.exit(bridge_main(sys.argv[2:]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_sink":
        sink_main(int(sys.argv[2]))
    else:
        sys.exit(main())
