"""The training script the fault suite runs: docs/training.md's loop, with one failure injected.

Run under torchrun (2 ranks, gloo, ColossalAI's Booster with TorchDDPPlugin), as a
user would write it: the monitor is created after ``launch_from_torch``, the model
is boosted through it, each step is a ``with monitor.step()`` block, checkpoints
go through the watched ``booster.save_model``. It has no ``with TrainingMonitor()``
and catches nothing it would not catch in real life, so an uncaught exception ends
the rank the way it ends a real one (``sys.excepthook``, exit 1, torchrun stops
the others).

``FAULT`` names the failure and ``FAULT_RANK`` the rank that has it. Failures of
the running loop wait for SIGUSR1, which the test sends once Prometheus has seen
the run healthy; start-up failures (kernels) happen on their own.

Two start-up failures happen before the process group exists: ``slow_start``, the
faulty rank blocked before ``launch_from_torch`` (the others wait for it in
``init_process_group``), and ``ranks_never_start``, a world twice torchrun's, as a
launcher that starts each rank itself gives it when half its ranks' nodes never come
up (the ranks that did start wait in ``init_process_group`` for the rest), and
``master_never_starts``, the same where the node that did not come up is the master's:
ranks 0 and 1 and the rendezvous store are missing, and ranks 2 and 3 cannot reach it.

``TOPOLOGY`` shapes the job: ``booster`` (the default: ColossalAI's Booster with
TorchDDPPlugin, gradients all-reduced in backward), ``pairs`` (four ranks, plain
torch: each step an all-reduce within a pair, ``new_group([0, 1])`` and
``new_group([2, 3])``, then one over all ranks), ``mesh`` (four ranks, ColossalAI's
``ProcessGroupMesh(2, 2)``: an all-reduce in each rank's tensor-parallel group, then
in its data-parallel group) and ``pipeline`` (two stages, plain torch: stage 0 sends
its activations to stage 1 with ``dist.send``, stage 1 sends the gradient back). Nothing here
fakes a failure's text: the out-of-memory errors are the exception types and
texts ColossalAI and torch raise (FACTS.md), the host allocation failure, the
full disk, the checkpoint target that is a file, the kernel that does not load
and the call that holds the GIL are real.

Three failures run on past the hang, as a real job does once its process group's
timeout passes. ``hang_then_timeout`` gives the process group the timeout a user
passes to ``init_process_group`` (``PG_TIMEOUT`` seconds; ColossalAI's launch passes
none, so torch's default is set before it), and gloo's own timeout ends the ranks that
wait: a real error, raised in Python; ``hang_then_short_timeout`` is the same with a
timeout shorter than the step budget, as a job of long steps has.
``hang_then_watchdog`` is what ProcessGroupNCCL does instead, which gloo cannot: its
watchdog thread, finding a collective in flight past the timeout, logs "Watchdog
caught collective operation timeout" and tears the process down from C++
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s default): the rank dies by SIGABRT with no
Python error. :func:`nccl_watchdog` stands in for that thread (the one stand-in
here): it reads the flight recorder as the watchdog reads its work list, and aborts
the rank once a collective has been in flight for its group's timeout, a moment
before gloo's own timeout (the same one) would raise. The frozen rank froze in
compute, before its backward's collective: it has nothing in flight to time out.
``hang_then_short_watchdog`` is that with a timeout shorter than the step budget.
"""

from __future__ import annotations

import ctypes
import datetime
import io
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import colossalai
import torch
from colossalai.booster import Booster
from colossalai.booster.plugin import TorchDDPPlugin

from colossalai_exporter import Budgets, TrainingMonitor

FAULT = os.environ.get("FAULT", "none")
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
TOPOLOGY = os.environ.get("TOPOLOGY", "booster")
CHECKPOINT_DIR = Path(os.environ["CHECKPOINT_DIR"])
STEP_SECONDS = 0.05  # stands in for the real work of a step
LAYERS_SECONDS = 1.5  # solo_eval_layers: the compute between a step's two collectives
# The hang_then_* faults' process group timeout: past the step budget, so the hang pages
# first (and what it mutes fires, with room on a loaded machine). The short ones' is
# within their budget (40 s, below): the run dies before the rank counts as stalled.
SHORT_TIMEOUTS = ("hang_then_short_timeout", "hang_then_short_watchdog")
PG_TIMEOUT = 15.0 if FAULT in SHORT_TIMEOUTS else 30.0
WATCHDOGS = ("hang_then_watchdog", "hang_then_short_watchdog")
HANGS = ("frozen_compute", "hang_then_timeout", "hang_then_short_timeout", *WATCHDOGS)
# The model under torch.compile; once armed, the faulty rank's next batch is the epoch's
# short last one (a new shape), which dynamo compiles again: 12 s (recompile, a large
# model's compile with inductor), or for ever (recompile_hangs).
COMPILES = ("recompile", "recompile_hangs")
# Rank 0's validation or torch.save inside the step's block (the loop's whole body in it)
WORK_IN_STEP = ("eval_in_step", "save_in_step", "eval_in_step_hangs")
RECOMPILE_SECONDS = 12.0
# Once armed, the faulty rank's loader starts its next epoch: a fresh iterator whose
# worker takes 12 s before its first batch (epoch_start: workers that import and open
# their shards), or never gives it (epoch_start_hangs: a shard's open that never returns).
EPOCH_STARTS = ("epoch_start", "epoch_start_hangs")
EPOCH_START_SECONDS = 12.0
CHECKPOINT_EVERY = int(os.environ.get("CHECKPOINT_EVERY", "50"))

# torch.OutOfMemoryError's text as a Gemini run on an H200 raised it (FACTS.md).
CUDA_OOM = ("CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total capacity "
            "of 139.80 GiB of which 137.65 GiB is free. Of the allocated memory 1.40 GiB is "
            "allocated by PyTorch.")
GEMINI_LAYOUT = "Adjust layout failed! No enough CUDA memory! Need 2147483648, 1073741824 left"

armed = threading.Event()
signal.signal(signal.SIGUSR1, lambda signum, frame: armed.set())
slow_compile = threading.Event()  # the faulty rank's next compile is the slow one


def compile_backend(gm: Any, example_inputs: Any) -> Any:
    """torch.compile's backend in the compile faults: dynamo's graph, run as it is (no
    C++ compiler needed), called by dynamo's compiler as inductor is. The slow compile
    takes as long as inductor on a large model's graph, or waits for ever, as a compile
    behind a stale lock in a shared inductor cache does (the GIL released)."""
    if slow_compile.is_set():
        slow_compile.clear()
        if FAULT == "recompile_hangs":
            threading.Event().wait()
        time.sleep(RECOMPILE_SECONDS)
    return gm.forward


def planned_step() -> int | None:
    """The step at which every rank does what the test asked (finish, a slow
    checkpoint): written by the test before it signals, so that all ranks act at the
    same step, as a real loop's end or checkpoint interval makes them."""
    try:
        return int((CHECKPOINT_DIR / "at-step").read_text())
    except (OSError, ValueError):
        return None


class RandomBatches(torch.utils.data.IterableDataset[torch.Tensor]):
    """The data loader's source; with FAULT=data_stuck it blocks, once armed, on the
    faulty rank: a read from a network filesystem that never returns."""

    def __init__(self, stuck: bool, hoards: bool = False) -> None:
        self.stuck = stuck
        self.hoards = hoards

    def __iter__(self) -> Any:
        while True:
            if self.stuck and armed.is_set():
                time.sleep(3600)
            if self.hoards and (CHECKPOINT_DIR / "worker-hoards").exists():
                # In a DataLoader worker (FAULT=oom_kill_worker), armed by a file (the
                # test's signal reaches the rank, not its worker): memory that grows
                # until the kernel's OOM killer ends the worker, as a leaking or
                # oversized prefetch does.
                hoard = []
                while True:
                    hoard.append(bytearray(16 * 1024 * 1024))
            yield torch.randn(16, 32)


class NextEpoch(torch.utils.data.IterableDataset[torch.Tensor]):
    """The next epoch's data, read in a worker process that takes its time to start (its
    imports, its first shard opened from a network filesystem), or never does."""

    def __init__(self, hangs: bool) -> None:
        self.hangs = hangs

    def __iter__(self) -> Any:
        if self.hangs:
            threading.Event().wait()
        time.sleep(EPOCH_START_SECONDS)
        while True:
            yield torch.randn(16, 32)


def slow_kernel_loader() -> Any:
    """A real ``KernelLoader`` whose only extension takes ten minutes to build.

    What a JIT build behind a stale lock in the extension cache looks like: the
    loader's own ``load()`` picks the extension and calls its ``load()``, which
    never returns in time.
    """
    from colossalai.kernel.extensions.base_extension import _Extension
    from colossalai.kernel.kernel_loader import KernelLoader

    class StuckBuild(_Extension):
        def __init__(self) -> None:
            super().__init__(name="stuck_build", support_aot=False, support_jit=True)

        def is_available(self) -> bool:
            return True

        def assert_compatible(self) -> None:
            pass

        def build_aot(self) -> Any:
            raise NotImplementedError

        def build_jit(self) -> Any:
            time.sleep(600)  # waiting for a lock nobody releases

        def load(self) -> Any:
            return self.build_jit()

    class StuckLoader(KernelLoader):
        REGISTRY = [StuckBuild]  # noqa: RUF012 - ColossalAI's own class attribute

    return StuckLoader().load()


# The step budget: 5 s, so that a fault pages within the suite's deadlines. The healthy
# run (FAULT=lifecycle), which must page nobody, runs longest beside the tests' own load
# (its 4 ranks, agent and Prometheus restarts, on two cores): a starved CPU held a step
# of its rank 0 for 10 s once, with two suites on the machine. Its budget leaves room
# for that; its checkpoint's (5 s, against a 3 s checkpoint) is the point of the case.
STEP_BUDGET = 40.0 if FAULT in SHORT_TIMEOUTS else {"lifecycle": 20.0}.get(FAULT, 5.0)
# The checkpoint budget: 5 s, so that a stuck save pages soon; the rank-0 saves' is a
# real one's, far above the step budget, as a large model's save takes minutes.
CHECKPOINT_BUDGET = {"rank0_save": 60.0, "unwrapped_save": 60.0, "upload": 60.0,
                     "upload_subprocess": 60.0, "save_in_step": 60.0}.get(FAULT, 5.0)
# The compile budget: a real one's (30 m), except where the recompile hangs.
COMPILE_BUDGET = {"recompile_hangs": 5.0}.get(FAULT, 1800.0)
# The data loader start's budget: a real one's (10 m), except where the start hangs.
DATA_START_BUDGET = {"epoch_start_hangs": 5.0}.get(FAULT, 600.0)
RANK0_SAVE_SECONDS = 12.0  # beyond the step budget (5 s) twice over
# The evaluation budget: a real one's (an hour), except where the evaluation hangs.
EVALUATION_BUDGET = {"eval_hangs": 5.0, "eval_in_step_hangs": 5.0}.get(FAULT, 3600.0)
# The start-up budget: a real one's (model set-up, the rendezvous), except where the
# start-up itself is the failure.
# Where the master node is missing, a budget longer than the rendezvous alert's `for`
# (10 s here, 1 m shipped, where the budget is minutes): the store's page comes first.
STARTUP_BUDGET = {"slow_start": 5.0, "ranks_never_start": 5.0,
                  "master_never_starts": 30.0}.get(FAULT, 120.0)


def main() -> int:
    if FAULT == "ranks_never_start":
        # A world twice torchrun's, as a launcher that starts every rank itself (srun,
        # mpirun) gives each rank: the other half's node never came up, so this half
        # waits for it in init_process_group.
        os.environ["WORLD_SIZE"] = str(2 * int(os.environ["WORLD_SIZE"]))
    if FAULT == "master_never_starts":
        # The same, with the other half the master node's: ranks 0 and 1, and the
        # rendezvous store that rank 0's launcher hosts, never came up. This half is
        # the world's second, and its store's port refuses every connect.
        world = int(os.environ["WORLD_SIZE"])
        os.environ["WORLD_SIZE"] = str(2 * world)
        os.environ["RANK"] = str(int(os.environ["RANK"]) + world)
        os.environ["MASTER_PORT"] = os.environ["DEAD_MASTER_PORT"]
    # First, as docs/training.md shows: a start that dies in the rendezvous is seen too.
    monitor = TrainingMonitor(
        budgets=Budgets(step=STEP_BUDGET, checkpoint=CHECKPOINT_BUDGET, kernels=5.0,
                        startup=STARTUP_BUDGET, evaluation=EVALUATION_BUDGET,
                        compile=COMPILE_BUDGET, data_start=DATA_START_BUDGET),
        publish_interval=0.5)
    if FAULT == "resume_fails" and monitor.rank == FAULT_RANK:
        # Every start reads the data shard the last run got to, which is gone: the
        # same exception at each of torchrun's restarts, a crash loop.
        with open(CHECKPOINT_DIR / "data" / "shard-00017.bin", "rb") as shard:
            shard.read()
    if FAULT == "slow_start" and monitor.rank == FAULT_RANK:
        prepare_data()
    if FAULT.startswith("hang_then_"):
        # What init_process_group(timeout=...) sets; ColossalAI's launch passes none.
        import torch.distributed.distributed_c10d as c10d

        c10d.default_pg_timeout = datetime.timedelta(seconds=PG_TIMEOUT)
    colossalai.launch_from_torch(backend="gloo", verbose=False)
    rank = monitor.rank
    mine = rank == FAULT_RANK
    if FAULT in WATCHDOGS and not mine:
        threading.Thread(target=nccl_watchdog, args=(rank,), daemon=True).start()
    torch.manual_seed(0)
    model: Any = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                     torch.nn.Linear(64, 1))
    if FAULT == "kernel_build_fails":
        # HybridAdam loads ColossalAI's CPU Adam kernel; on a machine without one:
        # "AssertionError: No usable kernel found for CPUAdamLoader on the current machine."
        from colossalai.nn.optimizer import HybridAdam

        optimizer: Any = HybridAdam(model.parameters(), lr=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if FAULT == "kernel_build_slow" and mine:
        slow_kernel_loader()
    criterion: Any = torch.nn.MSELoss()
    if FAULT in COMPILES:
        model = torch.compile(model, backend=compile_backend)
    if TOPOLOGY == "booster":
        booster = Booster(plugin=TorchDDPPlugin())
        model, optimizer, criterion, _, _ = monitor.boost(booster, model, optimizer, criterion)
        step_fn = booster_step(booster, model, optimizer, criterion)
    else:
        booster = None
        step_fn = collectives_step(model, criterion)
        if TOPOLOGY == "pipeline":
            # What a plain-torch pipeline tells the monitor (docs/training.md); ColossalAI's
            # HybridParallelPlugin is read for it.
            monitor.set_info(pipeline_stage=rank)
    print(f"rank {rank}: training", flush=True)
    worker_oom = FAULT == "oom_kill_worker" and mine
    batches = iter(torch.utils.data.DataLoader(
        RandomBatches(FAULT == "data_stuck" and mine, hoards=worker_oom), batch_size=None,
        num_workers=1 if worker_oom else 0))
    step_seconds = STEP_SECONDS

    step = 0
    slow_moments_done = False
    while True:
        step += 1
        x = next(batches)
        if armed.is_set() and FAULT == "all_slow":
            step_seconds = 1.0  # every rank: slower, well within the 5 s budget
        if armed.is_set() and FAULT in ("finish", "lifecycle") and step == planned_step():
            if FAULT == "finish" or slow_moments_done:
                monitor.finish()  # a clean end: what a run that completes does
                return 0
            # A healthy run's slow moments: a checkpoint of 3 s (its budget is 5 s) and an
            # evaluation longer than the step budget on every rank; training goes on until
            # the next signal.
            armed.clear()
            slow_moments_done = True
            with monitor.checkpoint(step):
                save(booster, model, CHECKPOINT_DIR / f"lifecycle-{rank}.pt")
                time.sleep(3)
            with monitor.evaluation():
                time.sleep(STEP_BUDGET + 3)
        if armed.is_set() and FAULT in ("finish_early", "finish_early_held") and mine:
            # This rank's data ran out a step before the others' (an uneven shard): its
            # loop ends, and the run is finished as `with TrainingMonitor()` finishes it.
            monitor.finish()
            if FAULT == "finish_early_held":
                hold_connections_open()
            return 0
        if armed.is_set() and FAULT == "exit_unfinished" and step == planned_step():
            return 0  # the loop's end, in a script that never calls monitor.finish()
        if armed.is_set() and FAULT == "after_the_loop" and step == planned_step():
            # The loop's end, then work on rank 0 alone that the monitor is not told of
            # (a final save with torch.save, an upload, a conversion), longer than a
            # step's budget, while the other ranks have exited; no monitor.finish().
            if rank == 0:
                after_training(model)
            return 0
        if armed.is_set() and FAULT in EPOCH_STARTS and mine:
            # The epoch's end on this rank: its loader starts again, a fresh iterator and a
            # worker process, while the other rank, quicker, waits for it in the step's
            # all-reduce.
            armed.clear()
            batches = iter(torch.utils.data.DataLoader(
                NextEpoch(hangs=FAULT == "epoch_start_hangs"), batch_size=None,
                num_workers=1))
            x = next(batches)
        if armed.is_set() and FAULT in COMPILES and mine:
            armed.clear()
            slow_compile.set()
            x = x[:15]  # the epoch's short last batch: a new shape, compiled again
        fault_now = (armed.is_set() and mine) or hang_after_checkpoint.is_set()
        try:
            with monitor.step(samples=16) as current:
                if fault_now:
                    inject_in_step()
                current.loss = step_fn(x)
                if armed.is_set() and FAULT in WORK_IN_STEP and rank == 0:
                    # The loop's whole body in the step's block, as many scripts write it:
                    # rank 0's periodic validation, or its torch.save, inside the step,
                    # while the others go on into the next step's all-reduce.
                    armed.clear()
                    if FAULT.startswith("eval_in_step"):
                        validate(model, batches, hangs=FAULT == "eval_in_step_hangs")
                    else:
                        unwrapped_save(model, step, hangs=False)
                time.sleep(step_seconds)
            last_step_done[0] = time.monotonic()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if FAULT not in ("oom_caught", "host_oom"):
                raise
            # The retry a user writes around an out-of-memory error: skip the batch.
            print(f"rank {rank}: step {step} skipped: {str(exc).splitlines()[0]}", flush=True)
            armed.clear()
            continue
        if armed.is_set() and FAULT == "extra_barrier" and mine:
            # A collective on one rank only (logging code under `if rank == 1:`): the
            # ranks' collectives no longer match.
            armed.clear()
            import torch.distributed as dist

            dist.barrier()
        if armed.is_set() and FAULT == "rank0_save":
            # The tutorial's save (docs/training.md's starting point): rank 0 alone, now and
            # then, while the other ranks go on into the next step and wait for it in its
            # all-reduce. Longer than the step budget, as a large model's save is.
            armed.clear()
            with monitor.checkpoint(step):
                save(booster, model, CHECKPOINT_DIR / f"rank0-{step}.pt")
                time.sleep(RANK0_SAVE_SECONDS)
        if armed.is_set() and FAULT.startswith("unwrapped_save") and rank == 0:
            # The tutorial's save as most scripts keep it: rank 0 alone, torch.save into a
            # slow filesystem, without monitor.checkpoint() (and not through the
            # booster), longer than the step budget, while the others wait for it in the
            # next step's all-reduce; with unwrapped_save_hangs, a write that never
            # returns (a hung mount, the GIL released).
            armed.clear()
            unwrapped_save(model, step, hangs=FAULT == "unwrapped_save_hangs")
        if armed.is_set() and FAULT.startswith("upload") and rank == 0:
            # A save through the watched booster, then rank 0 alone uploads it (to an
            # object store, the Hub) before it goes on, longer than the step budget, while
            # the others wait for it in the next step's all-reduce; with upload_hangs, an
            # upload to a server that stopped reading (a write that never returns); with
            # upload_subprocess, the upload is a child process's (`aws s3 cp`).
            armed.clear()
            saved = CHECKPOINT_DIR / f"upload-{step}.pt"
            save(booster, model, saved)
            upload(saved, hangs=FAULT == "upload_hangs", child=FAULT == "upload_subprocess")
        if armed.is_set() and FAULT in ("solo_eval", "solo_eval_layers"):
            # An evaluation on one rank only (a rank that holds the validation set), as
            # long as the rank-0 save, while the others wait for it in the next step.
            armed.clear()
            with monitor.evaluation():
                time.sleep(RANK0_SAVE_SECONDS)
        if armed.is_set() and FAULT == "unwrapped_eval":
            # A validation loop as most scripts write it: model.eval(), batches under
            # no_grad, model.train(); longer than the step budget, and the monitor not
            # told (no monitor.evaluation()).
            armed.clear()
            validate(model, batches)
        if armed.is_set() and FAULT == "eval_hangs":
            # Every rank's validation reads its shard from a shared filesystem that hangs:
            # no rank waits for another, each is stuck in its own read (GIL released).
            armed.clear()
            with monitor.evaluation():
                read_validation_shard()
        if armed.is_set() and FAULT == "long_eval":
            armed.clear()
            with monitor.evaluation():
                time.sleep(20)  # far over the step budget, well within evaluation's
        requested = FAULT.startswith("checkpoint") or (
            FAULT == "gil_hang_after_checkpoint" and mine)
        if armed.is_set() and requested:
            # A save the test asked for, into the target it prepared (full, a file, hung).
            armed.clear()
            save(booster, model, CHECKPOINT_DIR / "requested.pt")
            if FAULT == "gil_hang_after_checkpoint":
                hang_after_checkpoint.set()
        elif step % CHECKPOINT_EVERY == 0:
            save(booster, model, CHECKPOINT_DIR / f"step-{step}.pt")


hang_after_checkpoint = threading.Event()
last_step_done: list[float | None] = [None]  # monotonic, once a step completed


def nccl_watchdog(rank: int) -> None:
    """ProcessGroupNCCL's watchdog, for the ``hang_then_*watchdog`` faults (module
    docstring): a collective in flight (not completed) for its group's timeout, as the
    flight recorder has it, then the message on stderr and the process torn down by
    SIGABRT. 0.3 s early, so that gloo's own timeout, which would raise a Python
    error, does not come first."""
    from torch._C._distributed_c10d import _dump_fr_trace

    while True:
        time.sleep(0.1)
        recorded = pickle.loads(_dump_fr_trace(includeCollectives=True,
                                               includeStackTraces=False, onlyActive=True))
        for entry in recorded.get("entries") or ():
            if entry.get("retired") or entry.get("state") == "completed":
                continue
            waited_ms = (time.time_ns() - entry["time_created_ns"]) / 1e6
            if waited_ms > entry["timeout_ms"] - 300:
                print(f"[rank{rank}]:[E] [PG ID 0 PG GUID 0 Rank {rank}] Watchdog caught "
                      f"collective operation timeout: WorkNCCL(SeqNum="
                      f"{entry['collective_seq_id']}, OpType=ALLREDUCE, Timeout(ms)="
                      f"{entry['timeout_ms']}) ran for {waited_ms:.0f} milliseconds before "
                      "timing out.", file=sys.stderr, flush=True)
                os.abort()


def hold_connections_open() -> None:
    """What NCCL within a node does when a peer process ends: nothing its peers can see
    (shared memory and CUDA IPC have no connection to close), so they wait in their
    collective until the process group's timeout. gloo sees a closed socket at once; a
    child that inherits the rank's sockets and outlives it keeps them open, for a
    bounded time (it ends by itself)."""
    if os.fork() == 0:
        time.sleep(120)
        os._exit(0)


class ThrottledFile(io.RawIOBase):
    """A file written at a network filesystem's slow pace: 4 MiB in about 12 s, beyond
    the 5 s step budget (``RANK0_SAVE_SECONDS``). torch.save calls its ``write``."""

    RATE = 4 * 2**20 / RANK0_SAVE_SECONDS  # bytes a second

    def __init__(self, path: Path, hangs: bool = False) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self._hangs = hangs

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = len(memoryview(data).cast("B"))
        time.sleep(3600 if self._hangs else size / self.RATE)
        return self._file.write(data)

    def close(self) -> None:
        self._file.close()
        super().close()


# What ``aws s3 cp`` does in the child process: one PUT of the file and its shards.
CHILD_UPLOAD = """
import http.client, sys
body = open(sys.argv[1], "rb").read() + bytes(4 * 2**20)
connection = http.client.HTTPConnection("127.0.0.1", int(sys.argv[2]), timeout=3600)
connection.request("PUT", "/checkpoints/" + sys.argv[1].rsplit("/", 1)[-1], body=body)
connection.getresponse().read()
"""


def upload(path: Path, hangs: bool, child: bool = False) -> None:
    """An HTTP PUT of ``path`` and 4 MiB more (a checkpoint's shards) to an object store
    on loopback that reads it at a remote store's slow pace, about 12 s
    (``RANK0_SAVE_SECONDS``); with ``hangs``, one that stops reading: the write blocks
    once the socket's buffers are full, and never returns. With ``child``, the PUT is a
    child process's, as a script that runs ``aws s3 cp`` waits for it."""
    import http.client
    import http.server
    import subprocess

    body = path.read_bytes() + bytes(4 * 2**20)
    rate = len(body) / RANK0_SAVE_SECONDS  # bytes a second

    class SlowStore(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            left = int(self.headers["Content-Length"])
            while left:
                if hangs:
                    time.sleep(3600)
                chunk = self.rfile.read(min(left, 64 * 1024))
                left -= len(chunk)
                time.sleep(len(chunk) / rate)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    store = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowStore)
    threading.Thread(target=store.serve_forever, daemon=True).start()
    if child:
        subprocess.run([sys.executable, "-c", CHILD_UPLOAD, str(path),
                        str(store.server_address[1])], check=True, timeout=3600)
    else:
        connection = http.client.HTTPConnection("127.0.0.1", store.server_address[1],
                                                timeout=3600)
        connection.request("PUT", f"/checkpoints/{path.name}", body=body)
        connection.getresponse().read()
        connection.close()
    store.shutdown()


def read_validation_shard() -> None:
    """A validation shard's read from a shared filesystem that hangs (every rank's)."""
    time.sleep(3600)


def prepare_data() -> None:
    """What a rank does before it joins the process group (a dataset index read from a
    network filesystem), blocked: a read that never returns, the GIL released."""
    time.sleep(600)


def after_training(model: Any) -> None:
    """What a script does after its loop on rank 0: a final save, then an upload."""
    torch.save(model.state_dict(), CHECKPOINT_DIR / "final.pt")
    time.sleep(RANK0_SAVE_SECONDS)  # the upload


def unwrapped_save(model: Any, step: int, hangs: bool) -> None:
    """torch.save of the model into a slow filesystem (``ThrottledFile``), without
    monitor.checkpoint() and not through the booster; ``hangs``: a write that never
    returns."""
    with ThrottledFile(CHECKPOINT_DIR / f"unwrapped-{step}.pt", hangs=hangs) as out:
        torch.save({"model": model.state_dict(), "optimizer": torch.zeros(1 << 20)}, out)


def validate(model: Any, batches: Any, hangs: bool = False) -> None:
    """A validation loop as most scripts write it (model.eval(), batches under no_grad,
    model.train()), for ``RANK0_SAVE_SECONDS``; the monitor not told. ``hangs``: its
    shard's read from a shared filesystem never returns."""
    model.eval()
    deadline = time.monotonic() + RANK0_SAVE_SECONDS
    with torch.no_grad():
        while time.monotonic() < deadline:
            if hangs:
                read_validation_shard()
            model(next(batches))
            time.sleep(0.1)
    model.train()


def save(booster: Any, model: Any, path: Path) -> None:
    if booster is not None:
        booster.save_model(model, str(path))  # watched by the monitor: phase checkpointing
    else:
        torch.save(model.state_dict(), path)


def booster_step(booster: Any, model: Any, optimizer: Any, criterion: Any) -> Any:
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = criterion(model(x), x[:, :1] * 2.0 + 0.1)
        booster.backward(loss, optimizer)  # DDP all-reduces the gradients here
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()
    return step


def collectives_step(model: Any, criterion: Any) -> Any:
    """A step of plain collectives in the shape ``TOPOLOGY`` names (module docstring)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if TOPOLOGY == "pairs":
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
        first, second = pairs[rank // 2], None
    elif TOPOLOGY == "mesh":
        from colossalai.cluster import ProcessGroupMesh

        mesh = ProcessGroupMesh(2, 2)
        first, second = mesh.get_group_along_axis(1), mesh.get_group_along_axis(0)
    elif TOPOLOGY != "pipeline":
        raise SystemExit(f"unknown TOPOLOGY {TOPOLOGY!r}")

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            loss = criterion(model(x), x[:, :1])
        grad = torch.ones(8)
        if TOPOLOGY == "pipeline":
            # stage 0 -> stage 1 (activations), stage 1 -> stage 0 (gradients)
            if rank == 0:
                dist.send(grad, 1)
                dist.recv(grad, 1)
            else:
                dist.recv(grad, 0)
                dist.send(grad, 0)
        else:
            dist.all_reduce(grad, group=first)
            if FAULT == "solo_eval_layers":
                # The model's layers between the two collectives, every step: a rank
                # released from the first after a long wait computes here, stalled,
                # while the ranks released earlier wait for it in the second.
                time.sleep(LAYERS_SECONDS)
            dist.all_reduce(grad, group=second)  # None: every rank
        return loss
    return step


def inject_in_step() -> None:
    if FAULT in ("oom_caught", "oom_fatal"):
        raise torch.OutOfMemoryError(CUDA_OOM)
    if FAULT == "gemini_layout":
        raise RuntimeError(GEMINI_LAYOUT)
    if FAULT == "host_oom":
        torch.empty(2**45, dtype=torch.uint8)  # 32 TiB: the CPU allocator refuses
    if FAULT in ("straggler", "heavy_stage"):
        # every step, within the 5 s budget: a slower GPU, say; or, in a pipeline, a
        # stage with more to do (the last stage's LM head and loss)
        time.sleep(0.25)
    if FAULT in HANGS:
        time.sleep(3600)  # a compute kernel that never returns, GIL released
    if FAULT == "gil_hang" or hang_after_checkpoint.is_set():
        ctypes.PyDLL(None).sleep(3600)  # a C call that holds the GIL: nothing runs
    if FAULT == "segfault":
        # A bug in native code (an extension's kernel, a driver): a read of address 0.
        ctypes.string_at(0)
    if FAULT == "own_error":
        # A bug of the rank's own, while the others wait for it in a collective.
        raise ValueError("batch 17 has 0 samples: the data shard is empty")
    if FAULT == "oom_kill":
        # Memory that grows until the kernel's OOM killer ends the rank (the test put the
        # rank in a memory cgroup with a small limit): no Python error, just SIGKILL.
        hoard = []
        while True:
            hoard.append(bytearray(16 * 1024 * 1024))


if __name__ == "__main__":
    sys.exit(main())
