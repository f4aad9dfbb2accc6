"""``GET /ready`` of a gateway with several workers: the kernel hands each new
connection to any worker, so the gateway is ready when every worker that listens is,
not when the one a probe reached is (a Kubernetes readiness probe, ``kiloserve up``,
the chaos drills: before, a worker still without backends took requests and answered
503; seen as 2,443 failed requests in the etcd-down drill with two workers)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from test_gateway_fakes import FakeBackend, fake_backends, gateway_config, wait_until_ready

from kiloserve.gateway.app import WORKER_METRICS_KEY, create_gateway_app
from kiloserve.gateway.worker_metrics import WorkerMetrics
from local_app import serve_app


class Sibling:
    """A sibling worker's private port: ``/ready?local=1`` answers as ``ready`` says."""

    def __init__(self) -> None:
        self.ready = False
        self.asked: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.asked.append(request.query_string)
        return web.json_response({"ready": self.ready}, status=200 if self.ready else 503)


@pytest.fixture
async def worker0() -> AsyncIterator[tuple[str, Sibling, list[tuple[int, int]]]]:
    """Worker 0's app (one fake backend) of three workers: one sibling that listens
    and one whose port refuses connections (a dead worker: no listener, so no requests
    either)."""
    sibling = Sibling()
    sib_app = web.Application()
    sib_app.router.add_get("/ready", sibling.handle)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
    ports: list[tuple[int, int]] = []
    try:
        async with (
            fake_backends(FakeBackend()) as (fake,),
            serve_app(sib_app) as sib_url,
        ):
            ports += [(0, 1), (1, int(sib_url.rsplit(":", 1)[1])), (2, dead.getsockname()[1])]
            app = create_gateway_app(gateway_config([{"url": fake.url, "name": "b0"}]))
            app[WORKER_METRICS_KEY] = WorkerMetrics(0, lambda: ports, workers=3)
            async with serve_app(app) as url:
                yield url, sibling, ports
    finally:
        dead.close()


async def _ready(url: str) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as s, s.get(url + "/ready") as r:
        return r.status, await r.json()


async def test_ready_waits_for_every_listening_worker(
    worker0: tuple[str, Sibling, list[tuple[int, int]]],
) -> None:
    url, sibling, _ = worker0
    async with aiohttp.ClientSession() as s:
        for _ in range(250):  # worker 0's own table: its backend scraped and discovered
            async with s.get(url + "/ready?local=1") as r:
                if r.status == 200:
                    break
    assert r.status == 200
    assert await _ready(url) == (503, {"ready": False, "workers_not_ready": [1]})
    assert sibling.asked[-1] == "local=1"  # its own table, not another round of siblings
    sibling.ready = True
    await wait_until_ready(url)
    assert await _ready(url) == (200, {"ready": True})


async def test_a_worker_that_has_not_started_is_not_ready(
    worker0: tuple[str, Sibling, list[tuple[int, int]]],
) -> None:
    """Worker 1 still starting (no port published yet): it listens soon, with whatever
    backends it has then (none, if the registry went down meanwhile)."""
    url, sibling, ports = worker0
    sibling.ready = True
    await wait_until_ready(url)
    ports.remove(ports[1])
    assert await _ready(url) == (503, {"ready": False, "workers_not_ready": [1]})
    metrics = WorkerMetrics(0, lambda: ports)  # no count of workers: those published
    assert await metrics.not_ready() == []


async def test_a_sibling_that_does_not_answer_in_time_is_not_ready() -> None:
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(1)  # accepts into the backlog, never answers
    try:
        metrics = WorkerMetrics(0, lambda: [(0, 1), (3, hung.getsockname()[1])])
        assert await metrics.not_ready(timeout_s=0.2) == [3]
    finally:
        hung.close()
