"""PNG plots with matplotlib (optional: without it, ``is_available()`` is False and
callers skip plots and say so).

Uses ``matplotlib.figure.Figure`` directly (no pyplot global state, no GUI backend).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["is_available", "plot_backend_p95", "plot_cdfs", "plot_sweep"]


def is_available() -> bool:
    """True when matplotlib can be imported."""
    return importlib.util.find_spec("matplotlib") is not None


def _figure(width_in: float = 7.0, height_in: float = 4.5) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width_in, height_in), layout="tight")


def plot_cdfs(
    path: Path, series_ms: Mapping[str, Sequence[float]], *, title: str, xlabel: str
) -> Path | None:
    """Overlaid empirical CDFs, one line per label; None if there is nothing to plot."""
    if not any(len(v) for v in series_ms.values()):
        return None
    fig = _figure()
    ax = fig.subplots()
    for label, values in series_ms.items():
        if not len(values):
            continue
        xs = np.sort(np.asarray(values, dtype=float))
        ys = np.arange(1, xs.size + 1) / xs.size
        ax.step(xs, ys, where="post", label=f"{label} (n={xs.size})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize="small")
    fig.savefig(path, dpi=110)
    return path


def plot_backend_p95(
    path: Path, p95_ms: Mapping[str, Mapping[str, float]], *, title: str
) -> Path | None:
    """Grouped bars: per backend, one bar per metric (e.g. TTFT and E2E P95)."""
    backends = sorted({b for values in p95_ms.values() for b in values})
    if not backends:
        return None
    fig = _figure(max(6.0, 0.6 * len(backends) + 3), 4.5)
    ax = fig.subplots()
    width = 0.8 / max(1, len(p95_ms))
    xs = np.arange(len(backends))
    for i, (metric, values) in enumerate(p95_ms.items()):
        heights = [values.get(b, 0.0) for b in backends]
        ax.bar(xs + i * width, heights, width, label=metric)
    ax.set_xticks(xs + width * (len(p95_ms) - 1) / 2, backends, rotation=30, ha="right")
    ax.set_ylabel("P95 latency (ms)")
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


def plot_sweep(
    path: Path, points: Sequence[Mapping[str, float]], *, parameter: str, knee: float | None
) -> Path | None:
    """Latency (TPOT and TTFT P50) against output-token throughput across a sweep."""
    if not points:
        return None
    fig = _figure()
    ax = fig.subplots()
    xs = [p["output_token_throughput"] for p in points]
    for key, label in (("tpot_p50_ms", "TPOT P50"), ("ttft_p50_ms", "TTFT P50")):
        ax.plot(xs, [p[key] for p in points], marker="o", label=label)
    for p in points:
        ax.annotate(f"{parameter}={p['value']:g}", (p["output_token_throughput"], p["tpot_p50_ms"]),
                    fontsize="x-small", textcoords="offset points", xytext=(4, 4))  # fmt: skip
    if knee is not None:
        ax.axvline(knee, color="grey", linestyle="--", label="knee")
    ax.set_yscale("log")
    ax.set_xlabel("output token throughput (tok/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"latency vs throughput ({parameter} sweep)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path
