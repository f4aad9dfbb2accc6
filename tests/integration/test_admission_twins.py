"""Admission with its defaults protects short requests on real twins (issue 17, S2.3).

The modelled GPU spends time per prefill token (only the GPU is mocked), so a burst of
long documents fills an engine's FIFO queue; a medium prompt sent right after them
must not wait behind all of them when admission is on with its defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
from test_gateway_fakes import gateway_config, running_gateway

from kiloserve.engine.server import TwinServer
from kiloserve.engine.twin import TwinConfig

MODEL = "Llama-3.1-8B"


class PrefillTimer:
    """A modelled GPU: ``base_s`` per step plus ``per_prefill_token_s`` per prompt token."""

    def __init__(self, base_s: float = 0.002, per_prefill_token_s: float = 2e-5) -> None:
        self.base_s = base_s
        self.per_prefill_token_s = per_prefill_token_s

    def step_time_s(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> float:
        return self.base_s + self.per_prefill_token_s * sum(n for n, _ in prefill)

    def decode_steps_time_s(self, num_seqs: int, context_tokens: int, num_steps: int) -> float:
        return self.base_s * num_steps


@contextlib.asynccontextmanager
async def prefill_bound_twin() -> AsyncIterator[TwinServer]:
    cfg = TwinConfig(
        gpu="H100-SXM", model="llama-3.1-8b", port=0, api_overhead_s=0.0,
        max_num_batched_tokens=2048,
    )  # fmt: skip
    async with TwinServer(cfg, timer=PrefillTimer()) as server:
        yield server


async def _ttft_s(s: aiohttp.ClientSession, url: str, tag: str, words: int) -> float:
    prompt = f"{tag} " + "word " * words  # distinct first block: no prefix-cache hits
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
    t0 = time.monotonic()
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        ttft = None
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.monotonic() - t0
    assert ttft is not None
    return ttft


async def _burst(admission: dict[str, Any] | None) -> list[float]:
    """10 long documents at once, then 3 medium prompts: the medium prompts' TTFTs."""
    async with prefill_bound_twin() as twin:
        extra = {} if admission is None else {"admission": admission}
        cfg = gateway_config([{"url": twin.url, "name": "t"}], **extra)
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            docs = [asyncio.create_task(_ttft_s(s, url, f"doc{i}", 6000)) for i in range(10)]
            await asyncio.sleep(0.05)
            medium = await asyncio.gather(*(_ttft_s(s, url, f"q{i}", 300) for i in range(3)))
            await asyncio.gather(*docs)
    return list(medium)


async def test_admission_defaults_keep_medium_prompts_out_of_the_engine_queue() -> None:
    off = await _burst(None)
    on = await _burst({"enabled": True})
    # off: the medium prompts wait behind ~60k prefill tokens in the engine's FIFO
    # (~1.3 s); on: behind at most the one document in prefill (~0.15 s)
    assert min(off) > 0.6
    assert max(on) < 0.4 * min(off)
