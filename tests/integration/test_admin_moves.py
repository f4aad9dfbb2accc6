"""Drain / undrain through the admin API as idempotent state moves (issue 17, S3.5):
an optional ``move_id`` (UUID) and ``expected_version`` in the JSON body."""

from __future__ import annotations

from typing import Any

import aiohttp
from test_gateway_fakes import FakeBackend, fake_backends, gateway_config, running_gateway

from kiloserve.gateway.registry.moves import new_move_id


async def _post(s: aiohttp.ClientSession, url: str, body: Any = None) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json()


async def test_drain_moves_apply_once_and_refuse_stale_versions() -> None:
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url, "name": "b0"}], health={"enabled": False})
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            drain, undrain = gw + "/admin/backends/b0/drain", gw + "/admin/backends/b0/undrain"
            move = {"move_id": new_move_id(), "expected_version": 0}
            status, body = await _post(s, drain, move)
            assert status == 200 and body == {
                "name": "b0", "draining": True, "applied": True, "version": 1,
            }  # fmt: skip
            # the same move again (a client retry): a no-op, same version
            status, body = await _post(s, drain, move)
            assert status == 200 and (body["applied"], body["version"]) == (False, 1)
            # a move made on what version 0 looked like: refused, nothing changes
            stale = {"move_id": new_move_id(), "expected_version": 0}
            status, body = await _post(s, undrain, stale)
            assert status == 409, body
            assert body["error"]["type"] == "conflict_error"
            assert body["error"]["code"] == "stale_version"
            assert "expected version 0, it is at version 1" in body["error"]["message"]
            async with s.get(gw + "/admin/backends") as r:
                row = (await r.json())["backends"][0]
            assert row["draining"] and row["move_version"] == 1
            status, body = await _post(s, undrain, {**stale, "expected_version": 1})
            assert status == 200 and (body["draining"], body["version"]) == (False, 2)
            # no body at all: applied as before (version still counts)
            status, body = await _post(s, drain)
            assert status == 200 and body["version"] == 3
            for bad, param in (({"move_id": "x"}, "move_id"), ({"expected_version": -1},
                               "expected_version")):  # fmt: skip
                status, body = await _post(s, drain, bad)
                assert status == 400 and body["error"]["param"] == param
