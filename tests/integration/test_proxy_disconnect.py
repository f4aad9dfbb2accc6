"""Clients that leave early: every attempt is accounted once and its upstream is closed.

Issue 15, finding 9: when the client was already gone as the proxy prepared the
streamed response, ``StreamResponse.prepare`` raised ``ClientConnectionResetError``
outside the relay's ``try``; aiohttp logged an ERROR traceback, the attempt's
``finish`` never ran (``in_flight`` stayed up for good) and the upstream response was
never closed. The race is reproduced exactly here: the backend writes its first byte
and, in the same event-loop step, the test hangs up the client's socket, so the
gateway sees the upstream bytes first and the client's FIN right behind them (and the
same for a later event: the write, not the prepare, then finds the client gone).
Clients also leave before the first byte, right after the headers and mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest
from aiohttp import web
from test_gateway_fakes import FakeBackend, fake_backends, gateway_config, running_gateway

ADMIN_TOKEN = "admin-secret"
Cuts = dict[str, Callable[[], None]]
CHUNK = b'data: {"id":"x","choices":[{"index":0,"text":"t"}],"usage":null}\n\n'


@dataclass
class CuttingBackend(FakeBackend):
    """Streams one event after ``first_byte_delay_s``, then one every ``chunk_delay_s``.

    ``cuts[request_id]``, once set, runs right after the next event is written, in the
    same loop step (no await in between)."""

    first_byte_delay_s: float = 0.05
    cuts: Cuts = field(default_factory=dict)

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        rid = request.headers.get("x-request-id", "")
        try:
            await asyncio.sleep(self.first_byte_delay_s)
            await resp.prepare(request)
            for i in range(self.num_chunks):
                if i:
                    await asyncio.sleep(self.chunk_delay_s)
                await resp.write(CHUNK)
                cut = self.cuts.pop(rid, None)
                if cut is not None:
                    cut()
        except ConnectionResetError:  # the gateway hung up between two writes
            self.num_aborted += 1  # (re-raising would make aiohttp log an ERROR)
            return resp
        await resp.write(b"data: [DONE]\n\n")
        self.num_finished += 1
        await resp.write_eof()
        return resp


def _hang_up(writer: asyncio.StreamWriter) -> None:
    """Close the client's socket now: the FIN leaves before this returns."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    writer.close()


async def _open_stream(url: str, rid: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send a streamed completion request on a raw connection (nothing read yet)."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    payload = orjson.dumps({"model": "m", "prompt": "p", "stream": True})
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        f"x-request-id: {rid}\r\n\r\n"
    ).encode()
    writer.write(head + payload)
    await writer.drain()
    return reader, writer


async def _read_until(reader: asyncio.StreamReader, done: Callable[[bytes], bool]) -> None:
    data = b""
    while not done(data):
        chunk = await reader.read(65536)
        assert chunk, f"the gateway closed the stream early: {data!r}"
        data += chunk


async def _closed(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def _gone_before_first_byte(url: str, rid: str, cuts: Cuts) -> None:
    _, writer = await _open_stream(url, rid)
    _hang_up(writer)
    await _closed(writer)


async def _cut_at_next_event(writer: asyncio.StreamWriter, rid: str, cuts: Cuts) -> None:
    """Hang up in the loop step in which the backend writes its next event: the gateway
    then reads that event first and the client's FIN right behind it."""
    hung_up = asyncio.get_running_loop().create_future()

    def cut() -> None:
        _hang_up(writer)
        hung_up.set_result(None)

    cuts[rid] = cut
    await asyncio.wait_for(hung_up, 30.0)
    await _closed(writer)


async def _gone_while_preparing(url: str, rid: str, cuts: Cuts) -> None:
    """The exact race of finding 9: the client is gone as the gateway prepares its
    response for the upstream's first byte."""
    _, writer = await _open_stream(url, rid)
    await _cut_at_next_event(writer, rid, cuts)


async def _gone_while_writing(url: str, rid: str, cuts: Cuts) -> None:
    """The client is gone as the gateway writes the second event."""
    reader, writer = await _open_stream(url, rid)
    await asyncio.wait_for(_read_until(reader, lambda d: b"data: " in d), 30.0)
    await _cut_at_next_event(writer, rid, cuts)


async def _gone_after_headers(url: str, rid: str, cuts: Cuts) -> None:
    reader, writer = await _open_stream(url, rid)
    await asyncio.wait_for(_read_until(reader, lambda d: b"\r\n\r\n" in d), 30.0)
    _hang_up(writer)
    await _closed(writer)


async def _gone_mid_stream(url: str, rid: str, cuts: Cuts) -> None:
    reader, writer = await _open_stream(url, rid)
    await asyncio.wait_for(_read_until(reader, lambda d: d.count(b"data: ") >= 3), 30.0)
    _hang_up(writer)
    await _closed(writer)


_Client = Callable[[str, str, Cuts], Awaitable[None]]
CLIENTS: dict[str, _Client] = {
    "before_first_byte": _gone_before_first_byte,
    "while_preparing": _gone_while_preparing,
    "after_headers": _gone_after_headers,
    "while_writing": _gone_while_writing,
    "mid_stream": _gone_mid_stream,
}


async def _in_flight(session: aiohttp.ClientSession, url: str) -> dict[str, int]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with session.get(url + "/admin/backends", headers=headers) as r:
        assert r.status == 200
        rows = (await r.json())["backends"]
    return {row["name"]: row["in_flight"] for row in rows}


async def _settled(
    session: aiohttp.ClientSession, url: str, fakes: list[CuttingBackend], timeout_s: float
) -> dict[str, int]:
    """Poll until no request is in flight anywhere; returns the last in-flight map."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        in_flight = await _in_flight(session, url)
        upstream_done = all(f.num_active == 0 and f.num_aborted == len(f.bodies) for f in fakes)
        if (upstream_done and not any(in_flight.values())) or loop.time() > deadline:
            return in_flight
        await asyncio.sleep(0.02)


async def _metric_sums(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """``/metrics`` samples summed by ``name{status=...}`` (status label only, if any)."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        status = series.partition('status="')[2].partition('"')[0]
        key = f"{name}{{status={status}}}" if status else name
        sums[key] = sums.get(key, 0.0) + float(value)
    return sums


async def test_clients_leaving_early_leak_no_in_flight_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    per_kind = 6
    cuts: Cuts = {}  # shared: whichever backend gets the request runs its cut
    fakes = [CuttingBackend(num_chunks=400, chunk_delay_s=0.05, cuts=cuts) for _ in range(2)]
    async with fake_backends(*fakes):
        backends = [{"url": f.url, "name": f"b{i}"} for i, f in enumerate(fakes)]
        cfg = gateway_config(backends, admin_token=ADMIN_TOKEN)
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as session:
            await asyncio.gather(
                *(
                    client(url, f"{kind}-{i}", cuts)
                    for kind, client in CLIENTS.items()
                    for i in range(per_kind)
                )
            )
            in_flight = await _settled(session, url, fakes, timeout_s=20.0)
            metrics = await _metric_sums(session, url)
    assert in_flight == {"b0": 0, "b1": 0}
    # every request a backend received was cut off by the gateway, none ran to the end
    assert [(f.num_active, f.num_finished) for f in fakes] == [(0, 0), (0, 0)]
    assert [f.num_aborted for f in fakes] == [len(f.bodies) for f in fakes]
    assert sum(len(f.bodies) for f in fakes) >= 4 * per_kind  # all but "before first byte"
    # each attempt accounted exactly once, as a client gone: one per routing decision
    # (no retries here; decide and dispatch happen in one loop step)
    done = {k: v for k, v in metrics.items() if k.startswith("kiloserve_gateway_requests_total")}
    decisions = metrics["kiloserve_gateway_routing_decisions_total"]
    assert done == {"kiloserve_gateway_requests_total{status=499}": decisions}, metrics
    assert decisions >= 4 * per_kind
    tracebacks = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not tracebacks, [(r.name, r.getMessage(), r.exc_text) for r in tracebacks]
