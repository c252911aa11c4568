"""Starting the demo's processes: the node agent and the training ranks.

The ranks run under torchrun (``python -m torch.distributed.run``, so it is the
torch of the running Python) for the torch backends, or as plain processes
with the ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` variables torchrun would set.
Each process is its own process group, so stopping the demo stops everything
it started and nothing else.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from colossalai_exporter.errors import ConfigError


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def choose_backend(requested: str) -> tuple[str, str]:
    """(backend, a sentence saying what runs and why) for ``auto`` or an explicit choice."""
    if requested == "auto":
        if installed("colossalai") and installed("torch"):
            requested = "colossalai"
        elif installed("torch"):
            return "torch", ("colossalai is not installed: running a plain torch DDP loop "
                             "(gloo) instead; install colossalai to see the Booster integration")
        else:
            return "plain", ("torch is not installed: running a plain Python loop instead; "
                             "for a torch or ColossalAI run, install them as "
                             "docs/training.md, 'Installing', says")
    for module in {"colossalai": ("torch", "colossalai"), "torch": ("torch",)}.get(requested, ()):
        if not installed(module):
            raise ConfigError(f"--backend {requested} needs {module}, which is not installed")
    sentences = {"colossalai": "ColossalAI Booster with TorchDDPPlugin on the CPU (gloo)",
                 "torch": "plain torch DistributedDataParallel on the CPU (gloo)",
                 "plain": "a plain Python loop (no torch)"}
    return requested, sentences[requested]


def check_port_free(host: str, port: int, what: str) -> None:
    """A clear error now rather than a server that silently fails to start later.

    With SO_REUSEADDR, as the servers themselves bind: a port whose old connections
    linger in TIME_WAIT (the last run's scrapes, a demo restarted within a minute) is
    free for a listener, and only one that something listens on is refused.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"{what} port {host}:{port} is not available: "
                              f"{exc.strerror}") from None


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class Started:
    """Processes the demo started, each the leader of its own process group."""

    procs: list[subprocess.Popen[bytes]]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def returncodes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def stop(self, timeout: float = 10.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout)


def spawn(argv: Sequence[str], log: IO[bytes], env: dict[str, str] | None = None
          ) -> subprocess.Popen[bytes]:
    return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def start_agent(host: str, port: int, run_dir: Path, checkpoint_dir: Path,
                log: IO[bytes]) -> Started:
    argv = [sys.executable, "-m", "colossalai_exporter", "node",
            "--web.listen-address", f"{host}:{port}", "--ranks.run-dir", str(run_dir),
            "--disk", f"checkpoints={checkpoint_dir}"]
    return Started([spawn(argv, log)])


def start_ranks(backend: str, ranks: int, worker_args: Sequence[str], host: str,
                log: IO[bytes], master_port: int = 0) -> Started:
    worker = ["-m", "colossalai_exporter.demo.worker", "--backend", backend, *worker_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # One thread per rank: the demo's model is tiny, and two ranks on a small
    # machine would otherwise fight over every core.
    env.setdefault("OMP_NUM_THREADS", "1")
    if backend in ("colossalai", "torch"):
        port = master_port or free_port(host)
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                "--master_addr", host, "--master_port", str(port), *worker]
        return Started([spawn(argv, log, env)])
    procs = []
    # No torchrun, so no rendezvous address the ranks share: name the run once for all.
    env.setdefault("COLOSSALAI_EXPORTER_RUN_ID", f"demo-{os.getpid()}")
    for rank in range(ranks):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks))
        procs.append(spawn([sys.executable, *worker], log, rank_env))
    return Started(procs)
