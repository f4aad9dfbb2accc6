"""``kiloserve engine --enable-prompt-tokens-details``: the twin reports its prefix-cache
hits as vLLM does, in ``usage.prompt_tokens_details.cached_tokens`` (non-streaming
bodies, and the usage chunk of streams with ``stream_options.include_usage``)."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from kiloserve.engine.cli import add_arguments, config_from_args
from kiloserve.engine.protocol import render_chat
from kiloserve.engine.server import TwinServer
from kiloserve.engine.twin import TwinConfig
from kiloserve.tokens import filler_text, tokenize

MODEL = "Llama-3.1-8B"
HEAD = filler_text(80, seed=11)  # five whole 16-token blocks


def _config(**kwargs: Any) -> TwinConfig:
    base: dict[str, Any] = {"gpu": "H100-SXM", "model": "llama-3.1-8b", "port": 0}
    return TwinConfig(**(base | {"api_overhead_s": 0.0} | kwargs))


@pytest.fixture
async def twin() -> AsyncIterator[TwinServer]:
    async with TwinServer(_config(enable_prompt_tokens_details=True)) as server:
        yield server


def _client(server: TwinServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _cached(usage: Any) -> int:
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int)
    return cached


def _whole_blocks_but_last(num_tokens: int) -> int:
    """A full hit: every whole block except the one holding the last prompt token."""
    return (num_tokens - 1) // 16 * 16


async def test_completions_report_cached_prefix_tokens(twin: TwinServer) -> None:
    num_head = len(tokenize(HEAD))
    async with _client(twin) as client:
        first = await client.completions.create(model=MODEL, prompt=HEAD, max_tokens=2)
        again = await client.completions.create(model=MODEL, prompt=HEAD, max_tokens=2)
        tail = HEAD + " " + filler_text(20, seed=12)
        longer = await client.completions.create(model=MODEL, prompt=tail, max_tokens=2)
        other = await client.completions.create(
            model=MODEL, prompt=filler_text(80, seed=13), max_tokens=2
        )
    assert _cached(first.usage) == 0
    # the whole prompt is cached, but the last token is always computed: one block less
    assert _cached(again.usage) == _whole_blocks_but_last(num_head) == 64
    # the shared head: its 5 whole blocks (the earlier requests' output is not cached
    # past the prompt's last full block, and differs from this tail anyway)
    assert _cached(longer.usage) == 80
    assert _cached(other.usage) == 0
    assert first.usage is not None and first.usage.prompt_tokens == num_head


async def test_chat_stream_usage_chunk_carries_cached_tokens(twin: TwinServer) -> None:
    messages: Any = [{"role": "system", "content": HEAD}, {"role": "user", "content": "go"}]
    num_prompt = len(tokenize(render_chat(messages)))
    async with _client(twin) as client:
        full = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert _cached(full.usage) == 0
    assert chunks[-1].choices == []
    assert _cached(chunks[-1].usage) == _whole_blocks_but_last(num_prompt)
    assert all(c.usage is None for c in chunks[:-1])


async def test_json_shape_is_vllms(twin: TwinServer) -> None:
    body = {"model": MODEL, "prompt": HEAD, "max_tokens": 1}
    async with aiohttp.ClientSession() as session:
        async with session.post(twin.url + "/v1/completions", json=body) as resp:
            first = await resp.json()
        stream_body = body | {"stream": True, "stream_options": {"include_usage": True}}
        async with session.post(twin.url + "/v1/completions", json=stream_body) as resp:
            events = [e for e in (await resp.read()).split(b"\n\n") if e]
    assert first["usage"] == {
        "prompt_tokens": 80,
        "completion_tokens": 1,
        "total_tokens": 81,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert events[-1] == b"data: [DONE]"
    usage_chunk = orjson.loads(events[-2].removeprefix(b"data: "))
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}


async def test_without_the_flag_usage_has_no_details() -> None:
    async with TwinServer(_config()) as server, _client(server) as client:
        await client.completions.create(model=MODEL, prompt=HEAD, max_tokens=1)
        again = await client.completions.create(model=MODEL, prompt=HEAD, max_tokens=1)
        stream = await client.completions.create(
            model=MODEL,
            prompt=HEAD,
            max_tokens=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert again.usage is not None and again.usage.prompt_tokens_details is None
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details is None


def test_cli_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--gpu", "H100", "--model", "llama-3.1-8b", "--port", "0"]
    assert not config_from_args(parser.parse_args(base)).enable_prompt_tokens_details
    on = parser.parse_args([*base, "--enable-prompt-tokens-details"])
    assert config_from_args(on).enable_prompt_tokens_details
