"""The live dashboard: ``GET /dashboard`` (one page) and ``GET /dashboard/state`` (JSON).

The page (``gateway/static/dashboard.{html,js,css}``, vanilla JS, no CDN) polls
``/dashboard/state`` every ``dashboard.refresh_interval_ms`` (1 s by default) and draws
every backend (pool, GPU, health state, effective weight and why, in-flight, queue, KV
usage, TTFT/TPOT P50/P95 sparklines), per-pool totals, request and error rates, and
the recent routing decisions by policy. The numbers come from the live backend table,
the gateway's request counters and the ``DashboardRecorder`` ring buffers
(``gateway/dashboard_state.py``), ticked once a second by a task of this module.

Like the admin API without a token, the dashboard answers loopback clients only,
unless ``dashboard.allow_remote`` is set (put it behind your own auth proxy then). Like
the admin API, it refuses (403) a ``Host`` other than an IP address, localhost, the
bound host or an ``admin_allowed_hosts`` name (DNS rebinding would let a page read the
fleet's state), a cross-origin ``Origin`` and a cross-site fetch other than following a
link (``kiloserve.httpguard``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from kiloserve import __version__
from kiloserve.gateway.admin import check_browser, config_hash, host_policy, is_loopback
from kiloserve.gateway.dashboard_merge import merge_states
from kiloserve.gateway.dashboard_state import DashboardRecorder, RateCounts
from kiloserve.gateway.metrics import GatewayMetrics
from kiloserve.gateway.proxy import ProxyContext
from kiloserve.gateway.worker_metrics import WorkerMetrics
from kiloserve.httpguard import HostPolicy
from kiloserve.policies.base import Decision, Outcome, RequestInfo
from kiloserve.routing.table import BackendRecord

__all__ = [
    "DASHBOARD_SIBLINGS_KEY",
    "STATIC_FILES",
    "Describe",
    "add_dashboard_routes",
    "build_state",
    "health_of",
    "rate_counts",
]

STATIC_FILES = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_MAX_NUM_RECENT_DECISIONS = 25
_TICK_INTERVAL_S = 1.0
_TASKS_KEY = web.AppKey("kiloserve_dashboard_tasks", list)
# --workers N: the sibling workers, whose own states the served one merges in
DASHBOARD_SIBLINGS_KEY = web.AppKey("kiloserve_dashboard_siblings", WorkerMetrics)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Describe = Callable[[str, float], Mapping[str, Any]]


def _is_error_status(status: str) -> bool:
    return status.isdigit() and (int(status) >= 500 or int(status) == 429)


def rate_counts(metrics: GatewayMetrics) -> dict[str, RateCounts]:
    """Cumulative requests and errors (5xx or 429) per model from the gateway counters."""
    totals: dict[str, list[int]] = {}
    for (model, _backend, status), n in metrics.requests.items():
        acc = totals.setdefault(model, [0, 0])
        acc[0] += n
        if _is_error_status(status):
            acc[1] += n
    return {m: RateCounts(req, err) for m, (req, err) in totals.items()}


_DEMOTION_WHY = {
    "tpot_abs": "TPOT median over the absolute limit",
    "ttft_abs": "TTFT median over the absolute limit",
    "tpot_pool": "TPOT median far above the rest of its pool",
}


def _unhealthy_why(rec: BackendRecord, ft: Mapping[str, Any]) -> tuple[str, str]:
    if "ejected" in rec.vetoes:
        if ft.get("breaker") == "half_open":
            return "ejected", "circuit half-open: the next request is its trial"
        cause = ft.get("last_ejection_reason") or "consecutive failures"
        left_s = float(ft.get("ejected_for_s") or 0.0)
        return "ejected", f"outlier ejection ({cause}); {left_s:.1f} s left"
    if "probe" in rec.vetoes:
        return "down", "active health probes fail"
    error = f": {rec.last_scrape_error}" if rec.last_scrape_error else ""
    return "down", f"{rec.num_scrape_failures} failed scrapes in a row{error}"


def health_of(
    rec: BackendRecord, now_s: float, ft: Mapping[str, Any] | None = None
) -> tuple[str, str]:
    """``(state, why)``: down, ejected, draining, demoted, stale or healthy, and why.

    ``ft`` is the fault-tolerance layer's description of the backend
    (``Resilience.describe``), when the gateway has one.
    """
    s, ft = rec.state, ft or {}
    if not s.healthy:
        return _unhealthy_why(rec, ft)
    if s.draining:
        return "draining", "drained through the admin API; no new requests"
    if s.effective_weight <= 0.0:
        return "ejected", "effective weight 0: no new requests"
    if ft.get("demoted"):
        if ft.get("recovering"):
            return "recovering", "slow start after a demotion: weight ramping up"
        reason = str(ft.get("demotion_reason") or "")
        return "demoted", "slow node: " + _DEMOTION_WHY.get(reason, reason or "latency")
    if s.scrape_stale:
        age = rec.last_scrape_ok_s
        since = "never scraped" if age is None else f"last good scrape {now_s - age:.1f} s ago"
        return "stale", f"load unknown ({since})"
    if s.consecutive_errors:
        return "healthy", f"{s.consecutive_errors} failed requests in a row"
    return "healthy", "all checks pass"


def _weight_why(rec: BackendRecord, ft: Mapping[str, Any]) -> str:
    s = rec.state
    if s.draining or not s.healthy:
        return f"no new requests while {'draining' if s.draining else 'unhealthy'}"
    if ft.get("demoted"):
        reason = str(ft.get("demotion_reason") or "")
        label = _DEMOTION_WHY.get(reason, reason or "slow")
        if ft.get("recovering"):
            return f"slow start back to {s.weight:g} after demotion ({label})"
        return f"demoted from {s.weight:g}: {label}"
    if s.effective_weight == 1.0:
        return "as configured"
    verb = "reduced" if s.effective_weight < 1.0 else "raised"
    return f"{verb} to {s.effective_weight:g}x the configured {s.weight:g}"


def _backend_row(
    rec: BackendRecord, now_s: float, recorder: DashboardRecorder, ft: Mapping[str, Any]
) -> dict[str, Any]:
    s = rec.state
    state, why = health_of(rec, now_s, ft)
    age = None if rec.last_scrape_ok_s is None else round(now_s - rec.last_scrape_ok_s, 3)
    return {
        "name": s.backend_id,
        "pools": sorted(s.models),
        "gpu": s.gpu,
        "group": s.group,
        "engine": rec.engine or rec.config.engine,
        "version": s.version,
        "state": state,
        "state_why": why,
        "routable": s.is_routable,
        "weight": s.weight,
        "effective_weight": s.effective_weight,
        "weight_why": _weight_why(rec, ft),
        "in_flight": s.in_flight,
        "num_running": s.num_running,
        "num_waiting": s.num_waiting,
        "kv_usage": s.kv_usage,
        "scrape_age_s": age,
        "latency_ms": recorder.latency_view(s.backend_id),
    }


def _sum_known(values: list[Any]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _pool_rows(rows: list[dict[str, Any]], recorder: DashboardRecorder) -> list[dict[str, Any]]:
    by_pool: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        for pool in row["pools"]:
            by_pool.setdefault(pool, []).append(row)
    out = []
    for pool, members in sorted(by_pool.items()):
        kv = [r["kv_usage"] for r in members if r["kv_usage"] is not None]
        req_per_s, err_per_s = recorder.pool_rates.get(pool, (0.0, 0.0))
        out.append(
            {
                "pool": pool,
                "num_backends": len(members),
                "num_routable": sum(1 for r in members if r["routable"]),
                "gpus": sorted({r["gpu"] for r in members if r["gpu"]}),
                "in_flight": sum(r["in_flight"] for r in members),
                "num_running": _sum_known([r["num_running"] for r in members]),
                "num_waiting": _sum_known([r["num_waiting"] for r in members]),
                "kv_usage_mean": sum(kv) / len(kv) if kv else None,
                "req_per_s": req_per_s,
                "err_per_s": err_per_s,
            }
        )
    return out


def _decisions_view(recorder: DashboardRecorder) -> dict[str, Any]:
    recent = [
        {
            "t_wall_s": d.t_wall_s,
            "request_id": d.request_id,
            "model": d.model,
            "policy": d.policy,
            "backend": d.backend_id,
            "num_candidates": d.num_candidates,
            "reason": d.reason,
        }
        for d in recorder.recent_decisions(_MAX_NUM_RECENT_DECISIONS)
    ]
    shares = [{"policy": p, "backend": b, "count": n} for p, b, n in recorder.decision_shares()]
    return {"num_buffered": len(recorder.decisions), "recent": recent, "by_policy": shares}


def _totals(
    rows: list[dict[str, Any]], recorder: DashboardRecorder, ctx: ProxyContext
) -> dict[str, Any]:
    req = recorder.request_rate[-1] if recorder.request_rate else 0.0
    err = recorder.error_rate[-1] if recorder.error_rate else 0.0
    return {
        "num_backends": len(rows),
        "num_routable": sum(1 for r in rows if r["routable"]),
        "in_flight": ctx.num_in_flight,
        "req_per_s": req,
        "err_per_s": err,
        "error_ratio": (err / req) if req else 0.0,
        "req_per_s_series": list(recorder.request_rate),
        "err_per_s_series": list(recorder.error_rate),
    }


def build_state(
    ctx: ProxyContext,
    recorder: DashboardRecorder,
    started_s: float,
    now_s: float,
    describe: Describe | None = None,
    cfg_hash: str | None = None,
) -> dict[str, Any]:
    """The JSON document behind the page (``GET /dashboard/state``); ``cfg_hash`` saves
    hashing the config on every call."""
    table = ctx.table
    rows = [
        _backend_row(table.record(b), now_s, recorder, describe(b, now_s) if describe else {})
        for b in table.backend_ids()
    ]
    return {
        "gateway": {
            "version": __version__,
            "config_hash": cfg_hash or config_hash(ctx.cfg),
            "policy": ctx.router.policy_name,
            "uptime_s": round(now_s - started_s, 1),
            "refresh_interval_ms": recorder.cfg.refresh_interval_ms,
            "window_s": recorder.cfg.window_s,
        },
        "totals": _totals(rows, recorder, ctx),
        "pools": _pool_rows(rows, recorder),
        "backends": rows,
        "decisions": _decisions_view(recorder),
    }


def _static_bytes(name: str) -> bytes:
    return (resources.files("kiloserve.gateway") / "static" / name).read_bytes()


def _guard(allow_remote: bool, policy: HostPolicy, handler: _Handler) -> _Handler:
    async def guarded(request: web.Request) -> web.StreamResponse:
        if not allow_remote and not is_loopback(request.remote):
            return web.Response(status=403, text="the dashboard is loopback-only\n")
        check_browser(request, policy)
        return await handler(request)

    return guarded


async def _tick_loop(ctx: ProxyContext, recorder: DashboardRecorder) -> None:
    while True:
        recorder.tick(time.monotonic(), ctx.table.backend_ids(), rate_counts(ctx.metrics))
        await asyncio.sleep(_TICK_INTERVAL_S)


def add_dashboard_routes(
    app: web.Application, ctx: ProxyContext, describe: Describe | None = None
) -> None:
    """Register ``/dashboard`` routes, the tick task and the completion listener when
    ``ctx.dashboard`` is set. ``describe(backend_id, now_s)`` is the fault-tolerance
    layer's view of a backend (``Resilience.describe``): ejection, demotion, probes."""
    recorder = ctx.dashboard
    if recorder is None:
        return

    def on_decision(info: RequestInfo, decision: Decision, ranked: tuple[str, ...]) -> None:
        recorder.note_decision(time.time(), info, decision, ranked)

    def on_complete(backend_id: str, _info: RequestInfo, outcome: Outcome) -> None:
        recorder.note_outcome(backend_id, time.monotonic(), outcome)

    ctx.router.decision_listeners.append(on_decision)
    ctx.router.completion_listeners.append(on_complete)
    allow_remote = recorder.cfg.allow_remote
    policy = host_policy(ctx.cfg)
    html = _static_bytes("dashboard.html")
    assets = {name: (_static_bytes(name), ctype) for name, ctype in STATIC_FILES.items()}
    started_s = time.monotonic()
    cfg_hash = config_hash(ctx.cfg)
    no_cache = {"Cache-Control": "no-cache"}

    async def page(request: web.Request) -> web.StreamResponse:
        headers = {**no_cache, "Content-Security-Policy": _CSP}
        return web.Response(body=html, content_type="text/html", headers=headers)

    async def asset(request: web.Request) -> web.StreamResponse:
        found = assets.get(request.match_info["name"])
        if found is None:
            raise web.HTTPNotFound()
        return web.Response(body=found[0], content_type=found[1], headers=no_cache)

    async def state(request: web.Request) -> web.StreamResponse:
        doc = build_state(ctx, recorder, started_s, time.monotonic(), describe, cfg_hash)
        siblings = request.app.get(DASHBOARD_SIBLINGS_KEY)
        if siblings is not None and request.query.get("local") != "1":
            doc = merge_states(doc, await siblings.sibling_json("/dashboard/state"))
        body = orjson.dumps(doc)
        return web.Response(body=body, content_type="application/json", headers=no_cache)

    app.router.add_get("/dashboard", _guard(allow_remote, policy, page))
    app.router.add_get("/dashboard/state", _guard(allow_remote, policy, state))
    app.router.add_get("/dashboard/static/{name}", _guard(allow_remote, policy, asset))
    app[_TASKS_KEY] = []
    app.on_startup.append(_make_start(ctx, recorder))
    app.on_cleanup.append(_stop)


def _make_start(
    ctx: ProxyContext, recorder: DashboardRecorder
) -> Callable[[web.Application], Awaitable[None]]:
    async def start(app: web.Application) -> None:
        app[_TASKS_KEY].append(asyncio.create_task(_tick_loop(ctx, recorder)))

    return start


async def _stop(app: web.Application) -> None:
    tasks = app[_TASKS_KEY]
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    tasks.clear()
