"""A real ``kiloserve gateway`` process keeps its memory whatever the ``user`` field holds.

Issue 15, finding 3: 150 requests with a unique 2 MB ``user`` string took the gateway's
RSS from 52 to 357 MB, never released (the output-length predictor keyed an LRU of
100,000 entries on the raw string). Long keys are now kept as digests; the unit test
``test_profile_bounds`` proves the bound for 10,000 users with tracemalloc, this one
measures the process's RSS as the user saw it.
"""

from __future__ import annotations

import io
from pathlib import Path

import aiohttp
import orjson
import pytest
from test_gateway_twins import MODEL, twins
from test_health_shutdown import _wait_ready, launch_gateway

_MB = 1 << 20
NUM_USERS = 150
JSON = {"Content-Type": "application/json"}
MAX_GROWTH_MIB = 24.0  # the old gateway grew by ~2 MB per user: ~300 MiB here


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise AssertionError("no VmRSS")


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_150_unique_2mb_users_do_not_grow_the_gateway(tmp_path: Path) -> None:
    async with twins({}, step_s=0.0) as servers:
        root, proc = launch_gateway(tmp_path, servers[0].url, policy={"name": "least_request"})
        url = root + "/v1/completions"
        base = "u" * (2 * _MB)
        try:
            await _wait_ready(root, proc)
            async with aiohttp.ClientSession() as s:

                async def send(i: int) -> None:
                    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": f"{base}{i}"}
                    data = io.BytesIO(orjson.dumps(body))  # aiohttp warns on big raw bytes
                    async with s.post(url, data=data, headers=JSON) as r:
                        assert r.status == 200, await r.text()

                for i in range(10):  # warm-up: buffers and allocator pools at their size
                    await send(-i - 1)
                before = _rss_mib(proc.pid)
                for i in range(NUM_USERS):
                    await send(i)
                after = _rss_mib(proc.pid)
            assert after - before < MAX_GROWTH_MIB, (before, after)
        finally:
            proc.kill()
            proc.wait()
