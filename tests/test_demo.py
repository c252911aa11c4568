"""``colossalai-exporter demo``: the real demo process, its ranks and its node agent.

The plain-Python backend runs the whole story fast (train, stall, /health 503,
stall evidence, the node agent's view, a clean exit); the ColossalAI backend
is run once for real under torchrun to show the README's first command works.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import cli_env, free_port, http_get, require, require_binary, run_cli, wait_until


class Demo:
    """A running ``colossalai-exporter demo``; output in a file, never a pipe that can fill."""

    def __init__(self, workdir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port, self.agent_port = free_port(), free_port()
        self.workdir = workdir
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "colossalai_exporter", "demo", "--workdir", str(workdir),
             "--port", str(self.port), "--agent-port", str(self.agent_port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env or cli_env())

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def agent_samples(self) -> dict[tuple[str, str], float]:
        status, _, body = http_get(f"http://127.0.0.1:{self.agent_port}/metrics")
        assert status == 200
        return {(s.name, s.labels.get("rank", "")): s.value
                for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture
def demos() -> Iterator[list[Demo]]:
    started: list[Demo] = []
    yield started
    for demo in started:
        demo.close()


def health(demo: Demo) -> tuple[int, dict[str, object]]:
    status, _, body = http_get(f"http://127.0.0.1:{demo.port}/health", timeout=2)
    return status, json.loads(body)


@pytest.mark.slow
def test_stall_story_health_evidence_and_node_agent_view(tmp_path: Path,
                                                         demos: list[Demo]) -> None:
    demo = Demo(tmp_path, "--backend", "plain", "--steps", "100000", "--step-seconds", "0.02",
                "--stall-after", "30", "--stall-for", "8", "--step-timeout", "1.5",
                "--interval", "0.3", "--checkpoint-every", "10")
    demos.append(demo)
    wait_until(lambda: health(demo)[0] == 200, timeout=30, what="rank 0 healthy")
    _, body = wait_until(lambda: (s := health(demo))[0] == 503 and s, timeout=30,
                              what="rank 0 /health to turn 503")
    assert body["stalled"] is True and "no step completed" in str(body["reason"]), body
    samples = wait_until(
        lambda: (m := demo.agent_samples()).get(("colossalai_training_stalled", "1")) and m,
        timeout=15, what="the node agent to see the stall")
    assert samples[("colossalai_rank_up", "0")] == 1
    assert samples[("colossalai_rank_up", "1")] == 1
    assert samples[("colossalai_training_steps_total", "0")] == 30
    evidence = wait_until(lambda: sorted((tmp_path / "run").glob("stacks-rank0-*.txt")),
                          timeout=10, what="the stall evidence file")
    assert "hang_like_a_kernel_that_never_returns" in evidence[0].read_text()

    assert demo.proc.wait(60) == 0, demo.output()
    out = demo.output()
    assert "a plain Python loop (no torch)" in out
    assert f"http://127.0.0.1:{demo.port}/health" in out
    assert f"http://127.0.0.1:{demo.agent_port}/metrics" in out
    assert "rank 0 /health is 200: ok" in out
    assert "rank 0 /health is 503: stalled in phase training" in out
    assert "stall evidence written: " in out
    assert "node agent sees: rank 0 up, stalled; rank 1 up, stalled" in out
    assert "rank 0 failed after 30 steps, last checkpoint at step 30" in out
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[:2] == [
        "step10-rank0.json", "step10-rank1.json"]


@pytest.mark.slow
def test_real_colossalai_run_finishes_with_checkpoints(tmp_path: Path,
                                                       demos: list[Demo]) -> None:
    require(importlib.util.find_spec("colossalai") is not None
            and importlib.util.find_spec("torch") is not None,
            "colossalai 0.5.0 and torch (scripts/install-dev.sh)")
    # 30 steps of at least 0.1 s keep the run in phase training for >= 3 s, several of the
    # demo's 0.5 s health polls; at 0.01 s a fast machine finished between two polls.
    demo = Demo(tmp_path, "--steps", "30", "--step-seconds", "0.1", "--checkpoint-every", "10",
                "--interval", "0.5")
    demos.append(demo)
    assert demo.proc.wait(180) == 0, demo.output()
    out = demo.output()
    assert "ColossalAI Booster with TorchDDPPlugin on the CPU (gloo)" in out
    assert "rank 0 finished after 30 steps, last checkpoint at step 30" in out, out
    assert "rank 1 finished after 30 steps, last checkpoint at step 30" in out, out
    assert "rank 0 /health is 200: ok" in out, out
    # A clean run says nothing alarming (issue 18): no "unreachable" while rank 0
    # starts or after it ended, no rank "down", and it says how to stop and what next.
    for noise in ("unreachable", "DOWN", "down", "no ranks seen yet"):
        assert noise not in out, out
    assert "Ctrl-C stops the ranks and the node agent" in out
    assert "next: add --stall-after 100" in out
    assert {p.name for p in (tmp_path / "checkpoints").iterdir()} == {
        "step10.pt", "step20.pt", "step30.pt"}


def test_ctrl_c_stops_every_process_it_started(tmp_path: Path, demos: list[Demo]) -> None:
    demo = Demo(tmp_path, "--backend", "plain", "--steps", "100000", "--step-seconds", "0.02",
                "--interval", "0.3")
    demos.append(demo)
    snaps = wait_until(lambda: len(list((tmp_path / "run").glob("rank-*.json"))) == 2
                       and [json.loads(p.read_text()) for p in (tmp_path / "run").glob("rank-*")],
                       timeout=30, what="both ranks' snapshots")
    pids = [int(s["pid"]) for s in snaps]
    demo.proc.send_signal(signal.SIGINT)
    assert demo.proc.wait(30) == 130, demo.output()
    assert "interrupted: stopping the ranks and the node agent" in demo.output()

    def gone(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(")")[-1].split()[0] == "Z"  # a zombie is gone too
        except FileNotFoundError:
            return True

    wait_until(lambda: all(gone(p) for p in pids), timeout=10, what="the ranks to exit")
    with socket.socket() as sock:  # the agent released its port
        sock.bind(("127.0.0.1", demo.agent_port))


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli("demo", "--port", str(port), "--workdir", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"colossalai-exporter: error: rank 0 port 127.0.0.1:{port} is not available: "
        "Address already in use"]
    for args, message in ((["--steps", "0"], "argument --steps: 0 is below 1"),
                          (["--step-timeout", "soon"], "argument --step-timeout: 'soon' is not "
                                                       "float")):
        result = run_cli("demo", *args)
        assert result.returncode == 2
        assert result.stderr.strip() == f"colossalai-exporter: error: {message}"
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_a_workdir_that_does_not_exist_is_created(tmp_path: Path, demos: list[Demo]) -> None:
    """--workdir new/deeper, with the run and checkpoint directories outside it: the
    logs' folder is made too (it crashed with FileNotFoundError: agent.log)."""
    workdir = tmp_path / "new" / "deeper"
    demo = Demo(workdir, "--backend", "plain", "--steps", "20", "--step-seconds", "0.01",
                "--interval", "0.3", "--run-dir", str(tmp_path / "run"),
                "--checkpoint-dir", str(tmp_path / "ckpt"))
    demos.append(demo)
    assert demo.proc.wait(60) == 0, demo.output()
    assert (workdir / "train.log").exists() and (workdir / "agent.log").exists()
    assert list((tmp_path / "run").glob("rank-*.json"))


def test_a_port_left_in_time_wait_is_free_for_the_demo() -> None:
    """The last run's connections in TIME_WAIT (a demo restarted within a minute) do not
    hold a port against a new listener; one that something listens on does."""
    from colossalai_exporter.demo.launch import check_port_free
    from colossalai_exporter.errors import ConfigError

    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: it is the one in TIME_WAIT
        client.recv(1)
        client.close()
        with pytest.raises(ConfigError, match="is not available"):
            check_port_free("127.0.0.1", port, "rank 0")  # still listening
    check_port_free("127.0.0.1", port, "rank 0")  # only TIME_WAIT is left


# --- demo --alerting: the real alert path on one host --------------------------------


def alerting_ports() -> list[str]:
    return [arg for name in ("prometheus", "alertmanager", "bridge", "pager")
            for arg in (f"--{name}-port", str(free_port()))]


def children(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


@pytest.mark.slow
def test_alerting_prints_the_page_for_the_killed_rank_and_stops_everything(
        tmp_path: Path, demos: list[Demo]) -> None:
    """The README's command to a page: real Prometheus, Alertmanager and bridge from the
    shipped files, a torch run whose rank 1 the demo kills. The first page names rank 1,
    its node and why, at the bridge's webhook and in Slack's title; nothing paged before
    the kill; Ctrl-C leaves no process and no port behind."""
    require_binary("prometheus")
    require_binary("prometheus-alertmanager")
    require(importlib.util.find_spec("torch") is not None, "torch installed")
    ports = alerting_ports()
    demo = Demo(tmp_path, "--alerting", "--backend", "torch", "--steps", "100000",
                "--kill-after", "30", "--step-seconds", "0.05", "--interval", "0.5", *ports)
    demos.append(demo)
    wait_until(lambda: "page to Slack slack-critical" in demo.output()
               or demo.proc.poll() is not None, timeout=300, interval=0.5,
               what="the Slack page")
    out = demo.output()
    assert demo.proc.poll() is None, out
    lines = [line.split(" ", 1)[1] if line[:2].isdigit() else line for line in out.splitlines()]
    killed = next(i for i, line in enumerate(lines) if line.startswith("killed rank 1 (pid "))
    first_page = next(i for i, line in enumerate(lines) if line.startswith("PAGE to "))
    assert killed < first_page, out  # nothing paged while the run was healthy
    assert lines[first_page].startswith("PAGE to the bridge's webhook oncall, "), out
    assert lines[first_page + 1].startswith(
        "    | TrainingRankDown (critical): Rank 1 of run 127.0.0.1:"), out
    assert f"on 127.0.0.1:{demo.agent_port} was killed" in lines[first_page + 1], out
    slack = next(i for i, line in enumerate(lines) if line.startswith("page to Slack "))
    assert lines[slack + 1].startswith("    | 🔴 FIRING: TrainingRankDown — job colossalai-node"
                                       " — run 127.0.0.1:"), out
    assert lines[slack + 1].endswith(f" — rank 1 on 127.0.0.1:{demo.agent_port}"), out
    seconds = int(lines[first_page].rsplit(", ", 1)[1].split(" s after")[0])
    assert 0 < seconds < 120, out

    started = children(demo.proc.pid)
    assert len(started) >= 4, out  # Prometheus, Alertmanager, the bridge, the agent, torchrun
    demo.proc.send_signal(signal.SIGINT)
    assert demo.proc.wait(60) == 130, demo.output()
    assert "interrupted: stopping everything the demo started" in demo.output()
    import psutil

    wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                               for p in started), timeout=30, what="every process to exit")
    for port in [demo.port, demo.agent_port, *map(int, ports[1::2])]:
        with socket.socket() as sock:  # every port released
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))


def test_alerting_without_prometheus_says_how_to_install_it(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    result = run_cli("demo", "--alerting", "--workdir", str(tmp_path / "w"),
                     env=cli_env(PATH=str(bare)))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "colossalai-exporter: error: --alerting needs Prometheus and Alertmanager, and "
        "prometheus and prometheus-alertmanager are not on PATH: install them with: sudo "
        "apt-get install prometheus prometheus-alertmanager (Debian, Ubuntu), or put the "
        "upstream prometheus and alertmanager binaries on PATH"]
    assert not (tmp_path / "w").exists()  # nothing started, nothing written


def test_one_host_folder_is_the_shipped_files_with_only_the_documented_changes(
        tmp_path: Path) -> None:
    """What `demo --alerting` runs is deploy/ as shipped, changed only as docs/deploy.md
    ("One host by hand") says: the addresses, the prober job left out, the demo's 5 s
    intervals, the secret files' folder. promtool, amtool and `bridge check` accept it."""
    import yaml

    from colossalai_exporter.demo import onehost
    from conftest import REPO
    from deploy_helpers import amtool_check_config, promtool_check_config

    ports = onehost.Ports(19090, 19093, 19468, 19466, 18766, 19469)
    folder = onehost.write(tmp_path / "stack", "127.0.0.1", ports)

    shipped = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    text = yaml.safe_dump(shipped)
    for old, new in (("alertmanager:9093", "127.0.0.1:19093"),
                     ("colossalai-bridge:9468", "127.0.0.1:19468"),
                     ("localhost:9090", "127.0.0.1:19090")):
        text = text.replace(old, new)
    expected = yaml.safe_load(text)
    expected["global"].update(scrape_interval="5s", scrape_timeout="5s",
                              evaluation_interval="5s")
    expected["scrape_configs"] = [job for job in expected["scrape_configs"]
                                  if job["job_name"] != "colossalai-prober"]
    assert yaml.safe_load(folder.prometheus_config.read_text()) == expected

    shipped_am = (REPO / "deploy/alertmanager/alertmanager.yml").read_text()
    secrets = tmp_path / "stack" / "alertmanager" / "secrets"
    expected_am = yaml.safe_load(
        shipped_am.replace("http://colossalai-bridge:9468", "http://127.0.0.1:19468")
        .replace("/etc/alertmanager/secrets", str(secrets)))
    assert yaml.safe_load(folder.alertmanager_config.read_text()) == expected_am
    for name in ("bridge-token", "slack-critical-url", "slack-warning-url"):
        assert (secrets / name).stat().st_mode & 0o077 == 0, name  # secrets: owner only
    assert (secrets / "bridge-token").read_text() == \
        (tmp_path / "stack" / "bridge" / "secrets" / "bridge-token").read_text()

    promtool = promtool_check_config(folder.prometheus_config)
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr
    warnings = [line for line in (promtool.stdout + promtool.stderr).splitlines()
                if "WARNING" in line]
    # Only the file_sd patterns nobody fills on one host (JSON files, the chat jobs).
    assert all("for file_sd in scrape job" in line for line in warnings), warnings
    checked = promtool.stdout.count("rules.yml\n  SUCCESS:")  # each rule file promtool read
    assert checked == len(list((REPO / "rules").glob("*.rules.yml"))), promtool.stdout
    amtool = amtool_check_config(folder.alertmanager_config)
    assert amtool.returncode == 0, amtool.stdout + amtool.stderr
    bridge = run_cli("bridge", "check", "--config.file", str(folder.bridge_config))
    assert bridge.returncode == 0, bridge.stdout + bridge.stderr

    deploy_md = (REPO / "docs" / "deploy.md").read_text()
    section = deploy_md.split("## One host by hand", 1)[1].split("\n## ", 1)[0]
    for words in ("alertmanager:9093", "colossalai-bridge:9468", "localhost:9090",
                  "colossalai-prober", "/etc/alertmanager/secrets/", "bridge-token",
                  "slack-critical-url", "slack-warning-url", "--cluster.listen-address=",
                  "--web.external-url=", "grafana_url", "prometheus-alertmanager",
                  "colossalai-exporter demo --alerting"):
        assert words in section, words


def test_the_end_summary_says_a_rank_whose_process_vanished_was_killed() -> None:
    """The demo's last words per rank read the snapshots, which a SIGKILLed rank never
    updates: it said "rank 1 training after 100 steps" of the rank it killed."""
    import os

    from colossalai_exporter.demo.summary import ending
    from colossalai_exporter.rankstate.schema import Interruption, Snapshot

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid is free now (reaped)

    def snap(pid: int, phase: str = "training",
             interruption: Interruption | None = None) -> Snapshot:
        return Snapshot(rank=1, local_rank=1, world_size=2, pid=pid, created=0.0,
                        written=0.0, phase=phase, phase_start=0.0,  # type: ignore[arg-type]
                        step_buckets=[], step_hist=[0], timeout=60.0, progress=0.0,
                        interruption=interruption)

    assert ending(snap(os.getpid())) == "training"  # alive: its phase
    assert ending(snap(gone.pid, "finished")) == "finished"  # it said how it ended
    assert ending(snap(gone.pid)) == \
        "killed in phase training (its process vanished with no error)"
    assert ending(snap(gone.pid, interruption=Interruption(signal="SIGTERM", time=1.0))) == \
        "ended by SIGTERM in phase training"
