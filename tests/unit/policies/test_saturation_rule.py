"""The ``ttft`` scorer's saturation rule: a high KV usage counts only while the engine
queues (``num_waiting`` > 0 or not reported); the ``max_num_seqs`` share and unknown
state count as before."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kiloserve.policies import BackendState, ClusterSnapshot, RequestInfo, create_policy
from kiloserve.policies.scorers import SCORERS, ScoringContext


def backend(bid: str, **kw: Any) -> BackendState:
    kw.setdefault("models", frozenset({"m"}))
    kw.setdefault("num_running", 2)
    kw.setdefault("num_waiting", 0)
    kw.setdefault("kv_usage", 0.1)
    return BackendState(backend_id=bid, **kw)


def ttft_scores(pool: list[BackendState], **ctx: Any) -> list[float]:
    request = RequestInfo("r", "m", input_tokens=100, predicted_output_tokens=10)
    return SCORERS["ttft"](ScoringContext(request=request, pool=pool, **ctx))


@pytest.mark.parametrize(
    ("fields", "penalised"),
    [
        ({"kv_usage": 0.97}, False),  # high usage, nothing waiting: healthy
        ({"kv_usage": 1.0}, False),
        ({"kv_usage": 0.97, "num_waiting": 1}, True),  # queueing: the usage counts
        ({"kv_usage": 0.97, "num_waiting": None}, True),  # cannot tell: counts
        ({"kv_usage": None}, True),  # unknown usage: saturated
        ({"kv_usage": 0.97, "scrape_stale": True}, True),
        ({"num_running": 60, "max_num_seqs": 64}, True),  # seat share >= 0.9 still counts
        ({"num_running": 30, "max_num_seqs": 64, "kv_usage": 0.99}, False),
    ],
)
def test_high_kv_usage_is_saturation_only_while_queueing(
    fields: dict[str, Any], penalised: bool
) -> None:
    tested, peer = backend("tested", **fields), backend("peer")
    score, _ = ttft_scores([tested, peer])
    assert (score < 0.5) is penalised  # saturation divides the work by 1 - 0.9 or more


def test_high_kv_usage_without_a_queue_keeps_the_prefix_credit() -> None:
    holder, other = backend("holder", kv_usage=0.95), backend("other")
    pool = [other, holder]
    depths = {"holder": 40}  # the whole 100-token prompt is cached there: 1 token of work
    scores = ttft_scores(pool, prefix_depths=depths, num_prefix_blocks=40)
    assert scores == [pytest.approx(0.01), 1.0]
    holder.num_waiting = 1  # now it queues: the cached blocks may be evicted
    assert ttft_scores(pool, prefix_depths=depths, num_prefix_blocks=40)[1] < 0.2


def test_default_does_not_avoid_the_backend_with_the_fullest_prefix_cache() -> None:
    # Equal load; "fast" served most, so its cache reads fullest. Before the rule its work
    # was divided by 1 - 0.99 and "slow" (the 4x slower, emptier one) won every tie.
    policy = create_policy("default")
    fast = backend("fast", kv_usage=0.99, in_flight=2)
    slow = backend("slow", kv_usage=0.7, in_flight=2)
    s = ClusterSnapshot(0.0, (slow, fast))
    fast.ewma_ttft_ms, fast.ewma_prefill_work_tokens = 10.0, 200.0
    slow.ewma_ttft_ms, slow.ewma_prefill_work_tokens = 40.0, 200.0
    fast.num_ttft_samples = slow.num_ttft_samples = 5
    assert policy.choose(RequestInfo("r", "m", 200, 32), s, random.Random(0)).ranked[0] == "fast"
