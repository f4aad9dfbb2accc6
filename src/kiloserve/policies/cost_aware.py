"""Cost aware: the cheapest backend predicted to meet the TTFT SLO (S1.8).

Algorithm: for every candidate predict

    ttft_ms = (ewma_ttft_ms + (outstanding_prefill_tokens + input_tokens)
               * ms_per_prefill_token) / (weight * effective_weight)

* ``ewma_ttft_ms`` ``None`` (no request finished yet) takes the mean of the known
  ones, or 0 when none is known, so new backends get probed.
* ``ms_per_prefill_token`` (0.1 ms, ~10k prefill tokens/s) turns the queued prompt
  work into waiting time; the EWMA already holds recent queueing, so the prediction
  errs on the slow side.
* A backend whose scraped load is stale or missing cannot be predicted to meet the
  SLO (unknown counts as saturated).

Backends with ``ttft_ms <= slo_ttft_ms`` (500 ms, S4.7 stage 1) are ranked first by
``cost_per_hour``, then by ``signals.load_rank``, then snapshot order; the others
follow in least-load order. When none meets the SLO, the whole ranking is least load.
"""

from __future__ import annotations

import math
import random

from pydantic import Field

from kiloserve.policies.base import BackendState, ClusterSnapshot, Decision, RequestInfo
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.ranking import ids, order_by, rank_by_keys
from kiloserve.policies.signals import (
    UNKNOWN_LOAD_OFFSET,
    candidates,
    load_ranks,
)
from kiloserve.policies.stateless import StatelessHooks

__all__ = ["CostAwareParams", "CostAwarePolicy", "predicted_ttft_ms"]


class CostAwareParams(PolicyParams):
    slo_ttft_ms: float = Field(default=500.0, gt=0.0)
    ms_per_prefill_token: float = Field(default=0.1, ge=0.0)


def predicted_ttft_ms(
    pool: list[BackendState], input_tokens: int, ms_per_prefill_token: float
) -> list[float]:
    """Predicted TTFT of a request of ``input_tokens`` on each backend of ``pool``."""
    known = [b.ewma_ttft_ms for b in pool if b.ewma_ttft_ms is not None]
    fill_ms = sum(known) / len(known) if known else 0.0
    out = []
    for b in pool:
        base_ms = fill_ms if b.ewma_ttft_ms is None else b.ewma_ttft_ms
        queue_ms = (b.outstanding_prefill_tokens + input_tokens) * ms_per_prefill_token
        out.append((base_ms + queue_ms) / (b.weight * b.effective_weight))
    return out


class CostAwarePolicy(StatelessHooks):
    name = "cost_aware"

    def __init__(self, params: CostAwareParams | None = None) -> None:
        self.params = params or CostAwareParams()

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        p = self.params
        pool = candidates(request, snapshot)
        if not pool:
            return Decision(ranked=(), policy=self.name, reason="no eligible backend")
        ttfts_ms = predicted_ttft_ms(pool, request.input_tokens, p.ms_per_prefill_token)
        ranks = load_ranks(pool)
        slo_ms = p.slo_ttft_ms
        costs = [
            b.cost_per_hour if ttft_ms <= slo_ms and rank < UNKNOWN_LOAD_OFFSET else math.inf
            for b, ttft_ms, rank in zip(pool, ttfts_ms, ranks, strict=True)
        ]
        if min(costs) == math.inf:
            return Decision(ids(pool, order_by(ranks)), self.name, reason="no backend meets SLO")
        ranked = rank_by_keys(pool, costs, ranks)
        return Decision(ranked=ranked, policy=self.name, reason="cheapest")
