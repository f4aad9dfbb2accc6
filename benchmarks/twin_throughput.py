"""How many streamed tokens per second one engine-twin process emits on one core.

The twin runs as ``python -m kiloserve engine ... --slowdown 0.001`` (modelled steps
1000x faster than the GPU, so the Python process, not the model, is the limit),
pinned to one CPU; the load generator runs in a separate process pinned to another
CPU (when the machine has two), keeps ``--concurrency`` streaming completions open
and counts the SSE token events it receives during the measurement window.

    .venv/bin/python benchmarks/twin_throughput.py [--concurrency 256] [--seconds 5]

Target: >= 20,000 streamed tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
import urllib.request
from multiprocessing.connection import Connection

import aiohttp

TARGET_TOKENS_PER_S = 20_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux /proc), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and cpu < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {cpu})


def _start_twin(port: int, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "kiloserve", "engine", "--log-level", "WARNING",
        "--gpu", args.gpu, "--model", args.model, "--port", str(port),
        "--slowdown", str(args.slowdown), "--max-num-seqs", str(max(256, args.concurrency)),
    ]  # fmt: skip
    return subprocess.Popen(cmd, preexec_fn=lambda: _pin(0))


def _wait_healthy(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("twin did not become healthy")


async def _one_stream(session: aiohttp.ClientSession, url: str, counts: list[int]) -> None:
    body = {"prompt": "time data node card", "max_tokens": 2000, "ignore_eos": True}
    body["stream"] = True
    async with session.post(url, json=body) as resp:
        tail = b""
        async for data in resp.content.iter_any():
            tail += data
            cut = tail.rfind(b"\n\n") + 2
            counts[0] += tail.count(b"data: {", 0, cut)
            tail = tail[cut:]


async def _twin_counters(session: aiohttp.ClientSession, port: int) -> tuple[float, float]:
    """The twin's ``vllm:generation_tokens_total`` (cross-check) and its loop lag."""
    async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
        text = await resp.text()
    values = {}
    for line in text.splitlines():
        for name in ("vllm:generation_tokens_total{", "kiloserve_twin_loop_lag_seconds "):
            if line.startswith(name):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["vllm:generation_tokens_total{"], values["kiloserve_twin_loop_lag_seconds "]


async def _load(
    port: int, twin_pid: int, concurrency: int, warmup_s: float, seconds: float
) -> tuple[float, float, float, float]:
    url = f"http://127.0.0.1:{port}/v1/completions"
    counts = [0]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while True:
                await _one_stream(session, url, counts)

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await asyncio.sleep(warmup_s)
        start_count, start_s = counts[0], time.monotonic()
        start_cpu_s = _cpu_seconds(twin_pid)
        start_generated, _ = await _twin_counters(session, port)
        await asyncio.sleep(seconds)
        num_tokens = counts[0] - start_count
        rate = num_tokens / (time.monotonic() - start_s)
        per_cpu_s = num_tokens / max(1e-9, _cpu_seconds(twin_pid) - start_cpu_s)
        end_generated, lag_s = await _twin_counters(session, port)
        generated = end_generated - start_generated
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return rate, per_cpu_s, generated / (time.monotonic() - start_s), lag_s


def _client(port: int, twin_pid: int, args: argparse.Namespace, out: Connection) -> None:
    _pin(1)
    out.send(asyncio.run(_load(port, twin_pid, args.concurrency, args.warmup, args.seconds)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="H100-SXM")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--slowdown", type=float, default=0.001)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    port = _free_port()
    twin = _start_twin(port, args)
    try:
        _wait_healthy(port)
        receiver, sender = mp.Pipe(duplex=False)
        client = mp.get_context("spawn").Process(
            target=_client, args=(port, twin.pid, args, sender)
        )
        client.start()
        rate, per_cpu_s, generated_rate, lag_s = receiver.recv()
        client.join()
    finally:
        twin.terminate()
        twin.wait(timeout=10)
    cpu_share = rate / per_cpu_s if per_cpu_s > 0 else 0.0
    verdict = "MET" if per_cpu_s >= TARGET_TOKENS_PER_S else "NOT MET"
    print(f"concurrent streams:                  {args.concurrency}")
    print(f"streamed tokens/s (wall clock):      {rate:,.0f}")
    print(f"twin's own generated tokens/s:       {generated_rate:,.0f}")
    print(f"twin CPU used:                       {cpu_share:.2f} core")
    print(f"streamed tokens per twin CPU-second: {per_cpu_s:,.0f}")
    print(f"twin loop lag at the end:            {lag_s * 1e3:.1f} ms")
    print(
        f"target >= {TARGET_TOKENS_PER_S:,} tok/s on one core: {verdict} "
        "(judged per CPU-second, so other load on a shared box does not count)"
    )
    return 0 if verdict == "MET" else 1


if __name__ == "__main__":
    sys.exit(main())
