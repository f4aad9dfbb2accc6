"""The lean upstream HTTP/1.1 client against raw servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from conftest import free_port
from kiloserve.errors import UpstreamError
from kiloserve.gateway.upstream import UpstreamPool

Reply = Callable[[bytes], list[bytes]]


class RawServer:
    """Answers each request with the byte pieces ``reply(request)`` returns."""

    def __init__(self, reply: Reply, close_after: bool = False, gap_s: float = 0.0) -> None:
        self.reply = reply
        self.close_after = close_after
        self.gap_s = gap_s
        self.requests: list[bytes] = []
        self.num_connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                for piece in self.reply(head + body):
                    writer.write(piece)
                    await writer.drain()
                    if self.gap_s:
                        await asyncio.sleep(self.gap_s)
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def raw_server(server: RawServer) -> AsyncIterator[str]:
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.close()
        await srv.wait_closed()


def _bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
)
CHUNKED_HEAD = CHUNKED[: CHUNKED.index(b"\r\n\r\n") + 4]
LENGTH = (
    b'HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{"a":1}'
)


@pytest.mark.parametrize("split", [False, True])
async def test_chunked_and_length_bodies_with_keep_alive(split: bool) -> None:
    replies = iter([CHUNKED, LENGTH, CHUNKED])

    def reply(_: bytes) -> list[bytes]:
        data = next(replies)
        return _bytewise(data) if split else [data]

    server = RawServer(reply)
    pool = UpstreamPool(connect_timeout_s=1.0)
    async with raw_server(server) as url:
        got = []
        for _ in range(3):
            resp = await pool.post(url, "/v1/x", b'{"q":1}', {"Authorization": "Bearer k"})
            got.append((resp.status, resp.content_type, await resp.read()))
            resp.release()
    await pool.close()
    assert got == [
        (200, "text/event-stream", b"hello world"),
        (201, "application/json", b'{"a":1}'),
        (200, "text/event-stream", b"hello world"),
    ]
    assert server.num_connections == 1  # reused
    first = server.requests[0]
    assert first.startswith(b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nAuthorization: Bearer k\r\n" in first and first.endswith(b'\r\n\r\n{"q":1}')


async def test_readany_yields_chunks_as_they_arrive() -> None:
    pieces = [CHUNKED_HEAD, b"5\r\nhello\r\n", b"6\r\n world\r\n", b"0\r\n\r\n"]
    server = RawServer(lambda _: pieces, gap_s=0.02)
    pool = UpstreamPool(connect_timeout_s=1.0)
    async with raw_server(server) as url:
        resp = await pool.post(url, "/", b"", {})
        parts = []
        while part := await resp.readany():
            parts.append(part)
        resp.release()
    await pool.close()
    assert parts == [b"hello", b" world"]


async def test_close_delimited_body_and_204() -> None:
    server = RawServer(lambda _: [b"HTTP/1.0 200 OK\r\n\r\nuntil close"], close_after=True)
    pool = UpstreamPool(connect_timeout_s=1.0)
    async with raw_server(server) as url:
        resp = await pool.post(url, "/", b"x", {})
        assert await resp.read() == b"until close"
        resp.release()
    no_content = RawServer(lambda _: [b"HTTP/1.1 204 No Content\r\n\r\n"])
    async with raw_server(no_content) as url:
        resp = await pool.post(url, "/", b"x", {})
        assert resp.status == 204 and await resp.read() == b""
        resp.release()
    await pool.close()


async def test_stale_keep_alive_connection_is_retried_once() -> None:
    server = RawServer(lambda _: [LENGTH], close_after=True)  # closes after each answer
    pool = UpstreamPool(connect_timeout_s=1.0)
    async with raw_server(server) as url:
        for _ in range(3):
            resp = await pool.post(url, "/", b"x", {})
            assert await resp.read() == b'{"a":1}'
            resp.release()
            await asyncio.sleep(0.02)  # let the close arrive
    await pool.close()
    assert server.num_connections == 3


async def test_errors_are_upstream_errors() -> None:
    pool = UpstreamPool(connect_timeout_s=1.0)
    with pytest.raises(UpstreamError):
        await pool.post(f"http://127.0.0.1:{free_port()}", "/", b"", {})
    with pytest.raises(UpstreamError):
        await pool.post("https://example.invalid", "/", b"", {})
    truncated = RawServer(lambda _: [LENGTH[:-3]], close_after=True)
    async with raw_server(truncated) as url:
        resp = await pool.post(url, "/", b"", {})
        with pytest.raises(UpstreamError):
            await resp.read()
        resp.close()
    garbage = RawServer(lambda _: [b"HTTP/1.1 2xx what\r\n\r\n"], close_after=True)
    async with raw_server(garbage) as url:
        with pytest.raises(UpstreamError):
            await pool.post(url, "/", b"", {})
    with pytest.raises(UpstreamError):
        await pool.post("http://127.0.0.1:1", "/", b"", {"X-Bad": "a\r\nInjected: 1"})
    await pool.close()


async def test_close_mid_body_disconnects_the_backend() -> None:
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(CHUNKED_HEAD + b"5\r\nhello\r\n")
        await writer.drain()
        await reader.read()  # returns b"" when the client closes
        closed.set()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    pool = UpstreamPool(connect_timeout_s=1.0)
    resp = await pool.post(url, "/", b"", {})
    assert await resp.readany() == b"hello"
    resp.close()
    await asyncio.wait_for(closed.wait(), 2.0)
    srv.close()
    await srv.wait_closed()
    await pool.close()
