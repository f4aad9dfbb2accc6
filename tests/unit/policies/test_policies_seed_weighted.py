"""seed_weighted: S1.4 weights, weighted-random picks via rng, caching per snapshot."""

from __future__ import annotations

import bisect
import math
import random
from itertools import accumulate
from typing import Any

import pytest

from kiloserve.policies import BackendState, ClusterSnapshot, RequestInfo, create_policy
from kiloserve.policies.seed_weighted import SeedWeightedParams, SeedWeightedPolicy, seed_weights


def backend(bid: str, **kw: Any) -> BackendState:
    kw.setdefault("models", frozenset({"m"}))
    kw.setdefault("num_running", 0)
    kw.setdefault("num_waiting", 0)
    return BackendState(backend_id=bid, **kw)


REQ = RequestInfo("r", "m", 100, 10)


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        # free 0.6 * (1 - 0.5) * exp(-0.05 * (30 - 20)) * 1
        ({"kv_usage": 0.4, "pcie_util": 0.5, "ewma_tpot_ms": 30.0}, 0.3 * math.exp(-0.5)),
        # pcie None counts as 0
        ({"kv_usage": 0.4, "pcie_util": None, "ewma_tpot_ms": 20.0}, 0.6),
        # effective weight multiplies
        ({"kv_usage": 0.0, "ewma_tpot_ms": 20.0, "effective_weight": 0.2}, 0.2),
        # unknown or stale kv: full, weight 0
        ({"kv_usage": None, "ewma_tpot_ms": 20.0}, 0.0),
        ({"kv_usage": 0.0, "ewma_tpot_ms": 20.0, "scrape_stale": True}, 0.0),
        # unknown latency takes the mean of the known ones: (20 + 40) / 2 = 30
        ({"kv_usage": 0.0, "ewma_tpot_ms": None}, math.exp(-0.5)),
    ],
)
def test_weight_formula(kw: dict[str, Any], expected: float) -> None:
    pool = [
        backend("ref", kv_usage=0.0, ewma_tpot_ms=20.0),
        backend("x", **kw),
        backend("ref2", kv_usage=0.0, ewma_tpot_ms=40.0),
    ]
    weights = seed_weights(pool, SeedWeightedParams())
    assert weights[0] == pytest.approx(1.0)
    assert weights[1] == pytest.approx(expected)


def test_ttft_metric_and_no_underflow() -> None:
    pool = [
        backend("a", kv_usage=0.0, ewma_ttft_ms=2000.0),
        backend("b", kv_usage=0.0, ewma_ttft_ms=2010.0),
    ]
    weights = seed_weights(pool, SeedWeightedParams(latency_metric="ttft"))
    assert weights[0] == pytest.approx(1.0)  # exp(-100) would underflow ratios without the shift
    assert weights[1] == pytest.approx(math.exp(-0.5))


def test_exact_pick_sequence_follows_rng() -> None:
    s = ClusterSnapshot(
        0.0,
        (
            backend("a", kv_usage=0.5, ewma_tpot_ms=20.0),
            backend("b", kv_usage=0.0, ewma_tpot_ms=20.0),
            backend("c", kv_usage=0.75, ewma_tpot_ms=20.0),
        ),
    )
    cumulative = list(accumulate([0.5, 1.0, 0.25]))
    ref = random.Random(9)
    expected = ["abc"[bisect.bisect_right(cumulative, ref.random() * 1.75)] for _ in range(30)]
    policy, rng = create_policy("seed_weighted"), random.Random(9)
    got = [policy.choose(REQ, s, rng).ranked[0] for _ in range(30)]
    assert got == expected
    assert policy.choose(REQ, s, random.Random(0)).ranked[1:] in {
        ("b", "a"),
        ("b", "c"),
        ("a", "c"),
    }


def test_pick_shares_follow_weights() -> None:
    s = ClusterSnapshot(
        0.0, (backend("a", kv_usage=0.8), backend("b", kv_usage=0.2), backend("c", kv_usage=1.0))
    )
    policy, rng = create_policy("seed_weighted"), random.Random(3)
    got = [policy.choose(REQ, s, rng).ranked[0] for _ in range(5000)]
    assert "c" not in got
    assert got.count("b") / len(got) == pytest.approx(0.8, abs=0.03)


def test_all_zero_weights_fall_back_to_least_load() -> None:
    s = ClusterSnapshot(
        0.0,
        (
            backend("a", kv_usage=1.0, in_flight=4),
            backend("b", kv_usage=None, in_flight=1),
            backend("c", kv_usage=1.0, scrape_stale=True),
        ),
    )
    decision = create_policy("seed_weighted").choose(REQ, s, random.Random(0))
    assert decision.ranked == ("b", "a", "c")
    assert decision.reason == "all weights zero"


def test_weights_recomputed_for_a_new_snapshot_only() -> None:
    a, b = backend("a", kv_usage=0.0), backend("b", kv_usage=1.0)
    s1 = ClusterSnapshot(0.0, (a, b))
    policy = create_policy("seed_weighted")
    assert policy.choose(REQ, s1, random.Random(0)).ranked[0] == "a"
    a.kv_usage, b.kv_usage = 1.0, 0.0  # same snapshot object: cached weights stay
    assert policy.choose(REQ, s1, random.Random(0)).ranked[0] == "a"
    s2 = ClusterSnapshot(0.2, (a, b))
    assert policy.choose(REQ, s2, random.Random(0)).ranked[0] == "b"


class FakeClock:
    """Snapshot time under test control: each ``snapshot()`` is a new object."""

    def __init__(self, *backends: BackendState) -> None:
        self.now_s = 0.0
        self.backends = backends

    def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(self.now_s, self.backends)


def seed_policy(params: dict[str, Any] | None = None) -> SeedWeightedPolicy:
    policy = create_policy("seed_weighted", params)
    assert isinstance(policy, SeedWeightedPolicy)
    return policy


def test_refresh_every_200_ms_of_snapshot_time_not_per_snapshot_object() -> None:
    a, b = backend("a", kv_usage=0.0), backend("b", kv_usage=1.0)
    clock = FakeClock(a, b)
    policy = seed_policy()
    assert policy.choose(REQ, clock.snapshot(), random.Random(0)).ranked[0] == "a"
    a.kv_usage, b.kv_usage = 1.0, 0.0
    for now_s in (0.05, 0.1, 0.199):  # a new snapshot per decision, as the gateway builds
        clock.now_s = now_s
        assert policy.choose(REQ, clock.snapshot(), random.Random(0)).ranked[0] == "a"
    clock.now_s = 0.2
    assert policy.choose(REQ, clock.snapshot(), random.Random(0)).ranked[0] == "b"
    assert policy.weights.num_computed == 2


@pytest.mark.parametrize(("refresh_s", "num_computed"), [(0.0, 6), (0.05, 3), (1.0, 1)])
def test_refresh_s_param(refresh_s: float, num_computed: int) -> None:
    clock = FakeClock(backend("a", kv_usage=0.0), backend("b", kv_usage=0.5))
    policy = seed_policy({"refresh_s": refresh_s})
    for now_s in (0.0, 0.0, 0.03, 0.06, 0.09, 0.12):
        clock.now_s = now_s
        policy.choose(REQ, clock.snapshot(), random.Random(0))
    assert policy.weights.num_computed == num_computed


def test_candidate_change_and_clock_reset_recompute_at_once() -> None:
    a, b = backend("a", kv_usage=0.0), backend("b", kv_usage=0.5)
    clock = FakeClock(a, b)
    policy = seed_policy({"refresh_s": 10.0})
    policy.choose(REQ, clock.snapshot(), random.Random(0))
    a.draining = True  # leaves the candidates: never picked from stale weights
    clock.now_s = 0.01
    assert policy.choose(REQ, clock.snapshot(), random.Random(0)).ranked == ("b",)
    a.draining = False
    clock.now_s = 0.0  # a new simulation run on the same policy object
    policy.choose(REQ, clock.snapshot(), random.Random(0))
    assert policy.weights.num_computed == 3
