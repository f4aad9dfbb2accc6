"""``kiloserve plan``: memory ledgers, per-replica capacity, replicas and cost.

Example::

    kiloserve plan --model qwen2-72b --gpu H100 --gpu A100 --rate 300 \\
        --workload mix:chat=1 --slo ttft_p95=800ms,tpot_p95=50ms --out plan-out

Prints the memory ledger of every GPU x TP x quantisation and the deployments that
meet the SLO sorted by cost, and writes ``OUT/plan.json``. See docs/planner.md.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from kiloserve.catalog import get_gpu, get_model, list_gpus, normalize_name
from kiloserve.errors import ConfigError
from kiloserve.plan import disagg
from kiloserve.plan.capacity import (
    DEFAULT_MAX_NUM_PROBES,
    CapacityResult,
    PercentileSlo,
    capacity_from_sweep,
    initial_rate_guess,
    parse_percentile_slo,
    search_capacity,
)
from kiloserve.plan.pareto import DEFAULT_MIN_PROBE_S, deployment_cluster, replica_probe
from kiloserve.plan.planner import (
    DEFAULT_HEADROOM,
    DEFAULT_KV_REDUNDANCY,
    TP_DEGREES,
    Candidate,
    Deployment,
    deployment_table,
    enumerate_candidates,
    ledger_table,
    parse_prices,
    plan_deployment,
    price_for,
    print_reasons,
    rank_deployments,
)
from kiloserve.policies import available_policies
from kiloserve.results.report import write_json
from kiloserve.sim.sweep import add_sweep_arguments, run_all
from kiloserve.workload import load_workload

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)
DEFAULT_NUM_REQUESTS = 300
SCHEMA_VERSION = 1
WIDE_COLUMNS = 160  # tables written to a file or pipe are not truncated to 80
PARETO_LOADS = ("scaled", "target")
NOT_IN_COMMAND = ("log_level", "func", "jobs", "ray")  # where it ran does not change a plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", required=True, help="model name from the catalog, e.g. qwen2-72b")
    a("--gpu", action="append", default=[], help="GPU type (repeatable; default: all)")
    a("--rate", type=float, required=True, help="target load in requests/s")
    a("--workload", required=True, help="workload spec, as for kiloserve bench")
    a("--slo", required=True, help="percentile SLO, e.g. ttft_p95=800ms,tpot_p95=50ms")
    a("--quant", action="append", default=[], help="quantisation (repeatable; default bf16)")
    a("--tp", type=int, action="append", default=[], help="TP degree (repeatable; 1,2,4,8)")
    a("--price", help="dollars per GPU-hour, e.g. H100=2.5,A100=1.8 (default: catalog)")
    a("--headroom", type=float, default=DEFAULT_HEADROOM, help="replica headroom (1.25)")
    a("--kv-redundancy", type=float, default=DEFAULT_KV_REDUNDANCY, help="KV check (0.25)")
    a("--sweep-file", help="per-replica capacity from a `kiloserve bench --sweep` sweep.json")
    a("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS, help="requests per probe")
    a("--probe-duration", type=float, default=DEFAULT_MIN_PROBE_S, help="min seconds per probe")
    a("--max-probes", type=int, default=DEFAULT_MAX_NUM_PROBES, help="rate probes per candidate")
    a("--max-model-len", type=int, help="context length (default: the model's)")
    a("--seed", type=int, default=0, help="workload seed (0)")
    a("--verify", action="store_true", help="simulate the recommended cluster at --rate")
    a("--pareto", action="store_true", help="cost vs P95 across cluster sizes (with a plot)")
    a("--pareto-sizes", help="GPU counts for --pareto, e.g. 128,256,512,1024")
    a("--pareto-load", choices=PARETO_LOADS, default="scaled", help="see docs/planner.md")
    a("--stages", action="store_true", help="the five growth stages (1 -> 1,024 cards)")
    a("--policy", default="default", help="routing policy for --verify / --pareto (default)")
    a("--sim-duration", type=float, default=60.0, help="seconds of arrivals per cluster run")
    a("--out", default="plan-out", help="output folder for plan.json (plan-out)")
    disagg.add_arguments(parser)
    add_sweep_arguments(parser)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    console = Console(width=None if sys.stdout.isatty() else WIDE_COLUMNS)
    model = get_model(args.model)
    gpus = list({g.name: g for g in map(get_gpu, args.gpu)}.values()) if args.gpu else list_gpus()
    prices = _prices(args.price)
    slo = parse_percentile_slo(args.slo)
    quants = list(dict.fromkeys(normalize_name(q) for q in args.quant or ["bf16"]))
    tps = sorted(set(args.tp or TP_DEGREES))
    candidates = enumerate_candidates(model, gpus, quants, tps, args.max_model_len)
    mean_in, mean_out = _workload_means(args)
    capacities = _capacities(args, candidates, slo, mean_in, mean_out)
    deployments = _deployments(args, candidates, capacities, prices, mean_out)
    plan = _plan_dict(args, slo, candidates, deployments, capacities, mean_in, mean_out)
    console.print(ledger_table(candidates))
    print_reasons(console, candidates)
    console.print(deployment_table(deployments, args.rate, str(slo)))
    _print_capacity_notes(console, candidates, capacities)
    if deployments and (args.verify or args.pareto):
        plan |= _cluster_runs(args, deployments[0], slo, console)
    if args.disagg:
        from kiloserve.plan.disagg_report import run_disagg

        run_disagg(
            args, candidates, deployments, slo, mean_in, mean_out, console, command=_command(args)
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "plan.json", plan)
    console.print(f"plan: {out / 'plan.json'}")
    if args.stages:
        _stages(args, candidates, capacities, prices, slo, mean_out, console)
    return 0 if deployments else 1


def _stages(
    args: argparse.Namespace,
    candidates: Sequence[Candidate],
    capacities: dict[str, CapacityResult],
    prices: dict[str, float],
    slo: PercentileSlo,
    mean_out: float,
    console: Console,
) -> None:
    """``--stages``: simulate the five growth stages; print and write stages.md/.json."""
    from kiloserve.plan.stage_runs import run_stages, write_stages

    stages = run_stages(
        candidates, capacities, lambda c: price_for(c.gpu, prices), slo=slo,
        workload_spec=args.workload, mean_output_tokens=mean_out, headroom=args.headroom,
        seed=args.seed, duration_s=args.sim_duration, policy=args.policy,
        jobs=args.jobs, ray_address=args.ray,
    )  # fmt: skip
    header = {
        "command": _command(args), "model": get_model(args.model).name,
        "workload": args.workload, "slo": str(slo), "target_rps": args.rate,
        "headroom": args.headroom,
        "duration_s": args.sim_duration, "policy": args.policy, "seed": args.seed,
    }  # fmt: skip
    text = write_stages(Path(args.out), stages, header)
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    console.print(f"stages: {Path(args.out) / 'stages.md'}, {Path(args.out) / 'stages.json'}")


def _check_args(args: argparse.Namespace) -> None:
    if not args.rate > 0:
        raise ConfigError(f"--rate must be > 0 requests/s, got {args.rate}")
    if args.policy not in available_policies():
        raise ConfigError(f"unknown --policy {args.policy!r}; valid: {available_policies()}")
    if not args.probe_duration > 0:
        raise ConfigError(f"--probe-duration must be > 0 seconds, got {args.probe_duration}")
    if not args.sim_duration > 0:
        raise ConfigError(f"--sim-duration must be > 0 seconds, got {args.sim_duration}")
    if args.max_probes < 2:
        raise ConfigError(f"--max-probes must be >= 2, got {args.max_probes}")
    if args.num_requests < 10:
        raise ConfigError(f"--num-requests must be >= 10, got {args.num_requests}")
    bad_tp = [t for t in args.tp if t not in TP_DEGREES]
    if bad_tp:
        raise ConfigError(f"--tp must be one of {TP_DEGREES} (inside one node), got {bad_tp}")


def _prices(text: str | None) -> dict[str, float]:
    prices = parse_prices(text)
    for name in prices:
        get_gpu(name)  # an unknown GPU in --price is a typo: say so
    return prices


def _workload_means(args: argparse.Namespace) -> tuple[float, float]:
    """Mean input and output tokens of the requests one probe sends."""
    workload = load_workload(
        args.workload,
        seed=args.seed,
        num_requests=args.num_requests,
        rate=1.0,
        with_prompts=False,
    )
    specs = list(workload)
    if not specs:
        raise ConfigError(f"workload {args.workload!r} yields no requests")
    mean_in = sum(s.input_tokens for s in specs) / len(specs)
    mean_out = sum(s.output_tokens for s in specs) / len(specs)
    return mean_in, mean_out


def _capacities(
    args: argparse.Namespace,
    candidates: Sequence[Candidate],
    slo: PercentileSlo,
    mean_in: float,
    mean_out: float,
) -> dict[str, CapacityResult]:
    fitting = [c for c in candidates if c.is_fitting]
    if args.sweep_file:
        if len(fitting) != 1:
            names = ", ".join(c.name for c in fitting) or "none"
            raise ConfigError(
                "--sweep-file measures one deployment: narrow --gpu/--tp/--quant to exactly "
                f"one that fits (fitting now: {names})"
            )
        return {fitting[0].name: capacity_from_sweep(args.sweep_file, slo)}
    search = functools.partial(_search, args, slo, mean_in, mean_out)
    results = run_all(search, fitting, jobs=args.jobs, ray_address=args.ray, label="rate search")
    return {cand.name: result for cand, result in zip(fitting, results, strict=True)}


def _search(
    args: argparse.Namespace, slo: PercentileSlo, mean_in: float, mean_out: float, cand: Candidate
) -> CapacityResult:
    """One candidate's rate search (its probes depend on each other: one task)."""
    from kiloserve.engine.timing import StepTimeModel

    timer = StepTimeModel(cand.gpu, cand.model, cand.tp, cand.quant)
    cluster = deployment_cluster(
        cand.gpu.name, cand.model.name, cand.tp, cand.quant, 1, max_model_len=args.max_model_len
    )
    probe = replica_probe(
        cluster,
        args.workload,
        num_requests=args.num_requests,
        min_duration_s=args.probe_duration,
        seed=args.seed,
    )
    guess = initial_rate_guess(timer, mean_in, mean_out)
    result = search_capacity(probe, slo, guess, max_num_probes=args.max_probes)
    logger.info(
        "%s: %.3g req/s within the SLO (%d probes)", cand.name, result.rate_rps, len(result.points)
    )
    return result


def _deployments(
    args: argparse.Namespace,
    candidates: Sequence[Candidate],
    capacities: dict[str, CapacityResult],
    prices: dict[str, float],
    mean_out: float,
) -> list[Deployment]:
    out: list[Deployment] = []
    for cand in candidates:
        capacity = capacities.get(cand.name)
        if capacity is None:
            continue
        deployment = plan_deployment(
            cand,
            capacity,
            args.rate,
            mean_out,
            price_per_gpu_hour=price_for(cand.gpu, prices),
            headroom=args.headroom,
            kv_redundancy=args.kv_redundancy,
        )
        if deployment is not None:
            out.append(deployment)
    return rank_deployments(out)


def _print_capacity_notes(
    console: Console, candidates: Sequence[Candidate], capacities: dict[str, CapacityResult]
) -> None:
    for cand in candidates:
        cap = capacities.get(cand.name)
        if cap is None:
            continue
        if cap.rate_rps <= 0:
            why = "; ".join(cap.points[-1].violations) if cap.points else "no probes"
            console.print(f"{cand.name}: one replica misses the SLO at every probed rate ({why})")
        elif not cap.is_bracketed and cap.source == "simulated":
            console.print(f"{cand.name}: no failing rate found: capacity is a lower bound")


def _plan_dict(
    args: argparse.Namespace,
    slo: PercentileSlo,
    candidates: Sequence[Candidate],
    deployments: Sequence[Deployment],
    capacities: dict[str, CapacityResult],
    mean_in: float,
    mean_out: float,
) -> dict[str, Any]:
    ranked = [d.to_dict() | {"capacity": d.capacity.to_dict()} for d in deployments]
    return {
        "schema_version": SCHEMA_VERSION,
        "command": _command(args),
        "model": get_model(args.model).name,
        "target_rps": args.rate,
        "target_output_tokens_per_s": args.rate * mean_out,
        "workload": {
            "spec": args.workload,
            "seed": args.seed,
            "num_requests_per_probe": args.num_requests,
            "mean_input_tokens": mean_in,
            "mean_output_tokens": mean_out,
        },
        "slo": slo.to_dict(),
        "headroom": args.headroom,
        "kv_redundancy": args.kv_redundancy,
        "candidates": [c.ledger_dict() for c in candidates],
        "capacities": {name: cap.to_dict() for name, cap in capacities.items()},
        "deployments": ranked,
        "recommended": ranked[0] if ranked else None,
    }


def _command(args: argparse.Namespace) -> list[str]:
    """The command line that reproduces this plan (flags in a fixed order)."""
    out = ["kiloserve", "plan"]
    for key, value in sorted(vars(args).items()):
        flag = "--" + key.replace("_", "-")
        if key in NOT_IN_COMMAND or value is None or value is False or value == []:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    return out


def _cluster_runs(
    args: argparse.Namespace, best: Deployment, slo: PercentileSlo, console: Console
) -> dict[str, Any]:
    from kiloserve.plan import pareto

    out: dict[str, Any] = {}
    if args.verify:
        out["verify"] = pareto.verify(
            best,
            slo,
            args.workload,
            seed=args.seed,
            duration_s=args.sim_duration,
            policy=args.policy,
        )
        console.print(pareto.verify_text(out["verify"]))
    if args.pareto:
        sizes = pareto.parse_sizes(args.pareto_sizes, best)
        rate_for: Callable[[int], float] = pareto.rate_for_size(best, args.pareto_load)
        rows = pareto.pareto_rows(
            best,
            sizes,
            rate_for,
            args.workload,
            slo=slo,
            seed=args.seed,
            duration_s=args.sim_duration,
            policy=args.policy,
            jobs=args.jobs,
            ray_address=args.ray,
        )
        out["pareto"] = rows
        console.print(pareto.pareto_table(rows))
        png = pareto.write_pareto(Path(args.out), rows)
        if png is not None:
            console.print(f"pareto plot: {png}")
    return out
