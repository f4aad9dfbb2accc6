"""``kiloserve chaos -c cluster.yaml --scenario NAME [--scenario ...] --out DIR``.

Starts a local twin cluster with the gateway, drives steady streaming load, injects
each scenario's fault and writes ``DIR/report.json`` (see docs/chaos.md). ``--scenario
all`` runs every scenario.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import orjson

from kiloserve.chaos.drill import run_drills
from kiloserve.chaos.scenarios import SCENARIOS, DrillOptions
from kiloserve.launch.config import load_cluster_config

__all__ = ["add_arguments", "options_from_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", required=True, help="cluster YAML (kiloserve up)")
    parser.add_argument(
        "--scenario", action="append", required=True,
        choices=[*SCENARIOS, "all"], help="scenario to run (repeatable, or 'all')",
    )  # fmt: skip
    parser.add_argument("--out", required=True, help="output folder for report.json")
    parser.add_argument("--concurrency", type=int, default=8, help="streams in flight")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (max)")
    parser.add_argument("--before", type=float, default=5.0, help="seconds of load before")
    parser.add_argument("--fault", type=float, default=30.0, help="seconds the fault lasts")
    parser.add_argument("--after", type=float, default=10.0, help="seconds of load after")
    parser.add_argument("--flap-period", type=float, default=2.0, help="flap half-period (s)")
    parser.add_argument("--victim", type=int, default=0, help="index of the faulty backend")
    parser.add_argument("--seed", type=int, default=0)


def options_from_args(args: argparse.Namespace) -> DrillOptions:
    return DrillOptions(
        concurrency=args.concurrency, max_tokens=args.max_tokens, before_s=args.before,
        fault_s=args.fault, after_s=args.after, flap_period_s=args.flap_period,
        victim=args.victim, seed=args.seed,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    names = list(SCENARIOS) if "all" in args.scenario else list(dict.fromkeys(args.scenario))
    cfg = load_cluster_config(args.config)
    report = asyncio.run(run_drills(cfg, names, options_from_args(args), Path(args.out)))
    for name, row in report.items():
        keys = (
            "sent", "failed", "failed_not_started", "streams_cut", "user_visible_failures",
            "detect_s", "recover_s",
        )  # fmt: skip
        print(
            name,
            orjson.dumps({k: row[k] for k in keys} | {"ttft_p95_ms": row["ttft_p95_ms"]}).decode(),
        )
    print(f"report: {Path(args.out) / 'report.json'}")
    return 0
