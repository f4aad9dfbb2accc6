"""Cross-site requests (issue 15, finding 5): DNS rebinding and CSRF against the gateway's
admin API and dashboard and the engine twin's ``/admin/faults``; the ``/metrics`` token;
the warning for an open non-loopback gateway. Real servers on 127.0.0.1."""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from test_gateway_fakes import FakeBackend, fake_backends, gateway_config, running_gateway

from kiloserve.engine.cli import add_arguments, admin_token_from_args
from kiloserve.engine.server import TwinServer, create_app
from kiloserve.engine.twin import TwinConfig
from kiloserve.gateway.app import create_gateway_app
from kiloserve.gateway.config import parse_gateway_config

JSON = {"Content-Type": "application/json"}
EVIL = "http://evil.example"


async def _call(
    s: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    headers: dict[str, str] | None = None,
    data: bytes | None = None,
    skip: tuple[str, ...] = (),
) -> tuple[int, Any]:
    async with s.request(method, url, headers=headers, data=data, skip_auto_headers=skip) as r:
        if r.content_type == "application/json":
            return r.status, await r.json()
        return r.status, await r.text()


def _code(body: Any) -> tuple[str, str]:
    return body["error"]["type"], body["error"]["code"]


@pytest.fixture
async def gateway() -> AsyncIterator[str]:
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url, "name": "b0"}])
        async with running_gateway(cfg) as url:
            yield url


async def _is_draining(s: aiohttp.ClientSession, url: str) -> bool:
    status, body = await _call(s, "GET", url + "/admin/backends")
    assert status == 200
    return bool(body["backends"][0]["draining"])


async def test_admin_writes_must_be_json(gateway: str) -> None:
    drain = gateway + "/admin/backends/b0/drain"
    async with aiohttp.ClientSession() as s:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
            status, body = await _call(s, "POST", drain, headers={"Content-Type": ctype}, data=b"x")
            assert status == 400 and _code(body) == ("invalid_request_error", "json_required")
        # an empty text/plain POST (fetch(url, {method: "POST", body: ""})) is refused too
        status, body = await _call(s, "POST", drain, headers={"Content-Type": "text/plain"})
        assert status == 400 and _code(body) == ("invalid_request_error", "json_required")
        # a body without any Content-Type (a fetch() of a Blob) is refused too
        status, body = await _call(s, "POST", drain, data=b"{}", skip=("Content-Type",))
        assert status == 400 and _code(body) == ("invalid_request_error", "json_required")
        assert not await _is_draining(s, gateway)
        # JSON works, and so does a bare POST with no body at all (curl -XPOST; aiohttp
        # sends application/octet-stream, which a page cannot send without a preflight)
        status, body = await _call(s, "POST", drain, headers=JSON, data=b"{}")
        assert status == 200 and body["draining"] is True
        undrain = gateway + "/admin/backends/b0/undrain"
        status, _ = await _call(s, "POST", undrain)
        assert status == 200 and not await _is_draining(s, gateway)


async def test_admin_refuses_foreign_host_names(gateway: str) -> None:
    async with aiohttp.ClientSession() as s:
        for host in ("evil.example", "attacker.example:8000", "a b", "127.0.0.1@evil"):
            headers = {"Host": host, **JSON}
            status, body = await _call(s, "POST", gateway + "/admin/backends/b0/drain",
                                       headers=headers, data=b"{}")  # fmt: skip
            assert status == 403 and _code(body) == ("permission_error", "host_not_allowed")
            status, body = await _call(s, "GET", gateway + "/admin/config", headers={"Host": host})
            assert status == 403 and _code(body) == ("permission_error", "host_not_allowed")
        assert not await _is_draining(s, gateway)
        port = gateway.rsplit(":", 1)[1]
        for host in (f"localhost:{port}", "localhost", f"127.0.0.1:{port}", "[::1]:9", "10.1.2.3"):
            status, _ = await _call(s, "GET", gateway + "/admin/config", headers={"Host": host})
            assert status == 200, host


async def test_admin_refuses_cross_origin_and_cross_site(gateway: str) -> None:
    drain = gateway + "/admin/backends/b0/drain"
    async with aiohttp.ClientSession() as s:
        status, body = await _call(s, "GET", gateway + "/admin/config", headers={"Origin": EVIL})
        assert status == 403 and _code(body) == ("permission_error", "cross_origin")
        for origin in (EVIL, "null", gateway.replace("127.0.0.1", "localhost"), gateway + "1"):
            headers = {"Origin": origin, **JSON}
            status, body = await _call(s, "POST", drain, headers=headers, data=b"{}")
            assert status == 403 and _code(body) == ("permission_error", "cross_origin"), origin
        cross = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", **JSON}
        status, body = await _call(s, "POST", drain, headers=cross, data=b"{}")
        assert status == 403 and _code(body) == ("permission_error", "cross_site")
        assert not await _is_draining(s, gateway)
        # the page's own origin works
        same = {"Origin": gateway, "Sec-Fetch-Site": "same-origin", **JSON}
        status, body = await _call(s, "POST", drain, headers=same, data=b"{}")
        assert status == 200 and body["draining"] is True


async def test_allowed_hosts_let_a_named_gateway_in() -> None:
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config(
            [{"url": fake.url, "name": "b0"}],
            admin_allowed_hosts=["gw.example", "ops.example:443"],
        )
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            headers = {"Host": "GW.example:8000", "Origin": "http://gw.example:8000", **JSON}
            status, _ = await _call(s, "POST", url + "/admin/backends/b0/drain",
                                    headers=headers, data=b"{}")  # fmt: skip
            assert status == 200
            # a TLS proxy at https://ops.example that forwards with Host 127.0.0.1:port
            status, _ = await _call(s, "GET", url + "/admin/config",
                                    headers={"Origin": "https://ops.example"})  # fmt: skip
            assert status == 200
            status, _ = await _call(s, "GET", url + "/admin/config",
                                    headers={"Origin": "https://ops.example:8443"})  # fmt: skip
            assert status == 403
            status, body = await _call(
                s, "GET", url + "/admin/config", headers={"Host": "x.example"}
            )
            assert status == 403 and "admin_allowed_hosts" in body["error"]["message"]


async def test_dashboard_refuses_foreign_hosts_and_origins(gateway: str) -> None:
    async with aiohttp.ClientSession() as s:
        for path in ("/dashboard", "/dashboard/state", "/dashboard/static/dashboard.js"):
            status, body = await _call(s, "GET", gateway + path, headers={"Host": "evil.example"})
            assert status == 403 and _code(body) == ("permission_error", "host_not_allowed")
        status, body = await _call(s, "GET", gateway + "/dashboard/state", headers={"Origin": EVIL})
        assert status == 403 and _code(body) == ("permission_error", "cross_origin")
        script = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors",
                  "Sec-Fetch-Dest": "script"}  # fmt: skip
        status, _ = await _call(
            s, "GET", gateway + "/dashboard/static/dashboard.js", headers=script
        )
        assert status == 403
        # following a link to the page from another site is fine
        link = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate",
                "Sec-Fetch-Dest": "document"}  # fmt: skip
        status, _ = await _call(s, "GET", gateway + "/dashboard", headers=link)
        assert status == 200


async def test_api_and_probes_take_any_host(gateway: str) -> None:
    evil = {"Host": "evil.example", "Origin": EVIL, "Sec-Fetch-Site": "cross-site"}
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/models", "/health", "/ready", "/metrics"):
            status, _ = await _call(s, "GET", gateway + path, headers=evil)
            assert status == 200, path


async def test_metrics_token() -> None:
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url, "name": "b0"}], metrics_token="m3trics")
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            status, body = await _call(s, "GET", url + "/metrics")
            assert status == 401 and _code(body)[0] == "authentication_error"
            bad = {"Authorization": "Bearer nope"}
            assert (await _call(s, "GET", url + "/metrics", headers=bad))[0] == 401
            good = {"Authorization": "Bearer m3trics", "Host": "prometheus-target.example"}
            status, text = await _call(s, "GET", url + "/metrics", headers=good)
            assert status == 200 and "kiloserve_gateway_requests_total" in text
            assert (await _call(s, "GET", url + "/v1/models"))[0] == 200
            status, config = await _call(s, "GET", url + "/admin/config")
            assert status == 200 and config["metrics_token"] == "***"
            assert "m3trics" not in str(config)


def _open_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "no API keys" in r.getMessage()
    ]


@pytest.mark.parametrize(
    ("extra", "warned"),
    [
        ({"host": "0.0.0.0"}, True),
        ({"host": "10.0.0.5"}, True),
        ({"host": "127.0.0.1"}, False),
        ({"host": "localhost"}, False),
        ({"host": "0.0.0.0", "admin_token": "t"}, False),
        ({"host": "0.0.0.0", "auth": {"keys": [{"name": "a", "key_sha256": "0" * 64}]}}, False),
    ],
)
def test_warns_when_open_on_the_network(
    extra: dict[str, Any], warned: bool, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.delenv("KILOSERVE_ADMIN_TOKEN", raising=False)
    caplog.set_level(logging.WARNING)
    cfg = parse_gateway_config({"backends": [{"url": "http://127.0.0.1:9"}], **extra})
    create_gateway_app(cfg)
    assert len(_open_warnings(caplog)) == (1 if warned else 0), caplog.text


# -- the engine twin -----------------------------------------------------------------------


def _twin_config(host: str = "127.0.0.1") -> TwinConfig:
    return TwinConfig(gpu="H100-SXM", model="llama-3.1-8b", host=host, port=0, api_overhead_s=0.0)


async def test_twin_faults_refuse_non_json_and_foreign_pages() -> None:
    async with TwinServer(_twin_config()) as twin, aiohttp.ClientSession() as s:
        faults = twin.url + "/admin/faults"
        crash = b'{"crash": true}'
        for ctype in ("text/plain", "application/x-www-form-urlencoded"):
            status, body = await _call(s, "POST", faults, headers={"Content-Type": ctype},
                                       data=b'{"slowdown": 4.0}')  # fmt: skip
            assert status == 400 and body["error"]["code"] == "json_required"
        status, _ = await _call(s, "POST", faults, data=crash, skip=("Content-Type",))
        assert status == 400
        for headers in ({"Host": "evil.example:8000"}, {"Origin": EVIL},
                        {"Sec-Fetch-Site": "cross-site"}):  # fmt: skip
            status, body = await _call(s, "POST", faults, headers={**headers, **JSON}, data=crash)
            assert status == 403 and body["error"]["type"] == "permission_error", headers
        status, body = await _call(s, "GET", faults, headers={"Host": "evil.example"})
        assert status == 403
        assert twin.twin.faults.faults.slowdown == 1.0
        status, body = await _call(s, "POST", faults, headers=JSON, data=b'{"slowdown": 4.0}')
        assert (status, body) == (200, {"slowdown": 4.0})
        # the OpenAI API and the probes answer any Host (load balancers use names)
        status, _ = await _call(s, "GET", twin.url + "/v1/models", headers={"Host": "lb.example"})
        assert status == 200


async def test_twin_admin_token() -> None:
    async with TwinServer(_twin_config(), admin_token="tw1n") as twin, aiohttp.ClientSession() as s:
        faults = twin.url + "/admin/faults"
        body = b'{"slowdown": 2.0}'
        status, err = await _call(s, "POST", faults, headers=JSON, data=body)
        assert status == 401 and err["error"]["type"] == "authentication_error"
        bad = {"Authorization": "Bearer nope", **JSON}
        assert (await _call(s, "POST", faults, headers=bad, data=body))[0] == 401
        assert (await _call(s, "GET", faults))[0] == 401
        good = {"Authorization": "Bearer tw1n", **JSON}
        assert await _call(s, "POST", faults, headers=good, data=body) == (200, {"slowdown": 2.0})
        assert await _call(s, "GET", faults, headers=good) == (200, {"slowdown": 2.0})
        assert (await _call(s, "GET", twin.url + "/metrics"))[0] == 200


def test_twin_cli_admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--gpu", "H100", "--model", "llama-3.1-8b", "--port", "0"]
    monkeypatch.delenv("KILOSERVE_ADMIN_TOKEN", raising=False)
    assert admin_token_from_args(parser.parse_args(base)) is None
    assert admin_token_from_args(parser.parse_args([*base, "--admin-token", "a"])) == "a"
    monkeypatch.setenv("KILOSERVE_ADMIN_TOKEN", "from-env")
    assert admin_token_from_args(parser.parse_args(base)) == "from-env"
    assert admin_token_from_args(parser.parse_args([*base, "--admin-token", "a"])) == "a"


@pytest.mark.parametrize(("host", "token", "warned"),
                         [("0.0.0.0", None, True), ("0.0.0.0", "t", False),
                          ("127.0.0.1", None, False)])  # fmt: skip
def test_twin_warns_when_faults_are_open_on_the_network(
    host: str, token: str | None, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    create_app(_twin_config(host), admin_token=token)
    found = [r for r in caplog.records if "/admin/faults" in r.getMessage()]
    assert len(found) == (1 if warned else 0), caplog.text
