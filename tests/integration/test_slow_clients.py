"""Slow and greedy clients against a real gateway on 127.0.0.1 (issue 15, finding 4).

Raw sockets: half a request head, a body stopped mid-way, uploads past the body
buffer cap, connections past the connection cap, an idle keep-alive connection,
accept() out of descriptors. The gateway is started the way ``kiloserve gateway``
starts it (``make_runner``), with small limits so each test takes about a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from kiloserve.gateway.app import BODY_BUDGET_KEY, create_gateway_app, make_runner
from kiloserve.gateway.config import GatewayConfig, parse_gateway_config

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def _cfg(**overrides: Any) -> GatewayConfig:
    base: dict[str, Any] = {
        # a backend that serves "m" but is never reached (nothing listens on port 9)
        "backends": [{"url": "http://127.0.0.1:9", "models": ["m"]}],
        "client_header_timeout_s": 5.0,
        "client_body_timeout_s": 5.0,
        "keepalive_timeout_s": 30.0,
        "max_connections": 64,
    }
    return parse_gateway_config({**base, **overrides})


@contextlib.asynccontextmanager
async def _gateway(cfg: GatewayConfig) -> AsyncIterator[tuple[int, web.Application]]:
    app = create_gateway_app(cfg)
    runner = make_runner(app, cfg)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield runner.addresses[0][1], app
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def _conns(port: int, num: int) -> AsyncIterator[list[Conn]]:
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(num)]
    try:
        yield conns
    finally:
        for _, writer in conns:
            writer.close()
        for _, writer in conns:
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def _closed_within(reader: asyncio.StreamReader, timeout_s: float) -> float:
    """Seconds until the server closes the connection (fails past ``timeout_s``)."""
    start = time.monotonic()
    with contextlib.suppress(ConnectionResetError):
        while await asyncio.wait_for(reader.read(65536), timeout_s):
            pass
    return time.monotonic() - start


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3.0)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 3.0)
    return status, headers, body


def _upload_head(length: int, path: str = "/v1/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def _get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n".encode())
        status, _, body = await _response(reader)
        return status, body
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def _no_errors(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


async def test_half_a_request_head_is_disconnected(caplog: pytest.LogCaptureFixture) -> None:
    async with _gateway(_cfg(client_header_timeout_s=0.5)) as (port, _), _conns(port, 2) as c:
        (half_reader, half_writer), (mute_reader, _) = c
        half_writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Le")
        assert await _closed_within(half_reader, 3.0) < 1.5
        assert await _closed_within(mute_reader, 3.0) < 1.5  # sent nothing at all
        # a keep-alive connection gets the head timeout again for its next request
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert (await _response(reader))[0] == 200
        await asyncio.sleep(0.7)  # idle between requests is keep-alive, not the head timer
        writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert (await _response(reader))[0] == 200
        writer.write(b"GET /health HTTP/1.1\r\nHo")
        assert await _closed_within(reader, 3.0) < 1.5
        writer.close()
        assert (await _get(port, "/health"))[0] == 200
    _no_errors(caplog)


async def test_body_stopped_midway_is_disconnected_and_released(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = _cfg(client_body_timeout_s=0.5)
    async with _gateway(cfg) as (port, app), _conns(port, 1) as [(reader, writer)]:
        writer.write(_upload_head(4_000_000) + b'{"model": "m", "prompt": "' + b"x" * 200_000)
        await asyncio.sleep(0.2)
        assert app[BODY_BUDGET_KEY].num_bytes == 4_000_000  # reserved while it is read
        assert await _closed_within(reader, 3.0) < 1.5
        await asyncio.sleep(0.05)
        assert app[BODY_BUDGET_KEY].num_bytes == 0
        assert app[BODY_BUDGET_KEY].num_reading == 0
        assert (await _get(port, "/health"))[0] == 200
    _no_errors(caplog)


async def test_uploads_past_the_buffer_cap_get_503_before_their_body_is_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mib = 1024 * 1024
    cfg = _cfg(max_buffered_body_bytes=5 * mib)
    async with _gateway(cfg) as (port, app), _conns(port, 4) as conns:
        for _, writer in conns[:2]:  # two 2 MiB uploads, stalled after 64 KiB: 4 MiB held
            writer.write(_upload_head(2 * mib) + b"x" * 65536)
        await asyncio.sleep(0.2)
        for reader, writer in conns[2:]:  # the next ones are refused before any body byte
            writer.write(_upload_head(2 * mib))
            status, headers, body = await _response(reader)
            assert status == 503
            assert headers["retry-after"] == "1"
            error = orjson.loads(body)["error"]
            assert error["type"] == "service_unavailable" and error["code"] == "overloaded"
            assert "max_buffered_body_bytes" in error["message"]
        assert app[BODY_BUDGET_KEY].num_bytes == 4 * mib
        for _, writer in conns[:2]:
            writer.close()
        await asyncio.sleep(0.2)
        assert app[BODY_BUDGET_KEY].num_bytes == 0
        # room again: a whole body is read and routed (no backend listens: 502 or 503)
        body_bytes = orjson.dumps({"model": "m", "prompt": "hi"})
        async with _conns(port, 1) as [(reader, writer)]:
            writer.write(_upload_head(len(body_bytes)) + body_bytes)
            status, _, body = await _response(reader)
            assert status in (502, 503)
            assert orjson.loads(body)["error"]["code"] != "overloaded"
    _no_errors(caplog)


async def test_max_in_flight_is_checked_before_the_body_is_read() -> None:
    async with _gateway(_cfg(max_in_flight=1)) as (port, app), _conns(port, 2) as conns:
        (_, slow_writer), (reader, writer) = conns
        slow_writer.write(_upload_head(100_000) + b"x" * 1000)  # being read: in flight
        await asyncio.sleep(0.2)
        writer.write(_upload_head(100_000))
        status, headers, body = await _response(reader)
        assert status == 503 and headers["retry-after"] == "1"
        assert "max_in_flight" in orjson.loads(body)["error"]["message"]
        assert app[BODY_BUDGET_KEY].num_bytes == 100_000  # only the first one's


async def test_connections_past_max_connections_are_closed_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with _gateway(_cfg(max_connections=4)) as (port, _):
        async with _conns(port, 4) as hoarders:
            for _, writer in hoarders:
                writer.write(b"GET /health HTTP/1.1\r\nHo")  # half a head, held
            await asyncio.sleep(0.1)
            async with _conns(port, 3) as extra:
                for reader, _ in extra:
                    assert await _closed_within(reader, 2.0) < 0.5
        await asyncio.sleep(0.1)
        status, body = await _get(port, "/health")  # the hoarders are gone: room again
        assert status == 200 and orjson.loads(body) == {"status": "ok"}
    _no_errors(caplog)
    warnings = [r for r in caplog.records if "max_connections" in r.getMessage()]
    assert len([r for r in warnings if r.levelno == logging.WARNING]) == 1


async def test_idle_keepalive_connection_is_closed(caplog: pytest.LogCaptureFixture) -> None:
    async with _gateway(_cfg(keepalive_timeout_s=0.5)) as (port, _), _conns(port, 1) as c:
        [(reader, writer)] = c
        writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert (await _response(reader))[0] == 200
        assert await _closed_within(reader, 3.0) < 1.5
    _no_errors(caplog)


async def test_accept_out_of_descriptors_logs_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with _gateway(_cfg()) as (port, _):
        loop = asyncio.get_running_loop()
        for _ in range(500):  # what asyncio's accept loop reports on EMFILE
            exc = OSError(errno.EMFILE, "Too many open files")
            loop.call_exception_handler(
                {"message": "socket.accept() out of system resource", "exception": exc}
            )
        assert (await _get(port, "/health"))[0] == 200
    _no_errors(caplog)
    emfile = [r for r in caplog.records if "Too many open files" in r.getMessage()]
    assert len([r for r in emfile if r.levelno == logging.WARNING]) == 1
    assert not [r for r in caplog.records if r.name == "asyncio"]


async def test_out_of_descriptors_for_real_logs_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    async with _gateway(_cfg(max_connections=1000)) as (port, _):
        num_open = len(os.listdir("/proc/self/fd"))
        clients: list[asyncio.StreamWriter] = []
        resource.setrlimit(resource.RLIMIT_NOFILE, (num_open + 10, hard))
        try:
            for _ in range(20):  # each takes two descriptors here: client and server side
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    break
                clients.append(writer)
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.2)  # asyncio retries the failed accept after 1 s
        finally:
            for writer in clients:
                writer.close()
            await asyncio.sleep(0.1)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        await asyncio.sleep(1.1)  # the listener is back after its retry delay
        assert (await _get(port, "/health"))[0] == 200
    _no_errors(caplog)
    assert [r for r in caplog.records if "cannot accept connections" in r.getMessage()]


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",  # no method / target / version
        b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",  # header without a colon
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    ],
    ids=["request-line", "header", "content-length"],
)
async def test_malformed_requests_get_openai_json(raw: bytes) -> None:
    async with _gateway(_cfg()) as (port, _app):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 5.0)  # the gateway closes after it
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400", data[:200]
    assert b"application/json" in head.lower()
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"]) == ("invalid_request_error", "bad_http_request")
