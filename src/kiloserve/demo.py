"""``make demo``: the example cluster, a few streamed requests, then a policy comparison.

1. Starts ``examples/cluster.yaml`` (engine twins + gateway), prints the backends and
   streams a handful of requests through the gateway, showing TTFT / TPOT per backend.
2. Runs ``kiloserve compare`` (short) on the same cluster: round robin, least request and
   the default policy under a mixed chat + long-document workload with shared prefixes,
   and prints the side-by-side table.
3. Ends with where to look next (``next_steps``): the report, the live dashboard (a
   command that starts the cluster for it: the demo's own clusters are gone by then)
   and one command to try.

Environment knobs: ``KILOSERVE_DEMO_REQUESTS`` (default 150), ``KILOSERVE_DEMO_RATE``
(requests/s, default 6), ``KILOSERVE_DEMO_OUT`` (default ``runs/demo``).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kiloserve.bench.client import ClientOptions, run_bench
from kiloserve.bench.compare import compare_policies, default_model
from kiloserve.launch.cli import backend_table
from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import ClusterConfig, load_cluster_config
from kiloserve.results.metrics import parse_slo, summarize
from kiloserve.workload import OpenLoop, Workload, load_workload

__all__ = ["main", "next_steps"]

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = "mix:chat=0.7,longdoc=0.1,short=0.2"
POLICIES = ("round_robin", "least_request", "default")
TRY_COMMAND = (
    "kiloserve sim -c examples/cluster-1024.yaml --workload azure-conv --num-requests 5000 "
    "--policy round_robin --policy default --out runs/sim"
)


def _workload(num_requests: int, rate: float) -> Workload:
    return load_workload(WORKLOAD, seed=7, num_requests=num_requests, rate=rate)


def _smoke(console: Console, cluster_path: Path) -> None:
    cfg = load_cluster_config(cluster_path)
    with LocalCluster(cfg, gateway=True, gateway_port=0) as cluster:
        console.print(backend_table(cluster))
        console.print(f"gateway {cluster.gateway_url}: streaming 12 requests ...")
        workload = load_workload("synthetic:input=fixed(300),output=fixed(40)", seed=1,
                                 num_requests=12, rate=8.0)  # fmt: skip
        result = asyncio.run(
            run_bench(str(cluster.gateway_url), default_model(cfg), workload, OpenLoop(None),
                      options=ClientOptions(timeout_s=60))
        )  # fmt: skip
    table = Table(title="streamed through the gateway")
    for col in ("request", "backend", "TTFT ms", "TPOT ms", "tokens"):
        table.add_column(col)
    for rec in result.records:
        ttft_ms = (rec.ttft_s or 0.0) * 1000
        tpot_ms = (rec.tpot_s or 0.0) * 1000
        table.add_row(rec.request_id, rec.backend or "-", f"{ttft_ms:.1f}", f"{tpot_ms:.1f}",
                      str(rec.output_tokens))  # fmt: skip
    console.print(table)
    ok = summarize(result)["requests_ok"]
    console.print(f"{ok}/{len(result.records)} requests ok")


def main() -> int:
    console = Console(width=max(120, Console().width))
    cluster_path = REPO / "examples" / "cluster.yaml"
    num_requests = int(os.environ.get("KILOSERVE_DEMO_REQUESTS", "150"))
    rate = float(os.environ.get("KILOSERVE_DEMO_RATE", "6"))
    out_dir = Path(os.environ.get("KILOSERVE_DEMO_OUT", REPO / "runs" / "demo"))
    _smoke(console, cluster_path)
    cfg = load_cluster_config(cluster_path)
    console.rule("policy comparison")
    console.print(f"workload {WORKLOAD}, {num_requests} requests at {rate:g}/s, per policy")
    runs = compare_policies(
        cfg, POLICIES, lambda: _workload(num_requests, rate), OpenLoop(None),
        model=default_model(cfg), out_dir=out_dir, slo=parse_slo("ttft=1s,tpot=50ms"),
        seed=7,
        command=["make", "demo"],
        on_policy=lambda p: console.print(f"policy [bold]{p}[/]: fresh cluster ..."),
    )  # fmt: skip
    print((out_dir / "comparison.md").read_text())
    for line in next_steps(out_dir, cfg, cluster_path):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    return 0 if all(r.summary["requests_ok"] for r in runs) else 1


def next_steps(out_dir: Path, cfg: ClusterConfig, cluster_path: Path) -> list[str]:
    """The demo's last lines: the report, the dashboard, one command to try."""
    host, port = cfg.gateway.host, cfg.gateway.port
    url = f"http://{host}:{port}/dashboard" if port else "the dashboard URL it prints"
    return [
        "where to look next:",
        f"  report:    {_shown(out_dir / 'comparison.md')} "
        f"(per policy: {_shown(out_dir)}/<policy>/summary.md and plots)",
        f"  dashboard: kiloserve up -c {_shown(cluster_path)} --open  (then {url})",
        f"  try:       {TRY_COMMAND}",
    ]


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when under it (what a user types)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
