"""Planner arithmetic on hand-checked cases (SPEC S4.4, S4.5)."""

from __future__ import annotations

import math

import pytest

from kiloserve.catalog import GIB, get_gpu, get_model
from kiloserve.errors import ConfigError
from kiloserve.plan.capacity import CapacityResult
from kiloserve.plan.planner import (
    Candidate,
    cost_per_million_tokens,
    cost_per_request,
    enumerate_candidates,
    kv_capacity_check,
    min_tp_for_weights,
    parse_prices,
    plan_deployment,
    price_for,
    rank_deployments,
    replicas_needed,
)


def test_seed_002_thousand_cards() -> None:
    # Seed 002: 10,000 tok/s at 40 tok/s per TP4 replica -> 250 replicas = 1,000 cards.
    num_replicas = replicas_needed(10_000, 40, headroom=1.0)
    assert num_replicas == 250
    assert num_replicas * 4 == 1000


def test_seed_002_with_default_headroom() -> None:
    # The same target with the 1.25 headroom of S4.5: ceil(250 x 1.25) = ceil(312.5).
    assert replicas_needed(10_000, 40) == 313


@pytest.mark.parametrize(
    ("target", "per_replica", "headroom", "expected"),
    [
        (300, 2.5, 1.25, 150),  # exact: 120 x 1.25
        (7.7, 0.7, 1.0, 11),  # 7.7 / 0.7 is 11.000000000000002 in floats: still 11
        (1, 1000, 1.25, 1),  # never fewer than one replica
        (0, 5, 1.25, 1),
        (100, 7, 1.0, 15),  # 14.29 -> 15
    ],
)
def test_replicas_needed(target: float, per_replica: float, headroom: float, expected: int) -> None:
    assert replicas_needed(target, per_replica, headroom) == expected


@pytest.mark.parametrize(
    ("target", "per_replica", "headroom"), [(10, 0, 1.25), (10, -1, 1.25), (10, 1, 0.9)]
)
def test_replicas_needed_rejects_bad_input(
    target: float, per_replica: float, headroom: float
) -> None:
    with pytest.raises(ConfigError):
        replicas_needed(target, per_replica, headroom)


def test_min_tp_for_weights_rule_of_thumb() -> None:
    usable = 80 * GIB * 0.92  # 79.0 GB usable per H100
    assert min_tp_for_weights(145.4e9, usable) == 2  # Qwen2-72B bf16: 1.84 cards -> 2
    assert min_tp_for_weights(16.1e9, usable) == 1  # Llama-3.1-8B
    assert min_tp_for_weights(3 * usable - 1, usable) == 4  # 3 cards -> next power of two
    assert min_tp_for_weights(5 * usable, usable) == 8


def test_kv_capacity_check_hand_computed() -> None:
    # 300 req/s x 200 output tokens x 320 KiB = 19.66 GB; x 1.25 = 24.58 GB over
    # 10 GiB per replica = 2.29 -> 3 replicas of TP4 = 12 cards.
    check = kv_capacity_check(300, 200, 327_680, 10 * GIB, tp=4, redundancy=0.25)
    assert check.kv_bytes_needed == 300 * 200 * 327_680
    assert check.num_replicas == 3
    assert check.num_cards == 12


def test_kv_capacity_check_rejects_empty_cache() -> None:
    with pytest.raises(ConfigError):
        kv_capacity_check(1, 1, 1, 0, tp=1)


def test_costs() -> None:
    assert cost_per_million_tokens(10.0, 1000) == pytest.approx(10 / 3.6e6 * 1e6)
    assert cost_per_request(3.6, 1.0) == pytest.approx(0.001)
    assert math.isinf(cost_per_million_tokens(1.0, 0))
    assert math.isinf(cost_per_request(1.0, 0))


def test_ledger_rows_qwen2_72b_on_h100() -> None:
    model, gpu = get_model("qwen2-72b"), get_gpu("H100")
    rows = {c.tp: c for c in enumerate_candidates(model, [gpu])}
    assert sorted(rows) == [1, 2, 4, 8]
    assert not rows[1].is_fitting and rows[1].issue == "weights"
    assert not rows[2].is_fitting and rows[2].issue == "weights"
    assert rows[2].reason is not None and "--tp 4" in rows[2].reason
    tp4 = rows[4].ledger_dict()
    # usable 85,899,345,920 x 0.92 = 79,027,398,246 B; weights 72,706,203,648 x 2 / 4 =
    # 36,353,101,824 B; minus 5.5 GiB activations and 0.6 GiB runtime leaves
    # 36,124,471,296 B; blocks of 16 tokens x 81,920 B/token/GPU -> 27,560 blocks.
    assert tp4["fits"] is True
    assert tp4["weights_gib_per_gpu"] == pytest.approx(36_353_101_824 / GIB)
    assert tp4["kv_tokens"] == 440_960
    total = tp4["weights_gib_per_gpu"] + tp4["kv_gib_per_gpu"] + tp4["reserve_gib_per_gpu"]
    assert total == pytest.approx(80.0)
    assert rows[8].ledger_dict()["kv_tokens"] > tp4["kv_tokens"]


def test_tp_that_does_not_divide_heads() -> None:
    (cand,) = enumerate_candidates(get_model("qwen2-7b"), [get_gpu("H100")], tps=[8])
    assert cand.issue == "heads"
    assert cand.ledger_dict() == {
        "gpu": "H100-SXM",
        "tp": 8,
        "quant": "bf16",
        "fits": False,
        "issue": "heads",
        "reason": "TP8 does not divide 28 attention heads",
    }


def test_kv_too_small_is_named() -> None:
    (cand,) = enumerate_candidates(get_model("qwen2-72b"), [get_gpu("L40S")], ["int4"], [1])
    assert cand.issue == "kv"
    assert cand.reason is not None and "KV cache" in cand.reason


def test_prices() -> None:
    prices = parse_prices("H100=3, A100-80G=1.5")
    assert price_for(get_gpu("H100-SXM"), prices) == 3.0
    assert price_for(get_gpu("A100"), prices) == 1.5
    assert price_for(get_gpu("L40S"), prices) == get_gpu("L40S").cost_per_hour
    for bad in ("H100", "H100=x", "=2", "H100=-1"):
        with pytest.raises(ConfigError):
            parse_prices(bad)


def _capacity(rate_rps: float, tokens_per_s: float = 400.0) -> CapacityResult:
    return CapacityResult(rate_rps, tokens_per_s, "test", True)


def _tp4_h100() -> Candidate:
    return enumerate_candidates(get_model("qwen2-72b"), [get_gpu("H100")], tps=[4])[0]


def test_plan_deployment_hand_computed() -> None:
    d = plan_deployment(_tp4_h100(), _capacity(2.5), 300, 200, price_per_gpu_hour=2.5)
    assert d is not None
    assert d.num_replicas == 150  # 300 / 2.5 x 1.25
    assert d.num_cards == 600
    assert d.cost_per_hour == pytest.approx(1500.0)
    assert d.cost_per_million_output_tokens == pytest.approx(1500 / (300 * 200 * 3600) * 1e6)
    assert d.cost_per_request == pytest.approx(1500 / (300 * 3600))
    # KV: 300 x 200 x 327,680 B x 1.25 = 24.6 GB fits one replica's 53.8 GB (4 x 13.46 GB).
    assert d.kv_check.num_replicas == 1
    assert d.to_dict()["num_cards"] == 600


def test_plan_deployment_without_capacity() -> None:
    cand = _tp4_h100()
    assert plan_deployment(cand, _capacity(0.0), 300, 200, price_per_gpu_hour=2.5) is None


def test_rank_cheapest_first() -> None:
    cand = _tp4_h100()
    slow = plan_deployment(cand, _capacity(1.0), 100, 200, price_per_gpu_hour=2.5)
    fast = plan_deployment(cand, _capacity(4.0), 100, 200, price_per_gpu_hour=2.5)
    assert slow is not None and fast is not None
    assert rank_deployments([slow, fast]) == [fast, slow]
