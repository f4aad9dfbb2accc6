"""logprobs, echo, response_format and tools on a real twin (stream and not), in vLLM's
shapes, read back through the OpenAI SDK; what vLLM refuses is a 400 here too."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from conftest import FixedStepTimer
from kiloserve.engine.server import TwinServer
from kiloserve.engine.twin import TwinConfig

MODEL = "Llama-3.1-8B"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
MESSAGES: Any = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    cfg = TwinConfig(gpu="H100-SXM", model="llama-3.1-8b", port=0, api_overhead_s=0.0)
    async with TwinServer(cfg, timer=FixedStepTimer(0.001)) as server:
        url = server.url + "/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as c:
            yield c


async def test_completion_logprobs_and_echo(client: openai.AsyncOpenAI) -> None:
    out = await client.completions.create(
        model=MODEL, prompt="say it", max_tokens=4, logprobs=2, echo=True
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
    assert choice.text == "say it" + "".join(lp.tokens)
    assert lp.token_logprobs is not None and all(v < 0 for v in lp.token_logprobs)
    assert lp.top_logprobs is not None and all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == len("say it")
    stream = await client.completions.create(
        model=MODEL, prompt="say it", max_tokens=4, logprobs=1, echo=True, stream=True
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert all(c.choices[0].logprobs is not None for c in chunks)


async def test_chat_logprobs(client: openai.AsyncOpenAI) -> None:
    out = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs and out.choices[0].logprobs.content
    assert content is not None and len(content) == 3
    assert "".join(t.token for t in content) == out.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode()) for t in content)
    assert content[0].top_logprobs[0].token == content[0].token
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, stream=True
    )
    lps = [c.choices[0].logprobs async for c in stream if c.choices[0].delta.content]
    assert len(lps) == 3 and all(lp is not None and lp.content for lp in lps)


async def test_response_format_json(client: openai.AsyncOpenAI) -> None:
    out = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)
    assert out.choices[0].finish_reason == "stop"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"enum": [True]}}}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    stream = await client.completions.create(
        model=MODEL, prompt="json please", stream=True, extra_body={"response_format": fmt}
    )
    text = "".join([c.choices[0].text async for c in stream])
    assert json.loads(text) == {"n": 1, "ok": True}


async def test_named_and_required_tool_calls(client: openai.AsyncOpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    out = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[TOOL], tool_choice=named
    )
    calls = out.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "text", "days": 1}  # type: ignore[union-attr]
    assert out.choices[0].finish_reason == "stop"
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[TOOL], tool_choice="required", stream=True
    )
    chunks = [c async for c in stream]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function is not None and deltas[0].function.name == "get_weather"
    args = "".join((d.function.arguments or "") for d in deltas if d.function)
    assert json.loads(args) == {"city": "text", "days": 1}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"tools": [TOOL]}, "--enable-auto-tool-choice"),  # "auto" by default, as vLLM
        ({"tools": [], "tool_choice": "none"}, "must not be an empty array"),
        ({"tool_choice": "required"}, "`tools` must be set"),
        ({"logprobs": False, "top_logprobs": 2}, "`logprobs` must be set to true"),
        ({"top_logprobs": 21, "logprobs": True}, "from 0 to 20"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"anyOf": [{"type": "string"}]}}}}, "anyOf"),
    ],
)  # fmt: skip
async def test_refused_as_vllm(
    client: openai.AsyncOpenAI, kwargs: dict[str, Any], needle: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=needle):
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)


async def test_echo_of_token_ids_is_refused(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="echoes only text prompts"):
        await client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, echo=True)


async def test_n_choices(client: openai.AsyncOpenAI) -> None:
    out = await client.completions.create(model=MODEL, prompt="pick", max_tokens=3, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage is not None and out.usage.completion_tokens == 9
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, n=2, stream=True,
        stream_options={"include_usage": True}, logprobs=True,
    )  # fmt: skip
    chunks = [c async for c in stream]
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert sorted(roles) == [0, 1]
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert len([c for c in mine if c.delta.content]) == 4
        assert mine[-1].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
