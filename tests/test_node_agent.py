"""The node agent as a real process on loopback: exposition, health, faults, bad input."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from colossalai_exporter import catalogue
from colossalai_exporter.configfile import load
from colossalai_exporter.errors import ConfigError
from conftest import (
    REPO,
    cli_env,
    http_get,
    is_root,
    refused_port,
    require,
    require_binary,
    run_cli,
    syn_dropping_port,
    wait_until,
)

GOLDEN = REPO / "tests" / "golden" / "node_agent_names.txt"
NO_GPU = "--no-collector.gpu"


def scrape(url: str) -> str:
    status, _, body = http_get(url + "/metrics")
    assert status == 200
    return body.decode()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, metric: str, /, **labels: str) -> float | None:
    return samples(text).get((metric, frozenset(labels.items())))


@pytest.fixture
def listener() -> Iterator[int]:
    """A real listening socket that accepts and closes, like a c10d store would accept."""
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
                conn.close()
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield int(sock.getsockname()[1])
    stop.set()
    thread.join(2)
    sock.close()


def test_serves_catalogued_names_promtool_clean_and_matches_golden(
        server_process, tmp_path: Path, listener: int) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    agent = server_process("node", NO_GPU, "--disk", f"checkpoints={tmp_path}",
                           "--rendezvous.target", f"127.0.0.1:{listener}",
                           "--ranks.run-dir", str(run_dir))
    text = scrape(agent.url)
    served = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert served <= catalogue.known_sample_names(), served - catalogue.known_sample_names()

    promtool = require_binary("promtool")
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=30, check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr

    # Golden: every family's name and type, so an accidental rename fails here; label
    # names of every sample must be exactly the catalogued ones.
    families = list(text_string_to_metric_families(text))
    shape = sorted({f"{fam.name} {fam.type}" for fam in families})
    assert GOLDEN.read_text().splitlines() == shape, (
        "exposition shape changed; if intended, update tests/golden/node_agent_names.txt")
    for fam in families:
        for sample in fam.samples:
            metric = catalogue.BY_NAME.get(sample.name) or catalogue.BY_NAME.get(fam.name) \
                or catalogue.BY_NAME[fam.name + ("_total" if fam.type == "counter" else "_info")]
            assert set(sample.labels) - {"le"} == set(metric.labels), sample

    assert value(text, "colossalai_disk_path_ok", name="checkpoints", path=str(tmp_path)) == 1
    assert value(text, "colossalai_nccl_up", target=f"127.0.0.1:{listener}") == 1
    assert value(text, "colossalai_host_memory_total_bytes") > 0
    assert value(text, "colossalai_exporter_collector_up", collector="disk") == 1
    # Error counters exist at zero before the first failure.
    assert value(text, "colossalai_exporter_collector_errors_total",
                 collector="disk", reason="timeout") == 0

    status, headers, body = http_get(agent.url + "/metrics",
                                     headers={"Accept": "application/openmetrics-text"})
    assert status == 200 and "openmetrics" in headers["content-type"]
    assert body.decode().rstrip().endswith("# EOF")

    status, _, body = http_get(agent.url + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, _, body = http_get(agent.url + "/")
    assert status == 200 and b'href="metrics"' in body


def test_health_is_degraded_only_for_what_is_wrong(server_process, tmp_path: Path) -> None:
    """No GPU driver on a node where no GPU is expected is fine; a watched path that is
    missing is not (issue 18: the reverse was true)."""
    require(not Path("/proc/driver/nvidia").exists(), "a machine without an NVIDIA driver")
    fine = server_process("node", "--no-collector.rendezvous", "--disk", f"ckpt={tmp_path}")
    status, _, body = http_get(fine.url + "/health")
    assert (status, json.loads(body)["problems"]) == (200, []), body
    missing = tmp_path / "not-there"
    broken = server_process("node", "--no-collector.rendezvous", "--disk", f"ckpt={tmp_path}",
                            "--disk", f"nvme={missing}")
    status, _, body = http_get(broken.url + "/health")
    assert status == 503, body
    assert json.loads(body)["problems"] == [{
        "collector": "disk", "reason": "missing",
        "message": f"nvme ({missing}) is not usable: missing"}]
    expecting = server_process("node", "--no-collector.rendezvous", "--disk", f"ckpt={tmp_path}",
                               "--gpu.expected", "1")
    status, _, body = http_get(expecting.url + "/health")
    assert status == 503, body
    assert [(p["collector"], p["reason"]) for p in json.loads(body)["problems"]] == [
        ("gpu", "no_driver")]


def test_disk_faults_on_real_filesystems(server_process, tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    not_mount = tmp_path / "plain"
    not_mount.mkdir()
    args = ["node", NO_GPU, "--no-collector.rendezvous",
            "--disk", f"missing={missing}", "--disk", f"file={a_file}",
            "--disk.mount-point", f"nvme={not_mount}"]
    full = tmp_path / "full"
    mounted = False
    if is_root():
        full.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(full)],
                                 check=False, capture_output=True).returncode == 0
    require(mounted, "root and mount -t tmpfs for a real full disk")
    try:
        # Fill the tmpfs to the last block: a real full disk.
        fill = subprocess.run(["dd", "if=/dev/zero", f"of={full / 'fill'}", "bs=64k"],
                              capture_output=True, text=True, check=False)
        assert "No space left on device" in fill.stderr
        args += ["--disk.mount-point", f"full={full}"]
        readonly_mount = tmp_path / "ro"
        readonly_mount.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M,ro", "tmpfs",
                        str(readonly_mount)], check=True)
        args += ["--disk", f"readonly={readonly_mount}"]
        agent = server_process(*args)
        text = scrape(agent.url)
        for name, path, reason in [("missing", missing, "missing"),
                                   ("file", a_file, "not_directory"),
                                   ("nvme", not_mount, "not_mounted"),
                                   ("readonly", readonly_mount, "not_writable")]:
            assert value(text, "colossalai_disk_path_ok", name=name, path=str(path)) == 0, name
            assert value(text, "colossalai_disk_path_failure_info", name=name, path=str(path),
                         reason=reason) == 1, (name, reason)
        assert value(text, "colossalai_disk_path_ok", name="full", path=str(full)) == 1
        assert value(text, "colossalai_disk_free_bytes", name="full", path=str(full)) == 0
        assert value(text, "colossalai_disk_total_bytes", name="full", path=str(full)) == 1 << 20
        # The disk collector itself is up: bad paths are data, not collector failures.
        assert value(text, "colossalai_exporter_collector_up", collector="disk") == 1
    finally:
        for mount in (full, tmp_path / "ro"):
            subprocess.run(["umount", str(mount)], check=False, capture_output=True)


def test_mode_0555_directory_is_not_writable_for_non_root(tmp_path: Path) -> None:
    """Root ignores permission bits (the read-only mount above covers root)."""
    from colossalai_exporter.node.disk import WatchedPath, check_path

    target = tmp_path / "locked"
    target.mkdir(mode=0o555)
    if os.geteuid() == 0:
        assert check_path(WatchedPath("x", str(target))).ok
    else:
        assert check_path(WatchedPath("x", str(target))).reason == "not_writable"


def test_rendezvous_closed_port_is_refused(server_process) -> None:
    with refused_port() as closed:
        agent = server_process("node", NO_GPU, "--no-collector.disk",
                               "--rendezvous.target", f"127.0.0.1:{closed}")
        text = scrape(agent.url)
    assert value(text, "colossalai_nccl_up", target=f"127.0.0.1:{closed}") == 0
    assert value(text, "colossalai_nccl_failure_info", target=f"127.0.0.1:{closed}",
                 reason="refused") == 1


def test_master_addr_is_the_default_rendezvous_target(server_process, listener: int) -> None:
    env = cli_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(listener))
    agent = server_process("node", NO_GPU, "--no-collector.disk", env=env)
    assert value(scrape(agent.url), "colossalai_nccl_up", target=f"127.0.0.1:{listener}") == 1


def test_the_live_ranks_stores_are_checked_and_no_store_is_guessed(
        server_process, tmp_path: Path, listener: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On defaults the agent checks the store each live rank was given (its snapshot's
    MASTER_ADDR:MASTER_PORT, a torchrun --standalone job's own port), and nothing else:
    it once checked 127.0.0.1:29500, and a healthy standalone job paged
    NCCLRendezvousDown."""
    from colossalai_exporter import TrainingMonitor

    run_dir = tmp_path / "run"
    env = cli_env()
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    agent = server_process("node", NO_GPU, "--no-collector.disk", "--ranks.run-dir",
                           str(run_dir), env=env)
    assert "colossalai_nccl_up{" not in scrape(agent.url)  # no rank, no store to check
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(listener))
    monitor = TrainingMonitor(serve="none", run_dir=run_dir, publish_interval=0.2,
                              record_signals=False)
    try:
        with monitor.step():
            pass
        # The rendezvous collector reads the stores the ranks collector saw last scrape.
        wait_until(lambda: value(scrape(agent.url), "colossalai_nccl_up",
                                 target=f"127.0.0.1:{listener}") == 1,
                   timeout=30, interval=0.2, what="the rank's store checked")
        text = scrape(agent.url)
        assert text.count("colossalai_nccl_up{") == 1, text
    finally:
        monitor.close()


def test_hung_mount_does_not_block_the_scrape(hung_disk_path: object) -> None:
    """A stat that never returns (a hung NFS mount) is reported as timeout in time."""
    import time

    from colossalai_exporter.node import disk

    # A deadline a loaded 2-core CI box meets (the "ok" path's check must return
    # within it); the hang (30 s, hung_disk_path) is far longer.
    collector = disk.DiskCollector([disk.WatchedPath("hung", "/"), disk.WatchedPath("ok", "/")],
                                   timeout=3.0)
    try:
        start = time.monotonic()
        families = collector.collect(time.monotonic() + 10)
        elapsed = time.monotonic() - start
    finally:
        collector.close()
    assert elapsed < 3.0 + 2.0
    failure = next(f for f in families if f.name == "colossalai_disk_path_failure")
    assert [s.labels["reason"] for s in failure.samples] == ["timeout"]


@pytest.mark.parametrize(("args", "needle"), [
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--disk", "nopath"], "--disk 'nopath' must be NAME=PATH"),
    (["--rendezvous.target", "host"], "must be HOST:PORT"),
    (["--web.listen-address", "nonsense"], "must be HOST:PORT or :PORT"),
    (["--web.listen-address", "127.0.0.1:99999"], "port must be 0-65535"),
    (["--gpu.timeout", "-1"], "--gpu.timeout must be a positive number"),
])
def test_bad_flags_are_one_line_and_exit_2(args: list[str], needle: str) -> None:
    result = run_cli("node", NO_GPU, *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colossalai-exporter: error: "), lines
    assert needle in lines[0]


def test_bad_config_files_are_one_line_and_exit_2(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yml"
    bad_yaml.write_text("disks: [\n  - {name: x\n")
    unknown = tmp_path / "unknown.yml"
    unknown.write_text("diskz: []\n")
    bad_hash = tmp_path / "web.yml"
    bad_hash.write_text("basic_auth_users:\n  prometheus: plaintext\n")
    cases = [(["--config.file", str(bad_yaml)], "is not valid YAML at line"),
             (["--config.file", str(unknown)], "unknown key `diskz`"),
             (["--web.config.file", str(bad_hash)], "is not a bcrypt hash")]
    for args, needle in cases:
        result = run_cli("node", NO_GPU, *args)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], lines


# Typos a user makes in node.yml (issue 18: each started the agent on its defaults),
# and the line that must say which key is wrong.
NODE_TYPOS = [
    ("web: {listen_adress: ':9999'}", "web: unknown key `listen_adress`"),
    ("gpu: {timout_seconds: 1}", "gpu: unknown key `timout_seconds`"),
    ("gpu: {expectd: 8}", "gpu: unknown key `expectd`"),
    ("ranks: {rundir: /x}", "ranks: unknown key `rundir`"),
    ("disks: [{name: ckpt, path: /ckpt, mountpoint: true}]",
     "disks[0]: unknown key `mountpoint`"),
    ("collectors: {gpuu: false}", "collectors: unknown key `gpuu`"),
    ("log: {level: verbose}", "log.level: invalid enum value 'verbose'"),
    ("gpu: {expected: -1}", "gpu.expected: expected `int` >= 0"),
    ("gpu: {timeout_seconds: 5 min}", "gpu.timeout_seconds:"),
    ("disks: [{path: /ckpt}]", "disks[0]: missing key `name`"),
    ("rendezvous: {targets: node-0}", "rendezvous.targets: expected `array`"),
]


@pytest.mark.parametrize(("text", "needle"), NODE_TYPOS, ids=[t for t, _ in NODE_TYPOS])
def test_a_typo_anywhere_in_the_node_config_is_named(tmp_path: Path, text: str,
                                                      needle: str) -> None:
    from colossalai_exporter.node.config import NodeFile

    path = tmp_path / "node.yml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as error:
        load(path, NodeFile)
    assert str(error.value).startswith(f"{path}: "), error.value
    assert needle in str(error.value), error.value


def test_node_config_durations_and_relative_paths(tmp_path: Path) -> None:
    from colossalai_exporter.node.config import NodeConfig, NodeFile, apply_file

    path = tmp_path / "etc" / "node.yml"
    path.parent.mkdir()
    path.write_text("gpu: {timeout_seconds: 1500ms}\nscrape_timeout_seconds: 8\n"
                    "rendezvous: {timeout_seconds: 2s}\n"
                    "disks: [{name: ckpt, path: ckpt}]\nranks: {run_dir: /dev/shm/x}\n")
    config = NodeConfig()
    apply_file(config, load(path, NodeFile), str(path))
    assert (config.gpu_timeout, config.scrape_timeout, config.rendezvous_timeout) == \
        (1.5, 8.0, 2.0)
    assert config.disks[0].path == str(tmp_path / "etc" / "ckpt")  # the file's folder
    assert config.ranks_run_dir == "/dev/shm/x"


def test_a_node_config_typo_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "node.yml"
    path.write_text("web:\n  listen_adress: ':9999'\n")
    result = run_cli("node", NO_GPU, "--config.file", str(path))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"colossalai-exporter: error: {path}: web: unknown key `listen_adress` "
        "(known: listen_address, config_file)"], result.stderr


def test_busy_listen_address_is_exit_2(listener: int) -> None:
    result = run_cli("node", NO_GPU, "--web.listen-address", f"127.0.0.1:{listener}")
    assert result.returncode == 2
    assert "cannot listen" in result.stderr and "Address already in use" in result.stderr


def test_config_file_with_flags_overriding(server_process, tmp_path: Path) -> None:
    config = tmp_path / "node.yml"
    config.write_text(f"disks:\n  - {{name: fromfile, path: {tmp_path}}}\n"
                      "collectors: {rendezvous: false}\n")
    agent = server_process("node", NO_GPU, "--config.file", str(config))
    text = scrape(agent.url)
    assert value(text, "colossalai_disk_path_ok", name="fromfile", path=str(tmp_path)) == 1
    assert value(text, "colossalai_exporter_collector_up", collector="rendezvous") is None
    agent2 = server_process("node", NO_GPU, "--config.file", str(config),
                            "--disk", f"fromflag={tmp_path}")
    text = scrape(agent2.url)
    assert value(text, "colossalai_disk_path_ok", name="fromflag", path=str(tmp_path)) == 1
    assert value(text, "colossalai_disk_path_ok", name="fromfile", path=str(tmp_path)) is None


def test_sigterm_stops_cleanly(server_process) -> None:
    agent = server_process("node", NO_GPU, "--no-collector.disk", "--no-collector.rendezvous")
    assert agent.stop() == 0


def test_series_budget_with_8_fake_gpus_and_2_disks(server_process, tmp_path: Path) -> None:
    """With 8 GPUs and 2 disks the agent's own exposition stays under 200 series."""
    from gpu_helpers import Scenario, fake_nvml_env, gpu

    scenario = Scenario(tmp_path / "nvml.json").write(gpus=[gpu(i) for i in range(8)])
    disk_a, disk_b = tmp_path / "a", tmp_path / "b"
    disk_a.mkdir()
    disk_b.mkdir()
    agent = server_process("node", "--disk", f"checkpoints={disk_a}", "--disk", f"nvme={disk_b}",
                           "--rendezvous.target", "127.0.0.1:1",
                           env=fake_nvml_env(scenario.path, cli_env()))

    def gpus_up() -> str | None:
        text = scrape(agent.url)
        return text if value(text, "colossalai_gpu_devices") == 8 else None

    from conftest import wait_until

    text = wait_until(gpus_up, 20, what="8 fake GPUs served")
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(series) < 200, len(series)
    assert value(text, "colossalai_gpu_memory_used_percent", gpu="7") == pytest.approx(10.0)
    assert value(text, "colossalai_exporter_collector_up", collector="gpu") == 1


def test_agent_code_path_never_imports_torch(tmp_path: Path) -> None:
    """Start the agent's whole code path in a fresh interpreter: torch stays out.

    So do the training monitor and its HTTP client (requests), and PyYAML when
    no config file is given: the agent reads snapshots with the training
    package's small modules only, which keeps its start-up (goal: first scrape
    within 0.5 s) short.
    """
    code = f"""
import sys, time
from colossalai_exporter.node import cli, config as node_config
from colossalai_exporter.node.agent import build_app
from colossalai_exporter.flags import ArgumentParser, add_common_flags
parser = ArgumentParser(); add_common_flags(parser, 9466); node_config.add_node_flags(parser)
cfg = node_config.load_config(parser.parse_args(["--disk", "c={tmp_path}"]))
agent = cli.build_agent(cfg); build_app(agent); list(agent.collect()); agent.close()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "colossalai", "numpy",
                                                             "requests", "yaml")
               or m.startswith("colossalai_exporter.training"))  # rankstate is the contract
print(heavy)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=cli_env(), timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _host_values(collector: object) -> dict[str, float]:
    from colossalai_exporter.node.host import HostCollector

    assert isinstance(collector, HostCollector)
    return {f.name: f.samples[0].value for f in collector.collect(0.0)}


def test_host_memory_from_proc_meminfo_agrees_with_psutil(tmp_path: Path) -> None:
    import psutil

    from colossalai_exporter.node.host import HostCollector

    ours = _host_values(HostCollector())
    memory, swap = psutil.virtual_memory(), psutil.swap_memory()
    assert ours["colossalai_host_memory_total_bytes"] == memory.total
    assert ours["colossalai_host_swap_total_bytes"] == swap.total
    # Available memory and swap use move between the two reads; a few MiB at most.
    assert abs(ours["colossalai_host_memory_available_bytes"] - memory.available) < 64 * 2**20
    assert abs(ours["colossalai_host_swap_used_bytes"] - swap.used) < 64 * 2**20

    # A kernel whose meminfo lacks MemAvailable (before 3.14): psutil computes it instead.
    old = tmp_path / "meminfo"
    old.write_text("MemTotal:       16384 kB\nMemFree:         1024 kB\n"
                   "SwapTotal:          0 kB\nSwapFree:           0 kB\n")
    fallback = _host_values(HostCollector(meminfo=str(old)))
    assert fallback["colossalai_host_memory_total_bytes"] == memory.total
    # A file of our own with every field: exact kB-to-bytes arithmetic.
    full = tmp_path / "meminfo-full"
    full.write_text("MemTotal:       16384 kB\nMemFree:         1024 kB\n"
                    "MemAvailable:    8192 kB\nSwapTotal:       4096 kB\n"
                    "SwapFree:        1024 kB\n")
    # The OOM killer's count from /proc/vmstat (node_exporter's node_vmstat_oom_kill);
    # absent where the kernel does not count (before 4.13), not a false zero.
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "vmstat").write_text("nr_free_pages 1024\noom_kill 3\npgfault 7\n")
    assert _host_values(HostCollector(meminfo=str(full), proc_root=str(proc))) == {
        "colossalai_host_memory_total_bytes": 16384 * 1024.0,
        "colossalai_host_memory_available_bytes": 8192 * 1024.0,
        "colossalai_host_swap_total_bytes": 4096 * 1024.0,
        "colossalai_host_swap_used_bytes": 3072 * 1024.0,
        "colossalai_host_oom_kills": 3.0,  # the family (samples add _total)
    }
    (proc / "vmstat").write_text("nr_free_pages 1024\npgfault 7\n")
    assert "colossalai_host_oom_kills" not in _host_values(
        HostCollector(meminfo=str(full), proc_root=str(proc)))


def test_an_endpoint_that_never_answers_is_a_timeout_within_its_budget() -> None:
    """A SYN that is dropped, as a firewall drops packets: the connect to an address,
    made without blocking, is a timeout once the collector's budget is spent."""
    import time

    from colossalai_exporter.node.rendezvous import Endpoint, RendezvousCollector

    with syn_dropping_port() as port:
        collector = RendezvousCollector([Endpoint("127.0.0.1", port)], timeout=0.5)
        start = time.monotonic()
        families = collector.collect(time.monotonic() + 5)
        elapsed = time.monotonic() - start
        collector.close()
    assert 0.4 < elapsed < 1.5, elapsed
    failure = next(f for f in families if f.name == "colossalai_nccl_failure")
    assert [s.labels["reason"] for s in failure.samples] == ["timeout"]


def test_a_hung_path_holds_one_thread_and_later_scrapes_wait_for_that_check() -> None:
    """The paths behind a hung one are still checked (a thread each, halfway through
    the deadline); the hung path is not checked again until its check returns."""
    import threading
    import time

    from colossalai_exporter.node import disk

    release = threading.Event()
    calls: dict[str, int] = {}
    real = disk.check_path

    def hanging(path: disk.WatchedPath) -> disk.PathStatus:
        calls[path.name] = calls.get(path.name, 0) + 1
        if path.name == "hung":
            release.wait(30)
        return real(path)

    paths = [disk.WatchedPath("a", "/"), disk.WatchedPath("hung", "/"),
             disk.WatchedPath("b", "/"), disk.WatchedPath("c", "/")]
    # A deadline a loaded 2-core CI box meets: the paths behind the hung one get their
    # threads at half of it, and each must return within the other half.
    collector = disk.DiskCollector(paths, timeout=3.0)

    def reasons() -> dict[str, str]:
        pending = collector.begin(time.monotonic() + 5)
        families = collector.collect(time.monotonic() + 5, pending)
        ok = next(f for f in families if f.name == "colossalai_disk_path_ok")
        failed = next(f for f in families if f.name == "colossalai_disk_path_failure")
        out = {s.labels["name"]: "ok" for s in ok.samples if s.value == 1}
        out.update({s.labels["name"]: s.labels["reason"] for s in failed.samples})
        return out

    original, disk.check_path = disk.check_path, hanging
    try:
        for _ in range(3):
            assert reasons() == {"a": "ok", "hung": "timeout", "b": "ok", "c": "ok"}
        assert calls == {"a": 3, "hung": 1, "b": 3, "c": 3}
        release.set()
        # Its check returns: a scrape that was waiting for it, or the next one, says ok.
        wait_until(lambda: reasons() == {"a": "ok", "hung": "ok", "b": "ok", "c": "ok"},
                   timeout=30, interval=0.05, what="the released path reported ok")
    finally:
        disk.check_path = original
        release.set()
        collector.close()


def test_begun_collectors_run_last_and_families_keep_the_collectors_order() -> None:
    from prometheus_client.core import GaugeMetricFamily

    from colossalai_exporter.node.agent import Agent

    calls: list[str] = []

    class Inline:
        reasons = ()

        def __init__(self, name: str) -> None:
            self.name = name

        def collect(self, deadline: float) -> list[GaugeMetricFamily]:
            calls.append(f"collect {self.name}")
            return [GaugeMetricFamily(f"test_{self.name}", "x", value=1)]

        def close(self) -> None:
            pass

    class Begun(Inline):
        def begin(self, deadline: float) -> None:
            calls.append(f"begin {self.name}")

        def collect(self, deadline: float,  # type: ignore[override]
                    pending: object = None) -> list[GaugeMetricFamily]:
            return super().collect(deadline)

    agent = Agent([Begun("first"), Inline("second"), Begun("third"), Inline("fourth")])
    names = [f.name for f in agent.collect() if f.name.startswith("test_")]
    assert names == ["test_first", "test_second", "test_third", "test_fourth"]
    assert calls == ["begin first", "begin third", "collect second", "collect fourth",
                     "collect first", "collect third"]
    assert all(state.up for state in agent.states.values())


def test_address_endpoints_connect_without_resolving(listener: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An IP address is connected to directly (no getaddrinfo); a name is resolved."""
    from colossalai_exporter.node import rendezvous

    def no_resolver(*args: object, **kwargs: object) -> None:
        raise AssertionError("getaddrinfo called for an address")

    with monkeypatch.context() as patched:
        patched.setattr(socket, "getaddrinfo", no_resolver)
        assert rendezvous.connect(rendezvous.Endpoint("127.0.0.1", listener), 2).ok
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]
        assert rendezvous.connect(rendezvous.Endpoint("127.0.0.1", port), 2).reason == "refused"
    assert rendezvous.connect(rendezvous.Endpoint("localhost", listener), 2).ok


def test_the_example_node_config_is_read_strictly_as_documented() -> None:
    from colossalai_exporter.node.config import NodeConfig, NodeFile, apply_file

    example = REPO / "deploy" / "node" / "node.example.yml"
    config = NodeConfig()
    apply_file(config, load(example, NodeFile), str(example))
    assert config.gpu_expected == 8 and config.scrape_timeout == 8.0
    assert [(d.name, d.mount_point) for d in config.disks] == [("checkpoints", False),
                                                                ("nvme_offload", True)]
    assert config.rendezvous == []  # the ranks' own stores are checked without a setting
