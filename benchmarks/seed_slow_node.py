"""Seed 002 headline: slow-node removal (rolling TPOT > 300 ms -> weight 20%), in the simulator.

    .venv/bin/python benchmarks/seed_slow_node.py            # ~8 min on the shared 2-core box
    .venv/bin/python benchmarks/seed_slow_node.py --quick    # 5x only, least_request + default

Seed 002: in a batch of 100 replicas one node with 5x the others' TPOT holds requests up
while the gateway keeps sending to it; the fix is to cut its weight to 20% when its
rolling TPOT passes a threshold (300 ms). Setup: 100 replicas of Qwen2-72B bf16, TP4 on
H100 (400 GPUs), ``mix:chat=1`` at 201.6 req/s (the planner's 2.52 req/s per replica /
1.25 headroom x 100), 120 s of Poisson arrivals; at t = 20 s replica ``q-7`` is slowed
5x (the seed's case) or 10x. The gateway's own ``SlowNodeDemoter`` runs in the simulator
(``sim/demotion.py``); each row runs with demotion on and off (``demotion: {enabled:
false}``). Figures over the requests that started at t >= 30 s; per-request TPOT is
``(e2e - ttft) / (output_tokens - 1)``. The same rows with the CLI::

    kiloserve sim -c C.yaml --workload mix:chat=1 --rate 201.6 --duration 120 \\
        --policy least_request --policy default --records --no-plots \\
        --fault t=20,backend=q-7,kind=slow,factor=5 --out OUT
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kiloserve.launch.config import ClusterConfig, parse_cluster_config
from kiloserve.results.records import RequestRecord
from kiloserve.sim import simulate
from kiloserve.sim.faults import FaultEvent
from kiloserve.workload import load_workload

WORKLOAD, RATE, DURATION_S, SLOW_BACKEND, FAULT_AT_S, MEASURE_FROM_S = (
    "mix:chat=1", 201.6, 120.0, "q-7", 20.0, 30.0,
)  # fmt: skip
POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "least_request": ("least_request", {}),
    "default": ("default", {}),
    "static WRR": ("weighted_round_robin", {"weights": "static"}),
}


def cluster(demotion: bool) -> ClusterConfig:
    gateway: dict[str, Any] = {"policy": "default"}
    if not demotion:
        gateway["options"] = {"demotion": {"enabled": False}}
    backends = [{"name": "q", "gpu": "H100", "model": "qwen2-72b", "tp": 4, "count": 100}]
    data = {"name": "qwen72b-100x4", "gateway": gateway, "backends": backends}
    return parse_cluster_config(data, "qwen72b-100x4")


def _pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(p / 100 * len(values)))] if values else float("nan")


def row(policy: str, factor: float | None, demotion: bool) -> dict[str, Any]:
    name, params = POLICIES[policy]
    workload = load_workload(WORKLOAD, seed=0, duration_s=DURATION_S, rate=RATE, with_prompts=False)
    faults = () if factor is None else (FaultEvent(FAULT_AT_S, SLOW_BACKEND, "slow", factor),)
    result = simulate(
        cluster(demotion), workload, name, policy_params=params, faults=faults,
        keep_records=True,
    )  # fmt: skip
    late = [r for r in result.records if r.start_s >= MEASURE_FROM_S]
    slow = [r for r in late if r.backend == SLOW_BACKEND]
    tpot = sorted(_tpot_ms(late))
    return {
        "share": len(slow) / max(1, len(late)),
        "slow_p50": _pct(sorted(_tpot_ms(slow)), 50),
        "p99": _pct(tpot, 99),
        "p999": _pct(tpot, 99.9),
        "over_100": sum(1 for v in tpot if v > 100.0),
        "demotions": sum((result.summary["demotions"].get("by_backend") or {}).values()),
    }


def _tpot_ms(records: list[RequestRecord]) -> list[float]:
    return [1000.0 * t for r in records if (t := r.tpot_s) is not None]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="5x only; least_request and default")
    args = p.parse_args()
    policies = ["least_request", "default"] if args.quick else list(POLICIES)
    print("| policy | slow node | demotion | q-7 share | q-7 median TPOT | P99 TPOT | "
          "P99.9 TPOT | TPOT > 100 ms | demotions |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for policy in policies:
        cases: list[tuple[float | None, bool]] = [(None, True)] if policy != "static WRR" else []
        factors = [5.0] if args.quick or policy == "static WRR" else [5.0, 10.0]
        cases += [(f, d) for f in factors for d in (False, True)]
        for factor, demotion in cases:
            r = row(policy, factor, demotion)
            slow = "none" if factor is None else f"{factor:g}x"
            print(f"| {policy} | {slow} | {'on' if demotion else 'off'} | {r['share']:.2%} | "
                  f"{r['slow_p50']:.0f} ms | {r['p99']:.1f} | {r['p999']:.1f} | "
                  f"{r['over_100']} | {r['demotions']} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
