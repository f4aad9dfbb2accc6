"""``kiloserve sim``: simulate a cluster and its gateway under several policies and rates.

    kiloserve sim -c examples/cluster-1024.yaml --workload azure-conv --rate 400 \\
        --policy round_robin --policy default --out /tmp/sim

writes ``DIR/<policy>/`` (summary.json, summary.md, PNGs) per policy and
``DIR/comparison.md`` when there are several (ratios against the first policy).
Several ``--rate`` flags run every policy at every rate: ``DIR/rate-<R>/<policy>/``
per run, ``DIR/rate-<R>/comparison.md`` per rate when there are several policies, and
``DIR/comparison.md`` over all runs (labels ``rate-<R>/<policy>``; ratios against the
first rate's first policy).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kiloserve.errors import ConfigError
from kiloserve.launch.config import load_cluster_config
from kiloserve.results.metrics import Slo, parse_slo
from kiloserve.results.report import write_comparison
from kiloserve.sim.faults import FaultEvent, load_faults, parse_fault
from kiloserve.sim.report import write_sim_report
from kiloserve.sim.run import SimResult, simulate
from kiloserve.sim.sweep import add_sweep_arguments, run_all
from kiloserve.workload import Workload, load_workload

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("-c", "--config", required=True, help="cluster YAML (e.g. examples/cluster-1024.yaml)")
    a("--workload", required=True, help="workload spec (see docs/workloads.md)")
    a("--rate", type=float, action="append", help="requests/s (synthetic arrivals; rescales a "
      "trace); repeatable: every policy runs at every rate")  # fmt: skip
    a("--burstiness", type=float, default=1.0, help="gamma shape of synthetic arrival gaps")
    a("--duration", type=float, help="seconds of arrivals")
    a("--num-requests", type=int, help="number of requests")
    a("--policy", action="append", help="routing policy (repeatable; default: default)")
    a("--policy-params", help="JSON object of parameters for every --policy")
    a("--model", help="send every request to this served model (default: all pools, "
      "weighted by GPUs)")  # fmt: skip
    a("--seed", type=int, default=0, help="workload, policy RNG and model-draw seed")
    a("--slo", help="goodput SLOs, e.g. ttft=500ms,tpot=50ms")
    a("--fault", action="append", default=[], help="t=30,backend=NAME,kind=die|slow|recover"
      "[,factor=3] (repeatable)")  # fmt: skip
    a("--faults", type=Path, help="YAML list of faults")
    a("--scrape-interval", type=float, default=0.2, help="gateway scrape period in s")
    a("--network-delay", type=float, default=0.0005, help="gateway<->backend one-way delay s")
    a("--traces-dir", help="folder of the shipped traces")
    a("--records", action="store_true", help="also write requests.jsonl and routing.csv")
    a("--out", required=True, type=Path, help="report folder")
    a("--no-plots", action="store_true", help="skip PNG plots")
    add_sweep_arguments(p)


class _PolicyRun(NamedTuple):
    """One (rate, policy) simulation, as a process pool or Ray task gets it (picklable)."""

    args: argparse.Namespace
    cluster: Any
    policy: str
    params: dict[str, Any] | None
    slo: Slo | None
    faults: list[FaultEvent]
    command: list[str]
    rate: float | None = None
    label: str = ""  # the run's folder under --out: the policy, or rate-<R>/<policy>


def run(args: argparse.Namespace) -> int:
    cluster = load_cluster_config(args.config)
    policies: list[str] = args.policy or ["default"]
    if len(set(policies)) != len(policies):
        raise ConfigError(f"--policy given twice: {policies}")
    rates = _rates(args.rate)
    params = _policy_params(args.policy_params)
    slo = parse_slo(args.slo) if args.slo else None
    faults = _faults(args)
    console = Console(stderr=True)
    command = ["kiloserve", "sim", *sys.argv[2:]]
    runs = [
        _PolicyRun(args, cluster, p, params, slo, faults, command, rate, label)
        for rate, folder in rates.items()
        for p in policies
        for label in [f"{folder}/{p}" if folder else p]
    ]
    summaries: dict[str, dict[str, Any]] = {}
    records = {}
    for one, result in zip(runs, _run_policies(runs, console), strict=True):
        write_sim_report(args.out / one.label, result, plot=not args.no_plots)
        summaries[one.label] = result.summary
        records[one.label] = result.records
        _print_line(console, one.label, result)
    kept = records if args.records else None
    if len(rates) > 1 and len(policies) > 1:  # the policies side by side at each rate
        for folder in rates.values():
            at = {
                k[len(folder) + 1 :]: v for k, v in summaries.items() if k.startswith(folder + "/")
            }
            kept_at = None if kept is None else {p: kept[f"{folder}/{p}"] for p in at}
            title = f"simulated policies on {cluster.name} at {folder}"
            write_comparison(args.out / folder, at, records=kept_at, title=title,
                             plot=not args.no_plots)  # fmt: skip
    if len(runs) > 1:
        what = "policies" if len(rates) == 1 else "rates and policies"
        title = f"simulated {what} on {cluster.name}"
        write_comparison(args.out, summaries, records=kept, title=title, plot=not args.no_plots)
    print(args.out)
    return 0


def _rates(given: list[float] | None) -> dict[float | None, str]:
    """Each ``--rate`` -> its folder under ``--out`` (``rate-<R>``; ``""`` for a single
    rate or none, whose runs write to ``DIR/<policy>`` as ever)."""
    if not given:
        return {None: ""}
    for rate in given:
        if not rate > 0 or rate == float("inf"):
            raise ConfigError(f"--rate must be a positive number of requests/s, got {rate}")
    if len(given) == 1:
        return {given[0]: ""}
    folders: dict[float | None, str] = {rate: f"rate-{rate:g}" for rate in given}
    if len(folders) != len(given) or len(set(folders.values())) != len(given):
        raise ConfigError(f"--rate given twice: {given}")
    return folders


def _run_policies(runs: list[_PolicyRun], console: Console) -> list[SimResult]:
    """In this process with a bar per policy (``--jobs 1`` or one policy), else side
    by side on the process pool or Ray (``sim.sweep``)."""
    args = runs[0].args
    if args.ray is None and (args.jobs == 1 or len(runs) == 1):
        workloads: dict[float | None, Workload] = {}
        results = []
        for run in runs:
            if run.rate not in workloads:
                workloads = {run.rate: _workload(args, run.rate)}  # runs are grouped by rate
            workload = workloads[run.rate]
            with _progress(console, run.label, workload.num_requests) as on_progress:
                results.append(_simulate(run, workload, on_progress))
        return results
    fields = run_all(_simulate_in_worker, runs, jobs=args.jobs, ray_address=args.ray,
                     label="sim runs", console=console)  # fmt: skip
    return [SimResult(*f) for f in fields]


def _simulate_in_worker(run: _PolicyRun) -> tuple[Any, ...]:
    """In a worker; its fields travel back (``SimResult`` may be a compiled class)."""
    result = _simulate(run, _workload(run.args, run.rate), None)
    return result.summary, result.routing, result.records, result.timeseries


def _simulate(
    run: _PolicyRun, workload: Workload, on_progress: Callable[[int], None] | None
) -> SimResult:
    args = run.args
    return simulate(
        run.cluster,
        workload,
        run.policy,
        policy_params=run.params,
        seed=args.seed,
        scrape_interval_s=args.scrape_interval,
        network_delay_s=args.network_delay,
        faults=run.faults,
        keep_records=args.records,
        progress=on_progress,
        slo=run.slo,
        model=args.model,
        traces_dir=args.traces_dir,
        command=run.command,
    )


def _workload(args: argparse.Namespace, rate: float | None) -> Workload:
    return load_workload(
        args.workload,
        seed=args.seed,
        num_requests=args.num_requests,
        duration_s=args.duration,
        rate=rate,
        burstiness=args.burstiness,
        traces_dir=args.traces_dir,
        with_prompts=False,
    )


def _policy_params(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"--policy-params is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError("--policy-params must be a JSON object")
    return value


def _faults(args: argparse.Namespace) -> list[FaultEvent]:
    faults = [parse_fault(text) for text in args.fault]
    if args.faults is not None:
        faults += load_faults(args.faults)
    return sorted(faults, key=lambda f: f.time_s)


@contextmanager
def _progress(console: Console, label: str, total: int | None) -> Iterator[Callable[[int], None]]:
    columns = (
        TextColumn(f"sim {label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(label, total=total)

        def update(num_done: int) -> None:
            bar.update(task, completed=num_done)

        yield update


def _print_line(console: Console, label: str, result: SimResult) -> None:
    s = result.summary
    ttft, e2e = s["ttft_ms"], s["e2e_ms"]
    console.print(
        f"{label}: {s['requests_ok']} ok, {s['requests_failed']} failed, "
        f"{s['request_throughput']:.1f} req/s, TTFT p95 {_ms(ttft['p95'])}, "
        f"E2E p95 {_ms(e2e['p95'])}, P95 std across backends "
        f"{_ms(s['p95_std_across_backends_ms'])}; {s['simulated_requests']} requests "
        f"in {s['sim_wall_s']:.1f} s wall ({s['requests_per_wall_s']:.0f}/s)"
    )


def _ms(value: object) -> str:
    return f"{value:.0f} ms" if isinstance(value, int | float) else "-"
