"""Benchmark-client capacity: concurrent streams and SSE chunks/s in one process.

Starts a minimal raw-asyncio OpenAI-style SSE server in a *separate process* (it
emits one chunk per active stream every ``--step-ms``, like an engine's decode step,
with chunked transfer encoding and keep-alive), or with ``--server twin`` an engine
twin at ``--slowdown 0.001`` (then the twin's own Python cost is usually the limit),
then drives it with
``kiloserve.bench.client.run_bench`` and prints measured numbers against the targets:
>= 2,000 concurrent streams and >= 50,000 chunks/s, with the client's event-loop lag
and CPU use. Run: ``.venv/bin/python benchmarks/bench_client_capacity.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import orjson

from kiloserve.bench.client import run_bench
from kiloserve.workload import ClosedLoop, load_workload

TARGET_STREAMS = 2_000
TARGET_CHUNKS_PER_S = 50_000


def _frame(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


CHUNK = _frame(b'data: {"choices":[{"index":0,"text":" tok"}]}\n\n')
HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\nx-kiloserve-backend: raw\r\n\r\n")  # fmt: skip


@dataclass
class _Stream:
    writer: asyncio.StreamWriter
    remaining: int
    done: asyncio.Future[None]


class Stepper:
    """Writes one chunk to every active stream per step (one timer for all)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.active: list[_Stream] = []

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            keep = []
            for s in self.active:
                s.writer.write(CHUNK)
                s.remaining -= 1
                if s.remaining > 0:
                    keep.append(s)
                elif not s.done.done():
                    s.done.set_result(None)
            self.active = keep


async def _handle(stepper: Stepper, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:  # fmt: skip
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = orjson.loads(await reader.readexactly(length))
            writer.write(HEAD)
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            stepper.active.append(_Stream(writer, int(body["max_tokens"]), done))
            await done
            usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
            tail = b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n"
            writer.write(_frame(tail) + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def serve(port: int, step_s: float) -> None:
    stepper = Stepper(step_s)
    server = await asyncio.start_server(
        lambda r, w: _handle(stepper, r, w), "127.0.0.1", port, backlog=4096
    )
    async with server:
        await asyncio.gather(server.serve_forever(), stepper.run())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("capacity server did not start")


async def _phase(url: str, concurrency: int, num_requests: int, output: str) -> dict[str, float]:
    spec = f"synthetic:input=fixed(16),output={output}"
    workload = load_workload(spec, seed=0, num_requests=num_requests)
    result = await run_bench(url, "m", workload, ClosedLoop(concurrency))
    num_chunks = sum(r.num_chunks for r in result.records)
    return {
        "ok": sum(r.is_ok for r in result.records),
        "failed": sum(not r.is_ok for r in result.records),
        "max_in_flight": result.client.max_in_flight,
        "chunks_per_s": num_chunks / result.duration_s,
        "duration_s": result.duration_s,
        "lag_p99_ms": result.client.lag_p99_ms,
        "cpu_util": result.client.cpu_util,
        "chunks_per_cpu_s": num_chunks / max(1e-9, result.client.cpu_util * result.duration_s),
    }


def _server_cmd(server: str, port: int, step_ms: float) -> list[str]:
    if server == "raw":
        return [sys.executable, __file__, "--serve", str(port), "--step-ms", str(step_ms)]
    # an engine twin answering (almost) instantly: every modelled step takes 1/1000
    return [sys.executable, "-m", "kiloserve", "engine", "--gpu", "H100-SXM", "--model",
            "llama-3.1-8b", "--served-model-name", "m", "--port", str(port), "--slowdown",
            "0.001", "--max-num-seqs", "4096", "--log-level", "WARNING"]  # fmt: skip


def _run_phase(name: str, server: str, step_ms: float, concurrency: int, num_requests: int,
               output: str) -> dict[str, float]:  # fmt: skip
    port = _free_port()
    proc = subprocess.Popen(_server_cmd(server, port, step_ms))
    try:
        _wait_ready(port)
        stats = asyncio.run(_phase(f"http://127.0.0.1:{port}", concurrency, num_requests,
                                   output))  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(10)
    step = f"step {step_ms} ms" if server == "raw" else "slowdown 0.001"
    print(f"{name}: {server} server ({step}), concurrency {concurrency}, output {output} "
          f"tokens -> ok {stats['ok']:.0f} failed {stats['failed']:.0f}, max in flight "
          f"{stats['max_in_flight']:.0f}, {stats['chunks_per_s']:,.0f} chunks/s, loop lag p99 "
          f"{stats['lag_p99_ms']:.1f} ms, client CPU {stats['cpu_util']:.0%} "
          f"({stats['chunks_per_cpu_s']:,.0f} chunks per client CPU-second), "
          f"{stats['duration_s']:.1f} s")  # fmt: skip
    return stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    p.add_argument("--step-ms", type=float, default=20.0, help=argparse.SUPPRESS)
    p.add_argument("--streams", type=int, default=TARGET_STREAMS)
    p.add_argument(
        "--server",
        choices=("raw", "twin"),
        default="raw",
        help="raw asyncio SSE server (default) or an engine twin at --slowdown 0.001",
    )
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.step_ms / 1000.0))
        return 0
    # lengths vary so streams finish at different times, as with a real engine
    streams = _run_phase("streams", args.server, 50.0, args.streams, 3 * args.streams,
                         "uniform(20,60)")  # fmt: skip
    chunks = _run_phase("chunks", args.server, 2.0, 200, 600, "fixed(400)")
    held = streams["max_in_flight"] >= TARGET_STREAMS and streams["failed"] == 0
    fast = chunks["chunks_per_s"] >= TARGET_CHUNKS_PER_S and chunks["failed"] == 0
    print(f"concurrent streams: {streams['max_in_flight']:.0f} (target {TARGET_STREAMS}): "
          f"{'met' if held else 'NOT met'}")  # fmt: skip
    print(f"chunks/s: {chunks['chunks_per_s']:,.0f} (target {TARGET_CHUNKS_PER_S:,}): "
          f"{'met' if fast else 'NOT met'}")  # fmt: skip
    return 0 if held and fast else 1


if __name__ == "__main__":
    sys.exit(main())
