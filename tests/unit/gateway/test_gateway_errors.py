"""Through the real gateway app: one error type per status, whichever part refuses.

The admin API's 401 (admin token) and the front door's 401 (API key) carry the same
``type``, and so do the admin API's 404 (unknown backend) and the front door's 404
(unknown model). Every error answer has the OpenAI keys and an ``x-request-id``, and a
refused request is counted once in ``kiloserve_gateway_requests_total``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kiloserve.gateway.admission.auth import hash_key
from kiloserve.gateway.app import create_gateway_app
from kiloserve.gateway.config import parse_gateway_config

_ADMIN = "admin-secret"
_KEY = "sk-team-a"


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    cfg = parse_gateway_config(
        {
            "port": 0,
            "policy": {"name": "round_robin"},
            "admin_token": _ADMIN,
            "health": {"enabled": False},
            "scrape_interval_s": 60.0,
            # nothing listens there: no request in this test reaches a backend
            "backends": [{"name": "b0", "url": "http://127.0.0.1:9", "models": ["m", "x"]}],
            "auth": {
                "keys": [{"name": "a", "key_sha256": hash_key(_KEY), "allowed_models": ["m"]}]
            },
        }
    )
    async with TestClient(TestServer(create_gateway_app(cfg), host="127.0.0.1")) as c:
        yield c


async def _error(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status == status
    assert resp.headers["x-request-id"]
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    err: dict[str, Any] = body["error"]
    return err


async def test_admin_401_and_api_key_401_carry_the_same_type(
    client: TestClient[Any, Any],
) -> None:
    admin = await _error(await client.get("/admin/backends"), 401)
    wrong = {"Authorization": "Bearer not-the-token"}
    admin_wrong = await _error(await client.get("/admin/config", headers=wrong), 401)
    no_key = await _error(await client.post("/v1/completions", json={"model": "m"}), 401)
    bad_key = await _error(
        await client.post("/v1/completions", json={"model": "m"}, headers=wrong), 401
    )
    types = {e["type"] for e in (admin, admin_wrong, no_key, bad_key)}
    assert types == {"authentication_error"}
    assert bad_key["code"] == "invalid_api_key" and admin["code"] == 401


async def test_404_and_403_types_are_one_per_status(client: TestClient[Any, Any]) -> None:
    key = {"Authorization": f"Bearer {_KEY}", "x-request-id": "rid-1"}
    resp = await client.post("/v1/completions", json={"model": "nope"}, headers=key)
    model = await _error(resp, 404)
    assert resp.headers["x-request-id"] == "rid-1"  # the client's id comes back
    admin = {"Authorization": f"Bearer {_ADMIN}"}
    backend = await _error(await client.post("/admin/backends/nope/drain", headers=admin), 404)
    assert model["type"] == backend["type"] == "not_found_error"
    assert (model["code"], backend["code"]) == ("model_not_found", "backend_not_found")
    denied = await _error(
        await client.post("/v1/completions", json={"model": "x"}, headers=key), 403
    )
    assert denied["type"] == "permission_error" and denied["code"] == "model_not_allowed"


async def test_refused_requests_are_counted_once(client: TestClient[Any, Any]) -> None:
    await client.post("/v1/completions", json={"model": "m"})  # 401
    await client.get("/admin/backends")  # 401, admin: not a proxied request
    key = {"Authorization": f"Bearer {_KEY}"}
    await client.post("/v1/completions", data=b"{nope", headers=key)  # 400
    text = await (await client.get("/metrics")).text()
    lines = [ln for ln in text.splitlines() if ln.startswith("kiloserve_gateway_requests_total{")]
    assert sorted(lines) == [
        'kiloserve_gateway_requests_total{backend="",model="",status="400"} 1.0',
        'kiloserve_gateway_requests_total{backend="",model="",status="401"} 1.0',
    ]
