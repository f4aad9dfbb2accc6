"""The agent-era APIs' request profiles, the response-id LRU and the 404 rule."""

from __future__ import annotations

import pytest

from kiloserve.engine.agent_protocol import anthropic_chat_messages, responses_chat_messages
from kiloserve.engine.agent_shapes import MessagesEncoder, ResponsesEncoder, responses_usage
from kiloserve.engine.protocol import render_chat
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.extra_apis import (
    STREAM_MARKERS,
    ResponseOwners,
    is_route_missing,
    profile_view,
)
from kiloserve.gateway.profile import Profiler
from kiloserve.gateway.sse import SseRelay
from kiloserve.tokens import tokenize

MODEL = "m"


def _profiler() -> Profiler:
    cfg = parse_gateway_config(
        {"backends": [{"url": "http://127.0.0.1:9001", "models": [MODEL]}], "block_size": 4}
    )
    return Profiler(cfg)


def _profile(path: str, body: dict[str, object], headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return _profiler().profile("r1", profile_view(path, {"model": MODEL, **body}), headers or {})


def test_responses_profile_counts_the_twins_prompt_and_the_output_budget() -> None:
    body: dict[str, object] = {
        "instructions": "be terse",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello there"}]}],
        "max_output_tokens": 33,
        "user": "alice",
    }
    info = _profile("/v1/responses", body)
    twin_ids = tokenize(render_chat(responses_chat_messages(body)))
    assert info.input_tokens == len(twin_ids)
    assert info.max_tokens == info.predicted_output_tokens == 33
    assert info.session_key == "alice" and len(info.prefix_hashes) == len(twin_ids) // 4


def test_anthropic_profile_uses_system_messages_and_metadata_user() -> None:
    body: dict[str, object] = {
        "system": [{"type": "text", "text": "you help"}],
        "messages": [{"role": "user", "content": "write code"}],
        "max_tokens": 100,
        "metadata": {"user_id": "u-7"},
    }
    info = _profile("/v1/messages", body)
    assert info.input_tokens == len(tokenize(render_chat(anthropic_chat_messages(body))))
    assert info.max_tokens == 100 and info.session_key == "u-7"


@pytest.mark.parametrize(
    ("path", "body", "input_tokens"),
    [
        ("/v1/embeddings", {"input": "a cat"}, 2),
        ("/v1/embeddings", {"input": [[1, 2, 3], [4]]}, 4),
        ("/v1/rerank", {"query": "q", "documents": ["ab", {"text": "cd"}]}, 7),
        ("/tokenize", {"prompt": "a long prompt to count"}, 0),
        ("/detokenize", {"tokens": [1, 2, 3]}, 0),
        ("/v1/responses", {"input": 7}, 0),  # bad input: the engine answers it
    ],
)
def test_prompt_only_apis_have_no_output(
    path: str, body: dict[str, object], input_tokens: int
) -> None:
    info = _profile(path, body)
    assert info.input_tokens == input_tokens
    if path != "/v1/responses":
        assert info.max_tokens == info.predicted_output_tokens == 0


def test_response_owners_is_a_bounded_lru() -> None:
    owners = ResponseOwners(max_num_ids=2)
    owners.remember("resp_1", "a")
    owners.remember("resp_2", "b")
    assert owners.owner("resp_1") == "a"  # now the most recent
    owners.remember("resp_3", "c")
    assert len(owners) == 2 and owners.owner("resp_2") is None
    assert owners.owner("resp_1") == "a" and owners.owner("resp_3") == "c"


@pytest.mark.parametrize(
    ("body", "missing"),
    [
        (b"404: Not Found", True),  # aiohttp's plain text
        (b'{"detail":"Not Found"}', True),  # FastAPI (vLLM, SGLang)
        (b'{"error":{"message":"Not Found","type":"NotFoundError"}}', True),  # the twin
        (b'{"error":{"code":404,"message":"File Not Found"}}', True),  # llama.cpp
        (b'{"error":{"message":"The model `x` does not exist."}}', False),
        (b'{"object":"error","message":"Response with id \'r\' not found."}', False),
    ],
)
def test_route_missing_404s(body: bytes, missing: bool) -> None:
    assert is_route_missing(body) is missing


def _twin_stream(path: str, num_tokens: int) -> bytes:
    if path == "/v1/responses":
        enc = ResponsesEncoder("resp_1", MODEL, 0, {})
        words = b"".join(enc.delta(f" w{i}") for i in range(num_tokens))
        usage = responses_usage(3, num_tokens, 0)
        end = enc.end_events("text", "completed", usage)
        return enc.start_events() + enc.first_events() + words + end
    msg = MessagesEncoder(MODEL)
    words = b"".join(msg.delta(f" w{i}") for i in range(num_tokens))
    return msg.first_events(3) + words + msg.end_events(num_tokens, "stop")


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_stream_markers_count_one_per_token(path: str) -> None:
    relay = SseRelay(strip_usage=False, count=STREAM_MARKERS[path])
    data = _twin_stream(path, 5)
    out = b"".join(relay.feed(data[i : i + 7]) for i in range(0, len(data), 7)) + relay.flush()
    assert out == data and relay.num_events == 5
