"""The NVML worker process and the agent-side handle that drives it.

Why a process: an NVML call into a wedged GPU blocks inside the kernel driver
and never returns; a thread stuck there can never be stopped, and every later
scrape would queue behind it. A process can be abandoned and killed, and a
fresh one started. The worker is started with multiprocessing's ``spawn``
context: forking the agent, which runs HTTP server threads, could copy a lock
held by another thread into the child.

Messages over the pipe (all picklable builtins or :mod:`.protocol` types):

- agent -> worker: ``("sample", request_id)`` or ``None`` to stop;
- worker -> agent: ``("ready", 0, failure_or_None)`` once after its first
  NVML initialisation, then ``("sample", request_id, Reading)`` per request.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from colossalai_exporter.node.gpu.protocol import Failure, Reading

#: How often the worker checks that the agent that started it is still alive.
_ORPHAN_CHECK_SECONDS = 1.0


def worker_main(conn: Connection, fake_scenario: str | None) -> None:
    """Entry point of the worker process: initialise NVML, then answer requests."""
    _exit_when_orphaned()
    nvml: Any
    if fake_scenario:
        from colossalai_exporter.node.gpu.protocol import FAKE_NVML_ENV

        os.environ[FAKE_NVML_ENV] = fake_scenario
        from colossalai_exporter.node.gpu import fake_nvml

        nvml = fake_nvml
    else:
        import pynvml

        nvml = pynvml
    from colossalai_exporter.node.gpu.reader import NvmlReader

    reader = NvmlReader(nvml)
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


def _exit_when_orphaned() -> None:
    """Exit once the agent is gone, even while the main thread hangs in NVML.

    pynvml releases the GIL during calls, so this thread keeps running while
    the main thread is stuck. (PR_SET_PDEATHSIG is not used: it fires when the
    *thread* that started the worker exits, and the agent may start it from a
    short-lived request thread.)
    """
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(_ORPHAN_CHECK_SECONDS)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


class Worker:
    """Agent-side handle of one worker process."""

    def __init__(self, fake_scenario: str | None) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process: BaseProcess = context.Process(
            target=worker_main, args=(child_conn, fake_scenario),
            name="colossalai-exporter-nvml", daemon=True)
        self.started = time.monotonic()
        self.process.start()
        child_conn.close()  # so a dead worker reads as EOF on our end
        #: set once the worker answered its first initialisation
        self.ready = False
        #: id of the sample request not yet answered, if any
        self.pending: int | None = None
        self._next_id = 0

    @property
    def pid(self) -> int | None:
        return self.process.pid

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
        if self.process.is_alive():
            self.process.kill()

    def stop(self, grace: float = 0.5) -> None:
        """Ask the worker to exit, killing it if it does not within ``grace``."""
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(grace)
        self.kill()
        self.process.join(grace)

    def reaped(self) -> bool:
        """True once the process has exited and been waited for."""
        self.process.join(0)
        return self.process.exitcode is not None
