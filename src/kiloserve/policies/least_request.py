"""Least request: fewest in-flight requests per unit of capacity weight.

Algorithm: sort candidates by ``in_flight / (weight * effective_weight)`` (the
gateway's own counter, always known), then by the scraped
``(num_running + num_waiting) / capacity weight`` (``inf`` when the scrape is stale or
missing: unknown counts as saturated), then by snapshot order. No thresholds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kiloserve.policies.base import BackendState, RequestInfo
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.stateless import SortedPolicy

__all__ = ["LeastRequestParams", "LeastRequestPolicy"]


class LeastRequestParams(PolicyParams):
    """Least request takes no parameters."""


class LeastRequestPolicy(SortedPolicy):
    name = "least_request"
    reads_prefix_hashes = False  # (optional Policy attribute: see protocol.py)

    def __init__(self, params: LeastRequestParams | None = None) -> None:
        self.params = params or LeastRequestParams()

    def sort_keys(
        self, request: RequestInfo, pool: list[BackendState]
    ) -> tuple[Sequence[float], Sequence[float]]:
        in_flight, queue = [], []
        for b in pool:
            cw = b.weight * b.effective_weight
            in_flight.append(b.in_flight / cw)
            running, waiting = b.num_running, b.num_waiting
            if b.scrape_stale or running is None or waiting is None:
                queue.append(math.inf)
            else:
                queue.append((running + waiting) / cw)
        return in_flight, queue
