"""Routing quality on the twin cluster: default policy vs round robin vs least request.

    .venv/bin/python benchmarks/routing_quality.py [--num-requests 300] [--rate 9]

Two experiments, every policy on a fresh cluster with the identical request sequence:

1. ``examples/cluster.yaml`` (Llama pool: 2 x H100, 2 x A100, 1 x L40S) under a mixed
   workload (chat + long documents + short prompts, with shared prefixes).
   Targets (issue #3): P99 TTFT <= 0.5x round robin and <= 0.8x least_request.
2. The same cluster with one H100 made 4x slower (twin fault ``slowdown: 4``), against
   the same cluster without that backend. Target: the default policy's P99 E2E on the
   slow-backend cluster within 1.5x of the cluster without it.

Prints each figure with its ratio and met / NOT met; reports under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kiloserve.bench.client import ClientOptions  # noqa: E402
from kiloserve.bench.compare import compare_policies  # noqa: E402
from kiloserve.launch.config import ClusterConfig, load_cluster_config  # noqa: E402
from kiloserve.workload import OpenLoop, load_workload  # noqa: E402

MODEL = "Llama-3.1-8B"
WORKLOAD = "mix:chat=0.6,longdoc=0.1,short=0.3"


def llama_only(
    cfg: ClusterConfig, slow: str | None = None, drop: str | None = None
) -> ClusterConfig:
    """The Llama pool of ``cfg``; ``slow`` gets a 4x slowdown, ``drop`` is left out."""
    data: dict[str, Any] = cfg.model_dump(mode="json", exclude_none=True)
    backends = []
    for b in data["backends"]:
        if b["model"] != "llama-3.1-8b":
            continue
        items = [b] if b.get("count", 1) == 1 else _split(b)
        for item in items:
            if item["name"] == drop:
                continue
            if item["name"] == slow:
                item["faults"] = {"slowdown": 4.0}
            backends.append(item)
    data["backends"] = backends
    return ClusterConfig.model_validate(data)


def _split(b: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**b, "name": f"{b['name']}-{i}", "count": 1} for i in range(b["count"])]


def _p(summary: dict[str, Any], key: str, stat: str) -> float:
    return float(summary[key][stat])


def _verdict(ratio: float, target: float) -> str:
    return "met" if ratio <= target else "NOT met"


def run(args: argparse.Namespace) -> int:
    base = load_cluster_config(REPO / "examples" / "cluster.yaml")
    options = ClientOptions(timeout_s=300)

    def workload() -> Any:
        return load_workload(WORKLOAD, seed=args.seed, num_requests=args.num_requests,
                             rate=args.rate)  # fmt: skip

    def go(cfg: ClusterConfig, policies: list[str], name: str) -> dict[str, dict[str, Any]]:
        runs = compare_policies(
            cfg, policies, workload, OpenLoop(None), model=MODEL, out_dir=args.out / name,
            options=options, seed=args.seed, plot=not args.no_plots,
            on_policy=lambda p: print(f"[{name}] {p} ...", flush=True),
        )  # fmt: skip
        return {r.policy: r.summary for r in runs}

    mixed = go(llama_only(base), ["round_robin", "least_request", "default"], "mixed")
    print((args.out / "mixed" / "comparison.md").read_text())
    d, rr, lr = mixed["default"], mixed["round_robin"], mixed["least_request"]
    r1 = _p(d, "ttft_ms", "p99") / _p(rr, "ttft_ms", "p99")
    r2 = _p(d, "ttft_ms", "p99") / _p(lr, "ttft_ms", "p99")
    slow = go(llama_only(base, slow="h100-llama-1"), ["default"], "slow-backend")
    ref = go(llama_only(base, drop="h100-llama-1"), ["default"], "without-slow-backend")
    r3 = _p(slow["default"], "e2e_ms", "p99") / _p(ref["default"], "e2e_ms", "p99")
    print("\n## Targets (issue #3)")
    print(f"P99 TTFT default / round_robin   = {r1:.2f}  (target <= 0.50: {_verdict(r1, 0.5)})")
    print(f"P99 TTFT default / least_request = {r2:.2f}  (target <= 0.80: {_verdict(r2, 0.8)})")
    print(f"P99 E2E slow-backend / without   = {r3:.2f}  (target <= 1.50: {_verdict(r3, 1.5)})")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=9.0, help="requests/s")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "routing-quality")
    p.add_argument("--no-plots", action="store_true")
    return run(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
