"""``kiloserve plan --disagg``: colocated vs disaggregated prefill/decode (P/D) layouts
and CPU KV-tier sizes on the same GPU count, ranked by goodput per GPU, and the crossover.

The planner's recommended deployment (GPU, TP, quantisation; its replica count, or
``--disagg-replicas``) fixes the GPU count. On it ``layouts_for`` builds:

* ``colocated``: every engine ``role: both`` (today's cluster);
* one P/D layout per ratio P:D in ``DEFAULT_RATIOS`` (1:1, 1:2, 1:3, 1:4, 2:1): the
  replicas split ``prefill = floor(R * P / (P + D) + 0.5)`` (at least one of each
  role), named by the counts they get (``3P+9D``); ratios that round to the same
  counts are run once;
* ``colocated+cpuN``: colocated with an N GiB CPU KV tier per engine (64 and 256).

Each layout is one simulated cluster run (``kiloserve.sim.simulate``, ``duration_s``
seconds of arrivals of the workload at the rate). Goodput is the offered rate times
the share of requests that met every limit of the SLO (TTFT *and* TPOT when both are
given: ``slo_attainment``); goodput per GPU divides it by the layout's GPUs. Layouts
rank by goodput per GPU, ties by the worst percentile / limit ratio (headroom).

The crossover (``crossover_sweeps``) reruns colocated and every P/D layout over a
grid of prompt lengths (a synthetic workload, fixed prompt and the workload's mean
output, at the rate) and over a grid of rates (the workload itself); at each point
the best P/D layout is compared with colocated and the crossover is the first grid
value where it beats colocated by more than ``MIN_GAIN`` (2%), with the grid value
before it (the bracket). ``None`` when it never does: "none in range".
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kiloserve.errors import ConfigError
from kiloserve.launch.config import ClusterConfig, parse_cluster_config
from kiloserve.plan.capacity import PercentileSlo, slo_ratio, slo_violations
from kiloserve.sim.sweep import run_all

__all__ = [
    "DEFAULT_CPU_GIBS",
    "DEFAULT_RATE_FACTORS",
    "DEFAULT_RATIOS",
    "KV_LINKS",
    "MIN_GAIN",
    "DisaggSetup",
    "Layout",
    "LayoutRun",
    "Runner",
    "add_arguments",
    "beats_colocated",
    "compare_layouts",
    "crossover_block",
    "crossover_sweeps",
    "default_rates",
    "find_crossover",
    "layout_cluster",
    "layout_row",
    "layouts_for",
    "parse_list",
    "prompt_grid",
    "rank_rows",
    "simulate_layout",
]

DEFAULT_RATIOS: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (1, 3), (1, 4), (2, 1))
DEFAULT_CPU_GIBS = (64.0, 256.0)
DEFAULT_PROMPT_LENS = (256, 512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_RATE_FACTORS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
KV_LINKS = ("network", "nvlink", "pcie")
MIN_GAIN = 0.02  # "beats colocated": more than 2% more goodput per GPU
MIN_NUM_REQUESTS = 100
MAX_NUM_REQUESTS = 200_000
PERCENTILE_KEYS = ("mean", "p50", "p90", "p95", "p99")


@dataclass(frozen=True, slots=True)
class Layout:
    """Engine counts per role on one GPU type, and the CPU tier per engine (GiB)."""

    name: str
    prefill: int
    decode: int
    both: int
    kv_cpu_gib: float = 0.0
    ratio: str | None = None  # the P:D asked for (the counts may round)

    @property
    def num_replicas(self) -> int:
        return self.prefill + self.decode + self.both

    @property
    def is_disagg(self) -> bool:
        return self.prefill > 0 and self.decode > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class DisaggSetup:
    """What every layout of one comparison shares."""

    gpu: str
    model: str
    tp: int
    quant: str
    slo: PercentileSlo
    max_model_len: int | None = None
    kv_link: str = "network"
    policy: str = "default"
    seed: int = 0
    duration_s: float = 30.0


@dataclass(frozen=True, slots=True)
class LayoutRun:
    """One simulation: a layout under a workload at a rate (picklable, for ``run_all``)."""

    setup: DisaggSetup
    layout: Layout
    workload_spec: str
    rate_rps: float


Runner = Callable[[LayoutRun], Mapping[str, Any]]


def layouts_for(
    num_replicas: int,
    ratios: Sequence[tuple[int, int]] = DEFAULT_RATIOS,
    cpu_gibs: Sequence[float] = DEFAULT_CPU_GIBS,
) -> list[Layout]:
    """Colocated, the P/D splits of ``num_replicas`` (distinct counts only; none below
    two replicas) and colocated with each CPU tier size (module docstring)."""
    if num_replicas < 1:
        raise ConfigError(f"a layout needs at least one replica, got {num_replicas}")
    out = [Layout("colocated", 0, 0, num_replicas)]
    seen: set[tuple[int, int]] = set()
    for p, d in ratios:
        if p < 1 or d < 1:
            raise ConfigError(f"a P:D ratio needs both parts >= 1, got {p}:{d}")
        if num_replicas < 2:
            break
        prefill = min(num_replicas - 1, max(1, math.floor(num_replicas * p / (p + d) + 0.5)))
        decode = num_replicas - prefill
        if (prefill, decode) in seen:
            continue
        seen.add((prefill, decode))
        out.append(Layout(f"{prefill}P+{decode}D", prefill, decode, 0, ratio=f"{p}:{d}"))
    for gib in cpu_gibs:
        if not gib > 0:
            raise ConfigError(f"a CPU tier size must be > 0 GiB, got {gib:g}")
        out.append(Layout(f"colocated+cpu{gib:g}", 0, 0, num_replicas, kv_cpu_gib=float(gib)))
    return out


def layout_cluster(setup: DisaggSetup, layout: Layout) -> ClusterConfig:
    """The layout as a cluster config: one line per role (``role``, ``kv_cpu_gib`` and
    ``kv_link`` written only where they differ from the defaults)."""
    lines: list[dict[str, Any]] = []
    for role, count in (("prefill", layout.prefill), ("decode", layout.decode),
                        ("both", layout.both)):  # fmt: skip
        if count < 1:
            continue
        line: dict[str, Any] = {
            "name": role, "gpu": setup.gpu, "model": setup.model, "tp": setup.tp,
            "quant": setup.quant, "count": count, "max_model_len": setup.max_model_len,
        }  # fmt: skip
        if role != "both":
            line["role"] = role
            line["kv_link"] = setup.kv_link
        if layout.kv_cpu_gib > 0:
            line["kv_cpu_gib"] = layout.kv_cpu_gib
        lines.append(line)
    data = {"name": f"disagg-{layout.name}", "gateway": {"policy": setup.policy},
            "backends": lines}  # fmt: skip
    return parse_cluster_config(data, "<planner --disagg>")


def simulate_layout(run: LayoutRun) -> dict[str, Any]:
    """The bench-schema summary of one layout run (``kiloserve.sim.simulate``)."""
    from kiloserve.sim import simulate
    from kiloserve.workload import load_workload

    setup = run.setup
    if not run.rate_rps > 0 or not setup.duration_s > 0:
        raise ConfigError(f"need rate > 0 and duration > 0, got {run.rate_rps}, {setup.duration_s}")
    num_requests = max(MIN_NUM_REQUESTS, math.ceil(run.rate_rps * setup.duration_s))
    workload = load_workload(
        run.workload_spec,
        seed=setup.seed,
        num_requests=min(num_requests, MAX_NUM_REQUESTS),
        rate=run.rate_rps,
        with_prompts=False,
    )
    cluster = layout_cluster(setup, run.layout)
    slo = setup.slo.per_request_slo()
    return simulate(cluster, workload, setup.policy, seed=setup.seed, slo=slo).summary


def _stats(block: object) -> dict[str, float | None] | None:
    if not isinstance(block, Mapping):
        return None
    return {k: None if block.get(k) is None else float(block[k]) for k in PERCENTILE_KEYS}


def layout_row(
    layout: Layout, tp: int, rate_rps: float, summary: Mapping[str, Any], slo: PercentileSlo
) -> dict[str, Any]:
    """One layout's result (the ``layouts`` entries of disagg.json)."""
    num_gpus = layout.num_replicas * tp
    attainment = float(summary.get("slo_attainment") or 0.0)
    goodput = rate_rps * attainment
    cache = summary.get("prefix_cache")
    hit_rate = cache.get("hit_rate") if isinstance(cache, Mapping) else None
    tiers = summary.get("kv_tiers")
    ratio = slo_ratio(summary, slo)
    violations = slo_violations(summary, slo)
    return {
        **layout.to_dict(),
        "num_gpus": num_gpus,
        "rate_rps": rate_rps,
        "slo_attainment": attainment,
        "goodput_rps": goodput,
        "goodput_per_gpu": goodput / num_gpus,
        "measured_goodput_rps": summary.get("goodput"),
        "ttft_ms": _stats(summary.get("ttft_ms")),
        "tpot_ms": _stats(summary.get("tpot_ms")),
        "e2e_ms": _stats(summary.get("e2e_ms")),
        "kv_transfer_ms": _stats(summary.get("kv_transfer_ms")),
        "error_rate": float(summary.get("error_rate", 0.0)),
        "is_slo_met": not violations,
        "violations": violations,
        "slo_ratio": ratio if math.isfinite(ratio) else None,
        "prefix_cache_hit_rate": hit_rate,
        "kv_tier_hit_rate": _tier_hit_rate(tiers),
        "kv_tiers": tiers,
        "disagg": summary.get("disagg"),
        "sim_wall_s": summary.get("sim_wall_s"),
    }


def _tier_hit_rate(tiers: object) -> float | None:
    """Tokens loaded back from the CPU and remote tiers / tokens looked up in them."""
    if not isinstance(tiers, Mapping) or not tiers.get("queries_tokens"):
        return None
    hits = int(tiers.get("cpu_hit_tokens", 0)) + int(tiers.get("remote_hit_tokens", 0))
    return hits / int(tiers["queries_tokens"])


def rank_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows best first: most goodput per GPU; ties by the lower worst percentile/limit
    ratio, then the input order. Sets ``rank`` (1 = best)."""

    def key(item: tuple[int, dict[str, Any]]) -> tuple[float, float, int]:
        index, row = item
        ratio = row.get("slo_ratio")
        return -float(row["goodput_per_gpu"]), math.inf if ratio is None else ratio, index

    ranked = [row for _, row in sorted(enumerate(rows), key=key)]
    for rank, row in enumerate(ranked, 1):
        row["rank"] = rank
    return ranked


def compare_layouts(
    setup: DisaggSetup,
    layouts: Sequence[Layout],
    workload_spec: str,
    rate_rps: float,
    *,
    runner: Runner = simulate_layout,
    jobs: int | None = None,
    ray_address: str | None = None,
) -> list[dict[str, Any]]:
    """Every layout at ``rate_rps``, ranked (``rank_rows``)."""
    runs = [LayoutRun(setup, layout, workload_spec, rate_rps) for layout in layouts]
    summaries = run_all(runner, runs, jobs=jobs, ray_address=ray_address, label="disagg layouts")
    rows = [
        layout_row(run.layout, setup.tp, rate_rps, summary, setup.slo)
        for run, summary in zip(runs, summaries, strict=True)
    ]
    return rank_rows(rows)


def beats_colocated(point: Mapping[str, Any], min_gain: float = MIN_GAIN) -> bool:
    """The point's best P/D goodput per GPU beats colocated by more than ``min_gain``
    (relative; any positive goodput beats a colocated 0)."""
    colocated = float(point["colocated_goodput_per_gpu"])
    best = point.get("best_pd_goodput_per_gpu")
    if best is None:
        return False
    return (colocated <= 0 < best) or (colocated > 0 and best > colocated * (1 + min_gain))


def find_crossover(points: Sequence[Mapping[str, Any]], min_gain: float = MIN_GAIN) -> int | None:
    """Index of the first point where P/D beats colocated (``beats_colocated``); None
    if it never does."""
    return next((i for i, p in enumerate(points) if beats_colocated(p, min_gain)), None)


def crossover_block(
    what: str, unit: str, points: list[dict[str, Any]], min_gain: float = MIN_GAIN, **extra: Any
) -> dict[str, Any]:
    """The crossover for one sweep: its points, the first winning value (or None) and
    the value before it, and one honest sentence."""
    index = find_crossover(points, min_gain)
    values = [p["value"] for p in points]
    first = None if index is None else values[index]
    previous = None if not index else values[index - 1]
    wins = [p["value"] for p in points if beats_colocated(p, min_gain)]
    if index is None:
        span = f"{_num(min(values))}-{_num(max(values))} {unit}" if values else "an empty grid"
        text = f"{what}: none in range ({span}): P/D never beats colocated by > {min_gain:.0%}"
    else:
        p = points[index]
        since = f"not at {_num(previous)}" if previous is not None else "already at the first"
        text = (
            f"{what}: P/D first beats colocated at {_num(first)} {unit} ({p['best_pd']}: "
            f"{p['best_pd_goodput_per_gpu']:.3g} vs {p['colocated_goodput_per_gpu']:.3g} "
            f"good req/s per GPU; {since})"
        )
        if wins != values[index:]:
            text += "; it wins only at " + ", ".join(_num(v) for v in wins)
    return {**extra, "min_gain": min_gain, "points": points, "crossover": first,
            "previous": previous, "wins": wins, "text": text}  # fmt: skip


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:.3g}"


def _point(value: float, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    colocated = next(r for r in rows if not r["prefill"] and not r["kv_cpu_gib"])
    pd = [r for r in rows if r["prefill"] > 0]
    best = max(pd, key=lambda r: float(r["goodput_per_gpu"]), default=None)
    gpg = None if best is None else float(best["goodput_per_gpu"])
    base = float(colocated["goodput_per_gpu"])
    return {
        "value": value,
        "colocated_goodput_per_gpu": base,
        "colocated_slo_attainment": colocated["slo_attainment"],
        "best_pd": None if best is None else best["name"],
        "best_pd_goodput_per_gpu": gpg,
        "best_pd_slo_attainment": None if best is None else best["slo_attainment"],
        "gain": None if gpg is None or base <= 0 else gpg / base - 1.0,
        "goodput_per_gpu": {r["name"]: r["goodput_per_gpu"] for r in rows},
    }


def crossover_sweeps(
    setup: DisaggSetup,
    layouts: Sequence[Layout],
    workload_spec: str,
    rate_rps: float,
    *,
    prompt_lens: Sequence[int],
    rates: Sequence[float],
    mean_input_tokens: float,
    output_tokens: int,
    runner: Runner = simulate_layout,
    jobs: int | None = None,
    ray_address: str | None = None,
    min_gain: float = MIN_GAIN,
) -> dict[str, Any]:
    """Colocated and every P/D layout over prompt lengths (at ``rate_rps``) and over
    rates (``workload_spec``); the ``crossover`` object of disagg.json."""
    swept = [lay for lay in layouts if lay.kv_cpu_gib == 0]
    if not any(lay.is_disagg for lay in swept):
        raise ConfigError("the crossover needs a P/D layout: use at least 2 replicas")
    specs = [f"synthetic:input=fixed({n}),output=fixed({output_tokens})" for n in prompt_lens]
    grid = [(spec, rate_rps) for spec in specs] + [(workload_spec, r) for r in rates]
    runs = [LayoutRun(setup, lay, spec, r) for spec, r in grid for lay in swept]
    summaries = run_all(runner, runs, jobs=jobs, ray_address=ray_address, label="crossover")
    rows = [
        layout_row(run.layout, setup.tp, run.rate_rps, s, setup.slo)
        for run, s in zip(runs, summaries, strict=True)
    ]
    n = len(swept)
    points = [_point(v, rows[i * n : (i + 1) * n]) for i, v in enumerate([*prompt_lens, *rates])]
    by_prompt = crossover_block(
        "prompt length", "prompt tokens", points[: len(prompt_lens)], min_gain,
        rate_rps=rate_rps, output_tokens=output_tokens,
    )  # fmt: skip
    by_rate = crossover_block(
        "request rate", "req/s", points[len(prompt_lens) :], min_gain,
        workload=workload_spec, mean_input_tokens=mean_input_tokens,
    )  # fmt: skip
    return {"prompt_tokens": by_prompt, "rate_rps": by_rate}


def parse_list(text: str | None, flag: str, kind: Callable[[str], float]) -> list[float] | None:
    """``--flag 1,2,4``: positive numbers, or None when the flag is not given."""
    if text is None:
        return None
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise ConfigError(f"{flag} must be positive numbers, got {text!r}")
    return sorted(set(values))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--disagg`` and its options (``kiloserve plan``)."""
    a = parser.add_argument
    a("--disagg", action="store_true", help="compare P/D layouts and CPU KV tiers")
    a("--disagg-replicas", type=int, help="engines per layout (default: the plan's replicas)")
    a("--disagg-cpu-gib", help="CPU KV tier sizes per engine, GiB (64,256)")
    a("--disagg-prompt-lens", help="crossover prompt lengths (256,...,16384)")
    a("--disagg-rates", help="crossover rates, req/s (--rate x 0.25,0.5,1,1.5,2,3,4)")
    a("--kv-link", choices=KV_LINKS, default="network", help="link decode pulls KV over")


def default_rates(rate_rps: float) -> list[float]:
    """The rate grid of the crossover: ``--rate`` times ``DEFAULT_RATE_FACTORS``."""
    return [rate_rps * f for f in DEFAULT_RATE_FACTORS]


def prompt_grid(lens: Sequence[float] | None, output_tokens: int, max_len: int | None) -> list[int]:
    """Prompt lengths that fit the context with the output (the defaults when None)."""
    chosen = [int(n) for n in (lens or DEFAULT_PROMPT_LENS)]
    fits = [n for n in chosen if max_len is None or n + output_tokens <= max_len]
    if not fits:
        raise ConfigError(f"no crossover prompt length fits max_model_len {max_len}: {chosen}")
    return fits
