"""Least KV: the backend with the most free KV cache (S1.5, long requests to free KV).

Algorithm: sort candidates by descending ``(1 - kv_usage) * weight * effective_weight``
(an unknown or stale ``kv_usage`` counts as a full cache, i.e. 0 free), then by
``signals.load_rank`` (known request load first), then by snapshot order.
No thresholds.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiloserve.policies.base import BackendState, RequestInfo
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.signals import kv_free_fractions, load_ranks
from kiloserve.policies.stateless import SortedPolicy

__all__ = ["LeastKvParams", "LeastKvPolicy"]


class LeastKvParams(PolicyParams):
    """Least KV takes no parameters."""


class LeastKvPolicy(SortedPolicy):
    name = "least_kv"
    reads_prefix_hashes = False  # (optional Policy attribute: see protocol.py)

    def __init__(self, params: LeastKvParams | None = None) -> None:
        self.params = params or LeastKvParams()

    def sort_keys(
        self, request: RequestInfo, pool: list[BackendState]
    ) -> tuple[Sequence[float], Sequence[float]]:
        neg_free = [
            -free * b.weight * b.effective_weight
            for b, free in zip(pool, kv_free_fractions(pool), strict=True)
        ]
        return neg_free, load_ranks(pool)
