"""weighted_round_robin: nginx smooth WRR on live (seed) or static weights, exact sequences."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kiloserve.policies import BackendState, ClusterSnapshot, RequestInfo, create_policy
from kiloserve.policies.base import Policy

REQ = RequestInfo("r", "m", 100, 10)


def backend(bid: str, **kw: Any) -> BackendState:
    kw.setdefault("models", frozenset({"m"}))
    kw.setdefault("num_running", 0)
    kw.setdefault("num_waiting", 0)
    kw.setdefault("kv_usage", 0.0)
    return BackendState(backend_id=bid, **kw)


def run(policy: Policy, snapshot: ClusterSnapshot, n: int) -> str:
    """Pick and dispatch ``n`` times; the picks as one string of backend ids."""
    out = []
    for _ in range(n):
        pick = policy.choose(REQ, snapshot, random.Random(0)).ranked[0]
        policy.on_dispatch(REQ, pick)
        out.append(pick)
    return "".join(out)


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        ({"a": 5.0, "b": 1.0, "c": 1.0}, "aabacaa" * 2),  # nginx's documented sequence
        ({"a": 1.0, "b": 1.0, "c": 1.0}, "abcabc"),  # equal weights: plain round robin
        ({"a": 2.0, "b": 1.0}, "abaaba"),
        ({"a": 0.0, "b": 1.0}, "bbbb"),  # static weight 0: not a candidate
    ],
)
def test_static_weights_exact_sequences(weights: dict[str, float], expected: str) -> None:
    s = ClusterSnapshot(
        0.0, tuple(backend(k, weight=w, effective_weight=1.0) for k, w in weights.items())
    )
    policy = create_policy("weighted_round_robin", {"weights": "static"})
    assert run(policy, s, len(expected)) == expected


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        # free KV 0.5 / 1.0 / 0.25 -> W 2:4:1 (worked by hand in docs/policies.md)
        ({"a": {"kv_usage": 0.5}, "b": {"kv_usage": 0.0}, "c": {"kv_usage": 0.75}}, "babcbab"),
        # latency: exp(-0.05 * 0) vs exp(-0.05 * 13.86) = 0.5 -> 2:1
        ({"a": {"ewma_tpot_ms": 20.0}, "b": {"ewma_tpot_ms": 33.8629436}}, "abaaba"),
        # PCIe 75% busy -> W 0.25 -> 4:1
        ({"a": {}, "b": {"pcie_util": 0.75}}, "aabaa"),
        # full or unknown KV: W 0, never picked while another has W > 0
        ({"a": {"kv_usage": 1.0}, "b": {"kv_usage": None}, "c": {}}, "ccc"),
        # health weight (S3.2 demotion to 0.2) multiplies: 1 : 0.2 = 5:1
        ({"a": {}, "b": {"effective_weight": 0.2}}, "aaabaa"),
    ],
)
def test_seed_weights_exact_sequences(kw: dict[str, dict[str, Any]], expected: str) -> None:
    s = ClusterSnapshot(0.0, tuple(backend(k, **v) for k, v in kw.items()))
    policy = create_policy("weighted_round_robin")
    assert run(policy, s, len(expected)) == expected


def test_static_ignores_live_state() -> None:
    s = ClusterSnapshot(0.0, (backend("a", kv_usage=0.9), backend("b", kv_usage=0.0)))
    assert run(create_policy("weighted_round_robin", {"weights": "static"}), s, 4) == "abab"
    assert run(create_policy("weighted_round_robin"), s, 11) == "bbbbbabbbbb"


def test_choose_is_pure_and_ranks_fallbacks() -> None:
    s = ClusterSnapshot(
        0.0,
        (
            backend("full", kv_usage=1.0, in_flight=3),
            backend("a", kv_usage=0.5),
            backend("b", kv_usage=0.0),
            backend("stale", kv_usage=0.0, scrape_stale=True),
        ),
    )
    policy = create_policy("weighted_round_robin")
    first = policy.choose(REQ, s, random.Random(0))
    assert first == policy.choose(REQ, s, random.Random(1))  # no state moved, no rng used
    # c + w: b 1.0 > a 0.5; then W = 0 ones by least load (stale load unknown: last)
    assert first.ranked == ("b", "a", "full", "stale")


def test_dispatch_to_a_fallback_steps_that_backend() -> None:
    s = ClusterSnapshot(0.0, (backend("a"), backend("b")))
    policy = create_policy("weighted_round_robin", {"weights": "static"})
    assert policy.choose(REQ, s, random.Random(0)).ranked == ("a", "b")
    policy.on_dispatch(REQ, "b")  # the retry went to b: c = (1, -1), a owed one turn
    assert run(policy, s, 3) == "aab"
    policy.on_dispatch(REQ, "nobody")  # not in the weighted set: nothing moves
    assert run(policy, s, 2) == "ab"


def test_all_weights_zero_falls_back_to_least_load() -> None:
    s = ClusterSnapshot(
        0.0, (backend("a", kv_usage=1.0, in_flight=2), backend("b", kv_usage=None, in_flight=1))
    )
    decision = create_policy("weighted_round_robin").choose(REQ, s, random.Random(0))
    assert decision.ranked == ("b", "a")
    assert decision.reason == "all weights zero"


def test_no_candidate() -> None:
    s = ClusterSnapshot(0.0, (backend("a", healthy=False),))
    assert create_policy("weighted_round_robin").choose(REQ, s, random.Random(0)).ranked == ()


def test_live_weights_refresh_on_snapshot_time() -> None:
    a, b = backend("a", kv_usage=0.0), backend("b", kv_usage=0.0)
    policy = create_policy("weighted_round_robin", {"refresh_s": 0.2})
    assert run(policy, ClusterSnapshot(0.0, (a, b)), 2) == "ab"
    a.kv_usage = 0.75  # W(a) 1 -> 0.25, seen only once 200 ms of snapshot time passed
    assert run(policy, ClusterSnapshot(0.19, (a, b)), 2) == "ab"
    # c = (0, 0), w = (0.25, 1): c + w picks b b a b b (1 a in 5 = 0.25 / 1.25)
    assert run(policy, ClusterSnapshot(0.2, (a, b)), 5) == "bbabb"


def test_candidate_change_recomputes_at_once() -> None:
    a, b, c = backend("a"), backend("b"), backend("c")
    policy = create_policy("weighted_round_robin", {"refresh_s": 10.0})
    assert run(policy, ClusterSnapshot(0.0, (a, b, c)), 2) == "ab"
    b.healthy = False  # ejected: gone from the rotation without waiting for a refresh
    # c was (a -1, b -1, c 2): b forgotten, c keeps its credit -> c c a c
    assert run(policy, ClusterSnapshot(0.1, (a, b, c)), 4) == "ccac"
