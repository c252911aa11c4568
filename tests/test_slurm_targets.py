"""deploy/slurm and ``python -m colossalai_exporter.slurm``: hostlists, file_sd, prolog, epilog."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from colossalai_exporter.slurm import file_sd
from colossalai_exporter.slurm.hostlist import MAX_HOSTS, HostlistError, expand
from conftest import REPO, cli_env, is_root, wait_until
from deploy_helpers import active_targets, prometheus_layout, running_prometheus

SLURM_DIR = REPO / "deploy" / "slurm"


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu-a[1-2],gpu-b3", ["gpu-a1", "gpu-a2", "gpu-b3"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("node[8-10]", ["node8", "node9", "node10"]),          # no padding: none asked for
    ("node[08-10]", ["node08", "node09", "node10"]),       # width from the first number
    ("gpu[1-2]-ib,login1", ["gpu1-ib", "gpu2-ib", "login1"]),
    ("a1,a[1-2]", ["a1", "a2"]),                           # each host once
    ("dgx-h100-007.cluster", ["dgx-h100-007.cluster"]),
    (" node[1-2]\n", ["node1", "node2"]),                  # surrounding whitespace
])
def test_expands_slurm_hostlists(nodelist: str, hosts: list[str]) -> None:
    assert expand(nodelist) == hosts


@pytest.mark.parametrize(("nodelist", "message"), [
    ("", "the nodelist is empty"),
    ("node[01-", "'[' at position 4 is never closed"),
    ("node]01", "']' without '[' at position 4"),
    ("node[]", "empty brackets at position 4"),
    ("node[4-2]", "range '4-2' at position 4 counts down"),
    ("node[a-b]", "'a-b' in brackets at position 4 is not a number or a range"),
    ("node[1-2-3]", "'1-2-3' in brackets"),
    ("node[[1]]", "nested '[' at position 5"),
    ("a,,b", "empty host name at position 2"),
    ("a,", "empty host name at position 2"),
    ("no de", "character ' ' at position 2"),
    ("node[1-4:2]", "'1-4:2' in brackets"),                # steps are not Slurm syntax
    ("n[0-99999999]", f"expands to more than {MAX_HOSTS} hosts"),
    ("r[1-300]n[1-300]", f"expands to more than {MAX_HOSTS} hosts"),
])
def test_malformed_hostlists_are_one_line_errors(nodelist: str, message: str) -> None:
    with pytest.raises(HostlistError) as info:
        expand(nodelist)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def _run(*args: str, env: dict[str, str] | None = None,
         module: bool = True) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in cli_env().items() if not k.startswith("SLURM_")}
    command = [sys.executable, "-m", "colossalai_exporter.slurm"] if module else []
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=30,
                          env={**base, **(env or {})}, check=False)


def _slurm_env(tmp_path: Path, nodelist: str = "node[01-04,07]", job_id: str = "4242",
               **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": job_id,
            "COLOSSALAI_EXPORTER_FILE_SD_DIR": str(tmp_path / "targets"), **extra}


def _read(tmp_path: Path, job: str, job_id: str = "4242") -> list[dict[str, object]]:
    data: list[dict[str, object]] = json.loads(
        (tmp_path / "targets" / job / f"slurm-{job_id}.json").read_text())
    return data


def test_write_from_the_slurm_environment(tmp_path: Path) -> None:
    result = _run("write", env=_slurm_env(tmp_path, SLURM_JOB_NAME="llama-70b"))
    assert result.returncode == 0, result.stderr
    node_file = tmp_path / "targets" / "colossalai-node" / "slurm-4242.json"
    assert result.stdout.splitlines() == [
        f"wrote {node_file} (5 targets)",
        f"wrote {tmp_path / 'targets' / 'colossalai-training' / 'slurm-4242.json'} (1 target)",
    ]
    labels = {"slurm_job_id": "4242", "slurm_job_name": "llama-70b"}
    assert _read(tmp_path, "colossalai-node") == [{
        "targets": ["node01:9466", "node02:9466", "node03:9466", "node04:9466", "node07:9466"],
        "labels": labels}]
    # rank 0 serves, on the first node of the (sorted) nodelist
    assert _read(tmp_path, "colossalai-training") == [
        {"targets": ["node01:8766"], "labels": labels}]
    # readable by a Prometheus running as another user; no temporary file left behind
    assert node_file.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in node_file.parent.iterdir()) == ["slurm-4242.json"]


def test_write_options(tmp_path: Path) -> None:
    result = _run("write", "--nodelist", "gpu-a[1-2],gpu-b3", "--job-id", "7",
                  "--node.port", "19466", "--training.port", "18766",
                  "--training.local-ranks", "2", "--domain", "hpc.example",
                  "--label", "team=nlp", "--label", "model=llama",
                  env={"COLOSSALAI_EXPORTER_FILE_SD_DIR": str(tmp_path / "targets")})
    assert result.returncode == 0, result.stderr
    labels = {"slurm_job_id": "7", "team": "nlp", "model": "llama"}
    assert _read(tmp_path, "colossalai-node", "7") == [{
        "targets": ["gpu-a1.hpc.example:19466", "gpu-a2.hpc.example:19466",
                    "gpu-b3.hpc.example:19466"], "labels": labels}]
    # serve="local": every node, one port per local rank
    assert _read(tmp_path, "colossalai-training", "7")[0]["targets"] == [
        f"{host}.hpc.example:{port}" for host in ("gpu-a1", "gpu-a2", "gpu-b3")
        for port in (18766, 18767)]


def test_a_label_the_exporters_set_is_refused(tmp_path: Path) -> None:
    """``run`` (or ``rank``) on a target would rename the monitor's own to exported_run."""
    result = _run("write", "--nodelist", "gpu-a1", "--job-id", "7", "--label", "run=llama",
                  env={"COLOSSALAI_EXPORTER_FILE_SD_DIR": str(tmp_path / "targets")})
    assert result.returncode == 2
    assert "label 'run' is set by the exporters themselves" in result.stderr
    assert not (tmp_path / "targets").exists() or not list((tmp_path / "targets").rglob("*.json"))


def test_rewrite_replaces_and_port_zero_removes(tmp_path: Path) -> None:
    assert _run("write", env=_slurm_env(tmp_path)).returncode == 0
    result = _run("write", "--training.port", "0", env=_slurm_env(tmp_path, "node[01-02]"))
    assert result.returncode == 0, result.stderr
    assert _read(tmp_path, "colossalai-node")[0]["targets"] == ["node01:9466", "node02:9466"]
    assert not (tmp_path / "targets" / "colossalai-training" / "slurm-4242.json").exists()


def test_remove_deletes_only_this_jobs_files(tmp_path: Path) -> None:
    assert _run("write", env=_slurm_env(tmp_path, job_id="1")).returncode == 0
    assert _run("write", env=_slurm_env(tmp_path, job_id="2")).returncode == 0
    result = _run("remove", env=_slurm_env(tmp_path, job_id="1"))
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2
    remaining = sorted(p.relative_to(tmp_path / "targets").as_posix()
                       for p in (tmp_path / "targets").rglob("*.json"))
    assert remaining == ["colossalai-node/slurm-2.json", "colossalai-training/slurm-2.json"]
    # already gone is fine (an epilog may run twice)
    again = _run("remove", env=_slurm_env(tmp_path, job_id="1"))
    assert (again.returncode, again.stdout) == (0, "")


@pytest.mark.parametrize(("args", "env", "message"), [
    (["write"], {"SLURM_JOB_NODELIST": "node[01-"},
     "colossalai_exporter.slurm: error: nodelist 'node[01-': '[' at position 4 is never closed"),
    (["write"], {"SLURM_JOB_NODELIST": ""},
     "colossalai_exporter.slurm: error: no nodelist: set SLURM_JOB_NODELIST"),
    (["write"], {"SLURM_JOB_ID": "../../etc/x"},
     "colossalai_exporter.slurm: error: the job id must be digits (SLURM_JOB_ID), "
     "got '../../etc/x'"),
    (["write", "--label", "job=x"], {}, "label 'job' is set by Prometheus"),
    (["write", "--label", "bad-name=x"], {}, "label 'bad-name' is not a Prometheus label name"),
    (["write", "--label", "novalue"], {}, "--label 'novalue' must be NAME=VALUE"),
    (["write", "--node.port", "70000"], {}, "--node.port must be 0 (off) or a port 1-65535"),
    (["write", "--domain", "a b"], {}, "--domain 'a b' is not a DNS domain"),
    (["write", "--frobnicate"], {}, "unrecognized arguments: --frobnicate"),
    ([], {}, "the following arguments are required: command"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
        tmp_path: Path, args: list[str], env: dict[str, str], message: str) -> None:
    result = _run(*args, env={**_slurm_env(tmp_path), **env})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert not (tmp_path / "targets").exists()


def test_hostnames_prints_one_host_a_line() -> None:
    result = _run("hostnames", "rack[1-2]-node[01-02]")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["rack1-node01", "rack1-node02", "rack2-node01",
                                     "rack2-node02"]
    from_env = _run("hostnames", env={"SLURM_JOB_NODELIST": "gpu-a[1-2],gpu-b3"})
    assert from_env.stdout.split() == ["gpu-a1", "gpu-a2", "gpu-b3"]


def test_a_failed_rename_leaves_no_temporary_file(tmp_path: Path) -> None:
    blocked = tmp_path / "slurm-1.json"
    (blocked / "inside").mkdir(parents=True)  # a directory where the file should go
    with pytest.raises(IsADirectoryError):
        file_sd.write_atomically(blocked, b"[]\n")
    assert [p.name for p in tmp_path.iterdir()] == ["slurm-1.json"]


def _fill(path: Path) -> None:
    with path.open("wb", buffering=0) as filler:
        while True:
            filler.write(b"x" * 4096)


def test_a_full_disk_keeps_the_old_file_whole(tmp_path: Path) -> None:
    """A real full filesystem (tmpfs): Prometheus keeps reading the previous file intact."""
    if not is_root():
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "full"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        path = mount / "slurm-1.json"
        file_sd.write_atomically(path, b"old\n")
        with pytest.raises(OSError, match="No space left on device"):
            _fill(mount / "filler")
        with pytest.raises(OSError, match="No space left on device"):
            file_sd.write_atomically(path, b"new" * 100_000)
        assert path.read_bytes() == b"old\n"
        assert sorted(p.name for p in mount.iterdir()) == ["filler", "slurm-1.json"]
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _scripts_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    # The wrapper runs this interpreter, with the package from the source tree.
    return {**_slurm_env(tmp_path, **extra), "COLOSSALAI_EXPORTER_PYTHON": sys.executable}


def test_prolog_and_epilog_scripts(tmp_path: Path) -> None:
    prolog, epilog = SLURM_DIR / "prolog-slurmctld.sh", SLURM_DIR / "epilog-slurmctld.sh"
    for script in (prolog, epilog, SLURM_DIR / "colossalai-slurm-targets"):
        assert os.access(script, os.X_OK), f"{script} is not executable"
    # without the opt-in comment: node agents only
    result = _run(str(prolog), env=_scripts_env(tmp_path), module=False)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "targets" / "colossalai-node" / "slurm-4242.json").exists()
    assert not (tmp_path / "targets" / "colossalai-training" / "slurm-4242.json").exists()
    # sbatch --comment=colossalai: the rank server too
    result = _run(str(prolog), env=_scripts_env(tmp_path, SLURM_JOB_COMMENT="colossalai"),
                  module=False)
    assert result.returncode == 0, result.stderr
    assert _read(tmp_path, "colossalai-training")[0]["targets"] == ["node01:8766"]
    result = _run(str(epilog), env=_scripts_env(tmp_path), module=False)
    assert result.returncode == 0, result.stderr
    assert not list((tmp_path / "targets").rglob("*.json"))


def test_prolog_never_fails_the_job(tmp_path: Path) -> None:
    """A non-zero PrologSlurmctld would requeue or cancel the job: it reports and exits 0."""
    result = _run(str(SLURM_DIR / "prolog-slurmctld.sh"),
                  env=_scripts_env(tmp_path, nodelist="node[01-"), module=False)
    assert result.returncode == 0
    assert not (tmp_path / "targets").exists()


@pytest.mark.slow
def test_prometheus_adds_and_drops_a_jobs_targets(tmp_path: Path) -> None:
    """Real Prometheus: the prolog's files become labelled targets; removing them drops them."""
    config = prometheus_layout(tmp_path, examples=False)
    env = _scripts_env(tmp_path, nodelist="gpu-a[1-2],gpu-b3", SLURM_JOB_COMMENT="colossalai")
    with running_prometheus(config) as base:
        assert _run(str(SLURM_DIR / "prolog-slurmctld.sh"), env=env, module=False).returncode == 0

        def slurm_targets() -> dict[str, dict[str, str]] | None:
            found = {t["labels"]["instance"]: t["labels"] for t in active_targets(base)
                     if t["labels"].get("slurm_job_id") == "4242"}
            return found if len(found) == 4 else None

        # file_sd notices new files through inotify, without a reload
        found = wait_until(slurm_targets, timeout=30, interval=0.25, what="the job's 4 targets")
        assert found["gpu-a1:8766"]["job"] == "colossalai-training"
        assert {found[f"{h}:9466"]["job"] for h in ("gpu-a1", "gpu-a2", "gpu-b3")} == {
            "colossalai-node"}
        assert _run(str(SLURM_DIR / "epilog-slurmctld.sh"), env=env, module=False).returncode == 0
        wait_until(lambda: not any(t["labels"].get("slurm_job_id") for t in active_targets(base)),
                   timeout=30, interval=0.25, what="the job's targets dropped")
