"""Issue 15: every bad request gets a clear OpenAI-style 4xx, and none floods the log.

Token-id prompts out of range or nested too deep and bodies that fail to decode were
plain-text 500s; aiohttp's own 404 / 405 / 413 were plain text; a non-object
``stream_options`` was silently rewritten; a 100 KB ``model`` came back whole in the
404; and every malformed request logged an ERROR with a traceback. Requests go to a
real gateway on 127.0.0.1 (raw sockets for what never reaches a handler).
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import re
import zlib
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from test_gateway_fakes import FakeBackend, fake_backends, gateway_config, running_gateway

from kiloserve.errors import ERROR_TYPES
from kiloserve.gateway.errors import ProtocolErrorLog, error_middleware


async def _error(resp: aiohttp.ClientResponse, status: int) -> dict[str, Any]:
    """The OpenAI error object of ``resp``, after checking its status, type and shape."""
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    assert resp.headers["x-request-id"]
    body = await resp.json()
    assert set(body) == {"error"}
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ERROR_TYPES[status]
    return err


def _problems(caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[str]]:
    """(ERROR-or-worse or traceback-carrying records, WARNING records) as text."""
    bad = [
        f"{r.name} {r.levelname} {r.getMessage()}"
        for r in caplog.records
        if r.levelno >= logging.ERROR or (r.levelno >= logging.WARNING and r.exc_info)
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    return bad, warnings


@pytest.mark.parametrize(
    "prompt",
    [[1, 2, 2**40], [-1, 2, 3], [True, 2, 3], [[1, 2], [[3]]], [[1, 2], [3, 2**33]]],
    ids=repr,
)
async def test_bad_token_id_prompts_are_400_naming_prompt(
    prompt: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url}], block_size=2)
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": prompt}
            async with s.post(url + "/v1/completions", json=body) as r:
                err = await _error(r, 400)
            assert err["param"] == "prompt"
            assert "token ids" in err["message"] or "nests" in err["message"]
            good = {"model": "m", "prompt": [[1, 2], [3, 2**32 - 1]]}
            async with s.post(url + "/v1/completions", json=good) as r:
                assert r.status == 200
    assert len(fake.bodies) == 1
    assert _problems(caplog)[0] == []


@pytest.mark.parametrize(
    ("encoding", "data", "needle"),
    [
        ("gzip", b'{"model": "m"}', "decode"),  # not gzip at all
        ("deflate", b"\x78\x9c garbage", "decode"),
        ("x-unknown", b'{"model": "m"}', "Content-Encoding"),  # aiohttp: passed through
        ("gzip, deflate", b'{"model": "m"}', "Content-Encoding"),
        # a gzip stream cut short decodes to a prefix: aiohttp does not check the trailer
        ("gzip", gzip.compress(b'{"model": "m", "prompt": "x"}')[:-9], "JSON"),
    ],
)
async def test_bodies_that_fail_to_decode_are_400(
    encoding: str, data: bytes, needle: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url}])
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            hdrs = {"Content-Encoding": encoding, "Content-Type": "application/json"}
            async with s.post(url + "/v1/completions", data=data, headers=hdrs) as r:
                err = await _error(r, 400)
            assert needle in err["message"]
            async with s.post(url + "/v1/completions", json={"model": "m"}) as r:
                assert r.status == 200  # the gateway is fine afterwards
    assert len(fake.bodies) == 1
    assert _problems(caplog)[0] == []


async def test_compressed_bodies_reach_the_backend_decoded() -> None:
    """aiohttp decodes gzip / deflate bodies; the engine gets the decoded JSON, so it
    must not also get the client's ``Content-Encoding`` (it would fail to decode it)."""
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url}])
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            for enc, packed in [
                ("gzip", gzip.compress(b'{"model": "m", "prompt": "g"}')),
                ("deflate", zlib.compress(b'{"model": "m", "prompt": "d"}')),
                ("identity", b'{"model": "m", "prompt": "i"}'),
            ]:
                hdrs = {"Content-Encoding": enc}
                async with s.post(url + "/v1/completions", data=packed, headers=hdrs) as r:
                    assert r.status == 200, (enc, await r.text())
    assert [b["prompt"] for b in fake.bodies] == ["g", "d", "i"]
    assert all("content-encoding" not in h for h in fake.headers)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stream": True, "stream_options": "x"}, "stream_options"),
        ({"stream": True, "stream_options": ["include_usage"]}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"stream": "yes"}, "stream"),
    ],
)
async def test_stream_fields_of_the_wrong_type_are_400(body: dict[str, Any], param: str) -> None:
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url}])
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"model": "m", **body}) as r:
                err = await _error(r, 400)
            assert err["param"].startswith(param) and param in err["message"]
            ok = {"model": "m", "stream": True, "stream_options": None}
            async with s.post(url + "/v1/completions", json=ok) as r:
                assert r.status == 200
                await r.read()
    assert len(fake.bodies) == 1


async def test_a_huge_model_name_is_not_echoed_whole() -> None:
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url}])
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            model = "q" * 100_000
            async with s.post(url + "/v1/completions", json={"model": model}) as r:
                err = await _error(r, 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    assert len(err["message"]) < 600
    assert "q" * 256 + "... (100000 chars)" in err["message"]
    assert "Served models: m" in err["message"]


async def test_aiohttp_http_errors_are_openai_json() -> None:
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url}], max_body_bytes=1000)
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            async with s.get(url + "/nope") as r:
                not_found = await _error(r, 404)
            path = "/v1/nope/" + "p" * 5000
            async with s.post(url + path, json={}) as r:
                long_path = await _error(r, 404)
            async with s.get(url + "/v1/completions") as r:
                wrong = await _error(r, 405)
                assert r.headers["Allow"] == "POST"
            async with s.delete(url + "/health") as r:
                wrong_health = await _error(r, 405)
                assert "GET" in r.headers["Allow"]

            async def chunks() -> Any:  # no Content-Length: the limit trips while reading
                for _ in range(20):
                    yield b"x" * 100

            async with s.post(url + "/v1/completions", data=chunks()) as r:
                too_big = await _error(r, 413)
    assert "/nope" in not_found["message"] and not_found["type"] == "not_found_error"
    assert len(long_path["message"]) < 600 and f"({len(path)} chars)" in long_path["message"]
    assert wrong["type"] == wrong_health["type"] == "invalid_request_error"
    assert "GET" in wrong["message"] and "/v1/completions" in wrong["message"]
    assert "1000-byte" in too_big["message"]


async def test_client_max_size_413_from_any_handler_is_openai_json() -> None:
    """The middleware turns every ``web.HTTPException`` (here aiohttp's own 413 from
    ``client_max_size`` in a handler that reads the body) into the OpenAI shape."""

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    app = web.Application(client_max_size=100, middlewares=[error_middleware(lambda _r: "rid")])
    app.router.add_post("/echo", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/echo", data=b"x" * 500) as r:
                err = await _error(r, 413)
            assert r.headers["x-request-id"] == "rid"
            async with s.post(f"http://127.0.0.1:{port}/echo", data=b"ok") as r:
                assert r.status == 200 and await r.read() == b"ok"
    finally:
        await runner.cleanup()
    assert err["type"] == "invalid_request_error" and err["code"] == 413


_MALFORMED = [
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n{}",
    b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nNOT A REQUEST\r\n\r\n",  # 2nd on keep-alive
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
    b"Content-Encoding: br\r\n\r\nhello",  # aiohttp cannot decode br here: protocol level
]


async def _raw(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5.0)  # the server closes after a 400
    finally:
        writer.close()


async def test_malformed_requests_get_400_and_at_most_one_warning_per_burst(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url}])
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            caplog.clear()
            answers = [await _raw(url, _MALFORMED[i % len(_MALFORMED)]) for i in range(50)]
            # bodies that fail to decode are in the same family (RequestPayloadError)
            hdrs = {"Content-Encoding": "gzip"}
            for _ in range(10):
                async with s.post(url + "/v1/completions", data=b"{}", headers=hdrs) as r:
                    assert r.status == 400
            async with s.post(url + "/v1/completions", json={"model": "m"}) as r:
                assert r.status == 200  # still serving
    # the last answer on each connection is the 4xx (the keep-alive case has a 200 first)
    statuses = [re.findall(rb"HTTP/1\.[01] (\d{3}) ", a)[-1:] for a in answers]
    assert all(st and st[0].startswith(b"4") for st in statuses), statuses
    bad, warnings = _problems(caplog)
    assert bad == []
    assert len(warnings) <= 1, warnings


def test_protocol_error_log_rate_limits_client_faults_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = ProtocolErrorLog(interval_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    for _ in range(50):  # what aiohttp's handle_error does for each malformed request
        log.exception("Error handling request from %s", "1.2.3.4", exc_info=BadHttpMessage("x"))
    now[0] = 10.0
    log.exception("Unhandled exception", exc_info=web.RequestPayloadError("bad gzip"))
    real = RuntimeError("a gateway bug")
    log.exception("Error handling request from %s", "1.2.3.4", exc_info=real)
    log.debug("Ignored premature client disconnection")
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert [r.exc_info for r in warnings] == [None, None]
    assert "0 more" in warnings[0].getMessage() and "49 more" in warnings[1].getMessage()
    assert "RequestPayloadError" in warnings[1].getMessage()
    errors = [r for r in records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None  # a real bug keeps its trace
    assert errors[0].exc_info[1] is real
    assert sum(r.levelno == logging.DEBUG for r in records) == 49 + 1
