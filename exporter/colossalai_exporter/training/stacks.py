"""Stall evidence: the Python stacks of every thread, written to the run directory."""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path


def format_all_stacks() -> str:
    """Every thread's current Python stack, main thread first, with names and ids."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    frames = sys._current_frames()
    parts = []
    for ident in sorted(frames, key=lambda i: (i != main_id, i)):
        header = f'Thread {ident} "{names.get(ident, "?")}"'
        parts.append(header + "\n" + "".join(traceback.format_stack(frames[ident])))
    return "\n".join(parts)


def write_stacks(run_dir: Path, rank: int, reason: str, now: float | None = None) -> Path:
    """Write ``stacks-rank<R>-<unix time>.txt`` into ``run_dir`` and return its path.

    Written to a hidden temporary file beside it and renamed into place (as the flight
    recorder's dump is), so a reader that finds the file never sees it partly written."""
    now = time.time() if now is None else now
    path = run_dir / f"stacks-rank{rank}-{int(now)}.txt"
    text = (f"# colossalai-exporter stall evidence, rank {rank}, "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now))}\n# {reason}\n\n"
            + format_all_stacks())
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
