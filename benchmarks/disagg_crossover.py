"""P/D disaggregation and a CPU KV tier in the simulator: the two checks of
docs/disaggregation.md, each against a colocated baseline measured in the same run.

    .venv/bin/python benchmarks/disagg_crossover.py        # all three parts, ~2-3 min here
    .venv/bin/python benchmarks/disagg_crossover.py --no-tier --no-max-rate   # part 1, ~10-25 s
    .venv/bin/python benchmarks/disagg_crossover.py --no-crossover --no-tier  # part 3, ~35-80 s
    .venv/bin/python benchmarks/disagg_crossover.py --no-crossover --no-max-rate \
        --tier-max-rate                                                # part 2, ~55 s
    .venv/bin/python benchmarks/disagg_crossover.py --plot crossover.png     # + part 1 plotted

1. Crossover (DistServe's claim: splitting prefill from decode raises goodput under a
   tight TPOT SLO for long prompts, not for short ones). ``--replicas`` engines of
   ``--model`` on ``--gpu`` (TP1), laid out as colocated and as P:D 1:1, 1:2, 1:3, 1:4
   and 2:1 (``kiloserve.plan.disagg.layouts_for``); fixed-length prompts from
   ``--prompt-lens`` with ``--output`` output tokens at ``--rate`` req/s, then
   ``--workload`` at the ``--rates``; ``--slo`` per request. Prints per point the
   colocated goodput per GPU and each P/D layout's ratio to it, and the crossover.
2. CPU tier (LMCache / vLLM's offloading: host memory extends the prefix cache). The
   shipped Mooncake conversation trace (real shared 512-token prefixes), its first
   ``--tier-requests`` rescaled to each of ``--tier-rates`` (3 req/s: below what the
   cluster serves; 6: above it, so completions per second measure throughput), on
   ``--tier-replicas`` colocated engines of ``--tier-model`` on ``--tier-gpu`` with 0 /
   64 / 256 GiB of CPU tier each. Prints the hit rates (the engines' counters, tokens:
   GPU prefix cache, and tier hits / tier lookups), completions per second, goodput and
   TTFT, each as a ratio to the 0 GiB row at the same rate; with ``--tier-max-rate``
   also each tier size's capacity (the highest rate with 90% of requests within
   ``--tier-slo``, ``--tier-duration`` seconds of the trace per probe).

3. DistServe's own metric (``--no-max-rate`` skips it): per-GPU goodput as the highest
   rate at which at least 90% of requests meet both SLOs, found by doubling then
   bisecting (to 5%) the rate of fixed-length prompts, for colocated and the P:D 1:1,
   2:1 and 1:2 layouts at ``--max-rate-lens`` prompt tokens.

Every number is one deterministic simulation (seed 0); wall time goes to stderr.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kiloserve.plan.capacity import PercentileSlo, parse_percentile_slo  # noqa: E402
from kiloserve.plan.disagg import (  # noqa: E402
    DisaggSetup,
    Layout,
    LayoutRun,
    crossover_sweeps,
    layout_row,
    layouts_for,
    simulate_layout,
)
from kiloserve.plan.disagg_report import plot_crossover  # noqa: E402
from kiloserve.sim.sweep import run_all  # noqa: E402

ATTAINMENT = 0.9  # DistServe: the rate at which 90% of requests meet both SLOs


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",")]


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model", default="llama-3.1-8b")
    a("--gpu", default="H100")
    a("--replicas", type=int, default=12)
    a("--slo", default="ttft_p95=2s,tpot_p95=15ms")
    a("--rate", type=float, default=12.0, help="req/s of the prompt-length sweep")
    a("--output", type=int, default=200, help="output tokens of the prompt-length sweep")
    a("--prompt-lens", type=_ints, default=[256, 512, 1024, 2048, 4096, 8192, 16384])
    a("--workload", default="mix:summarize=1", help="workload of the rate sweep")
    a("--rates", type=_floats, default=[3.0, 6.0, 12.0, 18.0, 24.0, 36.0, 48.0])
    a("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    a("--kv-link", default="network")
    a("--tier-model", default="llama-3.1-8b")
    a("--tier-gpu", default="H100")
    a("--tier-replicas", type=int, default=4)
    a("--tier-rates", type=_floats, default=[3.0, 6.0])
    a("--tier-requests", type=int, default=2000)
    a("--tier-slo", default="ttft_p95=5s,tpot_p95=100ms")
    a("--tier-max-rate", action="store_true", help="part 2 also searches each tier's capacity")
    a("--tier-duration", type=float, default=300.0, help="seconds per capacity probe")
    a("--jobs", type=int, default=None)
    a("--plot", type=Path, help="write the crossover plot here (PNG)")
    a("--no-crossover", action="store_true")
    a("--no-tier", action="store_true")
    a("--no-max-rate", action="store_true")
    a("--max-rate-lens", type=_ints, default=[512, 2048, 8192])
    return p.parse_args()


def _ratio(value: float, base: float) -> str:
    return "-" if base <= 0 else f"{value / base:5.2f}x"


def _print_sweep(title: str, block: Mapping[str, Any], names: Sequence[str]) -> None:
    print(f"\n{title}")
    print(f"{'value':>8} {'colocated gp/GPU':>17}  " + " ".join(f"{n:>8}" for n in names))
    for p in block["points"]:
        base = p["colocated_goodput_per_gpu"]
        cells = " ".join(f"{_ratio(p['goodput_per_gpu'][n], base):>8}" for n in names)
        print(f"{p['value']:>8g} {base:>17.3f}  {cells}")
    print(block["text"])


def crossover(args: argparse.Namespace) -> dict[str, Any]:
    setup = DisaggSetup(
        args.gpu, args.model, 1, "bf16", parse_percentile_slo(args.slo), kv_link=args.kv_link,
        duration_s=args.duration,
    )  # fmt: skip
    layouts = layouts_for(args.replicas, cpu_gibs=())
    started = time.perf_counter()
    result = crossover_sweeps(
        setup, layouts, args.workload, args.rate, prompt_lens=args.prompt_lens,
        rates=args.rates, mean_input_tokens=0.0, output_tokens=args.output, jobs=args.jobs,
    )  # fmt: skip
    wall = time.perf_counter() - started
    print(f"\n1. Crossover: {args.replicas} x {args.gpu} {args.model}, SLO {args.slo}, "
          f"KV over {args.kv_link}; goodput per GPU of each P/D layout / colocated")  # fmt: skip
    names = [lay.name for lay in layouts if lay.is_disagg]
    _print_sweep(f"prompt tokens (output {args.output}) at {args.rate:g} req/s:",
                 result["prompt_tokens"], names)  # fmt: skip
    _print_sweep(f"request rate, {args.workload}:", result["rate_rps"], names)
    print(f"({wall:.0f} s wall)", file=sys.stderr)
    if args.plot is not None:
        path = plot_crossover(args.plot, result)
        print(f"plot: {path}" if path is not None else "plot: skipped (no matplotlib)")
    return result


def tier(args: argparse.Namespace) -> list[dict[str, Any]]:
    slo = parse_percentile_slo(args.tier_slo)
    layouts = layouts_for(args.tier_replicas, ratios=(), cpu_gibs=(64.0, 256.0))
    runs = [
        LayoutRun(
            DisaggSetup(args.tier_gpu, args.tier_model, 1, "bf16", slo,
                        duration_s=args.tier_requests / rate),
            lay, "mooncake", rate,
        )
        for rate in args.tier_rates
        for lay in layouts
    ]  # fmt: skip
    started = time.perf_counter()
    summaries = run_all(simulate_layout, runs, jobs=args.jobs, label="tiers")
    wall = time.perf_counter() - started
    rows = [layout_row(r.layout, 1, r.rate_rps, s, slo) | {"summary": s}
            for r, s in zip(runs, summaries, strict=True)]  # fmt: skip
    print(f"\n2. CPU KV tier: mooncake (first {args.tier_requests} requests), "
          f"{args.tier_replicas} x {args.tier_gpu} {args.tier_model}, SLO {args.tier_slo}; "
          "hit rates in tokens (engines' counters)")  # fmt: skip
    print(f"{'req/s':>5} {'layout':<17} {'GPU hit':>8} {'tier hit':>8} {'done/s':>7} "
          f"{'goodput':>8} {'TTFT p50':>9} {'TTFT p95':>9}   ratios to 0 GiB: hit (GPU+tier), "
          "done/s, goodput, TTFT p50, p95")  # fmt: skip
    for i in range(0, len(rows), len(layouts)):
        base = rows[i]
        for row in rows[i : i + len(layouts)]:
            s = row["summary"]
            gpu, tier_hit = row["prefix_cache_hit_rate"] or 0.0, row["kv_tier_hit_rate"] or 0.0
            cells = [
                _ratio(gpu + tier_hit, base["prefix_cache_hit_rate"] or 0.0),
                _ratio(s["request_throughput"], base["summary"]["request_throughput"]),
                _ratio(row["goodput_rps"], base["goodput_rps"]),
                _ratio(row["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
                _ratio(row["ttft_ms"]["p95"], base["ttft_ms"]["p95"]),
            ]
            print(f"{row['rate_rps']:>5g} {row['name']:<17} {gpu:>8.1%} {tier_hit:>8.1%} "
                  f"{s['request_throughput']:>7.2f} {row['goodput_rps']:>8.2f} "
                  f"{row['ttft_ms']['p50']:>9,.0f} {row['ttft_ms']['p95']:>9,.0f}   "
                  + " ".join(cells))  # fmt: skip
    print(f"({wall:.0f} s wall)", file=sys.stderr)
    if args.tier_max_rate:
        _tier_max_rate(args, slo, layouts)
    return rows


def _tier_max_rate(args: argparse.Namespace, slo: PercentileSlo, layouts: list[Layout]) -> None:
    """Throughput as DistServe-style capacity: the highest rate of the trace at which
    90% of requests meet the SLO, per tier size (``--tier-duration`` s per probe)."""
    setup = DisaggSetup(args.tier_gpu, args.tier_model, 1, "bf16", slo,
                        duration_s=args.tier_duration)  # fmt: skip
    items = [(setup, lay, "mooncake", 2.0) for lay in layouts]
    started = time.perf_counter()
    results = run_all(_max_rate, items, jobs=args.jobs, label="tier max rate")
    wall = time.perf_counter() - started
    base = results[0]["max_rate"]
    print(f"highest req/s with >= {ATTAINMENT:.0%} of requests within {args.tier_slo} "
          f"({args.tier_duration:g} s of the trace per probe):")  # fmt: skip
    for r in results:
        print(f"  {r['layout']:<17} {r['max_rate']:6.2f} req/s  {_ratio(r['max_rate'], base)}")
    print(f"({wall:.0f} s wall, {sum(len(r['probes']) for r in results)} runs)", file=sys.stderr)


def _max_rate(item: tuple[DisaggSetup, Layout, str, float]) -> dict[str, Any]:
    """Highest rate (req/s) whose run keeps >= 90% of requests within the SLO."""
    setup, layout, spec, start = item
    probes: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        summary = simulate_layout(LayoutRun(setup, layout, spec, rate))
        probes.append((rate, float(summary.get("slo_attainment") or 0.0)))
        return probes[-1][1] >= ATTAINMENT

    low, high, rate = 0.0, math.inf, start
    while len(probes) < 12 and (high == math.inf or low == 0.0 or high / low > 1.05):
        if ok(rate):
            low = rate
        else:
            high = rate
        rate = rate * 2 if high == math.inf else rate / 2 if low == 0.0 else math.sqrt(low * high)
    return {"layout": layout.name, "spec": spec, "max_rate": low, "probes": probes}


def max_rate(args: argparse.Namespace) -> None:
    setup = DisaggSetup(
        args.gpu, args.model, 1, "bf16", parse_percentile_slo(args.slo), kv_link=args.kv_link,
        duration_s=args.duration,
    )  # fmt: skip
    layouts = [lay for lay in layouts_for(args.replicas, ratios=((1, 1), (2, 1), (1, 2)),
                                          cpu_gibs=())]  # fmt: skip
    specs = [f"synthetic:input=fixed({n}),output=fixed({args.output})" for n in args.max_rate_lens]
    items = [(setup, lay, spec, float(args.replicas)) for spec in specs for lay in layouts]
    started = time.perf_counter()
    results = run_all(_max_rate, items, jobs=args.jobs, label="max rate")
    wall = time.perf_counter() - started
    print(f"\n3. DistServe's goodput: highest req/s per GPU with >= {ATTAINMENT:.0%} of requests "
          f"within {args.slo} ({args.replicas} x {args.gpu}, output {args.output}); "
          "ratio to colocated")  # fmt: skip
    print(f"{'prompt':>8} " + " ".join(f"{lay.name:>16}" for lay in layouts))
    for i, n in enumerate(args.max_rate_lens):
        row = results[i * len(layouts) : (i + 1) * len(layouts)]
        base = row[0]["max_rate"]
        cells = [f"{r['max_rate'] / args.replicas:7.3f} ({_ratio(r['max_rate'], base)})"
                 for r in row]  # fmt: skip
        print(f"{n:>8} " + " ".join(f"{c:>16}" for c in cells))
    print(f"({wall:.0f} s wall, {sum(len(r['probes']) for r in results)} runs)", file=sys.stderr)


def main() -> None:
    args = _args()
    if not args.no_crossover:
        crossover(args)
    if not args.no_max_rate:
        max_rate(args)
    if not args.no_tier:
        tier(args)


if __name__ == "__main__":
    main()
