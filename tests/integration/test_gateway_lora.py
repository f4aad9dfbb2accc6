"""LoRA adapters through the gateway, against live engine twins on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from test_gateway_fakes import gateway_config, running_gateway

from conftest import FixedStepTimer
from kiloserve.engine.lora import LoraModule
from kiloserve.engine.server import TwinServer
from kiloserve.engine.twin import TwinConfig

BASE = "Llama-3.1-8B"


@contextlib.asynccontextmanager
async def lora_twins(*modules: tuple[LoraModule, ...]) -> AsyncIterator[list[TwinServer]]:
    async with contextlib.AsyncExitStack() as stack:
        servers = []
        for mods in modules:
            cfg = TwinConfig(
                gpu="H100-SXM", model="llama-3.1-8b", port=0, api_overhead_s=0.0,
                enable_lora=True, lora_modules=mods, max_loras=2,
                allow_runtime_lora_updating=True,
            )  # fmt: skip
            server = TwinServer(cfg, timer=FixedStepTimer(0.002))
            servers.append(await stack.enter_async_context(server))
        yield servers


def _cfg(servers: list[TwinServer], **kw: Any) -> Any:
    backends = [{"url": t.url, "name": f"twin{i}"} for i, t in enumerate(servers)]
    return gateway_config(backends, discovery_interval_s=0.1, **kw)


async def _complete(url: str, model: str) -> tuple[int, str]:
    body = {"model": model, "prompt": "hello", "max_tokens": 2}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status, r.headers.get("x-kiloserve-backend", "")


async def _adapters(url: str) -> set[str]:
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
        return {c["id"] for c in (await r.json())["data"] if c.get("parent")}


async def _unload(url: str, name: str) -> None:
    body = {"lora_name": name}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/unload_lora_adapter", json=body) as r,
    ):
        assert r.status == 200


async def test_adapter_requests_go_to_the_backends_that_hold_it() -> None:
    async with (
        lora_twins((), (LoraModule("sql", "/a/sql"),)) as servers,
        running_gateway(_cfg(servers)) as url,
    ):
        got = [await _complete(url, "sql") for _ in range(6)]
        assert got == [(200, "twin1")] * 6
        assert [await _complete(url, BASE) for _ in range(2)] != [(200, "twin1")] * 2


async def test_known_adapter_is_loaded_on_a_miss_and_lru_evicted() -> None:
    adapters = {n: {"path": f"/a/{n}", "base_model": BASE} for n in ("a", "b", "c")}
    lora = {"adapters": adapters, "max_adapters_per_backend": 2}
    async with lora_twins(()) as servers:
        twin = servers[0].url
        async with running_gateway(_cfg(servers, lora=lora)) as url:
            assert await _complete(url, "a") == (200, "twin0")
            assert await _adapters(twin) == {"a"}
            assert await _complete(url, "b") == (200, "twin0")
            assert await _complete(url, "a") == (200, "twin0")  # b now least recent
            assert await _complete(url, "c") == (200, "twin0")
            assert await _adapters(twin) == {"a", "c"}  # b unloaded, within budget
            assert (await _complete(url, "nope"))[0] == 404


async def test_discovered_adapter_is_reloaded_after_its_holder_dropped_it() -> None:
    async with (
        lora_twins((LoraModule("sql", "/a/sql"),), ()) as servers,
        running_gateway(_cfg(servers)) as url,
    ):
        await asyncio.sleep(0.3)  # one catalog refresh: sql is known from twin0
        await _unload(servers[0].url, "sql")
        await asyncio.sleep(0.3)  # discovery sees it gone
        status, _ = await _complete(url, "sql")
        assert status == 200
        held = [await _adapters(t.url) for t in servers]
        assert sum("sql" in h for h in held) == 1


async def test_concurrent_misses_share_one_load() -> None:
    lora = {"adapters": {"a": {"path": "/a/a", "base_model": BASE}}}
    async with lora_twins((), ()) as servers, running_gateway(_cfg(servers, lora=lora)) as url:
        got = await asyncio.gather(*(_complete(url, "a") for _ in range(8)))
        assert {s for s, _ in got} == {200}
        held = [await _adapters(t.url) for t in servers]
        assert sorted(len(h) for h in held) == [0, 1]


async def test_holders_found_when_backend_models_are_configured() -> None:
    """Configured ``models`` turn discovery off; the adapter catalog still finds holders."""
    async with lora_twins((), (LoraModule("sql", "/a/sql"),)) as servers:
        backends = [
            {"url": t.url, "name": f"twin{i}", "models": [BASE]} for i, t in enumerate(servers)
        ]
        cfg = gateway_config(backends, discovery_interval_s=0.1)
        async with running_gateway(cfg) as url:
            await asyncio.sleep(0.3)  # one catalog refresh
            got = [await _complete(url, "sql") for _ in range(4)]
            assert got == [(200, "twin1")] * 4
