"""Length-conditional least connections (S1.5, seed 002): short requests to the
shortest queue, long requests to the most free KV, so batch fill stays even.

Algorithm: a request is *long* when ``input_tokens + predicted_output_tokens >
short_max_tokens`` (1024: seed 002 gives no number; 1024 is seed 004's "Slow" lane
boundary, ``> 1024 tokens``), else *short*.

* short: fewest requests per unit of capacity weight, ``signals.load_rank``
  (``max(in_flight, num_running + num_waiting) / (weight * effective_weight)``;
  unknown or stale scrape sorts after every known load); ties by most free KV, then
  snapshot order.
* long: most free KV times capacity weight (``weight * effective_weight``). Free KV is
  in tokens when every candidate has ``kv_capacity_tokens``: ``(1 - kv_usage) *
  kv_capacity_tokens - outstanding_prefill_tokens`` (floored at 0; a half-empty 80 GB
  card beats a half-empty 48 GB one, and the prompts this gateway sent that have not
  started yet, which the scraped usage does not show, count as taken); else the free
  fraction ``1 - kv_usage``. Unknown or stale ``kv_usage`` counts as a full cache;
  ties by ``load_rank``, then snapshot order.

Stateless (no hooks), deterministic (no ``rng``). Known limit: without
``kv_capacity_tokens`` the free fraction is the last scrape's, so long requests
arriving between two scrapes all see the same free KV and follow the same backend (at
300 req/s and a 200 ms scrape, 60 requests; the simulator knows every capacity).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from kiloserve.policies.base import BackendState, RequestInfo
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.signals import kv_free_fractions, load_ranks
from kiloserve.policies.stateless import SortedPolicy

__all__ = ["LengthLeastConnParams", "LengthLeastConnPolicy", "free_kv_amounts", "is_long"]


class LengthLeastConnParams(PolicyParams):
    short_max_tokens: int = Field(default=1024, ge=1)


def is_long(request: RequestInfo, short_max_tokens: int) -> bool:
    """True when prompt + predicted output tokens exceed ``short_max_tokens``."""
    return request.input_tokens + request.predicted_output_tokens > short_max_tokens


def free_kv_amounts(pool: Sequence[BackendState]) -> list[float]:
    """Free KV per candidate times capacity weight: tokens (less this gateway's prompts
    not yet started) when every candidate's KV size is known, else the free fraction."""
    capacities = [b.kv_capacity_tokens or 0 for b in pool]
    frees = kv_free_fractions(pool)
    if all(c > 0 for c in capacities):
        frees = [
            max(0.0, free * c - b.outstanding_prefill_tokens)
            for b, free, c in zip(pool, frees, capacities, strict=True)
        ]
    return [free * b.weight * b.effective_weight for b, free in zip(pool, frees, strict=True)]


class LengthLeastConnPolicy(SortedPolicy):
    name = "length_least_conn"
    reads_prefix_hashes = False  # (optional Policy attribute: see protocol.py)

    def __init__(self, params: LengthLeastConnParams | None = None) -> None:
        self.params = params or LengthLeastConnParams()

    def sort_keys(
        self, request: RequestInfo, pool: list[BackendState]
    ) -> tuple[Sequence[float], Sequence[float]]:
        neg_free = [-x for x in free_kv_amounts(pool)]
        if is_long(request, self.params.short_max_tokens):
            return neg_free, load_ranks(pool)
        return load_ranks(pool), neg_free
