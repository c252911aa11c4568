"""Stall evidence from torch's flight recorder: dumped beside the stacks when enabled."""

from __future__ import annotations

import importlib.util
import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from colossalai_exporter.training import flight_recorder
from conftest import cli_env, free_port, require

STALLING_RANK = textwrap.dedent("""
    import json, sys, time
    import torch
    import torch.distributed as dist
    from colossalai_exporter import TrainingMonitor

    run_dir = sys.argv[1]
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2],
                            rank=0, world_size=1)
    dist.all_reduce(torch.ones(4))           # something for the recorder to hold
    monitor = TrainingMonitor(rank=0, local_rank=0, world_size=1, serve="none",
                              run_dir=run_dir, step_timeout=0.3, publish_interval=0.1)
    monitor.step_done(0.01)
    deadline = time.monotonic() + 20
    while len(monitor.evidence_files) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)                     # the stall: no step for longer than 0.3 s
    print(json.dumps([str(p) for p in monitor.evidence_files]))
    monitor.close()
    dist.destroy_process_group()
""")


def run_stalling_rank(tmp_path: Path, **env: str) -> list[str]:
    require(importlib.util.find_spec("torch") is not None, "torch (scripts/install-dev.sh)")
    result = subprocess.run([sys.executable, "-c", STALLING_RANK, str(tmp_path),
                             str(free_port())], env=cli_env(**env), capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    files: list[str] = json.loads(result.stdout.strip().splitlines()[-1])
    return files


@pytest.mark.slow
def test_enabled_recorder_is_dumped_beside_the_stacks(tmp_path: Path) -> None:
    files = run_stalling_rank(tmp_path, TORCH_FR_BUFFER_SIZE="1000")
    assert len(files) == 2, files
    stacks, recorded = map(Path, files)
    assert stacks.name.startswith("stacks-rank0-")
    assert recorded.name.startswith("flight-recorder-rank0-") and recorded.suffix == ".pickle"
    dump = pickle.loads(recorded.read_bytes())  # torch's own dump format
    assert isinstance(dump, dict) and "version" in dump, dump
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically


@pytest.mark.slow
def test_no_recorder_no_dump(tmp_path: Path) -> None:
    files = run_stalling_rank(tmp_path, TORCH_FR_BUFFER_SIZE="0")
    # Only the stacks: the loop in the child waits up to 20 s for a second file.
    assert [Path(f).name.split("-")[0] for f in files] == ["stacks"]
    assert not list(tmp_path.glob("flight-recorder-*"))


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, False),
    ({"TORCH_FR_BUFFER_SIZE": "2000"}, True),
    ({"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}, False),
    ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}, True),  # torch < 2.6's name
    ({"TORCH_FR_BUFFER_SIZE": "lots"}, False),
    ({"TORCH_FR_BUFFER_SIZE": " "}, False),
])
def test_enabled_reads_both_variable_names(environ: dict[str, str], expected: bool) -> None:
    assert flight_recorder.enabled(environ) is expected


def test_never_imports_torch(tmp_path: Path) -> None:
    code = ("import sys; from pathlib import Path;"
            "from colossalai_exporter.training import flight_recorder as fr;"
            f"print(fr.dump(Path({str(tmp_path)!r}), 0, environ={{'TORCH_FR_BUFFER_SIZE': '9'}}),"
            " 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "False"]
