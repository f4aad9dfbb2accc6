"""``kiloserve plan --disagg``: run the comparison and write ``disagg.md`` / ``disagg.json``
(and ``disagg.png`` with matplotlib). The layouts, runs, ranking and crossover search
are ``kiloserve.plan.disagg``; the schema is in docs/disaggregation.md.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kiloserve.errors import ConfigError
from kiloserve.plan.capacity import PercentileSlo
from kiloserve.plan.disagg import (
    DEFAULT_CPU_GIBS,
    DisaggSetup,
    Runner,
    compare_layouts,
    crossover_sweeps,
    default_rates,
    layouts_for,
    parse_list,
    prompt_grid,
    simulate_layout,
)
from kiloserve.plan.planner import Candidate, Deployment
from kiloserve.results.report import write_json

__all__ = ["DISAGG_SCHEMA_VERSION", "disagg_markdown", "disagg_table", "run_disagg", "write_disagg"]

DISAGG_SCHEMA_VERSION = 1


def run_disagg(
    args: argparse.Namespace,
    candidates: Sequence[Candidate],
    deployments: Sequence[Deployment],
    slo: PercentileSlo,
    mean_input_tokens: float,
    mean_output_tokens: float,
    console: Console,
    *,
    command: Sequence[str] = (),
    runner: Runner = simulate_layout,
) -> dict[str, Any]:
    """The ``--disagg`` comparison for the plan's recommended deployment (or, when none
    meets the SLO, the first fitting candidate at ``--disagg-replicas``): prints the
    table and crossover, writes ``OUT/disagg.{md,json,png}``, returns the json dict."""
    candidate, num_replicas = _choice(args, candidates, deployments)
    ledger = candidate.ledger
    max_len = args.max_model_len or (ledger.max_model_len if ledger is not None else None)
    setup = DisaggSetup(
        candidate.gpu.name, candidate.model.name, candidate.tp, candidate.quant, slo,
        max_model_len=args.max_model_len, kv_link=args.kv_link, policy=args.policy,
        seed=args.seed, duration_s=args.sim_duration,
    )  # fmt: skip
    cpu = parse_list(args.disagg_cpu_gib, "--disagg-cpu-gib", float)
    layouts = layouts_for(num_replicas, cpu_gibs=DEFAULT_CPU_GIBS if cpu is None else cpu)
    output_tokens = max(1, round(mean_output_tokens))
    lens = parse_list(args.disagg_prompt_lens, "--disagg-prompt-lens", int)
    prompt_lens = prompt_grid(lens, output_tokens, max_len)
    rates = parse_list(args.disagg_rates, "--disagg-rates", float) or default_rates(args.rate)
    runs = {"runner": runner, "jobs": args.jobs, "ray_address": args.ray}
    rows = compare_layouts(setup, layouts, args.workload, args.rate, **runs)
    crossover = crossover_sweeps(
        setup, layouts, args.workload, args.rate, prompt_lens=prompt_lens, rates=rates,
        mean_input_tokens=mean_input_tokens, output_tokens=output_tokens, **runs,
    )  # fmt: skip
    data = {
        "schema_version": DISAGG_SCHEMA_VERSION,
        "command": list(command),
        "model": candidate.model.name, "gpu": candidate.gpu.name, "tp": candidate.tp,
        "quant": candidate.quant, "num_replicas": num_replicas,
        "num_gpus": num_replicas * candidate.tp, "workload": args.workload,
        "mean_input_tokens": mean_input_tokens, "mean_output_tokens": mean_output_tokens,
        "rate_rps": args.rate, "slo": slo.to_dict(), "kv_link": args.kv_link,
        "duration_s": args.sim_duration, "policy": args.policy, "seed": args.seed,
        "layouts": rows, "best": rows[0]["name"], "crossover": crossover,
    }  # fmt: skip
    out = Path(args.out)
    write_disagg(out, data)
    console.print(disagg_table(data))
    for block in crossover.values():
        console.print(block["text"], markup=False, highlight=False)
    console.print(f"disagg: {out / 'disagg.md'}, {out / 'disagg.json'}")
    return data


def _choice(
    args: argparse.Namespace, candidates: Sequence[Candidate], deployments: Sequence[Deployment]
) -> tuple[Candidate, int]:
    replicas: int | None = args.disagg_replicas
    if replicas is not None and replicas < 1:
        raise ConfigError(f"--disagg-replicas must be >= 1, got {replicas}")
    if deployments:
        best = deployments[0]
        return best.candidate, replicas or best.num_replicas
    fitting = [c for c in candidates if c.is_fitting]
    if not fitting:
        raise ConfigError("--disagg: no candidate fits in memory")
    if replicas is None:
        raise ConfigError(
            "--disagg: no colocated deployment meets the SLO, so there is no replica count "
            "to compare at: give --disagg-replicas N"
        )
    return fitting[0], replicas


def _ms(stats: Mapping[str, Any] | None, key: str = "p95") -> str:
    value = None if stats is None else stats.get(key)
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _cells(row: Mapping[str, Any]) -> list[str]:
    hit, tier = row.get("prefix_cache_hit_rate"), row.get("kv_tier_hit_rate")
    return [
        str(row["rank"]), row["name"], str(row["prefill"]), str(row["decode"]), str(row["both"]),
        f"{row['kv_cpu_gib']:g}", f"{row['goodput_per_gpu']:.3g}", f"{row['slo_attainment']:.1%}",
        _ms(row["ttft_ms"], "p50"), _ms(row["ttft_ms"]), _ms(row["tpot_ms"], "p50"),
        _ms(row["tpot_ms"]), _ms(row["kv_transfer_ms"]), "-" if hit is None else f"{hit:.1%}",
        "-" if tier is None else f"{tier:.1%}",
        "met" if row["is_slo_met"] else "missed",
    ]  # fmt: skip


COLUMNS = ("#", "layout", "P", "D", "both", "CPU GiB", "goodput/GPU", "SLO att.", "P50 TTFT",
           "P95 TTFT", "P50 TPOT", "P95 TPOT", "P95 KV xfer", "GPU hit", "tier hit",
           "P95 SLO")  # fmt: skip


def disagg_table(data: Mapping[str, Any]) -> Table:
    """The ranked layouts for the terminal."""
    table = Table(
        title=f"P/D and KV-tier layouts on {data['num_gpus']} x {data['gpu']} at "
        f"{data['rate_rps']:g} req/s (goodput = good req/s per GPU; ms)"
    )
    for col in COLUMNS:
        if col == "layout":
            table.add_column(col, no_wrap=True, min_width=16)
        else:
            table.add_column(col, justify="right")
    for row in data["layouts"]:
        table.add_row(*_cells(row))
    return table


def _point_row(point: Mapping[str, Any]) -> str:
    gain = point.get("gain")
    best = point.get("best_pd_goodput_per_gpu")
    cells = [
        f"{point['value']:g}", f"{point['colocated_goodput_per_gpu']:.3g}",
        f"{point['colocated_slo_attainment']:.1%}", str(point.get("best_pd") or "-"),
        "-" if best is None else f"{best:.3g}",
        "-" if point.get("best_pd_slo_attainment") is None
        else f"{point['best_pd_slo_attainment']:.1%}",
        "-" if gain is None else f"{gain:+.1%}",
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def disagg_markdown(data: Mapping[str, Any]) -> str:
    """disagg.md: the setup, the ranked layouts and both crossover sweeps."""
    slo = ", ".join(f"{k} {v:g}" for k, v in data["slo"].items())
    lines = [
        f"# P/D disaggregation: {data['model']} on {data['num_gpus']} x {data['gpu']} "
        f"(TP{data['tp']} {data['quant']})",
        "",
        "Computed by `" + " ".join(data["command"]) + "`.",
        f"Each layout: {data['duration_s']:g} s of `{data['workload']}` arrivals at "
        f"{data['rate_rps']:g} req/s, simulated (`{data['policy']}` policy, seed "
        f"{data['seed']}, KV over `{data['kv_link']}`). SLO: {slo}. Goodput = offered rate x "
        "share of requests meeting every SLO limit, per GPU. Latencies in ms.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(_cells(row)) + " |" for row in data["layouts"]),
        "",
        f"Best: **{data['best']}**.",
    ]
    for key, title in (("prompt_tokens", "prompt length"), ("rate_rps", "request rate")):
        block = data["crossover"][key]
        lines += [
            "", f"## Crossover over {title}", "", block["text"] + ".", "",
            f"| {title} | colocated goodput/GPU | colocated SLO att. | best P/D | "
            "P/D goodput/GPU | P/D SLO att. | gain |",
            "|---|---|---|---|---|---|---|",
            *(_point_row(p) for p in block["points"]),
        ]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_disagg(out_dir: Path, data: Mapping[str, Any]) -> str:
    """Write ``disagg.json``, ``disagg.md`` (and ``disagg.png``); returns the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "disagg.json", data)
    text = disagg_markdown(data)
    (out_dir / "disagg.md").write_text(text)
    plot_crossover(out_dir / "disagg.png", data["crossover"])
    return text


def plot_crossover(path: Path, crossover: Mapping[str, Any]) -> Path | None:
    """Goodput per GPU of colocated and the best P/D layout over prompt length and over
    rate (two panels); None without matplotlib."""
    from kiloserve.results import plots

    if not plots.is_available():
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10.0, 4.0), layout="tight")
    panels = (("prompt_tokens", "prompt tokens (fixed)"), ("rate_rps", "offered rate (req/s)"))
    for ax, (key, xlabel) in zip(fig.subplots(1, 2), panels, strict=True):
        block = crossover[key]
        xs = [p["value"] for p in block["points"]]
        ax.plot(xs, [p["colocated_goodput_per_gpu"] for p in block["points"]], "o-",
                label="colocated")  # fmt: skip
        pd = [math.nan if p["best_pd_goodput_per_gpu"] is None else p["best_pd_goodput_per_gpu"]
              for p in block["points"]]  # fmt: skip
        ax.plot(xs, pd, "s--", label="best P/D layout")
        if block["crossover"] is not None:
            ax.axvline(block["crossover"], color="grey", alpha=0.5, label="crossover")
        if key == "prompt_tokens":
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("goodput per GPU (req/s)")
        ax.set_ylim(bottom=0)
        ax.set_title(
            f"at {block['rate_rps']:g} req/s" if key == "prompt_tokens" else block["workload"]
        )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path
