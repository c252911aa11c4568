"""``colossalai-exporter node check``: one line and an exit code a scheduler acts on.

The real command in a subprocess: the GPUs from the fake NVML (tests/fake_nvml), real
paths for the disks, and kernel logs written as /dev/kmsg gives its records, with the
driver's Xid lines as it logs them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import cli_env
from gpu_helpers import Scenario, fake_nvml_env, gpu

XID_79 = ("3,812,5123456,-;NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, "
          "GPU has fallen off the bus.")
XID_63 = ("4,640,4000000,-;NVRM: Xid (PCI:0000:86:00): 63, pid=1234, name=python3, "
          "Row Remapper: New row (0x0000000000012345) Marked for Remapping, reset gpu to "
          "activate.")
XID_13 = ("4,600,3000000,-;NVRM: Xid (PCI:0000:86:00): 13, Graphics Exception: ESR "
          "0x404490=0x80000001")
# What a process writes to /dev/kmsg is logged with facility 1 (priority 8 and up): a
# forged Xid line does not count.
FORGED_79 = "12,900,6000000,-;NVRM: Xid (PCI:0000:3b:00): 79, forged by a user"


def run_check(tmp: Path, *args: str, gpus: int = 2, kmsg: list[str] | None = None,
              expected: int | None = 2, specs: list[dict[str, Any]] | None = None,
              errors: dict[str, int] | None = None) -> tuple[int, str, str]:
    scenario = Scenario(tmp / "nvml.json").write(
        gpus=specs if specs is not None else [gpu(i) for i in range(gpus)],
        errors=errors or {})
    log = tmp / "kmsg"
    log.write_text("".join(line + "\n" for line in (kmsg or [])))
    (tmp / "ckpt").mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "colossalai_exporter", "node", "check", "--kmsg", str(log),
            "--disk", f"checkpoints={tmp / 'ckpt'}", "--gpu.timeout", "10", *args]
    if expected is not None:
        argv += ["--gpu.expected", str(expected)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                            env=fake_nvml_env(scenario.path, cli_env()))
    return result.returncode, result.stdout, result.stderr


def test_a_healthy_node_is_ok_and_says_what_it_saw(tmp_path: Path) -> None:
    code, out, err = run_check(tmp_path, kmsg=[XID_13, FORGED_79])
    assert (code, out) == (0, "OK: 2 GPU(s)\n"), err


def test_a_critical_xid_since_boot_fails_the_node_with_the_action(tmp_path: Path) -> None:
    """The driver logged Xid 79 before the check ran (NVML tells only of new events):
    drain, with the reason and what to do in one line. A warning-tier Xid is said."""
    code, out, err = run_check(tmp_path, kmsg=[XID_63, XID_79, XID_79])
    assert code == 1, out + err
    assert out.splitlines() == [
        "FAIL: Xid 79 on GPU 0000:3b:00 since boot: GPU has fallen off the bus — drain the "
        "node and reboot it; the GPU is gone until then; 2 GPU(s); Xid 63 on GPU 0000:86:00 "
        "since boot: ECC page retirement or row remapping event — no action now; reset the "
        "GPU at the node's next drain"]


def test_what_nvml_says_of_the_gpus_fails_the_node_with_the_action(tmp_path: Path) -> None:
    """GPU 1 asks for a reset, GPU 2 failed a row remap, GPU 0 has a link down that its
    peers have up; GPU 3's pending remap is said. NVLink bridges (every GPU with the same
    links down) would not fail: a peer has no more."""
    links = {"links": 18}
    code, out, err = run_check(tmp_path, expected=4, specs=[
        gpu(0, nvlink={"links": 18, "inactive": [5]}),
        gpu(1, nvlink=links, recovery_action=1),
        gpu(2, nvlink=links, remapped_rows={"correctable": 0, "uncorrectable": 3,
                                            "pending": False, "failure": True}),
        gpu(3, nvlink=links, recovery_action=0,
            remapped_rows={"correctable": 1, "uncorrectable": 0, "pending": True,
                           "failure": False})])
    assert code == 1, out + err
    assert out.splitlines() == [
        "FAIL: GPU 1: NVML asks for gpu_reset — reset the GPU (nvidia-smi -r -i <gpu>) once "
        "its processes are stopped; GPU 2: a row remap failed, no spare rows left — replace "
        "the GPU (RMA); GPU 0: 17 of 18 NVLink links active — reset the GPU; if a link "
        "stays down, it needs service; 4 GPU(s); GPU 3: a row remap waits for the next GPU "
        "reset"]
    bridged = {"links": 18, "inactive": list(range(6, 18))}
    code, out, err = run_check(tmp_path, expected=2,
                               specs=[gpu(0, nvlink=bridged), gpu(1, nvlink=bridged)])
    assert (code, out) == (0, "OK: 2 GPU(s)\n"), err


def test_fewer_active_rdma_ports_than_expected_fail_the_node(tmp_path: Path) -> None:
    """Two ports, one polling (no peer): with 2 expected the node fails naming it; without
    an expected count the port is said and the node passes."""
    from test_infiniband import port

    sysfs = tmp_path / "ib"
    port(sysfs, "mlx5_0", 1)
    port(sysfs, "mlx5_1", 1, state="1: DOWN", phys="2: Polling")
    code, out, err = run_check(tmp_path, "--infiniband.sysfs", str(sysfs),
                               "--infiniband.expected-ports", "2")
    assert code == 1, out + err
    assert out.splitlines() == [
        "FAIL: infiniband: 1 of 2 expected ports active: mlx5_1/1 not active (polling: it "
        "sees no peer, the cable or the switch side); 2 GPU(s)"]
    code, out, err = run_check(tmp_path, "--infiniband.sysfs", str(sysfs))
    assert (code, out) == (0, "OK: 2 GPU(s); infiniband: mlx5_1/1 not active (polling: it "
                              "sees no peer, the cable or the switch side)\n"), err


def test_an_adapter_that_never_answers_fails_the_node_in_time(tmp_path: Path) -> None:
    """A counter read that blocks (a FIFO nobody writes, as a wedged adapter's firmware):
    the check still prints its one line and exits 1 within its scrape timeout."""
    import os

    from test_infiniband import port

    sysfs = tmp_path / "ib"
    counter = port(sysfs, "mlx5_0", 1) / "counters" / "link_downed"
    counter.unlink()
    os.mkfifo(counter)
    code, out, err = run_check(tmp_path, "--infiniband.sysfs", str(sysfs),
                               "--scrape.timeout", "1")
    assert code == 1, out + err
    assert out.splitlines() == [
        f"FAIL: infiniband: reading {sysfs} took over 1s (an adapter's firmware not "
        "answering?); 2 GPU(s)"]


def test_missing_gpus_and_a_broken_disk_fail(tmp_path: Path) -> None:
    code, out, _ = run_check(tmp_path, "--disk", f"nvme={tmp_path / 'gone'}", gpus=1,
                             expected=2)
    assert code == 1
    line = out.strip()
    assert line.startswith("FAIL: gpu: 1 of 2 expected GPUs are visible to NVML; "), line
    assert f"disk nvme ({tmp_path / 'gone'}) is not usable: missing" in line


def test_no_driver_where_gpus_are_expected_fails_once_without_a_recheck(
        tmp_path: Path) -> None:
    """A one-shot check asks NVML once: its line does not say "asked again every 10s",
    which the running agent says of the answer it keeps between rechecks."""
    code, out, _ = run_check(tmp_path, errors={"nvmlInit": 12}, expected=8)  # no libnvidia-ml
    assert code == 1
    line = out.strip()
    assert line.startswith("FAIL: gpu: "), line
    assert "asked again" not in line, line


def test_an_unreadable_kernel_log_is_said_not_failed_on(tmp_path: Path) -> None:
    code, out, _ = run_check(tmp_path, "--kmsg", str(tmp_path / "no-such-kmsg"))
    assert code == 0
    assert out.strip() == (f"OK: 2 GPU(s); Xids not checked: {tmp_path / 'no-such-kmsg'} does "
                           "not exist (a container without the host's /dev/kmsg)")


def test_a_bad_flag_or_config_is_unknown_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "node.yml"
    config.write_text(json.dumps({"collectors": {"gpuu": True}}))
    code, out, err = run_check(tmp_path, "--config.file", str(config))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "gpuu" in err, err


def test_the_slurm_healthcheck_drains_with_the_line_and_only_on_exit_1(tmp_path: Path) -> None:
    """deploy/slurm/healthcheck.sh with stand-ins for the check and for scontrol and
    logger (which record their arguments): exit 1 drains with the check's line as the
    reason; 0 does nothing; 2 drains nothing and logs."""
    from conftest import REPO

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for name in ("scontrol", "logger", "hostname"):
        stub = bin_dir / name
        body = 'echo node-7' if name == "hostname" else f'echo "{name} $*" >> {calls}'
        stub.write_text(f"#!/bin/sh\n{body}\n")
        stub.chmod(0o755)
    check = bin_dir / "check"

    def run(code: int, line: str) -> list[str]:
        check.write_text(f"#!/bin/sh\necho 'a warning from python'\necho '{line}'\nexit {code}\n")
        check.chmod(0o755)
        calls.unlink(missing_ok=True)
        result = subprocess.run(["bash", str(REPO / "deploy" / "slurm" / "healthcheck.sh")],
                                env={"PATH": f"{bin_dir}:/usr/bin:/bin",
                                     "COLOSSALAI_EXPORTER": str(check),
                                     "COLOSSALAI_NODE_CONFIG": str(tmp_path / "none.yml")},
                                capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stderr  # never fails slurmd itself
        return calls.read_text().splitlines() if calls.exists() else []

    assert run(0, "OK: 8 GPU(s)") == []
    failed = "FAIL: Xid 79 on GPU 0000:3b:00 since boot: GPU has fallen off the bus"
    assert run(1, failed) == [f"scontrol update nodename=node-7 state=drain reason={failed}",
                              f"logger -t colossalai-healthcheck drained: {failed}"]
    assert run(2, "colossalai-exporter: error: bad flag") == [
        "logger -t colossalai-healthcheck node check could not run (exit 2): "
        "colossalai-exporter: error: bad flag"]
