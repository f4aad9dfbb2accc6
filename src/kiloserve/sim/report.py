"""Report files of one simulated run, in the bench report layout.

``summary.json`` (bench schema + simulator keys), ``summary.md`` (the bench table plus
a simulator section), ``backend_p95.png`` (up to 64 backends) and
``backend_timeseries.png`` (mean and max utilisation and KV usage over time). With
records (``keep_records``) also
``requests.jsonl``, ``routing.csv`` and the TTFT / E2E CDF plots, through
``results.report.write_report``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiloserve.results import plots
from kiloserve.results.records import BenchResult, ClientStats
from kiloserve.results.report import write_json, write_report
from kiloserve.results.tables import fmt, summary_markdown
from kiloserve.sim.run import SimResult

__all__ = ["sim_markdown", "write_sim_report"]

logger = logging.getLogger(__name__)

MAX_NUM_BACKEND_BARS = 64


def write_sim_report(out_dir: str | Path, result: SimResult, *, plot: bool = True) -> list[Path]:
    """Write one run's report into ``out_dir``; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = result.summary
    if result.records:
        write_report(out, _bench_result(result), summary, plot=plot)
        _write_routing(out / "routing.csv", result.routing)
    write_json(out / "summary.json", summary)
    (out / "summary.md").write_text(sim_markdown(summary))
    if plot and plots.is_available():
        p95 = _backend_p95(summary)
        if len(p95["E2E P95"]) <= MAX_NUM_BACKEND_BARS:  # one bar per backend: small only
            plots.plot_backend_p95(out / "backend_p95.png", p95, title="P95 latency per backend")
        _plot_timeseries(out / "backend_timeseries.png", result.timeseries)
    elif plot:
        logger.warning("matplotlib is not installed: skipping plots")
    return sorted(p for p in out.iterdir() if p.is_file())


def sim_markdown(summary: Mapping[str, Any]) -> str:
    """The bench ``summary.md`` plus what only a simulation knows."""
    rows = [
        ("simulated requests", fmt(summary.get("simulated_requests"))),
        ("simulated duration (s)", fmt(summary.get("simulated_duration_s"), 2)),
        ("wall time (s)", fmt(summary.get("sim_wall_s"), 2)),
        ("simulated requests per wall second", fmt(summary.get("requests_per_wall_s"), 0)),
        ("real-time factor (simulated s per wall s)", fmt(summary.get("real_time_factor"), 2)),
    ]
    lines = ["", "## Simulation", "", "| quantity | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    per_backend = summary.get("per_backend") or {}
    if per_backend:
        lines += ["", "| backend | mean utilisation | mean KV usage | max KV usage |"]
        lines += ["|---|---|---|---|"]
        for name, block in per_backend.items():
            cells = [block.get(k) for k in ("utilisation_mean", "kv_usage_mean", "kv_usage_max")]
            lines.append(f"| {name} | " + " | ".join(fmt(c, 3) for c in cells) + " |")
    lines += _disagg_lines(summary)
    return summary_markdown(summary) + "\n".join(lines) + "\n"


def _disagg_lines(summary: Mapping[str, Any]) -> list[str]:
    """Split counts and KV transfer times (P/D pools), tier hit rates (KV tiers)."""
    rows: list[tuple[str, str]] = []
    disagg = summary.get("disagg")
    if isinstance(disagg, Mapping):
        rows += [(f"{mode} requests", fmt(disagg.get(mode))) for mode in
                 ("split", "colocated", "fallback")]  # fmt: skip
        transfer = summary.get("kv_transfer_ms") or {}
        rows += [(f"KV transfer {p} (ms)", fmt(transfer.get(p), 1)) for p in ("p50", "p95")]
    tiers = summary.get("kv_tiers")
    if isinstance(tiers, Mapping):
        rows += [
            ("CPU tier hit rate (tokens)", fmt(tiers.get("cpu_hit_rate"), 3)),
            ("remote tier hit rate (tokens)", fmt(tiers.get("remote_hit_rate"), 3)),
            ("KV loaded from tiers (s)", fmt(tiers.get("load_s"), 3)),
        ]
    if not rows:
        return []
    lines = ["", "## Disaggregated prefill/decode and KV tiers", "", "| quantity | value |"]
    return [*lines, "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


def _bench_result(result: SimResult) -> BenchResult:
    summary = result.summary
    client = ClientStats(0.0, 0.0, 0.0, 0.0, 0)
    return BenchResult(
        records=result.records,
        duration_s=float(summary["duration_s"]),
        started_at_unix=0.0,
        client=client,
        config=dict(summary["config"]),
        workload=dict(summary["workload"]),
        workload_digest=str(summary["workload_digest"]),
    )


def _write_routing(path: Path, routing: list[tuple[str, str]]) -> None:
    lines = ["request_id,backend"] + [f"{rid},{bid}" for rid, bid in routing]
    path.write_text("\n".join(lines) + "\n")


def _backend_p95(summary: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {"TTFT P95": {}, "E2E P95": {}}
    for backend, block in (summary.get("per_backend") or {}).items():
        for metric, key in (("TTFT P95", "ttft_ms"), ("E2E P95", "e2e_ms")):
            value = (block.get(key) or {}).get("p95")
            if value is not None:
                out[metric][backend] = float(value)
    return out


def _plot_timeseries(path: Path, series: Mapping[str, Any]) -> Path | None:
    """Mean and max over backends of utilisation and KV usage, against time."""
    times = series.get("t_s") or []
    if len(times) < 2:
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 4.5), layout="tight")
    ax = fig.subplots()
    for key, label in (("utilisation", "utilisation"), ("kv_usage", "KV usage")):
        columns = list(series[key].values())
        rows = list(zip(*columns, strict=True))
        ax.plot(times, [sum(r) / len(r) for r in rows], label=f"mean {label}")
        ax.plot(times, [max(r) for r in rows], linestyle="--", label=f"max {label}")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"backends over time ({len(series['utilisation'])} backends)")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path
