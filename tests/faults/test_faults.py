"""Fault to page: every failure our users lose days to, injected into a real job, must
reach the pager from any rank, with its cause in the text, and nothing else may page.

Each case starts its own stack (tests/faults/fault_stack.py): a real 2-rank (one case
4-rank) ColossalAI CPU job (Booster, TorchDDPPlugin, torchrun, gloo) running
tests/faults/train.py,
the node agent, the real Prometheus with the shipped rules (short `for` windows
through the documented override), the real Alertmanager with the shipped routing,
inhibitions and Slack template, and a recording receiver. Once Prometheus has
seen the job train, one failure is injected; the case then waits for the alerts
it must page, checks their labels and the cause in their text (the webhook's
description and the Slack message), waits for the alerts that must be muted to
fire in Prometheus and show as suppressed in Alertmanager, watches the pager for
a while longer, and checks that exactly the expected alerts paged.

``COLOSSALAI_FAULTS_DOCS=1`` rewrites docs/failures.md from a run of every case
(its header gives the command; any number of xdist workers); otherwise the table
of the cases run goes to the run's temporary directory (``failures.md`` under pytest's
base temporary directory).
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from colossalai_exporter.rulesgen.verdict import REMEDIES
from conftest import (
    RELEASES,
    REPO,
    free_port,
    limited_memory_cgroup,
    require,
    small_tmpfs,
    stack_binaries,
    wait_until,
)
from fake_vigilmon import fake_vigilmon
from fault_stack import (
    INTERVAL,
    RULES_OVERRIDE,
    Stack,
    now,
    running_stack,
    start_job,
    wait_for_snapshot,
    wait_healthy,
)
from gpu_helpers import gpu

pytestmark = pytest.mark.slow

PAGE_DEADLINE = 90.0  # seconds from the fault to its page, at most (the slowest: 30 s stale + 10 s)
QUIET = 8.0  # seconds the pager is watched after the last expected page and muted alert
# ... and at least this long after the failure: every shortened `for` window (15 s at
# most) with the scrape, evaluation and group wait after it. A page that arrives fast
# (the OOM killer's, in 2 s) must not end the watch before a second one could come.
WATCHED_AFTER_FAILURE = 25.0


@dataclass(frozen=True)
class Case:
    name: str
    failure: str  # what happened, for the table
    fault: str  # FAULT for train.py, or "sigkill" / "sigstop" (sent by the test)
    rank: int  # the rank with the failure
    pages: tuple[str, ...]  # alert names that must page, and nothing else
    labels: dict[str, str] = field(default_factory=dict)  # on the first of pages
    cause: tuple[str, ...] = ()  # texts the first page's description must hold
    # texts a later page's description must hold, by its alert name
    later: dict[str, tuple[str, ...]] = field(default_factory=dict)
    muted: tuple[str, ...] = ()  # alerts that must fire, but be inhibited
    trigger: str = "signal"  # signal | start (the fault happens at start-up by itself)
    target: str = "dir"  # checkpoint target: dir | full | file | fifo
    quiet: float = QUIET
    ranks: int = 2  # torchrun's --nproc_per_node
    restarts: int = 0  # torchrun's --max-restarts
    shipped_for: tuple[str, ...] = ()  # alerts keeping their shipped `for` window
    deadline: float = PAGE_DEADLINE  # seconds from the fault to its page, at most
    topology: str = "booster"  # train.py's TOPOLOGY
    nodes: int = 1  # launchers and node agents (``ranks`` each)
    gpus: int = 0  # GPUs each node agent reads from a fake NVML
    # whose Prometheus and Alertmanager (conftest.RELEASES): about half the cases run on
    # Debian testing's (Prometheus 3, a current Alertmanager), so that the pages are
    # proven on both without running every case twice
    release: str = "bookworm"
    # "local": every rank serves /metrics, each a target of the training job (docs/
    # training.md, serve), so TrainingStalled reads every rank, not rank 0 alone
    serve: str = "rank0"
    # "stop": once the first page is in (and what it mutes is muted), SIGTERM to torchrun,
    # as an operator (scancel) or the scheduler stops a hung job
    then: str = ""


# A hang that goes on to end the run (the process group's timeout), in the form NCCL's
# watchdog gives it; the same incident through gloo's own timeout is a variant of it.
HANG_THEN_WATCHDOG = Case(
    "hang-then-watchdog", "rank 1 frozen in compute; NCCL's watchdog (a stand-in: gloo has "
    "none) aborts rank 0, with no Python error, once its backward's all-reduce has been in "
    "flight for the process group's 30 s timeout; torchrun then stops rank 1 (SIGTERM)",
    "hang_then_watchdog", 1, ("TrainingHangSuspect", "TrainingRankDown"),
    {"rank": "1", "cause": "outside_collective", "activity": "compute"},
    ("is the rank the others wait for", "in compute at train.py:"),
    later={"TrainingRankDown": ("hung: it made no step for", "in compute at train.py:",
                                "then it received SIGTERM")},
    muted=("TrainingStalled",), release="current")

CASES = [
    Case("frozen-compute", "rank 1 frozen in compute (GIL released); rank 0 waits in "
         "backward's all-reduce", "frozen_compute", 1, ("TrainingHangSuspect",),
         {"rank": "1", "cause": "outside_collective", "activity": "compute"},
         ("is the rank the others wait for", "in compute at train.py:",
          "in inject_in_step while 1 other rank(s) wait in backward"),
         muted=("TrainingStalled",), release="current"),
    replace(HANG_THEN_WATCHDOG, name="hang-then-stopped", fault="frozen_compute",
            failure="rank 1 frozen in compute while rank 0 waits in backward's all-reduce; "
            "once the hang has paged, the job is stopped (SIGTERM to torchrun, as scancel "
            "does): rank 0, still waiting, is no second culprit", then="stop",
            release="bookworm"),
    Case("gil-hang-rank-0", "rank 0 hung in a C call holding the GIL at its first step after a "
         "checkpoint (its own /metrics server frozen too)", "gil_hang_after_checkpoint", 0,
         ("TrainingHangSuspect",), {"rank": "0", "cause": "not_responding"},
         ("is not responding (GIL held by a C call, or the process frozen",
          "while 1 other rank(s) wait in backward"),
         # TrainingStalled reads the rank servers: rank 0's is the frozen process itself
         muted=("TrainingRankDown",)),
    Case("sigstop", "rank 1 SIGSTOPped", "sigstop", 1, ("TrainingHangSuspect",),
         {"rank": "1", "cause": "not_responding"},
         ("is not responding (process stopped: SIGSTOP or a debugger",
          "while 1 other rank(s) wait in backward"),
         muted=("TrainingStalled", "TrainingRankDown"), release="current"),
    HANG_THEN_WATCHDOG,
    replace(HANG_THEN_WATCHDOG, name="hang-then-timeout", fault="hang_then_timeout",
            failure="rank 1 frozen in compute; the process group's 30 s timeout (gloo's own) "
            "ends rank 0, which waited in backward's all-reduce; torchrun then stops rank 1 "
            "(SIGTERM)", release="bookworm"),
    Case("hang-then-short-timeout", "rank 1 frozen in compute; the process group's 15 s "
         "timeout (gloo's own), shorter than the 40 s step budget, ends rank 0 before rank 1 "
         "counts as stalled; torchrun then stops rank 1 (SIGTERM)",
         "hang_then_short_timeout", 1, ("TrainingRankDown",),
         {"rank": "1", "cause": "process"},
         ("hung: it was in compute at train.py:", "outside any collective, when rank 0 "
          "timed out waiting for a peer in a collective", "then it received SIGTERM"),
         release="current"),
    # NCCL's form of the same: the rank that waited vanishes without a word, and its
    # collective in flight past the timeout (flight recorder) is all that says why.
    Case("hang-then-short-watchdog", "rank 1 frozen in compute; NCCL's watchdog (a "
         "stand-in) aborts rank 0, with no Python error, once its all-reduce has been in "
         "flight for the process group's 15 s timeout, shorter than the 40 s step budget, "
         "before rank 1 counts as stalled; torchrun then stops rank 1 (SIGTERM)",
         "hang_then_short_watchdog", 1, ("TrainingRankDown",),
         {"rank": "1", "cause": "process"},
         ("hung: it was in compute at train.py:", "outside any collective, when rank 0 "
          "vanished with no error (its collective", "NCCL's watchdog ends such a rank",
          "then it received SIGTERM"),
         release="bookworm"),
    Case("frozen-compute-4-ranks", "rank 2 of 4 frozen in compute; ranks 0, 1 and 3 wait "
         "in backward's all-reduce", "frozen_compute", 2, ("TrainingHangSuspect",),
         {"rank": "2", "cause": "outside_collective", "activity": "compute"},
         ("in inject_in_step while 3 other rank(s) wait in backward",),
         muted=("TrainingStalled",), ranks=4),
    # Two nodes, each with its own agent: the culprit and the ranks waiting for it are
    # judged from different agents' series, and the page must name the other node's rank.
    Case("frozen-compute-2-nodes", "two nodes (two launchers, two node agents, 2 ranks "
         "each); rank 3, on node 1, frozen in compute; ranks 0-2 wait in backward's "
         "all-reduce", "frozen_compute", 3, ("TrainingHangSuspect",),
         {"rank": "3", "cause": "outside_collective", "activity": "compute",
          "instance": "<node 1's agent>"},
         # How many others wait is counted as the page renders: node 0's agent may not
         # have been scraped yet since its ranks stalled (1 or 3 then, both true).
         ("is the rank the others wait for", "in inject_in_step while ",
          "other rank(s) wait in backward"), muted=("TrainingStalled",), nodes=2,
         release="current"),
    # The same short timeout with the hung rank alone on its node, under launchers with
    # static rendezvous (--master_addr): node 1's never learns that node 0's rank
    # failed, and the hung rank lives on. No one agent sees both it and the rank that
    # timed out waiting for it: the rules join them.
    Case("hang-then-short-timeout-2-nodes", "two nodes of one rank each (two launchers "
         "with static rendezvous, two node agents); rank 1, on node 1, frozen in compute; "
         "the process group's 15 s timeout, shorter than the 40 s step budget, ends rank 0 "
         "on node 0 before rank 1 counts as stalled; rank 1 lives on",
         "hang_then_short_timeout", 1, ("TrainingHangSuspect",),
         {"rank": "1", "cause": "others_timed_out", "instance": "<node 1's agent>"},
         ("is the rank the others wait for: rank 0 on 127.0.0.1:", "timed out waiting for "
          "a peer in a collective, and this rank, alive, has nothing in flight"),
         # the rendezvous store went with node 0's launcher; rank 0, which died of the
         # timeout, is not paged at all while the rank it waited for is named
         muted=("NCCLRendezvousDown",), nodes=2, ranks=1,
         release="current"),
    Case("data-stuck", "rank 1's data loader blocks (a read that never returns)",
         "data_stuck", 1, ("TrainingHangSuspect",),
         {"rank": "1", "cause": "outside_collective", "activity": "data"},
         ("in data at train.py:", "in __iter__ while 1 other rank(s) wait in backward"),
         muted=("TrainingStalled",), release="current"),
    Case("all-slow", "every rank 20 times slower, within its step budget: a slow job is "
         "not a hang", "all_slow", -1, (), quiet=20.0),
    Case("straggler", "rank 1 steadily slower (0.25 s more per step, within its budget): "
         "rank 0 waits for it in backward at every step", "straggler", 1,
         ("TrainingStraggler",), {"rank": "1", "cause": "waits_least"},
         ("is the rank the others wait for at every step",), release="current"),
    Case("heavy-stage", "2-stage pipeline (dist.send/recv) whose last stage has more to do "
         "(0.25 s more per step: the LM head and the loss), so stage 0 waits for it at every "
         "step: a pipeline's shape, not a straggler", "heavy_stage", 1, (), quiet=30.0,
         topology="pipeline", release="current"),
    Case("sigkill", "rank 1 SIGKILLed; rank 0 then fails on its closed connection", "sigkill",
         1, ("TrainingRankDown",), {"rank": "1", "cause": "process"},
         ("was killed: its process vanished with no error, no signal recorded and no OOM kill "
          "in the kernel log",)),
    # A crash in native code (an extension, a driver, NCCL) ends a rank with no error and
    # no snapshot after it: the page must name the signal and the line, not a SIGKILL.
    Case("segfault", "rank 1 crashes in native code (a real SIGSEGV: a read of address 0) "
         "in its step while rank 0 waits in backward's all-reduce", "segfault", 1,
         ("TrainingRankDown",), {"rank": "1", "cause": "process"},
         ("was killed: SIGSEGV (Segmentation fault), a crash in native code, at "
          "train.py:", " in inject_in_step (__init__.py:", "every thread's Python stack is "
          "in crash-rank1-"), release="current"),
    Case("oom-kill", "rank 1 killed by the kernel's OOM killer (a real kill: the rank in a "
         "256 MiB memory cgroup, allocating)", "oom_kill", 1, ("TrainingRankOOMKilled",),
         {"rank": "1"}, ("was killed by the kernel's OOM killer (memory cgroup "
                         "/colossalai-faults-", "from the kernel log)"), release="current"),
    # The most common host-memory death of a rank: its DataLoader worker OOM-killed, the
    # rank then raising "DataLoader worker (pid N) is killed by signal: Killed." The page
    # must say the OOM killer, not "died of its own error".
    Case("oom-kill-dataloader-worker", "rank 1's DataLoader worker killed by the kernel's "
         "OOM killer (a real kill: the worker in a 256 MiB memory cgroup, allocating); rank "
         "1 then raises that its worker was killed, and torchrun stops rank 0",
         "oom_kill_worker", 1, ("TrainingRankOOMKilled",), {"rank": "1"},
         ("was killed by the kernel's OOM killer (in its DataLoader worker, pid ",
          "memory cgroup /colossalai-faults-", "from the kernel log; the rank then raised "
          "RuntimeError: DataLoader worker (pid")),
    # Rank 0 is the rank that serves the run's own /metrics (the colossalai-training
    # target) and whose launcher holds the rendezvous: its death takes both with it, and
    # the page must still name it and the OOM killer, not "rank 0 down" or "the
    # rendezvous closed".
    Case("oom-kill-rank-0", "rank 0 killed by the kernel's OOM killer (the rank that "
         "serves the run's /metrics; a real kill in a 256 MiB memory cgroup)", "oom_kill", 0,
         ("TrainingRankOOMKilled",), {"rank": "0"},
         ("Rank 0 of run", "was killed by the kernel's OOM killer (memory cgroup "
          "/colossalai-faults-", "from the kernel log)")),
    Case("gpu-xid-79", "rank 1's GPU falls off the bus (Xid 79, fake NVML: the event, then "
         "the GPU lost) and rank 1 dies with it (SIGKILL)", "gpu_lost", 1, ("GPUXidCritical",),
         {"gpu": "1", "xid": "79", "instance": "<node 0's agent>", "remedy": "reboot"},
         ("GPU 1 on 127.0.0.1:", "Xid 79, GPU has fallen off the bus — drain the node and "
          "reboot it", "Ranks on this GPU: 1."),
         muted=("TrainingRankDown",), gpus=2),
    Case("gpu-recovery-reset", "NVML asks for a reset of rank 1's GPU (its recovery action "
         "field with Xid 154, fake NVML), and rank 1 then hangs in the driver (SIGSTOP) "
         "while rank 0 waits in backward's all-reduce", "gpu_reset", 1,
         ("GPURecoveryActionRequired",),
         {"gpu": "1", "action": "gpu_reset", "instance": "<node 0's agent>",
          "remedy": "reset_gpu"},
         ("GPU 1 on 127.0.0.1:", "NVML asks for gpu_reset — reset the GPU (nvidia-smi -r",
          "Ranks on this GPU: 1."),
         muted=("TrainingHangSuspect", "TrainingStalled"), gpus=2, release="current"),
    Case("own-error", "rank 1 raises an error of its own and exits 1 while rank 0 waits in "
         "backward's all-reduce", "own_error", 1, ("TrainingRankDown",),
         {"rank": "1", "cause": "process"},
         ("died of its own error: ValueError: batch 17 has 0 samples",)),
    Case("preemption", "the job preempted: SIGTERM to torchrun (what scancel or a pod deletion "
         "does), which stops every rank", "preempt", -1, (), quiet=20.0),
    Case("clean-finish", "the run completes: every rank calls monitor.finish() at the same "
         "step and exits 0; the rank server's static target stays", "finish", -1, (),
         quiet=20.0, release="current"),
    Case("finish-early", "rank 1's data runs out a step before rank 0's (an uneven shard): "
         "its loop ends, it calls monitor.finish() and exits 0, while rank 0 goes on into "
         "the next step's all-reduce and fails on rank 1's closed connection",
         "finish_early", 1, ("TrainingRankDown",), {"rank": "1", "cause": "process"},
         ("left the run early: it called monitor.finish() after step ",
          "while rank 0 on ", "still waited for it in a collective")),
    Case("finish-early-held", "rank 1's data runs out a step before rank 0's and it exits 0 "
         "after monitor.finish(), while rank 0 waits in the next step's all-reduce as NCCL "
         "within a node does (no connection to close: a stand-in, rank 1's sockets held "
         "open by a child)", "finish_early_held", 1, ("TrainingHangSuspect",),
         {"rank": "1", "cause": "left_early"},
         ("is the rank the others wait for: it left the run early: it called "
          "monitor.finish() after step ", "while the ranks it left (rank 0 on "),
         muted=("TrainingStalled",), release="current"),
    Case("extra-barrier", "4 ranks; rank 1 alone calls a barrier after a step (code under "
         "`if rank == 1:`): it waits there while ranks 0, 2 and 3 wait in the next step's "
         "all-reduce, each at the same collective number of the default process group",
         "extra_barrier", 1, ("TrainingHangSuspect",), {"rank": "1", "cause": "mismatch"},
         ("is in a different collective from the others: it waits in gloo:barrier #",
          "where rank 0 waits in gloo:all_reduce #", ", rank 2 waits in gloo:all_reduce #",
          ", rank 3 waits in gloo:all_reduce #"),
         muted=("TrainingStalled",), ranks=4),
    Case("exit-unfinished", "the run completes in a script that never calls monitor.finish(): "
         "every rank's loop ends at the same step and the script exits 0", "exit_unfinished",
         -1, (), quiet=20.0, release="current"),
    Case("after-the-loop", "the run completes: every rank's loop ends at the same step, "
         "the other ranks exit 0, and rank 0 goes on alone for 12 s (a final torch.save and "
         "an upload, beyond the 5 s step budget) before it exits 0; no monitor.finish()",
         "after_the_loop", -1, (), quiet=25.0),
    Case("pipeline-hang", "2-stage pipeline (dist.send/recv), stage 0 frozen in compute; stage "
         "1 waits in recv", "frozen_compute", 0, ("TrainingHangSuspect",),
         {"rank": "0", "cause": "outside_collective"},
         ("is the rank the others wait for", "while 1 other rank(s) wait in collective (recv)"),
         muted=("TrainingStalled",), topology="pipeline"),
    Case("pairs-hang", "4 ranks, each step an all-reduce in a pair then over all; rank 3 frozen "
         "in compute (rank 2 waits in their pair, behind in the global group only because of "
         "that)", "frozen_compute", 3, ("TrainingHangSuspect",),
         {"rank": "3", "cause": "outside_collective"},
         ("is the rank the others wait for", "in inject_in_step while"),
         muted=("TrainingStalled",), ranks=4, topology="pairs"),
    Case("mesh-hang", "ColossalAI ProcessGroupMesh(2, 2): an all-reduce in the tensor-parallel "
         "group then in the data-parallel group; rank 1 frozen in compute", "frozen_compute", 1,
         ("TrainingHangSuspect",), {"rank": "1", "cause": "outside_collective"},
         ("is the rank the others wait for", "in inject_in_step while"),
         muted=("TrainingStalled",), ranks=4, topology="mesh", release="current"),
    Case("node-lost", "two nodes (two launchers, two node agents, 2 ranks each); node 1 loses "
         "power: its agent, launcher and ranks killed at once", "node_lost", 2,
         ("TrainingNodeLost",), {"instance": "<node 1's agent>"},
         ("stopped answering, and with it 2 rank(s) of run", "(rank 2, rank 3)"), nodes=2,
         release="current"),
    Case("oom-caught", "CUDA out-of-memory error on rank 1, caught, the loop goes on",
         "oom_caught", 1, ("GeminiOutOfMemory",), {"rank": "1", "device": "cuda"},
         ("GPU memory (CUDA)", "OutOfMemoryError: CUDA out of memory. Tried to allocate "
          "1024.00 MiB")),
    Case("oom-kills-rank-0", "CUDA out-of-memory error on rank 0, uncaught: rank 0 dies, "
         "torchrun stops rank 1", "oom_fatal", 0, ("GeminiOutOfMemory",),
         {"rank": "0", "device": "cuda"}, ("OutOfMemoryError: CUDA out of memory",),
         muted=("TrainingRankDown",), release="current"),
    Case("gemini-layout", "Gemini's \"Adjust layout failed! No enough CUDA memory!\" on "
         "rank 1, uncaught", "gemini_layout", 1, ("GeminiOutOfMemory",),
         {"rank": "1", "device": "cuda"},
         ("RuntimeError: Adjust layout failed! No enough CUDA memory!",),
         muted=("TrainingRankDown",)),
    Case("host-oom", "a real host allocation failure (torch.empty of 32 TiB) on rank 1, "
         "caught", "host_oom", 1, ("GeminiOutOfMemory",), {"rank": "1", "device": "cpu"},
         ("host memory", "DefaultCPUAllocator: can't allocate memory"), release="current"),
    Case("checkpoint-full", "checkpoint into a full filesystem (a real 1 MiB tmpfs), "
         "uncaught", "checkpoint_full", 0, ("CheckpointFailing",), {"rank": "0"},
         ("filesystem full (0 B free of 1.0 MiB",), muted=("TrainingRankDown",),
         target="full"),
    Case("checkpoint-not-a-dir", "checkpoint whose target folder is a file, uncaught",
         "checkpoint_not_dir", 0, ("CheckpointFailing",), {"rank": "0"},
         ("RuntimeError: Parent directory",), muted=("TrainingRankDown",), target="file"),
    Case("checkpoint-hangs", "checkpoint that hangs in torch.save (a FIFO nobody reads: "
         "blocks holding the GIL, like a hung mount)", "checkpoint_hang", 0,
         ("CheckpointStuck",), {"rank": "0", "phase": "checkpointing"},
         ("phase checkpointing",), target="fifo", release="current"),
    Case("rank0-save", "the tutorial's save: rank 0 alone saves a checkpoint of 12 s (beyond "
         "the 5 s step budget, within its 60 s checkpoint budget) while rank 1 goes on into "
         "the next step's all-reduce and waits for it there", "rank0_save", 0, (), quiet=25.0),
    Case("unwrapped-save", "the tutorial's save as most scripts keep it: rank 0 alone "
         "torch.saves 4 MiB into a slow filesystem for 12 s (beyond the 5 s step budget), "
         "without monitor.checkpoint() or the booster, while rank 1 waits for it in the "
         "next step's all-reduce", "unwrapped_save", 0, (), quiet=25.0, release="current"),
    Case("unwrapped-save-hangs", "the same save without monitor.checkpoint() hangs: rank "
         "0's torch.save writes into a hung mount (a write that never returns, the GIL "
         "released) while rank 1 waits in the next step's all-reduce", "unwrapped_save_hangs",
         0, ("CheckpointStuck",), {"rank": "0", "phase": "checkpointing"},
         ("has been in phase checkpointing for", "a checkpoint save or upload that does not finish",
          "It is in checkpoint at train.py:", "in write while 1 other rank(s) wait in"),
         release="current"),
    Case("upload-after-save", "rank 0 alone uploads a checkpoint it saved through the "
         "booster (an HTTP PUT to an object store that takes 12 s, beyond the 5 s step "
         "budget, within the 60 s checkpoint budget) while rank 1 waits for it in the next "
         "step's all-reduce", "upload", 0, (), quiet=25.0, release="current"),
    Case("upload-subprocess-after-save", "the same upload run as a child process, as a "
         "script that calls `aws s3 cp` waits for it (12 s, beyond the 5 s step budget) "
         "while rank 1 waits in the next step's all-reduce", "upload_subprocess", 0, (),
         quiet=25.0),
    Case("upload-hangs", "rank 0's upload of its checkpoint hangs (an object store that "
         "stopped reading: a write that never returns) while rank 1 waits in the next "
         "step's all-reduce", "upload_hangs", 0, ("CheckpointStuck",),
         {"rank": "0", "phase": "checkpointing"},
         ("has been in phase checkpointing for", "It is in network at ",
          "while 1 other rank(s) wait in"), release="current"),
    Case("recompile", "rank 1's model, under torch.compile, gets the epoch's short last "
         "batch (a new shape) and compiles again for 12 s (inductor on a large model's "
         "graph; beyond the 5 s step budget, within the 30 m compile budget) while rank 0 "
         "waits for it in backward's all-reduce", "recompile", 1, (), quiet=25.0,
         release="current"),
    Case("recompile-hangs", "rank 1's recompile never ends (a lock in a shared inductor "
         "cache that nobody releases, the GIL released) while rank 0 waits for it in "
         "backward's all-reduce", "recompile_hangs", 1, ("CompileStuck",),
         {"rank": "1", "phase": "compiling"},
         ("has been in phase compiling for", "a torch.compile recompile that does not "
          "finish", "It is in compile at train.py:", "in compile_backend (threading.py:",
          "while 1 other rank(s) wait in backward")),
    Case("epoch-start", "rank 1's data loader starts its next epoch: a fresh iterator whose "
         "worker takes 12 s to give its first batch (imports, the first shard opened; "
         "beyond the 5 s step budget, within the 10 m data start budget) while rank 0 "
         "waits for it in the step's all-reduce", "epoch_start", 1, (), quiet=25.0,
         release="current"),
    Case("epoch-start-hangs", "rank 1's next epoch never starts: its data loader's worker "
         "never gives the first batch (a shard's open that never returns) while rank 0 "
         "waits for it in the step's all-reduce", "epoch_start_hangs", 1,
         ("DataStartStuck",), {"rank": "1", "phase": "data_start"},
         ("has been in phase data_start for", "a data loader's start that does not finish",
          "It is in data at train.py:", "while 1 other rank(s) wait in")),
    Case("rank0-save-every-rank-serves", "the tutorial's save of 12 s on rank 0 alone, as "
         "above, in a run where every rank serves /metrics (serve=\"local\"): rank 1's own "
         "server reports it stalled while it waits", "rank0_save", 0, (), quiet=25.0,
         serve="local", release="current"),
    Case("frozen-compute-every-rank-serves", "rank 1 frozen in compute while rank 0 waits, "
         "in a run where every rank serves /metrics (serve=\"local\")", "frozen_compute", 1,
         ("TrainingHangSuspect",), {"rank": "1", "cause": "outside_collective"},
         ("is the rank the others wait for", "in compute at train.py:"),
         muted=("TrainingStalled",), serve="local"),
    Case("solo-evaluation", "rank 1 alone evaluates for 12 s (beyond the 5 s step budget, "
         "within evaluation's) while rank 0, whose server the run serves, waits for it in "
         "the next step's all-reduce", "solo_eval", 1, (), quiet=25.0, release="current"),
    Case("solo-evaluation-pairs", "4 ranks, each step an all-reduce in a pair, 1.5 s of "
         "layers, then an all-reduce over all; rank 3 alone evaluates for 12 s while the "
         "others wait: once it is back, rank 2, released from their pair's all-reduce, "
         "computes those layers still stalled while ranks 0 and 1 wait for it in the "
         "global one", "solo_eval_layers", 3, (), quiet=25.0, ranks=4, topology="pairs"),
    Case("unwrapped-evaluation", "a 12 s validation loop on every rank as most scripts "
         "write it (model.eval(), batches under no_grad, model.train()), without "
         "monitor.evaluation(): beyond the 5 s step budget", "unwrapped_eval", -1, (),
         quiet=25.0, release="current"),
    Case("evaluation-in-step", "the same validation loop on rank 0 alone, inside the "
         "step's block (the loop's whole body in `with monitor.step()`), while rank 1 "
         "waits in the next step's all-reduce", "eval_in_step", 0, (), quiet=25.0),
    Case("evaluation-in-step-hangs", "rank 0's validation inside the step's block hangs "
         "in a read of its shard (a read that never returns) while rank 1 waits in the "
         "next step's all-reduce; once paged, the job is stopped (SIGTERM to torchrun): "
         "the rank that ended in its evaluation is not paged as stuck after its end",
         "eval_in_step_hangs", 0, ("EvaluationStuck", "TrainingRankDown"),
         {"rank": "0", "phase": "evaluating"},
         ("has been in phase evaluating for", "an evaluation that does not finish",
          "It is in compute at train.py:", "in read_validation_shard while 1 other rank(s) "
          "wait in"),
         later={"TrainingRankDown": ("hung: it stayed in phase evaluating for",
                                     "in read_validation_shard", "then it received SIGTERM")},
         then="stop", release="current"),
    Case("save-in-step", "the tutorial's torch.save into a slow filesystem (12 s) on rank "
         "0, inside the step's block, while rank 1 waits in the next step's all-reduce",
         "save_in_step", 0, (), quiet=25.0, release="current"),
    Case("evaluation-hangs", "every rank's evaluation hangs in a read of its validation "
         "shard from a shared filesystem (a read that never returns): no rank waits for "
         "another", "eval_hangs", -1, ("EvaluationStuck",), {"phase": "evaluating"},
         ("has been in phase evaluating for", "an evaluation that does not finish",
          "It is in compute at train.py:", "in read_validation_shard",
          "2 rank(s) of this run are stalled"), release="current"),
    Case("long-evaluation", "a 20 s evaluation on every rank (4 step budgets)", "long_eval",
         -1, (), quiet=25.0),
    Case("kernel-build-fails", "ColossalAI's CPU Adam kernel does not load (HybridAdam on "
         "a machine without it), uncaught, every rank", "kernel_build_fails", -1,
         ("KernelBuildFailed",), {},
         ("AssertionError: No usable kernel found for CPUAdamLoader",),
         muted=("TrainingRankDown",), trigger="start", release="current"),
    # Three restarts of a ColossalAI job take a minute or two on a 2-core machine; the
    # ranks are down between restarts for less than TrainingRankDown's shipped minute.
    Case("crash-loop", "rank 1 raises at every start (a data shard it reads is gone); "
         "torchrun restarts the job three times", "resume_fails", 1,
         ("TrainingRestartLoop",), {},
         ("restarted 3 times", "wrote no checkpoint meanwhile",
          "First failure (rank 1, in run): FileNotFoundError: [Errno 2] No such file"),
         trigger="start", restarts=3, shipped_for=("TrainingRankDown",), deadline=300.0,
         release="current"),
    Case("kernel-build-slow", "a kernel JIT build on rank 1 longer than its budget (5 s)",
         "kernel_build_slow", 1, ("TrainingStartupStuck",), {"rank": "1", "phase": "kernels"},
         ("phase kernels",), trigger="start"),
    # Start-up: the rendezvous waits for every rank of the world, so a rank that does not
    # come is waited for by all the others, each in phase init past its budget too.
    Case("slow-start", "rank 1 blocks before it joins the process group (a read that never "
         "returns) while rank 0 waits for it in init_process_group, both beyond the 5 s "
         "start-up budget", "slow_start", 1, ("TrainingStartupStuck",),
         {"rank": "1", "phase": "init"},
         ("has been in phase init for", "It is in compute at train.py:",
          "in prepare_data while 1 other rank(s) wait in collective (init_process_group)"),
         trigger="start"),
    Case("ranks-never-start", "ranks 2 and 3 of 4 never start (their node did not come up, "
         "under a launcher that starts each rank itself, as srun does): ranks 0 and 1 wait "
         "for them in init_process_group beyond the 5 s start-up budget",
         "ranks_never_start", -1, ("TrainingRanksMissing",),
         {"reported": "2", "world_size": "4"},
         ("has not started: only 2 of its 4 ranks have reported",
          "Ranks reported by node: 127.0.0.1:"), trigger="start", release="current"),
    Case("master-never-starts", "ranks 0 and 1 of 4 and the rendezvous store never start "
         "(the master node did not come up, under a launcher that starts each rank "
         "itself): ranks 2 and 3 cannot reach the store, and wait for it in "
         "init_process_group beyond the 30 s start-up budget",
         "master_never_starts", 2, ("NCCLRendezvousDown",),
         {"target": "<the dead master>"},
         ("cannot reach the rendezvous endpoint 127.0.0.1:", "(refused) while training "
          "ranks run there"),
         # the store's page names the master node; how many ranks reported says less
         muted=("TrainingRanksMissing",), trigger="start"),
]


@dataclass
class Row:
    case: Case
    pages: list[str]
    seconds: float
    description: str
    muted: list[str]
    watched: float  # seconds the pager was watched after the last expected event
    later: list[str] = field(default_factory=list)  # "Alert: description" of later pages


ROWS: list[Row] = []


def checkpoint_target(case: Case, tmp: Path) -> AbstractContextManager[Path]:
    path = tmp / "checkpoints"
    if case.target == "full":
        return small_tmpfs(path, full=True)
    if case.target == "file":
        path.write_text("a file where the checkpoint folder should be\n")
    else:
        path.mkdir()
        if case.target == "fifo":
            os.mkfifo(path / "requested.pt")
    return nullcontext(path)


def ranks_on_their_gpus(stack: Stack, case: Case) -> list[int]:
    """Each rank's process on its own GPU, as NVML lists them, seen by Prometheus first;
    the ranks' pids."""
    assert stack.gpus is not None
    pids = [stack.job_of(rank).pid(rank) for rank in range(stack.ranks)]
    stack.gpus.update(gpus=[gpu(i, processes=[pid]) for i, pid in enumerate(pids)])
    wait_until(lambda: stack.prometheus.query(
        f'colossalai_gpu_rank_info{{gpu="{case.rank}",rank="{case.rank}"}}'),
        timeout=60, interval=0.2, what="the ranks seen on their GPUs")
    return pids


def inject(stack: Stack, case: Case, cgroup: Path | None) -> float:
    """Make the failure happen; returns when (wall clock)."""
    ranks = list(range(stack.ranks)) if case.rank < 0 else [case.rank]
    if case.fault == "preempt":
        # What scancel or a pod deletion does: SIGTERM to the launcher, which sends it on
        # to every rank.
        at = now()
        stack.job.proc.send_signal(signal.SIGTERM)
        return at
    if case.fault == "node_lost":
        # Power lost: the node's agent, its launcher and its ranks end at once.
        node = stack.jobs.index(stack.job_of(case.rank))
        at = now()
        stack.agents[node].proc.kill()
        stack.jobs[node].stop()
        return at
    if case.fault == "gpu_lost":
        # What NVML shows when a GPU falls off the bus: an Xid 79 event, then the GPU
        # answers GPU_IS_LOST. The rank on it dies (a CUDA error, or the driver's reset).
        assert stack.gpus is not None
        pids = ranks_on_their_gpus(stack, case)
        at = now()
        stack.gpus.update(gpus=[gpu(0, processes=[pids[0]]), gpu(1, lost=True)],
                          xid=[{"id": 1, "gpu": 1, "code": 79}])
        os.kill(stack.job_of(case.rank).pid(case.rank), signal.SIGKILL)
        return at
    if case.fault == "gpu_reset":
        # The driver sets the GPU's recovery action and logs Xid 154 when a GPU needs a
        # reset (after an uncontained error, a GSP timeout); the rank's next CUDA call
        # on it then never returns. The hang is seen after the rank's step budget, much
        # later than the agent's next scrape: the case waits for the agent's alert to
        # reach Alertmanager before freezing the rank, so the order is not left to chance.
        assert stack.gpus is not None
        pids = ranks_on_their_gpus(stack, case)
        at = now()
        stack.gpus.update(gpus=[gpu(0, processes=[pids[0]]),
                                gpu(1, processes=[pids[1]], recovery_action=1)],
                          xid=[{"id": 1, "gpu": 1, "code": 154}])
        wait_until(lambda: stack.alertmanager_states("GPURecoveryActionRequired"),
                   timeout=60, interval=0.2, what="the recovery action in Alertmanager")
        os.kill(pids[case.rank], signal.SIGSTOP)
        return at
    if case.fault in ("finish", "exit_unfinished", "after_the_loop"):
        # Every rank ends at the same step, as a real loop's end makes them.
        furthest = max(stack.job_of(r).snapshot(r).steps for r in ranks)
        (stack.tmp / "checkpoints" / "at-step").write_text(str(furthest + 20))
    if case.fault == "oom_kill_worker":
        # The rank's DataLoader worker now allocates in a memory cgroup of its own (the
        # limit is the job's); a file arms it, since the signal below reaches the rank.
        assert cgroup is not None
        for worker in children(stack.job_of(case.rank).pid(case.rank)):
            (cgroup / "cgroup.procs").write_text(str(worker))
        at = now()
        (stack.tmp / "checkpoints" / "worker-hoards").touch()
        return at
    if cgroup is not None:
        # The rank now allocates in a memory cgroup of its own: the limit is the job's.
        (cgroup / "cgroup.procs").write_text(str(stack.job_of(case.rank).pid(case.rank)))
    at = now()
    for rank in ranks:
        pid = stack.job_of(rank).pid(rank)
        if case.fault == "sigkill":
            os.kill(pid, signal.SIGKILL)
        elif case.fault == "sigstop":
            os.kill(pid, signal.SIGSTOP)
        else:
            os.kill(pid, signal.SIGUSR1)
    return at


def children(pid: int) -> list[int]:
    """The processes ``pid`` forked (its DataLoader worker), from /proc."""
    found = [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
             for child in (task / "children").read_text().split()]
    assert found, f"rank process {pid} has no child process"
    return found


def started_failing(stack: Stack, case: Case) -> float:
    """When a start-up fault happened, as the failing rank recorded it."""
    rank = max(case.rank, 0)
    snap = stack.job.snapshot(rank)
    if case.fault in ("kernel_build_slow", "slow_start", "ranks_never_start",
                      "master_never_starts"):
        return snap.phase_start  # entering the phase it is stuck in
    wait_until(lambda: stack.job.snapshot(rank).last_error, timeout=60,
               what=f"rank {rank}'s error recorded (log: {stack.job.log})")
    error = stack.job.snapshot(rank).last_error
    assert error is not None
    return error.time


@pytest.fixture(scope="module", autouse=True)
def failures_table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    yield
    if not ROWS:
        return
    # Each xdist worker's base directory is in the run's: the rows of every worker meet
    # there, and whichever writes last renders them all.
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    publish_rows(shared, os.environ.get("PYTEST_XDIST_WORKER", "main"), ROWS,
                 os.environ.get("COLOSSALAI_FAULTS_DOCS") == "1")


def table_order() -> list[Case]:
    """Every case of the table, in its order: the failures, the healthy run on each
    release, the two jobs in one run directory."""
    return [*CASES, *(replace(HEALTHY, release=r) for r in RELEASES), TWO_JOBS]


def publish_rows(shared: Path, worker: str, rows: list[Row], docs: bool) -> Path:
    """Write ``worker``'s rows into ``shared``/faults-rows, then render every worker's
    rows so far: into docs/failures.md where ``docs`` and every case has a row, else
    into ``shared``/failures.md. Returns the table written."""
    folder = shared / "faults-rows"
    folder.mkdir(exist_ok=True)
    (folder / f"{worker}.json").write_text(json.dumps([
        {"case": row.case.name, "release": row.case.release, "pages": row.pages,
         "seconds": row.seconds, "description": row.description, "muted": row.muted,
         "watched": row.watched, "later": row.later} for row in rows]))
    order = table_order()
    cases = {(case.name, case.release): case for case in order}
    with (folder / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two workers ending at once: one table each
        merged = {}
        for path in sorted(folder.glob("*.json")):
            for row in json.loads(path.read_text()):
                key = (row.pop("case"), row.pop("release"))
                merged[key] = Row(cases[key], **row)
        ordered = [merged[key] for key in cases if key in merged]
        out = REPO / "docs" / "failures.md" if docs and len(ordered) == len(order) \
            else shared / "failures.md"
        out.write_text(render_table(ordered))
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_failure_pages_with_its_cause_and_nothing_else(
        case: Case, tmp_path: Path) -> None:
    require(importlib.util.find_spec("colossalai") is not None,
            "colossalai 0.5.0 and torch (scripts/install-dev.sh)")
    with fake_vigilmon() as receiver, checkpoint_target(case, tmp_path) as target, \
            rank_memory(case) as cgroup, \
            running_stack(tmp_path, receiver, case.fault, case.rank, target,
                          checkpoint_every=10**9 if case.target != "dir" else 50,
                          ranks=case.ranks, restarts=case.restarts,
                          shipped_for=case.shipped_for, topology=case.topology,
                          nodes=case.nodes, gpus=case.gpus, release=case.release,
                          serve=case.serve) as stack:
        if case.trigger == "start":
            wait_for_snapshot(stack, max(case.rank, 0))
            # a crash loop fails first right after its first start
            first_start = stack.job.snapshot(max(case.rank, 0)).created
        else:
            wait_healthy(stack)
            fault_at = inject(stack, case, cgroup)

        def have_paged(names: tuple[str, ...]) -> bool:
            return set(names) <= set(stack.paged())

        timeout = case.deadline + 120 * (case.trigger == "start")
        # The first page, then what it mutes (while the incident it names lasts: a hang
        # that later ends the run resolves its alerts), then any later page.
        wait_until(lambda: have_paged(case.pages[:1]), timeout=timeout, interval=0.2,
                   what=f"{case.pages[:1]} paged (log: {stack.job.log})")
        for name in case.muted:  # fired in Prometheus, muted by Alertmanager
            wait_until(lambda name=name: stack.prometheus.alerts(name), timeout=PAGE_DEADLINE,
                       interval=0.2, what=f"{name} firing in Prometheus")
            wait_until(lambda name=name: "suppressed" in stack.alertmanager_states(name),
                       timeout=10, interval=0.2, what=f"{name} inhibited in Alertmanager")
        if case.then == "stop":
            stack.job.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: have_paged(case.pages), timeout=timeout, interval=0.2,
                   what=f"{case.pages} paged (log: {stack.job.log})")
        if case.trigger == "start":
            fault_at = first_start if case.restarts else started_failing(stack, case)
        watched = max(case.quiet, fault_at + WATCHED_AFTER_FAILURE - now())
        watch_quietly(stack, watched)
        assert_every_notification_delivered(stack)

        paged = stack.paged()
        assert set(paged) == set(case.pages), "\n".join(
            [*stack.what_paged(), "log:", stack.job.log.read_text()[-3000:]])
        row = Row(case, sorted(paged), 0.0, "", list(case.muted), watched)
        if case.pages:
            first_at, description = check_the_page(stack, case)
            row.seconds = first_at - fault_at
            row.description = description
            row.later = [f"{name}: {alert['annotations']['description']}"
                         for name in case.later for _, alert in paged[name][:1]]
            assert row.seconds < case.deadline, row.seconds
        ROWS.append(row)


HEALTHY = Case(
    "healthy-lifecycle", "a healthy 4-rank run: a 3 s checkpoint (budget 5 s) and a 23 s "
    "evaluation (step budget 20 s) on every rank, the node agent restarted, Prometheus "
    "restarted, then a "
    "clean finish and the targets left in place; the node agent on defaults on a node "
    "without GPUs (its GPU collector on, no /checkpoints or /nvme)", "lifecycle", -1, (),
    quiet=25.0, ranks=4)


@pytest.mark.parametrize("release", RELEASES)
def test_a_healthy_run_pages_nobody(tmp_path: Path, release: str) -> None:
    """Everything a healthy run does that an alert could mistake for trouble, in one run:
    nothing reaches the pager, and at the end no alert but the Watchdog is even pending.
    On both Prometheus and Alertmanager releases: Prometheus 3's ranges leave out their
    first instant, which shortens every window the rules read."""
    require(importlib.util.find_spec("colossalai") is not None,
            "colossalai 0.5.0 and torch (scripts/install-dev.sh)")
    case = replace(HEALTHY, release=release)
    target = tmp_path / "checkpoints"
    target.mkdir()
    with fake_vigilmon() as receiver, \
            running_stack(tmp_path, receiver, case.fault, case.rank, target,
                          ranks=case.ranks, agent_defaults=True, release=release) as stack:
        wait_healthy(stack)
        plan_for_every_rank(stack)  # the slow checkpoint and evaluation
        wait_until(lambda: any(stack.job.snapshot(r).phase == "evaluating"
                               for r in range(stack.ranks)), timeout=60, interval=0.2,
                   what="the ranks evaluating")
        stack.restart_agent()
        wait_until(lambda: all(stack.job.snapshot(r).phase == "training"
                               for r in range(stack.ranks)), timeout=60, interval=0.2,
                   what="the ranks training again after the evaluation")
        stack.restart_prometheus()
        wait_healthy(stack)
        plan_for_every_rank(stack)  # the end
        assert stack.job.proc.wait(timeout=120) == 0, stack.job.log.read_text()[-3000:]
        watch_quietly(stack, case.quiet)
        assert_every_notification_delivered(stack)
        assert stack.pages() == [], "\n".join(stack.what_paged())
        unquiet = [a["labels"] for a in stack.prometheus.api("/api/v1/alerts")["alerts"]
                   if a["labels"]["alertname"] != "Watchdog"]
        assert unquiet == [], unquiet
    ROWS.append(Row(case, [], 0.0, "", [], case.quiet))


TWO_JOBS = Case(
    "two-jobs-one-run-dir", "two jobs of 2 ranks each on one node, both publishing into the "
    "node's run directory (as both would on the default): their ranks' snapshot files are "
    "written by both in turn", "none", -1, ("RankStateUnreadable",),
    {"reason": "shared", "instance": "<node 0's agent>"},
    ("could not be trusted for 5s (shared): two live runs write the same ranks' snapshots "
     "in turn",))


def test_two_jobs_in_one_run_directory_are_paged_as_such(tmp_path: Path) -> None:
    """Two jobs on one node, each of two ranks, both publishing into the node's run
    directory (the default one, for want of a setting): their ranks write the same
    files in turn. The page says so, for that node, with what to change, and nothing
    pages as a rank's incident."""
    require(importlib.util.find_spec("colossalai") is not None,
            "colossalai 0.5.0 and torch (scripts/install-dev.sh)")
    target = tmp_path / "checkpoints"
    target.mkdir()
    with fake_vigilmon() as receiver, \
            running_stack(tmp_path, receiver, "none", -1, target) as stack:
        wait_healthy(stack)
        second = start_job(tmp_path, "none", -1, target, free_port(), free_port(), 10**9,
                           name="second")
        try:
            # From when the second job's ranks train (and so publish): its start (imports,
            # the rendezvous) took more than the page's deadline on a loaded machine.
            wait_until(lambda: second.log.read_text().count(": training") >= 2,
                       timeout=PAGE_DEADLINE + 120, interval=0.2,
                       what=f"the second job's ranks training (log: {second.log})")
            at = now()
            wait_until(lambda: TWO_JOBS.pages[0] in stack.paged(), timeout=PAGE_DEADLINE,
                       interval=0.2, what=f"RankStateUnreadable paged (log: {second.log})")
            watch_quietly(stack, max(QUIET, at + WATCHED_AFTER_FAILURE - now()))
            assert second.proc.poll() is None, second.log.read_text()[-3000:]
        finally:
            second.stop()
        assert_every_notification_delivered(stack)
        first = stack.pages()[0].alerts[0]
        assert first["labels"]["alertname"] == "RankStateUnreadable", first["labels"]
        assert first["labels"]["instance"] == f"127.0.0.1:{stack.agent.port}", first["labels"]
        assert first["labels"]["reason"] == "shared", first["labels"]
        description = first["annotations"]["description"]
        assert description.startswith(
            f"Reads of rank snapshots on 127.0.0.1:{stack.agent.port} could not be trusted "
            "for 5s (shared): two live runs write the same ranks' snapshots in turn"), \
            description
        assert "its own COLOSSALAI_EXPORTER_RUN_DIR" in description, description
        title = json.loads(stack.slack("RankStateUnreadable")[0].body)["attachments"][0]["title"]
        assert f"127.0.0.1:{stack.agent.port}" in title, title
        assert set(stack.paged()) == {"RankStateUnreadable"}, "\n".join(stack.what_paged())
        ROWS.append(Row(TWO_JOBS, ["RankStateUnreadable"], stack.pages()[0].at - at,
                        description, [], QUIET))


def plan_for_every_rank(stack: Stack) -> None:
    """Every rank does what its FAULT plans (train.py) at one step, 20 from now."""
    furthest = max(stack.job.snapshot(r).steps for r in range(stack.ranks))
    (stack.tmp / "checkpoints" / "at-step").write_text(str(furthest + 20))
    for rank in range(stack.ranks):
        os.kill(stack.job.pid(rank), signal.SIGUSR1)


def rank_memory(case: Case) -> AbstractContextManager[Path | None]:
    """A memory cgroup the OOM case's rank is moved into: 256 MiB of new allocations,
    more than its steps ever take, far less than it allocates once armed."""
    if case.fault not in ("oom_kill", "oom_kill_worker"):
        return nullcontext(None)
    return limited_memory_cgroup(256 * 2**20)


def assert_every_notification_delivered(stack: Stack) -> None:
    """Alertmanager logged no failed notification: a template that does not render, a
    receiver's answer it refuses (and would send again a group interval later, a
    second page) all end in this line, on every version."""
    failed = [line for line in (stack.tmp / "alertmanager.log").read_text().splitlines()
              if "Notify for alerts failed" in line]
    assert failed == [], failed


def watch_quietly(stack: Stack, seconds: float) -> None:
    """Let the pager receive whatever else would page; an observation window, not a wait
    for speed: what arrives in it is what the case checks."""
    deadline = now() + seconds
    wait_until(lambda: now() >= deadline, timeout=seconds + 5, interval=0.25,
               what="the observation window")


def culprit_labels(stack: Stack, case: Case) -> dict[str, str]:
    """The labels that name where the incident began (placeholders filled in)."""
    labels = dict(case.labels)
    for node, agent in enumerate(stack.agents):
        if labels.get("instance") == f"<node {node}'s agent>":
            labels["instance"] = f"127.0.0.1:{agent.port}"
    if labels.get("target") == "<the dead master>":
        labels["target"] = stack.dead_master
    return labels


def check_the_page(stack: Stack, case: Case) -> tuple[float, str]:
    """The first page as on-call reads it: the first notification that reached the pager
    leads with the expected alert, for the rank (or node) where the incident began, and
    says why; its Slack message's title names that rank and run. No page of the case's
    alerts names anyone else. Returns when it arrived and its leading description."""
    labels = culprit_labels(stack, case)
    first = stack.pages()[0]
    lead = first.alerts[0]
    assert lead["labels"]["alertname"] == case.pages[0], [a["labels"] for a in first.alerts]
    assert all(lead["labels"].get(k) == v for k, v in labels.items()), (labels, lead["labels"])
    description = lead["annotations"]["description"]
    for text in case.cause:
        assert text in description, description
    run = lead["labels"].get("run")
    assert run, lead["labels"]  # every training page names its run
    # Nobody else is paged as a culprit: not in this notification, not later.
    if "rank" in labels or "instance" in labels:
        for _, alert in (p for name in case.pages for p in stack.paged()[name]):
            assert all(alert["labels"].get(k) == v for k, v in labels.items()
                       if k in ("rank", "instance")), alert["labels"]
    # The same page in Slack: its title says the alert, the run and where; its first
    # line is the lead alert's description.
    messages = [json.loads(r.body)["attachments"][0] for r in stack.slack(case.pages[0])]
    assert messages, f"no Slack message for {case.pages[0]}"
    title, text = messages[0]["title"], messages[0]["text"]
    assert f"FIRING: {case.pages[0]} — " in title and f"— run {run}" in title, title
    if "rank" in labels:
        assert f"rank {labels['rank']} on " in title, title
    if "instance" in labels:
        assert labels["instance"] in title, title
    if "world_size" in labels:  # a run that cannot start: how many of its ranks reported
        assert f"only {labels['reported']} of {labels['world_size']} ranks reported" in title, \
            title
    if "target" in labels:  # an unreachable rendezvous: the store's address
        assert f" — store {labels['target']} unreachable" in title, title
    if "remedy" in labels:  # a hardware page says what the node needs
        assert f" — {REMEDIES[labels['remedy']]}" in title, title
    # The lead alert's description is a firing bullet of the message. Not necessarily the
    # first: Slack's notification, later than the webhook's, may carry a second form of
    # the same alert for the same rank (TrainingHangSuspect's flight-recorder form beside
    # its outside-a-collective one), ordered before it.
    bullets = [line for line in text.splitlines()
               if line.startswith("• ") and not line.startswith("• ✅")]
    assert any(all(text_ in bullet for text_ in case.cause) for bullet in bullets), bullets
    for name, texts in case.later.items():  # a later page tells the same incident's story
        for _, alert in stack.paged()[name]:
            for text_ in texts:
                assert text_ in alert["annotations"]["description"], alert["annotations"]
    return first.at, description


@functools.cache
def release_versions(release: str) -> str:
    """"Prometheus 3.5.3, Alertmanager 0.33.1": what ``release`` runs, as the binaries say."""
    def version(binary: str) -> str:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=30, check=True)
        found = re.search(r"version (\d+\.\d+\.\d+)", out.stdout + out.stderr)
        return found.group(1) if found else "?"

    prometheus, alertmanager = stack_binaries(release)
    return f"Prometheus {version(prometheus)}, Alertmanager {version(alertmanager)}"


def render_table(rows: list[Row]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    failures = [row for row in rows if row.case.pages]
    healthy = [row for row in rows if not row.case.pages]
    lines = [
        "# Failures and their pages",
        "",
        "Generated by the fault-injection suite (`tests/faults/`): each failure injected",
        "into a real ColossalAI CPU job (2 ranks unless the row says more; Booster with",
        "TorchDDPPlugin, or the plain torch and ColossalAI process groups the row names;",
        "torchrun, gloo), watched by the node agent, the real Prometheus with the shipped",
        "rules and the real Alertmanager with the shipped routing.",
        f"Prometheus scrapes and evaluates every {INTERVAL:g} s; the rules' `for` windows",
        "are shortened through the documented override:",
        "",
        "```yaml" + RULES_OVERRIDE.rstrip(),
        "```",
        "",
        "Alertmanager's group waits are 1 s. *Seconds* run from the failure (the signal,",
        "or for a start-up failure the moment the rank recorded it) to the first",
        "notification at the pager (the bridge's webhook receiver). *What the page says*",
        "is that first notification's leading alert, as on-call reads it (and, where the",
        "incident goes on to end the run, the later page that says so: *Then*): the suite",
        "checks it names the alert, the rank (or node) where the incident began and why,",
        "and that its Slack title names the same rank and run; no page names another",
        "rank as a culprit. *Muted* alerts fired in Prometheus and were inhibited by",
        "Alertmanager under the cause (docs/rules.md, \"One incident, one page\"); after",
        f"the last page the pager was watched for {QUIET:g} s more, and until at least",
        f"{WATCHED_AFTER_FAILURE:g} s after the failure (past every shortened `for` window),",
        "and nothing else arrived.",
        "About half the cases run on Debian bookworm's Prometheus and Alertmanager, the",
        "others on Debian testing's (Prometheus 3, a current Alertmanager); *stack* says",
        "which, and the healthy run runs on both.",
        "Regenerate with `COLOSSALAI_FAULTS_DOCS=1 .venv/bin/python -m pytest -n 2 "
        "tests/faults` (every case; the workers' rows are merged).",
        "",
        "| failure | stack | paged | muted | seconds | what the page says |",
        "|---|---|---|---|---|---|",
    ]
    for row in failures:
        lines.append(f"| {cell(row.case.failure)} | {release_versions(row.case.release)} | "
                     f"{', '.join(row.pages)} | {', '.join(row.muted) or '—'} | "
                     f"{row.seconds:.1f} | {cell(row.description)}"
                     + "".join(f" *Then* {cell(text)}" for text in row.later) + " |")
    lines += [
        "",
        "## Healthy runs: pages (the goal is 0)",
        "",
        "Runs that must page nobody, through the same stack. Each was watched for the",
        "seconds given after its last event (longer than every shortened `for` window);",
        "the healthy run's end also has no alert but the Watchdog pending in Prometheus,",
        "so that the windows the override leaves long (GPUCollectorDown's 5 minutes,",
        "ExporterDown's) would not page later either.",
        "",
        "| run | stack | pages | watched |",
        "|---|---|---|---|",
    ]
    for row in healthy:
        lines.append(f"| {cell(row.case.failure)} | {release_versions(row.case.release)} | "
                     f"{len(row.pages)} | {row.watched:.0f} s |")
    lines += ["", f"Pages from healthy runs: {sum(len(r.pages) for r in healthy)} "
                  f"in {len(healthy)} runs.", ""]
    return "\n".join(lines)



def test_the_table_has_every_workers_rows_in_the_cases_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each xdist worker sees its own cases only: the rows meet in the run's directory,
    in the table's order whichever worker ran them, and docs/failures.md is written only
    from a run of every case."""
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    monkeypatch.setattr(sys.modules[__name__], "REPO", repo)
    order = table_order()
    rows = [Row(case, list(case.pages), 1.0, f"page of {case.name}", [], 25.0)
            for case in order]
    # two workers, each with every other case, the later first
    assert publish_rows(tmp_path, "gw1", rows[1::2], docs=True) == tmp_path / "failures.md"
    partial = (tmp_path / "failures.md").read_text()
    assert f"page of {order[1].name} |" in partial
    assert f"page of {order[0].name} |" not in partial
    written = publish_rows(tmp_path, "gw0", rows[0::2], docs=True)
    assert written == repo / "docs" / "failures.md"
    table = written.read_text()
    at = [table.index(f"page of {case.name} |") for case in order if case.pages]
    assert at == sorted(at) and len(at) == len([c for c in order if c.pages])
    assert table.count("| a healthy 4-rank run") == len(RELEASES)
    assert f"Pages from healthy runs: 0 in {len(order) - len(at)} runs." in table
