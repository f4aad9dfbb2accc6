"""Passive outlier detection and circuit breaking on real traffic (pure, time passed in).

Envoy's semantics, per backend:

* a run of ``consecutive_gateway_failures`` failures (connect errors, first-byte
  timeouts, 5xx answers: anything the gateway reports as status >= 500) ejects the
  backend; any success or client-side 4xx resets the run (a client's own 4xx is never a
  backend failure, a client that went away (499) is ignored);
* the ejection lasts ``base_ejection_time_s x num_ejections`` capped at
  ``max_ejection_time_s``; the multiplier decays by one for every ``base_ejection_time_s``
  the backend stays healthy;
* at most ``max_ejection_percent`` of a pool is ejected at once (always at least one
  backend may be ejected, as in Envoy);
* when the ejection expires the breaker is half-open: exactly one real request is let
  through (``try_trial``); its success closes the breaker, its failure re-ejects with a
  longer back-off. A passing active health probe also closes a half-open breaker
  (``on_probe_success``), so a backend comes back even when no traffic tests it.

With ``--workers N`` the run of failures is one run across the gateway's workers
(``streaks``, a ``StreakShare``: ``routing.shared_verdicts``), as Envoy counts a
host's over all its worker threads, and ``ejected_elsewhere`` says which backends a
sibling ejected, so ``max_ejection_percent`` holds for the gateway, not per worker.

No I/O and no clock reads: the gateway and the simulator pass ``now_s``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "BreakerState",
    "OutlierConfig",
    "OutlierDetector",
    "StreakShare",
    "is_backend_failure",
]

logger = logging.getLogger(__name__)

_CLIENT_GONE = 499


class OutlierConfig(BaseModel):
    """``outlier:`` section of the gateway config."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    consecutive_gateway_failures: int = Field(default=3, ge=1)
    base_ejection_time_s: float = Field(default=5.0, gt=0.0)
    max_ejection_time_s: float = Field(default=60.0, gt=0.0)
    max_ejection_percent: float = Field(default=50.0, ge=0.0, le=100.0)


class BreakerState(StrEnum):
    CLOSED = "closed"
    EJECTED = "ejected"
    HALF_OPEN = "half_open"


def is_backend_failure(status: int) -> bool | None:
    """True: counts against the backend; False: a success; None: ignored (client gone)."""
    if status == _CLIENT_GONE:
        return None
    return status >= 500


class StreakShare(Protocol):
    """Failure runs shared with sibling workers (``routing.shared_verdicts``)."""

    def note_reset(self, backend_id: str, now_s: float) -> None: ...

    def note_failure(self, backend_id: str, now_s: float, own_run: int) -> int: ...


@dataclass(slots=True)
class _Breaker:
    state: BreakerState = BreakerState.CLOSED
    num_failures: int = 0
    num_ejections: int = 0
    num_ejections_total: int = 0
    ejected_until_s: float = 0.0
    healthy_since_s: float = 0.0
    is_trial_in_flight: bool = False
    last_reason: str = ""


class OutlierDetector:
    """Breakers for every backend; ``pools`` maps a backend to the ids sharing its pool."""

    def __init__(self, cfg: OutlierConfig) -> None:
        self.cfg = cfg
        self._breakers: dict[str, _Breaker] = {}
        # --workers N: the failure runs over every worker, and the backends a sibling
        # ejected (None: one process)
        self.streaks: StreakShare | None = None
        self.ejected_elsewhere: Callable[[str], bool] | None = None

    def _get(self, backend_id: str) -> _Breaker:
        b = self._breakers.get(backend_id)
        if b is None:
            b = self._breakers[backend_id] = _Breaker()
        return b

    def forget(self, backend_id: str) -> None:
        self._breakers.pop(backend_id, None)

    def state(self, backend_id: str) -> BreakerState:
        return self._get(backend_id).state

    def num_ejections_total(self, backend_id: str) -> int:
        return self._get(backend_id).num_ejections_total

    def is_ejected(self, backend_id: str) -> bool:
        """True while the backend must not get ordinary traffic (ejected or half-open)."""
        return self._get(backend_id).state is not BreakerState.CLOSED

    def on_result(self, backend_id: str, status: int, now_s: float, pool: Iterable[str]) -> bool:
        """Record one attempt's status; True when this result ejected the backend."""
        failed = is_backend_failure(status)
        b = self._get(backend_id)
        if failed is None or not self.cfg.enabled:
            b.is_trial_in_flight = False  # a trial whose client left proves nothing
            return False
        if b.state is BreakerState.HALF_OPEN and b.is_trial_in_flight:
            b.is_trial_in_flight = False
            if failed:
                return self._eject(backend_id, b, now_s, f"half-open trial failed ({status})")
            self._close(backend_id, b, now_s)
            return False
        if not failed:
            b.num_failures = 0
            if self.streaks is not None:
                self.streaks.note_reset(backend_id, now_s)
            return False
        b.num_failures += 1
        run = b.num_failures
        if self.streaks is not None:
            run = self.streaks.note_failure(backend_id, now_s, run)
        is_run_over = run >= self.cfg.consecutive_gateway_failures
        if b.state is BreakerState.CLOSED and is_run_over and self._may_eject(backend_id, pool):
            reason = f"{run} consecutive failures (last {status})"
            return self._eject(backend_id, b, now_s, reason)
        return False

    def _is_ejected_anywhere(self, backend_id: str) -> bool:
        elsewhere = self.ejected_elsewhere
        return self.is_ejected(backend_id) or (elsewhere is not None and elsewhere(backend_id))

    def _may_eject(self, backend_id: str, pool: Iterable[str]) -> bool:
        ids = set(pool) | {backend_id}
        num_ejected = sum(1 for i in ids if i != backend_id and self._is_ejected_anywhere(i))
        max_num_ejected = max(1, math.floor(len(ids) * self.cfg.max_ejection_percent / 100.0))
        return num_ejected + 1 <= max_num_ejected

    def _eject(self, backend_id: str, b: _Breaker, now_s: float, reason: str) -> bool:
        b.num_ejections += 1
        b.num_ejections_total += 1
        duration_s = min(
            self.cfg.base_ejection_time_s * b.num_ejections, self.cfg.max_ejection_time_s
        )
        b.state = BreakerState.EJECTED
        b.ejected_until_s = now_s + duration_s
        b.num_failures = 0
        if self.streaks is not None:
            self.streaks.note_reset(backend_id, now_s)
        b.is_trial_in_flight = False
        b.last_reason = reason
        logger.warning("backend %s ejected for %.1f s: %s", backend_id, duration_s, reason)
        return True

    def _close(self, backend_id: str, b: _Breaker, now_s: float) -> None:
        b.state = BreakerState.CLOSED
        b.num_failures = 0
        if self.streaks is not None:
            self.streaks.note_reset(backend_id, now_s)
        b.healthy_since_s = now_s
        logger.info("backend %s back in rotation (half-open check passed)", backend_id)

    def tick(self, now_s: float) -> list[str]:
        """Advance time: expired ejections turn half-open; returns the ids that did."""
        opened: list[str] = []
        for backend_id, b in self._breakers.items():
            if b.state is BreakerState.EJECTED and now_s >= b.ejected_until_s:
                b.state = BreakerState.HALF_OPEN
                opened.append(backend_id)
            elif b.state is BreakerState.CLOSED and self._is_decay_due(b, now_s):
                b.num_ejections -= 1  # the multiplier decays while healthy
                b.healthy_since_s = now_s
        return opened

    def on_probe_success(self, backend_id: str, now_s: float) -> bool:
        """An active probe passed: a half-open backend (ejection over) closes without
        waiting for a trial request (Envoy's successful_active_health_check_uneject_host,
        limited to expired ejections so the back-off still holds). True if it closed."""
        b = self._get(backend_id)
        if b.state is not BreakerState.HALF_OPEN or b.is_trial_in_flight:
            return False
        self._close(backend_id, b, now_s)
        return True

    def _is_decay_due(self, b: _Breaker, now_s: float) -> bool:
        return b.num_ejections > 0 and now_s - b.healthy_since_s >= self.cfg.base_ejection_time_s

    def try_trial(self, backend_id: str) -> bool:
        """Claim the one trial request of a half-open backend (False if taken / not half-open)."""
        b = self._get(backend_id)
        if b.state is not BreakerState.HALF_OPEN or b.is_trial_in_flight:
            return False
        b.is_trial_in_flight = True
        return True

    def describe(self, backend_id: str, now_s: float) -> dict[str, object]:
        b = self._get(backend_id)
        left_s = max(0.0, b.ejected_until_s - now_s) if b.state is BreakerState.EJECTED else 0.0
        return {
            "breaker": b.state.value,
            "ejected_for_s": round(left_s, 3),
            "num_ejections_total": b.num_ejections_total,
            "last_ejection_reason": b.last_reason,
        }
