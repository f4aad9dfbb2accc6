"""Admission, API keys, rate limits and input limits through a real gateway and fake engines."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from test_gateway_fakes import (
    FakeBackend,
    fake_backends,
    gateway_config,
    running_gateway,
)

from kiloserve.gateway.admission.auth import hash_key


def _admission(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"enabled": True, "tick_s": 0.01}
    cap = kw.pop("capacity", {})
    base.update(kw)
    base["capacity"] = cap
    return base


async def _post(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    async with s.post(url + "/v1/completions", json=body, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.read()


async def test_bounded_queue_429_then_drains_in_order() -> None:
    fake = FakeBackend(num_chunks=3, chunk_delay_s=0.15)
    async with fake_backends(fake):
        adm = _admission(max_queue_len=1, capacity={"max_in_flight_per_backend": 1})
        cfg = gateway_config([{"url": fake.url, "models": ["m"]}], admission=adm)
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "hi", "stream": True}
            first = asyncio.create_task(_post(s, gw, body))
            await asyncio.sleep(0.1)
            second = asyncio.create_task(_post(s, gw, body))
            await asyncio.sleep(0.1)
            status, headers, err = await _post(s, gw, body)  # lane full
            assert status == 429 and headers["Retry-After"] == "1"
            assert b"queue_full" in err
            assert fake.num_active == 1  # the queued one waits at the gateway
            results = await asyncio.gather(first, second)
            assert [r[0] for r in results] == [200, 200]
            async with s.get(gw + "/metrics") as r:
                text = await r.text()
    assert (
        'kiloserve_gateway_admission_requests_total{model="m",outcome="rejected_queue_full"} 1.0'
        in text
    )
    assert "kiloserve_gateway_admission_queue_wait_seconds_bucket" in text
    assert 'kiloserve_gateway_admission_queue_depth{lane="short",model="m"} 0.0' in text


async def test_waiting_past_the_deadline_is_503() -> None:
    fake = FakeBackend(mode="hang")
    async with fake_backends(fake):
        adm = _admission(max_queue_wait_s=0.3, capacity={"max_in_flight_per_backend": 1})
        cfg = gateway_config([{"url": fake.url, "models": ["m"]}], admission=adm)
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            hung = asyncio.create_task(_post(s, gw, {"model": "m", "prompt": "x"}))
            await asyncio.sleep(0.1)
            t0 = asyncio.get_running_loop().time()
            status, headers, body = await _post(s, gw, {"model": "m", "prompt": "y"})
            waited = asyncio.get_running_loop().time() - t0
            hung.cancel()
    assert status == 503 and "Retry-After" in headers and b"queue_timeout" in body
    assert 0.25 <= waited < 1.5


async def test_short_request_passes_a_long_one_that_does_not_fit() -> None:
    fake = FakeBackend(num_chunks=4, chunk_delay_s=0.1)
    async with fake_backends(fake):
        adm = _admission(capacity={"kv_budget_frac": 1.0})
        backend = {"url": fake.url, "models": ["m"], "kv_capacity_tokens": 1000}
        cfg = gateway_config([backend], admission=adm)
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            order: list[str] = []

            async def go(name: str, prompt: str, max_tokens: int) -> int:
                body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
                status, _, _ = await _post(s, gw, body)
                order.append(name)
                return status

            running = asyncio.create_task(go("running", "a " * 20, 600))
            await asyncio.sleep(0.05)
            long = asyncio.create_task(go("long", "word " * 1200, 100))
            await asyncio.sleep(0.05)
            short = asyncio.create_task(go("short", "hi", 20))
            statuses = await asyncio.gather(running, long, short)
    assert statuses == [200, 200, 200]
    assert order.index("short") < order.index("long")


async def test_api_keys_401_403_and_admin_separation(monkeypatch: Any) -> None:
    monkeypatch.setenv("TEST_BOB_KEY", "sk-bob")
    keys = [
        {"name": "alice", "key_sha256": hash_key("sk-alice"), "allowed_models": ["m"]},
        {"name": "bob", "key_env": "TEST_BOB_KEY", "allowed_models": ["other"]},
    ]
    fake = FakeBackend()
    async with fake_backends(fake):
        cfg = gateway_config(
            [{"url": fake.url, "models": ["m"]}], auth={"keys": keys}, admin_token="adm-token"
        )
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "hi"}
            assert (await _post(s, gw, body))[0] == 401
            assert (await _post(s, gw, body, {"Authorization": "Bearer wrong"}))[0] == 401
            assert (await _post(s, gw, body, {"Authorization": "Bearer sk-bob"}))[0] == 403
            assert (await _post(s, gw, body, {"Authorization": "Bearer sk-alice"}))[0] == 200
            async with s.get(
                gw + "/admin/backends", headers={"Authorization": "Bearer sk-alice"}
            ) as r:
                assert r.status == 401
            async with s.get(
                gw + "/admin/backends", headers={"Authorization": "Bearer adm-token"}
            ) as r:
                assert r.status == 200
            async with s.get(gw + "/metrics") as r:
                text = await r.text()
            async with s.get(
                gw + "/admin/config", headers={"Authorization": "Bearer adm-token"}
            ) as r:
                conf = await r.text()
    assert "sk-alice" not in text and "sk-bob" not in text
    assert "sk-alice" not in conf and "sk-bob" not in conf
    # The gateway's client keys never reach an engine.
    assert fake.headers and all("authorization" not in h for h in fake.headers)


async def test_rate_limit_per_key_with_retry_after() -> None:
    keys = [{"name": "k", "key_sha256": hash_key("sk-k"), "max_requests_per_min": 2}]
    fake = FakeBackend()
    async with fake_backends(fake):
        cfg = gateway_config([{"url": fake.url, "models": ["m"]}], auth={"keys": keys})
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            auth = {"Authorization": "Bearer sk-k"}
            got = [await _post(s, gw, {"model": "m", "prompt": "hi"}, auth) for _ in range(3)]
    assert [g[0] for g in got] == [200, 200, 429]
    assert got[2][1]["Retry-After"] == "30"
    assert len(fake.bodies) == 2


async def test_input_limits_name_the_limit() -> None:
    fake = FakeBackend()
    async with fake_backends(fake):
        limits = {"max_output_tokens": 100, "model_context_tokens": {"m": 50}}
        cfg = gateway_config(
            [{"url": fake.url, "models": ["m"]}],
            admission={"limits": limits},
            max_body_bytes=4096,
        )
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            over_out = await _post(s, gw, {"model": "m", "prompt": "hi", "max_tokens": 101})
            over_ctx = await _post(s, gw, {"model": "m", "prompt": "word " * 60, "max_tokens": 1})
            too_big = await _post(s, gw, {"model": "m", "prompt": "x" * 5000})
            fine = await _post(s, gw, {"model": "m", "prompt": "hi", "max_tokens": 10})
    assert over_out[0] == 400 and b"max_output_tokens" in over_out[2]
    assert over_ctx[0] == 400 and b"context of 50 tokens" in over_ctx[2]
    assert too_big[0] == 413 and b"4096-byte limit" in too_big[2]
    assert fine[0] == 200
    assert len(fake.bodies) == 1


async def test_priority_header_orders_the_queue() -> None:
    fake = FakeBackend(num_chunks=2, chunk_delay_s=0.1)
    async with fake_backends(fake):
        adm = _admission(capacity={"max_in_flight_per_backend": 1}, ageing_s=0.0)
        cfg = gateway_config([{"url": fake.url, "models": ["m"]}], admission=adm)
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            order: list[str] = []

            async def go(name: str, prio: int) -> None:
                body = {"model": "m", "prompt": name, "stream": True}
                status, _, _ = await _post(s, gw, body, {"x-kiloserve-priority": str(prio)})
                assert status == 200
                order.append(name)

            first = asyncio.create_task(go("first", 0))
            await asyncio.sleep(0.05)
            low = asyncio.create_task(go("low", 0))
            await asyncio.sleep(0.02)
            high = asyncio.create_task(go("high", 5))
            await asyncio.gather(first, low, high)
            bad = await _post(s, gw, {"model": "m", "prompt": "x"}, {"x-kiloserve-priority": "99"})
    assert order == ["first", "high", "low"]
    assert bad[0] == 400
