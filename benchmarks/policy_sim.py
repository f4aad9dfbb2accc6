"""Routing policies compared in the simulator (deterministic, seconds per run).

    .venv/bin/python benchmarks/policy_sim.py

The same policy objects the gateway runs, on simulated engines, so the numbers do not
depend on how busy this machine is. Scenarios:

* ``twin-mix``: ``examples/cluster.yaml``'s Llama pool (2 x H100, 2 x A100, 1 x L40S),
  ``mix:chat=0.6,longdoc=0.1,short=0.3`` at 12 and 18 requests/s for 60 s;
* ``twin-azure``: the same pool replaying the Azure 2023 conversation trace at 15 req/s;
* ``twin-mooncake``: the Mooncake trace (long prompts, shared prefixes) at 3 req/s;
* ``scale-64``: 64 TP4 H100 replicas of Qwen2-72B (256 GPUs), ``mix:chat=1`` at 130 req/s.

Prints P50/P95/P99 TTFT, P95 TPOT, P99 E2E and throughput per policy, and the default's
P99 TTFT ratio to round robin and least request in each scenario.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiloserve.launch.config import ClusterConfig, load_cluster_config
from kiloserve.plan.pareto import deployment_cluster
from kiloserve.sim import simulate
from kiloserve.workload import Workload, load_workload

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from routing_quality import WORKLOAD, llama_only  # noqa: E402

POLICIES = ("round_robin", "least_request", "prefix_affinity", "default")


def scenarios(quick: bool) -> dict[str, tuple[Callable[[], ClusterConfig], Callable[[], Workload]]]:
    twin = lambda: llama_only(load_cluster_config(REPO / "examples" / "cluster.yaml"))  # noqa: E731
    out: dict[str, tuple[Callable[[], ClusterConfig], Callable[[], Workload]]] = {
        "twin-mix@12": (twin, lambda: load_workload(WORKLOAD, seed=11, duration_s=60, rate=12,
                                                    with_prompts=False)),
        "twin-mix@18": (twin, lambda: load_workload(WORKLOAD, seed=11, duration_s=60, rate=18,
                                                    with_prompts=False)),
        "twin-azure@15": (twin, lambda: load_workload("azure-conv", seed=11, num_requests=1000,
                                                      rate=15, with_prompts=False)),
        "twin-mooncake@3": (twin, lambda: load_workload("mooncake", seed=11, num_requests=600,
                                                        rate=3, with_prompts=False)),
    }  # fmt: skip
    if not quick:
        out["scale-64xTP4@130"] = (
            lambda: deployment_cluster("H100", "qwen2-72b", 4, "bf16", 64),
            lambda: load_workload("mix:chat=1", seed=11, duration_s=40, rate=130,
                                  with_prompts=False),
        )  # fmt: skip
    return out


def row(name: str, s: dict[str, Any]) -> str:
    t, e, tpot = s["ttft_ms"], s["e2e_ms"], s["tpot_ms"]["p95"]
    return (f"{name:>16} {t['p50']:8.0f} {t['p95']:8.0f} {t['p99']:8.0f} "
            f"{tpot:9.1f} {e['p99']:9.0f} {s['request_throughput']:7.2f}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="skip the 256-GPU scenario")
    args = p.parse_args()
    for scenario, (make_cluster, make_workload) in scenarios(args.quick).items():
        print(f"\n## {scenario}")
        print(f"{'policy':>16} {'TTFT p50':>8} {'p95':>8} {'p99':>8} {'TPOT p95':>9} "
              f"{'E2E p99':>9} {'req/s':>7}")  # fmt: skip
        p99: dict[str, float] = {}
        for policy in POLICIES:
            summary = simulate(make_cluster(), make_workload(), policy, seed=11).summary
            p99[policy] = float(summary["ttft_ms"]["p99"])
            print(row(policy, summary), flush=True)
        d = p99["default"]
        print(f"default P99 TTFT / round_robin = {d / p99['round_robin']:.2f} (target <= 0.5); "
              f"/ least_request = {d / p99['least_request']:.2f} (target <= 0.8)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
