"""Seed 000 headline 1: dynamic weights vs static weights, in the simulator.

    .venv/bin/python benchmarks/seed_dynamic_weights.py            # ~1-3 min on 2 cores
    .venv/bin/python benchmarks/seed_dynamic_weights.py --quick    # one seed, one rate

Seed 000 claims +27% cluster throughput and -41% P99 latency for its dynamic weight
``W = free_vram * (1 - pcie_util) * exp(-0.05 * latency_ms)`` (refreshed every 200 ms)
against static weights. The same policy object runs both sides, so only the weights
differ: ``weighted_round_robin`` with ``weights: static`` (configured weight x health
weight) against ``weights: seed`` (the live W), plus ``seed_weighted`` (the seed's own
weighted-random pick on W) and round robin (static, all weights equal). Slow-node
demotion is off, so no other mechanism moves the static side's weights. Scenarios:

* ``hetero12``: 4 x H100, 4 x A100, 4 x L40S single-GPU Llama-3.1-8B replicas; static
  weights by HBM bandwidth (3.35 : 2.0 : 0.86 TB/s = 3.9 : 2.3 : 1);
* ``h100x8``: seed 000's own setting, 8 H100 nodes serving Qwen2-72B (one TP4 replica
  each), equal static weights (static WRR is then round robin);
* ``h100x8-slow``: the same with one node 3x slower from t = 10 s (a degraded node that
  static weights cannot see).

Workload ``mix:chat=0.8,longdoc=0.2`` (open loop, 60 s of arrivals). Prints a markdown
table per scenario and rate: means over the seeds (KV: the mean over backends of each
backend's mean KV usage, and the highest KV usage seen), the dynamic / static WRR
ratios and the dynamic WRR / round robin ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from kiloserve.launch.config import ClusterConfig, parse_cluster_config
from kiloserve.sim import simulate
from kiloserve.sim.faults import FaultEvent
from kiloserve.workload import load_workload

WORKLOAD = "mix:chat=0.8,longdoc=0.2"
NO_DEMOTION = {"policy": "default", "options": {"demotion": {"enabled": False}}}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "static WRR": ("weighted_round_robin", {"weights": "static"}),
    "round robin (equal static weights)": ("round_robin", {}),
    "dynamic WRR (seed W)": ("weighted_round_robin", {}),
    "seed_weighted (random on W)": ("seed_weighted", {}),
}


def hetero12() -> ClusterConfig:
    backends = [
        {"name": name, "gpu": gpu, "model": "llama-3.1-8b", "count": 4, "weight": weight}
        for name, gpu, weight in (("h100", "H100", 3.9), ("a100", "A100", 2.3),
                                  ("l40s", "L40S", 1.0))
    ]  # fmt: skip
    data = {"name": "hetero12", "gateway": NO_DEMOTION, "backends": backends}
    return parse_cluster_config(data, "hetero12")


def h100x8() -> ClusterConfig:
    backends = [{"name": "h100-72b", "gpu": "H100", "model": "qwen2-72b", "tp": 4, "count": 8}]
    return parse_cluster_config(
        {"name": "h100x8", "gateway": NO_DEMOTION, "backends": backends}, "h100x8"
    )


SLOW = (FaultEvent(10.0, "h100-72b-0", "slow", 3.0),)


def run_one(
    cluster: ClusterConfig, variant: str, rate: float, seed: int, slow: bool
) -> dict[str, float]:
    policy, params = VARIANTS[variant]
    workload = load_workload(WORKLOAD, seed=seed, duration_s=60, rate=rate, with_prompts=False)
    faults = SLOW if slow else ()
    s = simulate(cluster, workload, policy, policy_params=params, seed=seed, faults=faults).summary
    blocks = s["per_backend"].values()
    return {
        "req/s": s["request_throughput"],
        "TTFT P99": s["ttft_ms"]["p99"],
        "E2E P50": s["e2e_ms"]["p50"],
        "E2E P99": s["e2e_ms"]["p99"],
        "KV mean %": 100 * statistics.fmean(b.get("kv_usage_mean", 0.0) for b in blocks),
        "KV max %": 100 * max(b.get("kv_usage_max", 0.0) for b in blocks),
    }


def table(cluster: ClusterConfig, rate: float, seeds: list[int], slow: bool = False) -> None:
    keys = ("req/s", "TTFT P99", "E2E P50", "E2E P99", "KV mean %", "KV max %")
    name = cluster.name + ("-slow (h100-72b-0 3x slower from t=10 s)" if slow else "")
    print(f"\n### {name} @ {rate:g} req/s, seeds {seeds}\n")
    print("| policy | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    means: dict[str, dict[str, float]] = {}
    for variant in VARIANTS:
        runs = [run_one(cluster, variant, rate, seed, slow) for seed in seeds]
        means[variant] = {k: statistics.fmean(r[k] for r in runs) for k in keys}
        print(f"| {variant} | " + " | ".join(f"{means[variant][k]:.2f}" if k == "req/s"
              else f"{means[variant][k]:.0f}" for k in keys) + " |", flush=True)  # fmt: skip
    base = means["static WRR"]
    for variant in list(VARIANTS)[2:]:
        ratios = " | ".join(f"{means[variant][k] / base[k]:.2f}x" for k in keys)
        print(f"| {variant} / static | {ratios} |")
    rr, dyn = means["round robin (equal static weights)"], means["dynamic WRR (seed W)"]
    ratios = " | ".join(f"{dyn[k] / rr[k]:.2f}x" for k in keys)
    print(f"| dynamic WRR (seed W) / round robin | {ratios} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one seed, one rate per scenario")
    args = p.parse_args()
    seeds = [1] if args.quick else [1, 2, 3, 4, 5]
    for cluster, rates in ((hetero12(), [9.0, 12.0]), (h100x8(), [8.0, 12.0])):
        for rate in rates[-1:] if args.quick else rates:
            table(cluster, rate, seeds)
    table(h100x8(), 8.0, seeds, slow=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
