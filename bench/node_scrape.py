"""Scrape latency, peak RSS and time-to-first-scrape: node agent vs node_exporter.

Both run on this machine in one run, scraped alternately over loopback by the
same client, so load from anything else falls on both alike. node_exporter is
limited to its filesystem and meminfo collectors — the same ground the agent
covers without a GPU (host memory and watched disks) — and the agent runs on
defaults plus two watched paths (its gpu collector included: on a machine
without a driver or GPUs it serves zero GPUs from NVML's standing no_driver answer).

    python bench/node_scrape.py --scrapes 300
    python bench/node_scrape.py --scrapes 300 --ranks 8   # a node with 8 live ranks
    python bench/node_scrape.py --scrapes 300 --ranks 8 --gpus 8   # and 8 fake GPUs
    python bench/node_scrape.py --scrapes 300 --ranks 8 --gpus 8 --rdma-ports 8  # and a fabric

``--ranks N`` starts N live training ranks first (a TrainingMonitor stepping every
50 ms with a loss, a checkpoint written, the default one-second publish interval),
whose run directory the agent reads: what a busy node's agent serves. ``--gpus N``
gives the agent N GPUs through the tests' fake NVML (tests/fake_nvml/pynvml.py: the same calls
and answers as pynvml's, from a file), so its gpu collector and NVML worker do the
work they do on a GPU node.
"""

from __future__ import annotations

import argparse
import compileall
import gzip
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def first_scrape_seconds(cmd: list[str], url: str, env: dict[str, str]) -> tuple[
        subprocess.Popen[bytes], float]:
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = start + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return proc, time.monotonic() - start
        except OSError:
            time.sleep(0.002)
    proc.kill()
    raise SystemExit(f"{cmd[0]} did not answer {url} within 30 s")


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its live children (the agent's NVML worker)."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in (root, *root.children(recursive=True)):
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def timed_starts(commands: dict[str, tuple[list[str], str]], count: int, env: dict[str, str],
                 ) -> tuple[dict[str, subprocess.Popen[bytes]], dict[str, list[float]]]:
    """Start each command ``count`` times, alternating; the last starts are left running."""
    starts: dict[str, list[float]] = {name: [] for name in commands}
    running: dict[str, subprocess.Popen[bytes]] = {}
    for round_ in range(count):
        for name, (cmd, url) in commands.items():
            proc, seconds = first_scrape_seconds(cmd, url, env)
            starts[name].append(seconds)
            if round_ < count - 1:
                proc.terminate()
                proc.wait(10)
            else:
                running[name] = proc
    return running, starts


RANK_SCRIPT = """
import sys, time
from colossalai_exporter import TrainingMonitor
monitor = TrainingMonitor(serve="none", run_dir=sys.argv[1])
with monitor.checkpoint(step=0):
    pass
while True:
    with monitor.step(samples=8, tokens=8192) as step:
        time.sleep(0.05)
        step.loss = 1.5
"""


def start_ranks(count: int, run_dir: str, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    """``count`` live ranks of one job on this node, each publishing its snapshot."""
    procs = []
    for rank in range(count):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(count),
                        OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, run_dir],
                                      env=rank_env, stdout=subprocess.DEVNULL))
    deadline = time.monotonic() + 60
    while len(list(Path(run_dir).glob("rank-*.json"))) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"{count} ranks did not publish within 60 s")
        time.sleep(0.1)
    return procs


def with_fake_gpus(count: int, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the tests' fake NVML (tests/fake_nvml/pynvml.py) serving ``count``
    busy H100s."""
    sys.path.insert(0, str(REPO / "tests"))  # the gpu tests' fake GPU, loaded as here
    from gpu_helpers import fake_nvml_env, gpu

    scenario = Path(tempfile.mkdtemp()) / "gpus.json"
    # What an H100 SXM on a 570 driver answers: every health field the agent reads, and
    # 18 NVLink links (each link's state is one more call a sample).
    scenario.write_text(json.dumps({"driver_version": "570.124.06", "gpus": [
        gpu(i, memory_used=60 * 2**30, utilization=97, temperature=61, power_mw=640_000,
            recovery_action=0, pcie_replays=0, clock_event_reasons=0x4,
            remapped_rows={"correctable": 0, "uncorrectable": 0, "pending": False,
                           "failure": False},
            nvlink={"links": 18, "errors": {"replay": 0, "recovery": 0, "crc_flit": 0,
                                            "crc_data": 0}})
        for i in range(count)]}))
    return dict(fake_nvml_env(scenario, env))


def fake_rdma_sysfs(count: int) -> Path:
    """A /sys with ``count`` active 400 Gb/s InfiniBand ports (mlx5_0/1 …), laid out as
    the kernel's (counters/ and mlx5's hw_counters/), with the device files
    node_exporter's collector reads as well."""
    root = Path(tempfile.mkdtemp()) / "sys"
    for index in range(count):
        device = root / "class" / "infiniband" / f"mlx5_{index}"
        device.mkdir(parents=True)
        (device / "board_id").write_text("MT_0000000838\n")
        (device / "fw_ver").write_text("28.39.1002\n")
        (device / "hca_type").write_text("MT4129\n")
        port = device / "ports" / "1"
        (port / "counters").mkdir(parents=True)
        for name, text in (("state", "4: ACTIVE"), ("phys_state", "5: LinkUp"),
                           ("rate", "400 Gb/sec (4X NDR)"), ("link_layer", "InfiniBand")):
            (port / name).write_text(text + "\n")
        for counter in ("link_downed", "link_error_recovery", "symbol_error",
                        "port_rcv_errors", "port_xmit_discards", "port_rcv_data",
                        "port_xmit_data", "port_rcv_packets", "port_xmit_packets"):
            (port / "counters" / counter).write_text("0\n")
        # mlx5's transport counters (the agent reads the error ones of them)
        (port / "hw_counters").mkdir()
        for counter in ("duplicate_request", "implied_nak_seq_err", "lifespan",
                        "local_ack_timeout_err", "np_cnp_sent", "np_ecn_marked_roce_packets",
                        "out_of_buffer", "out_of_sequence", "packet_seq_err",
                        "req_cqe_error", "req_remote_access_errors",
                        "req_transport_retries_exceeded", "resp_cqe_error",
                        "rnr_nak_retry_err", "roce_adp_retrans", "roce_slow_restart",
                        "rp_cnp_handled", "rx_read_requests", "rx_write_requests"):
            (port / "hw_counters" / counter).write_text("0\n")
    return root


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def scrape_alternately(ports: dict[str, int], headers: dict[str, str], count: int) -> tuple[
        dict[str, list[float]], dict[str, str], dict[str, int]]:
    """``count`` scrapes of each exporter, alternating so drift hits both alike.

    One keep-alive connection per exporter, as Prometheus scrapes. Returns the
    latencies, each answer's format and its number of series.
    """
    timings: dict[str, list[float]] = {name: [] for name in ports}
    formats: dict[str, str] = {}
    sizes: dict[str, int] = {}
    conns = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=10)
             for name, port in ports.items()}
    try:
        for _ in range(count):
            for name, conn in conns.items():
                start = time.perf_counter()
                conn.request("GET", "/metrics", headers=headers)
                response = conn.getresponse()
                body = response.read()
                timings[name].append(time.perf_counter() - start)
                # Decompressed after the clock stops: the scrape is over once its bytes are in.
                encoding = response.getheader("Content-Encoding", "identity")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                formats[name] = f"{response.getheader('Content-Type', '')} ({encoding})"
                sizes[name] = sum(1 for line in body.decode().splitlines()
                                  if line and not line.startswith("#"))
    finally:
        for conn in conns.values():
            conn.close()
    return timings, formats, sizes


def commands(node_exporter: str, ours_port: int, theirs_port: int, run_dir: str,
             rdma_ports: int, extra: list[str]) -> tuple[list[str], list[str]]:
    """The agent's command (defaults plus two watched paths) and node_exporter's (its
    filesystem and meminfo collectors: the same ground), each with the fake fabric."""
    ckpt = tempfile.mkdtemp()
    ours = [sys.executable, "-m", "colossalai_exporter", "node",
            "--web.listen-address", f"127.0.0.1:{ours_port}", "--ranks.run-dir", run_dir,
            "--disk", f"checkpoints={ckpt}", "--disk", "root=/", "--log.level", "warn",
            *extra]
    theirs = [node_exporter, f"--web.listen-address=127.0.0.1:{theirs_port}",
              "--collector.disable-defaults", "--collector.filesystem", "--collector.meminfo"]
    if rdma_ports:
        sysfs = fake_rdma_sysfs(rdma_ports)
        ours += ["--infiniband.sysfs", str(sysfs / "class" / "infiniband")]
        theirs += [f"--path.sysfs={sysfs}", "--collector.infiniband"]
    return ours, theirs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--accept", default=PROMETHEUS_ACCEPT,
                        help="Accept header of every scrape (default: what Prometheus 2.42 "
                             "sends; each exporter answers in the best format it has)")
    parser.add_argument("--accept-encoding", default="gzip",
                        help="Accept-Encoding of every scrape (default: gzip, as Prometheus "
                             "sends; 'identity' for uncompressed answers, as this benchmark "
                             "asked before 2026-12-04)")
    parser.add_argument("--starts", type=int, default=5,
                        help="start each exporter this many times (alternating) for the "
                             "time to its first scrape; the median is reported")
    parser.add_argument("--gpus", type=int, default=0,
                        help="GPUs the agent sees through the fake NVML")
    parser.add_argument("--ranks", type=int, default=0,
                        help="live training ranks on this node, read by the agent")
    parser.add_argument("--rdma-ports", type=int, default=0,
                        help="InfiniBand ports in a fake /sys that both exporters read "
                             "(node_exporter with its infiniband collector on)")
    parser.add_argument("agent_args", nargs="*", help="extra flags for the agent")
    args = parser.parse_args()
    # As installed by pip, which compiles bytecode: without it, every start of a
    # source tree run with PYTHONDONTWRITEBYTECODE=1 would compile the package first.
    compileall.compile_dir(str(REPO / "exporter" / "colossalai_exporter"), quiet=1)
    extra = args.agent_args
    node_exporter = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if not node_exporter:
        raise SystemExit("prometheus-node-exporter not found (apt-get install it)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO / "exporter"), os.environ.get("PYTHONPATH")])))
    if args.gpus:
        env = with_fake_gpus(args.gpus, env)
    run_dir = tempfile.mkdtemp()
    ranks = start_ranks(args.ranks, run_dir, env)
    ours_port, theirs_port = free_port(), free_port()
    ours_cmd, theirs_cmd = commands(node_exporter, ours_port, theirs_port, run_dir,
                                    args.rdma_ports, extra)
    procs, starts = timed_starts({
        "colossalai-exporter node": (ours_cmd, f"http://127.0.0.1:{ours_port}/metrics"),
        "node_exporter": (theirs_cmd, f"http://127.0.0.1:{theirs_port}/metrics"),
    }, max(1, args.starts), env)
    ours, theirs = procs["colossalai-exporter node"], procs["node_exporter"]
    ports = {"colossalai-exporter node": ours_port, "node_exporter": theirs_port}
    # What Prometheus 2.42 sends with every scrape (scrape/scrape.go, targetScraper.scrape).
    headers = {"Accept": args.accept, "Accept-Encoding": args.accept_encoding,
               "User-Agent": "Prometheus/2.42.0", "X-Prometheus-Scrape-Timeout-Seconds": "10"}
    pids = {"colossalai-exporter node": ours.pid, "node_exporter": theirs.pid}
    cpu_before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
    try:
        timings, formats, sizes = scrape_alternately(ports, headers, args.scrapes)
        # Server CPU per scrape: unlike latency, another job on the machine barely moves it.
        cpu = {name: (tree_cpu_seconds(pid) - cpu_before[name]) / args.scrapes
               for name, pid in pids.items()}
        rss = {"colossalai-exporter node": peak_rss_bytes(ours.pid),
               "node_exporter": peak_rss_bytes(theirs.pid)}
    finally:
        for proc in (ours, theirs, *ranks):
            proc.terminate()
            proc.wait(10)
    first = {name: statistics.median(values) for name, values in starts.items()}
    print(f"{args.scrapes} scrapes each, alternating, keep-alive, loopback, "
          f"{os.cpu_count()} cores, Accept-Encoding: {args.accept_encoding}, "
          f"{args.ranks} live ranks, {args.gpus} GPUs (the tests' fake NVML), "
          f"{args.rdma_ports} RDMA ports\n")
    print("| exporter | median scrape | p99 scrape | server CPU per scrape | peak RSS "
          "| first scrape after start (median) | series |")
    print("|---|---|---|---|---|---|---|")
    for name, values in timings.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.2f} ms "
              f"| {percentile(values, 0.99) * 1e3:.2f} ms | {cpu[name] * 1e3:.2f} ms "
              f"| {rss[name] / 2**20:.1f} MiB | {first[name]:.3f} s | {sizes[name]} |")
    ours_med = statistics.median(timings["colossalai-exporter node"])
    theirs_med = statistics.median(timings["node_exporter"])
    for name, values in starts.items():
        print(f"{name} first scrape after start, {len(values)} starts: "
              + ", ".join(f"{v:.3f}" for v in values) + " s")
    for name, content_type in formats.items():
        print(f"{name} answered {content_type}")
    print(f"\nmedian ratio (ours/node_exporter): {ours_med / theirs_med:.2f}; "
          f"RSS ratio: {rss['colossalai-exporter node'] / rss['node_exporter']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
