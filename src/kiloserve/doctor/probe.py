"""The doctor's reads (HTTP): the gateway's ``/admin/backends``, ``/admin/config`` and
``/metrics``, then each backend's TCP connect, ``GET /health`` round trip and engine
``/metrics``; the metric pages are read twice, ``window_s`` apart, for rates."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kiloserve.doctor.diagnose import (
    BackendFacts,
    EngineRead,
    Snapshot,
    engine_read,
    facts_from_reads,
    gateway_counts,
)
from kiloserve.errors import DoctorError

__all__ = ["Collected", "DoctorError", "collect"]


@dataclass
class Collected:
    snapshot: Snapshot
    gateway: dict[str, Any] = field(default_factory=dict)  # what the output's "gateway" shows


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


async def _timed_get(
    session: aiohttp.ClientSession, url: str, timeout_s: float, headers: dict[str, str]
) -> tuple[int, str, float]:
    """(status, body, ms); raises on connect errors and timeouts."""
    t0 = time.perf_counter()
    async with session.get(
        url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as r:
        body = await r.text()
    return r.status, body, 1000.0 * (time.perf_counter() - t0)


def _why(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "timeout"
    return f"{type(exc).__name__}: {exc}".strip(": ")[:120]


async def _connect_ok(url: str, timeout_s: float) -> bool:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname or "127.0.0.1", port), timeout_s
        )
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def _engine_metrics(session: aiohttp.ClientSession, url: str, timeout_s: float) -> EngineRead:
    try:
        status, body, _ = await _timed_get(session, url + "/metrics", timeout_s, {})
    except (aiohttp.ClientError, TimeoutError) as exc:
        return EngineRead(ok=False, error=_why(exc))
    if status != 200:
        return EngineRead(ok=False, error=f"status {status}")
    return engine_read(body)


async def _health(
    session: aiohttp.ClientSession, url: str, timeout_s: float, tries: int
) -> tuple[bool | None, str, float | None]:
    """(health ok, error, best round trip in ms) over ``tries`` GET /health."""
    best: float | None = None
    error = ""
    ok: bool | None = None
    for _ in range(tries):
        try:
            status, _, ms = await _timed_get(session, url + "/health", timeout_s, {})
        except (aiohttp.ClientError, TimeoutError) as exc:
            return False, _why(exc), best
        ok = status == 200
        if not ok:
            error = f"status {status}"
        best = ms if best is None else min(best, ms)
    return ok, error, best


@dataclass
class _Backend:
    row: dict[str, Any]
    connect_ok: bool = True
    health: tuple[bool | None, str, float | None] = (None, "", None)
    first: EngineRead = field(default_factory=EngineRead)
    last: EngineRead = field(default_factory=EngineRead)


async def _gateway_json(
    session: aiohttp.ClientSession, url: str, token: str | None, timeout_s: float
) -> Any:
    try:
        status, body, _ = await _timed_get(session, url, timeout_s, _headers(token))
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise DoctorError(f"cannot read {url}: {_why(exc)}") from exc
    if status != 200:
        raise DoctorError(f"{url} answered {status}: {body[:200]} (admin token? --admin-token)")
    import orjson

    return orjson.loads(body)


async def _gateway_metrics(
    session: aiohttp.ClientSession, url: str, token: str | None, timeout_s: float, tries: int
) -> dict[str, Any]:
    """The gateway's counters; a merged page (``--workers N``) that lacks a sibling's
    counters is read again (up to ``tries`` reads): one such page against a whole one
    would show a window's errors as none."""
    counts: dict[str, Any] = gateway_counts("")
    for _ in range(max(1, tries)):
        try:
            status, body, _ = await _timed_get(
                session, url + "/metrics", timeout_s, _headers(token)
            )
        except (aiohttp.ClientError, TimeoutError):
            status, body = 0, ""
        counts = gateway_counts(body if status == 200 else "")
        if not counts["missing_workers"]:
            break
    return counts


async def collect(
    gateway_url: str,
    *,
    admin_token: str | None = None,
    metrics_token: str | None = None,
    window_s: float = 1.0,
    timeout_s: float = 2.0,
    tries: int = 3,
) -> Collected:
    """Read everything (gateway first, then every backend in parallel) into a snapshot."""
    base = gateway_url.rstrip("/")
    mtoken = metrics_token or admin_token
    async with aiohttp.ClientSession() as session:
        gw_ok, gw_err, gw_rtt = await _health(session, base, timeout_s, tries)
        if gw_ok is False and gw_rtt is None:
            raise DoctorError(f"gateway {base} does not answer GET /health: {gw_err}")
        state = await _gateway_json(session, base + "/admin/backends", admin_token, timeout_s)
        config = await _gateway_json(session, base + "/admin/config", admin_token, timeout_s)
        gw_first = await _gateway_metrics(session, base, mtoken, timeout_s, tries)
        backends = [_Backend(dict(row)) for row in state.get("backends", [])]

        async def first_pass(b: _Backend) -> None:
            url = str(b.row.get("url", "")).rstrip("/")
            b.connect_ok = await _connect_ok(url, timeout_s)
            if not b.connect_ok:
                b.health = (False, "connect failed", None)
                b.first = b.last = EngineRead(ok=False, error="connect failed")
                return
            b.first, b.health = await asyncio.gather(
                _engine_metrics(session, url, timeout_s), _health(session, url, timeout_s, tries)
            )

        await asyncio.gather(*(first_pass(b) for b in backends))
        t_first = time.monotonic()
        await asyncio.sleep(max(0.0, window_s - (time.monotonic() - t_first)))

        async def second_pass(b: _Backend) -> None:
            if b.connect_ok:
                b.last = await _engine_metrics(
                    session, str(b.row.get("url", "")).rstrip("/"), timeout_s
                )

        gw_last, _ = await asyncio.gather(
            _gateway_metrics(session, base, mtoken, timeout_s, tries),
            asyncio.gather(*(second_pass(b) for b in backends)),
        )
        state2 = await _gateway_json(session, base + "/admin/backends", admin_token, timeout_s)
    rows2 = {str(r.get("name")): r for r in state2.get("backends", [])}
    facts: list[BackendFacts] = []
    for b in backends:
        row = rows2.get(str(b.row.get("name")), b.row)
        ok, err, rtt = b.health
        facts.append(
            facts_from_reads(
                row,
                first=b.first,
                last=b.last,
                gw_first=gw_first,
                gw_last=gw_last,
                connect_ok=b.connect_ok,
                health_ok=ok,
                health_error=err,
                rtt_ms=rtt,
            )
        )
    snapshot = Snapshot(
        gateway_url=base, gateway_rtt_ms=gw_rtt, window_s=window_s,
        backends=tuple(facts), queue_depth=dict(gw_last["queue"]),
    )  # fmt: skip
    gateway = {
        "url": base,
        "rtt_ms": None if gw_rtt is None else round(gw_rtt, 2),
        "health_ok": gw_ok,
        "policy": state2.get("policy"),
        "deployment": state2.get("deployment"),
        "admission": bool((config.get("admission") or {}).get("enabled", False)),
        "queue_depth": dict(gw_last["queue"]),
        "num_backends": len(facts),
    }
    return Collected(snapshot=snapshot, gateway=gateway)
