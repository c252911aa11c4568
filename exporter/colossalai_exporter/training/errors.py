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

import re
from typing import Any, Final

from colossalai_exporter.training.oom import Device

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
                 now: float) -> dict[str, Any]:
    """The snapshot's ``last_error``: a JSON-ready dict."""
    return {"time": now, "where": where, "type": type(exc).__name__,
            "device": device or "", "message": first_line(exc)}
