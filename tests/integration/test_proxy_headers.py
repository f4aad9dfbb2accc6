"""Header pass-through, both ways, streamed and not (issue 15, finding 10).

An engine's own response headers (rate-limit hints, its backend id) reach the client,
and the client's headers reach the engine, as through a transparent proxy: minus the
hop-by-hop headers (RFC 9110 section 7.6.1, and any header named in ``Connection``),
minus the framing the gateway redoes (``Content-Length``, ``Host``), with the gateway's
own ``x-request-id`` / ``x-kiloserve-backend`` winning and the client's API key kept
from the engine when the gateway checks keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from test_gateway_fakes import FakeBackend, fake_backends, gateway_config, running_gateway

from kiloserve.engine.protocol import PROBE_HEADER
from kiloserve.gateway.admission.auth import hash_key
from kiloserve.gateway.upstream import UpstreamPool

ENGINE_HEADERS = {
    "x-ratelimit-remaining-requests": "41",
    "x-ratelimit-reset-tokens": "6ms",
    "x-engine-backend-id": "engine-7",
    "openai-processing-ms": "12",
    # hop-by-hop: never relayed
    "Keep-Alive": "timeout=5, max=100",
    "Proxy-Connection": "keep-alive",
    "Trailer": "x-checksum",
    "Upgrade": "foo/2",
    "x-hop-secret": "named-in-connection",
    # the gateway's own headers win over an engine's same-named ones
    "x-request-id": "engine-request-id",
    "x-kiloserve-backend": "engine-says-so",
}
HOP_RESPONSE = {"keep-alive", "proxy-connection", "trailer", "upgrade", "x-hop-secret", "te"}


@dataclass
class HeaderBackend(FakeBackend):
    """Adds ``reply_headers`` to every answer; records the raw request headers it got
    (of client requests: a completion probe that lands mid-test, as in one CI run, is not).

    ``close_after`` answers with ``Connection: close, x-hop-secret`` and really closes."""

    reply_headers: dict[str, str] = field(default_factory=lambda: dict(ENGINE_HEADERS))
    close_after: bool = False
    raw_headers: list[list[tuple[str, str]]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = super().app()
        app.on_response_prepare.append(self._add_headers)
        return app

    async def _add_headers(self, request: web.Request, resp: web.StreamResponse) -> None:
        if request.method != "POST" or PROBE_HEADER in request.headers:
            return  # the gateway's own completion probes are not relayed client traffic
        self.raw_headers.append([(k.decode(), v.decode()) for k, v in request.raw_headers])
        resp.headers.update(self.reply_headers)
        if self.close_after:
            resp.headers["Connection"] = "close, X-Hop-Secret"
            resp.force_close()
        else:
            resp.headers["Connection"] = "keep-alive, X-Hop-Secret"


CLIENT_HEADERS = {
    "Authorization": "Bearer sk-client",
    "OpenAI-Organization": "org-1",
    "X-Custom-Trace": "abc",
    "User-Agent": "header-test/1",
    "Accept": "text/event-stream",
    "Cookie": "a=1",
    "x-session-id": "sess-9",
    # hop-by-hop: never forwarded
    "Connection": "keep-alive, X-Client-Hop",
    "X-Client-Hop": "1",
    "Keep-Alive": "timeout=3",
    "Proxy-Connection": "keep-alive",
    "TE": "trailers",
    "Trailer": "x-sum",
    # not printable / too long: the gateway makes its own id, and that one goes upstream
    "x-request-id": "r" * 200,
}
HOP_REQUEST = {"keep-alive", "proxy-connection", "te", "trailer", "x-client-hop", "upgrade"}


def _names(pairs: list[tuple[str, str]]) -> list[str]:
    return [k.lower() for k, _ in pairs]


def _check_response_headers(r: aiohttp.ClientResponse, backend: HeaderBackend) -> None:
    h = r.headers
    assert h["x-ratelimit-remaining-requests"] == "41"
    assert h["x-ratelimit-reset-tokens"] == "6ms"
    assert h["x-engine-backend-id"] == "engine-7"
    assert h["openai-processing-ms"] == "12"
    assert h.getall("x-kiloserve-backend") == ["b0"]
    assert h.getall("x-request-id") == [h["x-request-id"]] != ["engine-request-id"]
    assert not HOP_RESPONSE & {k.lower() for k in h}
    assert "connection" not in {k.lower() for k in h}  # the client's connection is ours
    assert len(h.getall("Content-Type")) == 1
    assert len(h.getall("Date")) == 1 and len(h.getall("Server")) == 1


def _check_request_headers(
    got: list[tuple[str, str]], backend: HeaderBackend, rid: str, *, keep_auth: bool
) -> None:
    names = _names(got)
    values = {k.lower(): v for k, v in got}
    assert values["openai-organization"] == "org-1"
    assert values["x-custom-trace"] == "abc"
    assert values["user-agent"] == "header-test/1"
    assert values["accept"] == "text/event-stream"
    assert values["cookie"] == "a=1"
    assert values["x-session-id"] == "sess-9"
    assert not HOP_REQUEST & set(names)
    assert values.get("connection", "keep-alive").lower() == "keep-alive"
    assert values["host"] == backend.url.removeprefix("http://")  # set to the backend
    assert values["content-type"] == "application/json"
    for name in ("host", "content-length", "content-type", "x-request-id"):
        assert names.count(name) == 1, (name, got)
    assert values["x-request-id"] == rid  # the gateway's id, not the client's bad one
    assert ("authorization" in values) is keep_auth
    if keep_auth:
        assert values["authorization"] == "Bearer sk-client"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("with_keys", [False, True])
async def test_headers_pass_through_both_ways(stream: bool, with_keys: bool) -> None:
    async with fake_backends(HeaderBackend(num_chunks=2)) as (fake,):
        kw: dict[str, Any] = {}
        if with_keys:
            kw["auth"] = {"keys": [{"name": "c", "key_sha256": hash_key("sk-client")}]}
        cfg = gateway_config([{"url": fake.url, "name": "b0", "models": ["m"]}], **kw)
        body = {"model": "m", "prompt": "p", "stream": stream}
        async with (
            running_gateway(cfg) as url,
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/completions", json=body, headers=CLIENT_HEADERS) as r,
        ):
            data = await r.read()
            assert r.status == 200, data
            _check_response_headers(r, fake)
            expected_type = "text/event-stream" if stream else "application/json"
            assert r.headers["Content-Type"].startswith(expected_type)
            rid = r.headers["x-request-id"]
    assert len(rid) < 200
    if stream:
        assert data.count(b"data: ") == 3 and data.endswith(b"data: [DONE]\n\n")
    else:
        assert orjson.loads(data)["choices"][0]["text"] == "hello"
    assert len(fake.raw_headers) == 1
    _check_request_headers(fake.raw_headers[0], fake, rid, keep_auth=not with_keys)


@pytest.mark.parametrize("stream", [False, True])
async def test_connection_close_from_engine_stays_upstream(stream: bool) -> None:
    """``Connection: close, X-Hop-Secret`` closes the upstream connection (not reused),
    and neither it nor the header it names reaches the client."""
    async with fake_backends(HeaderBackend(num_chunks=2, close_after=True)) as (fake,):
        cfg = gateway_config([{"url": fake.url, "name": "b0", "models": ["m"]}])
        body = {"model": "m", "prompt": "p", "stream": stream}
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    assert r.status == 200
                    _check_response_headers(r, fake)
    assert len(fake.raw_headers) == 3


async def test_error_answers_keep_engine_headers() -> None:
    """A 429 / 4xx relayed from the engine keeps its headers (``Retry-After``)."""
    fake = HeaderBackend(mode="429")
    fake.reply_headers = {**ENGINE_HEADERS, "Retry-After": "7"}
    async with fake_backends(fake):
        cfg = gateway_config([{"url": fake.url, "name": "b0", "models": ["m"]}])
        async with (
            running_gateway(cfg) as url,
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/completions", json={"model": "m"}) as r,
        ):
            assert r.status == 429
            assert r.headers["Retry-After"] == "7"
            assert r.headers["Content-Type"].startswith("application/json")
            _check_response_headers(r, fake)
            assert (await r.json())["error"]["message"] == "fake 429"
        fake.mode = "400"
        async with (
            running_gateway(cfg) as url,
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/completions", json={"model": "m"}) as r,
        ):
            assert r.status == 400
            _check_response_headers(r, fake)


async def test_upstream_client_reads_connection_tokens() -> None:
    """``Connection: close, X-Other`` is a close: the connection is not pooled."""
    async with fake_backends(HeaderBackend(close_after=True)) as (fake,):
        pool = UpstreamPool(connect_timeout_s=2.0)
        try:
            resp = await pool.post(
                fake.url, "/v1/completions", b'{"model":"m"}', {"Content-Type": "application/json"}
            )
            await resp.read()
            resp.release()
            assert not pool._idle.get(("127.0.0.1", int(fake.url.rsplit(":", 1)[1])))
            names = [name for name, _ in resp.headers]
            assert b"x-ratelimit-remaining-requests" in names and b"connection" in names
        finally:
            await pool.close()
