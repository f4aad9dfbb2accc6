"""``kiloserve gateway --workers 2``: what one worker finds broken, every worker avoids.

Real processes: the supervisor, two workers on one port, a healthy and a failing fake
backend. Requests go to one worker at a time through its private loopback port (each
worker also serves the gateway there: gateway/worker_metrics.py). Worker A ejects the
failing backend after its own failed requests; worker B, which never sent it one,
holds it out too (``routing.shared_verdicts``). Before the sharing, B kept sending it
requests until it had met the same failures itself.
"""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp
import pytest
from test_gateway_fakes import FakeBackend, fake_backends
from test_gateway_workers import _children, _gateway, _get, _until

pytestmark = pytest.mark.slow


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on at 127.0.0.1 (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        local, state, inode = cols[1], cols[3], cols[9]
        if state == "0A" and inode in inodes and local.startswith("0100007F:"):
            ports.add(int(local.split(":")[1], 16))
    return ports


async def _post(url: str) -> int:
    connector = aiohttp.TCPConnector(force_close=True)
    body = {"model": "m", "prompt": "x", "max_tokens": 2}
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.post(url + "/v1/completions", json=body) as r,
    ):
        await r.read()
        return r.status


async def _reasons(url: str, name: str) -> list[str] | None:
    """The worker's ``unhealthy_reasons`` of a backend (None while it is healthy)."""
    status, body = await _get(url + "/admin/backends")
    assert status == 200 and isinstance(body, dict)
    row = next(r for r in body["backends"] if r["name"] == name)
    return None if row["healthy"] else list(row["unhealthy_reasons"])


async def test_a_backend_one_worker_ejects_is_held_out_by_every_worker(tmp_path: Path) -> None:
    conf = tmp_path / "gw.yaml"
    conf.write_text(
        "health: {enabled: false}\n"
        "outlier: {consecutive_gateway_failures: 2, base_ejection_time_s: 120,"
        " max_ejection_percent: 100}\n"
        "backends:\n"
        # first: least_request sends it every request while in-flight counts tie
        "  - {name: bad, url: BAD, models: [m]}\n"
        "  - {name: good, url: GOOD, models: [m]}\n"
    )
    good, bad = FakeBackend(), FakeBackend(mode="500")
    async with fake_backends(good, bad):
        text = conf.read_text().replace("GOOD", good.url).replace("BAD", bad.url)
        conf.write_text(text)
        async with _gateway(config=conf) as (url, proc):
            shared_port = int(url.rsplit(":", 1)[1])
            workers = _children(proc.pid)
            assert len(workers) == 2
            private = {}
            for pid in workers:

                async def listening(pid: int = pid) -> bool:
                    return bool(_listening_ports(pid) - {shared_port})

                await _until(listening)
                (port,) = _listening_ports(pid) - {shared_port}
                private[pid] = f"http://127.0.0.1:{port}"
            a, b = (private[pid] for pid in workers)

            async def ready() -> bool:
                return (await _get(a + "/ready"))[0] == 200 and (await _get(b + "/ready"))[0] == 200

            await _until(ready)
            # worker A meets the failures (its retries answer the client from "good")
            for _ in range(30):
                assert await _post(a) == 200
                if await _reasons(a, "bad") == ["ejected"]:
                    break
            assert await _reasons(a, "bad") == ["ejected"], (len(bad.bodies), len(good.bodies))
            sent_to_bad = len(bad.bodies)

            async def held_out_by_b() -> bool:
                return await _reasons(b, "bad") == ["ejected (another worker)"]

            await _until(held_out_by_b, timeout_s=5.0)
            for _ in range(10):
                assert await _post(b) == 200
            assert len(bad.bodies) == sent_to_bad  # worker B sent it nothing
            assert len(good.bodies) >= 10
