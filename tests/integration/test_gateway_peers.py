"""Gateways that act as one: two ``kiloserve gateway`` processes share their in-flight
view through a real ``redis-server`` (``peers: {enabled: true}``), and each falls back
to its own view when Redis goes away; a Responses API follow-up through either gateway
reaches the twin that holds its conversation."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from test_gateway_fakes import FakeBackend, fake_backends, gateway_process
from test_gateway_twins import MODEL, twins
from test_ratelimit_redis import REDIS, redis_url  # noqa: F401 - the fixture

from kiloserve.gateway.headers import BACKEND_HEADER
from kiloserve.routing.engine_metrics import parse_samples

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REDIS is None, reason="redis-server not installed"),
]


@contextlib.asynccontextmanager
async def _gateway(conf: Path, *urls: str) -> AsyncIterator[str]:
    args = [a for u in urls for a in ("--backend", u)]
    async with gateway_process("-c", str(conf), *args) as (line, _):
        yield line.strip().rsplit(" ", 1)[-1]


async def _json(url: str) -> dict[str, object]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        body = await r.json()
        assert isinstance(body, dict)
        return body


async def _in_flight(gw: str) -> int:
    rows = (await _json(gw + "/admin/backends"))["backends"]
    assert isinstance(rows, list)
    return sum(int(r["in_flight"]) for r in rows)


async def _metric(gw: str, name: str) -> float:
    """A gauge each worker of the gateway keeps for itself (``--workers N``: one series
    per worker): its value when every series has the same one, else NaN."""
    async with aiohttp.ClientSession() as s, s.get(gw + "/metrics") as r:
        text = await r.text()
    values = {v for n, _, v in parse_samples(text) if n == name}
    return values.pop() if len(values) == 1 else float("nan")


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_two_gateways_count_as_one_and_fall_back_without_redis(
    redis_url: str,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    conf = tmp_path / "gw.yaml"
    conf.write_text(f"peers: {{enabled: true, redis_url: '{redis_url}'}}\n")
    fakes = [FakeBackend(mode="hang"), FakeBackend(mode="hang")]
    async with (
        fake_backends(*fakes),
        _gateway(conf, *(f.url for f in fakes)) as g1,
        _gateway(conf, *(f.url for f in fakes)) as g2,
    ):

        async def peered() -> bool:
            return all([await _metric(g, "kiloserve_gateway_peers") == 1 for g in (g1, g2)])

        await _until(peered)
        tasks: list[asyncio.Task[None]] = []

        async def one(gw: str) -> None:
            body = {"model": "m", "prompt": "x"}
            async with aiohttp.ClientSession() as s, s.post(gw + "/v1/completions", json=body):
                pass

        for gw in (g1, g1, g1, g2, g2):  # one at a time: each sees the ones before
            before = sum(f.num_active for f in fakes)
            tasks.append(asyncio.ensure_future(one(gw)))

            async def arrived(before: int = before) -> bool:
                return sum(f.num_active for f in fakes) > before

            await _until(arrived)
            await asyncio.sleep(0.1)  # the flush (10 ms) and a margin
        # least_request on the shared view: 3 and 2 across the backends, not 2+1 and 1+1
        assert sorted(f.num_active for f in fakes) == [2, 3]

        async def shared() -> bool:
            return [await _in_flight(g1), await _in_flight(g2)] == [5, 5]

        await _until(shared, 5.0)
        assert await _metric(g1, "kiloserve_gateway_peers_connected") == 1

        # Redis goes away: each gateway falls back to its own requests, and says so
        redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        async with aiohttp.ClientSession():
            pass
        proc_kill = await asyncio.create_subprocess_exec(
            "redis-cli", "-p", str(redis_port), "shutdown", "nosave",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await proc_kill.wait()

        async def own_view() -> bool:
            return [await _in_flight(g1), await _in_flight(g2)] == [3, 2] and all(
                [await _metric(g, "kiloserve_gateway_peers_connected") == 0 for g in (g1, g2)]
            )

        await _until(own_view, 10.0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _respond(gw: str, previous: str | None) -> tuple[int, str, str]:
    """A Responses API turn through ``gw``: (status, the backend that answered, its id)."""
    body: dict[str, object] = {"model": MODEL, "input": "next turn", "max_output_tokens": 2}
    if previous is not None:
        body["previous_response_id"] = previous
    async with aiohttp.ClientSession() as s, s.post(gw + "/v1/responses", json=body) as r:
        data = await r.json()
        return r.status, r.headers.get(BACKEND_HEADER, ""), str(data.get("id", ""))


async def test_a_responses_follow_up_through_the_other_gateway_finds_its_backend(
    redis_url: str,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    """The twins keep a Responses conversation where it was answered (as vLLM does);
    any other twin answers 404. The two gateways list the twins in opposite orders, so
    on idle twins least_request picks a different first twin on each: a follow-up
    through the other gateway reached the wrong twin before the gateways shared the
    ids (``"r"`` in the peer messages); now it goes to the right one at once, with no
    retry (the fallback for an unknown id, asking the twins in turn, is not needed)."""
    conf = tmp_path / "gw.yaml"
    conf.write_text(f"peers: {{enabled: true, redis_url: '{redis_url}'}}\n")
    async with twins({}, {}, {}) as servers:
        urls = [t.url for t in servers]
        async with _gateway(conf, *urls) as g1, _gateway(conf, *reversed(urls)) as g2:

            async def peered() -> bool:
                return all([await _metric(g, "kiloserve_gateway_peers") == 1 for g in (g1, g2)])

            await _until(peered)
            status, owner, previous = await _respond(g1, None)
            assert status == 200 and previous.startswith("resp_")
            for turn in range(4):
                await asyncio.sleep(0.5)  # the channel's delay (a Redis round trip)
                status, got, previous = await _respond((g2, g1)[turn % 2], previous)
                assert (status, got) == (200, owner), turn
            for g in (g1, g2):  # found through the shared ids, not by asking each twin
                async with aiohttp.ClientSession() as s, s.get(g + "/metrics") as r:
                    page = await r.text()
                names = [n for n, _, v in parse_samples(page) if v and "retries_total" in n]
                assert names == [], names
