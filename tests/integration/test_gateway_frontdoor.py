"""Front door: bad input, health/ready, metrics, admin API (drain, config, auth)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import aiohttp
import pytest
from test_gateway_fakes import FakeBackend, fake_backends, gateway_config, running_gateway


async def _post(s: aiohttp.ClientSession, url: str, data: bytes) -> tuple[int, Any, Any]:
    hdrs = {"Content-Type": "application/json"}
    async with s.post(url + "/v1/completions", data=data, headers=hdrs) as r:
        return r.status, await r.json(), r.headers


@pytest.mark.parametrize(
    ("data", "status", "needle"),
    [
        (b"{not json", 400, "invalid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"prompt": "x"}', 400, "'model'"),
        (b'{"model": 7}', 400, "'model'"),
        (b'{"model": "nope"}', 404, "Served models: m"),
        (b'{"model": "m", "max_tokens": "ten"}', 400, "max_tokens"),
        (b"x" * 2000, 413, "limit"),
    ],
)
async def test_bad_input_gets_openai_errors(data: bytes, status: int, needle: str) -> None:
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url}], max_body_bytes=1000)
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            got_status, body, headers = await _post(s, url, data)
            assert got_status == status
            assert needle in body["error"]["message"]
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert headers["x-request-id"]
            # the gateway is still fine afterwards
            assert (await _post(s, url, b'{"model": "m"}'))[0] == 200
    assert len(fake.bodies) == 1


async def test_garbage_bodies_never_crash_the_gateway() -> None:
    rng = random.Random(7)
    samples = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) for _ in range(30)]
    samples += [
        b'{"model": "m", "prompt": [[1, 2], "a", null], "messages": 3}',
        b'{"model": "m", "messages": [{"content": [{"text": 5}, 7]}, "x"], "user": []}',
        b'{"model": "m", "stream": true, "stream_options": "yes"}',
    ]
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url}])
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            statuses = [(await _post_raw(s, url, d)) for d in samples]
            assert (await _post(s, url, b'{"model": "m"}'))[0] == 200
    assert all(st in (200, 400) for st in statuses), statuses
    assert statuses[-3:] == [200, 200, 400]  # stream_options must be an object


async def _post_raw(s: aiohttp.ClientSession, url: str, data: bytes) -> int:
    async with s.post(url + "/v1/completions", data=data) as r:
        await r.read()
        return r.status


async def test_no_healthy_backend_is_503_with_retry_after_and_ready_flips() -> None:
    async with fake_backends(FakeBackend(metrics_status=500)) as (fake,):
        cfg = gateway_config([{"url": fake.url, "models": ["m"]}], max_scrape_failures=2)
        async with running_gateway(cfg, wait_ready=False) as url, aiohttp.ClientSession() as s:
            for _ in range(100):
                async with s.get(url + "/admin/backends") as r:
                    if not (await r.json())["backends"][0]["healthy"]:
                        break
                await asyncio.sleep(0.02)
            status, body, headers = await _post(s, url, b'{"model": "m"}')
            assert status == 503 and headers["Retry-After"] == "1"
            assert body["error"]["type"] == "service_unavailable"
            async with s.get(url + "/ready") as r:
                assert r.status == 503
            async with s.get(url + "/health") as r:
                assert r.status == 200
            fake.metrics_status = 200  # scrapes succeed again: healthy, ready
            for _ in range(100):
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.02)
            assert (await _post(s, url, b'{"model": "m"}'))[0] == 200


async def test_drain_undrain_and_admin_views() -> None:
    async with fake_backends(FakeBackend(), FakeBackend()) as fakes:
        backends = [{"url": f.url, "name": f"b{i}", "gpu": "H100"} for i, f in enumerate(fakes)]
        cfg = gateway_config(backends)
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            async with s.post(url + "/admin/backends/b0/drain") as r:
                assert r.status == 200 and (await r.json())["draining"] is True
            for _ in range(4):
                assert (await _post(s, url, b'{"model": "m"}'))[2]["x-kiloserve-backend"] == "b1"
            async with s.get(url + "/admin/backends") as r:
                view = {b["name"]: b for b in (await r.json())["backends"]}
            assert view["b0"]["draining"] and not view["b0"]["routable"]
            assert view["b1"]["effective_weight"] == 1.0 and view["b1"]["gpu"] == "H100"
            assert view["b1"]["num_running"] == 0 and view["b1"]["engine"] == "vllm"
            async with s.post(url + "/admin/backends/b0/undrain") as r:
                assert r.status == 200
            async with s.post(url + "/admin/backends/zz/drain") as r:
                assert r.status == 404
            got = {
                (await _post(s, url, b'{"model": "m"}'))[2]["x-kiloserve-backend"] for _ in range(4)
            }
            assert got == {"b0", "b1"}
            async with s.get(url + "/admin/config") as r:
                config = await r.json()
            assert config["backends"][0]["name"] == "b0" and config["admin_token"] is None


async def test_admin_token_required_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILOSERVE_ADMIN_TOKEN", "s3cret")
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url, "name": "b0"}])
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            async with s.get(url + "/admin/backends") as r:
                assert r.status == 401
            bad = {"Authorization": "Bearer nope"}
            async with s.post(url + "/admin/backends/b0/drain", headers=bad) as r:
                assert r.status == 401
            good = {"Authorization": "Bearer s3cret"}
            async with s.get(url + "/admin/config", headers=good) as r:
                text = await r.text()
            assert r.status == 200 and "s3cret" not in text and '"admin_token":"***"' in text


async def test_metrics_exposes_gateway_series() -> None:
    async with fake_backends(FakeBackend(num_chunks=3, chunk_delay_s=0.01)) as (fake,):
        cfg = gateway_config([{"url": fake.url, "name": "b0"}])
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            await _post(s, url, b'{"model": "m"}')
            data = b'{"model": "m", "stream": true}'
            async with s.post(url + "/v1/completions", data=data) as r:
                await r.read()
            await _post(s, url, b'{"model": "zz"}')
            async with s.get(url + "/metrics") as r:
                text = await r.text()
    for needle in [
        'kiloserve_gateway_requests_total{backend="b0",model="m",status="200"} 2.0',
        'kiloserve_gateway_requests_total{backend="",model="",status="404"} 1.0',
        'kiloserve_gateway_ttft_seconds_count{backend="b0"} 1.0',
        'kiloserve_gateway_e2e_seconds_count{backend="b0"} 2.0',
        'kiloserve_gateway_routing_decisions_total{backend="b0",policy="round_robin"} 2.0',
        'kiloserve_gateway_in_flight{backend="b0"} 0.0',
        'kiloserve_gateway_backend_healthy{backend="b0"} 1.0',
        'kiloserve_gateway_backend_effective_weight{backend="b0"} 1.0',
        'kiloserve_gateway_scrape_stale{backend="b0"} 0.0',
        'kiloserve_gateway_scrape_errors_total{backend="b0"} 0.0',
    ]:
        assert needle in text, needle
    itl = [
        ln
        for ln in text.splitlines()
        if ln.startswith("kiloserve_gateway_inter_token_seconds_count")
    ]
    assert len(itl) == 1 and float(itl[0].split()[-1]) >= 2  # 3 chunks spaced 10 ms apart


async def test_in_flight_limit_answers_503_instead_of_queueing() -> None:
    async with fake_backends(FakeBackend(mode="hang")) as (fake,):
        cfg = gateway_config([{"url": fake.url}], max_in_flight=1)
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            hung = asyncio.create_task(_post(s, url, b'{"model": "m"}'))
            for _ in range(100):
                if fake.num_active:
                    break
                await asyncio.sleep(0.01)
            status, body, headers = await _post(s, url, b'{"model": "m"}')
            assert status == 503 and headers["Retry-After"] == "1"
            assert body["error"]["code"] == "overloaded"
            hung.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hung
            fake.mode = "ok"
            for _ in range(100):  # the slot is free again once the client left
                if (await _post(s, url, b'{"model": "m"}'))[0] == 200:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("in-flight slot never freed")


async def test_slow_metrics_backend_goes_stale_without_delaying_others() -> None:
    slow, fast = FakeBackend(metrics_delay_s=2.0), FakeBackend()
    async with fake_backends(slow, fast):
        backends = [{"url": slow.url, "name": "slow"}, {"url": fast.url, "name": "fast"}]
        cfg = gateway_config(backends, scrape_timeout_s=0.1, stale_after_s=0.3)
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            await asyncio.sleep(0.5)
            async with s.get(url + "/admin/backends") as r:
                view = {b["name"]: b for b in (await r.json())["backends"]}
    assert view["fast"]["scrape_age_s"] < 0.25 and not view["fast"]["scrape_stale"]
    assert view["slow"]["scrape_stale"] and view["slow"]["num_running"] is None
    assert view["slow"]["num_scrape_errors_total"] >= 3 and not view["slow"]["healthy"]
