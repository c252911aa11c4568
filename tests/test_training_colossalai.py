"""Real ColossalAI 0.5.0 on the CPU: 2 ranks under torchrun, gloo, TorchDDPPlugin.

One job for the whole module (start-up costs seconds): it steps with the
monitor, saves a real checkpoint through the watched Booster, raises and
survives a real host out-of-memory on rank 0, and keeps stepping until the
test, having scraped rank 0 over HTTP and read both ranks' snapshots with the
node agent's collector, tells it to stop.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from colossalai_exporter.node.ranks import RanksCollector
from colossalai_exporter.rankstate.files import read_snapshot
from conftest import cli_env, free_port, http_get, require, wait_until
from test_ranks_collector import Adapter

pytestmark = pytest.mark.slow

JOB = textwrap.dedent("""
    import os, sys, time
    import torch
    import torch.distributed as dist
    import colossalai
    from colossalai.booster import Booster
    from colossalai.booster.plugin import TorchDDPPlugin
    from colossalai_exporter import TrainingMonitor

    run_dir, port, ckpt_dir, stop_file = sys.argv[1:5]
    monitor = TrainingMonitor(port=int(port), host="127.0.0.1", run_dir=run_dir,
                              publish_interval=0.2, step_timeout=60)
    colossalai.launch_from_torch(backend="gloo", verbose=False)
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = torch.nn.MSELoss()
    booster = Booster(plugin=TorchDDPPlugin())
    model, optimizer, criterion, _, _ = monitor.boost(booster, model, optimizer, criterion)

    if monitor.rank == 0:
        try:
            with monitor.step():
                torch.empty(2**45, dtype=torch.uint8)  # a real host OOM (FACTS.md)
        except RuntimeError as exc:
            print("OOM-RERAISED", type(exc).__name__, "DefaultCPUAllocator" in str(exc),
                  flush=True)

    deadline = time.time() + 120
    i = 0
    while time.time() < deadline:
        with monitor.step(samples=8, tokens=128) as step:
            x, y = torch.randn(8, 16), torch.randn(8, 1)
            loss = criterion(model(x), y)
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            step.loss = loss.detach()  # a CPU tensor: read by the publisher thread
        i += 1
        if i == 5:
            booster.save_model(model, os.path.join(ckpt_dir, "model.pt"))  # watched
        if i % 10 == 0:  # every rank must stop at the same step (DDP all-reduces)
            flag = torch.tensor([1 if os.path.exists(stop_file) else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
        time.sleep(0.02)
    monitor.finish()
    monitor.close()
    print("DONE", monitor.rank, i, flush=True)
""")


@dataclass
class Job:
    proc: subprocess.Popen[str]
    url: str
    run_dir: Path
    ckpt_dir: Path
    stop_file: Path

    def output(self) -> str:
        if self.proc.poll() is None:
            return "(running)"
        assert self.proc.stdout is not None
        return self.proc.stdout.read()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    require(importlib.util.find_spec("colossalai") is not None
            and importlib.util.find_spec("torch") is not None,
            "colossalai 0.5.0 and torch (scripts/install-dev.sh)")
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    require(torchrun is not None, "torchrun next to the Python running the tests")
    assert torchrun is not None
    base = tmp_path_factory.mktemp("colossalai-job")
    script = base / "job.py"
    script.write_text(JOB)
    run_dir, ckpt_dir = base / "run", base / "ckpt"
    ckpt_dir.mkdir()
    port = free_port()
    env = cli_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), str(script), str(run_dir), str(port),
         str(ckpt_dir), str(base / "stop")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job = Job(proc, f"http://127.0.0.1:{port}", run_dir, ckpt_dir, base / "stop")
    yield job
    job.stop_file.touch()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, _, body = http_get(url + "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def test_real_job_seen_from_rank0_and_from_the_node_agent(job: Job) -> None:
    def rank0_checkpointed() -> bool:
        if job.proc.poll() is not None:
            raise AssertionError(f"job exited early:\n{job.output()}")
        try:
            samples = scrape(job.url)
        except OSError:
            return False
        return samples.get(("colossalai_checkpoint_last_step", (("rank", "0"),)), 0) >= 5

    wait_until(rank0_checkpointed, timeout=120, interval=0.5, what="rank 0 checkpointed")
    samples = scrape(job.url)
    r0 = (("rank", "0"),)
    assert samples[("colossalai_training_steps_total", r0)] >= 5
    assert samples[("colossalai_training_phase", (("phase", "training"), ("rank", "0")))] == 1
    assert samples[("colossalai_gemini_oom_total", (("device", "cpu"), ("rank", "0")))] == 1
    assert samples[("colossalai_checkpoint_failures_total", r0)] == 0
    assert (job.ckpt_dir / "model.pt").exists()  # the real booster.save_model wrote it
    info = next(k for k in samples if k[0] == "colossalai_training_info")
    labels = dict(info[1])
    assert labels["plugin"] == "TorchDDPPlugin"
    assert labels["colossalai_version"] == "0.5.0"
    assert labels["world_size"] == "2"
    assert (labels["dp_size"], labels["tp_size"], labels["pp_size"]) == ("2", "1", "1")  # DDP
    wait_until(lambda: ("colossalai_training_loss", r0) in scrape(job.url), timeout=10,
               what="tensor loss converted by the publisher")
    status, _, body = http_get(job.url + "/health")
    assert status == 200, body
    assert json.loads(body)["training"]["world_size"] == 2

    registry = CollectorRegistry()
    registry.register(Adapter(RanksCollector(job.run_dir)))
    for rank in ("0", "1"):
        assert registry.get_sample_value("colossalai_rank_up", {"rank": rank}) == 1
        steps = registry.get_sample_value("colossalai_training_steps_total", {"rank": rank})
        assert steps is not None
        assert steps >= 5
        # Rank 1's save ran (and returned) too: TorchDDP writes on the master only.
        assert registry.get_sample_value("colossalai_checkpoint_last_step",
                                         {"rank": rank}) == 5

    job.stop_file.touch()
    assert job.proc.wait(90) == 0
    out = job.output()
    assert "OOM-RERAISED RuntimeError True" in out, out
    assert out.count("DONE") == 2, out
    for rank in ("0", "1"):
        snap = read_snapshot(job.run_dir / f"rank-{rank}.json")
        assert snap.phase == "finished"
        assert registry.get_sample_value("colossalai_rank_up", {"rank": rank}) == 0
        assert registry.get_sample_value(
            "colossalai_training_phase", {"rank": rank, "phase": "finished"}) == 1
