"""The gateway in front of real engine twins on 127.0.0.1 (only the GPU is modelled)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families
from test_gateway_fakes import gateway_config, running_gateway

from conftest import FixedStepTimer, free_port
from kiloserve.engine.faults import FaultSet
from kiloserve.engine.server import TwinServer
from kiloserve.engine.twin import TwinConfig

MODEL = "Llama-3.1-8B"


@contextlib.asynccontextmanager
async def twins(*specs: dict[str, Any], step_s: float = 0.002) -> AsyncIterator[list[TwinServer]]:
    async with contextlib.AsyncExitStack() as stack:
        servers = []
        for spec in specs:
            cfg = TwinConfig(
                gpu="H100-SXM", model="llama-3.1-8b", port=0, api_overhead_s=0.0, **spec
            )
            server = TwinServer(cfg, timer=FixedStepTimer(step_s))
            servers.append(await stack.enter_async_context(server))
        yield servers


async def twin_metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items()))
            out[key] = out.get(key, 0.0) + sample.value
    return out


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_openai_sdk_through_gateway_default_policy() -> None:
    async with twins({}, {}) as servers:
        backends = [{"url": t.url, "name": f"twin{i}"} for i, t in enumerate(servers)]
        cfg = gateway_config(backends, policy={"name": "default"})
        async with running_gateway(cfg) as url, _client(url) as client:
            raw = await client.completions.with_raw_response.create(
                model=MODEL, prompt="the fast node", max_tokens=5
            )
            assert raw.headers["x-kiloserve-backend"] in {"twin0", "twin1"}
            out = raw.parse()
            assert out.usage is not None and out.usage.completion_tokens == 5
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi there"}],
                max_tokens=6,
                stream=True,
            )
            chunks = [c async for c in stream]
            assert all(c.usage is None for c in chunks)  # usage hidden: not asked for
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text
            stream = await client.completions.create(
                model=MODEL, prompt="x", max_tokens=3, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            last = [c async for c in stream][-1]
            assert last.usage is not None and last.usage.completion_tokens == 3
            async with aiohttp.ClientSession() as s, s.get(url + "/admin/backends") as r:
                view = (await r.json())["backends"]
    assert {b["engine"] for b in view} == {"vllm"}
    assert all(b["kv_usage"] is not None and b["models"] == [MODEL] for b in view)
    assert sum(b["in_flight"] for b in view) == 0


async def test_disconnect_aborts_request_on_the_twin() -> None:
    async with twins({}, step_s=0.02) as (twin,):
        cfg = gateway_config([{"url": twin.url}])
        async with running_gateway(cfg) as url:
            async with aiohttp.ClientSession() as s:
                body = {"model": MODEL, "prompt": "the fast node " * 50, "max_tokens": 2000}
                async with s.post(url + "/v1/completions", json={**body, "stream": True}) as r:
                    for _ in range(3):
                        await r.content.readline()
                    during = await twin_metrics(twin.url)
            for _ in range(100):
                after = await twin_metrics(twin.url)
                if after["vllm:num_requests_running,engine=0,model_name=" + MODEL] == 0:
                    break
                await asyncio.sleep(0.02)
    key = ",engine=0,model_name=" + MODEL
    assert during["vllm:num_requests_running" + key] == 1
    assert during["vllm:kv_cache_usage_perc" + key] > 0
    assert after["vllm:num_requests_running" + key] == 0
    assert after["vllm:kv_cache_usage_perc" + key] == 0
    assert (
        after["vllm:request_success_total" + key.replace(",model", ",finished_reason=abort,model")]
        == 1
    )


async def test_retries_over_twin_faults_and_refused_connection() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    failing = {"faults": FaultSet(error_rate=1.0, error_status=503)}
    hanging = {"faults": FaultSet(is_hang=True)}
    async with twins(failing, hanging, {}) as (bad, hang, good):
        backends = [
            {"url": dead, "name": "dead", "models": [MODEL]},
            {"url": bad.url, "name": "bad"},
            {"url": hang.url, "name": "hang"},
            {"url": good.url, "name": "good"},
        ]
        cfg = gateway_config(
            backends,
            retries=3,
            first_byte_timeout_s=0.3,
            non_stream_timeout_s=0.3,
            max_scrape_failures=10**6,
        )
        async with running_gateway(cfg) as url, _client(url) as client:
            served = []
            for i in range(4):
                raw = await client.completions.with_raw_response.create(
                    model=MODEL, prompt="p", max_tokens=2, stream=bool(i % 2)
                )
                served.append(raw.headers["x-kiloserve-backend"])
                raw.parse()
            async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
                text = await r.text()
    assert served == ["good"] * 4
    retried = {
        line.split('backend="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("kiloserve_gateway_retries_total")
    }
    assert retried == {"dead", "bad", "hang"}


async def test_model_pools_over_twins() -> None:
    async with twins({"served_model_name": "small"}, {"served_model_name": "big"}) as servers:
        backends = [{"url": t.url, "name": f"t{i}"} for i, t in enumerate(servers)]
        async with running_gateway(gateway_config(backends)) as url, _client(url) as client:
            models = sorted(m.id for m in (await client.models.list()).data)
            picks = set()
            for model in ["small", "big", "small", "big"]:
                raw = await client.completions.with_raw_response.create(
                    model=model, prompt="p", max_tokens=1
                )
                picks.add((model, raw.headers["x-kiloserve-backend"]))
            try:
                await client.completions.create(model="nope", prompt="p", max_tokens=1)
                raise AssertionError("unknown model was served")
            except openai.NotFoundError as exc:
                assert "big, small" in str(exc)
    assert models == ["big", "small"]
    assert picks == {("small", "t0"), ("big", "t1")}
