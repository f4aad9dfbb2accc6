"""SIGTERM on a real ``kiloserve gateway`` process: stop accepting, finish streams, exit."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from test_gateway_twins import MODEL, twins

from conftest import free_port


async def _wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            assert proc.poll() is None, "gateway exited while starting"
            try:
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("gateway not ready")


def launch_gateway(
    tmp_path: Path, backend_url: str, **conf: Any
) -> tuple[str, subprocess.Popen[bytes]]:
    """A ``kiloserve gateway`` process on a free port in front of one backend (``t0``,
    serving ``MODEL``; active health checks off); ``conf`` adds config keys."""
    port = free_port()
    full = {
        "port": port,
        "health": {"enabled": False},
        "backends": [{"url": backend_url, "name": "t0", "models": [MODEL]}],
        **conf,
    }
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(full))
    argv = [sys.executable, "-m", "kiloserve", "gateway", "-c", str(path)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return f"http://127.0.0.1:{port}", proc


@pytest.mark.parametrize("workers", [1, 2])
async def test_sigterm_lets_in_flight_streams_finish_then_exits(
    tmp_path: Path, workers: int
) -> None:
    """With ``workers: 2`` the SIGTERM may come while worker 1 still starts (worker 0
    answers ``/ready`` first): exit 0 all the same (before: 1, "a worker did not start")."""
    async with twins({}, step_s=0.02) as servers:
        url, proc = launch_gateway(tmp_path, servers[0].url, shutdown_grace_s=10.0, workers=workers)
        try:
            await _wait_ready(url, proc)
            body = {"model": MODEL, "prompt": "drain me", "max_tokens": 40, "stream": True}
            async with (
                aiohttp.ClientSession() as s,
                s.post(url + "/v1/completions", json=body) as r,
            ):
                assert r.status == 200
                first = await r.content.readline()
                assert first.startswith(b"data: ")
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                async with aiohttp.ClientSession() as other:  # no new connections
                    try:
                        async with other.get(url + "/health") as late:
                            refused = False
                            assert late.status != 200
                    except aiohttp.ClientConnectionError:
                        refused = True
                assert refused
                rest = await r.read()
            assert b"data: [DONE]" in rest and b'"error"' not in rest
            assert await asyncio.to_thread(proc.wait, 10.0) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
