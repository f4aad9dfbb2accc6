"""cost_aware: cheapest backend predicted to meet the TTFT SLO, else least load."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kiloserve.policies import BackendState, ClusterSnapshot, RequestInfo, create_policy
from kiloserve.policies.cost_aware import predicted_ttft_ms


def backend(bid: str, **kw: Any) -> BackendState:
    kw.setdefault("models", frozenset({"m"}))
    kw.setdefault("num_running", 0)
    kw.setdefault("num_waiting", 0)
    return BackendState(backend_id=bid, **kw)


REQ = RequestInfo("r", "m", 1000, 10)  # 1000 prompt tokens = 100 ms at 0.1 ms/token


def test_predicted_ttft() -> None:
    pool = [
        backend("a", ewma_ttft_ms=200.0, outstanding_prefill_tokens=2000),
        backend("b", ewma_ttft_ms=None),
        backend("c", ewma_ttft_ms=100.0, effective_weight=0.5),
    ]
    assert predicted_ttft_ms(pool, 1000, 0.1) == pytest.approx([500.0, 250.0, 400.0])
    assert predicted_ttft_ms([backend("x")], 1000, 0.1) == pytest.approx([100.0])


@pytest.mark.parametrize(
    ("backends", "ranked", "reason"),
    [
        # cheapest meeting the SLO first; the H100 is faster but dearer
        (
            [
                backend("h100", cost_per_hour=4.0, ewma_ttft_ms=80.0),
                backend("l40s", cost_per_hour=1.0, ewma_ttft_ms=300.0),
                backend("a100", cost_per_hour=2.0, ewma_ttft_ms=150.0),
            ],
            ("l40s", "a100", "h100"),
            "cheapest",
        ),
        # the cheap card's queue pushes it over 500 ms: next cheapest
        (
            [
                backend("h100", cost_per_hour=4.0, ewma_ttft_ms=80.0),
                backend(
                    "l40s", cost_per_hour=1.0, ewma_ttft_ms=300.0, outstanding_prefill_tokens=1500
                ),
                backend("a100", cost_per_hour=2.0, ewma_ttft_ms=150.0, in_flight=5),
            ],
            ("a100", "h100", "l40s"),
            "cheapest",
        ),
        # equal cost: lower load first; stale never meets the SLO
        (
            [
                backend("a", cost_per_hour=1.0, ewma_ttft_ms=50.0, in_flight=3),
                backend("b", cost_per_hour=1.0, ewma_ttft_ms=50.0, in_flight=1),
                backend("c", cost_per_hour=0.5, ewma_ttft_ms=50.0, scrape_stale=True),
            ],
            ("b", "a", "c"),
            "cheapest",
        ),
        # none meets the SLO: least load
        (
            [
                backend("a", cost_per_hour=1.0, ewma_ttft_ms=900.0, in_flight=2),
                backend("b", cost_per_hour=3.0, ewma_ttft_ms=800.0, in_flight=1),
            ],
            ("b", "a"),
            "no backend meets SLO",
        ),
        # demoted slow node: 300 / 0.5 = 600 ms misses the SLO
        (
            [
                backend("cheap", cost_per_hour=1.0, ewma_ttft_ms=200.0, effective_weight=0.5),
                backend("dear", cost_per_hour=3.0, ewma_ttft_ms=200.0),
            ],
            ("dear", "cheap"),
            "cheapest",
        ),
    ],
)
def test_cost_aware_ranking(
    backends: list[BackendState], ranked: tuple[str, ...], reason: str
) -> None:
    decision = create_policy("cost_aware").choose(
        REQ, ClusterSnapshot(0.0, tuple(backends)), random.Random(0)
    )
    assert decision.ranked == ranked
    assert decision.reason == reason


def test_slo_is_configurable() -> None:
    s = ClusterSnapshot(
        0.0,
        (
            backend("cheap", cost_per_hour=1.0, ewma_ttft_ms=300.0),
            backend("dear", cost_per_hour=3.0, ewma_ttft_ms=50.0),
        ),
    )
    strict = create_policy("cost_aware", {"slo_ttft_ms": 200.0})
    assert strict.choose(REQ, s, random.Random(0)).ranked[0] == "dear"
    assert create_policy("cost_aware").choose(REQ, s, random.Random(0)).ranked[0] == "cheap"
