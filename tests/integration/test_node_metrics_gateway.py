"""Node hardware signals through a live gateway (S1.3, S1.4, S3.3): two twins whose
``/node/metrics`` pages (dcgm-exporter format) the gateway scrapes per backend
``node_metrics_url``; a PCIe-saturated node gets fewer requests under ``seed_weighted``,
an Xid or an uncorrectable ECC error takes a node out of routing until it clears."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from test_gateway_fakes import gateway_config, post_faults, running_gateway
from test_gateway_twins import MODEL, twins

from kiloserve.engine.server import TwinServer

NUM_REQUESTS = 60


def _backends(servers: list[TwinServer]) -> list[dict[str, Any]]:
    return [
        {"url": s.url, "name": name, "models": [MODEL], "node_metrics_url": s.url + "/node/metrics"}
        for s, name in zip(servers, ("a", "b"), strict=True)
    ]


async def _rows(gw: str) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(gw + "/admin/backends") as r:
        return {row["name"]: row for row in (await r.json())["backends"]}


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s} s")


async def _served_by(gw: str, num: int) -> Counter[str]:
    served: Counter[str] = Counter()
    body = {"model": MODEL, "prompt": "node", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        for _ in range(num):
            async with s.post(gw + "/v1/completions", json=body) as r:
                await r.read()
                assert r.status == 200
                served[r.headers["x-kiloserve-backend"]] += 1
    return served


async def test_seed_weighted_sends_less_to_a_pcie_saturated_node() -> None:
    async with twins({}, {}) as servers:
        cfg = gateway_config(_backends(servers), policy={"name": "seed_weighted"})
        async with running_gateway(cfg) as gw:
            await post_faults(servers[1].url, {"pcie_saturation": 0.95})

            async def saturated() -> bool:
                rows = await _rows(gw)
                b, a = rows["b"]["pcie_util"], rows["a"]["pcie_util"]
                return b is not None and b >= 0.9 and a is not None and a < 0.2

            await _until(saturated)
            served = await _served_by(gw, NUM_REQUESTS)
            print(f"seed_weighted, b at pcie_util >= 0.9: {dict(served)} of {NUM_REQUESTS}")
            # W = free_kv * (1 - pcie_util) * ...: b weighs ~0.05 of a, so ~3 of 60
            assert served["b"] <= NUM_REQUESTS // 5, served
            node = (await _rows(gw))["b"]["node"]
            assert node["num_gpus"] == 1 and node["xid"] == 0 and node["ecc_dbe_errors"] == 0


async def test_xid_and_ecc_take_a_node_out_of_routing_until_clear() -> None:
    async with twins({}, {}) as servers:
        cfg = gateway_config(_backends(servers), policy={"name": "round_robin"})
        async with running_gateway(cfg) as gw:
            for fault in ({"xid": 79}, {"ecc_dbe_errors": 2}):
                await post_faults(servers[1].url, fault)

                async def out() -> bool:
                    row = (await _rows(gw))["b"]
                    return "node" in row["unhealthy_reasons"] and not row["routable"]

                await _until(out)
                assert (await _rows(gw))["b"]["node_problems"]
                assert await _served_by(gw, 10) == Counter({"a": 10})
                await post_faults(servers[1].url, {})

                async def back() -> bool:
                    return bool((await _rows(gw))["b"]["routable"])

                await _until(back)
                assert (await _served_by(gw, 10))["b"] == 5
