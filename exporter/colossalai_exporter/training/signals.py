"""Termination signals, recorded before they end the rank: a preemption is not a crash.

When Slurm preempts or cancels a job, or Kubernetes deletes a pod, every rank gets
SIGTERM; when one rank dies, torchrun sends SIGTERM to the ranks that survive it;
Ctrl-C sends SIGINT. From outside, all of these look like a process that vanished
with no error, exactly like a rank the kernel's OOM killer ended, unless the rank
says what it received. This module records it (the monitor's ``interrupted``
callback writes the snapshot at once), so the node agent can tell the rank that
died first from the ranks that were told to stop, and a preempted run pages nobody.

Behaviour is kept exactly: the handler records, then does what was there before
(the user's own handler; Python's KeyboardInterrupt for SIGINT; for a signal left
at its default action, the default: the disposition is restored and the signal
sent again, so the process still ends by that signal, with the exit status
torchrun and the scheduler expect). A signal that was ignored is left alone.

A Python handler runs only when the main thread next executes Python code; a rank
whose main thread waits in C (a collective that never completes, which is exactly
when a scheduler's SIGTERM matters most) would not run it at all, and would
outlive the SIGTERM that should end it. Python's C-level handler also writes the
signal's number into a "wakeup" file descriptor at once, from any thread, so a
watcher thread reading it records the signal at once; for a signal whose action
was the default, it then restores that default with the C library's ``signal()``
(Python's own refuses outside the main thread) and sends the signal again: the
process ends as promptly as it would have without the monitor. When the wakeup
descriptor is already taken (an asyncio loop with signal handlers), only the
handler is installed.

A process forked from the rank (a DataLoader worker) inherits handlers and the
wakeup descriptor; it gets the previous handlers back at fork, or its own SIGTERM
(DataLoader terminates late workers that way) would read, in the rank, as the
rank's own. The recorded signals are blocked in the forking thread across the
fork, so that one sent to the child before it has reset its handlers waits for
the previous ones instead of reaching the rank's watcher through the shared
descriptor.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger("colossalai_exporter.training")

#: the signals a rank records: a scheduler's or torchrun's stop, Ctrl-C
RECORDED: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)

_Handler = Callable[[int, FrameType | None], Any] | int | None
# How long recording a signal may wait for a publish already in progress (the
# publisher's thread holds the snapshot for the length of one publish: well under a
# millisecond, but the first stalled publish writes the stall's evidence, and a loaded
# machine stretched one past a second, after which the rank ended by the signal with
# its record unwritten and was paged as killed). The bound only matters when the run
# directory hangs; it is well inside the 30 s torchrun, Slurm and Kubernetes give a
# rank between SIGTERM and SIGKILL.
RECORD_WAIT_SECONDS = 5.0
# How long the path that lost the race for a signal waits for the other to have
# written the record before the signal takes effect: longer than the record may take.
RACE_WAIT_SECONDS = RECORD_WAIT_SECONDS + 1.0
# Within this long after a record, the other path's sight of a signal is the same
# delivery; a later one (a second SIGTERM after the rank trained on) is recorded anew.
SAME_DELIVERY_SECONDS = 5.0


class SignalRecorder:
    """Records :data:`RECORDED` signals through ``interrupted(name)`` and passes them on.

    ``interrupted`` runs in the main thread's handler or in the watcher thread
    (whichever sees the signal first, at most once per signal); it must not raise.
    """

    def __init__(self, interrupted: Callable[[str], None]) -> None:
        self._interrupted = interrupted
        self._previous: dict[int, _Handler] = {}
        # When each signal was last recorded, and whether that record is written: the
        # handler and the watcher see the same delivery, and it is recorded once.
        self._recorded: dict[int, float] = {}
        self._done: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._thread: threading.Thread | None = None
        self._installed = False
        self._fork_hooks = False

    def install(self) -> bool:
        """Install the handlers (and the watcher); False when this is not the main
        thread, where Python allows no signal handler."""
        if threading.current_thread() is not threading.main_thread() or self._installed:
            return self._installed
        for signum in RECORDED:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue  # ignored on purpose (nohup, a launcher): nothing will end the rank
            self._previous[signum] = previous
            signal.signal(signum, self._handle)
        self._installed = True
        self._start_watcher()
        if not self._fork_hooks:
            self._fork_hooks = True  # registered once: os.register_at_fork has no undo
            os.register_at_fork(before=self._before_fork, after_in_parent=self._unblock,
                                after_in_child=self._forked)
        return True

    def uninstall(self) -> None:
        """Put the previous handlers and wakeup descriptor back (main thread only)."""
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._installed = False
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._stop_watcher()

    # -- the main thread's handler ------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Not after uninstall (a later recorder may still chain to this one), nor in a
        # forked child whose handlers the fork hook could not reset.
        if self._installed and os.getpid() == self._pid:
            self._record(signum)
            self._recorded_by_now(signum)
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)  # the user's handler, or KeyboardInterrupt for SIGINT
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # ends the process by that signal, as before

    def _record(self, signum: int) -> bool:
        """Record ``signum`` unless the other path (handler or watcher) did or is doing it;
        True for the one that did."""
        now = time.monotonic()
        with self._lock:
            if now - self._recorded.get(signum, -SAME_DELIVERY_SECONDS) < SAME_DELIVERY_SECONDS:
                return False
            self._recorded[signum] = now
            done = self._done[signum] = threading.Event()
        try:
            self._interrupted(signal.Signals(signum).name)
        except Exception as exc:  # the signal must still do what it did before
            log.warning("could not record %s: %s", signal.Signals(signum).name, exc)
        finally:
            done.set()
        return True

    def _recorded_by_now(self, signum: int) -> None:
        """Wait (a little) for the record to be written, whichever path writes it: the
        handler and the watcher race for the same signal, and the one that loses must
        not end the process while the other is still writing the snapshot."""
        with self._lock:
            done = self._done.get(signum)
        if done is not None:
            done.wait(RACE_WAIT_SECONDS)

    # -- the watcher: signals a blocked main thread cannot handle ------------------
    def _start_watcher(self) -> None:
        read, write = os.pipe()
        os.set_blocking(write, False)  # Python's C handler must never block on it
        try:
            old = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(read)
            os.close(write)
            return
        if old != -1:
            # Someone else listens there (asyncio's loop): give it back; handlers only.
            signal.set_wakeup_fd(old)
            os.close(read)
            os.close(write)
            return
        self._pipe = (read, write)
        self._thread = threading.Thread(target=self._watch, args=(read,),
                                        name="colossalai-signals", daemon=True)
        self._thread.start()

    def _stop_watcher(self) -> None:
        if self._pipe is None:
            return
        read, write = self._pipe
        self._pipe = None
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)
        with contextlib.suppress(OSError):
            os.close(write)  # the watcher's read returns EOF and it ends
        if self._thread is not None:
            self._thread.join(1.0)
        with contextlib.suppress(OSError):
            os.close(read)

    def _watch(self, read: int) -> None:
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                # Not once uninstalled (the monitor closing): a late read would record
                # a signal the rank already handled and trained on after.
                if self._installed and signum in self._previous:
                    self._record(signum)
                    self._recorded_by_now(signum)
                    self._end_if_default(signum)

    def _end_if_default(self, signum: int) -> None:
        previous = self._previous.get(signum)
        if previous not in (signal.SIG_DFL, None):
            return  # a handler of the user's: it runs when the main thread can run it
        if signal.getsignal(signum) != self._handle:
            return  # the script installed its own handler since: that one decides
        # The default action was to end the process at once; the main thread may be
        # blocked in C and never run the Python handler. Restore the default in the
        # C library (Python's signal.signal works only in the main thread) and send
        # the signal again: the process ends by it, as it would have without us.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(signum, None)  # SIG_DFL is the null handler
        os.kill(os.getpid(), signum)

    def _before_fork(self) -> None:
        if self._installed:
            signal.pthread_sigmask(signal.SIG_BLOCK, RECORDED)

    def _unblock(self) -> None:
        if self._installed:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, RECORDED)

    def _forked(self) -> None:
        # In a forked child (a DataLoader worker): its signals are its own, never the
        # rank's. Its main thread is the one that forked, normally the rank's main; a
        # fork from another thread keeps the handlers, whose pid check then passes the
        # signal on unrecorded.
        if not self._installed:
            return
        if threading.current_thread() is threading.main_thread():
            self._installed = False
            self._thread = None
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(-1)
            if self._pipe is not None:
                for fd in self._pipe:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                self._pipe = None
            for signum, previous in self._previous.items():
                with contextlib.suppress(ValueError, OSError, TypeError):
                    signal.signal(signum,
                                  previous if previous is not None else signal.SIG_DFL)
        # What arrived meanwhile is delivered now, to the handlers the child had before.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, RECORDED)
