"""Report files: ``summary.json``, ``requests.jsonl``, ``summary.md``, PNG plots, and a
side-by-side comparison of several runs (used by ``kiloserve compare``).

``summary.json`` follows the versioned schema documented in docs/bench.md
(``schema_version``); ``requests.jsonl`` has one ``RequestRecord`` per line.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from kiloserve.results import plots
from kiloserve.results.records import BenchResult, RequestRecord
from kiloserve.results.tables import comparison_markdown, summary_markdown

__all__ = ["load_records", "load_summary", "write_comparison", "write_json", "write_report"]

logger = logging.getLogger(__name__)

_JSON_OPTS = orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def write_json(path: Path, data: object) -> Path:
    path.write_bytes(orjson.dumps(data, option=_JSON_OPTS) + b"\n")
    return path


def write_report(
    out_dir: str | Path, result: BenchResult, summary: dict[str, Any], *, plot: bool = True
) -> dict[str, Path]:
    """Write every report file for one run into ``out_dir``; returns name -> path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"summary.json": write_json(out / "summary.json", summary)}
    paths["requests.jsonl"] = _write_records(out / "requests.jsonl", result.records)
    md = out / "summary.md"
    md.write_text(summary_markdown(summary))
    paths["summary.md"] = md
    if plot:
        paths |= _run_plots(out, result.records, summary)
    return paths


def write_comparison(
    out_dir: str | Path,
    summaries: Mapping[str, Mapping[str, Any]],
    *,
    records: Mapping[str, Sequence[RequestRecord]] | None = None,
    title: str = "comparison",
    plot: bool = True,
) -> dict[str, Path]:
    """Side-by-side report of several runs, ratios against the first label.

    Writes ``comparison.md`` and ``comparison.json``; with ``records`` (label -> the
    run's records) also overlaid TTFT and E2E CDF plots.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "comparison.md"
    md.write_text(comparison_markdown(summaries, title=title))
    paths = {"comparison.md": md}
    paths["comparison.json"] = write_json(out / "comparison.json", dict(summaries))
    if plot and records and _plots_ok():
        for key, name in (("ttft", "TTFT"), ("e2e", "E2E latency")):
            series = {label: _values_ms(recs, key) for label, recs in records.items()}
            path = plots.plot_cdfs(
                out / f"{key}_cdf.png", series, title=f"{name} CDF: {title}", xlabel="ms"
            )
            if path is not None:
                paths[path.name] = path
    return paths


def load_summary(path: str | Path) -> dict[str, Any]:
    """Read a ``summary.json`` (or the one inside a report folder)."""
    p = Path(path)
    data = orjson.loads((p / "summary.json" if p.is_dir() else p).read_bytes())
    if not isinstance(data, dict):
        raise ValueError(f"{p}: not a summary object")
    return data


def load_records(path: str | Path) -> list[RequestRecord]:
    """Read ``requests.jsonl`` (or the one inside a report folder)."""
    p = Path(path)
    p = p / "requests.jsonl" if p.is_dir() else p
    with p.open("rb") as f:
        return [RequestRecord.from_dict(orjson.loads(line)) for line in f if line.strip()]


def _write_records(path: Path, records: Sequence[RequestRecord]) -> Path:
    with path.open("wb") as f:
        for r in records:
            f.write(orjson.dumps(r.to_dict()) + b"\n")
    return path


def _values_ms(records: Sequence[RequestRecord], key: str) -> list[float]:
    attr = "ttft_s" if key == "ttft" else "e2e_s"
    values = (getattr(r, attr) for r in records if r.is_ok)
    return [v * 1000.0 for v in values if v is not None]


def _plots_ok() -> bool:
    if plots.is_available():
        return True
    logger.warning("matplotlib is not installed: skipping plots (pip install kiloserve[plots])")
    return False


def _run_plots(
    out: Path, records: Sequence[RequestRecord], summary: Mapping[str, Any]
) -> dict[str, Path]:
    if not _plots_ok():
        return {}
    made = [
        plots.plot_cdfs(out / "ttft_cdf.png", {"all": _values_ms(records, "ttft")},
                        title="TTFT CDF", xlabel="TTFT (ms)"),
        plots.plot_cdfs(out / "e2e_cdf.png", {"all": _values_ms(records, "e2e")},
                        title="E2E latency CDF", xlabel="E2E latency (ms)"),
        plots.plot_backend_p95(out / "backend_p95.png", _backend_p95(summary),
                               title="P95 latency per backend"),
    ]  # fmt: skip
    return {p.name: p for p in made if p is not None}


def _backend_p95(summary: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {"TTFT P95": {}, "E2E P95": {}}
    for backend, block in (summary.get("per_backend") or {}).items():
        for metric, key in (("TTFT P95", "ttft_ms"), ("E2E P95", "e2e_ms")):
            value = block.get(key, {}).get("p95")
            if value is not None:
                out[metric][backend] = float(value)
    return out
