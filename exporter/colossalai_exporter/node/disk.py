"""Watched paths: checkpoint and NVMe offload directories, free space and health.

Paths are checked in a worker thread with a deadline, because a hung NFS or
Lustre mount blocks ``statvfs`` in the kernel and would otherwise hang the
whole scrape. A path that does not answer in time is reported ``timeout``; its
thread is left to finish on its own (it cannot be interrupted).

A scrape's paths are checked in order on one thread, which the agent shares
with the ranks collector's read of the run directory (:mod:`.blocking`: one
hand-over per scrape, not one per path; the agent starts the checks with
``begin`` so they run while the other collectors do, and its event loop is
woken when the last returns). Should that thread still be busy halfway
through the deadline, say on a hung mount, the paths it has not reached get a
thread each, so that only the hung path is reported ``timeout``. A path whose
check from an earlier scrape has not returned is not checked again: later
scrapes wait for that same check, so a hung mount holds one thread, not one
more per scrape.

The built-in default paths (``/checkpoints`` and ``/nvme``, watched when no
flag, config file or environment variable names a path) are watched only
where they exist: a node on defaults that has neither is not broken, and
nobody asked for them. Each scrape still looks, so a mount that comes up
later is watched from then on. A path the user named that is missing is a
failure (``missing``), as any other.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from colossalai_exporter import catalogue
from colossalai_exporter.node.base import LoopWaker
from colossalai_exporter.node.blocking import BlockingCalls

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable
    from concurrent.futures import Future

    from prometheus_client.core import Metric as MetricFamily

    from colossalai_exporter.node.base import Pending
    from colossalai_exporter.node.collectors import Built
    from colossalai_exporter.node.config import NodeConfig

REASONS = ("missing", "not_directory", "not_writable", "not_mounted", "permission",
           "timeout", "error")


@dataclass(frozen=True)
class WatchedPath:
    name: str
    path: str
    #: the path must be a mount point (an NVMe offload mount, say): a plain
    #: directory left behind when the mount is missing is then a failure
    mount_point: bool = False
    #: a built-in default nobody named (no flag, config file or environment
    #: variable): watched only while it exists, so a node without it stays quiet
    default: bool = False


@dataclass(frozen=True)
class PathStatus:
    ok: bool
    reason: str = ""
    free_bytes: float | None = None
    total_bytes: float | None = None


def check_path(watched: WatchedPath) -> PathStatus:
    """Stat, mount and writability checks, then statvfs; never raises."""
    try:
        st = os.stat(watched.path)
    except FileNotFoundError:
        return PathStatus(False, "missing")
    except PermissionError:
        return PathStatus(False, "permission")
    except OSError:
        return PathStatus(False, "error")
    if not stat.S_ISDIR(st.st_mode):
        return PathStatus(False, "not_directory")
    try:
        vfs = os.statvfs(watched.path)
    except OSError as exc:
        return PathStatus(False, "permission" if exc.errno == errno.EACCES else "error")
    free = float(vfs.f_bavail * vfs.f_frsize)
    total = float(vfs.f_blocks * vfs.f_frsize)
    if watched.mount_point and not os.path.ismount(watched.path):
        return PathStatus(False, "not_mounted", free, total)
    # access() asks the kernel with the agent's credentials; a read-only mount
    # (ST_RDONLY) fails it too, which is what a checkpoint writer would hit.
    if not os.access(watched.path, os.W_OK | os.X_OK) or vfs.f_flag & os.ST_RDONLY:
        return PathStatus(False, "not_writable", free, total)
    return PathStatus(True, "", free, total)


def watched_now(watched: WatchedPath, status: PathStatus) -> bool:
    """Whether ``watched`` is reported this scrape: always, unless it is a built-in
    default that does not exist (yet: a mount that comes up later is watched then)."""
    return not (watched.default and status.reason == "missing")


class _Check:
    """One check of one path; ``status`` is set when it returns, then ``future`` completes."""

    __slots__ = ("future", "index", "path", "status")
    future: Future[None]  # set by the collector as it submits the check

    def __init__(self, index: int, path: WatchedPath) -> None:
        self.index = index
        self.path = path
        self.status: PathStatus | None = None


class _Scrape:
    """What one scrape waits for: a check per path (a Pending)."""

    __slots__ = ("checks", "start")

    def __init__(self, start: float, checks: list[_Check]) -> None:
        self.start = start
        self.checks = checks

    def ready(self) -> bool:
        return all(check.status is not None for check in self.checks)

    def watch(self, loop: asyncio.AbstractEventLoop,
              wake: Callable[[], None]) -> Callable[[], None]:
        waker = LoopWaker(loop, wake)
        for check in self.checks:
            check.future.add_done_callback(waker)
        return waker.stop


class DiskCollector:
    name = "disk"
    reasons: tuple[str, ...] = ("error",)

    def __init__(self, paths: list[WatchedPath], timeout: float = 2.0,
                 calls: BlockingCalls | None = None) -> None:
        """``calls``: the agent's runner of file system calls; by default one of its own."""
        self.paths = paths
        self.timeout = timeout
        # One thread per hung path at most (see above), plus the one going in order.
        # Daemon threads: a check stuck in the kernel must not hold up the agent's exit.
        self._calls = calls or BlockingCalls("disk", max_threads=min(8, 2 * len(paths)))
        self._cond = threading.Condition()
        self._in_flight: dict[int, _Check] = {}  # checks not returned yet, by path index
        self._last: list[tuple[WatchedPath, PathStatus]] = []  # for /health

    def begin(self, deadline: float) -> Pending:
        """Start this scrape's checks; collect() waits for them."""
        return self._start()

    def _start(self) -> _Scrape:
        checks: list[_Check] = []
        with self._cond:
            for index, watched in enumerate(self.paths):
                check = self._in_flight.get(index)
                if check is None:
                    # Submitted under the lock, so that another scrape never finds a
                    # check in flight without its future; it runs once the lock is free.
                    check = _Check(index, watched)
                    check.future = self._calls.submit(self._check, check)
                    self._in_flight[index] = check
                checks.append(check)
        return _Scrape(time.monotonic(), checks)

    def _check(self, check: _Check) -> None:
        status = check_path(check.path)
        with self._cond:
            check.status = status
            if self._in_flight.get(check.index) is check:
                del self._in_flight[check.index]
            self._cond.notify_all()

    def collect(self, deadline: float, pending: Pending | None = None) -> list[MetricFamily]:
        scrape = pending if isinstance(pending, _Scrape) else self._start()
        budget = max(0.01, min(self.timeout, deadline - scrape.start))
        end = scrape.start + budget
        fallback_at = scrape.start + budget / 2
        separated = False
        with self._cond:
            while any(check.status is None for check in scrape.checks):
                now = time.monotonic()
                if now >= end:
                    break
                if not separated and now >= fallback_at:
                    # The paths still queued behind a slow one: a thread each.
                    separated = True
                    self._calls.separate(check.future for check in scrape.checks
                                         if check.status is None)
                self._cond.wait((end if separated else fallback_at) - now)
            statuses = [check.status or PathStatus(False, "timeout") for check in scrape.checks]
            watched_paths = [(watched, status)
                             for watched, status in zip(self.paths, statuses, strict=True)
                             if watched_now(watched, status)]
            self._last = watched_paths
        free = catalogue.gauge("colossalai_disk_free_bytes")
        total = catalogue.gauge("colossalai_disk_total_bytes")
        ok = catalogue.gauge("colossalai_disk_path_ok")
        failure = catalogue.info("colossalai_disk_path_failure_info")
        for watched, status in watched_paths:
            labels = [watched.name, watched.path]
            ok.add_metric(labels, 1.0 if status.ok else 0.0)
            if not status.ok:
                failure.add_metric([*labels, status.reason], {})
            if status.free_bytes is not None and status.total_bytes is not None:
                free.add_metric(labels, status.free_bytes)
                total.add_metric(labels, status.total_bytes)
        return [free, total, ok, failure]

    def problems(self) -> list[dict[str, str]]:
        """Watched paths that were not usable at the last scrape, for /health."""
        with self._cond:
            last = list(self._last)
        return [{"collector": self.name, "reason": status.reason,
                 "message": f"{watched.name} ({watched.path}) is not usable: {status.reason}"}
                for watched, status in last if not status.ok]

    def close(self) -> None:
        self._calls.shutdown()


def from_config(config: NodeConfig, built: Built) -> DiskCollector | None:
    """The registry's factory (node/collectors.py): none without a path to watch."""
    if not config.disks:
        return None
    return DiskCollector(config.disks, calls=built.fs_calls)
