"""OpenTelemetry tracing (issue 18): the gateway's spans and the twins' spans reach a
real OTLP/HTTP receiver (an aiohttp server in the test that parses the protobufs), as
one trace per request that continues the client's ``traceparent``.

The gateway's own spans for a mid-stream migration and an admission wait are checked on
their own (a twin that stalls after a few tokens, admission on).

Three twins behind the gateway with round robin: ``bad`` answers every request with a
503, ``good`` and ``other`` serve. Two streamed requests: the first starts on ``bad`` and
is retried on ``good`` (two attempt spans, two engine spans); the round-robin cursor then
points at ``other``, which serves the second at once.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from test_gateway_fakes import gateway_config, running_gateway
from test_gateway_twins import MODEL, twins

from kiloserve.engine.faults import FaultSet

pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

MAX_TOKENS = 5


@dataclass(frozen=True)
class _Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    events: tuple[str, ...]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def _parse(body: bytes) -> list[_Span]:
    request = pb2.ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for rs in request.resource_spans:
        res = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                attrs = {a.key: _value(a.value) for a in s.attributes}
                events = tuple(e.name for e in s.events)
                ids = (s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex())
                spans.append(_Span(res["service.name"], s.name, *ids, attrs, events))
    return spans


@contextlib.asynccontextmanager
async def otlp_receiver() -> AsyncIterator[tuple[str, list[_Span]]]:
    """An OTLP/HTTP trace receiver on 127.0.0.1 port 0: (its URL, the spans it got)."""
    spans: list[_Span] = []

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        spans.extend(_parse(await request.read()))
        body = pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/v1/traces", spans
    finally:
        await runner.cleanup()


async def _stream_chat(url: str, traceparent: str) -> str:
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": MAX_TOKENS, "stream": True,
    }  # fmt: skip
    headers = {"traceparent": traceparent}
    chat_url = url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as s, s.post(chat_url, json=body, headers=headers) as r:
        assert r.status == 200
        text = await r.text()
    assert text.rstrip().endswith("data: [DONE]")
    return text


async def _run_requests() -> tuple[list[_Span], list[tuple[str, str]]]:
    clients = [(secrets.token_hex(16), secrets.token_hex(8)) for _ in range(2)]
    async with otlp_receiver() as (endpoint, spans):
        bad = {"faults": FaultSet(error_rate=1.0, error_status=503)}
        traced = {"otlp_traces_endpoint": endpoint}
        async with twins({**bad, **traced}, traced, traced) as servers:
            names = ["bad", "good", "other"]
            backends = [{"url": t.url, "name": n} for t, n in zip(servers, names, strict=True)]
            tracing = {"enabled": True, "otlp_endpoint": endpoint, "service_name": "gw-test"}
            cfg = gateway_config(backends, retries=1, tracing=tracing)
            async with running_gateway(cfg) as url:
                for trace_id, span_id in clients:
                    await _stream_chat(url, f"00-{trace_id}-{span_id}-01")
        # the gateway and the twins flush their batches when they stop
        return list(spans), clients


def _one(spans: list[_Span], **match: Any) -> _Span:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def _check_engine_span(spans: list[_Span], attempt: _Span, status: int) -> None:
    """The engine's span: same trace, child of the gateway's attempt span."""
    engine = _one(spans, service="kiloserve-engine", parent_id=attempt.span_id)
    assert engine.name == "llm_request"
    assert engine.trace_id == attempt.trace_id
    assert engine.attributes["gen_ai.response.model"] == MODEL
    assert engine.attributes["http.response.status_code"] == status
    if status == 200:
        assert engine.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
        assert engine.attributes["gen_ai.usage.input_tokens"] > 0


def _check_trace(
    spans: list[_Span], trace_id: str, client_span: str, names: list[str]
) -> list[_Span]:
    """Root, route and attempt spans of one request; returns its attempts, in order."""
    mine = [s for s in spans if s.trace_id == trace_id]
    root = _one(mine, service="gw-test", name="POST /v1/chat/completions")
    assert root.parent_id == client_span  # the client's traceparent is continued
    attrs = root.attributes
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.usage.input_tokens"] > 0
    assert attrs["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert attrs["http.response.status_code"] == 200
    assert "first_token" in root.events
    route = _one(mine, name="kiloserve.route")
    assert route.parent_id == root.span_id
    assert route.attributes["kiloserve.policy"] == "round_robin"
    assert sorted(route.attributes["kiloserve.ranked"]) == names
    attempts = sorted(
        (s for s in mine if s.name == "kiloserve.attempt"),
        key=lambda s: s.attributes["kiloserve.attempt.number"],
    )
    assert attempts and all(a.parent_id == root.span_id for a in attempts)
    assert route.attributes["kiloserve.backend"] == attempts[0].attributes["kiloserve.backend"]
    assert attrs["kiloserve.backend"] == attempts[-1].attributes["kiloserve.backend"]
    for attempt in attempts:
        connect = _one(mine, name="kiloserve.upstream.connect", parent_id=attempt.span_id)
        assert connect.service == "gw-test"
    return attempts


async def test_streamed_and_retried_requests_export_one_trace_each() -> None:
    spans, clients = await _run_requests()
    by_backend: dict[str, list[_Span]] = {}
    for trace_id, client_span in clients:
        attempts = _check_trace(spans, trace_id, client_span, ["bad", "good", "other"])
        by_backend[attempts[0].attributes["kiloserve.backend"]] = attempts
    assert set(by_backend) == {"bad", "other"}
    served = by_backend["other"]  # streamed, served at once
    assert len(served) == 1
    assert served[0].attributes["kiloserve.attempt.kind"] == "first"
    assert served[0].attributes["http.response.status_code"] == 200
    assert served[0].attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert "first_token" in served[0].events
    _check_engine_span(spans, served[0], 200)
    first, retry = by_backend["bad"]  # a 503 on ``bad``, then retried on ``good``
    assert first.attributes["http.response.status_code"] == 503
    assert first.attributes["kiloserve.attempt.kind"] == "first"
    assert "first_token" not in first.events
    assert retry.attributes["kiloserve.backend"] == "good"
    assert retry.attributes["kiloserve.attempt.kind"] == "retry"
    assert retry.attributes["http.response.status_code"] == 200
    assert "first_token" in retry.events
    _check_engine_span(spans, first, 503)
    _check_engine_span(spans, retry, 200)


async def test_migrated_stream_has_one_attempt_span_per_backend_and_admission() -> None:
    client = (secrets.token_hex(16), secrets.token_hex(8))
    async with otlp_receiver() as (endpoint, spans):
        stall = {"faults": FaultSet(stall_after_tokens=2)}
        async with twins(stall, {}) as servers:
            named = zip(servers, ["stall", "good"], strict=True)
            backends = [{"url": t.url, "name": n} for t, n in named]
            cfg = gateway_config(
                backends, migration={"stall_timeout_s": 0.3}, admission={"enabled": True},
                tracing={"enabled": True, "otlp_endpoint": endpoint, "service_name": "gw-test"},
            )  # fmt: skip
            async with running_gateway(cfg) as url:
                text = await _stream_chat(url, f"00-{client[0]}-{client[1]}-01")
        assert "error" not in text
    attempts = _check_trace(list(spans), *client, ["good", "stall"])
    assert [a.attributes["kiloserve.backend"] for a in attempts] == ["stall", "good"]
    assert [a.attributes["kiloserve.attempt.kind"] for a in attempts] == ["first", "migration"]
    assert [a.attributes["http.response.status_code"] for a in attempts] == [504, 200]
    assert all("first_token" in a.events for a in attempts)
    root = _one(list(spans), trace_id=client[0], name="POST /v1/chat/completions")
    wait = _one(list(spans), trace_id=client[0], name="kiloserve.admission")
    assert wait.parent_id == root.span_id
