"""The output-length history shared through a real ``redis-server`` (SPEC S1.1, issue
17): what one gateway learns, the other predicts; without Redis each keeps its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from test_gateway_fakes import (
    FakeBackend,
    admin_backends,
    fake_backends,
    gateway_config,
    running_gateway,
)
from test_ratelimit_redis import REDIS, redis_url  # noqa: F401  (the fixture)

from conftest import free_port

pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server not installed")
LEARNED_TOKENS = 37  # the fake's completions: usage.completion_tokens
DEFAULT_TOKENS = 256


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"condition not met within {timeout_s} s")


async def _metric(gw: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(gw + "/metrics") as r:
        text = await r.text()
    values = [float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name + " ")]
    assert values, f"{name} not on the page"
    return values[0]


async def _learn(gw: str, user: str) -> None:
    """One finished request of ``user`` without max_tokens (the fake answers 37 tokens)."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw + "/v1/completions", json={"model": "m", "prompt": "hi", "user": user}) as r,
    ):
        assert r.status == 200
        assert (await r.json())["usage"]["completion_tokens"] == LEARNED_TOKENS


async def _predicted(gw: str, fake: FakeBackend, user: str) -> int:
    """The output tokens ``gw`` predicts for ``user``: the decode tokens it accounts to
    the backend while the user's request (no max_tokens) hangs there."""
    fake.mode = "hang"
    body = {"model": "m", "prompt": "hi", "user": user}
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(gw + "/v1/completions", json=body))
        try:

            async def in_flight() -> bool:
                return (await admin_backends(gw))["f"]["in_flight"] == 1

            await _until(in_flight)
            return int((await admin_backends(gw))["f"]["outstanding_decode_tokens"])
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            fake.mode = "ok"


async def test_two_gateways_share_what_they_learn(redis_url: str) -> None:  # noqa: F811
    fake = FakeBackend(num_chunks=LEARNED_TOKENS)
    async with fake_backends(fake):
        backends = [{"url": fake.url, "name": "f"}]
        cfg = gateway_config(backends, rate_limit={"redis_url": redis_url})
        async with running_gateway(cfg) as gw1, running_gateway(cfg) as gw2:

            async def both_shared() -> bool:
                shared = "kiloserve_gateway_output_history_shared"
                return await _metric(gw1, shared) == 1 == await _metric(gw2, shared)

            await _until(both_shared)
            assert await _predicted(gw2, fake, "alice") == DEFAULT_TOKENS
            await _learn(gw1, "alice")  # gateway 1 serves alice; gateway 2 never did

            async def received() -> bool:
                return await _metric(gw2, "kiloserve_gateway_output_history_updates_total") >= 1

            await _until(received)
            assert await _predicted(gw2, fake, "alice") == LEARNED_TOKENS
            assert await _predicted(gw2, fake, "bob") == DEFAULT_TOKENS
        # a gateway started later finds what was learnt before it (fetched on a miss)
        async with running_gateway(cfg) as gw3:
            assert await _predicted(gw3, fake, "alice") == DEFAULT_TOKENS  # the miss

            async def fetched() -> bool:
                return await _predicted(gw3, fake, "alice") == LEARNED_TOKENS

            await _until(fetched)


async def test_without_redis_each_gateway_keeps_its_own_history() -> None:
    fake = FakeBackend(num_chunks=LEARNED_TOKENS)
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    async with fake_backends(fake):
        cfg = gateway_config([{"url": fake.url, "name": "f"}], output_history={"redis_url": dead})
        async with running_gateway(cfg) as gw:

            async def failed() -> bool:
                return await _metric(gw, "kiloserve_gateway_output_history_failures_total") >= 1

            await _until(failed)
            await asyncio.sleep(0.3)  # idle flushes (nothing to send) must not read as "up"
            assert await _metric(gw, "kiloserve_gateway_output_history_shared") == 0
            await _learn(gw, "alice")
            assert await _predicted(gw, fake, "alice") == LEARNED_TOKENS  # its own history
            assert await _metric(gw, "kiloserve_gateway_output_history_shared") == 0


def test_shared_history_follows_the_redis_settings() -> None:
    base = [{"url": "http://127.0.0.1:9"}]
    assert gateway_config(base).output_history_redis_url() is None
    url = "redis://127.0.0.1:1/0"
    assert gateway_config(base, rate_limit={"redis_url": url}).output_history_redis_url() == url
    off = gateway_config(base, rate_limit={"redis_url": url}, output_history={"shared": False})
    assert off.output_history_redis_url() is None
