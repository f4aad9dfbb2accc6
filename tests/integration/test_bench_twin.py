"""``kiloserve bench`` against real engine twins and the gateway on 127.0.0.1.

Only the GPU is modelled: the twins run the real scheduler, block manager and prefix
cache behind the vLLM-compatible HTTP API; the step time is fixed so token spacing is
known.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import FixedStepTimer
from kiloserve.bench.client import ClientOptions, run_bench
from kiloserve.engine.server import TwinServer
from kiloserve.engine.twin import TwinConfig
from kiloserve.gateway.app import create_gateway_app
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.results.metrics import parse_slo, summarize
from kiloserve.results.report import write_report
from kiloserve.workload import ClosedLoop, OpenLoop, Workload, load_workload
from kiloserve.workload.traces import PACKAGED_TRACES_DIR

MODEL = "Llama-3.1-8B"
STEP_S = 0.004
TRACES = PACKAGED_TRACES_DIR  # shipped with the package


@contextlib.asynccontextmanager
async def twins(num_twins: int) -> AsyncIterator[list[TwinServer]]:
    async with contextlib.AsyncExitStack() as stack:
        servers = []
        for _ in range(num_twins):
            cfg = TwinConfig(gpu="H100-SXM", model="llama-3.1-8b", port=0, api_overhead_s=0.0)
            server = TwinServer(cfg, timer=FixedStepTimer(STEP_S))
            servers.append(await stack.enter_async_context(server))
        yield servers


@contextlib.asynccontextmanager
async def gateway(urls: list[str]) -> AsyncIterator[str]:
    cfg = parse_gateway_config({
        "port": 0, "scrape_interval_s": 0.05, "scrape_timeout_s": 0.5,
        "policy": {"name": "round_robin"},
        # no completion probes: a twin counts a probe's prompt in its prefix-cache
        # counters (as vLLM does), so one landing after the gateway's last scrape would
        # make the twins' counters and the gateway's gauges differ by its token
        "health": {"completion_probe": False},
        "backends": [{"url": u, "name": f"twin{i}"} for i, u in enumerate(urls)],
    })  # fmt: skip
    runner = aiohttp.web.AppRunner(create_gateway_app(cfg), handler_cancellation=True,
                                   access_log=None)  # fmt: skip
    await runner.setup()
    try:
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        await _wait_ready(url)
        yield url
    finally:
        await runner.cleanup()


async def _wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(250):
            async with s.get(url + "/ready") as r:
                if r.status == 200:
                    return
            await asyncio.sleep(0.02)
    raise AssertionError("gateway never became ready")


async def _metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for family in text_string_to_metric_families(text):
        total += sum(x.value for x in family.samples if x.name == name)
    return total


async def test_bench_against_twin_writes_report(tmp_path: Path) -> None:
    spec = "synthetic:input=uniform(50,200),output=uniform(5,20)"
    workload = load_workload(spec, seed=4, num_requests=16, rate=40.0)
    async with twins(1) as (twin,):
        result = await run_bench(twin.url, MODEL, workload, OpenLoop())
    assert all(r.is_ok for r in result.records), [r.error for r in result.records]
    assert all(r.output_tokens == r.max_tokens for r in result.records)  # ignore_eos
    summary = summarize(result, parse_slo("ttft=1s"), command=["test"])
    tpot = summary["tpot_ms"]
    assert isinstance(tpot, dict) and tpot["p50"] >= STEP_S * 1000 * 0.9
    paths = write_report(tmp_path, result, summary)
    assert {"summary.json", "requests.jsonl", "summary.md", "ttft_cdf.png"} <= set(paths)


async def test_chat_endpoint_against_twin() -> None:
    workload = load_workload("synthetic:input=fixed(40),output=fixed(6)", seed=0, num_requests=4)
    async with twins(1) as (twin,):
        result = await run_bench(twin.url, MODEL, workload, ClosedLoop(2),
                                 options=ClientOptions(endpoint="chat"))  # fmt: skip
    assert all(r.is_ok and r.output_tokens == 6 for r in result.records)


@pytest.mark.skipif(not TRACES.is_dir(), reason="no shipped traces")
async def test_mooncake_prefixes_hit_the_twin_prefix_cache() -> None:
    base = load_workload("mooncake", seed=0, num_requests=4, traces_dir=TRACES)
    short = [s.replaced(output_tokens=2) for s in base]  # keep the run short
    workload = Workload("mooncake-short", 0, lambda: iter(short), len(short))
    async with twins(1) as (twin,):
        result = await run_bench(twin.url, MODEL, workload, ClosedLoop(1))
        hits = await _metric(twin.url, "vllm:prefix_cache_hits_total")
    assert all(r.is_ok for r in result.records), [r.error for r in result.records]
    # requests 1..3 share hash id 0 (512 tokens) with request 0
    assert hits >= 3 * 512, hits


async def test_bench_through_gateway_groups_by_backend() -> None:
    spec = "synthetic:input=uniform(20,80),output=uniform(4,12)"
    workload = load_workload(spec, seed=1, num_requests=20)
    async with twins(2) as servers, gateway([t.url for t in servers]) as url:
        result = await run_bench(url, MODEL, workload, ClosedLoop(4))
    assert all(r.is_ok for r in result.records), [r.error for r in result.records]
    summary = summarize(result)
    per_backend = summary["per_backend"]
    assert isinstance(per_backend, dict) and set(per_backend) == {"twin0", "twin1"}
    assert per_backend["twin0"]["count"] + per_backend["twin1"]["count"] == 20
    assert summary["p95_std_across_backends_ms"] is not None
