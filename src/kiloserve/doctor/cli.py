"""``kiloserve doctor --gateway URL [--admin-token T] [--json]``.

Reads the gateway (``/admin/backends``, ``/admin/config``, ``/metrics``), then each
backend's engine (TCP connect, ``/health`` round trip, ``/metrics`` twice, a window
apart), and prints the probable causes ranked most probable first (docs/doctor.md).
Exit code: 0 when nothing is found, 1 when there are findings, 2 when the gateway
cannot be read.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

import orjson

from kiloserve.doctor.diagnose import BackendFacts, Finding, diagnose

__all__ = ["add_arguments", "render_json", "render_table", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway", required=True, help="gateway base URL, http://host:port")
    parser.add_argument(
        "--admin-token", default=os.environ.get("KILOSERVE_ADMIN_TOKEN"),
        help="bearer token for /admin (default $KILOSERVE_ADMIN_TOKEN)",
    )  # fmt: skip
    parser.add_argument("--metrics-token", help="bearer token for /metrics (default: admin's)")
    parser.add_argument("--window", type=float, default=1.0, help="seconds between metric reads")
    parser.add_argument("--timeout", type=float, default=2.0, help="timeout of one probe (s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _backend_row(b: BackendFacts) -> dict[str, Any]:
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 2)

    return {
        "name": b.name, "model": b.model, "url": b.url, "healthy": b.healthy,
        "routable": b.routable, "draining": b.draining, "ejected": b.ejected,
        "demoted": b.demoted, "unhealthy_reasons": list(b.unhealthy_reasons),
        "connect_ok": b.connect_ok, "health_ok": b.health_ok, "rtt_ms": r(b.rtt_ms),
        "metrics_ok": b.metrics_ok, "running": b.running, "waiting": b.waiting,
        "kv_usage": r(b.kv_usage), "engine_itl_ms": r(b.engine_itl_ms),
        "engine_ttft_ms": r(b.engine_ttft_ms), "ewma_ttft_ms": r(b.ewma_ttft_ms),
        "ewma_tpot_ms": r(b.ewma_tpot_ms), "in_flight": b.in_flight,
        "attempts": b.attempts, "errors_5xx": b.errors, "preemptions": b.preemptions_delta,
    }  # fmt: skip


def render_json(
    findings: list[Finding], gateway: dict[str, Any], backends: tuple[BackendFacts, ...]
) -> str:
    doc = {
        "findings": [f.as_dict() for f in findings],
        "gateway": gateway,
        "backends": [_backend_row(b) for b in backends],
    }
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()


def render_table(
    findings: list[Finding], gateway: dict[str, Any], backends: tuple[BackendFacts, ...]
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    rtt = gateway.get("rtt_ms")
    console.print(
        f"gateway {gateway.get('url')}: round trip {rtt if rtt is not None else '-'} ms, "
        f"policy {gateway.get('policy')}, {len(backends)} backends"
    )
    state = Table(title="backends", title_justify="left")
    for col in ("backend", "model", "gw", "rtt ms", "run", "wait", "kv", "itl ms", "5xx"):
        state.add_column(col)

    def fmt(x: float | None, spec: str = "g") -> str:
        return "-" if x is None else format(x, spec)

    for b in backends:
        gw = "ok" if b.healthy and b.routable else ("drain" if b.draining else "down")
        if b.ejected:
            gw = "ejected"
        state.add_row(
            b.name, b.model, gw, fmt(b.rtt_ms, ".1f"), fmt(b.running), fmt(b.waiting),
            fmt(b.kv_usage, ".2f"), fmt(b.engine_itl_ms, ".1f"), f"{b.errors:g}/{b.attempts:g}",
        )  # fmt: skip
    console.print(state)
    if not findings:
        console.print("no probable cause found: the gateway and every backend look healthy")
        return
    table = Table(title="findings (most probable first)", title_justify="left", show_lines=True)
    for col in ("#", "cause", "backend", "score", "evidence", "what to do"):
        table.add_column(col, overflow="fold")
    for rank, f in enumerate(findings, 1):
        table.add_row(str(rank), f.cause, f.backend, f"{f.score:.2f}", f.evidence, f.advice)
    console.print(table)


def run(args: argparse.Namespace) -> int:
    from kiloserve.doctor.probe import collect

    got = asyncio.run(
        collect(
            args.gateway,
            admin_token=args.admin_token,
            metrics_token=args.metrics_token,
            window_s=args.window,
            timeout_s=args.timeout,
        )
    )
    findings = diagnose(got.snapshot)
    if args.json:
        sys.stdout.write(render_json(findings, got.gateway, got.snapshot.backends) + "\n")
    else:
        render_table(findings, got.gateway, got.snapshot.backends)
    return 1 if findings else 0
