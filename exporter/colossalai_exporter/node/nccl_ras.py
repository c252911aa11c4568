"""NCCL's RAS service: what every communicator of the job looks like, from NCCL itself.

Every process of an NCCL >= 2.24 job runs a RAS thread listening on
``localhost:28028`` (``NCCL_RAS_ADDR``); any one of them answers for the whole
job. The protocol is lines of text (NCCL's ``src/ras/client.cc``)::

    > CLIENT PROTOCOL 2        < SERVER PROTOCOL 2
    > TIMEOUT 5                < OK
    > SET FORMAT JSON          < OK            (NCCL >= 2.28.7; an error before)
    > VERBOSE STATUS           < the report, then the server closes

The JSON report lists each communicator's ``size``, its ``ranks`` (host, pid,
``status`` flags, ``collective_counts`` per operation) and its
``missing_ranks`` (host, pid, ``unresponsive``, ``considered_dead``). NCCL
2.28.9 writes a missing rank without the comma before its ``status`` (invalid
JSON; :func:`parse_json` repairs it). Without JSON, the text report's
communicator table gives each group's size and whether it is RUNNING and OK.

Every node's agent asks its own local RAS server, and every answer covers the
whole job, so each node reports only what concerns it (bounded series, and no
node repeats the job): the communicators that have a rank on this node, and
the problems of its own ranks (a rank behind the others in collective counts,
aborted, with an asynchronous error). Missing ranks are reported by every node
that reports their communicator: their own node may be the one that died.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, cast

from prometheus_client.core import Metric as MetricFamily

from colossalai_exporter import catalogue
from colossalai_exporter.node.base import CollectorError, FuturePending

if TYPE_CHECKING:
    from colossalai_exporter.node.base import Pending
    from colossalai_exporter.node.collectors import Built
    from colossalai_exporter.node.config import NodeConfig
    from colossalai_exporter.node.ranks import RanksCollector

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 28028
PROTOCOL: Final = 2
MAX_REPORT_BYTES: Final = 16 << 20
#: problems a rank can have, the values of colossalai_nccl_rank_problem_info{problem}
PROBLEMS: Final = ("missing", "unresponsive", "dead", "aborted", "async_error", "behind")


class RasError(Exception):
    """The RAS server answered, but not as the protocol says (``protocol``) or too late
    (``timeout``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class RasRank:
    rank: int
    host: str
    pid: int
    counts: Mapping[str, int] = field(default_factory=dict)
    problems: tuple[str, ...] = ()

    @property
    def collectives(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True)
class RasCommunicator:
    comm: str
    size: int
    ranks: tuple[RasRank, ...]
    missing: tuple[RasRank, ...] = ()
    #: text reports only: the group's status column said it is not running or not OK
    troubled: bool = False

    @property
    def ok(self) -> bool:
        return not self.troubled and not self.missing and not any(r.problems for r in self.ranks)


@dataclass(frozen=True)
class RasReport:
    version: str
    communicators: tuple[RasCommunicator, ...]
    detailed: bool = True  # JSON: per-rank data; text: one line per communicator group


# ---------------------------------------------------------------------------
# The conversation
# ---------------------------------------------------------------------------
def query(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
          timeout: float = 5.0) -> tuple[str, str]:
    """(``"json"`` or ``"text"``, the report), within ``timeout`` seconds in all.

    ConnectionRefusedError when nothing listens (no NCCL job on this node);
    :class:`RasError` for anything else that goes wrong.
    """
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        raise
    except TimeoutError:
        raise RasError("timeout", f"no connection to RAS at {host}:{port} within "
                                  f"{timeout:g}s") from None
    except OSError as exc:
        raise RasError("error", f"cannot connect to RAS at {host}:{port}: "
                                f"{exc.strerror or exc}") from None
    with sock:
        lines = _Lines(sock, deadline)
        lines.send(f"CLIENT PROTOCOL {PROTOCOL}")
        hello = lines.read()
        if not hello.startswith("SERVER PROTOCOL"):
            raise RasError("protocol", f"RAS answered {hello[:80]!r} to the handshake")
        # The server's own deadline for gathering from its peers, under ours.
        lines.send(f"TIMEOUT {max(1, int(timeout / 2))}")
        if lines.read() != "OK":
            raise RasError("protocol", "RAS refused the TIMEOUT command")
        lines.send("SET FORMAT JSON")
        kind = "json" if lines.read() == "OK" else "text"  # NCCL < 2.28.7: no JSON
        lines.send("VERBOSE STATUS")
        return kind, lines.rest()


class _Lines:
    """Line-by-line reads and writes on ``sock``, all within one deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.buffer = b""

    def _timeout(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RasError("timeout", "RAS did not answer in time")
        return left

    def send(self, line: str) -> None:
        self.sock.settimeout(self._timeout())
        try:
            self.sock.sendall(line.encode() + b"\n")
        except TimeoutError:
            raise RasError("timeout", "RAS did not take the request in time") from None
        except OSError as exc:
            raise RasError("error", f"RAS connection failed: {exc}") from None

    def _recv(self) -> bytes:
        self.sock.settimeout(self._timeout())
        try:
            return self.sock.recv(65536)
        except TimeoutError:
            raise RasError("timeout", "RAS did not answer in time") from None
        except OSError as exc:
            raise RasError("error", f"RAS connection failed: {exc}") from None

    def read(self) -> str:
        while b"\n" not in self.buffer:
            chunk = self._recv()
            if not chunk:
                raise RasError("protocol", "RAS closed the connection mid-handshake")
            self.buffer += chunk
            if len(self.buffer) > 4096:
                raise RasError("protocol", "RAS answered a handshake line of over 4 KiB")
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode(errors="replace").strip()

    def rest(self) -> str:
        chunks = [self.buffer]
        size = len(self.buffer)
        while chunk := self._recv():
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_REPORT_BYTES:
                raise RasError("protocol", f"RAS report over {MAX_REPORT_BYTES} bytes")
        return b"".join(chunks).decode(errors="replace")


# ---------------------------------------------------------------------------
# The reports
# ---------------------------------------------------------------------------
# NCCL 2.28.9 prints a missing rank's last number without its comma:
#     "nvml_dev": 1
#     "status": {
_MISSING_COMMA: Final = re.compile(r'(?<=[\d"el\]}])(\s*\n\s*")')


def parse_json(text: str) -> RasReport:
    """A JSON report, repaired where NCCL 2.28.9 leaves out a comma; RasError when it is
    not a report."""
    body = text[text.find("{"):] if "{" in text else text
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        try:
            data = json.loads(_MISSING_COMMA.sub(r",\1", body))
        except json.JSONDecodeError as exc:
            raise RasError("protocol", f"RAS JSON report unreadable: {exc.msg} at line "
                                       f"{exc.lineno}") from None
    if not isinstance(data, dict) or not isinstance(data.get("communicators"), list):
        raise RasError("protocol", "RAS JSON report has no communicators list")
    try:
        comms = tuple(_communicator(c) for c in data["communicators"])
    except (KeyError, TypeError, ValueError) as exc:
        raise RasError("protocol", f"RAS JSON report of an unexpected shape: {exc!r}") \
            from None
    return RasReport(str(data.get("nccl_version", "")), comms)


def _communicator(data: Mapping[str, Any]) -> RasCommunicator:
    ranks = [_rank(r) for r in data.get("ranks") or []]
    missing = tuple(_missing(r) for r in data.get("missing_ranks") or [])
    # Behind: fewer collectives than the communicator's most advanced rank. A rank that
    # has done fewer collectives than the others is the one they wait for in a hang.
    most = max((r.collectives for r in ranks), default=0)
    ranks = [RasRank(r.rank, r.host, r.pid, r.counts,
                     r.problems + (("behind",) if r.collectives < most else ()))
             for r in ranks]
    return RasCommunicator(str(data["hash"]), int(data["size"]), tuple(ranks), missing)


def _rank(data: Mapping[str, Any]) -> RasRank:
    status = data.get("status") or {}
    problems = []
    if status.get("abort_flag"):
        problems.append("aborted")
    if status.get("async_error"):
        problems.append("async_error")
    counts = {str(k): int(v) for k, v in (data.get("collective_counts") or {}).items()}
    return RasRank(int(data["rank"]), str(data.get("host", "")), int(data.get("pid", 0)),
                   counts, tuple(problems))


def _missing(data: Mapping[str, Any]) -> RasRank:
    status = data.get("status") or {}
    problem = ("dead" if status.get("considered_dead") else
               "unresponsive" if status.get("unresponsive") else "missing")
    return RasRank(int(data["rank"]), str(data.get("host", "")), int(data.get("pid", 0)),
                   problems=(problem,))


_VERSION: Final = re.compile(r"NCCL version (\S+)")
# "    0         1         1         1         1         1   RUNNING      OK"
_GROUP_ROW: Final = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)")


def parse_text(text: str) -> RasReport:
    """The text report's communicator table: one entry per group (no per-rank data)."""
    version = _VERSION.search(text)
    # From the "Communicators" section to the "Errors" section (the table's own header
    # has a column called Errors: the section is the word alone on its line).
    section = re.split(r"\n\s*Errors\s*\n", text.split("Communicators", 1)[-1], maxsplit=1)[0]
    groups = []
    for line in section.splitlines():
        row = _GROUP_ROW.match(line)
        if row:
            group, status, errors = row.group(1), row.group(7), row.group(8)
            groups.append(RasCommunicator(f"group{group}", int(row.group(5)), (),
                                          troubled=status != "RUNNING" or errors != "OK"))
    if version is None:
        raise RasError("protocol", "RAS text report without its NCCL version line")
    return RasReport(version.group(1), tuple(groups), detailed=False)


# ---------------------------------------------------------------------------
# The collector
# ---------------------------------------------------------------------------
@dataclass
class _Asking(FuturePending):
    """A scrape's question to RAS (a Pending), maybe one an earlier scrape asked."""

    future: Future[tuple[str, str]]


class NcclRasCollector:
    """Implements :class:`~colossalai_exporter.node.base.BegunCollector`.

    The question is asked in a thread of its own (``begin``), so that a RAS server
    that accepts and never answers holds that thread until the deadline, never the
    agent's event loop; a question still unanswered is not asked again.
    ``local_hosts`` are this node's addresses; ``local_ranks`` gives the training
    rank of each local pid (the ranks collector's snapshots), so that problems
    carry the ``rank`` label the training series have. ``local_world`` gives the
    local ranks' run and world size: a communicator of the world's size holds
    every rank in order (torch creates it with the sorted ranks), so its rank
    number is the training rank, and a missing rank on a node whose agent is gone
    is still named, with its run.
    """

    name = "nccl"
    reasons: tuple[str, ...] = ("timeout", "protocol", "error")

    def __init__(self, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 timeout: float = 3.0, local_hosts: frozenset[str] | None = None,
                 local_ranks: Callable[[], Mapping[int, int]] = dict,
                 local_world: Callable[[], tuple[str, int] | None] = lambda: None,
                 ask: Callable[[str, int, float], tuple[str, str]] = query) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.local_hosts = local_hosts if local_hosts is not None else node_addresses()
        self.local_ranks = local_ranks
        self.local_world = local_world
        self._ask = ask
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nccl-ras")
        self._asking: Future[tuple[str, str]] | None = None

    def begin(self, deadline: float) -> _Asking:
        if self._asking is None or self._asking.done():
            budget = max(0.05, min(self.timeout, deadline - time.monotonic()))
            self._asking = self._pool.submit(self._ask, self.host, self.port, budget)
        return _Asking(self._asking)

    def collect(self, deadline: float, pending: Pending | None = None) -> list[MetricFamily]:
        asking = pending if isinstance(pending, _Asking) else self.begin(deadline)
        try:
            kind, body = asking.future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            raise CollectorError("timeout", f"RAS at {self.host}:{self.port} did not answer "
                                            "before the scrape's deadline") from None
        except ConnectionRefusedError:
            return self._families(None)  # no NCCL job here now: nothing to report
        except RasError as exc:
            raise CollectorError(exc.reason, str(exc)) from None
        try:
            report = parse_json(body) if kind == "json" else parse_text(body)
        except RasError as exc:
            raise CollectorError(exc.reason, str(exc)) from None
        return self._families(report)

    def _families(self, report: RasReport | None) -> list[MetricFamily]:
        size = catalogue.gauge("colossalai_nccl_communicator_size")
        missing = catalogue.gauge("colossalai_nccl_communicator_missing_ranks")
        ok = catalogue.gauge("colossalai_nccl_communicator_ok")
        problems = catalogue.info("colossalai_nccl_rank_problem_info")
        behind = catalogue.gauge("colossalai_nccl_rank_collectives_behind")
        out = [size, missing, ok, problems, behind]
        if report is None:
            return out
        pids = self.local_ranks()
        run, world_size = self.local_world() or ("", 0)

        def local(rank: RasRank) -> bool:
            return rank.host in self.local_hosts or rank.pid in pids

        def training_rank(comm: RasCommunicator, rank: RasRank) -> str:
            if rank.pid in pids:
                return str(pids[rank.pid])
            return str(rank.rank) if world_size and comm.size == world_size else ""

        for comm in report.communicators:
            if report.detailed and not any(local(r) for r in comm.ranks + comm.missing):
                continue  # another node's communicator: its nodes report it
            size.add_metric([comm.comm], float(comm.size))
            ok.add_metric([comm.comm], 1.0 if comm.ok else 0.0)
            if report.detailed:
                missing.add_metric([comm.comm], float(len(comm.missing)))
            most = max((r.collectives for r in comm.ranks), default=0)
            for rank in comm.ranks:
                if not local(rank):
                    continue
                training = training_rank(comm, rank)
                for problem in rank.problems:
                    problems.add_metric([comm.comm, str(rank.rank), rank.host, str(rank.pid),
                                         training, run, problem], {})
                if rank.collectives < most:
                    behind.add_metric([comm.comm, str(rank.rank), training],
                                      float(most - rank.collectives))
            for rank in comm.missing:
                problems.add_metric([comm.comm, str(rank.rank), rank.host, str(rank.pid),
                                     training_rank(comm, rank), run, rank.problems[0]], {})
        return out

    def close(self) -> None:
        # A question to a server that never answers ends at its own deadline.
        self._pool.shutdown(wait=False, cancel_futures=True)


def node_addresses() -> frozenset[str]:
    """This node's IP addresses and host name, as RAS names hosts."""
    import psutil

    addresses = {socket.gethostname()}
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                addresses.add(entry.address.split("%", 1)[0])
    return frozenset(addresses)


def from_config(config: NodeConfig, built: Built) -> NcclRasCollector:
    """The registry's factory (node/collectors.py). The ranks collector's pids name the
    local ranks in NCCL's answers; without it, none is named."""
    ranks = cast("RanksCollector | None", built.collectors.get("ranks"))
    return NcclRasCollector(
        config.nccl_ras.host, config.nccl_ras.port, config.nccl_timeout,
        local_ranks=ranks.local_pids if ranks is not None else dict,
        local_world=ranks.local_world if ranks is not None else lambda: None)
