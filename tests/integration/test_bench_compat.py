"""What ``vllm bench serve`` needs from the gateway in front of engine twins.

Its ``/v1/models`` cards (``root``, ``parent``, ``max_model_len``), and a chat stream
whose first chunk (the role) comes with the first token, as vLLM's, so a client's
time to first chunk is the time to first token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import aiohttp
import orjson
from test_gateway_fakes import gateway_config, running_gateway
from test_gateway_twins import MODEL, twins

from kiloserve.engine.server import TwinServer
from kiloserve.engine.twin import TwinConfig

PREFILL_S = 0.4
DECODE_S = 0.002


class SlowPrefillTimer:
    """A modelled GPU whose steps with prefill take ``PREFILL_S``; decode steps are fast."""

    def step_time_s(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> float:
        return PREFILL_S if prefill else DECODE_S

    def decode_steps_time_s(self, num_seqs: int, context_tokens: int, num_steps: int) -> float:
        return DECODE_S * num_steps


async def test_gateway_models_keep_the_backends_cards() -> None:
    async with twins({"max_model_len": 4096}, {"max_model_len": 2048}) as servers:
        backends = [{"url": t.url, "name": f"twin{i}"} for i, t in enumerate(servers)]
        async with (
            running_gateway(gateway_config(backends)) as url,
            aiohttp.ClientSession() as s,
            s.get(url + "/v1/models") as r,
        ):
            assert r.status == 200
            cards = (await r.json())["data"]
    assert [c["id"] for c in cards] == [MODEL]
    card = cards[0]
    assert card["root"] == MODEL and card["parent"] is None
    assert card["max_model_len"] == 2048  # the smallest: a request must fit anywhere


async def _chunk_times(url: str, path: str, body: dict[str, object]) -> list[tuple[float, dict]]:
    out: list[tuple[float, dict]] = []
    start = time.perf_counter()
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                out.append((time.perf_counter() - start, orjson.loads(line[6:])))
    return out


async def test_chat_role_chunk_comes_with_the_first_token() -> None:
    cfg = TwinConfig(gpu="H100-SXM", model="llama-3.1-8b", port=0, api_overhead_s=0.0)
    async with TwinServer(cfg, timer=SlowPrefillTimer()) as twin:
        backends = [{"url": twin.url, "name": "twin0"}]
        async with running_gateway(gateway_config(backends)) as url:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "a long document " * 200}],
                "max_tokens": 4,
                "stream": True,
            }
            chunks = await _chunk_times(url, "/v1/chat/completions", body)
    role_t, role = chunks[0]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    first_t = next(t for t, c in chunks if c["choices"][0]["delta"].get("content"))
    assert role_t >= PREFILL_S * 0.9  # not when the stream opens, before prefill
    assert first_t - role_t < 0.1
