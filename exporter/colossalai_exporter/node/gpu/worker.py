"""The NVML worker process and the agent-side handle that drives it.

Why a process: an NVML call into a wedged GPU blocks inside the kernel driver
and never returns; a thread stuck there can never be stopped, and every later
scrape would queue behind it. A process can be abandoned and killed, and a
fresh one started.

The worker is a fresh interpreter running :func:`main`, started with
:class:`subprocess.Popen` (which execs at once): forking the agent, which runs
HTTP server threads, could copy a lock held by another thread into the child.
Not multiprocessing's ``spawn`` context: it would also start its
resource-tracker process (another 12 MB) that this worker never needs. Both
ends speak through a socketpair wrapped in
:class:`multiprocessing.connection.Connection` (length-prefixed pickles).

Messages (all picklable builtins or :mod:`.protocol` types):

- agent -> worker: ``("sample", request_id)`` or ``None`` to stop;
- worker -> agent: ``("ready", 0, failure_or_None)`` once after its first
  NVML initialisation, then ``("sample", request_id, Reading)`` per request.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from colossalai_exporter.node.gpu.protocol import Failure, Reading

#: How often the worker checks that the agent that started it is still alive.
_ORPHAN_CHECK_SECONDS = 1.0


def worker_main(conn: Connection, agent_pid: int) -> None:
    """Entry point of the worker process: initialise NVML, then answer requests."""
    _exit_when_orphaned(agent_pid)
    import pynvml

    from colossalai_exporter.node.gpu.reader import NvmlReader

    reader = NvmlReader(pynvml)
    # Initialise before the first request arrives: nvmlInit can take seconds
    # without persistence mode, and the agent should not pay it in a scrape.
    try:
        conn.send(("ready", 0, _safe(reader.initialise)))
        while True:
            message = conn.recv()
            if message is None:
                break
            _, request_id = message
            conn.send(("sample", request_id, _safe_sample(reader)))
    except (EOFError, OSError):
        pass  # the agent closed its end: it gave up on us or is gone
    finally:
        reader.shutdown()


def _safe(call: Any) -> Failure | None:
    try:
        result: Failure | None = call()
    except Exception as exc:  # a bug or a broken binding must not kill the worker
        return Failure("nvml_error", f"unexpected error in the NVML worker: {exc!r}")
    return result


def _safe_sample(reader: Any) -> Reading:
    try:
        reading: Reading = reader.sample()
    except Exception as exc:
        return Reading(failure=Failure("nvml_error",
                                       f"unexpected error in the NVML worker: {exc!r}"))
    return reading


def _exit_when_orphaned(agent_pid: int) -> None:
    """Exit once the agent is gone, even while the main thread hangs in NVML.

    pynvml releases the GIL during calls, so this thread keeps running while
    the main thread is stuck. (PR_SET_PDEATHSIG is not used: it fires when the
    *thread* that started the worker exits, and the agent may start it from a
    short-lived request thread.) The agent's pid comes from the agent, not from
    our own getppid() at start: an agent that died while we were still
    importing would otherwise leave us adopted, comparing against the adopter.
    """
    def watch() -> None:
        while os.getppid() == agent_pid:
            time.sleep(_ORPHAN_CHECK_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


#: The source root holding this package, so the worker imports the same copy.
_SOURCE_ROOT = str(Path(__file__).resolve().parents[3])
#: The worker's ``-c`` program: our source root replaces the current directory
#: (which ``-c`` would put first on sys.path) so no stray file there shadows
#: pynvml or this package.
_BOOT = ("import sys; sys.path[0] = sys.argv[1]; "
         "from colossalai_exporter.node.gpu.worker import main; sys.exit(main(sys.argv[2:]))")


class Worker:
    """Agent-side handle of one worker process (started at construction, not awaited)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        args = [sys.executable, "-c", _BOOT, _SOURCE_ROOT, str(theirs.fileno()), str(os.getpid())]
        self.started = time.monotonic()
        try:
            self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL,
                                            pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()  # so a dead worker reads as EOF on our end
        self.conn = Connection(ours.detach())
        # Connection.poll() builds a selector on every call (tens of microseconds,
        # twice a scrape); one poll object, registered once, does the same check.
        self._poller = select.poll()
        self._poller.register(self.conn.fileno(), select.POLLIN)
        #: set once the worker answered its first initialisation
        self.ready = False
        #: id of the sample request not yet answered, if any
        self.pending: int | None = None
        self._next_id = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    def exitcode(self) -> int | None:
        return self.process.poll()

    def readable(self, timeout: float) -> bool:
        """``conn.poll(timeout)``: an answer (or EOF) waiting within ``timeout`` seconds."""
        if self.conn.closed:
            raise OSError("the worker's connection is closed")
        return bool(self._poller.poll(max(0.0, timeout) * 1000))

    def request(self) -> int:
        self._next_id += 1
        self.pending = self._next_id
        self.conn.send(("sample", self._next_id))
        return self._next_id

    def age(self) -> float:
        return time.monotonic() - self.started

    def kill(self) -> None:
        """Kill without waiting: a process stuck in the driver may take a while to die."""
        with contextlib.suppress(OSError):
            self.conn.close()
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.process.kill()

    def stop(self, grace: float = 0.5) -> None:
        """Ask the worker to exit, killing it if it does not within ``grace``."""
        with contextlib.suppress(OSError):
            self.conn.send(None)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(grace)
        self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(grace)

    def reaped(self) -> bool:
        """True once the process has exited and been waited for."""
        return self.process.poll() is not None


def main(argv: list[str]) -> int:
    """Worker command line: ``FD AGENT_PID`` (FD: our end of the socketpair)."""
    conn = Connection(int(argv[0]))
    worker_main(conn, int(argv[1]))
    return 0
