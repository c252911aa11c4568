"""Body-read deadlines: one sweep per event loop cuts off slow reads, and only those."""

from __future__ import annotations

import asyncio
import sys

import pytest

from colossalai_exporter.web.deadlines import ReadDeadlines


async def _read(deadlines: ReadDeadlines, never: asyncio.Event) -> str:
    """What App.handle does around a body read."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    deadlines.start(task, loop)  # type: ignore[arg-type]
    try:
        await never.wait()
    except asyncio.CancelledError:
        if deadlines.finish(task, loop):  # type: ignore[arg-type]
            return "timed out"
        raise
    deadlines.finish(task, loop)  # type: ignore[arg-type]
    return "read"


def test_a_read_past_its_deadline_is_cut_off_and_the_others_are_not() -> None:
    async def main() -> None:
        deadlines = ReadDeadlines(0.2)
        loop = asyncio.get_running_loop()
        started = loop.time()
        slow, fast = asyncio.Event(), asyncio.Event()
        slow_read = asyncio.create_task(_read(deadlines, slow))
        fast_read = asyncio.create_task(_read(deadlines, fast))
        await asyncio.sleep(0.05)
        fast.set()
        assert await fast_read == "read"
        assert await slow_read == "timed out"
        # Cut off between the deadline and one tick after it.
        assert 0.2 <= loop.time() - started < 0.2 + deadlines.tick + 0.1
        if sys.version_info >= (3, 11):
            assert slow_read.cancelling() == 0  # our cancel was taken back
        # With nothing left to watch, the sweep stops re-arming itself.
        await asyncio.sleep(deadlines.tick * 2.5)
        assert loop not in deadlines._reading

    asyncio.run(main())


def test_a_cancel_from_elsewhere_is_not_taken_for_a_timeout() -> None:
    async def main() -> None:
        deadlines = ReadDeadlines(10)
        read = asyncio.create_task(_read(deadlines, asyncio.Event()))
        await asyncio.sleep(0.01)
        read.cancel()  # the server stopping, say
        with pytest.raises(asyncio.CancelledError):
            await read

    asyncio.run(main())


@pytest.mark.parametrize(("seconds", "tick"), [(0.2, 0.05), (5, 0.5), (30, 1.0)])
def test_the_sweep_is_late_by_at_most_a_tenth_of_the_deadline(seconds: float,
                                                              tick: float) -> None:
    assert ReadDeadlines(seconds).tick == tick
