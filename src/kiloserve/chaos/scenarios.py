"""The drill scenarios: how each fault is injected and cleared, and how the gateway's
reaction is recognised (detected / recovered), read from ``/admin/backends`` and
``/metrics``.

* ``kill``             SIGKILL one backend; restart it after the fault window
* ``hang``             the backend accepts and never answers (twin fault ``hang``)
* ``slow``             every step 4x slower (twin fault ``slowdown: 4``)
* ``errors``           half the requests answer 500
* ``stall``            streams go silent after 5 tokens (twin fault ``stall_after_tokens``)
* ``flap``             killed and restarted every ``flap_period_s`` during the window
                       (at least twice)
* ``etcd-down``        the registry (etcd) is stopped for the window (etcd mode)
* ``rolling-restart``  every backend in turn: drain, restart, wait healthy, undrain
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kiloserve.chaos.env import DrillEnv
from kiloserve.chaos.report import Timeline

__all__ = ["SCENARIOS", "DrillOptions", "Scenario"]


@dataclass(frozen=True, slots=True)
class DrillOptions:
    concurrency: int = 8
    max_tokens: int = 32
    before_s: float = 5.0
    fault_s: float = 10.0
    after_s: float = 5.0
    flap_period_s: float = 2.0
    victim: int = 0
    seed: int = 0


Check = Callable[[DrillEnv, str], Awaitable[bool]]
Fault = Callable[[DrillEnv, str, DrillOptions, Timeline], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    fault: Fault
    detected: Check | None
    recovered: Check
    needs_etcd: bool = False


def _is_full(row: dict[str, Any]) -> bool:
    return bool(row["routable"]) and row["effective_weight"] >= 1.0 - 1e-9


async def _unhealthy(env: DrillEnv, victim: str) -> bool:
    row = (await env.backends()).get(victim)
    return row is None or not row["healthy"]


async def _demoted(env: DrillEnv, victim: str) -> bool:
    row = (await env.backends()).get(victim)
    return row is not None and row["effective_weight"] < 1.0 - 1e-9


async def _back(env: DrillEnv, victim: str) -> bool:
    row = (await env.backends()).get(victim)
    return row is not None and _is_full(row)


async def _all_back(env: DrillEnv, victim: str) -> bool:
    rows = await env.backends()
    return len(rows) == len(env.names()) and all(_is_full(r) for r in rows.values())


async def _registry_down(env: DrillEnv, victim: str) -> bool:
    """Every worker of the gateway sees the registry down (one series per worker)."""
    up = await env.metric_values("kiloserve_gateway_registry_up")
    return bool(up) and max(up) == 0.0


async def _registry_up(env: DrillEnv, victim: str) -> bool:
    """Every worker of the gateway sees it up again."""
    up = await env.metric_values("kiloserve_gateway_registry_up")
    return bool(up) and min(up) == 1.0


async def _twin_fault(
    body: dict[str, Any], env: DrillEnv, victim: str, o: DrillOptions, t: Timeline
) -> None:
    t.hits_s.append(time.monotonic())
    await env.faults(victim, body)
    await asyncio.sleep(o.fault_s)
    await env.faults(victim, {})
    t.clear_s = time.monotonic()


def _twin(body: dict[str, Any]) -> Fault:
    async def fault(env: DrillEnv, victim: str, o: DrillOptions, t: Timeline) -> None:
        await _twin_fault(body, env, victim, o, t)

    return fault


async def _kill(env: DrillEnv, victim: str, o: DrillOptions, t: Timeline) -> None:
    t.hits_s.append(time.monotonic())
    env.kill(victim)
    await asyncio.sleep(o.fault_s)
    await env.restart(victim)
    t.clear_s = time.monotonic()


async def _flap(env: DrillEnv, victim: str, o: DrillOptions, t: Timeline) -> None:
    until_s = time.monotonic() + o.fault_s
    while len(t.hits_s) < 2 or time.monotonic() < until_s:  # a flap is at least two downs
        t.hits_s.append(time.monotonic())
        env.kill(victim)
        await asyncio.sleep(o.flap_period_s)
        await env.restart(victim)
        await asyncio.sleep(o.flap_period_s)
    t.clear_s = time.monotonic()


async def _etcd_down(env: DrillEnv, victim: str, o: DrillOptions, t: Timeline) -> None:
    if env.etcd is None:
        raise RuntimeError("etcd-down needs the etcd drill environment")
    t.hits_s.append(time.monotonic())
    await asyncio.to_thread(env.etcd.stop)
    await asyncio.sleep(o.fault_s)
    await asyncio.to_thread(env.etcd.start)
    t.clear_s = time.monotonic()


async def _wait(check: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.05)
    return False


async def _rolling(env: DrillEnv, victim: str, o: DrillOptions, t: Timeline) -> None:
    for name in env.names():
        await env.drain(name, True)

        async def idle(name: str = name) -> bool:
            return bool((await env.backends())[name]["in_flight"] == 0)

        await _wait(idle, 30.0)
        await env.restart(name, graceful=True)

        async def healthy(name: str = name) -> bool:
            return bool((await env.backends())[name]["healthy"])

        await _wait(healthy, 30.0)
        await env.drain(name, False)
    t.clear_s = time.monotonic()


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("kill", _kill, _unhealthy, _back),
        Scenario("hang", _twin({"hang": True}), _unhealthy, _back),
        Scenario("slow", _twin({"slowdown": 4.0}), _demoted, _back),
        Scenario("errors", _twin({"error_rate": 0.5, "status": 500}), _unhealthy, _back),
        Scenario("stall", _twin({"stall_after_tokens": 5}), _unhealthy, _back),
        Scenario("flap", _flap, _unhealthy, _back),
        Scenario("etcd-down", _etcd_down, _registry_down, _registry_up, needs_etcd=True),
        Scenario("rolling-restart", _rolling, None, _all_back),
    )
}
