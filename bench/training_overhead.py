"""Per-step cost of TrainingMonitor's hot path, against a bare loop and prometheus_client.

Run from the repository root:

    PYTHONPATH=exporter python bench/training_overhead.py [--steps N] [--repeats R]

Each variant runs N iterations, R times; the best (least disturbed) run is
reported, in nanoseconds per iteration, with the bare loop's own cost
subtracted. The monitor runs as in training: publisher thread on (snapshots
into a temporary run directory every second), no HTTP server.

The last three variants add step heartbeats every 50 steps (as many as the
sender takes: it pings at most once per 0.2 s poll) to a loopback server that
answers 200, to a port that refuses connections, and to a server that accepts
connections and never answers (each ping then waits for its 5 s timeout): the
hot path must not feel any of them.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge

from colossalai_exporter import TrainingMonitor


def best_ns_per_iter(loop: Callable[[int], None], steps: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter_ns()
        loop(steps)
        best = min(best, (time.perf_counter_ns() - started) / steps)
    return best


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def heartbeat_targets() -> Iterator[dict[str, str]]:
    """URLs of a healthy server, a refusing port and a server that never answers."""
    healthy = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=healthy.serve_forever, daemon=True).start()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refusing_port = closed.getsockname()[1]
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(128)  # the kernel completes handshakes; nobody ever reads or answers
    try:
        yield {"answering": f"http://127.0.0.1:{healthy.server_address[1]}/ping/token",
               "refusing": f"http://127.0.0.1:{refusing_port}/ping/token",
               "never answering": f"http://127.0.0.1:{silent.getsockname()[1]}/ping/token"}
    finally:
        healthy.shutdown()
        healthy.server_close()
        silent.close()


def with_block_loop(monitor: TrainingMonitor) -> Callable[[int], None]:
    def loop(n: int) -> None:
        step = monitor.step
        for _ in range(n):
            with step() as s:
                s.loss = 1.0

    return loop


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    registry = CollectorRegistry()
    counter = Counter("bench_steps", "steps", registry=registry)
    gauge = Gauge("bench_loss", "loss", registry=registry)
    with tempfile.TemporaryDirectory() as run_dir:
        monitor = TrainingMonitor(serve="none", run_dir=run_dir)

        def bare(n: int) -> None:
            box = [0.0]  # the loop body stores a loss, as the measured variants do
            for _ in range(n):
                box[0] = 1.0

        def with_block(n: int) -> None:
            step = monitor.step
            for _ in range(n):
                with step() as s:
                    s.loss = 1.0

        def plain_call(n: int) -> None:
            done = monitor.step_done
            for _ in range(n):
                done(loss=1.0)

        def prometheus_pair(n: int) -> None:
            inc, set_ = counter.inc, gauge.set
            for _ in range(n):
                inc()
                set_(1.0)

        results = {name: best_ns_per_iter(fn, args.steps, args.repeats) for name, fn in
                   (("bare loop", bare), ("with monitor.step()", with_block),
                    ("monitor.step_done()", plain_call),
                    ("Counter.inc() + Gauge.set()", prometheus_pair))}
        monitor.close()
        with heartbeat_targets() as urls:
            for label, url in urls.items():
                beating = TrainingMonitor(serve="none", run_dir=tempfile.mkdtemp(dir=run_dir),
                                          rank=0, step_heartbeat_url=url, heartbeat_every=50)
                results[f"  + heartbeats, {label}"] = best_ns_per_iter(
                    with_block_loop(beating), args.steps, args.repeats)
                sent = beating.snapshot().heartbeats["step"]
                beating.close()
                print(f"heartbeats to the {label} server: {sent.success} ok, "
                      f"{sent.failure} failed", file=sys.stderr)

    base = results["bare loop"]
    pair = results["Counter.inc() + Gauge.set()"] - base
    print(f"python {sys.version.split()[0]} on {platform.machine()}, "
          f"{args.steps} steps x {args.repeats} repeats (best run)")
    print(f"{'variant':32} {'ns/iter':>9} {'minus bare':>11} {'vs pair':>8}")
    for name, ns in results.items():
        cost = ns - base
        ratio = f"{cost / pair:.2f}x" if name != "bare loop" else "-"
        print(f"{name:32} {ns:9.1f} {cost:11.1f} {ratio:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
