"""The agent-era APIs (issue 18) through a real gateway in front of real engine twins:
``/v1/responses``, ``/v1/messages``, ``/v1/embeddings``, ``/tokenize``,
``/detokenize``, and ``/v1/rerank`` (not served by a twin: a JSON 404 naming it)."""

from __future__ import annotations

import base64
import struct
from typing import Any

import aiohttp
import openai
import orjson
from test_gateway_fakes import gateway_config, running_gateway
from test_gateway_twins import MODEL, twin_metrics, twins

BACKEND = "x-kiloserve-backend"


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _config(servers: list[Any], **kw: Any) -> Any:
    backends = [{"url": t.url, "name": f"twin{i}"} for i, t in enumerate(servers)]
    return gateway_config(backends, **kw)


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event, in order."""
    out = []
    for block in raw.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            out.append((lines["event"], orjson.loads(lines["data"])))
    return out


async def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, r.headers, await r.read()


async def _ttft_sum_s(url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    lines = [ln for ln in text.splitlines() if ln.startswith("kiloserve_gateway_ttft_seconds_sum")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


async def test_responses_api_through_gateway_non_stream_and_stream() -> None:
    async with (
        twins({}, {}) as servers,
        running_gateway(_config(servers)) as url,
        _client(url) as client,
    ):
        raw = await client.responses.with_raw_response.create(
            model=MODEL, input="write a haiku", max_output_tokens=7
        )
        assert raw.headers[BACKEND] in {"twin0", "twin1"}
        resp = raw.parse()
        assert resp.status == "incomplete" and resp.output_text
        assert resp.usage is not None and resp.usage.output_tokens == 7
        assert resp.id.startswith("resp_")
        stream = await client.responses.create(
            model=MODEL, input=[{"role": "user", "content": "hi"}], max_output_tokens=5,
            stream=True,
        )  # fmt: skip
        events = [e async for e in stream]
    names = [e.type for e in events]
    assert names[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert names.count("response.output_text.delta") == 5
    assert names[-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert done.output_text == text and done.usage is not None and done.usage.output_tokens == 5


async def test_responses_stream_ttft_is_the_first_text_delta() -> None:
    """response.created comes at once; the gateway's TTFT waits for the first delta
    (the twin's prefill: at least one 0.1 s step)."""
    async with twins({}, step_s=0.1) as servers, running_gateway(_config(servers)) as url:
        body = {"model": MODEL, "input": "hello there", "max_output_tokens": 2, "stream": True}
        status, _, raw = await _post(url, "/v1/responses", body)
        assert status == 200 and _events(raw)[0][0] == "response.created"
        assert await _ttft_sum_s(url) >= 0.09


async def test_previous_response_id_sticks_to_the_backend_that_has_it() -> None:
    """Round robin would spread the follow-ups; each goes where its previous response
    is (the twin that stored it: any other answers 404)."""
    async with (
        twins({}, {}, {}) as servers,
        running_gateway(_config(servers)) as url,
        _client(url) as client,
    ):
        raw = await client.responses.with_raw_response.create(
            model=MODEL, input="start", max_output_tokens=3
        )
        owner, previous = raw.headers[BACKEND], raw.parse().id
        seen = []
        for turn in range(4):
            raw = await client.responses.with_raw_response.create(
                model=MODEL, input=f"turn {turn}", max_output_tokens=3,
                previous_response_id=previous,
            )  # fmt: skip
            seen.append(raw.headers[BACKEND])
            previous = raw.parse().id
        stream = await client.responses.create(
            model=MODEL, input="streamed", max_output_tokens=2,
            previous_response_id=previous, stream=True,
        )  # fmt: skip
        last = [e async for e in stream][-1].response  # type: ignore[union-attr]
        follow = await client.responses.with_raw_response.create(
            model=MODEL, input="after the stream", max_output_tokens=2,
            previous_response_id=last.id,
        )  # fmt: skip
    assert seen == [owner] * 4
    assert follow.headers[BACKEND] == owner and follow.parse().usage is not None


async def test_a_follow_up_of_a_conversation_the_gateway_never_saw_finds_its_twin() -> None:
    """The first turn went straight to the last twin (as if through another gateway, or
    before this one restarted): the gateway does not know the id, and least_request
    picks the first twin, which answers 404. The gateway tries the pool's other twins
    before answering (before: the 404 reached the client), every one of them even with
    ``retries: 0``, learns where the new turn went, and an id no twin holds still gets
    the engine's own 404."""
    async with twins({}, {}, {}) as servers:
        cfg = _config(servers, policy={"name": "least_request"}, retries=0)
        async with running_gateway(cfg) as url, _client(url) as client:
            direct = await _post(servers[2].url, "/v1/responses", {
                "model": MODEL, "input": "started elsewhere", "max_output_tokens": 2,
            })  # fmt: skip
            previous = orjson.loads(direct[2])["id"]
            for turn in range(2):
                raw = await client.responses.with_raw_response.create(
                    model=MODEL, input=f"turn {turn}", max_output_tokens=2,
                    previous_response_id=previous,
                )  # fmt: skip
                assert raw.headers[BACKEND] == "twin2", turn
                previous = raw.parse().id
            body = {"model": MODEL, "input": "x", "previous_response_id": "resp_nobody"}
            status, _, answer = await _post(url, "/v1/responses", body)
    assert status == 404 and b"resp_nobody" in answer and b"not found" in answer


async def test_anthropic_messages_through_gateway_non_stream_and_stream() -> None:
    async with twins({}) as servers, running_gateway(_config(servers)) as url:
        body = {
            "model": MODEL, "max_tokens": 4, "system": "be brief",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        }  # fmt: skip
        status, headers, raw = await _post(url, "/v1/messages", body)
        assert status == 200 and headers[BACKEND] == "twin0"
        msg = orjson.loads(raw)
        assert msg["type"] == "message" and msg["role"] == "assistant"
        assert msg["stop_reason"] == "max_tokens" and msg["usage"]["output_tokens"] == 4
        assert msg["content"][0]["type"] == "text" and msg["content"][0]["text"]
        status, headers, raw = await _post(url, "/v1/messages", {**body, "stream": True})
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        status_bad, _, bad = await _post(url, "/v1/messages", {**body, "max_tokens": None})
    names = [name for name, _ in _events(raw)]
    assert names == [
        "message_start", "content_block_start", *["content_block_delta"] * 4,
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    text = "".join(d["delta"]["text"] for n, d in _events(raw) if n == "content_block_delta")
    assert text == msg["content"][0]["text"]
    assert status_bad == 400 and orjson.loads(bad)["type"] == "error"


async def test_embeddings_through_gateway() -> None:
    async with (
        twins({}, {}) as servers,
        running_gateway(_config(servers)) as url,
        _client(url) as client,
    ):
        one = await client.embeddings.create(model=MODEL, input=["a cat", "a dog"])
        again = await client.embeddings.create(model=MODEL, input="a cat", dimensions=8)
        status, _, raw = await _post(
            url, "/v1/embeddings",
            {"model": MODEL, "input": "a cat", "encoding_format": "base64", "dimensions": 8},
        )  # fmt: skip
    vecs = [d.embedding for d in one.data]
    assert len(vecs) == 2 and len(vecs[0]) == 4096 and vecs[0] != vecs[1]
    assert abs(sum(x * x for x in vecs[0]) - 1.0) < 1e-6
    assert one.usage.prompt_tokens == 4 and len(again.data[0].embedding) == 8
    assert status == 200
    packed = base64.b64decode(orjson.loads(raw)["data"][0]["embedding"])
    floats = struct.unpack("<8f", packed)
    assert all(abs(a - b) < 1e-6 for a, b in zip(floats, again.data[0].embedding, strict=True))


async def test_tokenize_and_detokenize_through_gateway() -> None:
    async with twins({}) as servers, running_gateway(_config(servers)) as url:
        status, _, raw = await _post(url, "/tokenize", {"model": MODEL, "prompt": "hello world"})
        assert status == 200
        tokens = orjson.loads(raw)
        assert tokens["count"] == len(tokens["tokens"]) == 4  # hell, o, " wor", ld
        gen = await _post(
            url, "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 3}
        )
        text = orjson.loads(gen[2])["output"][0]["content"][0]["text"]
        ids = orjson.loads((await _post(url, "/tokenize", {"model": MODEL, "prompt": text}))[2])
        status, _, raw = await _post(url, "/detokenize", {"model": MODEL, "tokens": ids["tokens"]})
    assert status == 200 and orjson.loads(raw) == {"prompt": text}


async def test_api_the_backend_lacks_is_a_json_404_naming_it() -> None:
    async with twins({}) as servers, running_gateway(_config(servers)) as url:
        body = {"model": MODEL, "query": "q", "documents": ["a", "b"]}
        status, headers, raw = await _post(url, "/v1/rerank", body)
        gone = await _post(url, "/v1/responses", {
            "model": MODEL, "input": "x", "previous_response_id": "resp_unknown",
        })  # fmt: skip
        metrics = await twin_metrics(servers[0].url)
    assert status == 404 and headers["Content-Type"].startswith("application/json")
    error = orjson.loads(raw)["error"]
    assert "/v1/rerank" in error["message"] and "twin0" in error["message"]
    assert error["code"] == "unsupported_api" and error["type"] == "not_found_error"
    # the engine's own 404 (an unknown response id) is relayed as it is
    assert gone[0] == 404 and "resp_unknown" in orjson.loads(gone[2])["error"]["message"]
    assert metrics  # the twin stayed up


async def test_unknown_path_is_a_json_404_naming_it() -> None:
    async with twins({}) as servers, running_gateway(_config(servers)) as url:
        status, headers, raw = await _post(url, "/v1/nothing/here", {"model": MODEL})
    assert status == 404 and headers["Content-Type"].startswith("application/json")
    error = orjson.loads(raw)["error"]
    assert "/v1/nothing/here" in error["message"] and error["type"] == "not_found_error"


async def test_agent_apis_go_through_admission() -> None:
    async with twins({}) as servers:
        cfg = _config(servers, admission={"enabled": True})
        async with running_gateway(cfg) as url:
            for path, body in (
                ("/v1/responses", {"input": "x", "max_output_tokens": 2}),
                ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}),
                ("/v1/embeddings", {"input": "x"}),
            ):
                assert (await _post(url, path, {"model": MODEL, **body}))[0] == 200
            async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
                text = await r.text()
    admitted = f'kiloserve_gateway_admission_requests_total{{model="{MODEL}",outcome="admitted"}}'
    assert f"{admitted} 3.0" in text
