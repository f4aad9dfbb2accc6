"""``kiloserve compare``: the same requests through the gateway under several policies.

For each policy a fresh local twin cluster and gateway are started (so no policy
inherits another's warm prefix caches), the identical request sequence (same workload,
seed and arrival times) is sent through the gateway, and one report per policy is
written to ``DIR/<policy>/``; ``DIR/comparison.md`` shows them side by side with ratios
against the first policy.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from kiloserve.bench.client import DEFAULT_TIMEOUT_S, ENDPOINTS, ClientOptions, run_bench
from kiloserve.errors import ConfigError
from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import ClusterConfig, load_cluster_config
from kiloserve.results.metrics import Slo, parse_slo, summarize
from kiloserve.results.records import RequestRecord
from kiloserve.results.report import write_comparison, write_report
from kiloserve.workload import ArrivalMode, ClosedLoop, OpenLoop, Workload, load_workload

__all__ = ["CompareRun", "add_arguments", "compare_policies", "default_model", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("-c", "--config", required=True, help="cluster YAML (examples/cluster.yaml)")
    a("--policies", default="round_robin,least_request,default",
      help="comma-separated registry names; the first is the baseline of the ratios")  # fmt: skip
    a("--workload", required=True, help="workload spec (see docs/workloads.md)")
    a("--model", help="model to send to (default: the model with the most backends)")
    a("--rate", type=float, help="requests/s, open loop")
    a("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps")
    a("--concurrency", type=int, help="closed loop: keep C requests in flight")
    a("--duration", type=float, help="seconds of arrivals")
    a("--num-requests", type=int, help="number of requests")
    a("--seed", type=int, default=0, help="workload and gateway seed")
    a("--slo", help="goodput SLOs, e.g. ttft=500ms,tpot=50ms")
    a("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    a("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
      help=f"per-request timeout in s (default {DEFAULT_TIMEOUT_S:g}); a timed-out request "
           "counts as failed and enters the TTFT/E2E percentiles at its wait")  # fmt: skip
    a("--traces-dir", type=Path, help="folder of the shipped traces (default: the packaged ones)")
    a("--out", required=True, type=Path, help="report folder")
    a("--no-plots", action="store_true", help="skip PNG plots")


@dataclass
class CompareRun:
    """One policy's outcome."""

    policy: str
    summary: dict[str, Any]
    records: list[RequestRecord]
    out_dir: Path


def default_model(cfg: ClusterConfig) -> str:
    """The served model with the most backends (ties: first in the file)."""
    from kiloserve.catalog import get_model

    counts: Counter[str] = Counter()
    for item in cfg.expanded():
        counts[item.spec.served_model_name or get_model(item.spec.model).name] += 1
    return counts.most_common(1)[0][0]


def compare_policies(
    cfg: ClusterConfig,
    policies: Sequence[str],
    make_workload: Callable[[], Workload],
    arrival: ArrivalMode,
    *,
    model: str,
    out_dir: Path,
    slo: Slo | None = None,
    options: ClientOptions | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    command: Sequence[str] | None = None,
    plot: bool = True,
    on_policy: Callable[[str], None] | None = None,
) -> list[CompareRun]:
    """Run the workload once per policy on a fresh cluster; write every report."""
    runs: list[CompareRun] = []
    for policy in policies:
        if on_policy is not None:
            on_policy(policy)
        cluster = LocalCluster(
            cfg,
            gateway=True,
            policy=policy,
            gateway_port=0,
            run_dir=out_dir / policy / "logs",
            gateway_options={"seed": seed},
        )
        with cluster:
            url = cluster.gateway_url
            if url is None:
                raise ConfigError("compare needs the gateway")
            result = asyncio.run(
                run_bench(url, model, make_workload(), arrival, options=options,
                          duration_s=duration_s)
            )  # fmt: skip
        summary = summarize(result, slo, command=command)
        summary["policy"] = policy
        write_report(out_dir / policy, result, summary, plot=plot)
        runs.append(CompareRun(policy, summary, list(result.records), out_dir / policy))
    write_comparison(
        out_dir,
        {r.policy: r.summary for r in runs},
        records={r.policy: r.records for r in runs},
        title=f"{cfg.name}: " + " vs ".join(policies),
        plot=plot,
    )
    return runs


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    cfg = load_cluster_config(args.config)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError("--policies needs at least one policy name")
    _check_policies(policies)
    model = args.model or default_model(cfg)
    if args.rate is not None and args.concurrency is not None:
        raise ConfigError("give either --rate or --concurrency, not both")
    if args.num_requests is None and args.duration is None:
        raise ConfigError("give --num-requests N or --duration S")

    def make_workload() -> Workload:
        return load_workload(
            args.workload, seed=args.seed, num_requests=args.num_requests,
            duration_s=args.duration, rate=args.rate, burstiness=args.burstiness,
            traces_dir=args.traces_dir,
        )  # fmt: skip

    arrival: ArrivalMode = (
        ClosedLoop(args.concurrency) if args.concurrency is not None else OpenLoop(None)
    )
    runs = compare_policies(
        cfg, policies, make_workload, arrival, model=model, out_dir=args.out,
        slo=parse_slo(args.slo) if args.slo else None,
        options=ClientOptions(endpoint=args.endpoint, timeout_s=args.timeout),
        duration_s=args.duration if args.concurrency is not None else None,
        seed=args.seed, command=["kiloserve", *sys.argv[1:]], plot=not args.no_plots,
        on_policy=lambda p: console.print(f"policy [bold]{p}[/]: starting a fresh cluster"),
    )  # fmt: skip
    print((args.out / "comparison.md").read_text())
    console.print(f"report: {args.out / 'comparison.md'}")
    return 0 if all(r.summary["requests_ok"] for r in runs) else 1


def _check_policies(policies: Sequence[str]) -> None:
    from kiloserve.policies.registry import available_policies

    known = set(available_policies())
    unknown = [p for p in policies if p not in known]
    if unknown:
        valid = ", ".join(sorted(known))
        raise ConfigError(f"unknown policies {', '.join(unknown)} (valid: {valid})")
