"""``--workers N`` with the etcd registry: a worker that replaces a dead one while etcd is
down starts from its siblings' registry view (``SharedLoad.registry_doc``), so it routes
to the backends they know instead of answering 503 for its share of the connections."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from etcd_fixture import EtcdProcess
from test_gateway_fakes import FakeBackend, fake_backends, gateway_process

from kiloserve.gateway.config import BackendConfig
from kiloserve.gateway.registry.etcd import EtcdClient
from kiloserve.gateway.registry.record import RegistryRecord, encode_record
from kiloserve.gateway.registry.settings import RegistryConfig
from worker_urls import children, worker_urls

pytestmark = pytest.mark.slow


async def _status(url: str) -> int:
    connector = aiohttp.TCPConnector(force_close=True)  # a fresh connection: any worker
    body = {"model": "m", "prompt": "x"}
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.post(url + "/v1/completions", json=body) as r,
    ):
        await r.read()
        return r.status


async def _ready(url: str) -> bool:
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s, s.get(url + "/ready") as r:
        return r.status == 200


async def _until(check: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert callable(check)
        if await check():
            return
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.1)


async def test_a_worker_started_while_etcd_is_down_routes_to_the_known_backends(
    tmp_path: Path,
) -> None:
    etcd = EtcdProcess(tmp_path / "etcd-data")
    etcd.start()
    try:
        fakes = [FakeBackend(), FakeBackend()]
        async with fake_backends(*fakes):
            prefix = RegistryConfig().prefix
            async with aiohttp.ClientSession() as s:  # records without a lease: they stay
                client = EtcdClient([etcd.endpoint], s, 2.0)
                for i, f in enumerate(fakes):
                    backend = BackendConfig(url=f.url, name=f"b{i}", models=["m"])
                    await client.put(prefix + f"b{i}", encode_record(RegistryRecord(backend)))
            config = tmp_path / "gateway.yaml"
            registry = {"kind": "etcd", "etcd": [etcd.endpoint], "retry_interval_s": 0.2}
            config.write_text(yaml.safe_dump({"backends": [], "registry": registry}))
            async with gateway_process("-c", str(config), "--workers", "2") as (line, proc):
                url = line.split(" listening on ", 1)[1].split()[0]

                async def serving() -> bool:
                    if not await _ready(url):
                        return False
                    return [await _status(url) for _ in range(8)] == [200] * 8

                await _until(serving, "the gateway serves")
                etcd.stop()  # the registry is down from here on
                workers = children(proc.pid)
                assert len(workers) == 2
                os.kill(workers[0], signal.SIGKILL)

                async def replaced() -> bool:
                    kids = children(proc.pid)
                    if len(kids) != 2 or workers[0] in kids:
                        return False
                    try:
                        worker_urls(url, proc.pid)
                    except ValueError:  # the new worker has no private port yet
                        return False
                    return await _ready(url)

                # before: never (the new worker knew no backend, so /ready answered 503 for the
                # whole outage and took the gateway out of its load balancer)
                await _until(replaced, "the new worker is ready")
                # every worker routes, asked on its own port (before: the new worker knew
                # no backend and answered 503 for its share of the connections)
                for worker_url in worker_urls(url, proc.pid):
                    statuses = [await _status(worker_url) for _ in range(4)]
                    assert statuses == [200] * 4, (worker_url, statuses)
                proc.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        etcd.stop()
