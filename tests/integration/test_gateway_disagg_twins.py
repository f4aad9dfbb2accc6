"""The gateway's disaggregated prefill/decode flow over LIVE twins (issue #19): each
half fails over. Real twin servers in the ``prefill`` and ``decode`` roles (the GPU's
steps modelled by a fixed step time) behind a real gateway on 127.0.0.1; faults are
the twins' own (``POST /admin/faults``) or a twin's server stopped (connection refused).

What moved is read from both sides' ``/metrics``: the prefill twin that served a leg
holds KV (``kiloserve:kv_held_blocks``) until the decode twin that pulled it releases
it; a decode twin counts each pull (``vllm:nixl_xfer_time_seconds``); the gateway
counts retries by backend and reason, and requests by disaggregation mode.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_gateway_fakes import gateway_config, post_faults, running_gateway

from conftest import FixedStepTimer
from kiloserve.engine.server import TwinServer
from kiloserve.engine.twin import TwinConfig
from kiloserve.gateway.config import GatewayConfig
from kiloserve.tokens import count_tokens

MODEL = "Llama-3.1-8B"
PROMPT = "tell me a long story about the sea " * 60  # ~480 tokens: a real KV handle
XFER = "vllm:nixl_xfer_time_seconds_count"
HELD = "kiloserve:kv_held_blocks"
GENERATED = "vllm:generation_tokens_total"


@contextlib.asynccontextmanager
async def pd_twins(*roles: str) -> AsyncIterator[list[TwinServer]]:
    """Live twins in ``roles`` on 127.0.0.1:0 (stopping one early is allowed)."""
    servers: list[TwinServer] = []
    try:
        for role in roles:
            cfg = TwinConfig(
                gpu="H100-SXM", model="llama-3.1-8b", port=0, api_overhead_s=0.0, role=role
            )
            server = TwinServer(cfg, timer=FixedStepTimer(0.002))
            await server.start()
            servers.append(server)
        yield servers
    finally:
        for server in servers:
            with contextlib.suppress(Exception):
                await post_faults(server.url, {})  # let hung requests go before the stop
            await server.stop()


def pd_gateway(named: dict[str, TwinServer], **kw: Any) -> GatewayConfig:
    """A gateway over ``named`` twins (name -> server, role from the twin). Scrapes are
    rare (30 s) so a twin stopped or hung after start-up is found by the requests
    themselves, not by the health checker: the failover under test, not the scrape."""
    backends = [{"url": t.url, "name": name, "role": t.config.role} for name, t in named.items()]
    kw.setdefault("scrape_interval_s", 30.0)
    kw.setdefault("disagg", {"min_prompt_tokens": 64, "transfer_timeout_s": 1.0})
    return gateway_config(backends, **kw)


def _samples(text: str) -> dict[str, float]:
    """Prometheus samples keyed ``name{k=v,...}`` (labels sorted) and by bare name
    (summed over labels)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            for key in {sample.name, f"{sample.name}{{{labels}}}"}:
                out[key] = out.get(key, 0.0) + sample.value
    return out


async def metrics(url: str) -> dict[str, float]:
    """A twin's or the gateway's ``/metrics`` (``_samples``)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return _samples(await r.text())


def retries(gw_metrics: dict[str, float]) -> dict[tuple[str, str], float]:
    """The gateway's retries by (backend, reason)."""
    out = {}
    for key, value in gw_metrics.items():
        if key.startswith("kiloserve_gateway_retries_total{"):
            labels = dict(kv.split("=", 1) for kv in key[key.index("{") + 1 : -1].split(","))
            out[(labels["backend"], labels["reason"])] = value
    return out


def modes(gw_metrics: dict[str, float]) -> dict[str, float]:
    """``kiloserve_gateway_disagg_requests_total`` by mode."""
    prefix = "kiloserve_gateway_disagg_requests_total{mode="
    return {k[len(prefix) : -1]: v for k, v in gw_metrics.items() if k.startswith(prefix)}


async def released(prefill: TwinServer, timeout_s: float = 3.0) -> dict[str, float]:
    """The prefill twin's metrics once it holds no KV (the decode twin's release is
    sent in the background after its pull)."""
    got: dict[str, float] = {}
    for _ in range(int(timeout_s / 0.02)):
        got = await metrics(prefill.url)
        if got.get(HELD) == 0:
            break
        await asyncio.sleep(0.02)
    return got


async def post(gw: str, body: dict[str, Any], rid: str) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw + "/v1/completions", json=body, headers={"x-request-id": rid}) as r,
    ):
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


def sse_chunks(raw: bytes) -> list[dict[str, Any]]:
    """A well-formed completion stream's JSON chunks (one ``[DONE]``, last)."""
    events = [e.strip() for e in raw.decode().split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), events
    datas = [e.removeprefix("data: ") for e in events]
    assert datas.count("[DONE]") == 1 and datas[-1] == "[DONE]", datas[-3:]
    return [orjson.loads(d) for d in datas[:-1]]


async def _break(server: TwinServer, how: str) -> None:
    """Make ``server`` fail its next request: a 5xx, a hang, or a stopped server."""
    if how == "error":
        await post_faults(server.url, {"error_rate": 1.0, "status": 500})
    elif how == "hang":
        await post_faults(server.url, {"hang": True})
    else:
        await server.stop()


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("error", "prefill_http_500"),
        ("hang", "prefill_timeout"),
        ("killed", "prefill_connect_error"),
    ],
)
async def test_prefill_half_fails_over_to_the_next_prefill_twin(how: str, reason: str) -> None:
    async with pd_twins("prefill", "prefill", "decode") as (p0, p1, d0):
        cfg = pd_gateway({"p0": p0, "p1": p1, "d0": d0})  # round robin: p0 first
        async with running_gateway(cfg) as gw:
            await _break(p0, how)
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}
            status, headers, raw = await post(gw, body, "pf-1")
            assert status == 200, raw
            assert headers["x-kiloserve-backend"] == "d0"
            assert orjson.loads(raw)["usage"]["completion_tokens"] == 5
            gw_m = await metrics(gw)
        served = await released(p1)
        decoded = await metrics(d0.url)
        broken = await metrics(p0.url) if how != "killed" else {}
    assert retries(gw_m) == {("p0", reason): 1}
    assert modes(gw_m) == {"split": 1}
    assert gw_m["kiloserve_gateway_disagg_prefill_seconds_count{backend=p1}"] == 1
    # p1 ran the prefill leg (one token) and its KV was pulled by d0, then released
    assert served[GENERATED] == 1
    assert served[HELD] == 0
    assert served.get("vllm:nixl_num_kv_expired_reqs_total", 0) == 0
    assert decoded[XFER] == 1 and decoded["vllm:nixl_bytes_transferred_sum"] > 0
    assert decoded[GENERATED] == 5
    assert decoded.get("vllm:nixl_num_failed_notifications_total", 0) == 0
    if broken:  # the faulted twin's engine never ran the leg
        assert broken.get(GENERATED, 0) == 0 and broken.get(HELD, 0) == 0


async def test_every_prefill_twin_down_runs_the_request_whole_on_a_decode_twin() -> None:
    async with pd_twins("prefill", "prefill", "decode") as (p0, p1, d0):
        cfg = pd_gateway({"p0": p0, "p1": p1, "d0": d0})
        async with running_gateway(cfg) as gw:
            await post_faults(p0.url, {"error_rate": 1.0, "status": 500})
            await post_faults(p1.url, {"error_rate": 1.0, "status": 503})
            body = {
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": 6,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            status, headers, raw = await post(gw, body, "pf-all")
            assert status == 200, raw
            assert headers["x-kiloserve-backend"] == "d0"
            chunks = sse_chunks(raw)
            assert not [c for c in chunks if "error" in c]
            usage = chunks[-1]["usage"]
            assert usage["completion_tokens"] == 6
            assert usage["prompt_tokens"] == count_tokens(PROMPT)
            gw_m = await metrics(gw)
        decoded = await metrics(d0.url)
        prefill = [await metrics(p.url) for p in (p0, p1)]
    assert retries(gw_m) == {("p0", "prefill_http_500"): 1, ("p1", "prefill_http_503"): 1}
    assert modes(gw_m) == {"fallback": 1}
    # no kv_transfer_params reached d0: it pulled nothing and prefilled the whole prompt
    assert decoded.get(XFER, 0) == 0
    assert decoded.get("vllm:nixl_bytes_transferred_sum", 0) == 0
    assert decoded["vllm:prompt_tokens_total"] == count_tokens(PROMPT)
    assert decoded[GENERATED] == 6
    assert all(m.get(GENERATED, 0) == 0 and m.get(HELD, 0) == 0 for m in prefill)


@pytest.mark.parametrize(("how", "reason"), [("error", "http_500"), ("killed", "connect_error")])
async def test_decode_half_fails_over_before_the_first_byte(how: str, reason: str) -> None:
    async with pd_twins("prefill", "decode", "decode") as (p0, d0, d1):
        cfg = pd_gateway({"p0": p0, "d0": d0, "d1": d1})  # idle twins tie: d0 first
        async with running_gateway(cfg) as gw:
            await _break(d0, how)
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 7, "stream": True}
            status, headers, raw = await post(gw, body, "df-1")
            assert status == 200, raw
            assert headers["x-kiloserve-backend"] == "d1"
            chunks = sse_chunks(raw)
            assert not [c for c in chunks if "error" in c]
            assert sum(1 for c in chunks for ch in c["choices"] if ch["text"]) == 7
            gw_m = await metrics(gw)
        served = await released(p0)
        decoded = await metrics(d1.url)
        broken = await metrics(d0.url) if how != "killed" else {}
    assert retries(gw_m) == {("d0", reason): 1}
    assert modes(gw_m) == {"split": 1}
    # d1 pulled p0's KV with the same params and released it: nothing held, nothing
    # left to the hold timeout
    assert decoded[XFER] == 1 and decoded[GENERATED] == 7
    assert decoded.get("vllm:nixl_num_failed_notifications_total", 0) == 0
    assert served[GENERATED] == 1
    assert served[HELD] == 0 and served["kiloserve:kv_held_requests"] == 0
    assert served.get("vllm:nixl_num_kv_expired_reqs_total", 0) == 0
    if broken:
        assert broken.get(XFER, 0) == 0 and broken.get(GENERATED, 0) == 0


async def test_decode_stalling_mid_stream_is_continued_on_the_other_decode_twin() -> None:
    async with pd_twins("prefill", "decode", "decode") as (p0, d0, d1):
        cfg = pd_gateway({"p0": p0, "d0": d0, "d1": d1}, migration={"stall_timeout_s": 0.5})
        async with running_gateway(cfg) as gw:
            await post_faults(d0.url, {"stall_after_tokens": 4})
            body = {
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": 12,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with asyncio.timeout(10.0):
                status, headers, raw = await post(gw, body, "mid-1")
            assert status == 200, raw
            assert headers["x-kiloserve-backend"] == "d0"  # the stream began there
            chunks = sse_chunks(raw)
            assert not [c for c in chunks if "error" in c], chunks
            assert len({c["id"] for c in chunks}) == 1
            texts = [ch["text"] for c in chunks for ch in c["choices"] if ch["text"]]
            assert len(texts) == 12
            finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"]]
            assert [f for f in finishes if f] == ["length"]
            usage = chunks[-1]["usage"]
            assert usage["completion_tokens"] == 12
            assert usage["prompt_tokens"] == count_tokens(PROMPT)
            gw_m = await metrics(gw)
        served = await released(p0)
        first, second = await metrics(d0.url), await metrics(d1.url)
    assert gw_m["kiloserve_gateway_migrations_total{reason=stall}"] == 1
    assert gw_m["kiloserve_gateway_migrated_tokens_total"] == 4
    assert modes(gw_m) == {"split": 1}
    # d0 pulled the KV (and released it); the continuation recomputed on d1, no pull
    assert first[XFER] == 1 and second.get(XFER, 0) == 0
    assert second["vllm:prompt_tokens_total"] > count_tokens(PROMPT)  # prompt + replayed
    assert served[HELD] == 0
    assert served.get("vllm:nixl_num_kv_expired_reqs_total", 0) == 0


async def test_the_only_decode_twin_stalling_mid_stream_is_continued_whole_elsewhere() -> None:
    """A continuation carries no KV params (it recomputes), so when the split stream's
    decode twin was the model's only one, it goes on a ``both`` twin."""
    async with pd_twins("prefill", "decode", "both") as (p0, d0, b0):
        cfg = pd_gateway({"p0": p0, "d0": d0, "b0": b0}, migration={"stall_timeout_s": 0.5})
        async with running_gateway(cfg) as gw:
            await post_faults(d0.url, {"stall_after_tokens": 3})
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 9, "stream": True}
            async with asyncio.timeout(10.0):
                status, headers, raw = await post(gw, body, "mid-2")
            assert status == 200, raw
            assert headers["x-kiloserve-backend"] == "d0"
            chunks = sse_chunks(raw)
            assert not [c for c in chunks if "error" in c], chunks
            assert len([ch for c in chunks for ch in c["choices"] if ch["text"]]) == 9
            gw_m = await metrics(gw)
        served = await released(p0)
        whole = await metrics(b0.url)
    assert gw_m["kiloserve_gateway_migrations_total{reason=stall}"] == 1
    assert modes(gw_m) == {"split": 1}
    assert whole.get(XFER, 0) == 0 and whole[GENERATED] == 9 - 3
    assert served[HELD] == 0 and served[GENERATED] == 1
