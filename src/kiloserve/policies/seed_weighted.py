"""Seed weighted: the dynamic-weight, weighted-random dispatch of S1.4 (seed 000).

Algorithm: for every candidate

    W = free_kv_fraction * (1 - pcie_util) * exp(-0.05 * (latency_ms - min_latency_ms))
        * weight * effective_weight

and pick one backend with probability ``W / sum(W)`` using ``rng.random()`` (one draw).

* ``free_kv_fraction = 1 - kv_usage``; stale or unknown KV counts as full (W = 0).
* ``pcie_util`` ``None`` counts as 0 (no PCIe signal); clamped to [0, 1].
* ``latency_ms`` is ``ewma_tpot_ms`` by default (``latency_metric: ttft`` switches to
  ``ewma_ttft_ms``). TPOT is the default because its range (10-100 ms) keeps the
  factor meaningful: at 0.05/ms a TTFT of 1 s would give exp(-50). A backend with no
  latency yet gets the mean of the known ones (0 when none is known), so new
  backends are neither starved nor flooded.
* Subtracting the pool's minimum latency leaves every ratio of weights unchanged
  (exp factors out) and keeps W from underflowing to 0.
* ``latency_decay_per_ms`` (0.05) is the seed's constant.

The weights are recomputed every ``refresh_s`` (0.2, the seed's 200 ms) of snapshot
time (``ClusterSnapshot.now_s``), and at once when the candidate set changes
(``live_weights.LiveWeights``); ``refresh_s: 0`` recomputes them for every decision.
Between refreshes the picks follow the cached W while the queues move. If every W is 0
the pick falls back to least load (``signals.load_rank``, current). Ranked fallbacks:
the other candidates by descending W.
"""

from __future__ import annotations

import bisect
import math
import random
from itertools import accumulate
from typing import Literal

from pydantic import Field

from kiloserve.policies.base import BackendState, ClusterSnapshot, Decision, RequestInfo
from kiloserve.policies.live_weights import LiveWeights
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.ranking import least_load_order, rank_by_keys
from kiloserve.policies.signals import candidates, capacity_weight, kv_free_fractions
from kiloserve.policies.stateless import StatelessHooks

__all__ = ["SeedWeightedParams", "SeedWeightedPolicy", "seed_weights"]


class SeedWeightedParams(PolicyParams):
    latency_metric: Literal["tpot", "ttft"] = "tpot"
    latency_decay_per_ms: float = Field(default=0.05, ge=0.0)
    refresh_s: float = Field(default=0.2, ge=0.0)


def _latencies_ms(pool: list[BackendState], metric: str) -> list[float]:
    raw = [b.ewma_tpot_ms if metric == "tpot" else b.ewma_ttft_ms for b in pool]
    known = [x for x in raw if x is not None]
    fill = sum(known) / len(known) if known else 0.0
    return [fill if x is None else x for x in raw]


def seed_weights(pool: list[BackendState], params: SeedWeightedParams) -> list[float]:
    """The S1.4 weight of every backend in ``pool`` (see module docstring)."""
    if not pool:
        return []
    latencies_ms = _latencies_ms(pool, params.latency_metric)
    min_latency_ms = min(latencies_ms)
    frees = kv_free_fractions(pool)
    out = []
    for b, free, latency_ms in zip(pool, frees, latencies_ms, strict=True):
        pcie = 0.0 if b.pcie_util is None else min(1.0, max(0.0, b.pcie_util))
        decay = math.exp(-params.latency_decay_per_ms * (latency_ms - min_latency_ms))
        out.append(free * (1.0 - pcie) * decay * capacity_weight(b))
    return out


class SeedWeightedPolicy(StatelessHooks):
    name = "seed_weighted"

    def __init__(self, params: SeedWeightedParams | None = None) -> None:
        self.params = params or SeedWeightedParams()
        self.weights = LiveWeights(self._weigh, self.params.refresh_s)
        # per model: the weights list these were derived from, cumulative W, ids by W
        self._derived: dict[str, tuple[list[float], list[float], tuple[str, ...]]] = {}

    def _weigh(self, pool: list[BackendState]) -> list[float]:
        return seed_weights(pool, self.params)

    def _table(
        self, model: str, pool: list[BackendState], weights: list[float]
    ) -> tuple[list[float], tuple[str, ...]]:
        derived = self._derived.get(model)
        if derived is None or derived[0] is not weights:
            by_weight = rank_by_keys(pool, [-w for w in weights])
            derived = (weights, list(accumulate(weights)), by_weight)
            self._derived[model] = derived
        return derived[1], derived[2]

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        pool = candidates(request, snapshot)
        if not pool:
            return Decision(ranked=(), policy=self.name, reason="no eligible backend")
        weights = self.weights.get(request.model, pool, snapshot.now_s)
        cumulative, by_weight = self._table(request.model, pool, weights)
        total = cumulative[-1]
        if total <= 0.0:
            ranked = least_load_order(pool)
            return Decision(ranked=ranked, policy=self.name, reason="all weights zero")
        index = bisect.bisect_right(cumulative, rng.random() * total)
        if index >= len(pool):  # float rounding at the very top: last positive weight
            index = bisect.bisect_left(cumulative, total)
        first = pool[index].backend_id
        rest = [bid for bid in by_weight if bid != first]
        return Decision(ranked=(first, *rest), policy=self.name)
