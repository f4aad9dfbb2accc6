"""``kiloserve gateway --workers 2`` and LoRA adapters: the workers load an adapter once.

Real processes (the supervisor and two workers on one port) in front of two fake vLLMs
that serve a base model, load adapters on ``POST /v1/load_lora_adapter`` (slowly, so
both workers miss the adapter while the first load runs) and count the loads. Requests
for a configured adapter reach both workers at once, through each one's private port.
Before the shared placement (gateway/lora_shared.py) each worker loaded the adapter
itself; now one worker loads it and the other waits for that load and routes there.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from test_gateway_fakes import FakeBackend, fake_backends
from test_gateway_workers_shared import _private_urls, _workers

from kiloserve.gateway.headers import BACKEND_HEADER

pytestmark = pytest.mark.slow

BASE = "base"
LOAD_S = 0.5  # a load takes this long: both workers miss the adapter meanwhile


@dataclass
class LoraFake(FakeBackend):
    """A ``FakeBackend`` serving a base model, with vLLM's runtime LoRA loading."""

    models: list[str] = field(default_factory=lambda: [BASE])
    held: set[str] = field(default_factory=set)
    loads: list[str] = field(default_factory=list)

    async def _models(self, request: web.Request) -> web.Response:
        cards = [{"id": BASE, "object": "model", "root": BASE, "parent": None}]
        cards += [
            {"id": a, "object": "model", "root": f"/a/{a}", "parent": BASE} for a in self.held
        ]
        return web.json_response({"object": "list", "data": cards})

    async def _load(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        self.loads.append(name)
        await asyncio.sleep(LOAD_S)
        if name in self.held:
            return web.json_response({"error": "already loaded"}, status=400)
        self.held.add(name)
        return web.Response(text="ok")

    async def _unload(self, request: web.Request) -> web.Response:
        self.held.discard((await request.json())["lora_name"])
        return web.Response(text="ok")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        model = (await request.json())["model"]
        if model != BASE and model not in self.held:
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        return await super()._generate(request)

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post("/v1/load_lora_adapter", self._load)
        app.router.add_post("/v1/unload_lora_adapter", self._unload)
        return app


async def _complete(url: str, model: str) -> tuple[int, str]:
    body = {"model": model, "prompt": "hello", "max_tokens": 2}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status, r.headers.get(BACKEND_HEADER, "")


async def test_two_workers_missing_one_adapter_load_it_once(tmp_path: Path) -> None:
    fakes = [LoraFake(), LoraFake()]
    async with fake_backends(*fakes):
        conf = tmp_path / "gw.yaml"
        conf.write_text(
            "health: {enabled: false}\n"
            "discovery_interval_s: 30\n"  # a sibling's load is not learnt by discovery here
            "lora: {adapters: {ad1: {path: /a/ad1, base_model: base}}}\n"
            "backends:\n"
            + "".join(f"  - {{name: f{i}, url: {f.url}}}\n" for i, f in enumerate(fakes))
        )
        async with _workers("-c", str(conf)) as (url, proc):
            a, b = await _private_urls(url, proc.pid)
            for worker in (a, b):  # both know the base model (discovered at start)
                assert (await _complete(worker, BASE))[0] == 200
            answers = await asyncio.gather(*(_complete(w, "ad1") for w in (a, b, a, b)))
            assert {status for status, _ in answers} == {200}, answers
            assert sum(len(f.loads) for f in fakes) == 1, [f.loads for f in fakes]
            (holder,) = [f"f{i}" for i, f in enumerate(fakes) if "ad1" in f.held]
            assert {backend for _, backend in answers} == {holder}
            # later requests to either worker go there without another load
            for worker in (a, b):
                assert await _complete(worker, "ad1") == (200, holder)
            assert sum(len(f.loads) for f in fakes) == 1
