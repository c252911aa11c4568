"""A rank's crash report (rankstate/crash.py): faulthandler's text, read back.

The reports here are as CPython writes them (a real one is made and judged in
tests/test_rank_exits.py); these cover what a real crash on this machine cannot
show at will: a crash in a thread without Python, a report older than the process.
"""

from __future__ import annotations

import os
from pathlib import Path

from colossalai_exporter.rankstate.crash import (
    HEADER,
    crash_report_path,
    parse_crash_report,
    read_crash_report,
    thread_name,
)

TRAINING = 0x7F3A3D8E5740
HEADER_TEXT = HEADER.format(rank=3, pid=4242, thread=thread_name(TRAINING))
# A crash in a thread of native code alone (NCCL's, CUDA's): faulthandler lists every
# Python thread, none of them "Current".
NATIVE_THREAD = HEADER_TEXT + f"""Fatal Python error: Bus error

Thread 0x00007f3a2c1ff640 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/opt/venv/lib/python3.11/site-packages/colossalai_exporter/x.py", line 80 in run

Thread {thread_name(TRAINING)} (most recent call first):
  File "/opt/venv/lib/python3.11/site-packages/torch/cuda/__init__.py", line 954 in synchronize
  File "/job/train.py", line 120 in train_step
  File "/job/train.py", line 200 in main

Extension modules: numpy.core._multiarray_umath, torch._C (total: 2)
"""


def test_a_crash_outside_any_python_thread_is_placed_at_the_training_thread() -> None:
    crash = parse_crash_report(NATIVE_THREAD, "crash-rank3-4242.txt")
    assert crash is not None
    assert (crash.signal, crash.error) == ("SIGBUS", "Bus error")
    assert crash.where == "train.py:120 in train_step (__init__.py:954 in synchronize)"


def test_the_header_alone_reports_no_crash() -> None:
    assert parse_crash_report(HEADER_TEXT, "crash-rank3-4242.txt") is None


def test_a_signal_faulthandler_names_otherwise_is_kept_in_its_words() -> None:
    crash = parse_crash_report(HEADER_TEXT + "Fatal Python error: Something new\n", "f.txt")
    assert crash is not None and crash.signal == crash.error == "Something new"
    assert crash.where == ""
    assert crash.describe().startswith(
        "Something new (Something new), a crash in native code; every thread's")


def test_a_report_older_than_the_process_is_another_process_s(tmp_path: Path) -> None:
    """A pid reused: the file's report was written before this process started."""
    path = crash_report_path(tmp_path, 3, 4242)
    path.write_text(NATIVE_THREAD)
    written = path.stat().st_mtime
    assert read_crash_report(tmp_path, 3, 4242, started=written - 10) is not None
    assert read_crash_report(tmp_path, 3, 4242, started=written + 10) is None
    os.truncate(path, len(HEADER_TEXT))
    assert read_crash_report(tmp_path, 3, 4242, started=written - 10) is None
    assert read_crash_report(tmp_path, 3, 4343, started=written - 10) is None  # no file
