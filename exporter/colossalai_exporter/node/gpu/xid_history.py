"""In which boots of the node each GPU's Xid codes were seen: an Xid back after a reboot.

A reboot clears the driver's state and the kernel log. An Xid that comes back on the
same GPU after one points at the hardware, not at anything the reboot reset (gpud
calls for hardware inspection when the same Xid follows two reboots). The agent
keeps, per GPU (by UUID: its index can change between boots) and Xid code, the boot
ids it was seen in (``/proc/sys/kernel/random/boot_id``), in a small JSON file in its
state directory (``--state.dir``). Without one it knows only the boot it runs in.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("colossalai_exporter.node")

BOOT_ID = "/proc/sys/kernel/random/boot_id"
FILE_NAME = "xid-boots.json"
#: boots kept a GPU and code (the most recent): enough to tell "came back" apart
KEEP_BOOTS = 8


def current_boot_id(path: str = BOOT_ID) -> str:
    try:
        return Path(path).read_text(encoding="ascii").strip()
    except OSError:
        return "unknown"


class XidBoots:
    """``{uuid: {code: [boot ids]}}``, loaded once and written when it changes."""

    def __init__(self, state_dir: str | os.PathLike[str] | None, boot_id: str) -> None:
        self.path = Path(state_dir) / FILE_NAME if state_dir else None
        self.boot_id = boot_id
        self._boots: dict[str, dict[str, list[str]]] = {}
        self._lock = threading.Lock()
        self._warned = False
        if self.path is not None:
            self._load(self.path)

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("Xid history %s not read (%s); starting a new one", path, exc)
            return
        if isinstance(data, dict):
            self._boots = {str(uuid): {str(code): [str(b) for b in boots][-KEEP_BOOTS:]
                                       for code, boots in codes.items()
                                       if isinstance(boots, list)}
                           for uuid, codes in data.items() if isinstance(codes, dict)}

    def seen(self, uuid: str, code: int) -> bool:
        """Record ``code`` on GPU ``uuid`` in this boot; True when that is new (a write
        is due)."""
        with self._lock:
            boots = self._boots.setdefault(uuid, {}).setdefault(str(code), [])
            if self.boot_id in boots:
                return False
            boots.append(self.boot_id)
            del boots[:-KEEP_BOOTS]
            return True

    def boots(self, uuid: str, code: int) -> int:
        """The boots ``code`` was seen in on GPU ``uuid``, this one included."""
        with self._lock:
            return len(self._boots.get(uuid, {}).get(str(code), ()))

    def save(self) -> None:
        """Write the file atomically; a failure is logged once, never raised."""
        if self.path is None:
            return
        with self._lock:
            text = json.dumps(self._boots, sort_keys=True)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("Xid history not written to %s (%s): an Xid back after a "
                            "reboot will not be told", self.path, exc)
