"""Stopping the gateway's background tasks without waiting for ever on one.

A task that swallows its cancellation keeps running. A gateway's shutdown (``gather``
of its tasks) waited for ever on one in CI: the output-length history's flush loop was
still running, cancelled, after ``cancel()`` (a task dump; its one other await is
redis-py's pipeline ``execute``, redis 8.1, which evidently swallowed the cancel).
``stop_tasks`` cancels and waits a bounded time (``STOP_WAIT_S``), then goes on: the
shutdown completes, the task is left to die with the process.
"""

from __future__ import annotations

import asyncio
import logging

__all__ = ["STOP_WAIT_S", "stop_tasks"]

logger = logging.getLogger(__name__)

STOP_WAIT_S = 5.0


async def stop_tasks(
    tasks: list[asyncio.Task[None]], timeout_s: float | None = None
) -> list[asyncio.Task[None]]:
    """Cancel ``tasks`` and wait for them, at most ``timeout_s`` (default
    ``STOP_WAIT_S``); the ones still running are returned (and logged)."""
    if timeout_s is None:
        timeout_s = STOP_WAIT_S
    for task in tasks:
        task.cancel()
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in done:
        if not task.cancelled():
            task.exception()  # retrieved: an error while stopping is no news
    if pending:
        logger.warning("%d background task(s) did not stop within %.0f s", len(pending), timeout_s)
    return list(pending)
