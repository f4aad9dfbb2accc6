"""``kiloserve doctor`` on a real local cluster (issue 15, S5.4): three twins of one model
(the third behind a delaying TCP proxy the test controls), one tiny-KV twin in a pool of
its own, and the gateway; light streaming load; one fault per test through the twin's
``POST /admin/faults`` (the network delay through the proxy, which the twin has no fault
for); the doctor must name the injected fault first, on the right backend."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from kiloserve.chaos.env import DrillEnv
from kiloserve.doctor.diagnose import Finding, diagnose
from kiloserve.doctor.probe import collect
from kiloserve.launch.config import parse_cluster_config

pytestmark = pytest.mark.slow

CLUSTER = {
    "name": "doctor",
    "gateway": {"port": 0, "policy": "default"},
    "backends": [
        {"name": "h100", "gpu": "H100", "model": "llama-3.1-8b", "count": 3},
        {
            "name": "tiny", "gpu": "H100", "model": "llama-3.1-8b",
            "served_model_name": "tiny-kv", "max_model_len": 1024,
            "extra_args": ["--gpu-memory-utilization", "0.26"],  # ~1.5k tokens of KV
        },
    ],
}  # fmt: skip
MODEL = "Llama-3.1-8B"
PROXIED = 2  # h100-2 is reached through the delay proxy


class DelayProxy:
    """A TCP proxy on 127.0.0.1:0 (its own thread and loop) that holds every chunk
    ``delay_s`` in each direction: a slow network path, the engine itself untouched."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.delay_s = 0.0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(10)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            while data := await reader.read(65536):
                queue.put_nowait((time.monotonic() + self.delay_s, data))
        except OSError:
            pass
        queue.put_nowait((0.0, b""))
        with contextlib.suppress(OSError):
            await sender
        writer.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))


class DoctorEnv(DrillEnv):
    """The drill environment with one backend's gateway URL pointed at the proxy."""

    proxy: DelayProxy

    def _gateway_conf(self, port: int) -> dict[str, Any]:
        conf = super()._gateway_conf(port)
        target = int(conf["backends"][PROXIED]["url"].rsplit(":", 1)[1])
        self.proxy = DelayProxy(target)
        self.proxy.start()
        conf["backends"][PROXIED]["url"] = f"http://127.0.0.1:{self.proxy.port}"
        return conf


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DoctorEnv]:
    drill = DoctorEnv(parse_cluster_config(CLUSTER), tmp_path_factory.mktemp("doctor"))
    drill.start()
    try:
        yield drill
    finally:
        drill.stop()
        with contextlib.suppress(AttributeError):
            drill.proxy.stop()


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with session.post(url + "/v1/completions", json=body) as resp:
            await resp.read()


@contextlib.asynccontextmanager
async def _load(
    env: DoctorEnv, *, model: str = MODEL, concurrency: int = 6, prompt: str = "hello doctor",
    max_tokens: int = 16,
) -> AsyncIterator[None]:  # fmt: skip
    """Steady streaming load on the gateway while the block runs."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    timeout = aiohttp.ClientTimeout(total=10.0)

    async def worker(session: aiohttp.ClientSession, i: int) -> None:
        while True:
            await _stream(session, env.gateway_url, {**body, "prompt": f"{i} {prompt}"})

    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [asyncio.ensure_future(worker(session, i)) for i in range(concurrency)]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _doctor(env: DoctorEnv) -> list[Finding]:
    token = os.environ.get("KILOSERVE_ADMIN_TOKEN")  # the drill's gateway inherits it
    got = await collect(env.gateway_url, admin_token=token, window_s=1.5, timeout_s=1.0)
    return diagnose(got.snapshot)


async def _fault(env: DoctorEnv, index: int, body: dict[str, Any]) -> None:
    await env.faults(env.names()[index], body)


def _first(findings: list[Finding]) -> Finding:
    assert findings, "the doctor found nothing"
    return findings[0]


def _settled(rows: dict[str, dict[str, Any]]) -> bool:
    return all(
        r["healthy"] and r["routable"] and not r["consecutive_errors"] for r in rows.values()
    )


@pytest.fixture(autouse=True)
async def _clear(env: DoctorEnv) -> AsyncIterator[None]:
    """After each test: clear the faults, then light load on both pools until every
    backend is healthy, routable and without an error streak (at most 8 s), so one test's
    leftovers (an ejection, an error streak) do not show in the next."""
    yield
    env.proxy.delay_s = 0.0
    for i in range(len(env.names())):
        await _fault(env, i, {})
    deadline = time.monotonic() + 8.0
    async with _load(env, concurrency=2, max_tokens=2), _load(env, model="tiny-kv", concurrency=1):
        while time.monotonic() < deadline and not _settled(await env.backends()):
            await asyncio.sleep(0.2)
    await env.close()


async def test_kv_full(env: DoctorEnv) -> None:
    async with _load(env, model="tiny-kv", concurrency=8, prompt="word " * 240, max_tokens=300):
        await asyncio.sleep(2.0)
        findings = await _doctor(env)
    top = _first(findings)
    assert (top.cause, top.backend) == ("kv_saturation", "tiny"), findings


async def test_errors(env: DoctorEnv) -> None:
    await _fault(env, 0, {"error_rate": 0.6, "status": 500})
    async with _load(env):
        await asyncio.sleep(1.0)
        findings = await _doctor(env)
    top = _first(findings)
    assert (top.cause, top.backend) == ("error_burst", "h100-0"), findings


async def test_hang(env: DoctorEnv) -> None:
    await _fault(env, 1, {"hang": True})
    async with _load(env):
        await asyncio.sleep(1.0)
        findings = await _doctor(env)
    top = _first(findings)
    assert (top.cause, top.backend) == ("hung_engine", "h100-1"), findings


async def test_network_delay(env: DoctorEnv) -> None:
    env.proxy.delay_s = 0.06
    async with _load(env):
        await asyncio.sleep(1.5)
        findings = await _doctor(env)
    top = _first(findings)
    assert (top.cause, top.backend) == ("network_delay", "h100-2"), findings


async def test_slow(env: DoctorEnv) -> None:
    await _fault(env, 0, {"slowdown": 5.0})
    async with _load(env):
        await asyncio.sleep(1.5)
        findings = await _doctor(env)
    top = _first(findings)
    assert (top.cause, top.backend) == ("slow_node", "h100-0"), findings


def test_cli_json_on_a_healthy_cluster(env: DoctorEnv) -> None:
    argv = [sys.executable, "-m", "kiloserve", "doctor", "--gateway", env.gateway_url,
            "--json", "--window", "0.5"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    assert done.returncode in (0, 1), done.stderr.decode()[-2000:]
    doc = orjson.loads(done.stdout)
    assert set(doc) >= {"findings", "gateway", "backends"}
    assert {b["name"] for b in doc["backends"]} == set(env.names())
    for f in doc["findings"]:
        assert set(f) == {"cause", "backend", "score", "evidence", "advice"}
    assert doc["gateway"]["rtt_ms"] is not None


def test_cli_unreachable_gateway(tmp_path: Path) -> None:
    from kiloserve.launch.cluster import free_port

    url = f"http://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "kiloserve", "doctor", "--gateway", url, "--timeout", "0.5"]
    done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    assert done.returncode == 2
    assert b"does not answer" in done.stderr
