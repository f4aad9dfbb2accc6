"""The default's "sticky until saturated" prefix rule (issue 14, docs/policies.md)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kiloserve.policies import BackendState, ClusterSnapshot, RequestInfo, create_policy
from kiloserve.tokens import prefix_block_hashes

TOKENS = [3 + i % 97 for i in range(2048)]


def backend(bid: str, **kw: Any) -> BackendState:
    base: dict[str, Any] = {"num_running": 2, "num_waiting": 0, "kv_usage": 0.3, "in_flight": 2}
    return BackendState(backend_id=bid, models=frozenset({"m"}), **(base | kw))


def req() -> RequestInfo:
    hashes = tuple(prefix_block_hashes(TOKENS))
    return RequestInfo("r", "m", len(TOKENS), 64, prefix_hashes=hashes)


def choose(policy: Any, *pool: BackendState) -> tuple[str, str]:
    decision = policy.choose(req(), ClusterSnapshot(0.0, pool), random.Random(0))
    return decision.ranked[0], decision.reason


def warm_policy(**params: Any) -> Any:
    policy = create_policy("default", params)
    policy.on_dispatch(req(), "warm")  # the approximate index: warm holds the prompt
    return policy


def test_stays_on_the_warm_backend_while_it_is_not_saturated() -> None:
    # the cold one looks better on every load score, but not by enough to give up 2k
    # cached tokens
    cold = backend("cold", num_running=1, in_flight=1, kv_usage=0.1)
    assert choose(warm_policy(), cold, backend("warm")) == ("warm", "prefix")


@pytest.mark.parametrize(
    ("saturated", "why"),
    [
        ({"num_waiting": 4}, "its engine queues"),
        ({"kv_usage": 0.85}, "its KV cache is full"),
        ({"in_flight": 7, "num_running": 7}, "load 7 vs 2 (mean 4.5): 2 over both, 1.5x"),
        ({"outstanding_prefill_tokens": 40_000}, "queued prefill: predicted TTFT far worse"),
    ],
)
def test_a_saturated_warm_backend_lets_the_scores_decide(
    saturated: dict[str, Any], why: str
) -> None:
    chosen, reason = choose(warm_policy(), backend("cold"), backend("warm", **saturated))
    assert (chosen, reason) != ("warm", "prefix"), why


def test_a_holder_near_the_pools_average_load_is_not_saturated() -> None:
    # a cold start: the holder runs three short requests, one backend has just gone
    # idle, the others run about as many; leaving would cost a 2k-token cold prefill
    # (8 tenant moves in 600 requests when only the least loaded was compared:
    # tests/unit/sim/test_sim_tenant_moves.py)
    warm = backend("warm", num_running=3, in_flight=3)
    idle = backend("idle", num_running=0, in_flight=0, kv_usage=0.0)
    pool = (idle, warm, *(backend(f"b{i}", num_running=2, in_flight=2) for i in range(4)))
    assert choose(warm_policy(), *pool) == ("warm", "prefix")
    # over its share (the pool's mean) by more than 2 as well: saturated
    hot = backend("warm", num_running=6, in_flight=6)
    assert choose(warm_policy(), idle, hot, *pool[2:])[1] != "prefix"


def test_sticky_off_and_short_matches_use_the_scores() -> None:
    cold = backend("cold", num_running=0, in_flight=0, kv_usage=0.0)
    assert choose(warm_policy(sticky=False), cold, backend("warm"))[1] != "prefix"
    policy = warm_policy(sticky_min_tokens=4096)  # the match (2,048 tokens) is too short
    assert choose(policy, cold, backend("warm"))[1] != "prefix"


def test_unknown_scraped_load_counts_as_in_flight() -> None:
    """Backends without /metrics keep their prefixes (issue 14: hit 0.31 without)."""
    stale = {"scrape_stale": True, "num_running": None, "num_waiting": None, "kv_usage": None}
    pool = (backend("cold", in_flight=1, **stale), backend("warm", in_flight=2, **stale))
    assert choose(warm_policy(), *pool) == ("warm", "prefix")
    busy = (backend("cold", in_flight=0, **stale), backend("warm", in_flight=5, **stale))
    assert choose(warm_policy(), *busy)[1] != "prefix"  # released: the scores decide
