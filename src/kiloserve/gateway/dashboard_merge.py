"""One dashboard for ``kiloserve gateway --workers N``: the workers' states, merged.

A browser's ``GET /dashboard/state`` reaches one worker (the kernel picks); each worker
records only the decisions and latencies of the requests it served
(``gateway/dashboard_state.py``). The worker that got the call fetches its siblings'
own documents (``/dashboard/state?local=1`` on their private loopback ports, as for
``/metrics``: ``gateway/worker_metrics.py``) and merges them with its own here:

* request and error rates (totals, per pool, and the per-second series, aligned at
  their newest point) and the gateway's in-flight count are summed;
* the backend rows' state, load and weights come from the shared table, so the
  worker's own rows stand; their latency sparklines are combined point by point:
  P50 the mean of the workers' P50s, P95 the highest P95 (percentiles of separate
  sample sets cannot be merged exactly; the highest P95 never hides a slow worker);
* recent decisions are interleaved by time (newest first, as many as one worker
  shows), the buffered count and the per-(policy, backend) shares summed.

``gateway.workers`` says how many workers the document covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["merge_states"]


def _sum_series(series: Sequence[Sequence[float]]) -> list[float]:
    """Point-wise sums of series aligned at their newest (last) point."""
    n = max((len(s) for s in series), default=0)
    out = [0.0] * n
    for s in series:
        for i, v in enumerate(reversed(s)):
            out[n - 1 - i] += v
    return [round(v, 3) for v in out]


def _merge_points(series: Sequence[Sequence[float | None]], how: str) -> list[float | None]:
    n = max((len(s) for s in series), default=0)
    out: list[float | None] = []
    for i in range(n):
        values = [s[len(s) - n + i] for s in series if len(s) - n + i >= 0]
        known = [v for v in values if v is not None]
        if not known:
            out.append(None)
        elif how == "max":
            out.append(max(known))
        else:
            out.append(round(sum(known) / len(known), 2))
    return out


def _merge_latency(views: Sequence[dict[str, list[float | None]]]) -> dict[str, Any]:
    return {
        key: _merge_points([v.get(key, []) for v in views], "max" if key.endswith("95") else "mean")
        for key in ("ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95")
    }


def _merge_totals(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    totals = dict(docs[0]["totals"])
    req = sum(d["totals"]["req_per_s"] for d in docs)
    err = sum(d["totals"]["err_per_s"] for d in docs)
    totals.update(
        in_flight=sum(d["totals"]["in_flight"] for d in docs),
        req_per_s=round(req, 3),
        err_per_s=round(err, 3),
        error_ratio=(err / req) if req else 0.0,
        req_per_s_series=_sum_series([d["totals"]["req_per_s_series"] for d in docs]),
        err_per_s_series=_sum_series([d["totals"]["err_per_s_series"] for d in docs]),
    )
    return totals


def _merge_pools(docs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    rates: dict[str, tuple[float, float]] = {}
    for d in docs:
        for row in d["pools"]:
            req, err = rates.get(row["pool"], (0.0, 0.0))
            rates[row["pool"]] = (req + row["req_per_s"], err + row["err_per_s"])
    out = []
    for row in docs[0]["pools"]:
        req, err = rates.get(row["pool"], (0.0, 0.0))
        out.append({**row, "req_per_s": round(req, 3), "err_per_s": round(err, 3)})
    return out


def _merge_backends(docs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    views: dict[str, list[dict[str, list[float | None]]]] = {}
    for d in docs:
        for row in d["backends"]:
            views.setdefault(row["name"], []).append(row["latency_ms"])
    return [
        {**row, "latency_ms": _merge_latency(views.get(row["name"], [row["latency_ms"]]))}
        for row in docs[0]["backends"]
    ]


def _merge_decisions(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    views = [d["decisions"] for d in docs]
    recent = sorted(
        (r for v in views for r in v["recent"]), key=lambda r: r["t_wall_s"], reverse=True
    )[: max(len(v["recent"]) for v in views)]
    shares: dict[tuple[str, str], int] = {}
    for v in views:
        for s in v["by_policy"]:
            key = (s["policy"], s["backend"])
            shares[key] = shares.get(key, 0) + s["count"]
    by_policy = [
        {"policy": p, "backend": b, "count": n}
        for (p, b), n in sorted(shares.items(), key=lambda kv: (-kv[1], kv[0]))
    ]
    return {
        "num_buffered": sum(v["num_buffered"] for v in views),
        "recent": recent,
        "by_policy": by_policy,
    }


def merge_states(own: dict[str, Any], siblings: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The gateway's document from this worker's (``own``) and its siblings'."""
    docs = [own, *siblings]
    return {
        **own,
        "gateway": {**own["gateway"], "workers": len(docs)},
        "totals": _merge_totals(docs),
        "pools": _merge_pools(docs),
        "backends": _merge_backends(docs),
        "decisions": _merge_decisions(docs),
    }
