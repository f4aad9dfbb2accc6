"""The twin's agent-era endpoints (issue 18; docs/engine-twin.md, "Agent-era APIs").

``POST /v1/responses`` (stream and not; ``previous_response_id`` continues a stored
conversation, as vLLM's with its response store on), ``POST /v1/messages`` (Anthropic
Messages, stream and not; errors in Anthropic's shape), ``POST /v1/embeddings`` and
``POST /detokenize``. ``/v1/rerank`` is not served: vLLM registers it only for score
(cross-encoder) models, so for a generative model it answers 404, as the twin does.

Timing is the engine model's, as for completions: each request is prefilled and
decoded by ``TwinLoop``; an embedding is a prefill and one step. The answer's length is
the twin's natural one (``protocol.natural_output_tokens``) capped by
``max_output_tokens`` / ``max_tokens`` (an agent's budget, not an exact length).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from kiloserve.catalog.loader import get_model
from kiloserve.engine.agent_protocol import (
    anthropic_chat_messages,
    embedding_inputs,
    encode_embedding,
    pseudo_embedding,
    responses_chat_messages,
    truncate_embedding,
)
from kiloserve.engine.agent_shapes import MessagesEncoder, ResponsesEncoder, responses_usage
from kiloserve.engine.http_body import read_json_object
from kiloserve.engine.protocol import PROBE_HEADER, GenerationRequest, plan_output, render_chat
from kiloserve.engine.sequence import output_token_id, output_word
from kiloserve.engine.twin import DisconnectWatcher, RequestStream, Twin, Watched
from kiloserve.errors import NotFoundError, RequestError
from kiloserve.tokens import FILLER_WORDS

__all__ = ["MAX_STORED_RESPONSES", "add_agent_routes"]

MAX_STORED_RESPONSES = 10_000  # conversations kept for previous_response_id (LRU)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_ECHOED = ("instructions", "max_output_tokens", "previous_response_id", "temperature",
           "top_p", "user", "metadata")  # fmt: skip
Messages = list[dict[str, Any]]


@dataclass(slots=True)
class _Agent:
    """What the handlers share: the twin, its disconnect watcher, the response store."""

    twin: Twin
    watcher: DisconnectWatcher
    store: OrderedDict[str, Messages] = field(default_factory=OrderedDict)


_AGENT_KEY = web.AppKey("kiloserve_twin_agent_apis", _Agent)


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _check_model(twin: Twin, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model != twin.model_name:
        raise NotFoundError(f"The model `{model}` does not exist.", param="model")


def _opt_int(body: dict[str, Any], key: str, minimum: int = 1) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if type(value) is not int or value < minimum:
        raise RequestError(f"'{key}' must be an integer of at least {minimum}", param=key)
    return value


def _is_stream(body: dict[str, Any]) -> bool:
    value = body.get("stream", False)
    if not isinstance(value, bool | None):
        raise RequestError("'stream' must be a boolean", param="stream")
    return bool(value)


def _plan(twin: Twin, ids: list[int], budget: int | None) -> tuple[int, str]:
    """(output tokens, finish): the natural length, capped by ``budget``."""
    gen = GenerationRequest(
        kind="chat", model=None, prompt_token_ids=ids, max_tokens=None, is_stream=False,
        include_usage=False, ignore_eos=False,
    )  # fmt: skip
    num_out, finish = plan_output(gen, twin.max_model_len)
    if budget is not None and num_out >= budget:
        return budget, "length"
    return num_out, finish


async def _start(
    request: web.Request, twin: Twin, ids: list[int], plan: tuple[int, str], is_stream: bool
) -> tuple[RequestStream, Watched]:
    entry = request.app[_AGENT_KEY].watcher.watch(request)
    stream = await twin.loop.submit(
        ids, plan[0], plan[1], is_notify_each_step=is_stream,
        is_probe=PROBE_HEADER in request.headers,
    )  # fmt: skip
    entry.stream = stream
    if entry.gone.is_set():
        twin.loop.abort(stream)
    return stream, entry


def _done(request: web.Request, twin: Twin, stream: RequestStream | None) -> None:
    request.app[_AGENT_KEY].watcher.unwatch(request)
    if stream is not None:
        twin.loop.abort(stream)  # a no-op once finished


async def _wait_finished(stream: RequestStream) -> None:
    while not stream.is_finished:
        await stream.wait_beyond(stream.num_generated_tokens)


async def _stream_tokens(
    request: web.Request,
    stream: RequestStream,
    head: bytes,
    first: Callable[[], bytes],
    delta: Callable[[str], bytes],
    tail: Callable[[int, str], bytes],
) -> web.StreamResponse:
    """``head`` at once, ``first()`` with the first token, ``delta`` per token, then
    ``tail(num_tokens, finish)``; the client gone or an abort ends it."""
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    num_sent = 0
    with contextlib.suppress(ConnectionError):
        if head:
            await response.write(head)
        while True:
            await stream.wait_beyond(num_sent)
            if stream.finish_reason == "abort":
                return response
            num = stream.num_generated_tokens
            data = first() if num_sent == 0 and num > 0 else b""
            data += b"".join(delta(output_word(i)) for i in range(num_sent, num))
            num_sent = num
            if stream.is_finished:
                await response.write(data + tail(num, stream.finish_reason or "stop"))
                await response.write_eof()
                return response
            if data:
                await response.write(data)
    return response  # the client went away


def _text(num_tokens: int) -> str:
    return "".join(output_word(i) for i in range(num_tokens))


def _history(request: web.Request, body: dict[str, Any]) -> Messages:
    previous = body.get("previous_response_id")
    if previous is None:
        return []
    store = request.app[_AGENT_KEY].store
    if not isinstance(previous, str) or previous not in store:
        raise NotFoundError(
            f"Response with id '{clip_id(previous)}' not found.", param="previous_response_id"
        )
    store.move_to_end(previous)
    return list(store[previous])


def clip_id(value: object) -> str:
    return str(value)[:128]


def _store(request: web.Request, response_id: str, messages: Messages) -> None:
    store = request.app[_AGENT_KEY].store
    store[response_id] = messages
    if len(store) > MAX_STORED_RESPONSES:
        store.popitem(last=False)


async def responses(request: web.Request) -> web.StreamResponse:
    twin = request.app[_AGENT_KEY].twin
    body = await read_json_object(request)
    _check_model(twin, body)
    messages = _history(request, body) + responses_chat_messages(body)
    ids = twin.tokenize(render_chat(messages))
    budget, is_stream = _opt_int(body, "max_output_tokens"), _is_stream(body)
    keep = body.get("store", True) is not False
    plan = _plan(twin, ids, budget)
    fields = {k: body.get(k) for k in _ECHOED} | {"store": keep}
    enc = ResponsesEncoder("resp_" + uuid.uuid4().hex, twin.model_name, int(time.time()), fields)
    stream: RequestStream | None = None
    try:
        stream, _entry = await _start(request, twin, ids, plan, is_stream)
        answer = stream  # for the closures below

        def tail(num: int, finish: str) -> bytes:
            status, text = ("incomplete" if finish == "length" else "completed"), _text(num)
            if keep:
                _store(
                    request, enc.response_id, [*messages, {"role": "assistant", "content": text}]
                )
            usage = responses_usage(len(ids), num, answer.num_cached_tokens)
            return enc.end_events(text, status, usage)

        if is_stream:
            return await _stream_tokens(
                request, stream, enc.start_events(), enc.first_events, enc.delta, tail
            )
        await _wait_finished(stream)
        if stream.finish_reason == "abort":
            return web.Response(status=499)
        num = stream.num_generated_tokens
        tail(num, stream.finish_reason or "stop")  # stores the conversation
        status = "incomplete" if stream.finish_reason == "length" else "completed"
        usage = responses_usage(len(ids), num, stream.num_cached_tokens)
        return _json(enc.response(status, _text(num), usage))
    finally:
        _done(request, twin, stream)


async def _messages(request: web.Request) -> web.StreamResponse:
    twin = request.app[_AGENT_KEY].twin
    body = await read_json_object(request)
    _check_model(twin, body)
    if body.get("max_tokens") is None:
        raise RequestError("max_tokens: Field required", param="max_tokens")
    budget, is_stream = _opt_int(body, "max_tokens"), _is_stream(body)
    ids = twin.tokenize(render_chat(anthropic_chat_messages(body)))
    plan = _plan(twin, ids, budget)
    enc = MessagesEncoder(twin.model_name)
    stream: RequestStream | None = None
    try:
        stream, _entry = await _start(request, twin, ids, plan, is_stream)
        if is_stream:
            return await _stream_tokens(
                request, stream, b"", lambda: enc.first_events(len(ids)), enc.delta,
                enc.end_events,
            )  # fmt: skip
        await _wait_finished(stream)
        if stream.finish_reason == "abort":
            return web.Response(status=499)
        num = stream.num_generated_tokens
        return _json(enc.message(_text(num), stream.finish_reason or "stop", len(ids), num))
    finally:
        _done(request, twin, stream)


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic Messages; its errors in Anthropic's shape (as vLLM's endpoint)."""
    try:
        return await _messages(request)
    except RequestError as exc:
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        error = {"type": "error", "error": {"type": kind, "message": exc.message}}
        return _json(error, exc.status)


def _embedding_ids(twin: Twin, body: dict[str, Any]) -> list[list[int]]:
    ids = [twin.tokenize(x) if isinstance(x, str) else x for x in embedding_inputs(body)]
    for one in ids:
        if len(one) > twin.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {twin.max_model_len} tokens. "
                f"However, you requested {len(one)} tokens in the input for embedding "
                "generation. Please reduce the length of the input.",
                param="input",
            )
    return ids


def _vector(ids: list[int], hidden: int, num_dims: int, fmt: str) -> list[float] | str:
    vec = pseudo_embedding(ids, hidden)
    return encode_embedding(vec if num_dims == hidden else truncate_embedding(vec, num_dims), fmt)


async def embeddings(request: web.Request) -> web.Response:
    twin = request.app[_AGENT_KEY].twin
    body = await read_json_object(request)
    _check_model(twin, body)
    hidden = get_model(twin.config.model).hidden_size
    num_dims = _opt_int(body, "dimensions") or hidden
    if num_dims > hidden:
        raise RequestError(f"'dimensions' must be at most {hidden}", param="dimensions")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise RequestError("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    ids = _embedding_ids(twin, body)
    probe = PROBE_HEADER in request.headers
    streams = [
        await twin.loop.submit(one, 1, "length", is_notify_each_step=False, is_probe=probe)
        for one in ids
    ]
    try:
        await asyncio.gather(*(_wait_finished(s) for s in streams))
    finally:
        for s in streams:
            twin.loop.abort(s)
    data = [
        {"index": i, "object": "embedding", "embedding": _vector(one, hidden, num_dims, fmt)}
        for i, one in enumerate(ids)
    ]
    num_prompt = sum(len(one) for one in ids)
    usage = {"prompt_tokens": num_prompt, "total_tokens": num_prompt, "completion_tokens": 0,
             "prompt_tokens_details": None}  # fmt: skip
    return _json({"id": "embd-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
                  "model": twin.model_name, "data": data, "usage": usage})  # fmt: skip


# the twin's output pieces, decodable (other ids: ``<|id|>``: the approximate
# tokenizer hashes pieces and cannot be inverted)
_OUTPUT_PIECES = {output_token_id(i): output_word(i) for i in range(len(FILLER_WORDS))}


async def detokenize(request: web.Request) -> web.Response:
    twin = request.app[_AGENT_KEY].twin
    body = await read_json_object(request)
    _check_model(twin, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise RequestError("'tokens' must be a list of token ids", param="tokens")
    return _json({"prompt": "".join(_OUTPUT_PIECES.get(t, f"<|{t}|>") for t in tokens)})


def add_agent_routes(app: web.Application, twin: Twin, watcher: DisconnectWatcher) -> None:
    """Register the agent-era endpoints on the twin's ``app``."""
    app[_AGENT_KEY] = _Agent(twin, watcher)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/detokenize", detokenize)
