"""The twin's LoRA adapters, served for real on 127.0.0.1 as vLLM serves them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from conftest import FixedStepTimer
from kiloserve.engine.lora import LORA_DISK_LOAD_S, LORA_GPU_SWAP_S, LoraModule
from kiloserve.engine.server import TwinServer
from kiloserve.engine.twin import TwinConfig

BASE = "Llama-3.1-8B"
LOAD = "/v1/load_lora_adapter"
CHAT_V2 = {"lora_name": "chat-v2", "lora_path": "/a/c"}


def _config(**kwargs: Any) -> TwinConfig:
    base: dict[str, Any] = {
        "gpu": "H100-SXM", "model": "llama-3.1-8b", "port": 0, "api_overhead_s": 0.0,
        "enable_lora": True, "lora_modules": (LoraModule("sql", "/adapters/sql"),),
        "allow_runtime_lora_updating": True,
    }  # fmt: skip
    base.update(kwargs)
    return TwinConfig(**base)


@pytest.fixture
async def twin() -> AsyncIterator[TwinServer]:
    async with TwinServer(_config(), timer=FixedStepTimer(0.002)) as server:
        yield server


async def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as resp:
        return resp.status, await resp.text()


async def _complete(url: str, model: str, max_tokens: int = 2) -> tuple[int, Any]:
    body = {"model": model, "prompt": "hello there", "max_tokens": max_tokens}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


async def test_models_lists_adapters_with_parent(twin: TwinServer) -> None:
    async with aiohttp.ClientSession() as s, s.get(twin.url + "/v1/models") as resp:
        cards = {c["id"]: c for c in (await resp.json())["data"]}
    assert cards["sql"]["parent"] == BASE
    assert cards["sql"]["root"] == "/adapters/sql"
    assert cards[BASE]["parent"] is None


async def test_load_serve_unload_with_vllm_messages(twin: TwinServer) -> None:
    status, body = await _complete(twin.url, "chat-v2")
    assert status == 404
    assert body["error"]["message"] == "The model `chat-v2` does not exist."
    status, text = await _post(twin.url, LOAD, CHAT_V2)
    assert (status, text) == (200, "Success: LoRA adapter 'chat-v2' added successfully.")
    status, body = await _complete(twin.url, "chat-v2")
    assert status == 200 and body["choices"][0]["text"]
    status, text = await _post(twin.url, LOAD, CHAT_V2)
    assert status == 400 and "The lora adapter 'chat-v2' has already been loaded." in text
    assert "InvalidUserInput" in text
    status, text = await _post(twin.url, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and "Both 'lora_name' and 'lora_path' must be provided." in text
    status, text = await _post(twin.url, "/v1/unload_lora_adapter", {"lora_name": "chat-v2"})
    assert (status, text) == (200, "Success: LoRA adapter 'chat-v2' removed successfully.")
    status, text = await _post(twin.url, "/v1/unload_lora_adapter", {"lora_name": "chat-v2"})
    assert status == 404 and "The lora adapter 'chat-v2' cannot be found." in text
    assert (await _complete(twin.url, "chat-v2"))[0] == 404


async def test_runtime_updates_need_the_env_flag() -> None:
    config = _config(allow_runtime_lora_updating=False)
    async with TwinServer(config, timer=FixedStepTimer(0.002)) as server:
        status, _ = await _post(server.url, LOAD, CHAT_V2)
        assert status == 404
        assert (await _complete(server.url, "sql"))[0] == 200  # --lora-modules still served


async def test_adapter_swap_costs_step_time() -> None:
    """max_loras=1: alternating two adapters pays a swap each time; repeats do not."""
    config = _config(lora_modules=(LoraModule("a", "pa"), LoraModule("b", "pb")), max_cpu_loras=2)
    async with TwinServer(config, timer=FixedStepTimer(0.002)) as server:

        async def timed(model: str) -> float:
            start = time.perf_counter()
            assert (await _complete(server.url, model))[0] == 200
            return time.perf_counter() - start

        cold_s = await timed("a")  # disk -> CPU -> GPU
        warm_s = min([await timed("a") for _ in range(3)])  # in the GPU slot
        swap_s = await timed("b")  # cold again
        back_s = await timed("a")  # in the CPU cache, not the slot: GPU copy only
    assert cold_s - warm_s >= 0.8 * (LORA_GPU_SWAP_S + LORA_DISK_LOAD_S)
    assert swap_s - warm_s >= 0.8 * (LORA_GPU_SWAP_S + LORA_DISK_LOAD_S)
    assert 0.8 * LORA_GPU_SWAP_S <= back_s - warm_s < LORA_DISK_LOAD_S


async def test_lora_requests_info_names_running_adapters() -> None:
    async with TwinServer(_config(max_loras=4), timer=FixedStepTimer(0.02)) as server:
        body = {"model": "sql", "prompt": "hi", "max_tokens": 200, "stream": True}
        async with (
            aiohttp.ClientSession() as s,
            s.post(server.url + "/v1/completions", json=body) as resp,
        ):
            await resp.content.readline()  # the stream has started
            async with s.get(server.url + "/metrics") as m:
                text = await m.text()
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'running_lora_adapters="sql"' in line
    assert 'waiting_lora_adapters=""' in line and 'max_lora="4"' in line
    assert abs(float(line.rsplit(" ", 1)[1]) - time.time()) < 60
