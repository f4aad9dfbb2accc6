"""Pareto sizes, loads and front; the simulated one-backend probe behaves like a queue."""

from __future__ import annotations

from typing import Any

import pytest

from kiloserve.catalog import get_gpu, get_model
from kiloserve.errors import ConfigError
from kiloserve.plan.capacity import CapacityResult
from kiloserve.plan.pareto import (
    deployment_cluster,
    mark_pareto_front,
    parse_sizes,
    rate_for_size,
    replica_probe,
)
from kiloserve.plan.planner import Deployment, enumerate_candidates, plan_deployment


def _deployment(per_replica_rps: float = 2.0, target_rps: float = 100.0) -> Deployment:
    cand = enumerate_candidates(get_model("qwen2-72b"), [get_gpu("H100")], tps=[4])[0]
    capacity = CapacityResult(per_replica_rps, 300.0, "test", True)
    d = plan_deployment(cand, capacity, target_rps, 200, price_per_gpu_hour=2.5)
    assert d is not None
    return d


def test_default_sizes_are_half_one_and_two_times_the_plan() -> None:
    d = _deployment()  # 100 / 2 x 1.25 = 62.5 -> 63 replicas = 252 GPUs
    assert d.num_cards == 252
    assert parse_sizes(None, d) == [128, 252, 504]


def test_explicit_sizes() -> None:
    d = _deployment()
    assert parse_sizes("1024, 128,256,512,128", d) == [128, 256, 512, 1024]
    for bad in ("130", "2", "x", ","):
        with pytest.raises(ConfigError):
            parse_sizes(bad, d)


def test_rate_for_size() -> None:
    d = _deployment()
    scaled = rate_for_size(d, "scaled")
    assert scaled(128) == pytest.approx(32 * 2.0 / 1.25)  # 32 replicas at 80% of capacity
    assert scaled(1024) == pytest.approx(256 * 2.0 / 1.25)
    assert rate_for_size(d, "target")(1024) == 100.0
    with pytest.raises(ConfigError):
        rate_for_size(d, "other")


def test_pareto_front() -> None:
    rows: list[dict[str, Any]] = [
        {"cost_per_request": 1.0, "ttft_p95_ms": 300.0},  # cheapest
        {"cost_per_request": 2.0, "ttft_p95_ms": 200.0},  # faster
        {"cost_per_request": 3.0, "ttft_p95_ms": 250.0},  # dominated by the second
        {"cost_per_request": 3.0, "ttft_p95_ms": None},  # unknown latency: dominated
    ]
    mark_pareto_front(rows)
    assert [r["is_pareto"] for r in rows] == [True, True, False, False]


def test_cluster_lines_hold_at_most_256_backends() -> None:
    cfg = deployment_cluster("H100", "qwen2-72b", 4, "bf16", 600, price_per_gpu_hour=2.0)
    assert [b.count for b in cfg.backends] == [256, 256, 88]
    assert len(cfg.expanded()) == 600
    assert {b.cost_per_hour for b in cfg.backends} == {2.0}
    with pytest.raises(ConfigError):
        deployment_cluster("H100", "qwen2-72b", 4, "bf16", 0)


def test_simulated_probe_queues_under_load() -> None:
    cluster = deployment_cluster("H100", "llama-3.1-8b", 1, "bf16", 1)
    workload = "synthetic:input=fixed(500),output=fixed(50)"
    probe = replica_probe(cluster, workload, num_requests=80, min_duration_s=0.01, seed=1)
    light, heavy = probe(2.0), probe(400.0)
    assert light["requests_ok"] == heavy["requests_ok"] == 80
    assert heavy["ttft_ms"]["p95"] > 3 * light["ttft_ms"]["p95"]
    assert heavy["tpot_ms"]["p95"] > light["tpot_ms"]["p95"]
    assert probe(2.0)["ttft_ms"] == light["ttft_ms"]  # deterministic


def test_probe_lasts_at_least_min_duration() -> None:
    cluster = deployment_cluster("H100", "llama-3.1-8b", 1, "bf16", 1)
    workload = "synthetic:input=fixed(100),output=fixed(10)"
    probe = replica_probe(cluster, workload, num_requests=10, min_duration_s=2.0)
    summary = probe(50.0)  # 10 requests would arrive in 0.2 s: 100 are sent instead
    assert summary["simulated_requests"] == 100
    assert 1.0 < summary["probe_arrival_span_s"] < 3.0
    assert summary["duration_s"] > summary["probe_arrival_span_s"]
