"""A rank's crash in native code, as its process wrote it down while dying.

A segmentation fault in an extension or a driver, a bus error on a mapped file, an
abort from C++: the process ends by a signal no Python code can handle, with no
error recorded and no snapshot after it, which from outside looks like a SIGKILL.
The rank's monitor therefore points Python's :mod:`faulthandler` (which runs in the
signal handler itself) at a file of its own in the run directory,
``crash-rank<R>-<pid>.txt``, headed by the line this module writes: on SIGSEGV,
SIGBUS, SIGFPE, SIGILL or SIGABRT the handler writes the fatal error and every
thread's Python stack there, then lets the signal end the process. The node agent
reads the file of a rank whose process is gone (training/crash.py writes it,
node/exits.py names the crash from it). The file of a process that ended any other
way holds the header alone (its monitor wrote it at start), and is removed by
``TrainingMonitor.close()``.

faulthandler's report, as CPython 3.9-3.13 write it::

    Fatal Python error: Segmentation fault

    Thread 0x00007f3a2c1ff640 (most recent call first):
      File "/usr/lib/python3.11/threading.py", line 331 in wait
      ...
    Current thread 0x00007f3a3d8e5740 (most recent call first):
      File "/opt/venv/lib/python3.11/site-packages/ctypes/__init__.py", line 519 in string_at
      File "/job/train.py", line 88 in forward
      ...

    Extension modules: numpy.core._multiarray_umath, ... (total: 42)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

#: The header's form: the thread that trains is named, for a crash in a thread without
#: Python (NCCL's, CUDA's), where no stack is the "Current thread".
HEADER: Final = ("# colossalai-exporter crash report, rank {rank}, pid {pid}, "
                 "training thread {thread}\n")
_HEADER_THREAD: Final = re.compile(
    r"^# colossalai-exporter crash report, .*training thread (0x[0-9a-f]+)$", re.MULTILINE)
# faulthandler's words for each signal it handles (Modules/faulthandler.c).
SIGNALS: Final = {
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
    "Aborted": "SIGABRT",
}
_FATAL: Final = re.compile(r"^Fatal Python error: (.+)$", re.MULTILINE)
# (a thread's name may follow its id in later releases: tolerated)
_THREAD: Final = re.compile(
    r"^(Current thread|Thread) (0x[0-9a-f]+)\b.*\(most recent call first\):$")
_FRAME: Final = re.compile(r'^  File "(.+)", line (\d+) in (.+)$')
# A report is a few KiB (every thread's stack, up to 100 frames each); read no more.
_MAX_BYTES: Final = 256 * 1024
# A rank's report counts only if written after its process started (a pid is reused).
_CLOCK_SLACK_SECONDS: Final = 1.0
# Frames of installed packages and the standard library: where the crash happened
# is theirs; the script's own frame is what on-call opens.
_LIBRARY: Final = re.compile(r"/(site-packages|dist-packages)/|/lib/python3\.\d+/")


def crash_report_path(run_dir: Path, rank: int, pid: int) -> Path:
    return run_dir / _file_name(rank, pid)


def _file_name(rank: int, pid: int) -> str:
    return f"crash-rank{rank}-{pid}.txt"


def thread_name(ident: int) -> str:
    """A thread's id as faulthandler writes it on 64 bits (``0x`` and 16 hex digits):
    always as long, so that the header's length is known (read_crash_report)."""
    return f"0x{ident:016x}"


@dataclass(frozen=True)
class Crash:
    """What a crash report says: the signal, and where the thread that trains was."""

    signal: str  # "SIGSEGV"; faulthandler's own words where it names another
    error: str  # faulthandler's words: "Segmentation fault"
    where: str  # "train.py:88 in forward (__init__.py:519 in string_at)", or ""
    file: str  # the report's file name, in the run directory

    def describe(self) -> str:
        """What follows "was killed: " on the page: the signal first."""
        at = f", at {self.where}" if self.where else ""
        return (f"{self.signal} ({self.error}), a crash in native code{at}; every "
                f"thread's Python stack is in {self.file} in the node's run directory")


def parse_crash_report(text: str, file_name: str) -> Crash | None:
    """The crash ``text`` reports, or None when it reports none (the header alone)."""
    fatal = _FATAL.search(text)
    if fatal is None:
        return None
    error = fatal.group(1).strip()
    header = _HEADER_THREAD.search(text)
    stacks = _stacks(text)
    # The thread that crashed where it ran Python, else the training thread: a fault in
    # a thread of native code alone (NCCL's, CUDA's) has no "Current thread".
    frames = stacks.get("current") or (stacks.get(header.group(1)) if header else None) or []
    return Crash(SIGNALS.get(error, error), error, _where(frames), file_name)


def read_crash_report(run_dir: Path, rank: int, pid: int, started: float) -> Crash | None:
    """The crash report of rank ``rank``'s process ``pid`` (started at ``started``, unix
    time), or None: no file, none with a crash in it, or one older than the process.

    One ``stat`` where there is no crash (every live rank, every scrape): the file then
    holds its header alone, whose length is known."""
    # Strings, not Path objects: this runs for every rank at every scrape of the agent.
    name = _file_name(rank, pid)
    path = os.path.join(run_dir, name)
    try:
        stat = os.stat(path)
        if stat.st_size <= _HEADER_SIZE + len(str(rank)) + len(str(pid)) or \
                stat.st_mtime < started - _CLOCK_SLACK_SECONDS:
            return None
        with open(path, "rb") as file:
            data = file.read(_MAX_BYTES)
    except OSError:
        return None
    return parse_crash_report(data.decode("utf-8", "replace"), name)


# The header's length less its rank's and pid's digits (ASCII: characters are bytes).
_HEADER_SIZE: Final = len(HEADER.format(rank="", pid="", thread=thread_name(0)))


def _stacks(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """Each thread's frames, innermost first, by its id; the crashing one also as "current"."""
    stacks: dict[str, list[tuple[str, str, str]]] = {}
    frames: list[tuple[str, str, str]] | None = None
    for line in text.splitlines():
        thread = _THREAD.match(line)
        if thread:
            frames = stacks.setdefault(thread.group(2), [])
            if thread.group(1) == "Current thread":
                stacks["current"] = frames
            continue
        frame = _FRAME.match(line)
        if frame and frames is not None:
            frames.append((frame.group(1), frame.group(2), frame.group(3)))
        elif frames is not None and line.strip():
            frames = None  # "Extension modules: …", or anything after the stacks
    return stacks


def _where(frames: list[tuple[str, str, str]]) -> str:
    """The script's innermost frame, then the library's innermost where it differs, as
    the stall's place is named (training/activity.py)."""
    if not frames:
        return ""

    def named(frame: tuple[str, str, str]) -> str:
        path, line, function = frame
        return f"{os.path.basename(path)}:{line} in {function}"

    script = next((f for f in frames if not _LIBRARY.search(f[0])), None)
    innermost = frames[0]
    if script is None:
        return named(innermost)
    if script is innermost:
        return named(script)
    return f"{named(script)} ({named(innermost)})"
