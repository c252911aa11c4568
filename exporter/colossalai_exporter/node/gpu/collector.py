"""The gpu collector: per-GPU memory, utilization, temperature, power, ECC and Xid.

NVML runs in a :class:`~colossalai_exporter.node.gpu.worker.Worker` process.
A scrape asks it for one reading and waits at most until its deadline (and at
most ``timeout`` seconds). If no answer comes, the scrape fails with reason
``timeout``, the worker is killed, and a fresh one is started at once, so the
next scrape does not queue behind a call that may never return. See
``docs/gpu.md`` for the whole design.

No NVIDIA driver (reason ``no_driver``) is a node without GPUs, not a
failure, where nothing says a GPU should be there: ``expected`` unset or 0, no
``/dev/nvidia0``-style device node (the driver creates one per GPU), and no GPU
seen since the collector started. The collector then serves
``colossalai_gpu_devices 0`` and is up, so a CPU-only node does not page.
Anywhere else no driver is a failure, as a broken driver on a GPU node is.

Example::

    collector = GpuCollector(timeout=5.0, expected=8)
    try:
        families = collector.collect(time.monotonic() + 5.0)
    except CollectorError as exc:
        print(exc.reason, exc.message)  # e.g. "no_driver no NVIDIA driver found (…)"
    finally:
        collector.close()
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import subprocess
import threading
import time
from typing import TYPE_CHECKING, cast

from prometheus_client.core import Metric as MetricFamily

from colossalai_exporter import catalogue
from colossalai_exporter.node.base import READY, CollectorError, LoopWaker
from colossalai_exporter.node.gpu import xid
from colossalai_exporter.node.gpu.health import health_families
from colossalai_exporter.node.gpu.protocol import (
    MISSING_GPUS,
    NO_DRIVER,
    NVML_ERROR,
    REASONS,
    TIMEOUT,
    WORKER_DIED,
    GpuReading,
    Reading,
    XidEvent,
)
from colossalai_exporter.node.gpu.worker import Worker
from colossalai_exporter.node.gpu.xid_history import XidBoots, current_boot_id

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from colossalai_exporter.node.base import Pending
    from colossalai_exporter.node.collectors import Built
    from colossalai_exporter.node.config import NodeConfig
    from colossalai_exporter.node.ranks import RanksCollector


# How soon a scrape waiting on the event loop looks again at a pipe it could not read.
RETRY_SECONDS = 0.002
# The device nodes the NVIDIA driver creates, one per GPU (/dev/nvidia0, …); not
# nvidiactl, nvidia-uvm or nvidia-caps, which say nothing about how many GPUs.
GPU_DEVICE_NODE = re.compile(r"nvidia[0-9]")

#: how long a rank seen on a GPU is still named for it (GPUXidCritical's window)
GPU_RANK_MEMORY_SECONDS = 3600.0


class _Request:
    """A scrape's request to the NVML worker (a Pending); ``answer`` once it is in.

    The agent's event loop watches the worker's pipe and takes the answer as soon
    as it arrives, so ``collect`` then only builds the families.
    """

    __slots__ = ("answer", "collector", "request_id", "worker")

    def __init__(self, collector: GpuCollector, worker: Worker, request_id: int | None) -> None:
        self.collector = collector
        self.worker = worker
        self.request_id = request_id
        self.answer: Reading | None = None

    def ready(self) -> bool:
        return self.collector._take_answer(self)

    def watch(self, loop: asyncio.AbstractEventLoop,
              wake: Callable[[], None]) -> Callable[[], None]:
        fd = self.worker.conn.fileno()
        retry: asyncio.TimerHandle | None = None
        stopped = False
        # The answer may be received by another scrape's thread, from a pipe this
        # loop then never sees readable again: that thread wakes the loop too.
        answered = LoopWaker(loop, wake)
        self.collector._on_answer.add(answered)

        def readable() -> None:
            nonlocal retry
            retry = None
            if self.collector._take_answer(self):
                loop.remove_reader(fd)
            elif self._still_readable():
                # Something this scrape cannot receive now: another scrape's thread
                # is receiving (it shares the answer), or the EOF of a dead worker.
                # The fd is level-triggered and would wake the loop on every turn:
                # look again shortly instead.
                loop.remove_reader(fd)
                retry = loop.call_later(RETRY_SECONDS, rewatch)
            wake()

        def rewatch() -> None:
            if not stopped:
                loop.add_reader(fd, readable)
                readable()

        def stop() -> None:
            nonlocal stopped
            stopped = True
            answered.stop()
            self.collector._on_answer.discard(answered)
            if retry is not None:
                retry.cancel()
            loop.remove_reader(fd)

        loop.add_reader(fd, readable)
        return stop

    def _still_readable(self) -> bool:
        # Not the worker's own poll object: a scrape thread may be blocked in it
        # (outside the collector's lock, this runs beside that thread).
        poller = select.poll()
        try:
            poller.register(self.worker.conn.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True


class GpuCollector:
    """NVML through a worker process with a deadline; implements ``NodeCollector``.

    :param timeout: the most one scrape waits for NVML, in seconds (the
        agent's own deadline may cut it shorter).
    :param expected: GPUs this node must have (``--gpu.expected``); fewer
        visible is a failure with reason ``missing_gpus`` that still carries
        the visible GPUs' series. ``None``: at least one GPU is expected where
        the NVIDIA driver is loaded. ``None`` or 0: no driver is a node
        without GPUs (``colossalai_gpu_devices 0``, up) unless ``dev_root``
        holds a GPU's device node or a GPU was seen earlier; 1 or more: no
        driver is a failure.
    :param init_timeout: how long a *starting* worker may take to initialise
        NVML before it is treated as stuck (``nvmlInit`` can take seconds per
        GPU without persistence mode). Scrapes meanwhile fail with ``timeout``
        after their own deadline but do not replace the worker.
    :param max_stuck_workers: killed workers that have not exited yet (stuck in
        an uninterruptible driver call) beyond which no new worker is started.
    :param no_driver_recheck: seconds for which a ``no_driver`` answer stands
        before the worker is asked again. A node without NVIDIA's library or
        kernel module stays so until someone installs or loads it, and asking
        on every scrape would cost each scrape a round trip to the worker
        (about a third of a scrape on a 2-core machine, bench/RESULTS.md);
        0 asks every time.
    :param dev_root: where the NVIDIA driver's device nodes are (``/dev``);
        read only when NVML says there is no driver.

    The worker is started by the constructor, without waiting for it.
    """

    name = "gpu"
    reasons: tuple[str, ...] = REASONS

    def __init__(self, timeout: float = 5.0, expected: int | None = None,
                 init_timeout: float = 30.0,
                 max_stuck_workers: int = 3, worker: Worker | None = None,
                 no_driver_recheck: float = 10.0,
                 dev_root: str | os.PathLike[str] = "/dev",
                 local_ranks: Callable[[], dict[int, int]] | None = None,
                 xid_boots: XidBoots | None = None) -> None:
        """``worker``: one already started (the agent starts it before it imports the
        rest, to boot meanwhile); by default the collector starts its own.
        ``local_ranks``: pid -> training rank of the node's live ranks (the ranks
        collector's), to tell which ranks run on which GPU."""
        if not timeout > 0:
            raise ValueError(f"gpu timeout must be positive, got {timeout!r}")
        if expected is not None and expected < 0:
            raise ValueError(f"expected GPU count must be 0 or more, got {expected!r}")
        self.timeout = timeout
        self.expected = expected
        self.init_timeout = max(init_timeout, timeout)
        self.max_stuck_workers = max_stuck_workers
        self.no_driver_recheck = no_driver_recheck
        self.dev_root = os.fspath(dev_root)
        # (until, message, whether a GPU is expected) of the last no_driver answer,
        # while it stands.
        self._no_driver: tuple[float, str, bool] | None = None
        # Whether a reading ever had a GPU: a driver that vanishes afterwards is
        # broken, not absent.
        self._seen_gpus = False
        # The last answer, with the worker and the request it answered.
        self._answered: tuple[Worker, int, Reading] | None = None
        # Scrapes on an event loop waiting for an answer (see _Request.watch).
        self._on_answer: set[LoopWaker] = set()
        self._lock = threading.Lock()
        self._worker: Worker | None = None
        self._stuck: list[Worker] = []
        self._closed = False
        # Xid history lives here, not in the worker: it survives worker restarts.
        self._xid_codes: dict[tuple[int, int], int] = {}  # (gpu, code) -> events
        self._local_ranks = local_ranks
        # (gpu, rank) -> when a reading last found the rank's process on the GPU
        self._gpu_ranks: dict[tuple[int, int], float] = {}
        self._last_xid: dict[int, XidEvent] = {}
        # In which boots each GPU's codes were seen (by UUID), and each index's UUID as the
        # last reading that had it said (a GPU lost since keeps its last one).
        self._xid_boots = xid_boots or XidBoots(None, current_boot_id())
        self._uuids: dict[int, str] = {}
        if worker is not None:
            self._worker = worker
        else:
            self._start_worker()

    # -- NodeCollector -------------------------------------------------------
    def begin(self, deadline: float) -> Pending | None:
        """Ask the worker for a reading now, so NVML works while other collectors run."""
        if self._known_no_driver() is not None:
            return READY
        if not self._lock.acquire(blocking=False):
            # Another scrape is waiting for the worker: its request, asked for after
            # this scrape began, is as fresh as a new one, and its answer is shared.
            worker = self._worker
            asked = None if worker is None else worker.pending
            return None if worker is None or asked is None else _Request(self, worker, asked)
        try:
            worker = self._worker
            if worker is None or self._closed:
                return None
            while worker.readable(0):
                self._receive(worker)  # answers to scrapes that gave up: stale
            if worker.pending is None:
                worker.request()
            return _Request(self, worker, worker.pending)
        except (EOFError, OSError):
            return None  # a dead worker: collect() finds it, replaces it and says so
        finally:
            self._lock.release()

    def collect(self, deadline: float, pending: Pending | None = None) -> list[MetricFamily]:
        """Fresh GPU families, or CollectorError, returning before ``deadline``.

        The Xid events counted so far are served either way: a GPU that fell off the
        bus (Xid 79) fails every sample after it, and its page must not resolve for
        that."""
        try:
            families = self._collect(deadline, pending)
        except CollectorError as exc:
            exc.families.extend(self._history())
            raise
        return [*families, *self._history()]

    def _collect(self, deadline: float, pending: Pending | None) -> list[MetricFamily]:
        known = self._known_no_driver()
        if known is not None:
            return self._without_driver(*known)
        request = pending if isinstance(pending, _Request) else None
        if request is not None and request.answer is not None:
            return self._families(request.answer)  # taken while the agent's loop waited
        now = time.monotonic()
        end = min(deadline, now + self.timeout)
        # Concurrent scrapes take turns; none waits past its own deadline.
        if not self._lock.acquire(timeout=max(0.0, end - now)):
            raise CollectorError(TIMEOUT, "another scrape is still waiting for NVML")
        try:
            reading = self._sample(end, None if request is None else request.request_id)
        finally:
            self._lock.release()
        return self._families(reading)

    def _take_answer(self, request: _Request) -> bool:
        """Receive what the worker has sent, never waiting; True once ``request``'s
        answer is in (``request.answer``)."""
        if request.answer is not None:
            return True
        answered = self._answered
        if answered is not None and answered[:2] == (request.worker, request.request_id):
            request.answer = answered[2]  # received by another scrape's thread
            return True
        if not self._lock.acquire(blocking=False):
            return False  # another scrape is receiving; it will share the answer
        try:
            worker = self._worker
            if worker is not request.worker or self._closed:
                return False
            while worker.readable(0):
                asked = worker.pending
                answer = self._receive(worker)
                if answer is not None and asked == request.request_id:
                    request.answer = answer
                    return True
            return False
        except (EOFError, OSError):
            return False  # a dead worker: collect() finds it, replaces it and says so
        finally:
            self._lock.release()

    def close(self) -> None:
        """Stop the worker and kill any stuck ones."""
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()
        for stuck in self._stuck:
            stuck.kill()
        for stuck in self._stuck:
            # Reap what dies at once; one stuck in the driver is left to init.
            with contextlib.suppress(subprocess.TimeoutExpired):
                stuck.process.wait(0.1)
        self._stuck = []

    # -- talking to the worker ------------------------------------------------
    def _start_worker(self) -> Worker | None:
        self._stuck = [w for w in self._stuck if not w.reaped()]
        if self._closed or len(self._stuck) >= self.max_stuck_workers:
            return None
        self._worker = Worker()
        return self._worker

    def _sample(self, end: float, begun: int | None) -> Reading:
        if self._closed:
            raise CollectorError(NVML_ERROR, "the gpu collector is closed")
        worker = self._worker or self._start_worker()
        if worker is None:
            raise CollectorError(TIMEOUT, f"{len(self._stuck)} NVML workers are stuck in the "
                                          "driver and could not be killed; not starting another")
        answered = self._answered
        if begun is not None and answered is not None and answered[:2] == (worker, begun):
            return answered[2]  # received meanwhile, by the loop or another scrape
        try:
            # Answers already waiting were asked for by a scrape that gave up:
            # their Xid events count, their values are stale; except the answer
            # to what this scrape's begin() asked for.
            while worker.readable(0):
                asked = worker.pending
                answer = self._receive(worker)
                if answer is not None and asked is not None and asked == begun:
                    return answer
            if worker.pending is None:
                worker.request()
            while True:
                remaining = end - time.monotonic()
                if remaining <= 0 or not worker.readable(remaining):
                    raise self._timed_out(worker)
                answer = self._receive(worker)
                if answer is not None:
                    return answer
        except (EOFError, OSError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(0.1)
            code = worker.exitcode()
            worker.kill()
            self._worker = None
            self._start_worker()
            raise CollectorError(WORKER_DIED, f"the NVML worker (pid {worker.pid}) exited "
                                              f"unexpectedly (exit code {code}); a fresh one "
                                              "was started") from None

    def _receive(self, worker: Worker) -> Reading | None:
        """Read one message; the Reading if it answers the pending request."""
        kind, request_id, payload = worker.conn.recv()
        if kind == "ready":
            worker.ready = True
            return None
        assert isinstance(payload, Reading)
        worker.ready = True
        for gpu in payload.gpus:
            self._uuids[gpu.index] = gpu.uuid
        self._count_xids(payload.xids)
        if request_id != worker.pending:
            return None
        worker.pending = None
        # Every scrape that asked while this request was pending takes this answer.
        self._answered = (worker, request_id, payload)
        for waker in list(self._on_answer):
            waker()
        return payload

    def _timed_out(self, worker: Worker) -> CollectorError:
        age = worker.age()
        if not worker.ready and age < self.init_timeout:
            return CollectorError(TIMEOUT, f"NVML is still initialising ({age:.1f}s since the "
                                           f"worker started; it is replaced only after "
                                           f"{self.init_timeout:g}s)")
        worker.kill()
        self._stuck.append(worker)
        self._worker = None
        started = self._start_worker()
        then = ("a fresh one was started" if started is not None
                else "too many stuck workers to start another")
        return CollectorError(TIMEOUT, f"NVML did not answer within the deadline; the stuck "
                                       f"worker (pid {worker.pid}) was killed and {then}")

    def _count_xids(self, events: tuple[XidEvent, ...]) -> None:
        changed = False
        for event in events:
            key = (event.gpu, event.code)
            self._xid_codes[key] = self._xid_codes.get(key, 0) + 1
            self._last_xid[event.gpu] = event
            uuid = self._uuids.get(event.gpu)
            if uuid is not None:
                changed |= self._xid_boots.seen(uuid, event.code)
        if changed:
            # Rare (a code's first event on a GPU in a boot); off the scrape's path, as
            # the state directory's disk may be slow.
            threading.Thread(target=self._xid_boots.save, name="xid-boots",
                             daemon=True).start()

    # -- families -------------------------------------------------------------
    def _history(self) -> list[MetricFamily]:
        """What the agent remembers across samples, served whether this one worked or
        not: every Xid code seen on every GPU, classified (node/gpu/xid_catalog.yml),
        and the ranks seen on each GPU within the last hour, so that a page for a GPU
        that fell off the bus can name the ranks it took down."""
        families: list[MetricFamily] = []
        if self._xid_codes:
            events = catalogue.counter("colossalai_gpu_xid_events_total")
            for (gpu, code), count in sorted(self._xid_codes.items()):
                kind = xid.classify(code)
                events.add_metric([str(gpu), str(code), kind.tier, kind.action, kind.what],
                                  count)
            families.append(events)
            boots = catalogue.gauge("colossalai_gpu_xid_boots")
            for gpu, code in sorted(self._xid_codes):
                uuid = self._uuids.get(gpu)
                if uuid is not None:
                    boots.add_metric([str(gpu), str(code)],
                                     self._xid_boots.boots(uuid, code))
            families.append(boots)
        forget = time.time() - GPU_RANK_MEMORY_SECONDS
        self._gpu_ranks = {key: seen for key, seen in self._gpu_ranks.items() if seen >= forget}
        if self._gpu_ranks:
            ranks = catalogue.info("colossalai_gpu_rank_info")
            for gpu, rank in sorted(self._gpu_ranks):
                ranks.add_metric([str(gpu), str(rank)], {})
            families.append(ranks)
        return families

    def _note_ranks(self, gpus: tuple[GpuReading, ...]) -> None:
        """Match each GPU's compute processes to the node's ranks (by pid)."""
        if self._local_ranks is None:
            return
        ranks = self._local_ranks()
        now = time.time()
        for gpu in gpus:
            for pid in gpu.pids or ():
                rank = ranks.get(pid)
                if rank is not None:
                    self._gpu_ranks[(gpu.index, rank)] = now

    def _known_no_driver(self) -> tuple[str, bool] | None:
        """The standing no_driver answer (its message, and whether a GPU is expected),
        or None when the worker must be asked."""
        known = self._no_driver
        if known is None or time.monotonic() >= known[0]:
            return None
        return known[1], known[2]

    def _why_gpus_expected(self) -> str | None:
        """What says this node should have a GPU, or None where nothing does: then no
        NVIDIA driver is a node without GPUs rather than a broken driver."""
        if self.expected:
            return f"{self.expected} GPU{'s' if self.expected > 1 else ''} expected"
        if self._seen_gpus:
            return "GPUs were seen since the agent started"
        try:
            nodes = sorted(name for name in os.listdir(self.dev_root)
                           if GPU_DEVICE_NODE.match(name))
        except OSError as exc:
            # Without a look at the device nodes, no driver stays a failure.
            return f"{self.dev_root} could not be listed ({exc.strerror or exc})"
        if nodes:
            return f"{os.path.join(self.dev_root, nodes[0])} exists"
        return None

    def _without_driver(self, message: str, gpus_expected: bool) -> list[MetricFamily]:
        """The answer to no NVIDIA driver: a failure where a GPU is expected, else zero
        GPUs (no per-GPU series)."""
        if gpus_expected:
            raise CollectorError(NO_DRIVER, message)
        return self._build(Reading())

    def _families(self, reading: Reading) -> list[MetricFamily]:
        if reading.failure is not None:
            message = reading.failure.message
            if reading.failure.reason != NO_DRIVER:
                raise CollectorError(reading.failure.reason, message)
            why = self._why_gpus_expected()
            if why is not None:
                message += f", yet {why}"
            if self.no_driver_recheck > 0:
                # The decision stands with the answer: /dev is listed once per recheck.
                message += f" (asked again every {self.no_driver_recheck:g}s)"
                self._no_driver = (time.monotonic() + self.no_driver_recheck, message,
                                   why is not None)
            return self._without_driver(message, why is not None)
        if reading.gpus:
            self._seen_gpus = True
        self._note_ranks(reading.gpus)
        families = self._build(reading)
        visible = len(reading.gpus)
        if self.expected is not None and visible < self.expected:
            raise CollectorError(MISSING_GPUS, f"{visible} of {self.expected} expected GPUs are "
                                               "visible to NVML", families)
        if self.expected is None and visible == 0:
            raise CollectorError(MISSING_GPUS, "the NVIDIA driver is loaded but NVML reports no "
                                               "GPUs", families)
        return families

    def _build(self, reading: Reading) -> list[MetricFamily]:
        devices = catalogue.gauge("colossalai_gpu_devices")
        devices.add_metric([], len(reading.gpus))
        families: list[MetricFamily] = [devices]
        if self.expected is not None:
            expected = catalogue.gauge("colossalai_gpu_expected_devices")
            expected.add_metric([], self.expected)
            families.append(expected)
        info = catalogue.info("colossalai_gpu_info")
        for gpu in reading.gpus:
            info.add_metric([str(gpu.index), gpu.uuid, gpu.name, reading.driver_version], {})
        families.append(info)
        families.extend(self._per_gpu(reading.gpus))
        families.extend(health_families(reading.gpus))
        return [family for family in families if family.samples or family is devices]

    def _per_gpu(self, gpus: tuple[GpuReading, ...]) -> list[MetricFamily]:
        used = catalogue.gauge("colossalai_gpu_memory_used_bytes")
        total = catalogue.gauge("colossalai_gpu_memory_total_bytes")
        percent = catalogue.gauge("colossalai_gpu_memory_used_percent")
        utilization = catalogue.gauge("colossalai_gpu_utilization_ratio")
        temperature = catalogue.gauge("colossalai_gpu_temperature_celsius")
        power = catalogue.gauge("colossalai_gpu_power_watts")
        ecc = catalogue.counter("colossalai_gpu_ecc_errors_total")
        xids = catalogue.counter("colossalai_gpu_xid_errors_total")
        last_xid = catalogue.gauge("colossalai_gpu_last_xid")
        last_xid_at = catalogue.gauge("colossalai_gpu_last_xid_timestamp_seconds")
        xid_totals: dict[int, int] = {}  # per GPU, from the counts by code
        for (index, _), count in self._xid_codes.items():
            xid_totals[index] = xid_totals.get(index, 0) + count
        for gpu in gpus:
            label = [str(gpu.index)]
            if gpu.memory_used_bytes is not None and gpu.memory_total_bytes is not None:
                used.add_metric(label, gpu.memory_used_bytes)
                total.add_metric(label, gpu.memory_total_bytes)
                if gpu.memory_total_bytes > 0:
                    percent.add_metric(label, 100.0 * gpu.memory_used_bytes
                                       / gpu.memory_total_bytes)
            if gpu.utilization_percent is not None:
                utilization.add_metric(label, gpu.utilization_percent / 100.0)
            if gpu.temperature_celsius is not None:
                temperature.add_metric(label, gpu.temperature_celsius)
            if gpu.power_milliwatts is not None:
                power.add_metric(label, gpu.power_milliwatts / 1000.0)
            if gpu.ecc_corrected is not None:
                ecc.add_metric([*label, "corrected"], gpu.ecc_corrected)
            if gpu.ecc_uncorrected is not None:
                ecc.add_metric([*label, "uncorrected"], gpu.ecc_uncorrected)
            if gpu.xid_watched or gpu.index in xid_totals:
                xids.add_metric(label, xid_totals.get(gpu.index, 0))
            event = self._last_xid.get(gpu.index)
            if event is not None:
                last_xid.add_metric(label, event.code)
                last_xid_at.add_metric(label, event.seen_at)
        return [used, total, percent, utilization, temperature, power, ecc, xids, last_xid,
                last_xid_at]



if TYPE_CHECKING:
    from colossalai_exporter.node.base import NodeCollector

    def _implements_node_collector(collector: GpuCollector) -> NodeCollector:
        return collector  # mypy checks GpuCollector against the protocol here


def from_config(config: NodeConfig, built: Built) -> GpuCollector:
    """The registry's factory (node/collectors.py). It owns ``built.gpu_worker`` (started
    early by the CLI) from here on; the ranks collector's pids name the rank on each GPU."""
    ranks = cast("RanksCollector | None", built.collectors.get("ranks"))
    return GpuCollector(timeout=config.gpu_timeout, expected=config.gpu_expected,
                        worker=built.gpu_worker,
                        local_ranks=ranks.local_pids if ranks is not None else None,
                        xid_boots=XidBoots(config.state_dir, current_boot_id()))
