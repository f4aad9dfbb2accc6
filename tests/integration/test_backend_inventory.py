"""Engine and model versions collected by a live gateway (SPEC S5.5, issue 17): a twin
(vLLM's /version, /v1/models, vllm:cache_config_info), and fakes answering SGLang's
/get_server_info and llama.cpp's /props, shown in /admin/backends and the
kiloserve_backend_info metric."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from test_gateway_fakes import admin_backends, gateway_config, running_gateway
from test_gateway_twins import MODEL, twins

from kiloserve.engine.server import VLLM_VERSION

SGLANG_INFO = {"model_path": "Qwen/Qwen2.5-0.5B-Instruct", "context_length": 32768,
               "tp_size": 1, "version": "0.4.6.post2"}  # fmt: skip
LLAMACPP_PROPS = {"build_info": "b5460-aa50ba46", "model_path": "/models/tiny.gguf",
                  "default_generation_settings": {"n_ctx": 2048}}  # fmt: skip


@contextlib.asynccontextmanager
async def engine_stub(path: str, answer: dict[str, Any], model: str) -> AsyncIterator[str]:
    """A server with /v1/models, /health and one engine-specific endpoint (no /metrics)."""

    async def info(request: web.Request) -> web.Response:
        return web.json_response(answer)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get(path, info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _wait_for_versions(gw: str, names: set[str], timeout_s: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = await admin_backends(gw)
        if all(rows[n]["engine_version"] for n in names):
            return rows
        await asyncio.sleep(0.05)
    raise AssertionError(f"no engine versions within {timeout_s} s: {await admin_backends(gw)}")


async def test_versions_in_admin_backends_and_the_info_metric() -> None:
    async with (
        twins({}) as (twin,),
        engine_stub("/get_server_info", SGLANG_INFO, "qwen") as sglang,
        engine_stub("/props", LLAMACPP_PROPS, "tiny") as llamacpp,
    ):
        backends = [
            {"url": twin.url, "name": "twin"},
            {"url": sglang, "name": "sgl"},
            {"url": llamacpp, "name": "lcpp", "engine": "llamacpp"},
        ]
        async with running_gateway(gateway_config(backends)) as gw:
            rows = await _wait_for_versions(gw, {"twin", "sgl", "lcpp"})
            async with aiohttp.ClientSession() as s, s.get(gw + "/metrics") as r:
                page = await r.text()
    assert rows["twin"]["engine"] == "vllm"
    assert rows["twin"]["engine_version"] == VLLM_VERSION
    assert rows["twin"]["model_root"] == MODEL and rows["twin"]["max_model_len"] > 0
    assert rows["twin"]["cache_config"]["block_size"] == "16"
    assert int(rows["twin"]["cache_config"]["num_gpu_blocks"]) > 0
    assert (rows["sgl"]["engine"], rows["sgl"]["engine_version"]) == ("sglang", "0.4.6.post2")
    assert rows["sgl"]["model_root"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert rows["sgl"]["max_model_len"] == 32768
    assert (rows["lcpp"]["engine"], rows["lcpp"]["engine_version"]) == (
        "llamacpp", "b5460-aa50ba46",
    )  # fmt: skip
    assert (rows["lcpp"]["model_root"], rows["lcpp"]["max_model_len"]) == (
        "/models/tiny.gguf", 2048,
    )  # fmt: skip
    info = {
        s.labels["backend"]: s.labels
        for f in text_string_to_metric_families(page)
        for s in f.samples
        if s.name == "kiloserve_backend_info"
    }
    assert info["twin"]["engine_version"] == VLLM_VERSION and info["twin"]["engine"] == "vllm"
    assert info["twin"]["max_model_len"] == str(rows["twin"]["max_model_len"])
    assert info["sgl"]["engine_version"] == "0.4.6.post2"
    assert info["lcpp"]["model_root"] == "/models/tiny.gguf"


async def test_inventory_off_leaves_the_labels_empty() -> None:
    async with twins({}) as (twin,):
        cfg = gateway_config([{"url": twin.url, "name": "twin"}], inventory_interval_s=0)
        async with running_gateway(cfg) as gw:
            await asyncio.sleep(0.3)
            row = (await admin_backends(gw))["twin"]
    assert row["engine_version"] == "" and row["max_model_len"] is None
