"""``kiloserve doctor`` reading the counters of a gateway with ``--workers N``: a merged
``/metrics`` page that lacks a sibling's counters is read again (doctor/probe.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from kiloserve.doctor.probe import collect
from local_app import serve_app

PAGE = (
    "# TYPE kiloserve_gateway_requests_total counter\n"
    'kiloserve_gateway_requests_total{backend="a0",status="200"} %d\n'
    'kiloserve_gateway_requests_total{backend="a0",status="500"} %d\n'
    "# TYPE kiloserve_gateway_worker_pages_missing gauge\n"
    "kiloserve_gateway_worker_pages_missing %d\n"
)
# the first read (whole), then a page short of one sibling's counters, then whole again
PAGES = [PAGE % (10, 0, 0), PAGE % (12, 0, 1), PAGE % (14, 6, 0)]


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[str, list[str]]]:
    pages = list(PAGES)
    served: list[str] = []

    async def metrics(_req: web.Request) -> web.Response:
        served.append(pages.pop(0) if len(pages) > 1 else pages[0])
        return web.Response(text=served[-1])

    async def backends(_req: web.Request) -> web.Response:
        # the backend's URL answers nothing: the doctor reads the gateway's side only
        return web.json_response({"backends": [{"name": "a0", "url": "http://127.0.0.1:9"}]})

    async def health(_req: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def config(_req: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/admin/backends", backends)
    app.router.add_get("/admin/config", config)
    app.router.add_get("/metrics", metrics)
    async with serve_app(app) as url:
        yield url, served


async def test_a_page_short_of_a_worker_is_read_again(gateway: tuple[str, list[str]]) -> None:
    url, served = gateway
    got = await collect(url, window_s=0.05, timeout_s=1.0)
    (facts,) = got.snapshot.backends
    assert len(served) == 3  # the short page was read again
    assert (facts.attempts, facts.errors) == (10, 6)
