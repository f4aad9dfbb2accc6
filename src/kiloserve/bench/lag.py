"""The client's own health: event-loop lag (a ticker task) and process CPU use.

A ticker sleeps ``sample_interval_s`` and records how late it wakes up. If the loop is
busy parsing streams, wake-ups are late and every timestamp the client takes is late by
about as much, so large lag means the measured latencies include client delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from types import TracebackType

import numpy as np

from kiloserve.results.records import ClientStats

__all__ = ["LagMonitor"]


class LagMonitor:
    """Async context manager sampling event-loop lag; calls ``on_tick`` periodically."""

    def __init__(
        self,
        *,
        on_tick: Callable[[], None] | None = None,
        tick_interval_s: float = 0.25,
        sample_interval_s: float = 0.01,
    ) -> None:
        self._on_tick = on_tick
        self._tick_interval_s = tick_interval_s
        self._sample_interval_s = sample_interval_s
        self._lags_s: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self._cpu0_s = self._wall0_s = 0.0
        self._cpu_s = self._wall_s = 0.0

    async def __aenter__(self) -> LagMonitor:
        self._cpu0_s, self._wall0_s = time.process_time(), time.perf_counter()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._cpu_s = time.process_time() - self._cpu0_s
        self._wall_s = time.perf_counter() - self._wall0_s
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def stats(self, max_in_flight: int = 0) -> ClientStats:
        lags_ms = np.array(self._lags_s or [0.0]) * 1000.0
        return ClientStats(
            lag_mean_ms=float(lags_ms.mean()),
            lag_p99_ms=float(np.percentile(lags_ms, 99)),
            lag_max_ms=float(lags_ms.max()),
            cpu_util=self._cpu_s / self._wall_s if self._wall_s > 0 else 0.0,
            max_in_flight=max_in_flight,
        )

    async def _run(self) -> None:
        next_tick = time.perf_counter() + self._tick_interval_s
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self._sample_interval_s)
            now = time.perf_counter()
            self._lags_s.append(max(0.0, now - before - self._sample_interval_s))
            if now >= next_tick:
                next_tick = now + self._tick_interval_s
                if self._on_tick is not None:
                    self._on_tick()
