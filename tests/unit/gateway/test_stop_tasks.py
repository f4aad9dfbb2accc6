"""Background tasks that swallow their cancellation do not hang the gateway's stop
(gateway/tasks.py; the output-length history and the peers use it)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kiloserve.gateway import tasks
from kiloserve.gateway.output_history import SharedOutputPredictor
from kiloserve.gateway.output_history_settings import OutputHistoryConfig
from kiloserve.gateway.tasks import stop_tasks


async def _deaf(until: asyncio.Event) -> None:
    """Swallows every cancellation (as redis-py's pipeline execute did once)."""
    while not until.is_set():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.05)


async def test_stop_tasks_returns_the_ones_that_would_not_stop() -> None:
    until = asyncio.Event()
    deaf = asyncio.ensure_future(_deaf(until))
    polite = asyncio.ensure_future(asyncio.sleep(3600))
    await asyncio.sleep(0)  # both running
    async with asyncio.timeout(5):
        left = await stop_tasks([deaf, polite], timeout_s=0.2)
    assert left == [deaf] and polite.cancelled() and not deaf.done()
    until.set()  # the test's own clean-up
    await deaf


async def test_the_history_stops_when_redis_swallowed_the_flush_loops_cancel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flush loop's Redis call swallows the cancel (as a task dump in CI showed);
    stop() still returns after the bounded wait: it used to wait for ever."""
    monkeypatch.setattr(tasks, "STOP_WAIT_S", 0.3)
    history = SharedOutputPredictor(
        OutputHistoryConfig(flush_interval_s=0.01), "redis://unused", default_tokens=16
    )
    deaf = [True]

    async def flush() -> bool:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            if not deaf[0]:
                raise
        return False

    history._flush = flush  # type: ignore[method-assign]
    loop_task = asyncio.ensure_future(history._flush_loop())
    history._tasks = [loop_task]
    await asyncio.sleep(0.1)
    async with asyncio.timeout(3):
        await history.stop()
    assert history._tasks == [] and not loop_task.done()
    deaf[0] = False  # the test's own clean-up
    loop_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await loop_task
