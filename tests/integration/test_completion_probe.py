"""The minimal-inference probe (SPEC S3.1, issue 17): on by default for vLLM-like
engines, it ejects a backend whose /health answers while its inference fails or hangs,
and its requests stay out of every user-facing count (the twin's metrics, the fakes'
request logs, the gateway's request counters)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from test_gateway_fakes import (
    FakeBackend,
    admin_backends,
    fake_backends,
    gateway_config,
    post_faults,
    running_gateway,
)
from test_gateway_twins import MODEL, twin_metrics, twins

# fast probes for the test; ``completion_probe`` is left at its default ("auto")
HEALTH = {"interval_s": 0.3, "recheck_interval_s": 0.1, "timeout_s": 0.5, "jitter": 0.1}


async def _until(check: Callable[[], Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s} s")


async def _probes(gw: str, backend: str, result: str) -> float:
    line = f'kiloserve_gateway_health_probes_total{{backend="{backend}",result="{result}"}}'
    async with aiohttp.ClientSession() as s, s.get(gw + "/metrics") as r:
        text = await r.text()
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line))


async def _health_status(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
        return r.status


async def test_failing_inference_behind_a_good_health_check_is_ejected() -> None:
    async with twins({}, {}) as (good, bad):
        backends = [{"url": good.url, "name": "good"}, {"url": bad.url, "name": "bad"}]
        cfg = gateway_config(backends, health=HEALTH)
        async with running_gateway(cfg) as gw:
            await post_faults(bad.url, {"error_rate": 1.0, "status": 500})
            assert await _health_status(bad.url) == 200  # /health alone sees nothing

            async def bad_is_out() -> bool:
                return not (await admin_backends(gw))["bad"]["healthy"]

            await _until(bad_is_out, 5.0)
            rows = await admin_backends(gw)
            assert rows["bad"]["unhealthy_reasons"] == ["probe"]
            assert rows["good"]["healthy"]
            await post_faults(bad.url, {})

            async def bad_is_back() -> bool:
                return bool((await admin_backends(gw))["bad"]["healthy"])

            await _until(bad_is_back, 5.0)


async def test_hanging_inference_behind_a_good_health_check_is_ejected() -> None:
    async with twins({}, {}) as (good, stuck):
        backends = [{"url": good.url, "name": "good"}, {"url": stuck.url, "name": "stuck"}]
        cfg = gateway_config(backends, health={**HEALTH, "completion_timeout_s": 0.5})
        async with running_gateway(cfg) as gw:
            await post_faults(stuck.url, {"slowdown": 10_000.0})  # a step takes ~20 s

            async def stuck_is_out() -> bool:
                return not (await admin_backends(gw))["stuck"]["healthy"]

            await _until(stuck_is_out, 6.0)
            assert await _health_status(stuck.url) == 200
            assert await _probes(gw, "stuck", "fail") >= 2
            assert (await admin_backends(gw))["good"]["healthy"]


async def test_probe_requests_stay_out_of_user_facing_counts() -> None:
    async with twins({}) as (twin,):
        cfg = gateway_config([{"url": twin.url, "name": "t"}], health=HEALTH)
        async with running_gateway(cfg) as gw:

            async def probed() -> bool:
                return await _probes(gw, "t", "ok") >= 3

            await _until(probed, 5.0)
            async with aiohttp.ClientSession() as s, s.get(gw + "/metrics") as r:
                gateway_page = await r.text()
        m = await twin_metrics(twin.url)
    ok = f"vllm:request_success_total,engine=0,finished_reason=length,model_name={MODEL}"
    assert m[ok] == 0  # every probe completed (1 token, "length"), none was counted
    assert m[f"vllm:generation_tokens_total,engine=0,model_name={MODEL}"] == 0
    assert "kiloserve_gateway_requests_total{" not in gateway_page


async def test_the_completion_probe_is_off_for_engines_with_few_slots() -> None:
    fake = FakeBackend()
    async with fake_backends(fake):
        backends = [{"url": fake.url, "name": "f", "engine": "llamacpp"}]
        cfg = gateway_config(backends, health=HEALTH)
        async with running_gateway(cfg) as gw:

            async def probed() -> bool:
                return await _probes(gw, "f", "ok") >= 3

            await _until(probed, 5.0)
    assert fake.num_probes == 0 and fake.bodies == []


async def test_the_fakes_vllm_page_turns_the_completion_probe_on() -> None:
    fake = FakeBackend()
    async with fake_backends(fake):
        cfg = gateway_config([{"url": fake.url, "name": "f"}], health=HEALTH)
        async with running_gateway(cfg) as gw:

            async def probed() -> bool:
                return fake.num_probes >= 2

            await _until(probed, 5.0)
            assert (await admin_backends(gw))["f"]["healthy"]
    assert fake.bodies == []  # probes are not client traffic
