"""The rank's last error: what a page names as the cause of a failure.

One record per rank (the newest), copied into the snapshot and served as
``colossalai_training_last_error_info{where, type, device, message}`` with
``colossalai_training_last_error_timestamp_seconds``, so that an alert can say
"rank 1 died after CUDA out of memory: Tried to allocate 1024.00 MiB …"
instead of "rank 1 down".

The message is the exception's first line, cut to :data:`MESSAGE_LIMIT`
characters (a label value; CUDA's OOM text runs to several hundred characters
with the allocator's advice after the first sentence). Paths stay: which
checkpoint directory failed is what on-call needs. Credentials in URLs do not:
a ``user:password@`` part and a query string (where heartbeat and storage
tokens travel) are replaced by ``…``.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Final

from colossalai_exporter.rankstate.schema import Device, LastError
from colossalai_exporter.rankstate.verdict import COLLECTIVE_TIMEOUT

MESSAGE_LIMIT: Final = 240
#: where an exception was seen: a step, a checkpoint, a kernel load or build, booster.boost,
#: an evaluation, the run itself (fail() or an uncaught exception), record_oom()
WHERES: Final = ("step", "checkpoint", "kernels", "boost", "evaluation", "run", "caught")

_USERINFO = re.compile(r"(?<=://)[^/\s@]+@")
_QUERY = re.compile(r"(://[^\s?#]*)\?[^\s#]*")


def redact(text: str) -> str:
    """``text`` without URL credentials or query strings."""
    return _QUERY.sub(r"\1?…", _USERINFO.sub("…@", text))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0].strip() if text else ""
    line = redact(line)
    return line if len(line) <= MESSAGE_LIMIT else line[: MESSAGE_LIMIT - 1] + "…"


def error_record(exc: BaseException, where: str, device: Device | None,
                 now: float, note: str = "") -> LastError:
    """The snapshot's ``last_error``; ``note`` leads the message."""
    message = first_line(exc)
    if note:
        message = f"{note}: {message}"[:MESSAGE_LIMIT]
    return LastError(time=now, where=where, type=type(exc).__name__, device=device or "",
                     message=message, peer=device is None and is_peer_failure(exc))


# What a rank raises when another rank, or the link to it, failed first: the first rank
# to die takes its connections with it, and every rank in a collective with it then
# fails on its own side. These texts are the backends' and torch's own (gloo's
# tcp/pair.cc, ProcessGroupNCCL's watchdog and abort, NCCL's ncclRemoteError, the
# TCPStore client); a page must name the rank that died first, not these.
_PEER_FAILURE = re.compile(
    "|".join((
        r"connection (?:closed|reset) by peer",
        r"broken pipe",
        r"application timeout caused pair closure",
        *COLLECTIVE_TIMEOUT,  # gloo's, NCCL's watchdog's: the peer never came
        r"communicator was aborted",
        r"remote process exited or there was a network error",
        r"some nccl operations have failed or timed out",
        r"failed to recv, got 0 bytes",
        r"connection refused",  # the store went with its host (rank 0's launcher)
    )),
    re.IGNORECASE)
# torch.distributed's errors of the network and of the store: a peer or the rendezvous
# host is gone (a local NCCL or CUDA fault raises DistBackendError, which is not this).
_PEER_FAILURE_TYPES = frozenset({"DistNetworkError", "DistStoreError"})


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says another rank or the process group failed, not this rank.

    Looks at the whole message and at the exceptions it was raised from, since
    ColossalAI and user code often re-raise a backend's error with their own first line.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ in _PEER_FAILURE_TYPES:
            return True
        if _PEER_FAILURE.search(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


# Below this much free space a failed save is put down to a full filesystem: less than
# any model's checkpoint shard, more than the metadata a nearly full disk keeps writing.
FULL_BELOW_BYTES: Final = 64 * 1024 * 1024
SPACE_CHECK_SECONDS: Final = 1.0


def space_note(path: str | os.PathLike[str] | None) -> str:
    """"filesystem full (0 B free of 1.0 MiB at /ckpt)" when ``path``'s filesystem is full.

    Only on a failed checkpoint, off the hot path. ``statvfs`` runs in a thread
    with a deadline: the filesystem that just failed a write may be a hung mount,
    and the failing save must still propagate promptly.
    """
    if path is None:
        return ""
    target = os.fspath(path)
    result: list[os.statvfs_result] = []

    def look() -> None:
        probe = target
        while probe and not os.path.exists(probe):  # a save may fail before creating it
            parent = os.path.dirname(probe)
            if parent == probe:
                return
            probe = parent
        result.append(os.statvfs(probe or "."))

    thread = threading.Thread(target=look, name="colossalai-space-check", daemon=True)
    thread.start()
    thread.join(SPACE_CHECK_SECONDS)
    if not result:
        return ""
    stat = result[0]
    free, total = stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize
    if free >= FULL_BELOW_BYTES:
        return ""
    return f"filesystem full ({_size(free)} free of {_size(total)} at {target})"


def _size(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
