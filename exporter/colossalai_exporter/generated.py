"""Files the project generates and commits (docs, rules, dashboards, manifests): write or check.

Every generator ends the same way: with ``--check`` nothing is written and each
stale or missing file is named with the command that regenerates it (exit 1,
what CI runs); otherwise every file is written and named.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path


def write_or_check(files: Mapping[Path, str], *, check: bool, regenerate: str) -> int:
    """Write ``files`` (path -> text), or with ``check`` report those that differ; exit code."""
    if check:
        stale = [path for path, text in files.items()
                 if not path.exists() or path.read_text(encoding="utf-8") != text]
        for path in stale:
            print(f"{path} is stale: run '{regenerate}'", file=sys.stderr)
        return 1 if stale else 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0
