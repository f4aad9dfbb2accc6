"""``kiloserve up -c FILE [--no-gateway]``: run a local cluster until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import webbrowser
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.table import Table

from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import load_cluster_config
from kiloserve.launch.process import tail

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", required=True, help="cluster YAML (see examples/cluster.yaml)")
    p.add_argument("--no-gateway", action="store_true", help="start the engines only")
    p.add_argument("--policy", help="gateway routing policy (overrides the YAML)")
    p.add_argument("--port", type=int, help="gateway port (overrides the YAML; 0 = any free)")
    p.add_argument("--open", action="store_true", help="open the gateway dashboard in a browser")
    p.add_argument("--run-dir", type=Path, help="folder for process logs (default: a temp dir)")
    p.add_argument(
        "--duration", type=float, help="stop by itself after this many seconds (default: Ctrl-C)"
    )


def backend_table(cluster: LocalCluster) -> Table:
    """The backends ``kiloserve up`` started; a ``role`` column when the cluster has
    prefill/decode pools (a cluster of ``both`` engines prints as before)."""
    table = Table(title=f"kiloserve cluster '{cluster.cfg.name}'")
    with_role = any(b.role != "both" for b in cluster.backends)
    cols = ["name", "url", "gpu", "model", "tp", "quant", "KV capacity (tokens)", "group"]
    if with_role:
        cols.append("role")
    for col in cols:
        table.add_column(col, justify="right" if col in ("tp", "KV capacity (tokens)") else "left")
    for b in cluster.backends:
        row = [b.name, b.url, b.gpu, b.model, str(b.tp), b.quant, f"{b.kv_capacity_tokens:,}"]
        row.append(b.group)
        table.add_row(*row, *([b.role] if with_role else []))
    return table


def _install_stop_handler(stop: threading.Event) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(120, Console().width))
    cfg = load_cluster_config(args.config)
    stop = threading.Event()
    _install_stop_handler(stop)
    cluster = LocalCluster(
        cfg,
        gateway=False if args.no_gateway else None,
        policy=args.policy,
        gateway_port=args.port,
        run_dir=args.run_dir,
    )
    with cluster:
        console.print(backend_table(cluster))
        if cluster.gateway_url:
            console.print(f"gateway: [bold]{cluster.gateway_url}[/] (policy {cluster.policy})")
            console.print(f"dashboard: [bold]{cluster.gateway_url}/dashboard[/]")
            if args.open:
                webbrowser.open(f"{cluster.gateway_url}/dashboard")
        console.print(f"logs: {cluster.run_dir}   press Ctrl-C to stop")
        sys.stdout.flush()
        return _watch(cluster, stop, args.duration, console)


def _watch(
    cluster: LocalCluster, stop: threading.Event, duration_s: float | None, console: Console
) -> int:
    """Report every crashed process as it happens; return 1 if any crashed."""
    num_crashed = 0
    waited_s = 0.0
    while not stop.wait(0.5):
        waited_s += 0.5
        for name, code in cluster.crashed():
            num_crashed += 1
            console.print(f"[bold red]{name} exited with status {code}[/]; last log lines:")
            console.print(tail(cluster.log_path(name)), markup=False)
            sys.stdout.flush()
        if duration_s is not None and waited_s >= duration_s:
            break
    console.print("stopping cluster ...")
    return 1 if num_crashed else 0
