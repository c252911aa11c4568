"""The infiniband collector on sysfs trees laid out as the kernel's
/sys/class/infiniband (an mlx5 adapter's files, as node_exporter's fixtures and gpud's
testdata have them): an active port, a port that dropped, a RoCE port, a node without
RDMA, and an adapter whose counter read never returns."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from colossalai_exporter.node.base import CollectorError
from colossalai_exporter.node.infiniband import InfinibandCollector, read_ports
from conftest import require_binary
from gpu_helpers import exposition


def port(root: Path, device: str, number: int, *, state: str = "4: ACTIVE",
         phys: str = "5: LinkUp", rate: str = "400 Gb/sec (4X NDR)",
         link_layer: str = "InfiniBand", **counters: int) -> Path:
    path = root / device / "ports" / str(number)
    (path / "counters").mkdir(parents=True)
    (path / "state").write_text(state + "\n")
    (path / "phys_state").write_text(phys + "\n")
    (path / "rate").write_text(rate + "\n")
    (path / "link_layer").write_text(link_layer + "\n")
    for name in ("link_downed", "link_error_recovery", "symbol_error"):
        (path / "counters" / name).write_text(f"{counters.get(name, 0)}\n")
    return path


def collect(collector: InfinibandCollector) -> dict[tuple[str, tuple[str, ...]], float]:
    families = collector.collect(time.monotonic() + 5)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in families for s in f.samples}


def collect_linted(root: Path) -> dict[tuple[str, tuple[str, ...]], float]:
    """What a collector of ``root`` serves, after ``promtool check metrics`` passed on it."""
    collector = InfinibandCollector(root)
    try:
        got = collect(collector)
        text = exposition(list(collector.collect(time.monotonic() + 5)))
    finally:
        collector.close()
    lint = subprocess.run([require_binary("promtool"), "check", "metrics"], input=text,
                          capture_output=True, text=True, timeout=30, check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    return got


def labels(device: str, port_: str = "1", **more: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"device": device, "port": port_, **more}.items()))


def test_ports_their_state_rate_and_counters(tmp_path: Path) -> None:
    port(tmp_path, "mlx5_0", 1, symbol_error=3)
    port(tmp_path, "mlx5_1", 1, state="1: DOWN", phys="2: Polling", link_downed=2)
    port(tmp_path, "mlx5_bond_0", 1, rate="200 Gb/sec (4X HDR)", link_layer="Ethernet")
    got = collect_linted(tmp_path)
    assert got[("colossalai_infiniband_state_id", labels("mlx5_0"))] == 4
    assert got[("colossalai_infiniband_state_id", labels("mlx5_1"))] == 1
    assert got[("colossalai_infiniband_physical_state_id", labels("mlx5_1"))] == 2
    assert got[("colossalai_infiniband_rate_bytes_per_second", labels("mlx5_0"))] == 50e9
    assert got[("colossalai_infiniband_link_downed_total", labels("mlx5_1"))] == 2
    assert got[("colossalai_infiniband_symbol_error_total", labels("mlx5_0"))] == 3
    assert got[("colossalai_infiniband_port_info",
                labels("mlx5_bond_0", link_layer="Ethernet"))] == 1
    assert got[("colossalai_infiniband_port_info",
                labels("mlx5_0", link_layer="InfiniBand"))] == 1


def roce_port(root: Path, device: str, interface: str, *, carrier_changes: int,
              by_gid: bool = True, **hw_errors: int) -> Path:
    """A RoCE port as mlx5 lays it out: link layer Ethernet, counters/ as on InfiniBand,
    hw_counters/ with the transport's counters, and its network interface named by the
    first GID's ndev (``by_gid``) or as the PCI function's only interface."""
    path = port(root, device, 1, rate="200 Gb/sec (4X HDR)", link_layer="Ethernet")
    (path / "hw_counters").mkdir()
    for name in ("local_ack_timeout_err", "rnr_nak_retry_err", "out_of_sequence",
                 "np_cnp_sent", "rx_write_requests"):
        (path / "hw_counters" / name).write_text(f"{hw_errors.get(name, 0)}\n")
    if by_gid:
        (path / "gid_attrs" / "ndevs").mkdir(parents=True)
        (path / "gid_attrs" / "ndevs" / "0").write_text(interface + "\n")
    else:
        (root / device / "device" / "net" / interface).mkdir(parents=True)
    net = root.parent / "net" / interface
    net.mkdir(parents=True)
    (net / "carrier_changes").write_text(f"{carrier_changes}\n")
    return path


def test_a_roce_port_serves_its_transport_errors_and_its_interfaces_flaps(
        tmp_path: Path) -> None:
    sysfs = tmp_path / "infiniband"
    roce_port(sysfs, "mlx5_2", "ens3np0", carrier_changes=7, local_ack_timeout_err=12,
              rnr_nak_retry_err=1)
    roce_port(sysfs, "mlx5_3", "ens4np0", carrier_changes=2, by_gid=False)
    port(sysfs, "mlx5_0", 1)  # InfiniBand: no interface to read
    got = collect_linted(sysfs)
    errors = "colossalai_infiniband_hw_errors_total"
    assert got[(errors, labels("mlx5_2", kind="local_ack_timeout_err"))] == 12
    assert got[(errors, labels("mlx5_2", kind="rnr_nak_retry_err"))] == 1
    assert got[(errors, labels("mlx5_2", kind="out_of_sequence"))] == 0
    # only the error counters, not the adapter's traffic or congestion notifications
    assert not [k for k in got if k[0] == errors and dict(k[1])["kind"] in
                ("np_cnp_sent", "rx_write_requests")]
    carrier = "colossalai_infiniband_carrier_changes_total"
    assert got[(carrier, labels("mlx5_2"))] == 7
    assert got[(carrier, labels("mlx5_3"))] == 2
    assert not [k for k in got if k[0] == carrier and dict(k[1])["device"] == "mlx5_0"]


def test_a_node_without_rdma_serves_no_port_and_does_not_fail(tmp_path: Path) -> None:
    collector = InfinibandCollector(tmp_path / "absent")
    try:
        assert not [s for f in collector.collect(time.monotonic() + 5) for s in f.samples]
    finally:
        collector.close()


def test_a_missing_file_leaves_out_that_value_only(tmp_path: Path) -> None:
    path = port(tmp_path, "mlx5_0", 1)
    (path / "rate").unlink()
    (path / "counters" / "symbol_error").unlink()
    ports = read_ports(tmp_path)
    assert [(p.state, p.rate_bytes_per_second, sorted(p.counters)) for p in ports] == [
        (4, None, ["link_downed", "link_error_recovery"])]


def test_a_counter_read_that_never_returns_fails_the_scrape_in_time(tmp_path: Path) -> None:
    """A wedged adapter: reading its counter blocks (here a FIFO nobody writes). The
    scrape fails with reason timeout by its deadline; the next one waits for the same
    read rather than starting another."""
    path = port(tmp_path, "mlx5_0", 1)
    fifo = path / "counters" / "link_downed"
    fifo.unlink()
    os.mkfifo(fifo)
    collector = InfinibandCollector(tmp_path, timeout=0.5)
    try:
        with pytest.raises(CollectorError) as err:
            collector.collect(time.monotonic() + 5)
        assert err.value.reason == "timeout"
        first = collector._reading
        with pytest.raises(CollectorError):
            collector.collect(time.monotonic() + 5)
        assert collector._reading is first
    finally:
        # Release the blocked read (a writer opens the FIFO and writes a count).
        threading.Thread(target=lambda: fifo.write_text("0\n"), daemon=True).start()
        collector.close()
