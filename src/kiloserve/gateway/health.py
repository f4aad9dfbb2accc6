"""Active health checks (SPEC S3.1): one probe loop per backend, jittered, never a storm.

Each backend gets its own loop, so at most one probe is in flight per backend. A probe
is ``GET /health`` and, when ``completion_probe`` is on, a minimal real inference
request (``max_tokens: 1``) for the backend's first model; a probe fails on a connect
error, a time-out (``timeout_s``) or a status >= 500.

``unhealthy_threshold`` consecutive failures mark a backend unhealthy,
``healthy_threshold`` consecutive successes healthy again (``ProbeTracker``, pure). The
next probe starts ``interval_s`` x (1 +- ``jitter``) after the previous one started;
after a failure that has not yet tipped the backend over, the confirming probe comes
after ``recheck_interval_s`` instead, so a hang is found within one interval plus the
confirmations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["HealthConfig", "ProbeTracker", "Prober", "probe_once"]

logger = logging.getLogger(__name__)


class HealthConfig(BaseModel):
    """``health:`` section of the gateway config (active probes)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    interval_s: float = Field(default=5.0, gt=0.0)
    jitter: float = Field(default=0.1, ge=0.0, lt=1.0)
    recheck_interval_s: float = Field(default=1.0, gt=0.0)
    timeout_s: float = Field(default=1.0, gt=0.0)
    unhealthy_threshold: int = Field(default=2, ge=1)
    healthy_threshold: int = Field(default=2, ge=1)
    path: str = "/health"
    completion_probe: bool = False


@dataclass(slots=True)
class _Streak:
    num_failures: int = 0
    num_successes: int = 0
    is_healthy: bool = True


class ProbeTracker:
    """Consecutive probe results per backend -> healthy / unhealthy (pure)."""

    def __init__(self, cfg: HealthConfig) -> None:
        self.cfg = cfg
        self._streaks: dict[str, _Streak] = {}

    def is_healthy(self, backend_id: str) -> bool:
        streak = self._streaks.get(backend_id)
        return streak is None or streak.is_healthy

    def forget(self, backend_id: str) -> None:
        self._streaks.pop(backend_id, None)

    def record(self, backend_id: str, is_ok: bool) -> bool | None:
        """Record one probe; returns the new health when it changed, else None."""
        s = self._streaks.setdefault(backend_id, _Streak())
        if is_ok:
            s.num_failures, s.num_successes = 0, s.num_successes + 1
            if not s.is_healthy and s.num_successes >= self.cfg.healthy_threshold:
                s.is_healthy = True
                return True
            return None
        s.num_successes, s.num_failures = 0, s.num_failures + 1
        if s.is_healthy and s.num_failures >= self.cfg.unhealthy_threshold:
            s.is_healthy = False
            return False
        return None

    def is_confirming(self, backend_id: str) -> bool:
        """True after a failure that has not (yet) changed the verdict."""
        s = self._streaks.get(backend_id)
        return s is not None and s.is_healthy and s.num_failures > 0


async def probe_once(
    session: aiohttp.ClientSession, url: str, cfg: HealthConfig, model: str | None
) -> str:
    """One probe of the backend at ``url``: '' when healthy, else why not."""
    try:
        async with asyncio.timeout(cfg.timeout_s):
            async with session.get(url + cfg.path) as resp:
                await resp.read()
                if resp.status >= 500:
                    return f"health http {resp.status}"
            if cfg.completion_probe and model is not None:
                body = {"model": model, "prompt": "ping", "max_tokens": 1}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    if resp.status >= 500:
                        return f"completion http {resp.status}"
    except TimeoutError:
        return "timeout"
    except (aiohttp.ClientError, OSError) as exc:
        return type(exc).__name__
    return ""


# (backend id) -> (url, first model) or None when the backend is gone
Target = Callable[[str], tuple[str, str | None] | None]
Verdict = Callable[[str, bool, str], None]


class Prober:
    """Runs one probe loop per backend; ``reconcile`` follows the current backend set."""

    def __init__(
        self,
        cfg: HealthConfig,
        session: aiohttp.ClientSession,
        target: Target,
        on_probe: Verdict,
        rng: random.Random,
    ) -> None:
        self.cfg = cfg
        self.tracker = ProbeTracker(cfg)
        self._session = session
        self._target = target
        self._on_probe = on_probe
        self._rng = rng
        self._loops: dict[str, asyncio.Task[None]] = {}

    def reconcile(self, backend_ids: set[str]) -> None:
        if not self.cfg.enabled:
            return
        for b in backend_ids - self._loops.keys():
            self._loops[b] = asyncio.create_task(self._loop(b))
        for b in self._loops.keys() - backend_ids:
            self._loops.pop(b).cancel()
            self.tracker.forget(b)

    def _delay_s(self, backend_id: str) -> float:
        if self.tracker.is_confirming(backend_id):
            return self.cfg.recheck_interval_s
        spread = self.cfg.jitter * self.cfg.interval_s
        return self.cfg.interval_s + self._rng.uniform(-spread, spread)

    async def _loop(self, backend_id: str) -> None:
        # first probe at a random point of the first interval: no thundering herd
        await asyncio.sleep(self._rng.uniform(0.0, self.cfg.interval_s))
        while True:
            started = time.monotonic()
            target = self._target(backend_id)
            if target is None:
                return
            why = await probe_once(self._session, target[0], self.cfg, target[1])
            self._on_probe(backend_id, not why, why)
            await asyncio.sleep(max(0.0, self._delay_s(backend_id) - (time.monotonic() - started)))

    async def close(self) -> None:
        tasks = list(self._loops.values())
        self._loops.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
