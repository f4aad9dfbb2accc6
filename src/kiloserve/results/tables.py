"""Markdown tables for one run (``summary.md``) and for several runs side by side."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["comparison_markdown", "fmt", "prefix_cache_text", "summary_markdown"]

_LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
_STATS = ("mean", "p50", "p90", "p95", "p99")
# (label, key path, lower is better)
_COMPARE_ROWS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("TTFT P50 (ms)", ("ttft_ms", "p50"), True),
    ("TTFT P95 (ms)", ("ttft_ms", "p95"), True),
    ("TTFT P99 (ms)", ("ttft_ms", "p99"), True),
    ("TPOT P50 (ms)", ("tpot_ms", "p50"), True),
    ("TPOT P95 (ms)", ("tpot_ms", "p95"), True),
    ("ITL P95 (ms)", ("itl_ms", "p95"), True),
    ("E2E P50 (ms)", ("e2e_ms", "p50"), True),
    ("E2E P95 (ms)", ("e2e_ms", "p95"), True),
    ("E2E P99 (ms)", ("e2e_ms", "p99"), True),
    ("P95 std across backends (ms)", ("p95_std_across_backends_ms",), True),
    ("request throughput (req/s)", ("request_throughput",), False),
    ("output throughput (tok/s)", ("output_token_throughput",), False),
    ("goodput (req/s)", ("goodput",), False),
    ("error rate", ("error_rate",), True),
    ("requests ok", ("requests_ok",), False),
    ("requests failed", ("requests_failed",), True),
    ("timeouts (in failed)", ("timeouts",), True),
)


def fmt(value: object, digits: int = 1) -> str:
    """A number for a table; ``-`` for missing values."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}" if abs(value) >= 0.01 or value == 0 else f"{value:.2e}"


def prefix_cache_text(summary: Mapping[str, Any]) -> str | None:
    """``43.2% (gateway, 2 backends; 1200 of 2778 tokens)``; None without a
    ``prefix_cache`` block (the engines' counters were not readable)."""
    block = summary.get("prefix_cache")
    if not isinstance(block, Mapping):
        return None
    rate = block.get("hit_rate")
    text = "n/a" if not isinstance(rate, int | float) else f"{rate:.1%}"
    where = [str(block["source"])] if block.get("source") else []
    if isinstance(block.get("backends"), int) and block.get("source") == "gateway":
        where[-1] += f", {block['backends']} backends"
    tokens = f"{block.get('hits_tokens')} of {block.get('queries_tokens')} tokens"
    text += f" ({'; '.join([*where, tokens])})"
    return text + (f"; {block['note']}" if block.get("note") else "")


def summary_markdown(summary: Mapping[str, Any]) -> str:
    """``summary.md`` for one run."""
    lines = [f"# kiloserve bench: {summary.get('workload', {}).get('name', '?')}", ""]
    lines += [*_provenance(summary), "", "## Latency (ms)", ""]
    lines += ["| metric | " + " | ".join(_STATS) + " |", "|---" * (len(_STATS) + 1) + "|"]
    for name, key in _LATENCIES:
        stats = summary.get(key) or {}
        lines.append(f"| {name} | " + " | ".join(fmt(stats.get(s)) for s in _STATS) + " |")
    lines += ["", "## Throughput and errors", "", *_totals(summary)]
    lines += _backends(summary)
    for key in ("client_warning", "dispatch_warning"):
        if summary.get(key):
            lines += ["", f"**Warning:** {summary[key]}"]
    errors = summary.get("errors") or {}
    if errors:
        lines += ["", "## Errors", ""] + [f"- {n} x `{msg}`" for msg, n in errors.items()]
    return "\n".join(lines) + "\n"


def _provenance(summary: Mapping[str, Any]) -> list[str]:
    command = summary.get("command")
    config = summary.get("config") or {}
    stopped = ["- **stopped early** (Ctrl-C): fewer requests than planned"]
    return (stopped if config.get("stopped_early") else []) + [
        f"- command: `{' '.join(command)}`" if command else "- command: (library call)",
        f"- url: {config.get('url')}, model: {config.get('model')}, "
        f"endpoint: {config.get('endpoint')}, arrival: {config.get('arrival')}",
        f"- seed: {summary.get('seed')}, config hash: `{summary.get('config_hash')}`, "
        f"workload digest: `{str(summary.get('workload_digest'))[:16]}`",
    ]


def _totals(summary: Mapping[str, Any]) -> list[str]:
    rows = [
        ("duration (s)", fmt(summary.get("duration_s"), 2)),
        ("requests ok / failed / timeouts",
         f"{summary.get('requests_ok')} / {summary.get('requests_failed')} / "
         f"{summary.get('timeouts')}"),
        ("error rate", fmt(summary.get("error_rate"), 4)),
        ("request throughput (req/s)", fmt(summary.get("request_throughput"), 2)),
        ("output token throughput (tok/s)", fmt(summary.get("output_token_throughput"))),
        ("total token throughput (tok/s)", fmt(summary.get("total_token_throughput"))),
    ]  # fmt: skip
    if "goodput" in summary:
        rows.append((f"goodput (req/s) under {summary.get('slo')}", fmt(summary["goodput"], 2)))
        rows.append(("SLO attainment", fmt(summary.get("slo_attainment"), 3)))
    cache = prefix_cache_text(summary)
    if cache is not None:
        rows.append(("prefix-cache hit rate (engine counters)", cache))
    lag = summary.get("client_lag_ms") or {}
    lag_text = f"{fmt(lag.get('p99'))} / {fmt(lag.get('max'))}"
    rows.append(("client loop lag p99 / max (ms)", lag_text))
    return ["| quantity | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]


def _backends(summary: Mapping[str, Any]) -> list[str]:
    per_backend = summary.get("per_backend") or {}
    if not per_backend:
        return []
    lines = ["", "## Per backend", ""]
    lines += ["| backend | requests | failed | TTFT P95 | TPOT P95 | E2E P50 | E2E P95 |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for name, b in per_backend.items():
        cells = [b["ttft_ms"]["p95"], b["tpot_ms"]["p95"], b["e2e_ms"]["p50"], b["e2e_ms"]["p95"]]
        lines.append(
            f"| {name} | {b.get('count')} | {b.get('requests_failed')} | "
            + " | ".join(fmt(c) for c in cells) + " |"
        )  # fmt: skip
    std = summary.get("p95_std_across_backends_ms")
    lines += ["", f"Std-dev of per-backend E2E P95: {fmt(std)} ms"]
    return lines


def comparison_markdown(summaries: Mapping[str, Mapping[str, Any]], *, title: str) -> str:
    """A table with one column per run and ratios against the first run."""
    labels = list(summaries)
    if not labels:
        return f"# {title}\n\n(no runs)\n"
    base = summaries[labels[0]]
    lines = [f"# {title}", "", f"Ratios are against `{labels[0]}` (lower is better for "
             "latency and errors, higher for throughput).", ""]  # fmt: skip
    lines += ["| metric | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name, path, _ in _COMPARE_ROWS:
        first = _get(base, path)
        cells = [fmt(first)] + [_with_ratio(_get(summaries[lb], path), first) for lb in labels[1:]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    digests = {str(s.get("workload_digest")) for s in summaries.values()}
    same = "identical" if len(digests) == 1 else "DIFFERENT"
    lines += ["", f"Request sequences: {same} across runs (workload digest)."]
    return "\n".join(lines) + "\n"


def _get(summary: Mapping[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value  # counts stay ints ("6", not "6.0")


def _with_ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return fmt(value)
    return f"{fmt(value)} ({value / base:.2f}x)"
