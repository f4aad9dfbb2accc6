"""Node health end to end with a real etcd (S3.3, S3.4): a twin's Xid burst on its
``/node/metrics`` -> the ``kiloserve agent`` reading that page (``--dcgm-url``) marks
the backend draining in etcd -> the gateway's etcd watch -> no new requests to it;
the fault cleared, the agent undrains and traffic comes back."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator

import aiohttp
from etcd_fixture import EtcdProcess
from test_etcd_registry import _names, _until, etcd, etcd_gateway
from test_gateway_fakes import post_faults
from test_gateway_twins import MODEL, twins

__all__ = ["etcd"]  # the fixture, re-used


@contextlib.contextmanager
def dcgm_agent(etcd: EtcdProcess, engine_url: str, name: str) -> Iterator[None]:
    argv = [
        sys.executable, "-m", "kiloserve", "agent", "--engine-url", engine_url,
        "--etcd", etcd.endpoint, "--name", name, "--model", MODEL, "--ttl", "2",
        "--interval", "0.3", "--dcgm-url", engine_url + "/node/metrics",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


async def _row(gw: str, name: str) -> dict[str, object]:
    async with aiohttp.ClientSession() as s, s.get(gw + "/admin/backends") as r:
        rows = {row["name"]: row for row in (await r.json())["backends"]}
    return dict(rows[name])


async def _served(gw: str, num: int) -> Counter[str]:
    served: Counter[str] = Counter()
    body = {"model": MODEL, "prompt": "node health", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        for _ in range(num):
            async with s.post(gw + "/v1/completions", json=body) as r:
                await r.read()
                assert r.status == 200
                served[r.headers["x-kiloserve-backend"]] += 1
    return served


async def test_xid_burst_drains_through_agent_etcd_and_gateway(etcd: EtcdProcess) -> None:
    async with twins({}, {}) as servers, etcd_gateway(etcd) as gw:
        with dcgm_agent(etcd, servers[0].url, "a0"), dcgm_agent(etcd, servers[1].url, "a1"):

            async def both() -> bool:
                return await _names(gw) == {"a0", "a1"}

            await _until(both, 10.0)
            await _until(lambda: _routable(gw, "a1", True), 5.0)
            await _until(lambda: _has_node_page(gw, "a1"), 5.0)  # the advertised page is read
            await post_faults(servers[1].url, {"xid": 79})
            took_s = await _until(lambda: _draining(gw, "a1", True), 5.0)
            print(f"xid 79 -> draining at the gateway in {took_s:.2f} s")
            assert await _served(gw, 10) == Counter({"a0": 10})
            await post_faults(servers[1].url, {})
            await _until(lambda: _draining(gw, "a1", False), 5.0)
            await _until(lambda: _routable(gw, "a1", True), 5.0)
            assert (await _served(gw, 20))["a1"] > 0


async def _has_node_page(gw: str, name: str) -> bool:
    return (await _row(gw, name))["node"] is not None


async def _draining(gw: str, name: str, value: bool) -> bool:
    return (await _row(gw, name))["draining"] is value


async def _routable(gw: str, name: str, value: bool) -> bool:
    return (await _row(gw, name))["routable"] is value
