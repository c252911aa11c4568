"""The node agent's ``ranks`` collector: every local training rank, seen from outside.

Each rank's :class:`~colossalai_exporter.training.TrainingMonitor` writes a
snapshot into the run directory about once a second. This collector reads
them and, for each rank, serves:

* ``colossalai_rank_up`` — 1 while the rank's process is alive (the pid exists
  and started when the snapshot says, so a reused pid does not count) and its
  snapshot is fresh (two of the rank's publish intervals plus 2 s, at most
  ``stale_after``: :meth:`RanksCollector.stale_limit`); a rank SIGKILLed or
  OOM-killed by the kernel drops to 0 at once, a frozen one (SIGSTOP, GIL held
  by a C call) once its snapshot ages;
* ``colossalai_rank_snapshot_age_seconds``, ``colossalai_rank_process_alive`` and
  ``colossalai_rank_process_stopped``;
* the rank's training series from its last snapshot, with the stall judged
  again now (``colossalai_training_stalled``): a frozen rank cannot say it is
  stuck, the agent can;
* ``colossalai_rank_exit_info`` once the process is gone: how it ended (finished,
  interrupted, OOM-killed, failed of its own error or of a peer's, killed), judged
  once by :class:`~colossalai_exporter.node.exits.ExitJudge`, so that a page leads
  with the rank where an incident began.

Snapshots of dead processes older than ``forget_after`` are ignored (an old
run's leftovers). Never imports torch.

The run directory is read in a thread of its own with a deadline, as the disk
collector checks its paths: a run directory on a hung NFS mount blocks
``listdir`` and ``open`` in the kernel, and must fail this collector
(``timeout``) rather than hang the scrape. The agent starts the read with
``begin`` so it overlaps the other collectors; a read that has not returned is
not started again, so a hung mount holds one thread, and later scrapes wait
for that same read.

A rank in another PID namespace than the agent's (a training pod without
``hostPID``, the agent in a container without it) writes pids that mean
nothing here, and judging them would report every rank dead. The snapshot
carries the rank's namespace; when it differs from the agent's, the rank is
judged by its snapshot's age alone: a killed or frozen rank still drops to 0,
once ``stale_after`` has passed, and ``colossalai_rank_process_stopped`` is
left out for it, since the agent cannot know.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from prometheus_client.core import Metric as MetricFamily

from colossalai_exporter import catalogue
from colossalai_exporter.node.base import CollectorError, FuturePending, Pending
from colossalai_exporter.node.blocking import BlockingCalls
from colossalai_exporter.node.exits import ExitJudge
from colossalai_exporter.node.oom import KernelLog
from colossalai_exporter.rankstate.crash import Crash, read_crash_report
from colossalai_exporter.rankstate.families import RankFamilies
from colossalai_exporter.rankstate.files import (
    default_run_dir,
    iter_snapshot_files,
    pid_namespace,
    read_snapshot,
)
from colossalai_exporter.rankstate.schema import ERROR_REASONS, Snapshot, SnapshotError

if TYPE_CHECKING:
    from colossalai_exporter.node.collectors import Built
    from colossalai_exporter.node.config import NodeConfig

log = logging.getLogger("colossalai_exporter.node")

PID_START_TOLERANCE_SECONDS = 1.0
# Why a rank's snapshot cannot be trusted, as colossalai_rank_snapshot_errors_total counts
# it: the file's own errors, and "shared": two live processes writing it in turn.
READ_ERRORS = (*ERROR_REASONS, "shared")


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_state(pid: int, pid_start: float | None,
                  boot_time: float | None = None) -> tuple[bool, bool]:
    """(alive, stopped) for a pid, checking its start time when known.

    One read of ``/proc/<pid>/stat`` (state and start time), not psutil's three
    (it reads the stat file, ``/proc/stat`` for the boot time, and the status file
    for each process): on a node of eight ranks that was a third of the ranks
    collector's time. The start time is psutil's formula (boot time plus start
    ticks), which the rank used for ``pid_start``.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False, False
    except PermissionError:
        return True, False  # it exists; we may not look closer (hidepid)
    # The command name may hold spaces and parentheses: the fields follow its last ')'.
    fields = stat[stat.rfind(b")") + 2:].split()
    state = fields[0]
    if pid_start is not None:
        started = (boot_time if boot_time is not None else psutil.boot_time()) + \
            int(fields[19]) / _CLOCK_TICKS
        if abs(started - pid_start) > PID_START_TOLERANCE_SECONDS:
            return False, False  # the pid now belongs to another process
    if state in (b"Z", b"X", b"x"):  # zombie, dead
        return False, False
    return True, state in (b"T", b"t")  # stopped, tracing stop


@dataclass
class RunDirLook:
    """One read of the run directory: every readable snapshot, by rank."""

    exists: bool = True
    snapshots: list[tuple[int, Snapshot]] = field(default_factory=list)
    permission_error: str = ""
    #: rank -> the crash report its snapshot's process left (rankstate/crash.py)
    crashes: dict[int, Crash] = field(default_factory=dict)


@dataclass
class _Read(FuturePending):
    """A scrape's read of the run directory (a Pending): maybe one begun by an earlier scrape."""

    future: Future[RunDirLook]
    start: float


class RanksCollector:
    """Implements :class:`~colossalai_exporter.node.base.NodeCollector`."""

    name = "ranks"
    reasons: tuple[str, ...] = ("permission", "timeout")

    def __init__(self, run_dir: Path | str | None = None, *, stale_after: float = 30.0,
                 forget_after: float = 6 * 3600.0, timeout: float = 2.0,
                 clock: Callable[[], float] = time.time,
                 calls: BlockingCalls | None = None, exits: ExitJudge | None = None) -> None:
        """``calls``: the agent's runner of file system calls; by default one of its own.
        ``exits``: judges how gone ranks ended; by default from the kernel log at
        /dev/kmsg and the memory cgroups of /proc and /sys/fs/cgroup."""
        self.run_dir = Path(run_dir) if run_dir is not None else default_run_dir()
        self.stale_after = stale_after
        self.forget_after = forget_after
        self.timeout = timeout
        self._clock = clock
        # reads of snapshot files that could not be used since start, by reason
        self._errors = dict.fromkeys(READ_ERRORS, 0)
        # rank -> its snapshot's last two writers (pid, monitor start), the last first:
        # a writer that comes back after another is a second run in the same directory.
        self._writers: dict[int, tuple[tuple[int, float], tuple[int, float] | None]] = {}
        self._pid_ns = pid_namespace()
        self._boot_time = psutil.boot_time()  # fixed while the node runs
        # A read stuck in the kernel holds one thread, and no second read starts.
        self._calls = calls or BlockingCalls("ranks", max_threads=2)
        self._lock = threading.Lock()
        self._reading: Future[RunDirLook] | None = None
        self._pids: dict[int, int] = {}  # pid -> rank of the live local ranks, last scrape
        self._world: tuple[str, int] | None = None  # their run and world size, last scrape
        self._stores: list[str] = []  # their rendezvous stores, last scrape
        self.exits = exits if exits is not None else ExitJudge(
            KernelLog(), forget_after=forget_after, clock=clock)

    def begin(self, deadline: float) -> _Read:
        """Start reading the run directory; collect() waits for it."""
        return _Read(self._read_async(), time.monotonic())

    def _read_async(self) -> Future[RunDirLook]:
        with self._lock:
            # A read that returned was a scrape's; one still running is waited for again.
            if self._reading is None or self._reading.done():
                self._reading = self._calls.submit(self._read_run_dir)
            return self._reading

    def _read_run_dir(self) -> RunDirLook:
        """All of this collector's file system work (it may block in the kernel)."""
        if not self.run_dir.is_dir():
            return RunDirLook(exists=False)
        try:
            files = list(iter_snapshot_files(self.run_dir))
        except PermissionError as exc:
            return RunDirLook(permission_error=f"cannot list {self.run_dir}: {exc}")
        look = RunDirLook()
        for rank, path in files:
            # One bad file costs its rank only: a training image newer than this agent
            # (a rolling upgrade), a truncated or hand-edited file.
            try:
                snap = read_snapshot(path)
            except FileNotFoundError:
                continue  # removed between the listing and the read
            except SnapshotError as exc:
                self._count_error(exc.reason, exc)
                continue
            except OSError as exc:
                self._count_error("unreadable", exc)
                continue
            look.snapshots.append((rank, snap))
            # A stat of the report's file, read only where it reports a crash: here, in
            # the thread that may block, not where the verdict is made.
            crash = read_crash_report(self.run_dir, rank, snap.pid, snap.created)
            if crash is not None:
                look.crashes[rank] = crash
        return look

    def _count_error(self, reason: str, why: object) -> None:
        with self._lock:
            first = self._errors[reason] == 0
            self._errors[reason] += 1
        if first:  # once per reason: a bad file is read again every scrape
            log.warning("rank snapshot not trusted (%s): %s", reason, why)

    def _check_writer(self, snap: Snapshot) -> None:
        """Count a rank's snapshot whose writer alternates with another ("shared").

        Two jobs on one node that publish into the same run directory (the default one)
        write the same ``rank-<R>.json`` in turn, each about once a second: every read
        finds one or the other, the rank's series flip between two runs, and a rank of
        either that dies or hangs is not seen (the other's snapshot stands in for it).
        A restart replaces a writer for good; only a writer that comes back after
        another is a second run. Told by the snapshot's own pid and monitor start, so
        also where the agent cannot see the ranks' pids (another PID namespace)."""
        writer = (snap.pid, snap.created)
        last, before = self._writers.setdefault(snap.rank, (writer, None))
        if writer == last:
            return
        self._writers[snap.rank] = (writer, last)
        if writer == before:
            self._count_error("shared", f"rank {snap.rank}'s snapshot in {self.run_dir} is "
                                        f"written in turn by pids {last[0]} and {writer[0]}: "
                                        "two runs in one run directory")

    def _look(self, deadline: float, pending: Pending | None) -> RunDirLook:
        read = pending if isinstance(pending, _Read) else self.begin(deadline)
        future, start = read.future, read.start
        budget = max(0.01, min(self.timeout, deadline - start))
        try:
            try:
                return future.result(timeout=max(0.0, start + budget / 2 - time.monotonic()))
            except FutureTimeout:
                # Queued behind a disk check on a hung mount, say: a thread of its own.
                self._calls.separate([future])
            return future.result(timeout=max(0.0, start + budget - time.monotonic()))
        except FutureTimeout:
            raise CollectorError("timeout", f"reading the run directory {self.run_dir} took "
                                            f"over {budget:.2g}s (a hung mount?); later "
                                            "scrapes wait for the same read") from None

    def collect(self, deadline: float, pending: Pending | None = None) -> list[MetricFamily]:
        look = self._look(deadline, pending)
        if look.permission_error:
            raise CollectorError("permission", look.permission_error)
        if not look.exists:
            # No run has started on this node yet: no ranks, which is not a failure.
            return [*self._empty(), self._errors_family()]
        now = self._clock()
        pids: dict[int, int] = {}
        worlds: dict[tuple[str, int], int] = {}
        stores: set[str] = set()
        up = catalogue.gauge("colossalai_rank_up")
        age = catalogue.gauge("colossalai_rank_snapshot_age_seconds")
        stopped = catalogue.gauge("colossalai_rank_process_stopped")
        alive_fam = catalogue.gauge("colossalai_rank_process_alive")
        training = RankFamilies(outside=True)
        live: list[Snapshot] = []
        gone: list[Snapshot] = []
        for rank, snap in look.snapshots:
            self._check_writer(snap)
            snap_age = max(0.0, now - snap.written)
            pids_mean_something = not self._other_namespace(snap.pid_ns)
            stale_after = self.stale_limit(snap)
            if pids_mean_something:
                alive, is_stopped = process_state(snap.pid, snap.pid_start, self._boot_time)
            else:
                alive, is_stopped = snap_age <= stale_after, False
            if not alive and snap_age > self.forget_after:
                continue
            label = [str(rank)]
            (live if alive else gone).append(snap)
            if alive:
                pids[snap.pid] = rank
                if snap.rendezvous:
                    stores.add(snap.rendezvous)
                world = (snap.info.get("run", ""), snap.world_size)
                worlds[world] = worlds.get(world, 0) + 1
            fresh = alive and snap_age <= stale_after
            up.add_metric(label, 1.0 if fresh else 0.0)
            age.add_metric(label, snap_age)
            if pids_mean_something:
                stopped.add_metric(label, 1.0 if is_stopped else 0.0)
                alive_fam.add_metric(label, 1.0 if alive else 0.0)
            training.add(snap, now)
        for gone_rank in self._writers.keys() - {rank for rank, _ in look.snapshots}:
            del self._writers[gone_rank]  # its file is gone: a later one starts afresh
        self._pids = pids
        self._stores = sorted(stores)
        self._world = max(worlds, key=worlds.__getitem__) if worlds else None
        exits = catalogue.info("colossalai_rank_exit_info")
        judged = self.exits.scrape(live, gone, look.crashes,
                                   lambda snap: not self._other_namespace(snap.pid_ns))
        for snap in gone:
            ended = judged[snap.rank]
            exits.add_metric([str(snap.rank), snap.info.get("run", ""), ended.reason,
                              ended.detail, ended.collective], {})
        served = training.families() if training.ranks else []  # no rank, no family
        return [up, age, stopped, alive_fam, exits, self._errors_family(), *served]

    def local_pids(self) -> dict[int, int]:
        """pid -> training rank of this node's live ranks, as the last scrape saw them
        (for the nccl collector, which learns pids from NCCL)."""
        return dict(self._pids)

    def local_stores(self) -> list[str]:
        """The rendezvous stores (``MASTER_ADDR:MASTER_PORT``) of this node's live ranks,
        as the last scrape saw them (for the rendezvous collector)."""
        return list(self._stores)

    def local_world(self) -> tuple[str, int] | None:
        """(run, world size) of this node's live ranks (most of them, should they
        differ), as the last scrape saw them; None without live ranks."""
        return self._world

    def stale_limit(self, snap: Snapshot) -> float:
        """How old a live rank's snapshot may be before the rank counts as not answering.

        Two publish intervals and 2 s of slack when the snapshot says its interval (a
        rank hung in a C call holding the GIL shows within seconds, in time to be
        named as the rank a hang waits for); ``stale_after`` otherwise, and at most.
        """
        if snap.publish_interval is None:
            return self.stale_after
        return min(self.stale_after, max(2 * snap.publish_interval, 1.0) + 2.0)

    def _other_namespace(self, rank_ns: int | None) -> bool:
        # Unknown on either side (an older snapshot, no /proc): trust the pid, as before.
        return rank_ns is not None and self._pid_ns is not None and rank_ns != self._pid_ns

    def _errors_family(self) -> MetricFamily:
        errors = catalogue.counter("colossalai_rank_snapshot_errors_total")
        with self._lock:
            counts = dict(self._errors)
        for reason in READ_ERRORS:
            errors.add_metric([reason], float(counts[reason]))
        served: MetricFamily = errors
        return served

    def _empty(self) -> list[MetricFamily]:
        names = ("colossalai_rank_up", "colossalai_rank_snapshot_age_seconds",
                 "colossalai_rank_process_stopped", "colossalai_rank_process_alive",
                 "colossalai_rank_exit_info")
        return [catalogue.family(n) for n in names]

    def close(self) -> None:
        # A reader stuck in the kernel cannot be joined; it ends with the process.
        self._calls.shutdown()


def from_config(config: NodeConfig, built: Built) -> RanksCollector:
    """The registry's factory (node/collectors.py)."""
    return RanksCollector(config.ranks_run_dir, calls=built.fs_calls)
