"""The node's evidence of kernel OOM kills: which process the OOM killer ended, and why.

A rank the OOM killer ends dies of SIGKILL ("exitcode -9"), as after a timer kill or
``scancel``. Only the kernel log names the victim (its pid in the initial pid namespace),
the memory cgroup whose limit was hit and whether a cgroup limit or the node ran out:
:class:`KernelLog`. Without it (a container lacking CAP_SYSLOG) counters remain, of a
rank's :func:`memory_cgroup` and the node. Never imports torch; never blocks.

Records read (tests/fixtures/kmsg/README.md has examples and sources): 5.0+ "oom-kill:
constraint=…,oom_memcg=…,task_memcg=…,task=…,pid=…"; 4.x "Task in X killed as a result of
limit of Y" and "…: Kill process P (…) score … or sacrifice child" (a child may die in
P's place); "Tasks in X are going to be killed due to memory.oom.group set"; and for
each victim "[message: ]Killed process PID (comm) total-vm:…kB, anon-rss:…kB, …".
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from colossalai_exporter.node.kmsg import KernelRecords

_CONSTRAINTS = {"CONSTRAINT_NONE": "global", "CONSTRAINT_MEMCG": "memcg",
                "CONSTRAINT_CPUSET": "cpuset", "CONSTRAINT_MEMORY_POLICY": "mempolicy"}
_KILLED = re.compile(r"(?:(?P<message>[^:]*): )?Killed process (?P<pid>\d+) \((?P<task>.*)\)"
                     r"(?P<rest>.*)")
_CHOSEN = re.compile(r"(?P<message>[^:]*): Kill process \d+ \(.*\) score \d+")
_TASK_IN = re.compile(r"Task in (?P<task_memcg>.+) killed as a result of limit of (?P<memcg>.+)")
_GROUP = re.compile(r"Tasks in (?P<memcg>.+) are going to be killed due to memory\.oom\.group")
_SIZE = re.compile(r"([a-z-]+):(\d+)kB")


@dataclass(frozen=True)
class OomKill:
    """One process the kernel's OOM killer ended, from the kernel log."""

    pid: int                 # victim pid as the kernel logs it (the initial pid namespace)
    task: str                # its command name, e.g. "python3"
    time: float              # boot time + the record's microseconds (a clock NTP never steers)
    constraint: str          # "memcg", "global", "cpuset", "mempolicy", or "" when not logged
    memcg: str               # the cgroup whose limit was hit (oom_memcg=), "" if unknown
    task_memcg: str          # the victim's own cgroup (task_memcg=); a group kill's cgroup
    anon_rss_bytes: int | None
    file_rss_bytes: int | None
    shmem_rss_bytes: int | None
    total_vm_bytes: int | None
    group: bool              # killed as part of a memory.oom.group kill (the whole container)


@dataclass
class _Context:  # what the records before a kill said about it
    constraint: str = ""
    memcg: str = ""
    task_memcg: str = ""
    pid: int | None = None  # the victim it names; None: the next kill of this OOM (4.x)


def _constraint_of(message: str) -> str:
    # 4.x says "Out of memory" for cpuset and mempolicy OOMs too; 5.0+ names them before.
    return ("memcg" if message.startswith("Memory cgroup out of memory") else
            "global" if message.startswith("Out of memory") else "")


def _summary(text: str) -> _Context:
    """The 5.0+ one-line summary, field by field: mems_allowed is a node list that may hold
    commas, a global OOM has ",global_oom" for oom_memcg, the command name may hold anything."""
    def field(pattern: str) -> str:
        found = re.search(pattern, text)
        return found[1] if found else ""
    name, pid = field(r"constraint=(\w+)"), field(r",task=.*,pid=\s*(\d+)")
    return _Context(_CONSTRAINTS.get(name, name.removeprefix("CONSTRAINT_").lower()),
                    field(r",oom_memcg=(.*?),task(?:_memcg)?="), field(r",task_memcg=(.*?),task="),
                    int(pid) if pid else None)


class _Parser:
    """Records in, one at a time; :class:`OomKill` out, in ``kills``."""

    def __init__(self) -> None:
        self.kills: list[OomKill] = []
        self._context: _Context | None = None
        self._last: OomKill | None = None  # this OOM's victim, which a group kill follows
        self._group: str | None = None  # a group kill's cgroup, until the next OOM; its pids
        self._group_pids: set[int] = set()

    def feed(self, when: float, text: str) -> None:
        if "invoked oom-killer:" in text:  # a new OOM: nothing before it belongs to it
            self._context, self._last, self._group = None, None, None
        elif text.startswith("oom-kill:"):
            self._start(_summary(text))
        elif match := _TASK_IN.match(text):
            self._start(_Context("memcg", match["memcg"], match["task_memcg"]))
        elif match := _CHOSEN.match(text):  # 4.x; the kill that follows may be a child's
            if self._context is None or self._context.pid is not None:
                self._start(_Context(_constraint_of(match["message"])))
        elif match := _GROUP.match(text):  # after the first victim, every process again
            first = self._last
            self._group, self._group_pids = match["memcg"], {first.pid} if first else set()
            if first is not None:  # it died with its group: so marked, unless handed out
                self._last = replace(first, group=True)
                self.kills = [self._last if kill is first else kill for kill in self.kills]
        elif match := _KILLED.match(text):
            self._killed(when, match)

    def _start(self, context: _Context) -> None:
        self._context, self._last, self._group = context, None, None

    def _killed(self, when: float, match: re.Match[str]) -> None:
        pid, said = int(match["pid"]), _constraint_of(match["message"] or "")
        sizes = {key: int(kb) * 1024 for key, kb in _SIZE.findall(match["rest"])}  # kB: KiB
        if self._group is not None:
            if pid in self._group_pids:
                return  # the first victim, listed again (before 5.3 threads are listed too)
            self._group_pids.add(pid)
            first = self._last
            context = _Context(first.constraint, first.memcg) if first else _Context(said)
            context.task_memcg = self._group
        elif self._context and self._context.pid in (None, pid):  # what the context names
            context, self._context = self._context, None
        else:
            context = _Context()
        kill = OomKill(pid, match["task"], when, context.constraint or said, context.memcg,
                       context.task_memcg, sizes.get("anon-rss"), sizes.get("file-rss"),
                       sizes.get("shmem-rss"), sizes.get("total-vm"), self._group is not None)
        self.kills.append(kill)
        if not kill.group:
            self._last = kill


class KernelLog:
    """Reads OOM kills from /dev/kmsg incrementally (node/kmsg.py reads the records).
    ``path`` and ``boot_time`` injectable; ``path`` may also be a file of records as
    /dev/kmsg gives them (``cat /dev/kmsg``)."""

    def __init__(self, path: str = "/dev/kmsg", boot_time: float | None = None) -> None:
        self._records = KernelRecords(path, boot_time)
        self._parser = _Parser()

    @property
    def readable(self) -> bool | None:
        """None before the first poll; False when the log cannot be opened or read."""
        return self._records.readable

    @property
    def problem(self) -> str:
        return self._records.problem

    def poll(self) -> list[OomKill]:
        """Every OOM kill recorded since the last poll (the first poll reads the whole ring
        buffer, so an agent started after a kill still sees it). Never blocks, never raises
        for I/O: when the log cannot be opened or read, returns [] and ``readable`` is False
        with ``problem`` saying why in one line."""
        for when, text in self._records.poll():
            self._parser.feed(when, text)
        kills, self._parser.kills = self._parser.kills, []
        return kills

    def close(self) -> None:
        """Close the log; a later poll opens it again and starts from its oldest record."""
        self._records.close()


@dataclass(frozen=True)
class MemoryCgroup:
    """A process's memory cgroup, where its OOM kill counters are."""

    version: int   # 1 or 2
    path: str      # the cgroup path as /proc/<pid>/cgroup gives it, e.g. "/slurm_job_4242"
    directory: str  # where its control files are


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _under(root: str, path: str) -> str | None:
    """``path`` under ``root``; None for a path outside this cgroup namespace ("/../x")."""
    parts = [part for part in path.split("/") if part]
    return None if ".." in parts else os.path.join(root, *parts)


def memory_cgroup(pid: int, proc_root: str = "/proc",
                  sys_root: str = "/sys/fs/cgroup") -> MemoryCgroup | None:
    """The memory cgroup of a live process (v1 'memory' controller line; else the v2 '0::'
    line when its directory has memory.events); None when the process is gone or no memory
    cgroup can be found."""
    text = _read(os.path.join(proc_root, str(pid), "cgroup"))
    if text is None:
        return None
    unified = None
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            unified = path
        elif "memory" in controllers.split(","):
            directory = _under(os.path.join(sys_root, "memory"), path)
            if directory and os.path.isdir(directory):
                return MemoryCgroup(1, path, directory)
    if unified is None:
        return None
    # cgroup2 is at sys_root on a v2 host, at sys_root/unified on a hybrid one, and there
    # often without the memory controller (no memory.events), as on this project's hosts.
    for root in (sys_root, os.path.join(sys_root, "unified")):
        directory = _under(root, unified)
        if directory and os.path.isfile(os.path.join(directory, "memory.events")):
            return MemoryCgroup(2, unified, directory)
    return None


def _counters(path: str) -> dict[str, int] | None:
    """A flat "key value" file: memory.events, memory.oom_control, /proc/vmstat."""
    text = _read(path)
    if text is None:
        return None
    pairs = (line.partition(" ") for line in text.splitlines())
    return {key: int(value) for key, _, value in pairs if value.strip().isdigit()}


def cgroup_oom_kills(cgroup: MemoryCgroup) -> tuple[int, int] | None:
    """(oom_kill, oom_group_kill) counted by the cgroup: v1 memory.oom_control's
    "oom_kill N" (group kills: 0); v2 memory.events' "oom_kill" and "oom_group_kill" (0
    when the kernel lacks the field). None when unreadable (the cgroup was removed with
    its container) or not counted (v1 before kernel 4.13)."""
    name = "memory.oom_control" if cgroup.version == 1 else "memory.events"
    values = _counters(os.path.join(cgroup.directory, name))
    if values is None or "oom_kill" not in values:
        return None
    return values["oom_kill"], values.get("oom_group_kill", 0)


def vmstat_oom_kills(proc_root: str = "/proc") -> int | None:
    """The node's OOM kills since boot: /proc/vmstat's oom_kill (kernel >= 4.13), None when
    absent."""
    # Read at every scrape: one line of about 180 found with bytes.find (about 13 us with
    # the read) rather than every line split into a dict (about 70 us).
    try:
        with open(os.path.join(proc_root, "vmstat"), "rb") as f:
            text = b"\n" + f.read()
    except OSError:
        return None
    start = text.find(b"\noom_kill ")
    if start < 0:
        return None
    end = text.find(b"\n", start + 1)
    value = text[start + len(b"\noom_kill "):end if end >= 0 else None].strip()
    return int(value) if value.isdigit() else None


def _size(value: int) -> str:
    gib = value / 2**30
    return f"{gib:.1f} GiB" if gib >= 1 else f"{value / 2**20:.1f} MiB"


def describe(kill: OomKill) -> str:
    """A short phrase for a page, e.g. "memory cgroup /slurm_job_4242 at its limit,
    anon-rss 99.5 MiB" or "the node out of memory (no cgroup limit), anon-rss 12.3 GiB";
    a group kill adds "with every process of cgroup … (memory.oom.group)"."""
    parts = [{"memcg": f"memory cgroup {kill.memcg or '(unknown)'} at its limit",
              "global": "the node out of memory (no cgroup limit)",
              "cpuset": "the memory nodes of its cpuset out of memory",
              "mempolicy": "the memory nodes of its NUMA policy out of memory",
              "": "out of memory (the kernel log does not say where)",
              }.get(kill.constraint, f"out of memory ({kill.constraint})")]
    if kill.anon_rss_bytes is not None:
        parts.append(f"anon-rss {_size(kill.anon_rss_bytes)}")
    if kill.group:
        cgroup = kill.task_memcg or kill.memcg or "(unknown)"
        parts.append(f"with every process of cgroup {cgroup} (memory.oom.group)")
    return ", ".join(parts)
