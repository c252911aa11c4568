"""The kernel log's records, read from /dev/kmsg without ever blocking.

The node agent's OOM evidence (node/oom.py) and the GPU check's Xid lines
(node/gpu/xid.py) read the same records: "prio,seq,usec,flags;text", one per read()
on /dev/kmsg (or a file of them, as ``cat /dev/kmsg`` writes). The first poll reads
the whole ring buffer, so what happened before the reader started is still seen.
"""

from __future__ import annotations

import errno
import os
import time

_READ_SIZE = 16384  # a /dev/kmsg record (< 8 KiB): a shorter read() fails with EINVAL

_OPEN_PROBLEMS = {  # EPERM is what /dev/kmsg answers a reader without CAP_SYSLOG
    errno.EPERM: "permission denied: {} needs CAP_SYSLOG (a container without it)",
    errno.EACCES: "permission denied: {} is not readable by this user",
    errno.ENOENT: "{} does not exist (a container without the host's /dev/kmsg)"}


class KernelRecords:
    """Reads the kernel's records from /dev/kmsg incrementally. ``path`` and ``boot_time``
    injectable.

    ``path`` may also be a file of records as /dev/kmsg gives them (``cat /dev/kmsg``).
    ``boot_time`` defaults to wall minus monotonic time: like the log's, that clock stops
    in suspend.
    """

    def __init__(self, path: str = "/dev/kmsg", boot_time: float | None = None) -> None:
        self.path = path
        self.boot_time = boot_time if boot_time is not None else time.time() - time.monotonic()
        self.readable: bool | None = None  # None before the first poll
        self.problem = ""
        self._fd: int | None = None
        self._partial = b""  # a regular file's unfinished last line, completed next poll

    def poll(self) -> list[tuple[float, str]]:
        """(when, text) of every kernel record since the last poll, ``when`` the boot time
        plus the record's microseconds. Never blocks, never raises for I/O: when the log
        cannot be opened or read, returns [] and ``readable`` is False with ``problem``
        saying why in one line."""
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                known = _OPEN_PROBLEMS.get(exc.errno or 0, "cannot open {}: " + str(exc.strerror))
                self.readable, self.problem = False, known.format(self.path)
                return []
        chunks: list[bytes] = []
        problem = ""
        while True:  # /dev/kmsg: a record a read; a regular file: to its end
            try:
                chunk = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                break  # EAGAIN: no more records for now
            except BrokenPipeError:
                continue  # EPIPE: records were overwritten unread; the next read goes on
            except OSError as exc:
                problem = f"cannot read {self.path}: {exc.strerror}"
                break
            if not chunk:
                break
            chunks.append(chunk)
        lines = (self._partial + b"".join(chunks)).split(b"\n")
        self._partial = lines.pop()
        records = [record for record in map(self._record, lines) if record is not None]
        self.readable, self.problem = not problem, problem
        return records

    def _record(self, line: bytes) -> tuple[float, str] | None:
        """One "prio,seq,usec,flags;text" record; its " KEY=value" lines are skipped."""
        header, semicolon, text = line.partition(b";")
        fields = header.split(b",")
        # Not a record (a dictionary line, cut short), or not the kernel's: its facility is
        # 0, and what a process writes to /dev/kmsg gets 1, so a forged kill line is ignored.
        if not semicolon or len(fields) < 4 or not all(field.isdigit() for field in fields[:3]) \
                or int(fields[0]) >> 3:
            return None
        return self.boot_time + int(fields[2]) / 1e6, text.decode("utf-8", "replace")

    def close(self) -> None:
        """Close the log; a later poll opens it again and starts from its oldest record."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd, self._partial = None, b""


