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

``COLOSSALAI_FAULTS_DOCS=1`` rewrites docs/failures.md from the run (bench/RESULTS.md
gives the command); otherwise the table goes to the test's temporary directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, require, small_tmpfs, wait_until
from fake_vigilmon import fake_vigilmon
from fault_stack import (
    INTERVAL,
    RULES_OVERRIDE,
    Stack,
    now,
    running_stack,
    wait_for_snapshot,
    wait_healthy,
)

pytestmark = pytest.mark.slow

PAGE_DEADLINE = 90.0  # seconds from the fault to its page, at most (the slowest: 30 s stale + 10 s)
QUIET = 8.0  # seconds the pager is watched after the last expected page and muted alert


@dataclass(frozen=True)
class Case:
    name: str
    failure: str  # what happened, for the table
    fault: str  # FAULT for train.py, or "sigkill" / "sigstop" (sent by the test)
    rank: int  # the rank with the failure
    pages: tuple[str, ...]  # alert names that must page, and nothing else
    labels: dict[str, str] = field(default_factory=dict)  # on the first of pages
    cause: tuple[str, ...] = ()  # texts the first page's description must hold
    muted: tuple[str, ...] = ()  # alerts that must fire, but be inhibited
    trigger: str = "signal"  # signal | start (the fault happens at start-up by itself)
    target: str = "dir"  # checkpoint target: dir | full | file | fifo
    quiet: float = QUIET
    ranks: int = 2  # torchrun's --nproc_per_node
    restarts: int = 0  # torchrun's --max-restarts
    shipped_for: tuple[str, ...] = ()  # alerts keeping their shipped `for` window
    deadline: float = PAGE_DEADLINE  # seconds from the fault to its page, at most


CASES = [
    Case("frozen-compute", "rank 1 frozen in compute (GIL released); rank 0 waits in "
         "backward's all-reduce", "frozen_compute", 1, ("TrainingHangSuspect",),
         {"rank": "1", "cause": "outside_collective", "activity": "compute"},
         ("is the rank the others wait for", "in compute at train.py:",
          "in inject_in_step while 1 other rank(s) wait in backward"),
         muted=("TrainingStalled",)),
    Case("gil-hang", "rank 1 hung in a C call holding the GIL", "gil_hang", 1,
         ("TrainingHangSuspect",), {"rank": "1", "cause": "not_responding"},
         ("is not responding (GIL held by a C call, or the process frozen",
          "while 1 other rank(s) wait in backward"),
         muted=("TrainingStalled", "TrainingRankDown")),
    Case("sigstop", "rank 1 SIGSTOPped", "sigstop", 1, ("TrainingHangSuspect",),
         {"rank": "1", "cause": "not_responding"},
         ("is not responding (process stopped: SIGSTOP or a debugger",
          "while 1 other rank(s) wait in backward"),
         muted=("TrainingStalled", "TrainingRankDown")),
    Case("frozen-compute-4-ranks", "rank 2 of 4 frozen in compute; ranks 0, 1 and 3 wait "
         "in backward's all-reduce", "frozen_compute", 2, ("TrainingHangSuspect",),
         {"rank": "2", "cause": "outside_collective", "activity": "compute"},
         ("in inject_in_step while 3 other rank(s) wait in backward",),
         muted=("TrainingStalled",), ranks=4),
    Case("data-stuck", "rank 1's data loader blocks (a read that never returns)",
         "data_stuck", 1, ("TrainingHangSuspect",),
         {"rank": "1", "cause": "outside_collective", "activity": "data"},
         ("in data at train.py:", "in __iter__ while 1 other rank(s) wait in backward"),
         muted=("TrainingStalled",)),
    Case("all-slow", "every rank 20 times slower, within its step budget: a slow job is "
         "not a hang", "all_slow", -1, (), quiet=20.0),
    Case("straggler", "rank 1 steadily slower (0.25 s more per step, within its budget): "
         "rank 0 waits for it in backward at every step", "straggler", 1,
         ("TrainingStraggler",), {"rank": "1", "cause": "waits_least"},
         ("is the rank the others wait for at every step",)),
    Case("sigkill", "rank 1 SIGKILLed (what the kernel's OOM killer does)", "sigkill", 1,
         ("TrainingRankDown",), {"rank": "1", "cause": "process"},
         ("is down: its process is gone",)),
    Case("oom-caught", "CUDA out-of-memory error on rank 1, caught, the loop goes on",
         "oom_caught", 1, ("GeminiOutOfMemory",), {"rank": "1", "device": "cuda"},
         ("GPU memory (CUDA)", "OutOfMemoryError: CUDA out of memory. Tried to allocate "
          "1024.00 MiB")),
    Case("oom-kills-rank-0", "CUDA out-of-memory error on rank 0, uncaught: rank 0 dies, "
         "torchrun stops rank 1", "oom_fatal", 0, ("GeminiOutOfMemory",),
         {"rank": "0", "device": "cuda"}, ("OutOfMemoryError: CUDA out of memory",),
         muted=("TrainingRankDown",)),
    Case("gemini-layout", "Gemini's \"Adjust layout failed! No enough CUDA memory!\" on "
         "rank 1, uncaught", "gemini_layout", 1, ("GeminiOutOfMemory",),
         {"rank": "1", "device": "cuda"},
         ("RuntimeError: Adjust layout failed! No enough CUDA memory!",),
         muted=("TrainingRankDown",)),
    Case("host-oom", "a real host allocation failure (torch.empty of 32 TiB) on rank 1, "
         "caught", "host_oom", 1, ("GeminiOutOfMemory",), {"rank": "1", "device": "cpu"},
         ("host memory", "DefaultCPUAllocator: can't allocate memory")),
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
         ("phase checkpointing",), muted=("TrainingRankDown",), target="fifo"),
    Case("long-evaluation", "a 20 s evaluation on every rank (4 step budgets)", "long_eval",
         -1, (), quiet=25.0),
    Case("kernel-build-fails", "ColossalAI's CPU Adam kernel does not load (HybridAdam on "
         "a machine without it), uncaught, every rank", "kernel_build_fails", -1,
         ("KernelBuildFailed",), {},
         ("AssertionError: No usable kernel found for CPUAdamLoader",),
         muted=("TrainingRankDown",), trigger="start"),
    # Three restarts of a ColossalAI job take a minute or two on a 2-core machine; the
    # ranks are down between restarts for less than TrainingRankDown's shipped minute.
    Case("crash-loop", "rank 1 raises at every start (a data shard it reads is gone); "
         "torchrun restarts the job three times", "resume_fails", 1,
         ("TrainingRestartLoop",), {},
         ("restarted 3 times", "wrote no checkpoint meanwhile",
          "First failure (rank 1, in run): FileNotFoundError: [Errno 2] No such file"),
         trigger="start", restarts=3, shipped_for=("TrainingRankDown",), deadline=300.0),
    Case("kernel-build-slow", "a kernel JIT build on rank 1 longer than its budget (5 s)",
         "kernel_build_slow", 1, ("TrainingStartupStuck",), {"rank": "1", "phase": "kernels"},
         ("phase kernels",), trigger="start"),
]


@dataclass
class Row:
    case: Case
    pages: list[str]
    seconds: float
    description: str
    muted: list[str]


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


def inject(stack: Stack, case: Case) -> float:
    """Make the failure happen; returns when (wall clock)."""
    ranks = list(range(case.ranks)) if case.rank < 0 else [case.rank]
    at = now()
    for rank in ranks:
        pid = stack.job.pid(rank)
        if case.fault == "sigkill":
            os.kill(pid, signal.SIGKILL)
        elif case.fault == "sigstop":
            os.kill(pid, signal.SIGSTOP)
        else:
            os.kill(pid, signal.SIGUSR1)
    return at


def started_failing(stack: Stack, case: Case) -> float:
    """When a start-up fault happened, as the failing rank recorded it."""
    rank = max(case.rank, 0)
    snap = stack.job.snapshot(rank)
    if case.fault == "kernel_build_slow":
        return snap.phase_start  # entering phase kernels
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
    write_docs = os.environ.get("COLOSSALAI_FAULTS_DOCS") == "1" and len(ROWS) == len(CASES)
    out = REPO / "docs" / "failures.md" if write_docs else \
        tmp_path_factory.mktemp("faults-table") / "failures.md"
    out.write_text(render_table(ROWS))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_failure_pages_with_its_cause_and_nothing_else(
        case: Case, tmp_path: Path) -> None:
    require(importlib.util.find_spec("colossalai") is not None,
            "colossalai 0.5.0 and torch (scripts/install-dev.sh)")
    with fake_vigilmon() as receiver, checkpoint_target(case, tmp_path) as target, \
            running_stack(tmp_path, receiver, case.fault, case.rank, target,
                          checkpoint_every=10**9 if case.target != "dir" else 50,
                          ranks=case.ranks, restarts=case.restarts,
                          shipped_for=case.shipped_for) as stack:
        if case.trigger == "start":
            wait_for_snapshot(stack, max(case.rank, 0))
            # a crash loop fails first right after its first start
            first_start = stack.job.snapshot(max(case.rank, 0)).created
        else:
            wait_healthy(stack)
            fault_at = inject(stack, case)

        def all_paged() -> bool:
            return set(case.pages) <= set(stack.paged())

        wait_until(all_paged, timeout=case.deadline + 120 * (case.trigger == "start"),
                   interval=0.2, what=f"{case.pages} paged (log: {stack.job.log})")
        if case.trigger == "start":
            fault_at = first_start if case.restarts else started_failing(stack, case)
        for name in case.muted:  # fired in Prometheus, muted by Alertmanager
            wait_until(lambda name=name: stack.prometheus.alerts(name), timeout=PAGE_DEADLINE,
                       interval=0.2, what=f"{name} firing in Prometheus")
            wait_until(lambda name=name: "suppressed" in stack.alertmanager_states(name),
                       timeout=10, interval=0.2, what=f"{name} inhibited in Alertmanager")
        watch_quietly(stack, case.quiet)

        paged = stack.paged()
        assert set(paged) == set(case.pages), (paged.keys(), stack.job.log.read_text()[-3000:])
        row = Row(case, sorted(paged), 0.0, "", list(case.muted))
        if case.pages:
            check_the_page(stack, case, paged)
            first_at, first = min(paged[case.pages[0]], key=lambda p: p[0])
            row.seconds = first_at - fault_at
            row.description = first["annotations"]["description"]
            assert row.seconds < case.deadline, row.seconds
        ROWS.append(row)


def watch_quietly(stack: Stack, seconds: float) -> None:
    """Let the pager receive whatever else would page; an observation window, not a wait
    for speed: what arrives in it is what the case checks."""
    deadline = now() + seconds
    wait_until(lambda: now() >= deadline, timeout=seconds + 5, interval=0.25,
               what="the observation window")


def check_the_page(stack: Stack, case: Case, paged: dict[str, list[tuple[float, Any]]]) -> None:
    alerts = [alert for _, alert in paged[case.pages[0]]]
    matching = [a for a in alerts
                if all(a["labels"].get(k) == v for k, v in case.labels.items())]
    assert matching, (case.labels, [a["labels"] for a in alerts])
    alert = matching[0]
    run = alert["labels"].get("run")
    assert run, alert["labels"]  # every training page names its run
    for text in case.cause:
        assert text in alert["annotations"]["description"], alert["annotations"]
    # The alert's own Slack message: an alert name can have several groups (the
    # rank-down seen by the agent and the rank server that stopped answering).
    messages = [json.loads(r.body)["attachments"][0] for r in stack.slack(case.pages[0])]
    assert messages, f"no Slack message for {case.pages[0]}"
    # (Descriptions are rendered again each evaluation, "snapshot 10.3s old" moves on:
    # the message is recognised by its cause and the alert's instance, not verbatim.)
    # (a run's alert, like the restart loop, has no instance)
    ours = [m for m in messages if alert["labels"].get("instance", "") in m["text"]
            and all(text in m["text"] for text in case.cause)]
    assert ours, (alert["labels"], case.cause, [m["text"] for m in messages])
    assert f"— run {run}" in ours[0]["title"], ours[0]["title"]
    for text in case.cause:
        assert text in ours[0]["text"], ours[0]["text"]


def render_table(rows: list[Row]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [
        "# Failures and their pages",
        "",
        "Generated by the fault-injection suite (`tests/faults/`): each failure injected",
        "into a real 2-rank (one case 4-rank) ColossalAI CPU job (Booster with",
        "TorchDDPPlugin, torchrun, gloo), watched by the node agent, the real Prometheus",
        "with the shipped rules and the real Alertmanager with the shipped routing.",
        f"Prometheus scrapes and evaluates every {INTERVAL:g} s; the rules' `for` windows",
        "are shortened through the documented override:",
        "",
        "```yaml" + RULES_OVERRIDE.rstrip(),
        "```",
        "",
        "Alertmanager's group waits are 1 s. *Seconds* run from the failure (the signal,",
        "or for a start-up failure the moment the rank recorded it) to the first",
        "notification at the pager (the bridge's webhook receiver). *Muted* alerts fired",
        "in Prometheus and were inhibited by Alertmanager under the cause (docs/rules.md,",
        "\"One incident, one page\"); after the last page the pager was watched for",
        f"{QUIET:g} s more, and nothing else arrived. Regenerate with",
        "`COLOSSALAI_FAULTS_DOCS=1 .venv/bin/python -m pytest tests/faults`.",
        "",
        "| failure | paged | muted | seconds | what the page says |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {cell(row.case.failure)} | {', '.join(row.pages) or 'nothing'} | "
                     f"{', '.join(row.muted) or '—'} | "
                     f"{row.seconds:.1f} | {cell(row.description) or '—'} |"
                     if row.pages else
                     f"| {cell(row.case.failure)} | nothing | — | — | — |")
    lines.append("")
    return "\n".join(lines)

