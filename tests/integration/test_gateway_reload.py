"""Hot reload of the gateway config (issue 17, S1.9): ``POST /admin/reload`` and SIGHUP.

Real servers on 127.0.0.1: fake backends, an in-process gateway app reloading from a
YAML file, and real ``kiloserve gateway -c FILE`` processes (one, and ``--workers 2``)
that get SIGHUP.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from test_gateway_fakes import FakeBackend, fake_backends, gateway_process, wait_until_ready

from kiloserve.gateway.app import create_gateway_app
from kiloserve.gateway.config import auto_workers, load_gateway_config
from kiloserve.gateway.reload import RELOAD_KEY

JSON = {"Content-Type": "application/json"}
BODY = {"model": "m", "prompt": "hi", "max_tokens": 3}


def _write(path: Path, backends: list[dict[str, Any]], **kw: Any) -> None:
    data: dict[str, Any] = {
        "scrape_interval_s": 0.05,
        "policy": {"name": "round_robin"},
        "health": {"enabled": False},
        "backends": backends,
    }
    data.update(kw)
    path.write_text(yaml.safe_dump(data))


def _backend(fake: FakeBackend, name: str, **kw: Any) -> dict[str, Any]:
    return {"url": fake.url, "name": name, "models": ["m"], **kw}


@contextlib.asynccontextmanager
async def _reloading_gateway(path: Path, *, with_source: bool = True) -> AsyncIterator[str]:
    """The gateway app serving ``path``'s config, reloading from ``path``."""
    app = create_gateway_app(load_gateway_config(path))
    if with_source:
        app[RELOAD_KEY].source = lambda: load_gateway_config(path)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        await wait_until_ready(url)
        yield url
    finally:
        await runner.cleanup()


async def _post(url: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.json()


async def _send(url: str, n: int) -> None:
    for _ in range(n):
        status, _ = await _post(url, "/v1/completions", BODY)
        assert status == 200


async def _get(url: str, path: str, *, fresh: bool = False) -> Any:
    connector = aiohttp.TCPConnector(force_close=True) if fresh else None
    async with aiohttp.ClientSession(connector=connector) as s, s.get(url + path) as r:
        assert r.status == 200
        return await (r.json() if path.startswith("/admin") else r.text())


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def _names(url: str, *, fresh: bool = False) -> set[str]:
    rows = (await _get(url, "/admin/backends", fresh=fresh))["backends"]
    return {row["name"] for row in rows}


async def test_reload_changes_the_canary_share(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    canary = {"name": "canary", "params": {"splits": {"v2": 0.0}, "sticky_sessions": False}}
    async with fake_backends(FakeBackend(), FakeBackend()) as (old, new):
        backends = [_backend(old, "stable", version="v1"), _backend(new, "next", version="v2")]
        _write(path, backends, policy=canary)
        async with _reloading_gateway(path) as url:
            await _send(url, 10)
            assert (len(old.bodies), len(new.bodies)) == (10, 0)
            canary["params"]["splits"] = {"v2": 1.0}  # ramp to 100 %
            _write(path, backends, policy=canary)
            status, body = await _post(url, "/admin/reload")
            assert status == 200, body
            assert body["changed"] == ["policy"] and body["policy"] == "canary"
            await _send(url, 10)
            assert (len(old.bodies), len(new.bodies)) == (10, 10)
            config = await _get(url, "/admin/config")
            assert config["policy"]["params"]["splits"] == {"v2": 1.0}
            assert config["deployment"]["config_hash"] == body["config_hash"]


async def test_reload_adds_and_removes_backends_keeping_in_flight(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    async with fake_backends(FakeBackend(), FakeBackend(chunk_delay_s=0.2)) as (added, gone):
        _write(path, [_backend(gone, "gone")])
        async with _reloading_gateway(path) as url:
            stream = asyncio.create_task(_stream(url))  # 3 chunks, 0.6 s on "gone"
            await _until(lambda: _active(gone))
            _write(path, [_backend(added, "added")])
            status, body = await _post(url, "/admin/reload")
            assert status == 200, body
            assert body["backends"] == {"added": ["added"], "removed": ["gone"], "updated": []}
            before = len(gone.bodies)
            await _until(lambda: _routable(url, "added"))
            await _send(url, 6)
            assert len(added.bodies) == 6 and len(gone.bodies) == before
            assert (await stream).count("data: ") == 4  # 3 chunks + [DONE]: not cut
            await _until(lambda: _gone(url, "gone"))


async def _stream(url: str) -> str:
    body = {**BODY, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        return await r.text()


async def _active(fake: FakeBackend) -> bool:
    return fake.num_active > 0


async def _routable(url: str, name: str) -> bool:
    rows = (await _get(url, "/admin/backends"))["backends"]
    return any(r["name"] == name and r["routable"] and r["kv_usage"] is not None for r in rows)


async def _gone(url: str, name: str) -> bool:
    return name not in await _names(url)


async def test_a_bad_reload_answers_400_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    async with fake_backends(FakeBackend()) as (fake,):
        _write(path, [_backend(fake, "b0")])
        async with _reloading_gateway(path) as url:
            before = await _get(url, "/admin/config")
            bad = {
                "invalid_config": "backends: [\n  - url: [",  # not YAML
                "invalid_config ": "polcy: {name: random}\n",  # a typo'd key
                "invalid_config  ": "policy: {name: no_such_policy}\n",
                "restart_required": "",  # port and workers: below
            }
            for code, text in bad.items():
                path.write_text(text)
                if not text:
                    # (a count the gateway does not run with, whatever the default)
                    _write(path, [_backend(fake, "b0")], port=9, workers=auto_workers() + 1)
                status, body = await _post(url, "/admin/reload")
                assert status == 400, body
                assert body["error"]["type"] == "invalid_request_error"
                assert body["error"]["code"] == code.strip(), body
                await _send(url, 1)  # the old config still serves
            assert "port, workers cannot change while the gateway runs" in body["error"]["message"]
            assert body["error"]["param"] == "port"
            assert await _get(url, "/admin/config") == before
            metrics = await _get(url, "/metrics")
            assert 'kiloserve_gateway_config_reloads_total{result="error"} 4.0' in metrics
            assert 'kiloserve_gateway_config_reloads_total{result="ok"} 0.0' in metrics


async def test_reload_is_an_admin_write(tmp_path: Path) -> None:
    """The CSRF guards of the other admin POSTs; 400 without a config file."""
    path = tmp_path / "gw.yaml"
    async with fake_backends(FakeBackend()) as (fake,):
        _write(path, [_backend(fake, "b0")])
        async with _reloading_gateway(path, with_source=False) as url, aiohttp.ClientSession() as s:
            evil = {**JSON, "Origin": "http://evil.example"}
            async with s.post(url + "/admin/reload", headers=evil) as r:
                assert r.status == 403
            async with s.post(url + "/admin/reload", data=b"x") as r:  # not JSON
                assert r.status == 400
                assert (await r.json())["error"]["code"] == "json_required"
            status, body = await _post(url, "/admin/reload")
            assert status == 400 and body["error"]["code"] == "no_config"


async def test_sighup_reloads_a_gateway_process(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    async with fake_backends(FakeBackend(), FakeBackend()) as (a, b):
        _write(path, [_backend(a, "a")])
        async with gateway_process("-c", str(path), "--workers", "1") as (line, proc):
            url = line.split(" listening on ", 1)[1].split()[0]
            await wait_until_ready(url)
            _write(path, [_backend(a, "a"), _backend(b, "b")])
            proc.send_signal(signal.SIGHUP)
            await _until(lambda: _routable(url, "b"))
            status, _ = await _post(url, "/admin/backends/a/drain")  # (least_request: ties go to a)
            assert status == 200
            await _send(url, 4)
            assert len(b.bodies) == 4
            assert proc.returncode is None


@pytest.mark.slow
async def test_sighup_to_the_supervisor_reloads_every_worker(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    async with fake_backends(FakeBackend(), FakeBackend(), FakeBackend()) as (a, b, c):
        _write(path, [_backend(a, "a")])
        async with gateway_process("-c", str(path), "--workers", "2") as (line, proc):
            url = line.split(" listening on ", 1)[1].split()[0]
            await wait_until_ready(url)
            _write(path, [_backend(a, "a"), _backend(b, "b")])
            os.kill(proc.pid, signal.SIGHUP)
            await _until(lambda: _all_workers_see(url, {"a", "b"}))
            # POST /admin/reload on whichever worker answers reaches both as well
            _write(path, [_backend(c, "c")])
            status, body = await _post(url, "/admin/reload")
            assert status == 200 and body["workers"] == "signalled", body
            await _until(lambda: _all_workers_see(url, {"c"}))
            assert proc.returncode is None


async def _all_workers_see(url: str, names: set[str]) -> bool:
    """Fresh connections land on either worker: 12 reads all show ``names``."""
    for _ in range(12):
        if await _names(url, fresh=True) != names:
            return False
    return True
