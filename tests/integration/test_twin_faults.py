"""Fault injection on a real twin server: flags at start-up and POST /admin/faults."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import pytest

from kiloserve.engine.cli import add_arguments, config_from_args
from kiloserve.engine.faults import FaultSet
from kiloserve.engine.server import TwinServer
from kiloserve.engine.twin import TwinConfig
from kiloserve.errors import RequestError

STEP_S = 0.01


class FixedStepTimer:
    """A GPU whose every step takes ``STEP_S``."""

    def step_time_s(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> float:
        return STEP_S

    def decode_steps_time_s(self, num_seqs: int, context_tokens: int, num_steps: int) -> float:
        return STEP_S * num_steps


def _config(faults: FaultSet | None = None, seed: int = 0) -> TwinConfig:
    return TwinConfig(
        gpu="H100-SXM",
        model="llama-3.1-8b",
        port=0,
        api_overhead_s=0.0,
        faults=faults or FaultSet(),
        seed=seed,
    )


@pytest.fixture
async def twin() -> AsyncIterator[TwinServer]:
    async with TwinServer(_config(), timer=FixedStepTimer()) as server:
        yield server


async def _post(session: aiohttp.ClientSession, url: str, body: object) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def _timed_completion(session: aiohttp.ClientSession, url: str, num_tokens: int) -> float:
    start_s = time.monotonic()
    body = {"prompt": "the node", "max_tokens": num_tokens}
    status, out = await _post(session, url + "/v1/completions", body)
    assert status == 200 and out["usage"]["completion_tokens"] == num_tokens
    return time.monotonic() - start_s


async def test_slowdown_at_run_time_and_clear(twin: TwinServer) -> None:
    async with aiohttp.ClientSession() as session:
        base_s = await _timed_completion(session, twin.url, 10)
        status, active = await _post(session, twin.url + "/admin/faults", {"slowdown": 4.0})
        assert status == 200 and active == {"slowdown": 4.0}
        async with session.get(twin.url + "/admin/faults") as resp:
            assert await resp.json() == {"slowdown": 4.0}
        slow_s = await _timed_completion(session, twin.url, 10)
        assert await _post(session, twin.url + "/admin/faults", {}) == (200, {})
        again_s = await _timed_completion(session, twin.url, 10)
    # 10 steps of 10 ms; tokens are never early, and late only by load (loose bounds)
    assert 0.09 <= base_s <= 0.35
    assert slow_s >= 4 * 0.09  # impossible without the slowdown
    assert 0.09 <= again_s <= 0.35


async def test_error_rate_uses_status_and_openai_body(twin: TwinServer) -> None:
    async with aiohttp.ClientSession() as session:
        fault = {"error_rate": 1.0, "status": 503}
        assert await _post(session, twin.url + "/admin/faults", fault) == (200, fault)
        status, body = await _post(session, twin.url + "/v1/completions", {"prompt": "x"})
        assert status == 503
        assert set(body["error"]) == {"message", "type", "param", "code"}
        async with session.get(twin.url + "/health") as resp:
            assert resp.status == 200  # the engine is up; requests fail


async def _count_errors(seed: int, num_requests: int) -> list[int]:
    faults = FaultSet(error_rate=0.5, error_status=500)
    async with (
        TwinServer(_config(faults, seed), timer=FixedStepTimer()) as server,
        aiohttp.ClientSession() as session,
    ):
        statuses = []
        for _ in range(num_requests):
            body = {"prompt": "x", "max_tokens": 1}
            statuses.append((await _post(session, server.url + "/v1/completions", body))[0])
    return statuses


async def test_error_rate_is_seeded_and_deterministic() -> None:
    first = await _count_errors(seed=7, num_requests=30)
    second = await _count_errors(seed=7, num_requests=30)
    other = await _count_errors(seed=8, num_requests=30)
    assert first == second
    assert first != other
    assert set(first) == {200, 500}
    assert 5 <= first.count(500) <= 25


async def test_hang_accepts_but_never_answers(twin: TwinServer) -> None:
    short = aiohttp.ClientTimeout(total=0.4)
    async with aiohttp.ClientSession() as session:
        assert await _post(session, twin.url + "/admin/faults", {"hang": True}) == (
            200,
            {"hang": True},
        )
        with pytest.raises(TimeoutError):
            await session.post(twin.url + "/v1/completions", json={"prompt": "x"}, timeout=short)
        with pytest.raises(TimeoutError):
            await session.get(twin.url + "/health", timeout=short)
        await _post(session, twin.url + "/admin/faults", {})
        await _timed_completion(session, twin.url, 3)


async def _read_until_quiet(resp: aiohttp.ClientResponse, quiet_s: float) -> list[bytes]:
    """SSE events received until nothing arrives for ``quiet_s`` (or the stream ends)."""
    buffer = b""
    while True:
        try:
            data = await asyncio.wait_for(resp.content.readany(), quiet_s)
        except TimeoutError:
            break
        if not data:
            break
        buffer += data
    return [e for e in buffer.split(b"\n\n") if e]


async def test_stall_after_tokens_keeps_connection_open(twin: TwinServer) -> None:
    async with aiohttp.ClientSession() as session:
        await _post(session, twin.url + "/admin/faults", {"stall_after_tokens": 5})
        body = {"prompt": "the node", "max_tokens": 20, "stream": True}
        async with session.post(twin.url + "/v1/completions", json=body) as resp:
            events = await _read_until_quiet(resp, quiet_s=0.5)
            assert not resp.content.at_eof()  # still open, nothing more sent
        assert len(events) == 5
        assert b"[DONE]" not in b"".join(events)
        await _post(session, twin.url + "/admin/faults", {})
        async with session.post(twin.url + "/v1/completions", json=body) as resp:
            events = await _read_until_quiet(resp, quiet_s=2.0)
        assert len(events) == 21 and events[-1] == b"data: [DONE]"


async def test_crash_answers_then_exits() -> None:
    exit_codes: list[int] = []
    async with (
        TwinServer(_config(), timer=FixedStepTimer(), on_crash=exit_codes.append) as server,
        aiohttp.ClientSession() as session,
    ):
        assert await _post(session, server.url + "/admin/faults", {"crash": True}) == (
            200,
            {"crash": True},
        )
    assert exit_codes == [1]


@pytest.mark.parametrize(
    "body",
    [
        {"slowdown": 0},
        {"slowdown": "fast"},
        {"error_rate": 1.5},
        {"error_rate": 0.5, "status": 200},
        {"hang": "yes"},
        {"stall_after_tokens": -1},
        {"crash": 1},
        {"explode": True},
        [1, 2],
    ],
)
async def test_bad_fault_bodies_are_400(twin: TwinServer, body: object) -> None:
    async with aiohttp.ClientSession() as session:
        status, out = await _post(session, twin.url + "/admin/faults", body)
        assert status == 400 and "error" in out
        async with session.get(twin.url + "/admin/faults") as resp:
            assert await resp.json() == {}  # nothing half-applied


def test_startup_flags_become_faults() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--gpu", "H100", "--model", "llama-3.1-8b", "--port", "0", "--slowdown", "2"]
    argv += ["--error-rate", "0.25", "--error-status", "503", "--hang"]
    argv += ["--stall-after-tokens", "3", "--seed", "5"]
    config = config_from_args(parser.parse_args(argv))
    assert config.faults.to_json() == {
        "slowdown": 2.0,
        "error_rate": 0.25,
        "status": 503,
        "hang": True,
        "stall_after_tokens": 3,
    }
    assert config.seed == 5
    with pytest.raises(RequestError, match="error_rate"):
        config_from_args(parser.parse_args([*argv, "--error-rate", "2"]))


class BrokenTimer(FixedStepTimer):
    """A step-time model with a bug: the loop must fail loudly, not hang requests."""

    def step_time_s(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> float:
        raise ZeroDivisionError("bug in the model")


async def test_loop_failure_turns_into_500s_not_hangs(caplog: pytest.LogCaptureFixture) -> None:
    async with (
        TwinServer(_config(), timer=BrokenTimer()) as server,
        aiohttp.ClientSession() as session,
    ):
        timeout = aiohttp.ClientTimeout(total=5)
        body = {"prompt": "x", "max_tokens": 3, "stream": True}
        async with session.post(server.url + "/v1/completions", json=body, timeout=timeout) as r:
            text = await r.text()  # ends (the request was aborted), no [DONE]
        assert "[DONE]" not in text
        status, out = await _post(session, server.url + "/v1/completions", {"prompt": "x"})
        assert status == 500 and "error" in out
        async with session.get(server.url + "/health") as resp:
            assert resp.status == 500
    assert any("loop failed" in r.getMessage() for r in caplog.records)
