"""Least KV: the backend with the most free KV cache (S1.5, long requests to free KV).

Algorithm: sort candidates by descending ``(1 - kv_usage) * weight * effective_weight``
(an unknown or stale ``kv_usage`` counts as a full cache, i.e. 0 free), then by
``signals.load_rank`` (known request load first), then by snapshot order.
No thresholds.
"""

from __future__ import annotations

import random

from kiloserve.policies.base import ClusterSnapshot, Decision, RequestInfo
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.ranking import rank_by_keys
from kiloserve.policies.signals import candidates, kv_free_fractions, load_ranks
from kiloserve.policies.stateless import StatelessHooks

__all__ = ["LeastKvParams", "LeastKvPolicy"]


class LeastKvParams(PolicyParams):
    """Least KV takes no parameters."""


class LeastKvPolicy(StatelessHooks):
    name = "least_kv"

    def __init__(self, params: LeastKvParams | None = None) -> None:
        self.params = params or LeastKvParams()

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        pool = candidates(request, snapshot)
        if not pool:
            return Decision(ranked=(), policy=self.name, reason="no eligible backend")
        neg_free = [
            -free * b.weight * b.effective_weight
            for b, free in zip(pool, kv_free_fractions(pool), strict=True)
        ]
        return Decision(ranked=rank_by_keys(pool, neg_free, load_ranks(pool)), policy=self.name)
