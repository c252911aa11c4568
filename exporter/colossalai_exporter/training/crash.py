"""Python's faulthandler pointed at the rank's crash report (rankstate/crash.py says why).

Installed once a process, by the first monitor started with a run directory, and
only where nothing else installed faulthandler: a script run with
``PYTHONFAULTHANDLER`` or ``-X faulthandler``, or under torchrun's ``@record`` (whose
error handler enables it), keeps its reports on stderr as before, and its ranks' crashes
read as before ("killed ... or a crash in native code"). Without it a crash printed
no Python stack at all, so the report loses the user nothing.

A DataLoader worker forked from the rank inherits faulthandler and its file: the
child stops reporting there (a worker's crash is the rank's error, which names it),
so the report is only ever the rank's own.

A script that enables faulthandler itself after the monitor started takes it over;
the monitor's close then disables it (faulthandler cannot say where it writes).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import os
import threading
from pathlib import Path
from typing import IO

from colossalai_exporter.rankstate.crash import HEADER, crash_report_path, thread_name

log = logging.getLogger("colossalai_exporter.training")

_lock = threading.Lock()
# (the monitor that installed it, its open file), while installed: faulthandler writes
# to the file's descriptor
_installed: list[tuple[object, IO[str]]] = []


def install(owner: object, run_dir: Path, rank: int, training_thread: int | None) -> bool:
    """Report this process's crashes into the run directory; False where faulthandler
    was already enabled (by the user, or an earlier monitor) or the file cannot be made."""
    with _lock:
        if _installed or faulthandler.is_enabled():
            return False
        path = crash_report_path(run_dir, rank, os.getpid())
        try:
            report = open(path, "w", encoding="utf-8")  # noqa: SIM115 - kept open for faulthandler
        except OSError as exc:
            log.info("rank %d: no crash report in %s (%s)", rank, run_dir, exc)
            return False
        try:
            # The header names the thread that trains; the report itself follows it only
            # if the process crashes (a file without one says "no crash").
            report.write(HEADER.format(rank=rank, pid=os.getpid(),
                                       thread=thread_name(training_thread or 0)))
            report.flush()
            faulthandler.enable(file=report, all_threads=True)
        except (OSError, ValueError) as exc:
            log.info("rank %d: no crash report in %s (%s)", rank, run_dir, exc)
            with contextlib.suppress(OSError):
                report.close()
                os.unlink(path)
            return False
        _installed.append((owner, report))
        return True


def _remove() -> None:
    """Stop reporting; close and remove the report of a process that did not crash
    (under the lock). faulthandler must not keep a descriptor that is closed here, and
    that a later open may reuse."""
    faulthandler.disable()
    _, report = _installed.pop()
    with contextlib.suppress(OSError):
        report.close()
        os.unlink(report.name)


def uninstall(owner: object) -> None:
    """Stop reporting, and remove the report (the process did not crash)."""
    with _lock:
        if _installed and _installed[0][0] is owner:
            _remove()


@atexit.register
def _at_exit() -> None:
    # A normal exit without close(): no crash to report (a crash in the rest of the
    # interpreter's shutdown is not reported).
    # (a forked child has nothing installed: _in_forked_child)
    with _lock:
        if _installed:
            _remove()


def _in_forked_child() -> None:
    # The child's own faulthandler state is a copy: disabling it leaves the rank's.
    if _installed:
        faulthandler.disable()
        _installed.clear()


os.register_at_fork(after_in_child=_in_forked_child)
