"""Fault tolerance in the live gateway, in front of real engine twins on 127.0.0.1.

Active probes find a hung twin, passive outlier detection ejects an erroring one (and
its half-open trial brings it back), a client's own 4xx never ejects, a slow twin is
demoted and recovers, and a stream cut mid-way ends with an explicit SSE error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from test_gateway_fakes import admin_backends, gateway_config, post_faults, running_gateway
from test_gateway_twins import MODEL, twins

from local_app import serve_app

FAST_HEALTH = {
    "interval_s": 0.3,
    "recheck_interval_s": 0.1,
    "timeout_s": 0.2,
    "unhealthy_threshold": 2,
    "healthy_threshold": 2,
    "jitter": 0.1,
}


_faults = post_faults
_backends = admin_backends


async def _until(check: Callable[[], Any], timeout_s: float) -> float:
    """Poll an async predicate; returns the seconds it took (fails on time-out)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await check():
            return time.monotonic() - start
        await asyncio.sleep(0.02)
    raise AssertionError(f"condition not met within {timeout_s} s")


async def _complete(s: aiohttp.ClientSession, gw: str, **kw: Any) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": "the cluster heals", "max_tokens": 4, **kw}
    async with s.post(gw + "/v1/completions", json=body) as r:
        await r.read()
        return r.status, r.headers.get("x-kiloserve-backend", "")


async def _metric(gw: str, prefix: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(gw + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


async def test_probes_find_a_hang_within_two_intervals_and_see_recovery() -> None:
    async with twins({}, {}) as servers:
        backends = [{"url": t.url, "name": f"t{i}"} for i, t in enumerate(servers)]
        cfg = gateway_config(backends, health=FAST_HEALTH)
        async with running_gateway(cfg) as gw:
            await _faults(servers[1].url, {"hang": True})

            async def t1_down() -> bool:
                return not (await _backends(gw))["t1"]["healthy"]

            took_s = await _until(t1_down, 3.0)
            assert "probe" in (await _backends(gw))["t1"]["unhealthy_reasons"]
            assert took_s <= 2 * FAST_HEALTH["interval_s"] + FAST_HEALTH["timeout_s"] + 0.2
            async with aiohttp.ClientSession() as s:
                results = [await _complete(s, gw) for _ in range(6)]
            assert results == [(200, "t0")] * 6
            await _faults(servers[1].url, {})

            async def t1_up() -> bool:
                return bool((await _backends(gw))["t1"]["healthy"])

            await _until(t1_up, 3.0)
            assert (
                await _metric(
                    gw, 'kiloserve_gateway_health_probes_total{backend="t1",result="fail"}'
                )
                >= 2
            )
            assert (
                await _metric(gw, 'kiloserve_gateway_health_probes_total{backend="t1",result="ok"}')
                >= 2
            )


async def test_probes_failing_everywhere_fall_back_to_panic_routing() -> None:
    async with twins({}, {}) as servers:
        backends = [{"url": t.url, "name": f"t{i}"} for i, t in enumerate(servers)]
        health = {**FAST_HEALTH, "timeout_s": 1e-6}  # every probe times out
        cfg = gateway_config(backends, health=health)
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:

            async def all_down() -> bool:
                return not any(r["healthy"] for r in (await _backends(gw)).values())

            await _until(all_down, 3.0)
            results = [await _complete(s, gw) for _ in range(4)]
            assert {status for status, _ in results} == {200}
            assert await _metric(gw, "kiloserve_gateway_panic_routing_total") == 4


async def test_outlier_ejects_an_erroring_backend_and_half_open_trial_restores_it() -> None:
    async with twins({}, {}, {}) as servers:
        backends = [{"url": t.url, "name": f"t{i}"} for i, t in enumerate(servers)]
        outlier = {"consecutive_gateway_failures": 3, "base_ejection_time_s": 0.5}
        cfg = gateway_config(backends, health={"enabled": False}, outlier=outlier, retries=2)
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            await _faults(servers[2].url, {"error_rate": 1.0, "status": 500})
            results = [await _complete(s, gw) for _ in range(15)]
            assert all(status == 200 for status, _ in results)  # retried elsewhere
            assert "t2" not in {b for _, b in results}
            rows = await _backends(gw)
            assert not rows["t2"]["healthy"] and rows["t0"]["healthy"] and rows["t1"]["healthy"]
            assert rows["t2"]["unhealthy_reasons"] == ["ejected"]
            assert await _metric(gw, 'kiloserve_gateway_outlier_ejections_total{backend="t2"}') == 1
            await _faults(servers[2].url, {})
            await asyncio.sleep(0.6)  # ejection over: half-open, the next request is the trial
            status, backend = await _complete(s, gw)
            assert (status, backend) == (200, "t2")
            assert (await _backends(gw))["t2"]["healthy"]


async def test_client_4xx_never_ejects() -> None:
    async with twins({}) as servers:
        backends = [{"url": servers[0].url, "name": "t0"}]
        outlier = {"consecutive_gateway_failures": 2}
        cfg = gateway_config(backends, health={"enabled": False}, outlier=outlier)
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            for _ in range(8):
                status, _ = await _complete(s, gw, max_tokens=-3)
                assert status == 400
            assert (await _backends(gw))["t0"]["healthy"]
            assert await _complete(s, gw) == (200, "t0")


async def test_slow_backend_is_demoted_then_slow_starts_back() -> None:
    async with twins({}, {}, step_s=0.004) as servers:
        backends = [{"url": t.url, "name": f"t{i}"} for i, t in enumerate(servers)]
        demotion = {
            "min_num_samples": 3,
            "window_s": 1.5,
            "slow_start_s": 0.5,
            "demoted_weight": 0.1,
        }
        cfg = gateway_config(
            backends, health={"enabled": False}, demotion=demotion, policy={"name": "least_request"}
        )
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            await _faults(servers[1].url, {"slowdown": 6.0})

            async def demoted() -> bool:
                await asyncio.gather(
                    *(_complete(s, gw, max_tokens=8, stream=True) for _ in range(4))
                )
                return bool((await _backends(gw))["t1"]["effective_weight"] < 0.2)

            await _until(demoted, 10.0)
            assert await _metric(gw, 'kiloserve_gateway_demotions_total{backend="t1"') >= 1
            assert await _metric(gw, 'kiloserve_gateway_backend_demoted{backend="t1"}') == 1
            await _faults(servers[1].url, {})

            async def restored() -> bool:
                await asyncio.gather(
                    *(_complete(s, gw, max_tokens=8, stream=True) for _ in range(4))
                )
                return bool((await _backends(gw))["t1"]["effective_weight"] == 1.0)

            await _until(restored, 10.0)


@contextlib.asynccontextmanager
async def _dying_backend() -> AsyncIterator[str]:
    """A backend that sends two SSE events, then drops the connection."""

    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(2):
            chunk = {
                "id": "x",
                "object": "text_completion",
                "choices": [{"index": 0, "text": str(i)}],
            }
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await asyncio.sleep(0.01)
        assert request.transport is not None
        request.transport.abort()
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", ok)
    app.router.add_get("/health", ok)
    async with serve_app(app) as url:
        yield url


async def test_stream_cut_mid_way_ends_with_an_sse_error_event() -> None:
    async with _dying_backend() as url:
        cfg = gateway_config([{"url": url, "name": "d0", "models": [MODEL]}])
        async with running_gateway(cfg, wait_ready=False) as gw, aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 10, "stream": True}
            async with asyncio.timeout(5.0), s.post(gw + "/v1/completions", json=body) as r:
                assert r.status == 200
                text = (await r.read()).decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
    assert len(events) == 3
    last = orjson.loads(events[-1])
    assert last["error"]["code"] == 502 and "mid-stream" in last["error"]["message"]
