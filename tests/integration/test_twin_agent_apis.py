"""The engine twin's agent-era endpoints on their own: vLLM's shapes and refusals."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
from test_gateway_twins import MODEL, twins


async def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, orjson.loads(await r.read())


async def test_twin_refuses_bad_agent_requests_as_vllm_does() -> None:
    async with twins({}) as (twin,):
        url = twin.url
        unknown = await _post(url, "/v1/responses", {
            "model": MODEL, "input": "x", "previous_response_id": "resp_nope",
        })  # fmt: skip
        no_input = await _post(url, "/v1/responses", {"model": MODEL})
        wrong_model = await _post(url, "/v1/embeddings", {"model": "other", "input": "x"})
        too_wide = await _post(
            url, "/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": 5000}
        )
        bad_format = await _post(
            url, "/v1/embeddings", {"model": MODEL, "input": "x", "encoding_format": "hex"}
        )
        no_max = await _post(
            url, "/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        )
        rerank = await _post(url, "/v1/rerank", {"model": MODEL, "query": "q", "documents": ["d"]})
    assert (
        unknown[0] == 404
        and unknown[1]["error"]["message"] == "Response with id 'resp_nope' not found."
    )
    assert no_input[0] == 400 and no_input[1]["error"]["param"] == "input"
    assert wrong_model[0] == 404 and wrong_model[1]["error"]["type"] == "NotFoundError"
    assert too_wide[0] == 400 and too_wide[1]["error"]["param"] == "dimensions"
    assert bad_format[0] == 400 and bad_format[1]["error"]["param"] == "encoding_format"
    # Anthropic's error shape on /v1/messages
    assert no_max == (
        400,
        {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
        },
    )
    # /v1/rerank: vLLM serves it for score models only; a generative model's is a 404
    assert rerank[0] == 404


async def test_twin_responses_continue_the_stored_conversation() -> None:
    """A follow-up's prompt is the stored conversation plus its input: it grows, and
    its prefix is cached (the engine model's prefix cache)."""
    async with twins({"enable_prompt_tokens_details": True}) as (twin,):
        first = await _post(
            twin.url,
            "/v1/responses",
            {"model": MODEL, "input": "tell me a story " * 20, "max_output_tokens": 8},
        )
        follow = await _post(twin.url, "/v1/responses", {
            "model": MODEL, "input": "more", "max_output_tokens": 4,
            "previous_response_id": first[1]["id"],
        })  # fmt: skip
        unstored = await _post(
            twin.url,
            "/v1/responses",
            {"model": MODEL, "input": "x", "store": False, "max_output_tokens": 1},
        )
        refused = await _post(twin.url, "/v1/responses", {
            "model": MODEL, "input": "y", "previous_response_id": unstored[1]["id"],
        })  # fmt: skip
    usage = follow[1]["usage"]
    assert follow[1]["previous_response_id"] == first[1]["id"]
    assert usage["input_tokens"] > first[1]["usage"]["input_tokens"] + 8
    assert usage["input_tokens_details"]["cached_tokens"] >= 64
    assert unstored[1]["store"] is False and refused[0] == 404
