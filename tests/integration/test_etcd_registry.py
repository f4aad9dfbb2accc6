"""The etcd registry end to end: a real etcd, real ``kiloserve agent`` processes, twins and
two in-process gateways that follow the prefix (register, watch, lease expiry, outage)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from etcd_fixture import EtcdProcess
from test_gateway_fakes import gateway_config, running_gateway
from test_gateway_twins import MODEL, twins


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    proc = EtcdProcess(tmp_path / "etcd-data")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def agent(etcd: EtcdProcess, engine_url: str, name: str) -> Iterator[subprocess.Popen[bytes]]:
    argv = [
        sys.executable, "-m", "kiloserve", "agent", "--engine-url", engine_url,
        "--etcd", etcd.endpoint, "--name", name, "--model", MODEL,
        "--ttl", "2", "--interval", "0.3", "--no-nvml",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@contextlib.asynccontextmanager
async def etcd_gateway(etcd: EtcdProcess) -> AsyncIterator[str]:
    registry = {"kind": "etcd", "etcd": [etcd.endpoint], "retry_interval_s": 0.2}
    cfg = gateway_config([], registry=registry, health={"enabled": False})
    async with running_gateway(cfg, wait_ready=False) as url:
        yield url


async def _names(gw: str) -> set[str]:
    async with aiohttp.ClientSession() as s, s.get(gw + "/admin/backends") as r:
        return {row["name"] for row in (await r.json())["backends"]}


async def _metric(gw: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(gw + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


async def _until(check: Callable[[], Any], timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await check():
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s} s")


async def _complete(gw: str) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": "registered", "max_tokens": 3}
    async with aiohttp.ClientSession() as s, s.post(gw + "/v1/completions", json=body) as r:
        await r.read()
        return r.status, r.headers.get("x-kiloserve-backend", "")


async def test_register_watch_expire_and_deregister(etcd: EtcdProcess) -> None:
    async with twins({}, {}) as servers, etcd_gateway(etcd) as gw1, etcd_gateway(etcd) as gw2:
        with agent(etcd, servers[0].url, "a0"), agent(etcd, servers[1].url, "a1") as a1:

            async def both_see_two() -> bool:
                return await _names(gw1) == {"a0", "a1"} == await _names(gw2)

            await _until(both_see_two, 10.0)  # two gateways, one pool
            await _until(lambda: _ok(gw1), 5.0)
            a1.send_signal(signal.SIGTERM)  # clean exit revokes the lease at once
            a1.wait(5.0)
            took_s = await _until(lambda: _only(gw1, {"a0"}), 3.0)
            assert took_s < 1.0
            assert await _complete(gw1) == (200, "a0")
        # the with-block killed agent a0 (SIGKILL): its lease (2 s) runs out
        took_s = await _until(lambda: _only(gw2, set()), 6.0)
        assert took_s <= 3.5


async def _ok(gw: str) -> bool:
    return (await _complete(gw))[0] == 200


async def _only(gw: str, names: set[str]) -> bool:
    return await _names(gw) == names


async def _faults(url: str, body: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + "/admin/faults", json=body) as r:
        assert r.status == 200


async def test_agent_deregisters_an_unhealthy_engine(etcd: EtcdProcess) -> None:
    async with twins({}) as servers, etcd_gateway(etcd) as gw:
        with agent(etcd, servers[0].url, "a0"):
            await _until(lambda: _only(gw, {"a0"}), 10.0)
            await _faults(servers[0].url, {"hang": True})
            await _until(lambda: _only(gw, set()), 5.0)
            await _faults(servers[0].url, {})
            await _until(lambda: _only(gw, {"a0"}), 5.0)


async def test_etcd_outage_keeps_the_last_known_set(etcd: EtcdProcess) -> None:
    async with twins({}) as servers, etcd_gateway(etcd) as gw:
        with agent(etcd, servers[0].url, "a0"):
            await _until(lambda: _only(gw, {"a0"}), 10.0)
            assert await _metric(gw, "kiloserve_gateway_registry_up") == 1.0
            etcd.stop()

            async def down() -> bool:
                return await _metric(gw, "kiloserve_gateway_registry_up") == 0.0

            await _until(down, 5.0)
            assert await _names(gw) == {"a0"}
            assert await _complete(gw) == (200, "a0")
            assert await _metric(gw, "kiloserve_gateway_registry_errors_total") >= 1
            etcd.start()

            async def up() -> bool:
                return await _metric(gw, "kiloserve_gateway_registry_up") == 1.0

            await _until(up, 10.0)
            await _until(lambda: _only(gw, {"a0"}), 5.0)
