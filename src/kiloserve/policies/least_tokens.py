"""Least tokens: least outstanding prefill + decode token work per capacity weight.

Algorithm: sort candidates by ``(outstanding_prefill_tokens + outstanding_decode_tokens
+ this request's input + predicted output tokens) / (weight * effective_weight)``
(gateway-local counters, always known), then by ``signals.load_rank`` (known request
load first; stale or missing scrapes count as saturated), then by snapshot order.
Adding the request's own tokens makes a demoted backend pay for the new work too.
No thresholds.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiloserve.policies.base import BackendState, RequestInfo
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.signals import load_ranks, token_loads
from kiloserve.policies.stateless import SortedPolicy

__all__ = ["LeastTokensParams", "LeastTokensPolicy"]


class LeastTokensParams(PolicyParams):
    """Least tokens takes no parameters."""


class LeastTokensPolicy(SortedPolicy):
    name = "least_tokens"
    reads_prefix_hashes = False  # (optional Policy attribute: see protocol.py)

    def __init__(self, params: LeastTokensParams | None = None) -> None:
        self.params = params or LeastTokensParams()

    def sort_keys(
        self, request: RequestInfo, pool: list[BackendState]
    ) -> tuple[Sequence[float], Sequence[float]]:
        new_tokens = request.input_tokens + request.predicted_output_tokens
        return token_loads(pool, new_tokens), load_ranks(pool)
