"""uvicorn's h11 protocol with the same protections as the default httptools one.

Kept for comparison (``serve(protocol="h11")``, benchmarks) and as a pure-Python
fallback; :mod:`.server` imports it only when asked for.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

from colossalai_exporter.web import server


class H11ServerProtocol(server.IgnoresUpgrades, H11Protocol):
    """A deadline for the first request's head, and TCP_NODELAY.

    The head's size is capped by h11 itself (``h11_max_incomplete_event_size``,
    which :func:`.server.serve` sets to :data:`.server.MAX_HEAD_BYTES`; over it,
    uvicorn answers 400 and closes), but only while the head is incomplete: a larger
    head that arrives whole in one read is parsed. Only the first head has a deadline.
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        server.set_nodelay(transport)
        self._head_timer = self.loop.call_later(server.HEADER_TIMEOUT_SECONDS,
                                                self._head_timeout)

    def _head_timeout(self) -> None:
        # ``cycle`` is set once h11 has parsed a complete request head.
        if getattr(self, "cycle", None) is None and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)
