"""Thermal throttling (S3.7) on a real local cluster: three twin processes, the gateway
process, steady streaming load. One twin gets a fast-heating thermal fault; the twin's
``/metrics`` must show it hot and throttled, and the gateway's slow-node demotion must
demote it (``effective_weight`` < 1) within ``DEMOTE_WITHIN_S`` of the first
throttled scrape, with no failed request. (Once demoted it gets almost no traffic, so
it cools below ``resume_at_c`` and its clock comes back: the model's hysteresis loop.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest

from kiloserve.chaos.env import DrillEnv
from kiloserve.chaos.load import LoadGenerator
from kiloserve.launch.config import parse_cluster_config

CLUSTER = {
    "name": "thermal",
    "gateway": {"port": 0, "policy": "default"},
    "backends": [{"name": "h100", "gpu": "H100", "model": "llama-3.1-8b", "count": 3}],
}
# Fast constants: from 40 C at full load, 60 C is reached after tau * ln(50/30) = 0.5 s of
# steps; a 4x clock drop (the `slow` drill's factor) is well past the 2.5x pool factor.
THERMAL = {
    "throttle_at_c": 60.0, "resume_at_c": 55.0, "factor": 4.0, "ambient_c": 40.0,
    "load_c": 90.0, "time_constant_s": 1.0,
}  # fmt: skip
THROTTLE_WITHIN_S = 10.0
DEMOTE_WITHIN_S = 10.0  # the `slow` drill's bound (docs/chaos.md)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DrillEnv]:
    drill = DrillEnv(parse_cluster_config(CLUSTER), Path(tmp_path_factory.mktemp("thermal")))
    drill.start()
    try:
        yield drill
    finally:
        drill.stop()


def _gauge(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


async def _twin_gauges(session: aiohttp.ClientSession, url: str) -> tuple[float | None, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    ratio = _gauge(text, "kiloserve_twin_gpu_clock_ratio")
    assert ratio is not None
    return _gauge(text, "kiloserve_twin_gpu_temperature_celsius"), ratio


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float) -> float | None:
    """Seconds until ``await check()`` is true, or ``None`` after ``timeout_s``."""
    start_s = time.monotonic()
    while time.monotonic() - start_s < timeout_s:
        if await check():
            return time.monotonic() - start_s
        await asyncio.sleep(0.1)
    return None


@pytest.mark.slow
async def test_thermal_throttling_is_demoted(env: DrillEnv) -> None:
    victim = env.names()[0]
    url = env.child(victim).url
    load = LoadGenerator(env.gateway_url, env.cluster.backends[0].model, 6)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0))
    try:
        await load.start()
        await asyncio.sleep(2.0)  # warm-up: every backend has samples
        assert (await _twin_gauges(session, url)) == (None, 1.0)
        await env.faults(victim, {"thermal": THERMAL})

        async def throttled() -> bool:
            temp, ratio = await _twin_gauges(session, url)
            return temp is not None and temp >= 60.0 and ratio == 0.25

        throttle_s = await _until(throttled, THROTTLE_WITHIN_S)
        assert throttle_s is not None

        async def demoted() -> bool:
            row = (await env.backends())[victim]
            return bool(row["effective_weight"] < 1.0 - 1e-9)

        demote_s = await _until(demoted, DEMOTE_WITHIN_S)
        assert demote_s is not None, await env.backends()
        print(f"thermal: throttled after {throttle_s:.1f} s, demoted {demote_s:.1f} s later")
        assert await env.metric(f'kiloserve_gateway_demotions_total{{backend="{victim}"') >= 1
        await env.faults(victim, {})
        assert (await _twin_gauges(session, url)) == (None, 1.0)
    finally:
        await load.stop()
        await session.close()
        await env.faults(victim, {})
        await env.close()
    done = [r for r in load.results if r.end_s > 0]
    failed = [r for r in done if not r.is_ok]
    assert len(done) > 20
    assert not failed, [r.reason for r in failed[:5]]
