"""A LoRA load on a miss happens only for an API key allowed to use the adapter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from test_gateway_fakes import FakeBackend, fake_backends, gateway_config, running_gateway

from kiloserve.gateway.admission.auth import hash_key

BASE = "base"


@dataclass
class LoraFake(FakeBackend):
    """A fake backend that serves ``load_lora_adapter`` and records each call."""

    loads: list[dict[str, Any]] = field(default_factory=list)
    adapters: dict[str, str] = field(default_factory=dict)  # name -> path

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post("/v1/load_lora_adapter", self._load)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        data: list[dict[str, Any]] = [{"id": m, "object": "model"} for m in self.models]
        data += [{"id": n, "root": p, "parent": BASE} for n, p in self.adapters.items()]
        return web.json_response({"object": "list", "data": data})

    async def _load(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.loads.append(body)
        self.adapters[body["lora_name"]] = body["lora_path"]
        self.models.append(body["lora_name"])
        return web.Response(text="Success")


async def _post(url: str, key: str, model: str) -> tuple[int, dict[str, Any]]:
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/completions", json=body, headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None)


async def test_a_key_not_allowed_an_adapter_causes_no_load() -> None:
    keys = [
        {"name": "base-only", "key_sha256": hash_key("sk-base"), "allowed_models": [BASE]},
        {"name": "sql", "key_sha256": hash_key("sk-sql"), "allowed_models": [BASE, "sql"]},
    ]
    lora = {"adapters": {"sql": {"path": "/a/sql", "base_model": BASE}}}
    fake = LoraFake(models=[BASE])
    async with fake_backends(fake):
        cfg = gateway_config(
            [{"url": fake.url, "name": "b0"}],
            discovery_interval_s=0.1, auth={"keys": keys}, lora=lora,
        )  # fmt: skip
        async with running_gateway(cfg) as gw:
            status, err = await _post(gw, "sk-base", "sql")
            assert status == 403
            assert err["error"]["code"] == "model_not_allowed"
            assert err["error"]["type"] == "permission_error"
            assert fake.loads == [] and fake.bodies == []
            status, _ = await _post(gw, "sk-sql", "sql")  # allowed: loaded on the miss
            assert status == 200
            assert fake.loads == [{"lora_name": "sql", "lora_path": "/a/sql"}]
            assert [b["model"] for b in fake.bodies] == ["sql"]
            assert (await _post(gw, "sk-base", "sql"))[0] == 403  # held now: still refused
            assert len(fake.loads) == 1 and len(fake.bodies) == 1
