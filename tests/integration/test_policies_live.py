"""The S1.4 / S1.5 policies through a live gateway in front of engine twins.

Two twins with small KV caches (400 blocks of 16 tokens); requests sent straight to the
twins (not through the gateway) hold them in a known state while the gateway routes:

* ``full``: one request with a 4,800-token prompt: KV 76% used, 1 running;
* ``busy``: three requests with 16-token prompts: KV 1% used, 3 running.

They decode (up to 1,500 tokens, 30 s at 20 ms a step), so the KV fills slowly: after
8 s about 81% on ``full`` and 20% on ``busy``. Both twins share a fixed step time, so
their TPOT and so the latency factor agree: the seed weight W is the free KV, from
0.24 down to about 0.19 on ``full``, 0.99 down to 0.8 on ``busy``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from test_gateway_fakes import admin_backends, gateway_config, running_gateway
from test_gateway_twins import MODEL, twins

NUM_BLOCKS = 401  # 400 usable blocks (the null block included, as vLLM counts)


@contextlib.asynccontextmanager
async def held(url: str, prompt_ids: list[int], num: int) -> AsyncIterator[None]:
    """``num`` streamed requests on the twin at ``url`` that outlast the test."""
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": 1500, "stream": True}
    async with contextlib.AsyncExitStack() as stack:
        session = await stack.enter_async_context(aiohttp.ClientSession())
        for _ in range(num):
            resp = await stack.enter_async_context(session.post(url + "/v1/completions", json=body))
            assert resp.status == 200, await resp.text()
            await resp.content.readline()  # admitted and running
        yield  # leaving closes the streams: the twin aborts them


@contextlib.asynccontextmanager
async def full_and_busy() -> AsyncIterator[list[dict[str, Any]]]:
    spec = {"num_gpu_blocks_override": NUM_BLOCKS}
    async with (
        twins(spec, spec, step_s=0.02) as (full, busy),
        held(full.url, [7] * 4800, 1),
        held(busy.url, [7] * 16, 3),
    ):
        yield [{"url": t.url, "name": n} for t, n in ((full, "full"), (busy, "busy"))]


async def wait_scraped(gw: str) -> None:
    """Until the gateway's table shows the held requests (KV and queues scraped)."""
    for _ in range(250):
        rows = await admin_backends(gw)
        if (rows["full"]["kv_usage"] or 0) > 0.7 and rows["busy"]["num_running"] == 3:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"gateway never saw the held requests: {rows}")


async def route(backends: list[dict[str, Any]], policy: dict[str, Any], prompts: list[Any]) -> str:
    """Send ``prompts`` one after another through a gateway; the serving backends'
    initials, in order."""
    cfg = gateway_config(backends, policy=policy, seed=5)
    async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
        await wait_scraped(gw)
        picks = []
        for prompt in prompts:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
            async with s.post(gw + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                picks.append(r.headers["x-kiloserve-backend"][0])
                await r.read()
    return "".join(picks)


SHORT = [1, 2, 3, 4]  # 4 prompt tokens + 2 predicted output tokens
LONG = list(range(100, 1200))  # 1,100 prompt tokens: long (> 1024 with the output)


async def test_seed_weighted_and_wrr_send_less_to_the_fuller_kv() -> None:
    async with full_and_busy() as backends:
        seed = await route(backends, {"name": "seed_weighted"}, [SHORT] * 40)
        wrr = await route(backends, {"name": "weighted_round_robin"}, [SHORT] * 20)
        static = await route(
            backends, {"name": "weighted_round_robin", "params": {"weights": "static"}}, [SHORT] * 8
        )
    counts = Counter(seed)
    # W(full) / sum(W) is about 0.2: 8 of 40 expected; round robin would give 20
    assert counts["f"] <= 14 and counts["b"] >= 26, seed
    # smooth WRR on W about 0.24 : 0.99: full gets every 4th-5th request, spread out
    assert 2 <= wrr.count("f") <= 6 and "ff" not in wrr, wrr
    assert static == "fbfbfbfb"  # static weights 1 : 1 ignore the KV


async def test_length_least_conn_short_to_short_queue_long_to_free_kv() -> None:
    async with full_and_busy() as backends:
        got = await route(backends, {"name": "length_least_conn"}, [SHORT, LONG] * 4)
        least_request = await route(backends, {"name": "least_request"}, [LONG] * 2)
    # short: fewest running (full: 1 < busy: 3); long: most free KV (busy: 99% free)
    assert got == "fbfbfbfb"
    assert least_request == "ff"  # load alone sends the long prompts to the fuller KV
