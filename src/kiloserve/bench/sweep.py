"""Single-backend sweep (S4.3): run the same workload at growing concurrency (or rate)
and find the knee, where throughput stops growing.

Gain per doubling between consecutive points ``a < b`` is
``(thr_b / thr_a) ** (1 / log2(b / a)) - 1``; the knee is the first point ``a`` after
which that gain falls below ``min_gain_per_doubling`` (10% by default): going higher
only adds latency. If throughput still grows at the last point, the knee is that
point and ``is_saturated`` is false (extend the sweep). Each point uses seed
``seed + i`` so its prompts are fresh text (a warm prefix cache from the previous
point would flatter TTFT); lengths and arrivals keep the same distributions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiloserve.bench.client import ClientOptions, ProgressHook, run_bench
from kiloserve.errors import ConfigError
from kiloserve.results import plots
from kiloserve.results.metrics import SCHEMA_VERSION, Slo, summarize
from kiloserve.results.report import write_json, write_report
from kiloserve.results.tables import fmt
from kiloserve.workload import ClosedLoop, OpenLoop, Workload

__all__ = [
    "SWEEP_PARAMETERS",
    "SweepPoint",
    "find_knee",
    "parse_sweep",
    "run_sweep",
    "sweep_markdown",
    "write_sweep",
]

SWEEP_PARAMETERS = ("concurrency", "rate")
DEFAULT_MIN_GAIN_PER_DOUBLING = 0.10


@dataclass(slots=True)
class SweepPoint:
    """One sweep point: the swept value, its report folder and its summary."""

    value: float
    out_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, float]:
        s = self.summary
        return {
            "value": self.value,
            "request_throughput": float(s["request_throughput"]),
            "output_token_throughput": float(s["output_token_throughput"]),
            "tpot_p50_ms": _stat(s, "tpot_ms", "p50"),
            "tpot_p95_ms": _stat(s, "tpot_ms", "p95"),
            "ttft_p50_ms": _stat(s, "ttft_ms", "p50"),
            "ttft_p95_ms": _stat(s, "ttft_ms", "p95"),
            "e2e_p95_ms": _stat(s, "e2e_ms", "p95"),
            "error_rate": float(s["error_rate"]),
        }


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """``concurrency=1,2,4,8`` or ``rate=1,2,4`` -> (parameter, ascending values)."""
    name, sep, rest = "".join(text.split()).partition("=")
    if name not in SWEEP_PARAMETERS or not sep:
        raise ConfigError(f"bad --sweep {text!r}; expected concurrency=1,2,4 or rate=1,2,4")
    try:
        values = [float(v) for v in rest.split(",") if v]
    except ValueError:
        raise ConfigError(f"--sweep values must be numbers, got {rest!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError("--sweep needs at least one value, all > 0")
    if name == "concurrency" and any(v != int(v) for v in values):
        raise ConfigError("concurrency values must be integers")
    return name, sorted(set(values))


async def run_sweep(
    url: str,
    model: str,
    make_workload: Callable[[int, float], Workload],
    parameter: str,
    values: Sequence[float],
    out_dir: str | Path,
    *,
    options: ClientOptions | None = None,
    duration_s: float | None = None,
    slo: Slo | None = None,
    command: Sequence[str] | None = None,
    on_point: Callable[[float], ProgressHook | None] | None = None,
    plot: bool = True,
) -> list[SweepPoint]:
    """Run one bench per value (``make_workload(index, value)`` builds its workload);
    write each point's report under ``out_dir/<parameter>_<value>/``."""
    points: list[SweepPoint] = []
    for i, value in enumerate(values):
        workload = make_workload(i, value)
        arrival = ClosedLoop(int(value)) if parameter == "concurrency" else OpenLoop()
        hook = on_point(value) if on_point is not None else None
        result = await run_bench(
            url, model, workload, arrival, options=options, duration_s=duration_s,
            on_progress=hook,
        )  # fmt: skip
        point = SweepPoint(value, Path(out_dir) / f"{parameter}_{value:g}")
        point.summary = summarize(result, slo, command=command)
        write_report(point.out_dir, result, point.summary, plot=plot)
        points.append(point)
    return points


def find_knee(
    rows: Sequence[dict[str, float]], min_gain_per_doubling: float = DEFAULT_MIN_GAIN_PER_DOUBLING
) -> dict[str, Any]:
    """The knee of a sweep (see module docstring) and the gain per doubling per point."""
    if not rows:
        raise ConfigError("a sweep needs at least one point")
    gains: list[float | None] = [None]
    knee_index = None
    for a, b in itertools.pairwise(rows):
        gain = _gain_per_doubling(a, b)
        gains.append(gain)
        if knee_index is None and gain < min_gain_per_doubling:
            knee_index = len(gains) - 2
    is_saturated = knee_index is not None
    index = knee_index if knee_index is not None else len(rows) - 1
    return {
        "value": rows[index]["value"],
        "output_token_throughput": rows[index]["output_token_throughput"],
        "tpot_p50_ms": rows[index]["tpot_p50_ms"],
        "is_saturated": is_saturated,
        "min_gain_per_doubling": min_gain_per_doubling,
        "gain_per_doubling": gains,
    }


def _gain_per_doubling(a: dict[str, float], b: dict[str, float]) -> float:
    thr_a, thr_b = a["output_token_throughput"], b["output_token_throughput"]
    if thr_a <= 0:
        return math.inf if thr_b > 0 else 0.0
    doublings = math.log2(b["value"] / a["value"])
    return float((thr_b / thr_a) ** (1.0 / doublings) - 1.0)


def write_sweep(
    out_dir: str | Path,
    parameter: str,
    points: Sequence[SweepPoint],
    meta: dict[str, Any],
    *,
    plot: bool = True,
) -> dict[str, Any]:
    """Write ``sweep.json`` (for the planner), ``sweep.md`` and the latency/throughput plot."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [p.row() for p in points]
    knee = find_knee(rows)
    data = {"schema_version": SCHEMA_VERSION, "parameter": parameter, **meta,
            "points": rows, "knee": knee}  # fmt: skip
    write_json(out / "sweep.json", data)
    (out / "sweep.md").write_text(sweep_markdown(parameter, rows, knee))
    if plot and plots.is_available():
        knee_thr = knee["output_token_throughput"] if knee["is_saturated"] else None
        plots.plot_sweep(out / "sweep.png", rows, parameter=parameter, knee=knee_thr)
    return data


def sweep_markdown(parameter: str, rows: Sequence[dict[str, float]], knee: dict[str, Any]) -> str:
    """The baseline table: TPOT and throughput per point, and the knee."""
    lines = [f"# Sweep over {parameter}", ""]
    lines += [f"| {parameter} | TPOT P50 (ms) | TPOT P95 (ms) | TTFT P50 (ms) | "
              "output tok/s | req/s | gain/doubling |", "|---" * 7 + "|"]  # fmt: skip
    for row, gain in zip(rows, knee["gain_per_doubling"], strict=True):
        cells = [row["tpot_p50_ms"], row["tpot_p95_ms"], row["ttft_p50_ms"],
                 row["output_token_throughput"], row["request_throughput"]]  # fmt: skip
        gain_text = "-" if gain is None else f"{gain:+.0%}"
        lines.append(f"| {row['value']:g} | " + " | ".join(fmt(c) for c in cells)
                     + f" | {gain_text} |")  # fmt: skip
    state = "throughput stops growing" if knee["is_saturated"] else "still growing: extend"
    lines += ["", f"Knee: {parameter} = {knee['value']:g} "
              f"({fmt(knee['output_token_throughput'])} tok/s; {state})."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _stat(summary: dict[str, Any], key: str, stat: str) -> float:
    value = (summary.get(key) or {}).get(stat)
    return float(value) if value is not None else math.nan
