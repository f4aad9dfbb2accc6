"""One ``request_timeout_s`` for a whole P/D split (gateway/disagg.py): the decode leg
and the fallbacks get what the prefill leg left, not a fresh budget. Real servers on
127.0.0.1 whose legs take the time the test sets."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from test_gateway_fakes import (
    PROBE_HEADER,
    FakeBackend,
    fake_backends,
    gateway_config,
    running_gateway,
)

LONG_PROMPT = "tell me a long story about the sea " * 40  # ~300 tokens: split
TIMEOUT_S = 1.0
PREFILL_S = 0.6


@dataclass
class SlowPd(FakeBackend):
    """Answers a prefill leg after ``prefill_s`` (with NixlConnector's params); any
    other request gets its first byte after ``decode_s``, then ``num_chunks`` events
    ``chunk_delay_s`` apart when streamed."""

    prefill_s: float = 0.0
    decode_s: float = 0.0

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        if PROBE_HEADER in request.headers:
            return await super()._generate(request)
        body = orjson.loads(await request.read())
        self.bodies.append(body)
        kv = body.get("kv_transfer_params")
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            await asyncio.sleep(self.prefill_s)
            params = {"do_remote_prefill": True, "remote_engine_id": "P0", "remote_block_ids": [1]}
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})
        await asyncio.sleep(self.decode_s)
        if body.get("stream"):
            return await self._stream(request, body)
        return web.json_response({"choices": [{"index": 0, "text": "hello"}]})


def _config(p: SlowPd, d: SlowPd) -> Any:
    backends = [
        {"url": p.url, "name": "p", "models": ["m"], "role": "prefill"},
        {"url": d.url, "name": "d", "models": ["m"], "role": "decode"},
    ]
    disagg = {"min_prompt_tokens": 64, "transfer_timeout_s": 5.0}
    return gateway_config(backends, request_timeout_s=TIMEOUT_S, disagg=disagg)


async def _post(gw: str, body: dict[str, Any]) -> tuple[int, bytes, float]:
    started = time.monotonic()
    async with aiohttp.ClientSession() as s, s.post(gw + "/v1/completions", json=body) as r:
        raw = await r.read()
        return r.status, raw, time.monotonic() - started


async def test_a_slow_decode_leg_times_out_at_the_configured_limit() -> None:
    p, d = SlowPd(prefill_s=PREFILL_S, decode_s=30.0), SlowPd(decode_s=30.0)
    async with fake_backends(p, d), running_gateway(_config(p, d)) as gw:
        status, raw, elapsed_s = await _post(gw, {"model": "m", "prompt": LONG_PROMPT})
    assert status == 504, raw
    assert orjson.loads(raw)["error"]["type"] == "upstream_error"
    # about the limit, not prefill + limit (1.6 s) nor + a whole fallback (2.6 s)
    assert TIMEOUT_S - 0.05 <= elapsed_s < TIMEOUT_S + 0.3, elapsed_s
    assert len(p.bodies) == 1  # the prefill leg only: no fallback sent past the deadline
    assert len(d.bodies) == 1


async def test_a_slow_decode_stream_is_cut_at_the_configured_limit() -> None:
    p = SlowPd(prefill_s=PREFILL_S)
    d = SlowPd(num_chunks=40, chunk_delay_s=0.05)  # 2 s of events
    async with fake_backends(p, d), running_gateway(_config(p, d)) as gw:
        body = {"model": "m", "prompt": LONG_PROMPT, "stream": True}
        status, raw, elapsed_s = await _post(gw, body)
    assert status == 200  # the decode leg answered: cut mid-stream with an error event
    events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert 1 <= len(events) < 40 and b'"error"' in events[-1]
    assert TIMEOUT_S - 0.05 <= elapsed_s < TIMEOUT_S + 0.3, elapsed_s


async def test_a_prefill_that_used_the_budget_gets_504_without_a_decode_leg() -> None:
    p, d = SlowPd(prefill_s=TIMEOUT_S + 0.2), SlowPd()
    async with fake_backends(p, d), running_gateway(_config(p, d)) as gw:
        status, raw, elapsed_s = await _post(gw, {"model": "m", "prompt": LONG_PROMPT})
    assert status == 504, raw
    assert elapsed_s < TIMEOUT_S + 0.3, elapsed_s
    assert d.bodies == []  # no whole-request fallback after the deadline
