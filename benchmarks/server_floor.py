"""Front-door floor: the CPU per request of HTTP servers that do only a proxy's minimum.

    .venv/bin/python benchmarks/server_floor.py [--num-requests 4000] [--rounds 3]

Issue 16 asks whether a lighter HTTP server than aiohttp's would let the gateway reach
<= 100 us of CPU per non-streamed request, and to pick on numbers. This measures the
floor each candidate puts under the gateway, in one run, on the same load:

* ``aiohttp``: ``aiohttp.web`` (its C HTTP parser), what the gateway runs today;
* ``httptools``: a hand-written ``asyncio.Protocol`` on httptools (llhttp, the parser
  uvicorn uses), one task per request as a proxy needs;
* ``granian``: granian's Rust HTTP server calling a Python RSGI handler (one worker,
  one runtime thread, uvloop).

Each candidate runs in its own process on uvloop and serves ``POST /v1/completions`` in
two modes, each its own process:

* ``answer``: read the body, parse it (orjson, as the gateway does) and answer a fixed
  completion: the server's own cost;
* ``proxy``: the same, then send the body to an instant backend with the gateway's own
  upstream client (``kiloserve.gateway.upstream.UpstreamPool``) and relay its answer:
  the floor of a proxy on that server, before any routing work.

The load client and the backend are those of ``benchmarks/gateway_overhead.py`` (a raw
asyncio keep-alive client, concurrency 32; a raw asyncio backend). CPU per request is
the server process's CPU (utime + stime from /proc, its threads and children included)
over ``--num-requests`` requests. ``--rounds`` rounds measure every candidate in turn
(so a change in the box's speed hits them all), and the report gives each one's median
and its ratio to aiohttp's in the same run. The gateway's own figure for comparison:
``benchmarks/gateway_overhead.py``. Candidates whose package is missing are skipped
with a line saying so (``dev`` installs httptools and granian).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from gateway_overhead import (  # noqa: E402
    COMPLETION,
    _content_length,
    _request,
    cpu_s,
    free_ports,
    processes,
    run_load,
    serve_backend,
    wait_port,
)

KINDS = ("aiohttp", "aiohttp-lowlevel", "httptools", "granian")
MODES = ("answer", "proxy")
PATH = "/v1/completions"
# The upstream's address for the server processes (granian imports the app, so the
# candidates take it from the environment, all the same way).
UPSTREAM_ENV = "FLOOR_UPSTREAM"
MODE_ENV = "FLOOR_MODE"
CONTENT_TYPE = "application/json"


class Handler:
    """What every candidate does per request: parse, then answer or proxy."""

    def __init__(self) -> None:
        self.mode = os.environ.get(MODE_ENV, "answer")
        self.upstream = os.environ.get(UPSTREAM_ENV, "")
        self.pool: Any = None

    async def __call__(self, body: bytes) -> tuple[int, bytes]:
        orjson.loads(body)
        if self.mode == "answer":
            return 200, COMPLETION
        if self.pool is None:
            from kiloserve.gateway.upstream import UpstreamPool

            self.pool = UpstreamPool(connect_timeout_s=5.0)
        resp = await self.pool.post(self.upstream, PATH, body, {"content-type": CONTENT_TYPE})
        try:
            answer: bytes = await resp.read()
        finally:
            resp.release()
        return resp.status, answer


# ----------------------------------------------------------------- aiohttp
def serve_aiohttp(port: int) -> None:
    import uvloop
    from aiohttp import web

    handler = Handler()

    async def completions(request: web.Request) -> web.Response:
        status, answer = await handler(await request.read())
        return web.Response(status=status, body=answer, content_type=CONTENT_TYPE)

    async def main() -> None:
        app = web.Application()
        app.router.add_post(PATH, completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        await asyncio.Event().wait()

    uvloop.run(main())


def serve_aiohttp_lowlevel(port: int) -> None:
    """aiohttp's low-level server: its HTTP protocol, request and response objects,
    without the Application (router, middlewares, signals)."""
    import uvloop
    from aiohttp import web

    handler = Handler()

    async def handle(request: web.BaseRequest) -> web.Response:
        if request.method == "POST" and request.path == PATH:
            status, answer = await handler(await request.read())
        else:
            status, answer = 404, b'{"error":"not found"}'
        return web.Response(status=status, body=answer, content_type=CONTENT_TYPE)

    async def main() -> None:
        server = web.Server(handle, access_log=None)
        loop = asyncio.get_running_loop()
        await loop.create_server(server, "127.0.0.1", port, backlog=1024)
        await asyncio.Event().wait()

    uvloop.run(main())


# ----------------------------------------------------------------- httptools
class HttptoolsProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive on httptools' parser; each request handled in a task."""

    def __init__(self, handler: Handler) -> None:
        import httptools

        self.handler = handler
        self.parser = httptools.HttpRequestParser(self)
        self.error = httptools.HttpParserError
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except self.error:
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        keep_alive = self.parser.should_keep_alive()
        asyncio.get_running_loop().create_task(
            self.respond(self.parser.get_method(), self.url, b"".join(self.body), keep_alive)
        )

    async def respond(self, method: bytes, url: bytes, body: bytes, keep_alive: bool) -> None:
        if method == b"POST" and url == PATH.encode():
            status, answer = await self.handler(body)
        else:
            status, answer = 404, b'{"error":"not found"}'
        t = self.transport
        if t is None or t.is_closing():
            return
        t.write(
            b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (status, len(answer))
            + answer
        )
        if not keep_alive:
            t.close()


def serve_httptools(port: int) -> None:
    import uvloop

    handler = Handler()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: HttptoolsProtocol(handler), "127.0.0.1", port, backlog=1024
        )
        async with server:
            await server.serve_forever()

    uvloop.run(main())


# ----------------------------------------------------------------- granian (RSGI)
_rsgi_handler: Handler | None = None


async def rsgi_app(scope: Any, proto: Any) -> None:
    """The RSGI application granian imports (``server_floor:rsgi_app``)."""
    global _rsgi_handler
    if _rsgi_handler is None:
        _rsgi_handler = Handler()
    body = await proto()
    if scope.method == "POST" and scope.path == PATH:
        status, answer = await _rsgi_handler(body)
    else:
        status, answer = 404, b'{"error":"not found"}'
    proto.response_bytes(status, [("content-type", CONTENT_TYPE)], answer)


def granian_command(port: int) -> list[str]:
    return [
        *(sys.executable, "-m", "granian", "--interface", "rsgi", "--loop", "uvloop"),
        *("--workers", "1", "--runtime-threads", "1", "--runtime-mode", "st", "--http", "1"),
        *("--no-ws", "--no-access-log", "--log-level", "warning", "--backlog", "1024"),
        *("--host", "127.0.0.1", "--port", str(port), "--working-dir", str(REPO / "benchmarks")),
        "server_floor:rsgi_app",
    ]


# ----------------------------------------------------------------- the run
def missing(kind: str) -> str:
    """Why a candidate cannot run here ('' when it can)."""
    if importlib.util.find_spec(kind.split("-")[0]) is None:
        return f"{kind} not installed (pip install {kind}; the dev extra has it)"
    return ""


def start(procs: list[subprocess.Popen[bytes]], kind: str, mode: str, port: int, up: int) -> int:
    env = os.environ | {MODE_ENV: mode, UPSTREAM_ENV: f"http://127.0.0.1:{up}"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    if kind == "granian":
        cmd = granian_command(port)
    else:
        cmd = [sys.executable, __file__, "--serve", kind, "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env)
    procs.append(proc)
    wait_port(port)
    return proc.pid


async def check(port: int) -> None:
    """One request read in full: a candidate must answer the backend's completion."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_request(f"127.0.0.1:{port}", stream=False))
        head = await reader.readuntil(b"\r\n\r\n")
        body = await reader.readexactly(_content_length(head.lower()))
    finally:
        writer.close()
    if not head.startswith(b"HTTP/1.1 200") or body != COMPLETION:
        raise RuntimeError(f"port {port} answered {head[:40]!r} {body[:80]!r}")


async def measure(pid: int, port: int, num_requests: int) -> tuple[float, float, int]:
    """(CPU us per request, requests/s, errors) over ``num_requests`` at concurrency 32."""
    await check(port)
    await run_load([port], 8, 300)  # warm up (connections, the upstream pool)
    cpu0 = cpu_s(pid)
    result = await run_load([port], 32, num_requests)
    cpu1 = cpu_s(pid)
    return (cpu1 - cpu0) / result.num_requests * 1e6, result.rps, result.num_errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        SERVERS[args.serve](args.port)
        return 0

    kinds = [k for k in KINDS if not missing(k)]
    for kind in KINDS:
        if why := missing(kind):
            print(f"{kind}: skipped, {why}")
    print(
        f"front-door floor: {', '.join(kinds)}; {os.cpu_count()} CPUs, "
        f"{args.num_requests} requests per measurement, {args.rounds} rounds"
    )
    targets = [(k, m) for m in MODES for k in kinds]
    ports = free_ports(len(targets) + 1)
    backend_port = ports.pop()
    samples: dict[tuple[str, str], list[tuple[float, float, int]]] = {t: [] for t in targets}
    with processes() as procs:
        backend = [sys.executable, __file__, "--serve", "backend", "--port", str(backend_port)]
        procs.append(subprocess.Popen(backend))
        wait_port(backend_port)
        pids = {t: start(procs, *t, p, backend_port) for t, p in zip(targets, ports, strict=True)}
        where = dict(zip(targets, ports, strict=True))
        for _ in range(args.rounds):
            for t in targets:
                samples[t].append(asyncio.run(measure(pids[t], where[t], args.num_requests)))
    report(samples, kinds)
    return 0


def serve_instant_backend(port: int) -> None:
    serve_backend(port, 0, 0.0)


SERVERS = {
    "aiohttp": serve_aiohttp,
    "aiohttp-lowlevel": serve_aiohttp_lowlevel,
    "httptools": serve_httptools,
    "backend": serve_instant_backend,
}


def report(
    samples: dict[tuple[str, str], list[tuple[float, float, int]]], kinds: list[str]
) -> None:
    print(
        f"\n{'server':<18}{'mode':<8}{'CPU us/req (median)':>21}{'all rounds':>32}"
        f"{'req/s':>9}{'errors':>8}{'vs aiohttp':>12}"
    )
    for mode in MODES:
        base = statistics.median(s[0] for s in samples[("aiohttp", mode)])
        for kind in kinds:
            rows = samples[(kind, mode)]
            cpu = statistics.median(s[0] for s in rows)
            each = " / ".join(f"{s[0]:.0f}" for s in rows)
            rps = statistics.median(s[1] for s in rows)
            errors = sum(s[2] for s in rows)
            print(
                f"{kind:<18}{mode:<8}{cpu:>21.1f}{each:>32}{rps:>9.0f}{errors:>8}"
                f"{cpu / base:>11.2f}x"
            )
    print(
        "\nissue 16 target: <= 100 us per request for the whole gateway (routing included); "
        "a proxy floor above it leaves no room for the routing work"
    )


if __name__ == "__main__":
    sys.exit(main())
