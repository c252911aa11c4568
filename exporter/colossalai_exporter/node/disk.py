"""Watched paths: checkpoint and NVMe offload directories, free space and health.

Each path is checked in a worker thread with a deadline, because a hung NFS or
Lustre mount blocks ``statvfs`` in the kernel and would otherwise hang the
whole scrape. A path that does not answer in time is reported ``timeout``; its
thread is left to finish on its own (it cannot be interrupted) and the pool's
size bounds how many such threads can exist.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from colossalai_exporter.catalogue import family

if TYPE_CHECKING:
    from prometheus_client.core import Metric as MetricFamily

REASONS = ("missing", "not_directory", "not_writable", "not_mounted", "permission",
           "timeout", "error")


@dataclass(frozen=True)
class WatchedPath:
    name: str
    path: str
    #: the path must be a mount point (an NVMe offload mount, say): a plain
    #: directory left behind when the mount is missing is then a failure
    mount_point: bool = False


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


class DiskCollector:
    name = "disk"
    reasons: tuple[str, ...] = ("error",)

    def __init__(self, paths: list[WatchedPath], timeout: float = 2.0) -> None:
        self.paths = paths
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(8, 2 * len(paths))),
                                        thread_name_prefix="disk")

    def collect(self, deadline: float) -> list[MetricFamily]:
        budget = max(0.01, min(self.timeout, deadline - time.monotonic()))
        end = time.monotonic() + budget
        futures = [(p, self._pool.submit(check_path, p)) for p in self.paths]
        free = family("colossalai_disk_free_bytes")
        total = family("colossalai_disk_total_bytes")
        ok = family("colossalai_disk_path_ok")
        failure = family("colossalai_disk_path_failure_info")
        for watched, future in futures:
            try:
                status = future.result(timeout=max(0.0, end - time.monotonic()))
            except TimeoutError:
                status = PathStatus(False, "timeout")
            labels = [watched.name, watched.path]
            ok.add_metric(labels, 1.0 if status.ok else 0.0)
            if not status.ok:
                failure.add_metric([*labels, status.reason], {})
            if status.free_bytes is not None and status.total_bytes is not None:
                free.add_metric(labels, status.free_bytes)
                total.add_metric(labels, status.total_bytes)
        return [free, total, ok, failure]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
