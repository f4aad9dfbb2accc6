"""Mid-stream failover (issue 15): a backend that crashes or stalls after tokens were
relayed does not cut the client's stream; the gateway continues it on another backend.

Three real twins behind the in-process gateway, 30 concurrent streams; one twin is
crashed (a real process exit: ``{"crash": true}``) or stalled (``stall_after_tokens``)
while the streams run. Every client must see one well-formed stream: status 200, one
``id``, ``max_tokens`` tokens, the right final usage, exactly one ``[DONE]``, no error
event.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from test_gateway_fakes import admin_backends, gateway_config, post_faults, running_gateway
from test_gateway_twins import MODEL, twins

from conftest import FixedStepTimer
from kiloserve.engine.protocol import render_chat
from kiloserve.engine.server import TwinServer
from kiloserve.engine.twin import TwinConfig
from kiloserve.launch.cluster import free_port
from kiloserve.tokens import count_tokens

NUM_STREAMS = 30
PROMPT = "the quick fox jumps over the lazy dog"


_faults = post_faults
_backends = admin_backends


async def _metric(gw: str, prefix: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(gw + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


def _twin_argv(port: int) -> list[str]:
    argv = [sys.executable, "-m", "kiloserve", "engine", "--gpu", "H100-SXM"]
    return [*argv, "--model", "llama-3.1-8b", "--port", str(port), "--served-model-name", MODEL]


@contextlib.asynccontextmanager
async def twin_processes(num: int) -> AsyncIterator[list[str]]:
    """``num`` twins as real processes (the crash fault exits the process)."""
    ports = [free_port() for _ in range(num)]
    out = subprocess.DEVNULL
    procs = [subprocess.Popen(_twin_argv(port), stdout=out, stderr=out) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        async with aiohttp.ClientSession() as s:
            for url in urls:
                for _ in range(300):
                    with contextlib.suppress(aiohttp.ClientError):
                        async with s.get(url + "/health") as r:
                            if r.status == 200:
                                break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError(f"twin at {url} never became healthy")
        yield urls
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


class _Stream:
    """One client stream: status, the raw SSE events, and how many tokens it has seen."""

    def __init__(self) -> None:
        self.status = 0
        self.events: list[str] = []
        self.num_tokens = 0


async def _stream(
    s: aiohttp.ClientSession, gw: str, path: str, body: dict[str, Any], st: _Stream
) -> None:
    async with s.post(gw + path, json=body) as r:
        st.status = r.status
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if event.strip():
                    st.events.append(event.decode())
                    st.num_tokens += b'"text":"' in event and b'"text":""' not in event
                    st.num_tokens += b'"content":"' in event and b'"content":""' not in event
        if buf.strip():
            st.events.append(buf.decode())


def _check(st: _Stream, max_tokens: int, *, chat: bool, usage: bool) -> None:
    """One well-formed stream: one id, ``max_tokens`` tokens, one [DONE], right usage."""
    assert st.status == 200
    assert st.events, "empty stream"
    assert all(e.startswith("data: ") for e in st.events), st.events
    datas = [e.removeprefix("data: ") for e in st.events]
    assert datas[-1] == "[DONE]", datas[-3:]
    assert datas.count("[DONE]") == 1
    chunks = [orjson.loads(d) for d in datas[:-1]]
    assert not [c for c in chunks if "error" in c], [c for c in chunks if "error" in c]
    assert len({c["id"] for c in chunks}) == 1, {c["id"] for c in chunks}
    assert len({c["created"] for c in chunks}) == 1
    assert {c["model"] for c in chunks} == {MODEL}
    field = "delta" if chat else "text"
    texts = [
        (ch["delta"].get("content") if chat else ch["text"])
        for c in chunks
        for ch in c["choices"]
        if field in ch
    ]
    assert sum(1 for t in texts if t) == max_tokens
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    if chat:
        roles = [
            ch["delta"]["role"] for c in chunks for ch in c["choices"] if "role" in ch["delta"]
        ]
        assert roles == ["assistant"]
    usages = [c["usage"] for c in chunks if c.get("usage")]
    if usage:
        assert len(usages) == 1 and chunks[-1].get("usage"), chunks[-2:]
        u = usages[0]
        assert u["completion_tokens"] == max_tokens
        # the original prompt counted once (the continuation's prompt minus what it replays)
        assert u["prompt_tokens"] == count_tokens(_chat_prompt() if chat else PROMPT)
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    else:
        assert usages == []


async def _run_streams(
    gw: str, path: str, bodies: list[dict[str, Any]], fault: Any, timeout_s: float
) -> list[_Stream]:
    """Start the streams, wait until each has some tokens, pull the fault, finish."""
    streams = [_Stream() for _ in bodies]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        tasks = [
            asyncio.create_task(_stream(s, gw, path, b, st))
            for b, st in zip(bodies, streams, strict=True)
        ]
        async with asyncio.timeout(timeout_s):
            if fault is not None:
                while not all(st.num_tokens >= 3 for st in streams):
                    await asyncio.sleep(0.005)
                await fault()
            await asyncio.gather(*tasks)
    return streams


async def _in_flight_drained(gw: str) -> None:
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        if all(b["in_flight"] == 0 for b in (await _backends(gw)).values()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"in_flight never went back to 0: {await _backends(gw)}")


def _chat_prompt() -> str:
    """The prompt text the twin's chat template renders for the test's messages."""
    return render_chat([{"role": "user", "content": PROMPT}])


def _bodies(max_tokens: int, *, chat: bool = False) -> list[dict[str, Any]]:
    out = []
    for i in range(NUM_STREAMS):
        body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": True}
        if chat:
            body["messages"] = [{"role": "user", "content": PROMPT}]
        else:
            body["prompt"] = PROMPT
        if i % 2 == 0:
            body["stream_options"] = {"include_usage": True}
        out.append(body)
    return out


def _check_all(streams: list[_Stream], bodies: list[dict[str, Any]], *, chat: bool) -> None:
    for st, body in zip(streams, bodies, strict=True):
        _check(st, body["max_tokens"], chat=chat, usage="stream_options" in body)


async def test_crash_mid_stream_is_migrated() -> None:
    async with twin_processes(3) as urls:
        backends = [{"url": u, "name": f"t{i}"} for i, u in enumerate(urls)]
        async with running_gateway(gateway_config(backends)) as gw:
            bodies = _bodies(120)

            async def crash() -> None:
                with contextlib.suppress(aiohttp.ClientError):
                    await _faults(urls[1], {"crash": True})

            streams = await _run_streams(gw, "/v1/completions", bodies, crash, 30.0)
            _check_all(streams, bodies, chat=False)
            await _in_flight_drained(gw)
            assert await _metric(gw, 'kiloserve_gateway_migrations_total{reason="crash"}') >= 1
            assert await _metric(gw, "kiloserve_gateway_migrated_tokens_total") >= 3


async def test_crash_mid_chat_stream_is_migrated() -> None:
    async with twin_processes(3) as urls:
        backends = [{"url": u, "name": f"t{i}"} for i, u in enumerate(urls)]
        async with running_gateway(gateway_config(backends)) as gw:
            bodies = _bodies(120, chat=True)

            async def crash() -> None:
                with contextlib.suppress(aiohttp.ClientError):
                    await _faults(urls[2], {"crash": True})

            streams = await _run_streams(gw, "/v1/chat/completions", bodies, crash, 30.0)
            _check_all(streams, bodies, chat=True)
            await _in_flight_drained(gw)


async def test_stall_mid_stream_is_detected_migrated_and_ejected() -> None:
    async with twins({}, {}, {}, step_s=0.004) as servers:
        backends = [{"url": t.url, "name": f"t{i}"} for i, t in enumerate(servers)]
        cfg = gateway_config(
            backends,
            migration={"stall_timeout_s": 0.5},
            outlier={"consecutive_gateway_failures": 3, "base_ejection_time_s": 30.0},
        )
        async with running_gateway(cfg) as gw:
            await _faults(servers[1].url, {"stall_after_tokens": 5})
            bodies = _bodies(60)
            start = time.monotonic()
            streams = await _run_streams(gw, "/v1/completions", bodies, None, 15.0)
            took_s = time.monotonic() - start
            _check_all(streams, bodies, chat=False)
            assert took_s < 5.0  # the stall is cut at 0.5 s, not at request_timeout_s
            await _in_flight_drained(gw)
            t1 = (await _backends(gw))["t1"]
            assert "ejected" in t1["unhealthy_reasons"], t1
            assert await _metric(gw, 'kiloserve_gateway_migrations_total{reason="stall"}') >= 1


async def test_migration_off_per_request_keeps_todays_error_event() -> None:
    async with twins({}, {}, step_s=0.004) as servers:
        backends = [{"url": t.url, "name": f"t{i}"} for i, t in enumerate(servers)]
        cfg = gateway_config(backends, migration={"stall_timeout_s": 0.3})
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            await _faults(servers[0].url, {"stall_after_tokens": 2})
            await _faults(servers[1].url, {"stall_after_tokens": 2})
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "stream": True}
            headers = {"x-kiloserve-migrate": "0"}
            async with asyncio.timeout(5.0):
                async with s.post(gw + "/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200
                    text = await r.text()
            events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
            assert "[DONE]" not in events
            assert orjson.loads(events[-1])["error"]["code"] == 504
            await _in_flight_drained(gw)


async def test_a_queued_chat_stream_is_not_a_stalled_one() -> None:
    """The twin sends a chat stream's role chunk at once; with one sequence at a time
    the second stream waits ~0.6 s for its first token: longer than the stall
    time-out (0.3 s), yet not a stall (tokens then come every 0.05 s)."""
    cfg = TwinConfig(gpu="H100-SXM", model="llama-3.1-8b", port=0, max_num_seqs=1)
    async with TwinServer(cfg, timer=FixedStepTimer(0.05)) as server:
        gw_cfg = gateway_config(
            [{"url": server.url, "name": "t0"}], migration={"stall_timeout_s": 0.3}
        )
        async with running_gateway(gw_cfg) as gw:
            bodies = _bodies(12, chat=True)[:2]
            streams = await _run_streams(gw, "/v1/chat/completions", bodies, None, 10.0)
            _check_all(streams, bodies, chat=True)
            assert await _metric(gw, "kiloserve_gateway_migrations_total") == 0


async def test_a_cut_stream_continues_where_panic_routing_sends_new_requests() -> None:
    """Every backend failed its probes (an overloaded box: the probes time out while
    requests are served), so new requests are panic-routed to all of them. A stream cut
    on one must continue on another the same way, not end with an error event because
    no backend is "routable" (seen: a real-vLLM failover drill on a starved box)."""
    async with twins({}, {}, step_s=0.004) as servers:
        backends = [{"url": t.url, "name": f"t{i}"} for i, t in enumerate(servers)]
        # every probe times out (1 us) while the twins serve: the starved box's case
        probe = {"timeout_s": 1e-6, "interval_s": 0.05, "recheck_interval_s": 0.05,
                 "unhealthy_threshold": 1, "completion_probe": False}  # fmt: skip
        cfg = gateway_config(backends, health=probe, migration={"stall_timeout_s": 0.5})
        async with running_gateway(cfg, wait_ready=False) as gw:
            deadline = time.monotonic() + 5.0
            while any(b["healthy"] for b in (await _backends(gw)).values()):
                assert time.monotonic() < deadline, await _backends(gw)
                await asyncio.sleep(0.02)
            await _faults(servers[1].url, {"stall_after_tokens": 5})
            bodies = _bodies(40)[:8]
            streams = await _run_streams(gw, "/v1/completions", bodies, None, 15.0)
            _check_all(streams, bodies, chat=False)
            assert await _metric(gw, 'kiloserve_gateway_migrations_total{reason="stall"}') >= 1
            assert await _metric(gw, "kiloserve_gateway_panic_routing") >= 1
