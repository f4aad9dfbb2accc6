"""Gateway overhead: direct vs through ``kiloserve gateway`` vs nginx and the Rust routers.

    .venv/bin/python benchmarks/gateway_overhead.py [--policy default] [--quick]

Two backends that answer instantly (a raw asyncio HTTP/1.1 server, one process each):
a non-streaming completion, or a stream of ``--chunks`` SSE chunks written
``--chunk-gap-ms`` apart (so each chunk is a separate read for the proxy). The load
generator is a raw asyncio keep-alive client (cheap, so it is not the bottleneck).
In-run references: nginx (``apt-get install -y nginx``) when the binary exists, SGLang's
and vLLM's Rust routers when installed (``make peer-routers``, run by ``make test``;
``benchmarks/peer_routers.py``), with ``--peer-policy`` (default ``round_robin``); each
line gives the gateway's CPU per request and per chunk as a ratio to that router's.

Figures (all measured in this run):
* CPU per request: the proxy's CPU seconds (utime + stime, /proc/PID/stat) per request,
  non-streaming, at moderate load (concurrency 4) and near saturation (concurrency 32).
* CPU per relayed chunk: (CPU per streamed request - CPU per plain request) / chunks.
* added p50 / p99 latency at moderate load (closed loop, concurrency 4) vs direct.
* max requests/s (closed loop, concurrency 64).
Targets (issue 3): <= 150 us CPU per request, <= 10 us per chunk, added p50 <= 1 ms;
issue 16: <= 100 us per request with the default policy, and with ``--workers 2``
>= 1.3x one worker's max requests/s at CPU per request within 10% of one worker's.
``--tracing`` adds a gateway with OpenTelemetry tracing on (``gw-tracing``; issue 18).
``--before-src DIR`` adds the gateway of another source tree (``gw-before``: ``git
worktree add /tmp/before REV``; run with ``PYTHONPATH=DIR/src``, one process, the same
config) and prints the CPU ratios per request and per chunk to it: issue 16's "per
streamed chunk no worse than before", measured in one run.

``gateway`` is one process (``--workers 1``, uvloop where installed), ``gw-asyncio`` the
same on asyncio's loop (unless ``--no-loop-baseline``); ``--workers 2`` adds a row whose
CPU is the supervisor's plus every worker's (``/proc`` children):
    .venv/bin/python benchmarks/gateway_overhead.py --workers 2

``--profile FILE`` runs the gateway under cProfile timed by the gateway's own CPU clock
(``time.process_time``: the event loop's sleep in select() is not charged to whatever
was awaiting, as a wall-clock profile does) and prints its functions by own and
cumulative time after the run (where the per-request CPU goes; the run's CPU figures
then include the profiler's own cost, so read shares, not microseconds):

    .venv/bin/python benchmarks/gateway_overhead.py --quick --profile /tmp/gw.prof
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead_report import report
from peer_routers import find_routers, nginx_conf, wait_ready

CLK_TCK = os.sysconf("SC_CLK_TCK")
# ``python -c PROFILE_RUNNER FILE -m kiloserve gateway ...``: the gateway under
# cProfile timed by this process's CPU clock (time.process_time), so the time the event
# loop sleeps in select() is not charged to whatever awaited; written at exit (SIGTERM
# stops the gateway cleanly)
PROFILE_RUNNER = """
import cProfile, runpy, sys, time
out = sys.argv[1]
sys.argv = ["kiloserve", *sys.argv[4:]]
prof = cProfile.Profile(time.process_time)
try:
    prof.runcall(runpy.run_module, "kiloserve", run_name="__main__", alter_sys=True)
finally:
    prof.dump_stats(out)
"""
MODEL = "bench-model"
METRICS = (
    b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n"
)
COMPLETION = (
    b'{"id":"cmpl-1","object":"text_completion","model":"bench-model","choices":[{"index":0,'
    b'"text":"hello","finish_reason":"length"}],"usage":{"prompt_tokens":8,'
    b'"completion_tokens":16,"total_tokens":24}}'
)

STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


# ----------------------------------------------------------------- instant backend
def _content_length(head: bytes) -> int:
    """Content-Length of a lower-cased header block ending in CRLF (0 if absent)."""
    pos = head.find(b"content-length:")
    return 0 if pos < 0 else int(head[pos + 15 : head.find(b"\r\n", pos)])


class BackendProtocol(asyncio.Protocol):
    """Minimal HTTP/1.1 keep-alive server: /metrics, /v1/models, completions."""

    def __init__(self, num_chunks: int, gap_s: float) -> None:
        self.num_chunks = num_chunks
        self.gap_s = gap_s
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[: end + 2].lower()
            total = end + 4 + _content_length(head)
            if len(self.buf) < total:
                return
            body, self.buf = self.buf[end + 4 : total], self.buf[total:]
            parts = head.split(b" ", 2)
            if len(parts) < 3 or not parts[2].startswith(b"http/1."):  # an HTTP/2 preface:
                assert self.transport is not None  # a router probing for h2 / gRPC workers
                self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                self.transport.close()
                return
            self.respond(parts[1], body)

    def _send(self, body: bytes, ctype: bytes = b"application/json") -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: "
            + ctype
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )

    def respond(self, path: bytes, body: bytes) -> None:
        if path == b"/metrics":
            self._send(METRICS, b"text/plain")
        elif path == b"/v1/models":
            self._send(b'{"object":"list","data":[{"id":"bench-model","object":"model"}]}')
        elif b'"stream":true' in body.replace(b" ", b""):
            asyncio.get_running_loop().create_task(self.stream(b"include_usage" in body))
        else:
            self._send(COMPLETION)

    async def stream(self, with_usage: bool) -> None:
        t = self.transport
        assert t is not None
        t.write(STREAM_HEAD)
        events = [
            b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":" tok"}]}\n\n'
        ] * self.num_chunks
        if with_usage:
            events.append(
                b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":8,"completion_tokens":'
                + str(self.num_chunks).encode()
                + b"}}\n\n"
            )
        events.append(b"data: [DONE]\n\n")
        for i, ev in enumerate(events):
            if t.is_closing():
                return
            t.write(f"{len(ev):x}\r\n".encode() + ev + b"\r\n")
            if self.gap_s and i < self.num_chunks:
                await asyncio.sleep(self.gap_s)
        t.write(b"0\r\n\r\n")


def serve_backend(port: int, num_chunks: int, gap_s: float) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: BackendProtocol(num_chunks, gap_s), "127.0.0.1", port, backlog=1024
        )
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# ----------------------------------------------------------------- raw load client
def _request(host_port: str, stream: bool) -> bytes:
    body = b'{"model":"bench-model","prompt":"the fast node runs all load","max_tokens":16'
    body += b',"stream":true}' if stream else b"}"
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: "
        + host_port.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    low = head.lower()
    if b"content-length:" in low:
        await reader.readexactly(_content_length(low))
        return status
    while True:  # chunked
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.strip().split(b";")[0], 16)
        await reader.readexactly(size + 2)
        if size == 0:
            return status


@dataclass
class RunResult:
    num_requests: int
    elapsed_s: float
    latencies_s: list[float]
    num_errors: int

    @property
    def rps(self) -> float:
        return self.num_requests / self.elapsed_s

    def pct_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1000.0)


async def run_load(
    ports: list[int], concurrency: int, num_requests: int, stream: bool = False
) -> RunResult:
    """Closed loop: ``concurrency`` keep-alive connections (spread over ``ports``)."""
    latencies: list[float] = []
    remaining = [num_requests]
    errors = [0]

    async def worker(i: int) -> None:
        port = ports[i % len(ports)]
        req = _request(f"127.0.0.1:{port}", stream)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while remaining[0] > 0:
                remaining[0] -= 1
                t0 = time.perf_counter()
                writer.write(req)
                try:
                    status = await _read_response(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    errors[0] += 1
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    continue
                latencies.append(time.perf_counter() - t0)
                if status != 200:
                    errors[0] += 1
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return RunResult(len(latencies), time.perf_counter() - t0, latencies, errors[0])


# ----------------------------------------------------------------- processes
def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago (all bound at once)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                out += [int(child), *_descendants(int(child))]
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds (utime + stime) of a process and its live descendants (the workers
    of ``kiloserve gateway --workers N``)."""
    total = 0.0
    for p in [pid, *_descendants(pid)]:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def wait_port(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def gateway_yaml(path: Path, port: int, backend_ports: list[int], policy: str) -> None:
    lines = [
        "host: 127.0.0.1",
        f"port: {port}",
        f"policy: {{name: {policy}}}",
        "backends:",
        *[
            f"  - {{url: 'http://127.0.0.1:{p}', name: b{i}, models: [{MODEL}]}}"
            for i, p in enumerate(backend_ports)
        ],
    ]
    path.write_text("\n".join(lines) + "\n")


# ----------------------------------------------------------------- measurement
@dataclass
class Target:
    name: str
    ports: list[int]
    pid: int | None


async def measure(target: Target, args: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    await run_load(target.ports, 8, 300)  # warm up
    await run_load(target.ports, 4, 100, stream=True)
    cpu0 = cpu_s(target.pid) if target.pid else 0.0
    mod = await run_load(target.ports, 4, args.num_requests)
    cpu1 = cpu_s(target.pid) if target.pid else 0.0
    sat = await run_load(target.ports, 32, args.num_requests)
    cpu2 = cpu_s(target.pid) if target.pid else 0.0
    streams = await run_load(target.ports, 32, args.num_streams, stream=True)
    cpu3 = cpu_s(target.pid) if target.pid else 0.0
    top = await run_load(target.ports, 64, args.num_requests)
    out.update(p50_ms=mod.pct_ms(50), p99_ms=mod.pct_ms(99), max_rps=top.rps)
    out["errors"] = mod.num_errors + sat.num_errors + streams.num_errors + top.num_errors
    if target.pid:
        out["cpu_us_moderate"] = (cpu1 - cpu0) / mod.num_requests * 1e6
        out["cpu_us_saturated"] = (cpu2 - cpu1) / sat.num_requests * 1e6
        per_stream_us = (cpu3 - cpu2) / streams.num_requests * 1e6
        out["cpu_us_per_chunk"] = (per_stream_us - out["cpu_us_saturated"]) / args.chunks
    return out


def start_all(
    args: argparse.Namespace, tmp: Path, procs: list[subprocess.Popen[bytes]]
) -> list[Target]:
    ports = free_ports(3)
    backend_ports, ng_port = ports[:2], ports[2]
    for p in backend_ports:
        cmd = [
            sys.executable,
            __file__,
            "--serve-backend",
            str(p),
            "--chunks",
            str(args.chunks),
            "--chunk-gap-ms",
            str(args.chunk_gap_ms),
        ]
        procs.append(subprocess.Popen(cmd))
    targets = [Target("direct", backend_ports, None)]
    one = ["--workers", "1"]  # one process (and --profile's cProfile sees the proxying)
    variants: list[tuple[str, list[str]]] = [("gateway", one)]
    if not args.no_loop_baseline:
        variants.append(("gw-asyncio", ["--loop", "asyncio", *one]))
    if args.workers > 1:
        variants.append((f"gw-{args.workers}w", ["--workers", str(args.workers)]))
    if args.tracing:
        variants.append(("gw-tracing", one))
    if args.before_src is not None:  # an older tree: --workers exists only since issue 16
        has_workers = (args.before_src / "src/kiloserve/gateway/workers.py").exists()
        variants.append(("gw-before", one if has_workers else []))
    for name, extra in variants:
        port = free_ports(1)[0]
        gateway_yaml(tmp / f"{name}.yaml", port, backend_ports, args.policy)
        if name == "gw-tracing":  # spans exported to a backend, which answers 200 to any POST
            with (tmp / f"{name}.yaml").open("a") as f:
                sink = f"http://127.0.0.1:{backend_ports[0]}/v1/traces"
                f.write(f"tracing: {{enabled: true, otlp_endpoint: '{sink}'}}\n")
        profile = ["-c", PROFILE_RUNNER, str(args.profile)] if args.profile else []
        gw_cmd = [
            sys.executable,
            *(profile if name == "gateway" else []),
            "-m",
            "kiloserve",
            "gateway",
            "-c",
            str(tmp / f"{name}.yaml"),
            "--log-level",
            "WARNING",
            *extra,
        ]
        env = None
        if name == "gw-before":
            env = {**os.environ, "PYTHONPATH": str(args.before_src.resolve() / "src")}
        gw = subprocess.Popen(gw_cmd, stdout=subprocess.DEVNULL, env=env)
        procs.append(gw)
        wait_port(port)
        targets.append(Target(name, [port], gw.pid))
    for p in backend_ports:
        wait_port(p)
    nginx = shutil.which("nginx")
    if nginx is None:
        print("nginx: binary not found, skipping the nginx reference (apt-get install -y nginx)")
    else:
        ng = subprocess.Popen(
            [nginx, "-c", str(nginx_conf(tmp, ng_port, backend_ports)), "-p", str(tmp)]
        )
        procs.append(ng)
        wait_port(ng_port)
        targets.append(Target("nginx", [ng_port], ng.pid))
    routers, missing = find_routers(args.peers) if args.peers != [] else ([], [])
    for line in missing:
        print(line)
    for router in routers:
        port, metrics_port = free_ports(2)
        cmd = router.command(port, metrics_port, backend_ports, args.peer_policy)
        rp = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(rp)
        wait_ready(port, MODEL)
        targets.append(Target(router.name, [port], rp.pid))
    time.sleep(0.5)  # first scrapes
    return targets


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--policy", default="default", help="gateway policy (default: default)")
    ap.add_argument("--chunks", type=int, default=50, help="SSE chunks per streamed response")
    ap.add_argument("--chunk-gap-ms", type=float, default=2.0, help="backend gap between chunks")
    ap.add_argument("--num-requests", type=int, default=4000)
    ap.add_argument("--num-streams", type=int, default=400)
    ap.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    ap.add_argument(
        "--profile",
        type=Path,
        help="run the gateway under cProfile, write its stats here and print the top "
        "functions (its CPU figures then include the profiler's cost: read the shares)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="also measure 'kiloserve gateway --workers N' (N > 1) in the same run",
    )
    ap.add_argument(
        "--no-loop-baseline",
        action="store_true",
        help="skip the gateway on the standard asyncio loop (measured by default beside "
        "the default loop, uvloop when installed)",
    )
    ap.add_argument(
        "--tracing",
        action="store_true",
        help="also measure the gateway with OpenTelemetry tracing on (needs kiloserve[tracing];"
        " spans exported over OTLP/HTTP to a backend)",
    )
    ap.add_argument(
        "--peers",
        type=lambda text: [n for n in text.split(",") if n],
        default=None,
        help="Rust routers to measure beside the gateway, comma-separated (default: every "
        "one installed of sglang-router, vllm-router: make peer-routers); '' for none",
    )
    ap.add_argument("--peer-policy", default="round_robin", help="their policy (round_robin)")
    ap.add_argument(
        "--before-src",
        type=Path,
        help="a source tree (e.g. git worktree add /tmp/before REV) whose gateway is measured "
        "as gw-before, one process, same config: the ratios per request and per chunk",
    )
    ap.add_argument("--serve-backend", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_backend:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        serve_backend(args.serve_backend, args.chunks, args.chunk_gap_ms / 1000.0)
        return 0
    if args.quick:
        args.num_requests, args.num_streams = 600, 64
    print(
        f"gateway overhead benchmark: policy={args.policy}, {os.cpu_count()} CPUs, "
        f"{args.num_requests} requests per run, {args.num_streams} streams x {args.chunks} chunks"
    )
    with tempfile.TemporaryDirectory() as tmp_dir, processes() as procs:
        targets = start_all(args, Path(tmp_dir), procs)
        results = {t.name: asyncio.run(measure(t, args)) for t in targets}
        report(results)
    if args.profile:  # written when the gateway exits (SIGTERM above)
        print_profile(args.profile)
    return 0


def print_profile(path: Path, top: int = 30) -> None:
    """The gateway's functions by own time, then by cumulative time, and the total."""
    import pstats

    if not path.exists():
        print(f"profile: {path} was not written (the gateway did not exit cleanly)")
        return
    stats = pstats.Stats(str(path))
    print(f"\n## gateway profile ({path}): total {stats.total_tt:.2f} s in profiled calls")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


if __name__ == "__main__":
    sys.exit(main())
