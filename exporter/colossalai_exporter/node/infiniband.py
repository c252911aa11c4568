"""InfiniBand and RoCE ports, from sysfs: what a fabric failure looks like on the node.

Each port of each RDMA device, ``/sys/class/infiniband/<device>/ports/<port>/``:

* ``state`` (``4: ACTIVE``) and ``phys_state`` (``5: LinkUp``; ``2: Polling`` is a
  port that lost its peer: the cable or the switch side);
* ``rate`` (``400 Gb/sec (4X NDR)``) and ``link_layer`` (``InfiniBand``, or
  ``Ethernet`` for RoCE);
* ``counters/link_downed`` (the link went down: each increase is a drop or a flap),
  ``counters/link_error_recovery`` and ``counters/symbol_error`` (bit errors on the
  wire, the BER the fabric's health tools threshold);
* ``hw_counters/`` (the adapter's transport counters, mlx5 and others): the ones that
  say the transport gave up or keeps retrying (``HW_ERRORS``): a peer that stopped
  acknowledging, a lossy RoCE fabric (PFC off, a congested switch) while every link
  is up, which ends in NCCL's timeouts;
* for a RoCE port (``link_layer`` Ethernet), its network interface's
  ``/sys/class/net/<if>/carrier_changes``: an Ethernet link's flaps, which
  ``link_downed`` does not count there (two changes a flap). The interface is the
  one ``ports/<port>/gid_attrs/ndevs/0`` names, else the adapter's only one
  (``<device>/device/net/``).

The names and values of ``state``, ``phys_state``, ``rate`` and ``counters/`` are
node_exporter's ``infiniband`` collector's (``node_infiniband_state_id`` …) under
this project's prefix, so that the rules read
either (rulesgen/fabric.py): a site that runs node_exporter's collector may switch
this one off (``--no-collector.infiniband``), and one that runs both pages once. It is
here because the page must name the ranks on the node, which the agent knows, and
because a site may not run node_exporter at all.

The files are the driver's, but reading a counter asks the adapter's firmware: a
wedged adapter, the failure this watches for, can make the read wait. So the reads
run on the agent's file-system threads, and a scrape waits for them only until its
deadline.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from colossalai_exporter import catalogue
from colossalai_exporter.node.base import READY, CollectorError, FuturePending, Pending
from colossalai_exporter.node.blocking import BlockingCalls

if TYPE_CHECKING:
    from prometheus_client.core import Metric as MetricFamily

    from colossalai_exporter.node.collectors import Built
    from colossalai_exporter.node.config import NodeConfig

SYSFS = "/sys/class/infiniband"
#: counters/<file> -> the metric counting it
COUNTERS = {
    "link_downed": "colossalai_infiniband_link_downed_total",
    "link_error_recovery": "colossalai_infiniband_link_error_recovery_total",
    "symbol_error": "colossalai_infiniband_symbol_error_total",
}
#: hw_counters/<file> the agent serves, as colossalai_infiniband_hw_errors_total{kind}:
#: the transport's retries and give-ups (NVSentinel fails a node on any increase of
#: rnr_nak_retry_err; local_ack_timeout_err and out_of_sequence are a lossy fabric's)
HW_ERRORS = ("local_ack_timeout_err", "rnr_nak_retry_err", "req_transport_retries_exceeded",
             "packet_seq_err", "out_of_sequence", "roce_slow_restart")
#: the physical states (IBTA PortPhysicalState) a port that is not active may be in, in
#: words (the pages' and `node check`'s)
PHYSICAL_WORDS = {
    1: "sleeping",
    2: "polling: it sees no peer, the cable or the switch side",
    3: "disabled",
    4: "training its link",
    5: "link up but not active: the subnet manager has not brought it up",
    6: "in link error recovery",
    7: "in a physical test",
}
_RATE = re.compile(r"^\s*([0-9.]+)\s*Gb/sec")


@dataclass(frozen=True)
class PortReading:
    device: str
    port: str
    link_layer: str
    state: int | None
    phys_state: int | None
    rate_bytes_per_second: float | None
    counters: dict[str, int] = field(default_factory=dict)
    hw_errors: dict[str, int] = field(default_factory=dict)
    #: the RoCE port's network interface's carrier changes (None: not RoCE, or unread)
    carrier_changes: int | None = None


def _text(path: Path) -> str | None:
    # os.read of the raw bytes: a scrape reads a dozen small files a port, and
    # Path.read_text's text-file machinery costs several times the read itself.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 256).decode("ascii", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)


def _state_id(text: str | None) -> int | None:
    """``4: ACTIVE`` -> 4."""
    if not text:
        return None
    number = text.split(":", 1)[0].strip()
    return int(number) if number.isdigit() else None


def _rate(text: str | None) -> float | None:
    """``400 Gb/sec (4X NDR)`` -> bytes a second, as node_exporter reports it."""
    match = _RATE.match(text or "")
    return float(match[1]) * 1e9 / 8 if match else None


def _numbers(directory: Path, names: tuple[str, ...] | dict[str, str]) -> dict[str, int]:
    found: dict[str, int] = {}
    if not directory.is_dir():  # one stat, not a failed open a file (no hw_counters/)
        return found
    for name in names:
        value = _text(directory / name)
        if value is not None and value.isdigit():
            found[name] = int(value)
    return found


def _netdev(device: Path, port: Path) -> str | None:
    """The network interface of a RoCE port (module docstring)."""
    name = _text(port / "gid_attrs" / "ndevs" / "0")
    if name:
        return name
    try:
        interfaces = [p.name for p in (device / "device" / "net").iterdir()]
    except OSError:
        return None
    return interfaces[0] if len(interfaces) == 1 else None


def _carrier_changes(net_root: Path, device: Path, port: Path) -> int | None:
    interface = _netdev(device, port)
    if interface is None or "/" in interface:
        return None
    value = _text(net_root / interface / "carrier_changes")
    return int(value) if value is not None and value.isdigit() else None


def read_ports(root: str | Path = SYSFS) -> list[PortReading]:
    """Every port of every RDMA device under ``root``; none where there is no such
    directory (a node without RDMA adapters). A RoCE port's interface is read from the
    ``net`` class beside ``root`` (/sys/class/net)."""
    base = Path(root)
    net_root = base.parent / "net"
    ports: list[PortReading] = []
    try:
        devices = sorted(p for p in base.iterdir() if p.is_dir())
    except OSError:
        return ports
    for device in devices:
        try:
            port_dirs = sorted((device / "ports").iterdir(), key=lambda p: p.name)
        except OSError:
            continue
        for port in port_dirs:
            link_layer = _text(port / "link_layer") or "InfiniBand"
            ports.append(PortReading(
                device=device.name, port=port.name, link_layer=link_layer,
                state=_state_id(_text(port / "state")),
                phys_state=_state_id(_text(port / "phys_state")),
                rate_bytes_per_second=_rate(_text(port / "rate")),
                counters=_numbers(port / "counters", COUNTERS),
                hw_errors=_numbers(port / "hw_counters", HW_ERRORS),
                carrier_changes=(_carrier_changes(net_root, device, port)
                                 if link_layer == "Ethernet" else None)))
    return ports


def port_families(ports: list[PortReading]) -> list[MetricFamily]:
    info = catalogue.info("colossalai_infiniband_port_info")
    state = catalogue.gauge("colossalai_infiniband_state_id")
    phys = catalogue.gauge("colossalai_infiniband_physical_state_id")
    rate = catalogue.gauge("colossalai_infiniband_rate_bytes_per_second")
    counters = {name: catalogue.counter(metric) for name, metric in COUNTERS.items()}
    hw_errors = catalogue.counter("colossalai_infiniband_hw_errors_total")
    carrier = catalogue.counter("colossalai_infiniband_carrier_changes_total")
    for port in ports:
        labels = [port.device, port.port]
        info.add_metric(labels, {"link_layer": port.link_layer})
        if port.state is not None:
            state.add_metric(labels, port.state)
        if port.phys_state is not None:
            phys.add_metric(labels, port.phys_state)
        if port.rate_bytes_per_second is not None:
            rate.add_metric(labels, port.rate_bytes_per_second)
        for name, value in port.counters.items():
            counters[name].add_metric(labels, value)
        for name, value in port.hw_errors.items():
            hw_errors.add_metric([*labels, name], value)
        if port.carrier_changes is not None:
            carrier.add_metric(labels, port.carrier_changes)
    return [info, state, phys, rate, *counters.values(), hw_errors, carrier]


@dataclass
class _Read(FuturePending):
    future: Future[list[PortReading]]
    start: float


class InfinibandCollector:
    """Implements :class:`~colossalai_exporter.node.base.NodeCollector`."""

    name = "infiniband"
    reasons: tuple[str, ...] = ("timeout",)

    def __init__(self, root: str | Path = SYSFS, *, calls: BlockingCalls | None = None,
                 timeout: float = 2.0) -> None:
        self.root = Path(root)
        self.timeout = timeout
        self._own_calls = calls is None
        self._calls = calls or BlockingCalls("infiniband", max_threads=1)
        self._reading: Future[list[PortReading]] | None = None

    def begin(self, deadline: float) -> Pending:
        # A node without RDMA adapters (most CPU and inference nodes): nothing to read,
        # and no hand-over to a thread. The directory is the kernel's: a stat of it
        # cannot hang as a counter read can.
        if not self.root.is_dir():
            return READY
        # A read still running (a wedged adapter) is waited for again, not doubled.
        if self._reading is None or self._reading.done():
            self._reading = self._calls.submit(read_ports, self.root)
        return _Read(self._reading, time.monotonic())

    def collect(self, deadline: float, pending: Pending | None = None) -> list[MetricFamily]:
        read = pending if pending is not None else self.begin(deadline)
        if not isinstance(read, _Read):
            return port_families([])
        budget = max(0.01, min(self.timeout, deadline - read.start))
        try:
            ports = read.future.result(timeout=max(0.0, read.start + budget - time.monotonic()))
        except FutureTimeout:
            self._calls.separate([read.future])
            raise CollectorError("timeout", f"reading {self.root} took over {budget:.2g}s "
                                            "(an adapter's firmware not answering?)") from None
        return port_families(ports)

    def close(self) -> None:
        if self._own_calls:
            self._calls.shutdown()


def from_config(config: NodeConfig, built: Built) -> InfinibandCollector:
    """The registry's factory (node/collectors.py)."""
    return InfinibandCollector(config.infiniband_sysfs, calls=built.fs_calls)
