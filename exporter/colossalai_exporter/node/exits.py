"""How each local rank's process ended, judged from outside: what a page names as the cause.

When one rank of a job dies, the others follow within milliseconds: their
collectives fail on the dead rank's closed connections, torchrun sends SIGTERM to
the survivors, a scheduler's preemption ends them all at once. Which of the dead
ranks is the incident is not in the order they vanished (a scrape sees them all
gone at once), but in how each one ended:

``finished``
    the run completed (phase finished): ``monitor.finish()``, or a normal exit of the
    interpreter without it (the script's end, ``sys.exit()``). Not an incident, unless
    ranks of its run were left waiting for it in a collective: its loop ran fewer steps
    than theirs (the rules join that across nodes, with the step it finished after in
    the detail).
``interrupted``
    the rank received SIGTERM or SIGINT and recorded it (training/signals.py): a
    scheduler preempting or cancelling the job, torchrun stopping the ranks that
    survived another's failure, Ctrl-C. Not an incident of its own, unless it was the
    rank the ranks that timed out on other nodes waited for: the rules join that
    across nodes from :data:`COLLECTIVE_STATES`.
``oom_killed``
    the kernel's OOM killer ended it, or ended one of its DataLoader workers, after
    which the rank raised ("DataLoader worker (pid 4242) is killed by signal: Killed",
    the most common host-memory death of a rank). The kernel log names the victim's
    pid (exact); where it cannot be read (a container without CAP_SYSLOG), the rank's
    memory cgroup counting an OOM kill since the rank was last seen alive, else the
    node's ``/proc/vmstat`` count rising then, stands in (and the detail says which),
    for a worker's kill as for the rank's.
``failed``
    it raised an exception of its own (its last error, recorded before it died).
``peer_failed``
    it raised an error that says another rank or the process group failed first
    (a peer's connection closed, a communicator aborted, a collective timed out):
    a consequence, never the cause.
``hung``
    it was stalled (no step within its budget) when it received SIGTERM or SIGINT, or
    when it vanished without a word (as of when it was last seen alive: a rank frozen by
    SIGSTOP or a C call holding the GIL, then SIGKILLed by the launcher that stopped the
    hung job, wrote its last snapshot before its stall), and another rank of its run on
    this node shows it
    was the rank they waited for: the flight recorder has it behind that rank in a
    process group, or it was outside any collective while that rank, stalled, waited in
    one. The rank a hang waited for, ended after the hang (torchrun stopping it once
    the process group's timeout ended the ranks that waited, or a scheduler's time
    limit). Evidence from another rank, because on a GPU a rank that waits for NCCL
    blocks in a CUDA sync of its own code, which samples as compute just as the hung
    rank's does. Also a rank signalled while outside any collective, with nothing in
    flight, after a rank of its run on this node timed out waiting in one (gloo's
    error, or gone without a word past its collective's timeout: NCCL's watchdog): the
    process group's timeout was shorter than the step budget, so the run died before
    the hung rank counted as stalled. The incident, though a signal ended it.
``killed``
    it vanished with no error, no signal and no OOM kill recorded: SIGKILL from
    outside, a crash in native code, or an OOM kill no evidence could show. A crash
    the rank's crash report records (a segmentation fault, a bus error, an abort:
    rankstate/crash.py) is named in the detail, with the signal and the script's line.

A rank that vanished without a word with a collective in flight past its group's
timeout (the monitor publishes its oldest collective in flight and the group's
timeout), or, where its monitor does not say, while it waited in a collective past
its budget (seen waiting, or ahead of another rank in the flight recorder), is
``peer_failed``: ProcessGroupNCCL's watchdog ends such a rank once its collective
passes the process group's timeout (10 minutes by default), from C++, with SIGABRT
and no Python error. It waited for the rank that hung.

Each rank is judged once, when its process is first found gone, and the verdict
is kept (a cgroup's OOM count compared later would blame it for another rank's
kill). The evidence that must be taken while the rank lives (its memory cgroup
and the counts then) is only gathered when the kernel log cannot be read.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Final

from colossalai_exporter.node.oom import (
    KernelLog,
    MemoryCgroup,
    OomKill,
    cgroup_oom_kills,
    describe,
    memory_cgroup,
    vmstat_oom_kills,
)
from colossalai_exporter.rankstate.crash import Crash
from colossalai_exporter.rankstate.schema import WAITING, LastError, Snapshot
from colossalai_exporter.rankstate.verdict import judge, timed_out_in_collective

# An OOM kill in the kernel log counts for a rank only if logged after the rank's
# process started (a pid is reused), with this much slack for the clocks' rounding.
CLOCK_SLACK_SECONDS: Final = 1.0
# A rank writes its snapshot every publish interval until it ends (one that waits in a
# collective releases the GIL): one that wrote nothing for this many intervals, and at
# least this many seconds (a loaded machine delays a write), had ended by then.
SILENT_INTERVALS: Final = 5
SILENT_FLOOR_SECONDS: Final = 10.0
# What torch's DataLoader raises in the rank when a worker dies: "DataLoader worker (pid
# 4242) is killed by signal: Killed." or "DataLoader worker (pid(s) 4242, 4243) exited
# unexpectedly" (torch/utils/data/dataloader.py, and its SIGCHLD handler in C++).
_DATALOADER_WORKERS: Final = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\)")


#: Where a rank stood with its collectives when it ended (``colossalai_rank_exit_info``'s
#: ``collective``): ``timed_out``, its collective passed the process group's timeout (the
#: backend's error, or gone past it: NCCL's watchdog); ``waiting``, seen waiting in one,
#: or one in flight for half its group's timeout; ``idle``, outside any collective with
#: nothing in flight, both seen; else ``unknown``. What the rules join across nodes,
#: where no one agent sees both the ranks that timed out and the rank they waited for.
COLLECTIVE_STATES: Final = ("timed_out", "waiting", "idle", "unknown")


@dataclass(frozen=True)
class Exit:
    """How a rank's process ended: a reason of the module docstring's, a phrase for the
    page, and where it stood with its collectives (:data:`COLLECTIVE_STATES`)."""

    reason: str
    detail: str = ""
    collective: str = "unknown"


def _how_it_finished(snap: Snapshot) -> str:
    """"called monitor.finish() after step 500": the detail a page quotes for a rank that
    left its run early (docs/rules.md)."""
    if snap.finished_at_exit:
        return (f"exited normally after step {snap.steps} without calling monitor.finish() "
                "(the end of its script, or sys.exit())")
    return f"called monitor.finish() after step {snap.steps}"


@dataclass(frozen=True)
class _Peers:
    """The other ranks of a rank's run on this node as last seen, which of them are gone,
    and when the agent looked."""

    snaps: list[Snapshot]
    gone: frozenset[int]
    now: float

    def __iter__(self) -> Iterator[Snapshot]:
        return iter(self.snaps)

    def vanished(self, other: Snapshot) -> bool:
        """Whether ``other`` is gone without a word: no error, no signal, not finished."""
        return (other.rank in self.gone and other.phase not in ("finished", "failed")
                and other.interruption is None)


@dataclass
class _Baseline:
    """What a live rank's death will be compared with, when the kernel log is unreadable."""

    cgroup: MemoryCgroup | None
    cgroup_kills: tuple[int, int] | None
    node_kills: int | None


class ExitJudge:
    """Judges the end of each local rank (see the module docstring).

    ``kernel_log`` None: the kernel log is not read at all (the cgroup and
    ``/proc/vmstat`` fallbacks only). ``proc_root`` and ``sys_root`` let tests hand
    it a fake ``/proc`` and ``/sys/fs/cgroup``.
    """

    def __init__(self, kernel_log: KernelLog | None = None, *, proc_root: str = "/proc",
                 sys_root: str = "/sys/fs/cgroup", forget_after: float = 6 * 3600.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.kernel_log = kernel_log
        self.proc_root = proc_root
        self.sys_root = sys_root
        self.forget_after = forget_after
        self._clock = clock
        self._kills: dict[int, OomKill] = {}  # victim pid -> its kill, from the kernel log
        self._baselines: dict[tuple[int, float | None], _Baseline] = {}
        self._verdicts: dict[tuple[int, float | None], Exit] = {}
        # When each live rank's process was last seen alive: a rank frozen by SIGSTOP or
        # a C call holding the GIL publishes nothing, so its last snapshot predates its
        # stall, and the launcher's SIGKILL that ends the hung job finds it that way.
        self._alive_at: dict[tuple[int, float | None], float] = {}
        # The kernel's ring buffer read whole now, at the agent's start (on a busy node
        # tens of thousands of records): a scrape then reads only the new ones.
        self._poll_kernel_log()

    def _key(self, snap: Snapshot) -> tuple[int, float | None]:
        return snap.pid, snap.pid_start

    def _exact(self) -> bool:
        """Whether the kernel log is being read (then it alone names OOM victims)."""
        return self.kernel_log is not None and self.kernel_log.readable is True

    def scrape(self, alive: Iterable[Snapshot], gone: Iterable[Snapshot],
               crashes: Mapping[int, Crash],
               pids_mean_something: Callable[[Snapshot], bool]) -> dict[int, Exit]:
        """One scrape: note the live ranks, judge the gone ones; rank -> exit.

        ``crashes``: rank -> the crash report its (gone) process left, where it left one.
        ``pids_mean_something``: False for a rank in another PID namespace, whose pid
        names no process here (nothing is looked up or matched by it)."""
        self._poll_kernel_log()
        alive, gone = list(alive), list(gone)
        everyone = [*alive, *gone]
        gone_ranks = frozenset(s.rank for s in gone)
        exits = {snap.rank: self._judge(snap, not pids_mean_something(snap), everyone,
                                        gone_ranks, crashes.get(snap.rank))
                 for snap in gone}
        self._note_alive([s for s in alive if pids_mean_something(s)])
        keep = {self._key(s) for s in gone}
        self._verdicts = {k: v for k, v in self._verdicts.items() if k in keep}
        now = self._clock()
        self._alive_at = {self._key(s): now for s in alive}
        return exits

    def _poll_kernel_log(self) -> None:
        if self.kernel_log is None:
            return
        now = self._clock()
        for kill in self.kernel_log.poll():
            self._kills[kill.pid] = kill
        self._kills = {pid: k for pid, k in self._kills.items()
                       if now - k.time <= self.forget_after}

    def _note_alive(self, alive: list[Snapshot]) -> None:
        if self._exact():
            self._baselines.clear()  # the kernel log names victims: nothing to compare
            return
        node_kills = vmstat_oom_kills(self.proc_root)
        counts: dict[MemoryCgroup, tuple[int, int] | None] = {}
        baselines: dict[tuple[int, float | None], _Baseline] = {}
        for snap in alive:
            key = self._key(snap)
            known = self._baselines.get(key)
            # A process's cgroup is looked up once; its counts are read every scrape,
            # once per cgroup however many ranks share it (a Slurm job's, a pod's).
            cgroup = known.cgroup if known is not None else \
                memory_cgroup(snap.pid, self.proc_root, self.sys_root)
            if cgroup is not None and cgroup not in counts:
                counts[cgroup] = cgroup_oom_kills(cgroup)
            baselines[key] = _Baseline(cgroup, counts.get(cgroup) if cgroup else None,
                                       node_kills)
        self._baselines = baselines

    def _judge(self, snap: Snapshot, foreign: bool, everyone: list[Snapshot],
               gone: frozenset[int], crash: Crash | None) -> Exit:
        key = self._key(snap)
        verdict = self._verdicts.get(key)
        if verdict is None:
            run = snap.info.get("run")
            peers = _Peers([s for s in everyone if s is not snap and s.info.get("run") == run],
                           gone, self._clock())
            ended = self._first_judgement(snap, foreign, peers, crash)
            verdict = self._verdicts[key] = replace(
                ended, collective=_collective_at_end(snap, ended, peers.now))
        return verdict

    def _first_judgement(self, snap: Snapshot, foreign: bool, peers: _Peers,
                         crash: Crash | None) -> Exit:
        """``peers``: the other ranks of its run on this node, alive or gone, as last seen;
        ``crash``: the crash report its process left, if any."""
        if snap.phase == "finished":
            return Exit("finished", _how_it_finished(snap))
        if snap.interruption is not None:
            received = f"received {snap.interruption.signal}"
            at = snap.interruption.time
            hang = _hung(snap, at, peers) or _waited_for(snap, at, peers)
            if hang:
                return Exit("hung", f"{hang}; then it {received} (torchrun stopping it once "
                                    "another rank ended, or the scheduler)")
            if _idle(snap, at):
                # what the rules need where the ranks that waited for it are elsewhere
                received += f" {_where(snap)}, outside any collective with nothing in flight"
            return Exit("interrupted", received)
        kill = None if foreign else self._kill_of(snap.pid, snap)
        if kill is not None:
            return Exit("oom_killed", f"{describe(kill)}; from the kernel log")
        error = snap.last_error
        if snap.phase == "failed":
            if error is None:
                return Exit("failed", snap.error)
            worker = None if foreign else self._killed_worker(snap, error)
            if worker is not None:
                return worker
            return Exit("peer_failed" if error.peer else "failed",
                        f"{error.type}: {error.message}")
        if foreign and crash is None:
            # A crash report says the process ended; without one a rank whose pid means
            # nothing here may only be frozen, and nothing below can be judged.
            return Exit("killed", "its state snapshot stopped, and its process is in another "
                                  "PID namespace than this agent's: killed, or frozen")
        counted = self._counted_oom(snap, "the rank vanished")
        if counted is not None:
            return Exit("oom_killed", counted)
        # As of when it was last seen alive: a frozen rank was stalled then, though its
        # last snapshot (from before it froze) was not.
        alive_at = max(snap.written, self._alive_at.get(self._key(snap), snap.written))
        hang = _hung(snap, alive_at, peers)
        if hang:
            ended = f"it crashed: {crash.describe()}" if crash is not None else \
                "its process vanished with no error and no signal recorded (SIGKILL after " \
                "the hang, or a crash)"
            return Exit("hung", f"{hang}; then {ended}")
        timed_out = _outlived_its_timeout(snap, _latest_end(snap, peers.now))
        if timed_out:
            return Exit("peer_failed", f"{timed_out}, then vanished with no error recorded: "
                                       "the process group's watchdog (NCCL's) ends a rank "
                                       "whose collective outlives the timeout, from C++ "
                                       "(SIGABRT)")
        waited = _stalled_waiting(snap, snap.written, peers)
        if waited:
            return Exit("peer_failed", f"{waited}, then vanished with no error recorded: "
                                       "the process group's watchdog (NCCL's, past its "
                                       "timeout) ends a rank whose collective does not "
                                       "complete")
        if crash is not None:
            # After the watchdog's verdicts: NCCL's watchdog ends a waiting rank with
            # SIGABRT, which faulthandler reports too, and that rank waited.
            return Exit("killed", crash.describe())
        return self._killed()

    def _killed_worker(self, snap: Snapshot, error: LastError) -> Exit | None:
        """The OOM kill of a DataLoader worker the rank's error names: the rank raised
        because the OOM killer ended its worker. From the kernel log, which names the
        worker's pid; where it cannot be read, the rank's memory cgroup or the node
        counting an OOM kill as the worker died."""
        named = _DATALOADER_WORKERS.search(error.message)
        if named is None:
            return None
        raised = f"the rank then raised {error.type}: {error.message}"
        pids = [int(pid) for pid in named.group(1).split(",")]
        for pid in pids:
            kill = self._kill_of(pid, snap)
            if kill is not None:
                return Exit("oom_killed", f"in its DataLoader worker, pid {pid}: "
                                          f"{describe(kill)}; from the kernel log; {raised}")
        workers = ", ".join(map(str, pids))
        counted = self._counted_oom(snap, f"its DataLoader worker (pid {workers}) died")
        if counted is not None:
            return Exit("oom_killed", f"in its DataLoader worker: {counted}; {raised}")
        return None

    def _counted_oom(self, snap: Snapshot, event: str) -> str | None:
        """The OOM kill the rank's memory cgroup, else the node, counted since the rank
        was last seen alive, as ``event`` happened; None when neither counted one, or
        when the kernel log is read (then it alone names victims: no counts are kept)."""
        baseline = self._baselines.get(self._key(snap))
        if baseline is None:
            return None
        unreadable = "" if self.kernel_log is None or self._exact() else \
            f" (the kernel log, which names the victim, cannot be read: {self.kernel_log.problem})"
        if baseline.cgroup is not None and baseline.cgroup_kills is not None:
            now = cgroup_oom_kills(baseline.cgroup)
            if now is not None and now > baseline.cgroup_kills:
                group = now[1] > baseline.cgroup_kills[1]
                what = "killed every process of it (memory.oom.group)" if group else \
                    "counted an OOM kill"
                return f"memory cgroup {baseline.cgroup.path} {what} as {event}{unreadable}"
        if baseline.node_kills is not None:
            now_node = vmstat_oom_kills(self.proc_root)
            if now_node is not None and now_node > baseline.node_kills:
                return (f"the node's OOM-kill count (/proc/vmstat) rose as {event}; neither "
                        "the kernel log nor the rank's memory cgroup could say more")
        return None

    def _kill_of(self, pid: int, snap: Snapshot) -> OomKill | None:
        """The kernel log's OOM kill of ``pid`` during ``snap``'s rank's life (a pid is
        reused: a kill logged before the rank started was another process's)."""
        kill = self._kills.get(pid)
        if kill is None or kill.time < snap.created - CLOCK_SLACK_SECONDS:
            return None
        return kill

    def _killed(self) -> Exit:
        """A rank gone without a word, and no evidence of why."""
        if self._exact():
            return Exit("killed", "its process vanished with no error, no signal recorded "
                                  "and no OOM kill in the kernel log: SIGKILL from outside, "
                                  "or a crash in native code")
        unreadable = "" if self.kernel_log is None else \
            f" (the kernel log, which names the victim, cannot be read: {self.kernel_log.problem})"
        return Exit("killed", "its process vanished with no error and no signal recorded: "
                              "SIGKILL from outside, a crash in native code, or an OOM kill "
                              f"nothing on this node could show{unreadable}")

def _stall(snap: Snapshot, at: float) -> str:
    """"it made no step for 21s (budget 5s)" when ``snap`` was stalled at ``at``, or ""."""
    stalled, _ = judge(snap, at)
    if not stalled:
        return ""
    if snap.phase == "training":
        # since its last step, though a wait's end restarted the stall's clock
        what, since = "it made no step", snap.last_step or snap.progress
    else:
        what, since = f"it stayed in phase {snap.phase}", snap.progress
    return f"{what} for {at - since:.0f}s (budget {snap.timeout:g}s)"


def _where(snap: Snapshot) -> str:
    """"in compute at train.py:285 in step": where the rank's training thread was."""
    where = snap.activity
    if where is None:
        return "somewhere not known"
    return f"in {where.kind}" + (f" at {where.frame}" if where.frame else "")


def _waits(snap: Snapshot) -> bool:
    """Whether the rank was seen waiting for others (in a collective, or backward's)."""
    return snap.activity is not None and snap.activity.kind in WAITING


def _behind(snap: Snapshot, other: Snapshot) -> str:
    """"rank 0 is at collective 12 of process group 0, this rank at 11" when the flight
    recorder (recorded while stalled) shows ``snap`` behind ``other`` in a group both
    are in, or ""."""
    theirs = {g.pg: g.enqueued for g in other.collectives or ()}
    for group in snap.collectives or ():
        ahead = theirs.get(group.pg)
        if ahead is not None and group.enqueued < ahead:
            return (f"rank {other.rank} is at collective {ahead} of process group "
                    f"{group.pg}, this rank at {group.enqueued}")
    return ""


def _the_one_waited_for(snap: Snapshot, peers: _Peers) -> str:
    """Why ``snap`` is the rank its run's other ranks on this node waited for, or "".

    Evidence from another rank, not from ``snap`` alone: on a GPU, NCCL's collectives
    return at once and a rank that waits for them blocks later, in a CUDA sync in its
    own code (``loss.item()``), which samples as compute just as the hung rank's does.
    So either the flight recorder shows ``snap`` behind another rank in a process
    group and ahead of none (a rank behind in one group only because it waits in
    another, as in pairs of groups, waited too), or ``snap`` was outside any collective
    while another stalled rank was seen waiting in one."""
    if not any(_behind(other, snap) for other in peers):
        for other in peers:
            behind = _behind(snap, other)
            if behind:
                return f"{_where(snap)}, behind the others ({behind})"
    if snap.activity is None or _waits(snap):
        return ""
    for other in peers:
        if other.stalled and _waits(other):
            return (f"{_where(snap)}, outside any collective, while rank {other.rank} "
                    f"waited {_where(other)}")
    return ""


def _hung(snap: Snapshot, at: float, peers: _Peers) -> str:
    """How the rank hung, as of ``at``: stalled, and the one the others waited for."""
    stall = _stall(snap, at)
    evidence = _the_one_waited_for(snap, peers) if stall else ""
    if not evidence:
        return ""
    return f"{stall}, {evidence}: the rank the others waited for"


def _waited_for(snap: Snapshot, at: float, peers: _Peers) -> str:
    """How ``snap`` was the rank the others waited for, when signalled at ``at``: outside
    any collective, with nothing in flight its group's timeout could end, after a rank of
    its run (on this node) timed out waiting in one.

    What a hang looks like when the process group's timeout is shorter than the step
    budget: the waiting ranks' collective times out before the hung rank counts as
    stalled, and torchrun then stops the hung rank. gloo (and NCCL in blocking-wait mode)
    raises the timeout as a Python error; NCCL's watchdog ends the rank that waited with
    none, and its collective in flight past the timeout is the evidence. The ranks that
    waited are told from the one they waited for by that collective: on a GPU every
    rank's thread samples as compute."""
    if not _idle(snap, at):
        return ""
    for other in peers:
        timed_out = _timed_out(other, snap, at, peers)
        if timed_out:
            stall = _stall(snap, at)
            return (f"{stall + ', ' if stall else 'it was '}{_where(snap)}, outside any "
                    f"collective, when {timed_out}: the rank the others waited for")
    return ""


def _timed_out(other: Snapshot, snap: Snapshot, at: float, peers: _Peers) -> str:
    """How ``other`` timed out waiting in a collective during ``snap``'s life, up to
    ``at``, or "": the backend's error (gloo's), or gone without a word with its
    collective in flight past the timeout (NCCL's watchdog)."""
    error = other.last_error
    if error is not None and snap.created <= error.time <= at \
            and timed_out_in_collective(error):
        return (f"rank {other.rank} timed out waiting for a peer in a collective "
                f"({error.type}: {error.message})")
    if peers.vanished(other):
        ended_by = min(at + CLOCK_SLACK_SECONDS, _latest_end(other, peers.now))
        outlived = _outlived_its_timeout(other, ended_by)
        if outlived:
            return (f"rank {other.rank} vanished with no error ({outlived}: NCCL's "
                    "watchdog ends such a rank)")
    return ""


def _latest_end(snap: Snapshot, now: float) -> float:
    """The latest ``snap``'s rank can have ended: when the agent found it gone, or a few
    publish intervals after its last snapshot, whichever came first."""
    silent = max(SILENT_INTERVALS * (snap.publish_interval or 0.0), SILENT_FLOOR_SECONDS)
    return min(now, snap.written + silent)


def _outlived_its_timeout(snap: Snapshot, ended_by: float) -> str:
    """"its collective 38 of process group 0 had been in flight 29s at its last snapshot,
    and the group's timeout is 30s" when its oldest collective in flight passed its
    group's timeout by ``ended_by``, or "". The monitor first sees a collective in flight
    up to one publish interval after it was enqueued: it may be that much older."""
    pending = snap.pending
    if pending is None or pending.timeout is None:
        return ""
    enqueued = pending.since - (snap.publish_interval or 0.0)
    if ended_by + CLOCK_SLACK_SECONDS < enqueued + pending.timeout:
        return ""
    return (f"its collective {pending.seq} of process group {pending.pg} had been in flight "
            f"{snap.written - pending.since:.0f}s at its last snapshot, and the group's "
            f"timeout is {pending.timeout:g}s")


def _idle(snap: Snapshot, at: float) -> bool:
    """Whether ``snap`` was outside any collective with nothing in flight (for half its
    group's timeout) at ``at``, both seen: where it was sampled, and the recorder's
    status read. On a GPU the first alone cannot tell: a rank that waits for NCCL
    samples in a CUDA sync, as compute."""
    return snap.activity is not None and not _waits(snap) and snap.in_flight_known \
        and not _in_flight_long(snap, at)


def _collective_at_end(snap: Snapshot, ended: Exit, now: float) -> str:
    """Where the rank stood with its collectives when it ended (:data:`COLLECTIVE_STATES`)."""
    at = snap.interruption.time if snap.interruption is not None else snap.written
    error = snap.last_error
    if snap.phase == "failed" and error is not None and timed_out_in_collective(error):
        return "timed_out"
    if ended.reason == "peer_failed" and snap.phase != "failed" \
            and _outlived_its_timeout(snap, _latest_end(snap, now)):
        return "timed_out"
    if _waits(snap) or _in_flight_long(snap, at):
        return "waiting"
    return "idle" if _idle(snap, at) else "unknown"


def _in_flight_long(snap: Snapshot, at: float) -> bool:
    """Whether ``snap`` had a collective in flight for half its group's timeout by ``at``:
    a rank that waited too, whose own timeout had not yet come."""
    pending = snap.pending
    return pending is not None and pending.timeout is not None \
        and at - pending.since >= pending.timeout / 2


def _stalled_waiting(snap: Snapshot, at: float, peers: _Peers) -> str:
    """How the rank waited, as of ``at``: stalled, and seen waiting in a collective (or
    backward's), or ahead of another rank in the flight recorder; or ""."""
    stall = _stall(snap, at)
    if not stall:
        return ""
    if _waits(snap):
        return f"{stall}, waiting {_where(snap)}"
    for other in peers:
        behind = _behind(other, snap)
        if behind:
            return f"{stall}, {_where(snap)}, ahead of rank {other.rank} ({behind})"
    return ""
