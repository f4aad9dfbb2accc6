"""Fake OpenAI-ish backends and a gateway runner for the gateway integration tests.

``FakeBackend`` is a real aiohttp server on 127.0.0.1 whose behaviour is switched per
test: ok, 500, 429, 400, hang before the first byte, slow stream. It records what it
received and counts streams the client aborted. The tests at the bottom check the fake
itself so a broken fake cannot make the gateway tests pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kiloserve.engine.protocol import PROBE_HEADER
from kiloserve.gateway.app import create_gateway_app
from kiloserve.gateway.config import GatewayConfig, parse_gateway_config
from kiloserve.policies.base import Policy

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} %d
vllm:num_requests_waiting{engine="0",model_name="m"} 0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""


@dataclass
class FakeBackend:
    """A controllable OpenAI-compatible server."""

    models: list[str] = field(default_factory=lambda: ["m"])
    mode: str = "ok"  # ok | 500 | 429 | 400 | hang | slow
    num_chunks: int = 3
    chunk_delay_s: float = 0.0
    metrics_status: int = 200
    metrics_delay_s: float = 0.0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    num_active: int = 0
    num_aborted: int = 0
    num_finished: int = 0
    num_metrics: int = 0  # GET /metrics answered
    num_probes: int = 0  # the gateway's completion probes (not in bodies / headers)
    url: str = ""
    _runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        return app

    async def start(self) -> str:
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model"} for m in self.models]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.num_metrics += 1
        if self.metrics_delay_s:
            await asyncio.sleep(self.metrics_delay_s)
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status, text="nope")
        return web.Response(text=VLLM_METRICS % self.num_active)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        is_probe = PROBE_HEADER in request.headers  # a health probe: not client traffic
        if is_probe:
            self.num_probes += 1
        else:
            self.bodies.append(body)
            self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if self.mode in ("500", "429", "400"):
            err = {"error": {"message": f"fake {self.mode}", "type": "fake", "code": 1}}
            return web.json_response(err, status=int(self.mode))
        if is_probe:  # the mode applies, the counts (num_active...) do not
            if self.mode == "hang":
                await asyncio.sleep(3600)
            return web.json_response(_completion(body, 1))
        self.num_active += 1
        try:
            if self.mode == "hang":
                await asyncio.sleep(3600)
            if body.get("stream"):
                return await self._stream(request, body)
            return web.json_response(_completion(body, self.num_chunks))
        except (asyncio.CancelledError, ConnectionResetError):
            self.num_aborted += 1
            raise
        finally:
            self.num_active -= 1

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.num_chunks):
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
            chunk = {"id": "x", "choices": [{"index": 0, "text": f"t{i}"}], "usage": None}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 5, "completion_tokens": self.num_chunks, "total_tokens": 9}
            await resp.write(b"data: " + orjson.dumps({"id": "x", "choices": [], "usage": usage}))
            await resp.write(b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        self.num_finished += 1
        await resp.write_eof()
        return resp


def _completion(body: dict[str, Any], num_tokens: int) -> dict[str, Any]:
    usage = {"prompt_tokens": 5, "completion_tokens": num_tokens, "total_tokens": 5 + num_tokens}
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": body.get("model"),
        "choices": [{"index": 0, "text": "hello", "finish_reason": "length"}],
        "usage": usage,
        "extra_field_seen": sorted(body),
    }


@contextlib.asynccontextmanager
async def fake_backends(*fakes: FakeBackend) -> AsyncIterator[list[FakeBackend]]:
    try:
        for f in fakes:
            await f.start()
        yield list(fakes)
    finally:
        for f in fakes:
            await f.stop()


@contextlib.asynccontextmanager
async def gateway_process(*args: str) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """``python -m kiloserve gateway ARGS --port 0`` (least_request, WARNING logs) for
    the block: yields the first line it prints (``... listening on URL ...``) and the
    process; SIGTERM at the end."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kiloserve", "gateway", *args, "--policy", "least_request",
        "--port", "0", "--log-level", "WARNING", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        yield line, proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 40)


def gateway_config(backends: list[dict[str, Any]], **kw: Any) -> GatewayConfig:
    data: dict[str, Any] = {
        "port": 0,
        "scrape_interval_s": 0.05,
        "scrape_timeout_s": 0.5,
        "policy": {"name": "round_robin"},
        "backends": backends,
    }
    data.update(kw)
    return parse_gateway_config(data)


@contextlib.asynccontextmanager
async def running_gateway(
    cfg: GatewayConfig, wait_ready: bool = True, policy: Policy | None = None
) -> AsyncIterator[str]:
    """Serve the gateway on 127.0.0.1:0 and yield its base URL (``policy`` overrides
    ``cfg.policy``)."""
    app = create_gateway_app(cfg, policy=policy)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        if wait_ready:
            await wait_until_ready(url)
        yield url
    finally:
        await runner.cleanup()


async def post_faults(url: str, body: dict[str, Any]) -> None:
    """Set a twin's faults (``POST /admin/faults``, JSON)."""
    async with aiohttp.ClientSession() as s, s.post(url + "/admin/faults", json=body) as r:
        assert r.status == 200


async def admin_backends(gw: str) -> dict[str, dict[str, Any]]:
    """The gateway's ``/admin/backends`` rows by backend name."""
    async with aiohttp.ClientSession() as s, s.get(gw + "/admin/backends") as r:
        rows = (await r.json())["backends"]
    return {row["name"]: row for row in rows}


async def wait_until_ready(url: str, timeout_s: float = 5.0) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(int(timeout_s / 0.02)):
            async with s.get(url + "/ready") as r:
                if r.status == 200:
                    return
            await asyncio.sleep(0.02)
    raise AssertionError(f"gateway at {url} never became ready")


async def test_fake_backend_streams_usage_only_when_asked() -> None:
    async with fake_backends(FakeBackend(num_chunks=2)) as (fake,), aiohttp.ClientSession() as s:
        body = {"model": "m", "prompt": "hi", "stream": True}
        async with s.post(fake.url + "/v1/completions", json=body) as r:
            plain = await r.read()
        body["stream_options"] = {"include_usage": True}
        async with s.post(fake.url + "/v1/completions", json=body) as r:
            with_usage = await r.read()
    assert plain.count(b"data: ") == 3
    assert b'"usage":{' not in plain
    assert with_usage.count(b"data: ") == 4
    assert b'"completion_tokens":2' in with_usage


async def test_fake_backend_error_modes() -> None:
    async with (
        fake_backends(FakeBackend(mode="500")) as (fake,),
        aiohttp.ClientSession() as s,
        s.post(fake.url + "/v1/completions", json={"model": "m"}) as r,
    ):
        assert r.status == 500
