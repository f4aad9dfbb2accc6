"""Per-backend signals every load-aware policy reads, with one rule for unknowns.

Rules shared by all policies (documented once, here):

* Candidates are ``base.eligible()`` (model pool, healthy, not draining, effective
  weight > 0) minus backends whose static ``weight`` is not positive.
* The capacity weight of a backend is ``weight * effective_weight``; load is divided
  by it, so a slow node demoted to 0.2 looks five times as loaded (S3.2).
* Scraped state is *unknown* when the scrape is stale or a counter is ``None``.
  Unknown never reads as idle: unknown backends sort after every known one in
  least-load order (``UNKNOWN_LOAD_OFFSET`` is added to their load rank), and an
  unknown KV usage counts as a full cache.
* Request load is ``max(in_flight, num_running + num_waiting)``: the gateway's own
  in-flight counter, or the engine's queue when other gateways feed it too.

The ``*_ranks`` / list functions are the hot path (one pass, no per-backend calls);
the scalar ones state the same rules for one backend.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiloserve.policies.base import BackendState, ClusterSnapshot, RequestInfo

__all__ = [
    "UNKNOWN_LOAD_OFFSET",
    "candidates",
    "capacity_weight",
    "is_load_unknown",
    "kv_free_fraction",
    "kv_free_fractions",
    "load_rank",
    "load_ranks",
    "num_requests",
    "request_load",
    "scraped_queue",
    "token_load",
    "token_loads",
]

UNKNOWN_LOAD_OFFSET = 1e9


def candidates(request: RequestInfo, snapshot: ClusterSnapshot) -> list[BackendState]:
    """The backends a policy may pick, in snapshot order.

    ``base.eligible`` with ``BackendState.is_routable`` inlined (the hot path: one
    property call per backend per decision); the tests check both agree. A snapshot
    may carry them precomputed (``ClusterSnapshot.eligible_by_model``).
    """
    known = snapshot.eligible_by_model
    if known is not None:
        eligible_pool = known.get(request.model)
        if eligible_pool is not None:
            return list(eligible_pool)
    return [
        b
        for b in snapshot.pool(request.model)
        if b.healthy and not b.draining and b.effective_weight > 0.0 and b.weight > 0.0
    ]


def capacity_weight(b: BackendState) -> float:
    """Static weight times health weight (positive for every candidate)."""
    return b.weight * b.effective_weight


def is_load_unknown(b: BackendState) -> bool:
    """True when the scraped queue is stale or missing."""
    return b.scrape_stale or b.num_running is None or b.num_waiting is None


def scraped_queue(b: BackendState) -> float:
    """Engine-reported running + waiting requests; ``inf`` (saturated) when unknown."""
    if b.scrape_stale or b.num_running is None or b.num_waiting is None:
        return float("inf")
    return float(b.num_running + b.num_waiting)


def num_requests(b: BackendState) -> int:
    """Requests on the backend, not weighted: ``max(in_flight, running + waiting)``."""
    if b.scrape_stale or b.num_running is None or b.num_waiting is None:
        return b.in_flight
    return max(b.in_flight, b.num_running + b.num_waiting)


def request_load(b: BackendState) -> float:
    """Requests on the backend per unit of capacity weight."""
    return num_requests(b) / (b.weight * b.effective_weight)


def load_rank(b: BackendState) -> float:
    """Least-load sort key: request load, plus ``UNKNOWN_LOAD_OFFSET`` when unknown."""
    return request_load(b) + (UNKNOWN_LOAD_OFFSET if is_load_unknown(b) else 0.0)


def load_ranks(pool: Sequence[BackendState]) -> list[float]:
    """``load_rank`` of every backend of ``pool`` (hot path)."""
    out = []
    for b in pool:
        running, waiting = b.num_running, b.num_waiting
        if b.scrape_stale or running is None or waiting is None:
            out.append(b.in_flight / (b.weight * b.effective_weight) + UNKNOWN_LOAD_OFFSET)
        else:
            out.append(max(b.in_flight, running + waiting) / (b.weight * b.effective_weight))
    return out


def token_load(b: BackendState, extra_tokens: int = 0) -> float:
    """Outstanding prefill + decode tokens (plus ``extra_tokens``) per capacity weight."""
    num_tokens = b.outstanding_prefill_tokens + b.outstanding_decode_tokens + extra_tokens
    return num_tokens / (b.weight * b.effective_weight)


def token_loads(pool: Sequence[BackendState], extra_tokens: int = 0) -> list[float]:
    """``token_load`` of every backend of ``pool`` (hot path)."""
    return [
        (b.outstanding_prefill_tokens + b.outstanding_decode_tokens + extra_tokens)
        / (b.weight * b.effective_weight)
        for b in pool
    ]


def kv_free_fraction(b: BackendState) -> float:
    """Free share of the KV cache in [0, 1]; unknown or stale reads as 0 (full)."""
    usage = b.kv_usage
    if b.scrape_stale or usage is None or usage >= 1.0:
        return 0.0
    return 1.0 if usage <= 0.0 else 1.0 - usage


def kv_free_fractions(pool: Sequence[BackendState]) -> list[float]:
    """``kv_free_fraction`` of every backend of ``pool`` (hot path)."""
    out = []
    for b in pool:
        usage = b.kv_usage
        if b.scrape_stale or usage is None or usage >= 1.0:
            out.append(0.0)
        else:
            out.append(1.0 if usage <= 0.0 else 1.0 - usage)
    return out
