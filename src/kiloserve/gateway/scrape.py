"""The concurrent scrape loop: every backend's ``/metrics`` page, parsed into the table.

Parsing is ``kiloserve.routing.engine_metrics`` (no I/O, shared with the simulator);
this module owns only the HTTP side: one loop per backend, so one slow backend never
delays the others' refresh, and a tick that marks stale values.

With ``kiloserve gateway --workers N`` the engines are scraped once, not N times:
worker 0 scrapes and publishes each outcome in the shared segment
(``SharedLoad.put_scrape``), the other workers apply the published outcomes to their
tables as if they had scraped (``get_scrape``), and scrape an engine themselves only
while its published record is older than two intervals plus the timeout (worker 0
restarting, or stuck).

A backend with a ``node_metrics_url`` (its node's dcgm-exporter) has that page fetched
in the same round, concurrently with ``/metrics``, by every worker (it is small and
not shared): ``routing/node_metrics.py`` parses it, ``BackendTable.record_node`` takes
its PCIe load and health verdict.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from kiloserve.routing.engine_metrics import EngineMetrics, parse_engine_metrics
from kiloserve.routing.node_metrics import NodeMetrics, node_problems, parse_node_metrics
from kiloserve.routing.shared_load import (
    SCRAPE_FAILED,
    SCRAPE_OK,
    SCRAPE_UNAVAILABLE,
    SharedLoad,
)
from kiloserve.routing.table import BackendTable

__all__ = ["follow_age_s", "scrape_loop"]

logger = logging.getLogger(__name__)


def _apply(
    table: BackendTable,
    backend_id: str,
    outcome: int,
    now_s: float,
    metrics: EngineMetrics | None,
    reason: str,
) -> None:
    if outcome == SCRAPE_OK and metrics is not None:
        table.record_scrape(backend_id, metrics, now_s)
    elif outcome == SCRAPE_UNAVAILABLE:
        table.record_scrape_unavailable(backend_id, now_s)
    else:
        table.record_scrape_failure(backend_id, now_s, reason)


async def _scrape_backend(
    session: aiohttp.ClientSession,
    table: BackendTable,
    backend_id: str,
    timeout_s: float,
    share: SharedLoad | None = None,
) -> None:
    url = table.url_of(backend_id) + "/metrics"
    metrics: EngineMetrics | None = None
    reason = ""
    try:
        async with asyncio.timeout(timeout_s), session.get(url) as resp:
            text = await resp.text()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        outcome, reason = SCRAPE_FAILED, type(exc).__name__
    else:
        if status >= 500:
            outcome, reason = SCRAPE_FAILED, f"http {status}"
        elif status >= 400:
            outcome = SCRAPE_UNAVAILABLE
        else:
            outcome, metrics = SCRAPE_OK, parse_engine_metrics(text)
    now_s = time.monotonic()
    _apply(table, backend_id, outcome, now_s, metrics, reason)
    if share is not None:
        share.put_scrape(backend_id, outcome, now_s, metrics, reason)


async def _scrape_node(
    session: aiohttp.ClientSession, table: BackendTable, backend_id: str, timeout_s: float
) -> None:
    """Fetch the backend's node page (when it has one) into the table."""
    url = table.record(backend_id).config.node_metrics_url
    if url is None:
        return
    node: NodeMetrics | None = None
    try:
        async with asyncio.timeout(timeout_s), session.get(url) as resp:
            text = await resp.text()
            if resp.status < 400:
                node = parse_node_metrics(text)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        logger.debug("node scrape of %s failed: %s", backend_id, type(exc).__name__)
    table.record_node(backend_id, node, [] if node is None else node_problems(node))


def follow_age_s(interval_s: float, timeout_s: float) -> float:
    """How old worker 0's published scrape of a backend may be before another worker
    stops relying on it (its scrapes, and its probes: gateway/workers.py)."""
    return 2 * interval_s + timeout_s


class _Follower:
    """A worker that is not the scraper: applies worker 0's published scrapes."""

    def __init__(self, share: SharedLoad, max_age_s: float) -> None:
        self.share = share
        self.max_age_s = max_age_s
        self.applied: dict[str, float] = {}

    def take(self, table: BackendTable, backend_id: str) -> bool:
        """True when a fresh published scrape stood in for our own."""
        got = self.share.get_scrape(backend_id)
        if got is None:
            return False
        outcome, t, metrics, reason = got
        if time.monotonic() - t > self.max_age_s:
            return False
        if t > self.applied.get(backend_id, -1.0):
            self.applied[backend_id] = t
            _apply(table, backend_id, outcome, t, metrics, reason)
        return True


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
    share: SharedLoad | None = None,
    *,
    is_scraper: bool = True,
) -> None:
    """Scrape forever (cancel the task to stop).

    Each backend has its own loop, so one slow backend never delays the others'
    refresh; a separate tick marks stale values every ``interval_s``. With ``share``
    (gateway workers), the scraper publishes its outcomes there and the others read
    them (module doc).
    """
    follower = (
        _Follower(share, follow_age_s(interval_s, timeout_s))
        if share is not None and not is_scraper
        else None
    )
    publish = share if is_scraper else None

    def scrape(backend_id: str) -> Callable[[], Awaitable[None]]:
        async def engine() -> None:
            if follower is not None and follower.take(table, backend_id):
                return
            await _scrape_backend(session, table, backend_id, timeout_s, publish)

        async def step() -> None:
            await asyncio.gather(engine(), _scrape_node(session, table, backend_id, timeout_s))

        return step

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
