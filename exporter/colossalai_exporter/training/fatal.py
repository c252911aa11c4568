"""How the process ends, recorded before it does: an uncaught exception, or a normal exit
with the run neither finished nor failed.

A training script that does not wrap its loop in ``with TrainingMonitor()``
still dies of an uncaught exception (an out-of-memory error in
``booster.boost``, a kernel that will not build) through :data:`sys.excepthook`.
The monitor chains itself in front of the hook that was there, marks the run
``failed`` with the exception as its reason, writes the snapshot synchronously
(the node agent must see why the rank is about to vanish), then calls the
previous hook, so the traceback is printed exactly as before. torchrun's
``@record`` wrapper re-raises, so it gets here too.

Only the main thread's hook: an exception ending another thread does not end
the run.

A script that ends without ``monitor.finish()`` (its loop ran out, ``sys.exit()``)
exits normally: :mod:`atexit` then ends each started monitor's run
(``TrainingMonitor._exiting``), so that the node agent reads a normal end and not a
process that vanished without a word (which it must judge killed). Not after a signal
(the rank records that itself) nor ``os._exit``, which runs no handler.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from colossalai_exporter.training.monitor import TrainingMonitor

_lock = threading.Lock()
_monitors: list[TrainingMonitor] = []
_previous: list[Any] = []  # the hook this one replaced, while installed
# Every monitor started in this process, closed or not: a script that calls close()
# without finish() still ends its run normally at exit. Weak: a monitor dropped is gone.
_started: weakref.WeakSet[TrainingMonitor] = weakref.WeakSet()


def _hook(exc_type: type[BaseException], exc: BaseException,
          tb: TracebackType | None) -> None:
    with _lock:
        monitors = list(_monitors)
    if isinstance(exc, Exception):  # not KeyboardInterrupt / SystemExit: those are not failures
        for monitor in monitors:
            with contextlib.suppress(Exception):  # the traceback below must still print
                monitor.fail(exc)
    (_previous[0] if _previous else sys.__excepthook__)(exc_type, exc, tb)


def _at_exit() -> None:
    with _lock:
        monitors = list(_started)
    for monitor in monitors:
        with contextlib.suppress(Exception):  # the interpreter is ending: nothing to raise to
            monitor._exiting()


# Registered once, at import: with no monitor started it has nothing to do.
atexit.register(_at_exit)


def attach(monitor: TrainingMonitor) -> None:
    with _lock:
        _started.add(monitor)
        if sys.excepthook is not _hook:
            _previous[:] = [sys.excepthook]
            sys.excepthook = _hook
        if monitor not in _monitors:
            _monitors.append(monitor)


def detach(monitor: TrainingMonitor) -> None:
    with _lock:
        if monitor in _monitors:
            _monitors.remove(monitor)
        if not _monitors and sys.excepthook is _hook:
            sys.excepthook = _previous[0] if _previous else sys.__excepthook__
            _previous.clear()
