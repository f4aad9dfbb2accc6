"""``n`` > 1: one engine sequence per choice, as vLLM's parallel sampling.

The twin submits ``n`` requests with the same prompt (so the engine model pays for
``n`` sequences; the later ones find the prompt in the prefix cache once the first
has computed it, as vLLM's children do) and answers with ``n`` choices, ``index``
``0 .. n-1``: non-streaming, every choice once all are done; streaming, each choice's
chunks as its tokens come (the chat role chunk of each with its first token), then one
usage chunk (``stream_options.include_usage``) counting every choice's tokens.

Differences from vLLM: the twin's metrics count ``n`` requests, and the stall fault
(``stall_after_tokens``) does not apply to such requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import orjson
from aiohttp import web

from kiloserve.engine.protocol import (
    DONE_EVENT,
    GenerationRequest,
    next_stream_chunks,
    plan_output,
)
from kiloserve.engine.shaped_output import ShapedChunkEncoder
from kiloserve.engine.twin import RequestStream, Twin, Watched

__all__ = ["generate_n"]

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _encoders(twin: Twin, gen: GenerationRequest) -> list[ShapedChunkEncoder]:
    prefix = "cmpl-" if gen.kind == "completion" else "chatcmpl-"
    args = (gen.kind, prefix + uuid.uuid4().hex, twin.model_name, int(time.time()))
    return [ShapedChunkEncoder(*args, gen.fields, index=i) for i in range(gen.n)]


def _num_cached(twin: Twin, streams: list[RequestStream]) -> int | None:
    if not twin.config.enable_prompt_tokens_details:
        return None
    return streams[0].num_cached_tokens


async def _submit(
    twin: Twin, gen: GenerationRequest, entry: Watched, is_probe: bool
) -> list[RequestStream]:
    num_out, finish = plan_output(gen, twin.max_model_len)
    submit = twin.loop.submit
    streams = await asyncio.gather(
        *(
            submit(gen.prompt_token_ids, num_out, finish, is_notify_each_step=gen.is_stream,
                   is_probe=is_probe)
            for _ in range(gen.n)
        )
    )  # fmt: skip
    entry.stream = streams[0]  # a vanished client aborts it; the others follow
    return list(streams)


async def _full(twin: Twin, gen: GenerationRequest, streams: list[RequestStream]) -> web.Response:
    for stream in streams:
        while not stream.is_finished:
            await stream.wait_beyond(stream.num_generated_tokens)
        if stream.finish_reason == "abort":
            return web.Response(status=499)  # the client is gone; nobody reads this
    num_prompt, cached = len(gen.prompt_token_ids), _num_cached(twin, streams)
    bodies = [
        orjson.loads(enc.full_response(num_prompt, s.num_generated_tokens, s.finish_reason, cached))
        for enc, s in zip(_encoders(twin, gen), streams, strict=True)
        if s.finish_reason is not None
    ]
    body = bodies[0]
    body["choices"] = [b["choices"][0] for b in bodies]
    num_out = sum(s.num_generated_tokens for s in streams)
    body["usage"].update(completion_tokens=num_out, total_tokens=num_prompt + num_out)
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _chunks(
    response: web.StreamResponse,
    encoders: list[ShapedChunkEncoder],
    streams: list[RequestStream],
    is_chat: bool,
) -> bool:
    """Write every choice's chunks until all finish; False when one was aborted."""
    num_sent = [0] * len(streams)
    roles = [enc.role_chunk() if is_chat else b"" for enc in encoders]
    is_done = [False] * len(streams)
    while not all(is_done):
        for i, stream in enumerate(streams):
            if is_done[i]:
                continue
            await stream.wait_beyond(num_sent[i])
            if stream.finish_reason == "abort":
                return False
            ready, reason = stream.num_generated_tokens, stream.finish_reason
            data, num_sent[i], _ = next_stream_chunks(encoders[i], num_sent[i], ready, reason, None)
            is_done[i] = stream.is_finished
            await response.write(roles[i] + data)
            roles[i] = b""
    return True


async def _stream(
    request: web.Request, twin: Twin, gen: GenerationRequest, streams: list[RequestStream]
) -> web.StreamResponse:
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    encoders = _encoders(twin, gen)
    with contextlib.suppress(ConnectionError):
        if not await _chunks(response, encoders, streams, gen.kind == "chat"):
            return response
        data = b""
        if gen.include_usage:
            num_out = sum(s.num_generated_tokens for s in streams)
            cached = _num_cached(twin, streams)
            data = encoders[0].usage_chunk(len(gen.prompt_token_ids), num_out, cached)
        await response.write(data + DONE_EVENT)
        await response.write_eof()
    return response


async def generate_n(
    request: web.Request, twin: Twin, gen: GenerationRequest, entry: Watched, is_probe: bool
) -> web.StreamResponse:
    """Serve a request with ``gen.n`` > 1 choices (the caller aborts ``entry.stream``)."""
    streams = await _submit(twin, gen, entry, is_probe)
    try:
        if entry.gone.is_set():
            return web.Response(status=499)
        if gen.is_stream:
            return await _stream(request, twin, gen, streams)
        return await _full(twin, gen, streams)
    finally:
        for stream in streams:
            twin.loop.abort(stream)
