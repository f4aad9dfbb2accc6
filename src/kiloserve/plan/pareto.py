"""Simulated runs of a plan: rate-search probes, ``--verify`` and the Pareto table (S4.6).

* ``replica_probe``: one backend (``deployment_cluster`` with one replica) under the
  workload at a rate, for ``kiloserve.plan.capacity.search_capacity``; at least
  ``DEFAULT_MIN_PROBE_S`` (30 s) of arrivals, so a growing queue has time to show.
* ``verify``: simulate the recommended cluster (its replicas, the default policy) at
  the target rate and report SLO attainment (the share of requests meeting every
  limit) and whether the percentile SLO holds.
* ``pareto_rows``: simulate the same deployment at several cluster sizes (GPU counts;
  replicas = GPUs / TP). ``scaled`` load drives each size at the load the plan would
  give it (replicas x per-replica capacity / headroom), like seed 000's table where
  requests/day grow with the cluster; ``target`` load drives every size at the target
  rate (bigger clusters buy lower latency). Each row: requests/day, P95 TTFT / TPOT /
  E2E, $/hour and $/request; rows on the Pareto front (no other row is both cheaper
  per request and lower in P95 TTFT, the latency seed 000's table reports) are marked.

Every run is one deterministic simulation of ``duration_s`` seconds of arrivals (60
by default; at least ``MIN_NUM_REQUESTS``, at most ``MAX_NUM_REQUESTS`` requests).
Requests/day is the offered rate times the success rate: a finite run's measured
throughput (requests / time to the last completion) is biased low by the drain at
its end. Latencies include the
warm-up from an empty cluster, so a run should last several E2E latencies.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from kiloserve.errors import ConfigError
from kiloserve.launch.config import ClusterConfig, parse_cluster_config
from kiloserve.plan.capacity import PROBE_SPAN_KEY, PercentileSlo, Probe, slo_violations
from kiloserve.plan.planner import Deployment, cost_per_request
from kiloserve.results.tables import fmt
from kiloserve.sim import simulate
from kiloserve.sim.sweep import run_all
from kiloserve.workload import load_workload

__all__ = [
    "DEFAULT_DURATION_S",
    "DEFAULT_MIN_PROBE_S",
    "DEFAULT_POLICY",
    "deployment_cluster",
    "mark_pareto_front",
    "pareto_rows",
    "pareto_table",
    "parse_sizes",
    "rate_for_size",
    "replica_probe",
    "simulate_deployment",
    "simulate_deployments",
    "verify",
    "verify_text",
    "write_pareto",
]

logger = logging.getLogger(__name__)
DEFAULT_DURATION_S = 60.0
DEFAULT_MIN_PROBE_S = 30.0
DEFAULT_POLICY = "default"
MAX_NUM_PER_LINE = 256  # BackendSpec.count's limit
MIN_NUM_REQUESTS = 200
MAX_NUM_REQUESTS = 200_000  # bounds one cluster run's wall time (minutes, not hours)
MAX_NUM_PROBE_REQUESTS = 20_000  # bounds one probe (a small model at 1,000 req/s)
SECONDS_PER_DAY = 86_400.0


def deployment_cluster(
    gpu_name: str,
    model_name: str,
    tp: int,
    quant: str,
    num_replicas: int,
    *,
    price_per_gpu_hour: float | None = None,
    max_model_len: int | None = None,
) -> ClusterConfig:
    """``num_replicas`` identical backends as a cluster config (lines of <= 256)."""
    if num_replicas < 1:
        raise ConfigError(f"a cluster needs at least one replica, got {num_replicas}")
    lines: list[dict[str, Any]] = []
    for i, start in enumerate(range(0, num_replicas, MAX_NUM_PER_LINE)):
        line: dict[str, Any] = {
            "name": f"r{i}",
            "gpu": gpu_name,
            "model": model_name,
            "tp": tp,
            "quant": quant,
            "count": min(MAX_NUM_PER_LINE, num_replicas - start),
            "cost_per_hour": price_per_gpu_hour,
            "max_model_len": max_model_len,
        }
        lines.append(line)
    data = {"name": "plan", "gateway": {"policy": "default"}, "backends": lines}
    return parse_cluster_config(data, "<planner>")


def replica_probe(
    cluster: ClusterConfig,
    workload_spec: str,
    *,
    num_requests: int,
    min_duration_s: float = DEFAULT_MIN_PROBE_S,
    seed: int = 0,
) -> Probe:
    """A probe: the workload at a rate, simulated on ``cluster`` (one backend for the
    capacity search) with the default policy: ``num_requests`` requests, more (up to
    ``MAX_NUM_PROBE_REQUESTS``) if they would arrive within ``min_duration_s`` (a short
    burst hides a growing queue). The
    summary gains ``PROBE_SPAN_KEY``, the last arrival time, for the backlog check."""

    def probe(rate_rps: float) -> dict[str, Any]:
        count = max(num_requests, min(MAX_NUM_PROBE_REQUESTS, math.ceil(rate_rps * min_duration_s)))
        workload = load_workload(
            workload_spec, seed=seed, num_requests=count, rate=rate_rps, with_prompts=False
        )
        span_s = max((s.arrival_s or 0.0 for s in workload), default=0.0)
        summary = simulate(cluster, workload, DEFAULT_POLICY, seed=seed).summary
        return summary | {PROBE_SPAN_KEY: span_s}

    return probe


def simulate_deployment(
    deployment: Deployment,
    num_replicas: int,
    rate_rps: float,
    workload_spec: str,
    *,
    seed: int = 0,
    slo: PercentileSlo | None = None,
    duration_s: float = DEFAULT_DURATION_S,
    policy: str = DEFAULT_POLICY,
) -> dict[str, Any]:
    """Bench-schema summary of ``num_replicas`` of the deployment at ``rate_rps``."""
    c = deployment.candidate
    ledger = c.ledger
    cluster = deployment_cluster(
        c.gpu.name,
        c.model.name,
        c.tp,
        c.quant,
        num_replicas,
        price_per_gpu_hour=deployment.price_per_gpu_hour,
        max_model_len=ledger.max_model_len if ledger is not None else None,
    )
    if not duration_s > 0 or not rate_rps > 0:
        raise ConfigError(f"need duration_s > 0 and rate > 0, got {duration_s}, {rate_rps}")
    num_requests = max(MIN_NUM_REQUESTS, math.ceil(rate_rps * duration_s))
    if num_requests > MAX_NUM_REQUESTS:
        logger.warning(
            "%.0f s at %.3g req/s is %d requests; simulating the first %d (%.0f s)",
            duration_s, rate_rps, num_requests, MAX_NUM_REQUESTS, MAX_NUM_REQUESTS / rate_rps,
        )  # fmt: skip
        num_requests = MAX_NUM_REQUESTS
    workload = load_workload(
        workload_spec, seed=seed, num_requests=num_requests, rate=rate_rps, with_prompts=False
    )
    if workload.num_requests is not None and workload.num_requests < num_requests:
        logger.warning(
            "%s has %d requests, fewer than the %d that %.0f s at %.3g req/s needs: the "
            "run covers %.0f s (use a synthetic workload or a longer trace)",
            workload_spec, workload.num_requests, num_requests, duration_s, rate_rps,
            workload.num_requests / rate_rps,
        )  # fmt: skip
    per_request = slo.per_request_slo() if slo is not None else None
    return simulate(cluster, workload, policy, seed=seed, slo=per_request).summary


def simulate_deployments(
    runs: Sequence[tuple[Deployment, int, float]],
    workload_spec: str,
    *,
    seed: int = 0,
    slo: PercentileSlo | None = None,
    duration_s: float = DEFAULT_DURATION_S,
    policy: str = DEFAULT_POLICY,
    jobs: int | None = None,
    ray_address: str | None = None,
    label: str = "cluster runs",
) -> list[dict[str, Any]]:
    """``simulate_deployment`` for each (deployment, replicas, rate), side by side on
    ``jobs`` local processes or on Ray (``kiloserve.sim.sweep.run_all``), in order."""
    one = functools.partial(
        _simulate_run, workload_spec=workload_spec, seed=seed, slo=slo, duration_s=duration_s,
        policy=policy,
    )  # fmt: skip
    return run_all(one, runs, jobs=jobs, ray_address=ray_address, label=label)


def _simulate_run(run: tuple[Deployment, int, float], **kwargs: Any) -> dict[str, Any]:
    deployment, num_replicas, rate_rps = run
    return simulate_deployment(deployment, num_replicas, rate_rps, **kwargs)


def verify(
    deployment: Deployment,
    slo: PercentileSlo,
    workload_spec: str,
    *,
    seed: int = 0,
    duration_s: float = DEFAULT_DURATION_S,
    policy: str = DEFAULT_POLICY,
) -> dict[str, Any]:
    """Simulate the recommended cluster at the target rate; SLO attainment and checks."""
    summary = simulate_deployment(
        deployment,
        deployment.num_replicas,
        deployment.target_rps,
        workload_spec,
        seed=seed,
        slo=slo,
        duration_s=duration_s,
        policy=policy,
    )
    violations = slo_violations(summary, slo)
    return _row(deployment, deployment.num_replicas, deployment.target_rps, summary) | {
        "slo_attainment": summary.get("slo_attainment"),
        "policy": policy,
        "is_slo_met": not violations,
        "violations": violations,
        "p95_std_across_backends_ms": summary.get("p95_std_across_backends_ms"),
    }


def verify_text(result: Mapping[str, Any]) -> str:
    """One paragraph for the terminal."""
    state = "met" if result["is_slo_met"] else "MISSED (" + "; ".join(result["violations"]) + ")"
    attainment = result.get("slo_attainment")
    share = "-" if attainment is None else f"{attainment:.1%}"
    return (
        f"verify: {result['num_gpus']} GPUs ({result['num_replicas']} replicas) at "
        f"{result['rate_rps']:g} req/s: SLO {state}; {share} of requests within every "
        f"limit; P95 TTFT {fmt(result['ttft_p95_ms'])} ms, TPOT {fmt(result['tpot_p95_ms'])} "
        f"ms, E2E {fmt(result['e2e_p95_ms'])} ms"
    )


def parse_sizes(text: str | None, deployment: Deployment) -> list[int]:
    """GPU counts for the Pareto table; default: half, one and two times the plan."""
    tp = deployment.candidate.tp
    if text:
        try:
            sizes = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"--pareto-sizes must be GPU counts, got {text!r}") from None
        bad = [s for s in sizes if s < tp or s % tp]
        if not sizes or bad:
            raise ConfigError(f"--pareto-sizes must be multiples of TP{tp}, got {text!r}")
        return sorted(set(sizes))
    cards = deployment.num_cards
    return sorted({max(tp, round(cards * f / tp) * tp) for f in (0.5, 1.0, 2.0)})


def rate_for_size(deployment: Deployment, mode: str) -> Callable[[int], float]:
    """Offered rate for a cluster of ``num_gpus`` (module docstring: scaled / target)."""
    if mode == "target":
        return lambda num_gpus: deployment.target_rps
    if mode != "scaled":
        raise ConfigError(f"pareto load must be 'scaled' or 'target', got {mode!r}")
    per_replica = deployment.capacity.rate_rps / deployment.headroom
    return lambda num_gpus: num_gpus // deployment.candidate.tp * per_replica


def pareto_rows(
    deployment: Deployment,
    sizes: Sequence[int],
    rate_for: Callable[[int], float],
    workload_spec: str,
    *,
    slo: PercentileSlo | None = None,
    seed: int = 0,
    duration_s: float = DEFAULT_DURATION_S,
    policy: str = DEFAULT_POLICY,
    jobs: int | None = None,
    ray_address: str | None = None,
) -> list[dict[str, Any]]:
    """One simulated row per cluster size, Pareto-optimal rows marked (and whether
    each meets ``slo``, when given). The sizes run side by side (``jobs``, Ray)."""
    runs = [(deployment, n // deployment.candidate.tp, rate_for(n)) for n in sizes]
    summaries = simulate_deployments(
        runs, workload_spec, seed=seed, duration_s=duration_s, policy=policy, jobs=jobs,
        ray_address=ray_address, label="pareto sizes",
    )  # fmt: skip
    rows = []
    for (_, num_replicas, rate), summary in zip(runs, summaries, strict=True):
        row = _row(deployment, num_replicas, rate, summary)
        if slo is not None:
            row["is_slo_met"] = not slo_violations(summary, slo)
        rows.append(row)
    mark_pareto_front(rows)
    return rows


def _row(
    deployment: Deployment, num_replicas: int, rate_rps: float, summary: Mapping[str, Any]
) -> dict[str, Any]:
    num_gpus = num_replicas * deployment.candidate.tp
    cost_per_hour = num_gpus * deployment.price_per_gpu_hour
    served_rps = rate_rps * (1.0 - float(summary.get("error_rate", 0.0)))

    def p95(key: str) -> float | None:
        value = (summary.get(key) or {}).get("p95")
        return None if value is None else float(value)

    return {
        "num_gpus": num_gpus,
        "num_replicas": num_replicas,
        "rate_rps": rate_rps,
        "measured_request_throughput": float(summary.get("request_throughput", 0.0)),
        "requests_per_day": served_rps * SECONDS_PER_DAY,
        "output_tokens_per_s": served_rps * deployment.mean_output_tokens,
        "ttft_p95_ms": p95("ttft_ms"),
        "tpot_p95_ms": p95("tpot_ms"),
        "e2e_p95_ms": p95("e2e_ms"),
        "error_rate": float(summary.get("error_rate", 0.0)),
        "cost_per_hour": cost_per_hour,
        "cost_per_request": cost_per_request(cost_per_hour, served_rps),
        "sim_wall_s": summary.get("sim_wall_s"),
        "simulated_requests": summary.get("simulated_requests"),
    }


def mark_pareto_front(rows: list[dict[str, Any]]) -> None:
    """Set ``is_pareto`` on each row: no other row is cheaper per request and faster."""

    def key(row: Mapping[str, Any]) -> tuple[float, float]:
        ttft = row["ttft_p95_ms"]
        return row["cost_per_request"], math.inf if ttft is None else ttft

    for row in rows:
        cost, p95 = key(row)
        row["is_pareto"] = not any(
            (k := key(other)) != (cost, p95) and k[0] <= cost and k[1] <= p95 for other in rows
        )


def pareto_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    """The seed-000-style table: GPUs, requests/day, P95s, $/request."""
    table = Table(title="Cost vs P95 across cluster sizes (* = Pareto front)")
    cols = ("GPUs", "replicas", "offered req/s", "req/day", "P95 TTFT ms", "P95 TPOT ms",
            "P95 E2E ms", "$/hour", "$/request", "SLO", "front")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["num_gpus"]),
            str(r["num_replicas"]),
            fmt(r["rate_rps"]),
            f"{r['requests_per_day'] / 1e6:.2f}M",
            fmt(r["ttft_p95_ms"]),
            fmt(r["tpot_p95_ms"]),
            fmt(r["e2e_p95_ms"]),
            fmt(r["cost_per_hour"], 0),
            f"{r['cost_per_request']:.5f}",
            _slo_text(r.get("is_slo_met")),
            "*" if r["is_pareto"] else "",
        )
    return table


def _slo_text(is_met: object) -> str:
    if is_met is None:
        return "-"
    return "met" if is_met else "missed"


def write_pareto(out_dir: Path, rows: Sequence[Mapping[str, Any]]) -> Path | None:
    """``pareto.png`` ($/request vs P95 TTFT, labelled by GPUs); None without matplotlib."""
    from kiloserve.results import plots

    if not plots.is_available() or not rows:
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.5), layout="tight")
    ax = fig.add_subplot()
    xs = [r["ttft_p95_ms"] or math.nan for r in rows]
    ys = [r["cost_per_request"] for r in rows]
    ax.plot(xs, ys, "o-")
    for x, y, r in zip(xs, ys, rows, strict=True):
        ax.annotate(f"{r['num_gpus']} GPUs", (x, y), textcoords="offset points", xytext=(5, 5))
    finite = [x for x in xs if math.isfinite(x) and x > 0]
    if finite and max(finite) > 20 * min(finite):
        ax.set_xscale("log")
    ax.set_xlabel("P95 TTFT (ms)")
    ax.set_ylabel("cost per request ($)")
    ax.set_title("Cost vs P95 across cluster sizes")
    ax.grid(True, alpha=0.3)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "pareto.png"
    fig.savefig(path, dpi=100)
    return path
