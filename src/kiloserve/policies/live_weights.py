"""Per-model backend weights recomputed on a period of snapshot time (S1.4's 200 ms).

``LiveWeights.get(model, pool, now_s)`` returns the weights of ``pool`` (aligned with
it), recomputing them with the given function when

* the candidate ids differ from the cached ones (a backend ejected, drained or
  added: a health change takes effect at once, never after the period), or
* ``now_s - computed_at_s >= refresh_s`` (``refresh_s = 0``: every decision), or
* time went backwards (``now_s < computed_at_s``: a new run of the simulator).

Keyed on the snapshot's ``now_s``, not on the snapshot object: the gateway builds a
new snapshot per decision, so identity alone recomputed the weights on every request.
The cache is a memo of a pure function of (pool, snapshot time), so a policy may fill
it from ``choose`` without breaking the "state moves only in hooks" rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kiloserve.policies.base import BackendState

__all__ = ["LiveWeights", "WeightFn"]

WeightFn = Callable[[list[BackendState]], list[float]]


@dataclass(slots=True)
class _Entry:
    computed_at_s: float
    ids: tuple[str, ...]
    weights: list[float]


class LiveWeights:
    """Weights per model, refreshed every ``refresh_s`` of snapshot time."""

    def __init__(self, weigh: WeightFn, refresh_s: float) -> None:
        self._weigh = weigh
        self.refresh_s = refresh_s
        self._entries: dict[str, _Entry] = {}
        self.num_computed = 0  # how many times weights were computed (tests, docs)

    def get(self, model: str, pool: list[BackendState], now_s: float) -> list[float]:
        """``pool``'s weights, from the cache while it is fresh and the ids match."""
        ids = tuple([b.backend_id for b in pool])
        entry = self._entries.get(model)
        if entry is not None and entry.ids == ids:
            age_s = now_s - entry.computed_at_s
            if 0.0 <= age_s < self.refresh_s:
                return entry.weights
        weights = self._weigh(pool)
        self._entries[model] = _Entry(now_s, ids, weights)
        self.num_computed += 1
        return weights
