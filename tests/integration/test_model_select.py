"""The model from a header or a verified JWT claim (SPEC S1.1, issue 17), through a
real gateway in front of a fake backend that records what it was sent."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from typing import Any

import aiohttp
import orjson
import pytest
from test_gateway_fakes import FakeBackend, fake_backends, gateway_config, running_gateway

from kiloserve.errors import ConfigError
from kiloserve.gateway.admission.auth import hash_key

SECRET = "s3cret-for-tests"
SECRET_ENV = "KILOSERVE_TEST_JWT_SECRET"
MODEL_FROM = {"header": "x-kiloserve-model", "jwt_claim": "model", "jwt_secret_env": SECRET_ENV}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def make_jwt(claims: dict[str, Any], secret: str = SECRET, alg: str = "HS256") -> str:
    head = _b64(orjson.dumps({"alg": alg, "typ": "JWT"}))
    body = _b64(orjson.dumps(claims))
    digest = {"HS256": hashlib.sha256, "HS512": hashlib.sha512}.get(alg, hashlib.sha256)
    sig = hmac.new(secret.encode(), f"{head}.{body}".encode(), digest).digest()
    return f"{head}.{body}.{_b64(sig)}"


async def _post(
    gw: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw + "/v1/completions", json=body, headers=headers) as r,
    ):
        return r.status, await r.json()


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)


async def test_header_overrides_and_fills_the_body_model() -> None:
    fake = FakeBackend(models=["a", "b"])
    async with fake_backends(fake):
        cfg = gateway_config([{"url": fake.url}], model_from={"header": "x-kiloserve-model"})
        async with running_gateway(cfg) as gw:
            hdr = {"x-kiloserve-model": "b"}
            assert (await _post(gw, {"model": "a", "prompt": "hi"}, hdr))[0] == 200
            assert (await _post(gw, {"prompt": "hi"}, hdr))[0] == 200  # no body model
            assert (await _post(gw, {"model": "a", "prompt": "hi"}, {}))[0] == 200
            status, err = await _post(gw, {"prompt": "hi"}, {"x-kiloserve-model": "zzz"})
    assert [b["model"] for b in fake.bodies] == ["b", "b", "a"]
    assert status == 404 and err["error"]["code"] == "model_not_found"


async def test_without_model_from_the_header_is_ignored() -> None:
    fake = FakeBackend(models=["a", "b"])
    async with fake_backends(fake), running_gateway(gateway_config([{"url": fake.url}])) as gw:
        hdr = {"x-kiloserve-model": "b"}
        assert (await _post(gw, {"model": "a", "prompt": "hi"}, hdr))[0] == 200
        status, err = await _post(gw, {"prompt": "hi"}, hdr)
    assert [b["model"] for b in fake.bodies] == ["a"]
    assert status == 400 and err["error"]["param"] == "model"


async def test_verified_jwt_claim_wins_over_header_and_body() -> None:
    fake = FakeBackend(models=["a", "b", "c"])
    async with fake_backends(fake):
        cfg = gateway_config([{"url": fake.url}], model_from=MODEL_FROM)
        async with running_gateway(cfg) as gw:
            token = make_jwt({"sub": "u1", "model": "c", "exp": time.time() + 60})
            hdr = {"Authorization": f"Bearer {token}", "x-kiloserve-model": "b"}
            assert (await _post(gw, {"model": "a", "prompt": "hi"}, hdr))[0] == 200
            no_claim = make_jwt({"sub": "u1"})  # verified, without the claim: the header
            hdr = {"Authorization": f"Bearer {no_claim}", "x-kiloserve-model": "b"}
            assert (await _post(gw, {"model": "a", "prompt": "hi"}, hdr))[0] == 200
    assert [b["model"] for b in fake.bodies] == ["c", "b"]


@pytest.mark.parametrize(
    "token",
    [
        make_jwt({"model": "c"}, secret="wrong"),
        make_jwt({"model": "c", "exp": time.time() - 3600}),
        make_jwt({"model": "c", "nbf": time.time() + 3600}),
        make_jwt({"model": "c"}, alg="HS512"),  # an algorithm the config did not allow
        make_jwt({"model": "c"}).rsplit(".", 1)[0] + "." + _b64(b"\x00" * 32),
        _b64(b'{"alg":"none"}') + "." + _b64(b'{"model":"c"}') + ".",
    ],
    ids=["bad-signature", "expired", "not-yet-valid", "alg-not-allowed", "zero-sig", "alg-none"],
)
async def test_an_unverified_claim_is_refused(token: str) -> None:
    fake = FakeBackend(models=["a", "c"])
    async with fake_backends(fake):
        cfg = gateway_config([{"url": fake.url}], model_from=MODEL_FROM)
        async with running_gateway(cfg) as gw:
            hdr = {"Authorization": f"Bearer {token}"}
            status, err = await _post(gw, {"model": "a", "prompt": "hi"}, hdr)
    assert status == 401
    assert err["error"]["code"] == "invalid_token"
    assert fake.bodies == []


async def test_override_body_false_only_fills_a_missing_model() -> None:
    fake = FakeBackend(models=["a", "b"])
    async with fake_backends(fake):
        model_from = {"header": "x-kiloserve-model", "override_body": False}
        cfg = gateway_config([{"url": fake.url}], model_from=model_from)
        async with running_gateway(cfg) as gw:
            hdr = {"x-kiloserve-model": "b"}
            assert (await _post(gw, {"model": "a", "prompt": "hi"}, hdr))[0] == 200
            assert (await _post(gw, {"prompt": "hi"}, hdr))[0] == 200
    assert [b["model"] for b in fake.bodies] == ["a", "b"]


async def test_an_api_keys_allowed_models_apply_to_the_header_model() -> None:
    fake = FakeBackend(models=["a", "b"])
    keys = [{"name": "k", "key_sha256": hash_key("sk-k"), "allowed_models": ["a"]}]
    async with fake_backends(fake):
        cfg = gateway_config(
            [{"url": fake.url}], auth={"keys": keys}, model_from={"header": "x-kiloserve-model"}
        )
        async with running_gateway(cfg) as gw:
            hdr = {"Authorization": "Bearer sk-k", "x-kiloserve-model": "b"}
            status, err = await _post(gw, {"model": "a", "prompt": "hi"}, hdr)
    assert status == 403 and err["error"]["code"] == "model_not_allowed"
    assert fake.bodies == []


def test_a_claim_without_its_secret_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiloserve.gateway.app import create_gateway_app

    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ConfigError, match=SECRET_ENV):
        create_gateway_app(gateway_config([{"url": "http://127.0.0.1:9"}], model_from=MODEL_FROM))
    with pytest.raises(ConfigError, match="jwt_secret_env"):
        gateway_config([{"url": "http://127.0.0.1:9"}], model_from={"jwt_claim": "model"})
