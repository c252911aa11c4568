"""``colossalai-exporter node check``: the node's health once, as a scheduler asks for it.

Slurm's ``HealthCheckProgram`` and Kubernetes' node-problem-detector (a custom
plugin) run a program and act on its exit code: 0 healthy, 1 not (drain the node,
with the one line printed as the reason), 2 unknown (a bad flag or config). This
runs the node agent's own checks once, on the agent's flags and config file:

* the GPUs: NVML answers within ``--gpu.timeout``, none is lost, and at least
  ``--gpu.expected`` are visible (the gpu collector's verdict); none asks for a
  recovery action, failed a row remap or has fewer NVLink links active than a peer
  GPU of the node (a pending row remap is said, not failed on);
* the watched disks: each path exists, is writable and answers in time (the disk
  collector's);
* the RDMA ports (``--infiniband.sysfs``): fewer active than
  ``--infiniband.expected-ports`` fails the node; a port not active is said;
* the kernel log since boot: an Xid the catalog (node/gpu/xid_catalog.yml) calls
  critical fails the node until it is rebooted (the driver logs every Xid there;
  NVML only tells of new ones); warning-tier Xids are said, not failed on. A log
  this process cannot read (no CAP_SYSLOG) is said, not failed on.

Never waits longer than ``--scrape.timeout`` (for the GPUs, the disks and the RDMA
ports each) plus the kernel log's read.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client.samples import Sample

from colossalai_exporter.flags import ArgumentParser
from colossalai_exporter.node.base import CollectorError
from colossalai_exporter.node.config import NodeConfig, add_node_flags, load_config
from colossalai_exporter.node.gpu import xid
from colossalai_exporter.node.gpu.health import RECOVERY_ACTION_WORDS
from colossalai_exporter.node.kmsg import KernelRecords

HEALTHY, UNHEALTHY = 0, 1


@dataclass
class Verdict:
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        """The one line a scheduler keeps (Slurm's drain reason, NPD's message)."""
        if self.failures:
            return "FAIL: " + "; ".join(self.failures + self.notes)
        return "OK" + (": " + "; ".join(self.notes) if self.notes else "")


def check_gpus(config: NodeConfig, verdict: Verdict) -> None:
    from colossalai_exporter.node.gpu import GpuCollector

    # One answer, no recheck: a one-shot check asks once (and says nothing of "again").
    collector = GpuCollector(timeout=config.gpu_timeout, expected=config.gpu_expected,
                             no_driver_recheck=0)
    try:
        families = collector.collect(time.monotonic() + config.gpu_timeout)
    except CollectorError as exc:
        verdict.failures.append(f"gpu: {exc.message}")
        return
    finally:
        collector.close()
    devices = next((s.value for f in families for s in f.samples
                    if s.name == "colossalai_gpu_devices"), 0)
    verdict.notes.append(f"{devices:.0f} GPU(s)")
    check_gpu_health([s for f in families for s in f.samples], verdict)


def check_gpu_health(samples: Sequence[Sample], verdict: Verdict) -> None:
    """What NVML says of each GPU, as GPURecoveryActionRequired, GPURowRemapFailure and
    GPUNVLinkDown page it; a one-off check has no history, so an NVLink counts as down
    only against a peer GPU of the node with more links active."""
    def values(name: str) -> list[Sample]:
        return [s for s in samples if s.name == name]

    for sample in values("colossalai_gpu_recovery_action_info"):
        action = sample.labels["action"]
        if action != "none":
            words = RECOVERY_ACTION_WORDS.get(action, "see NVIDIA's documentation of it")
            verdict.failures.append(f"GPU {sample.labels['gpu']}: NVML asks for {action} — "
                                    f"{words}")
    for sample in values("colossalai_gpu_row_remap_failed"):
        if sample.value == 1:
            verdict.failures.append(f"GPU {sample.labels['gpu']}: a row remap failed, no "
                                    "spare rows left — replace the GPU (RMA)")
    links = {s.labels["gpu"]: s.value for s in values("colossalai_gpu_nvlink_links")}
    active = values("colossalai_gpu_nvlink_links_active")
    best = max((s.value for s in active), default=0.0)
    for sample in active:
        if sample.value < best:
            gpu = sample.labels["gpu"]
            verdict.failures.append(
                f"GPU {gpu}: {sample.value:.0f} of {links.get(gpu, best):.0f} NVLink links "
                "active — reset the GPU; if a link stays down, it needs service")
    for sample in values("colossalai_gpu_row_remap_pending"):
        if sample.value == 1:
            verdict.notes.append(f"GPU {sample.labels['gpu']}: a row remap waits for the "
                                 "next GPU reset")


def check_disks(config: NodeConfig, verdict: Verdict) -> None:
    if not config.disks:
        return
    from colossalai_exporter.node.disk import DiskCollector

    collector = DiskCollector(config.disks)
    try:
        collector.collect(time.monotonic() + config.scrape_timeout)
        problems = collector.problems()
    finally:
        collector.close()
    verdict.failures += [f"disk {problem['message']}" for problem in problems]


def check_infiniband(config: NodeConfig, expected: int, verdict: Verdict) -> None:
    """The RDMA ports: fewer active than ``expected`` fails the node (0: not checked, as
    a port never cabled is no failure of its own); each port that is not active is said."""
    from concurrent.futures import TimeoutError as FutureTimeout

    from colossalai_exporter.node.blocking import BlockingCalls
    from colossalai_exporter.node.infiniband import PHYSICAL_WORDS, read_ports

    # A counter read asks the adapter's firmware, and a wedged adapter never answers:
    # read on a daemon thread, so the check still prints its line and exits in time.
    calls = BlockingCalls("infiniband-check", max_threads=1)
    try:
        ports = calls.submit(read_ports, config.infiniband_sysfs).result(
            timeout=config.scrape_timeout)
    except FutureTimeout:
        verdict.failures.append(f"infiniband: reading {config.infiniband_sysfs} took over "
                                f"{config.scrape_timeout:g}s (an adapter's firmware not "
                                "answering?)")
        return
    finally:
        calls.shutdown()
    active = [p for p in ports if p.state is not None and p.state >= 4]
    down = [f"{p.device}/{p.port} not active"
            + (f" ({PHYSICAL_WORDS[p.phys_state]})" if p.phys_state in PHYSICAL_WORDS else "")
            for p in ports if p not in active]
    if expected and len(active) < expected:
        verdict.failures.append(f"infiniband: {len(active)} of {expected} expected ports "
                                f"active" + (": " + ", ".join(down) if down else ""))
    elif down:
        verdict.notes.append("infiniband: " + ", ".join(down))


def check_kernel_xids(kmsg: str, verdict: Verdict) -> None:
    log = KernelRecords(kmsg)
    try:
        seen = xid.kernel_xids(log.poll())
    finally:
        log.close()
    if not log.readable:
        verdict.notes.append(f"Xids not checked: {log.problem}")
        return
    words = xid.actions()
    reported: set[tuple[str, int]] = set()
    for event in seen:
        if (event.pci, event.code) in reported:
            continue
        reported.add((event.pci, event.code))
        kind = xid.classify(event.code)
        text = (f"Xid {event.code} on GPU {event.pci} since boot: {kind.what} — "
                f"{words[kind.action]}")
        if kind.tier == "critical":
            verdict.failures.append(text)
        elif kind.tier in ("warning", "unknown"):
            verdict.notes.append(text)


def main(argv: Sequence[str]) -> int:
    parser = ArgumentParser(
        prog="colossalai-exporter node check",
        description="Check this node's GPUs, watched disks and kernel-logged Xids once, "
                    "with the node agent's flags and config file; print one line and exit "
                    "0 (healthy), 1 (drain it: the line says why) or 2 (bad flag or config). "
                    "For Slurm's HealthCheckProgram and node-problem-detector.")
    parser.add_argument("--config.file", dest="config_file", default=None, metavar="PATH",
                        help="the node agent's YAML config file")
    parser.add_argument("--kmsg", default="/dev/kmsg", metavar="PATH",
                        help="the kernel log to read Xids from (default /dev/kmsg; needs "
                             "CAP_SYSLOG)")
    parser.add_argument("--infiniband.expected-ports", dest="infiniband_expected", type=int,
                        default=0, metavar="N",
                        help="fewer active RDMA ports than N fails the node (default 0: not "
                             "checked; ports not active are said)")
    add_node_flags(parser)
    args = parser.parse_args(list(argv))
    config = load_config(args)
    verdict = Verdict()
    if config.collectors["gpu"]:
        check_gpus(config, verdict)
    if config.collectors["disk"]:
        check_disks(config, verdict)
    if config.collectors["infiniband"]:
        check_infiniband(config, args.infiniband_expected, verdict)
    check_kernel_xids(args.kmsg, verdict)
    print(verdict.line(), flush=True)
    return UNHEALTHY if verdict.failures else HEALTHY


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
