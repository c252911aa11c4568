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

from conftest import cli_env, free_port, http_get, require, run_cli, wait_until


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
