"""The concurrent scrape loop: every backend's ``/metrics`` page, parsed into the table.

Parsing is ``kiloserve.routing.engine_metrics`` (no I/O, shared with the simulator);
this module owns only the HTTP side: one loop per backend, so one slow backend never
delays the others' refresh, and a tick that marks stale values.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from kiloserve.routing.engine_metrics import parse_engine_metrics
from kiloserve.routing.table import BackendTable

__all__ = ["scrape_loop"]

logger = logging.getLogger(__name__)


async def _scrape_backend(
    session: aiohttp.ClientSession, table: BackendTable, backend_id: str, timeout_s: float
) -> None:
    url = table.url_of(backend_id) + "/metrics"
    try:
        async with asyncio.timeout(timeout_s), session.get(url) as resp:
            text = await resp.text()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        table.record_scrape_failure(backend_id, time.monotonic(), type(exc).__name__)
        return
    if status >= 500:
        table.record_scrape_failure(backend_id, time.monotonic(), f"http {status}")
    elif status >= 400:
        table.record_scrape_unavailable(backend_id, time.monotonic())
    else:
        table.record_scrape(backend_id, parse_engine_metrics(text), time.monotonic())


async def _every(interval_s: float, what: str, step: Callable[[], Awaitable[None]]) -> None:
    """Run ``step`` every ``interval_s`` (start to start) until cancelled."""
    while True:
        started = time.monotonic()
        try:
            await step()
        except Exception:  # keep going whatever one round did
            logger.exception("%s failed", what)
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


async def scrape_loop(
    session: aiohttp.ClientSession,
    table: BackendTable,
    interval_s: float,
    timeout_s: float,
) -> None:
    """Scrape forever (cancel the task to stop).

    Each backend has its own loop, so one slow backend never delays the others'
    refresh; a separate tick marks stale values every ``interval_s``.
    """

    def scrape(backend_id: str) -> Callable[[], Awaitable[None]]:
        return lambda: _scrape_backend(session, table, backend_id, timeout_s)

    loops: dict[str, asyncio.Task[None]] = {}

    async def refresh() -> None:
        table.refresh_staleness(time.monotonic())
        ids = set(table.backend_ids())  # backends come and go with a registry
        for b in ids - loops.keys():
            loops[b] = asyncio.create_task(_every(interval_s, f"scrape of {b}", scrape(b)))
        for b in loops.keys() - ids:
            loops.pop(b).cancel()

    try:
        await _every(interval_s, "staleness refresh", refresh)
    finally:
        for task in loops.values():
            task.cancel()
        await asyncio.gather(*loops.values(), return_exceptions=True)
