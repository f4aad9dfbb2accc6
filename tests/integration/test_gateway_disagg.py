"""The gateway's disaggregated prefill/decode flow (gateway/disagg.py) against fakes that
speak vLLM's P/D proxy protocol: the prefill leg's request shape, the decode leg's
params and request id, failover of each half, the split rule, and the admin/metrics
views. Real servers on 127.0.0.1; nothing mocked but the engines' GPU work."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from test_gateway_fakes import (
    FakeBackend,
    admin_backends,
    fake_backends,
    gateway_config,
    running_gateway,
    wait_until_ready,
)

from conftest import FixedStepTimer
from kiloserve.engine.server import TwinServer
from kiloserve.engine.twin import TwinConfig
from kiloserve.gateway.app import create_gateway_app
from kiloserve.gateway.config import load_gateway_config
from kiloserve.gateway.disagg import PREFILL_KV_PARAMS
from kiloserve.gateway.reload import RELOAD_KEY

LONG_PROMPT = "tell me a long story about the sea " * 40  # ~300 tokens: over the threshold
SHORT_PROMPT = "hi"
TWIN_MODEL = "Llama-3.1-8B"


@dataclass
class PdFake(FakeBackend):
    """A ``FakeBackend`` that answers a prefill leg as vLLM's NixlConnector does: the
    completion plus ``kv_transfer_params`` naming this engine and its blocks."""

    engine_id: str = "engine"
    omit_params: bool = False  # answer a prefill leg without kv_transfer_params
    prefill_s: float = 0.0  # a prefill leg's compute time

    def _params(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": [3, 4, 5],
            "remote_host": "127.0.0.1",
            "remote_port": 1234,
            "tp_size": 1,
        }

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        kv = body.get("kv_transfer_params")
        if not (isinstance(kv, dict) and kv.get("do_remote_decode")) or self.mode != "ok":
            return await super()._generate(request)
        self.bodies.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if self.prefill_s:
            await asyncio.sleep(self.prefill_s)
        answer: dict[str, Any] = {
            "id": "cmpl-p",
            "object": "text_completion",
            "model": body.get("model"),
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 300, "completion_tokens": 1, "total_tokens": 301},
        }
        if not self.omit_params:
            answer["kv_transfer_params"] = self._params()
        return web.json_response(answer)


@contextlib.asynccontextmanager
async def running_app(app: web.Application) -> AsyncIterator[str]:
    """Serve a built gateway app on 127.0.0.1:0 until ready; yield its base URL."""
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


def _backends(*fakes: tuple[str, str, FakeBackend]) -> list[dict[str, Any]]:
    return [{"url": f.url, "name": n, "models": ["m"], "role": r} for n, r, f in fakes]


def _pd_config(*fakes: tuple[str, str, FakeBackend], **kw: Any) -> Any:
    kw.setdefault("disagg", {"min_prompt_tokens": 64, "transfer_timeout_s": 5.0})
    return gateway_config(_backends(*fakes), **kw)


async def _post(
    gw: str, body: dict[str, Any], path: str = "/v1/completions", rid: str = "req-1"
) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw + path, json=body, headers={"x-request-id": rid}) as r,
    ):
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


async def _metric(gw: str, line_start: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(gw + "/metrics") as r:
        text = await r.text()
    values = [float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line_start)]
    return sum(values)


def _is_prefill_leg(body: dict[str, Any]) -> bool:
    return body.get("kv_transfer_params") == PREFILL_KV_PARAMS


async def test_split_completion_speaks_vllm_protocol() -> None:
    p, d, b = PdFake(engine_id="P0"), PdFake(engine_id="D0"), PdFake(engine_id="B0")
    async with fake_backends(p, d, b):
        cfg = _pd_config(("p", "prefill", p), ("d", "decode", d), ("b", "both", b))
        async with running_gateway(cfg) as gw:
            body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 7, "min_tokens": 2}
            status, headers, raw = await _post(gw, body)
            assert status == 200, raw
            assert headers["x-kiloserve-backend"] == "d"
            assert headers["x-request-id"] == "req-1"
            assert await _metric(gw, 'kiloserve_gateway_disagg_requests_total{mode="split"}') == 1
            assert await _metric(gw, "kiloserve_gateway_disagg_prefill_seconds_count") == 1
    assert b.bodies == []
    (leg1,), (leg2,) = p.bodies, d.bodies
    assert leg1["max_tokens"] == 1 and leg1["stream"] is False
    assert "min_tokens" not in leg1 and "stream_options" not in leg1
    assert leg1["kv_transfer_params"] == PREFILL_KV_PARAMS
    assert leg1["prompt"] == LONG_PROMPT
    assert leg2["max_tokens"] == 7 and leg2["min_tokens"] == 2 and "stream" not in leg2
    assert leg2["kv_transfer_params"] == p._params()  # the prefill's own answer
    assert p.headers[0]["x-request-id"] == d.headers[0]["x-request-id"] == "req-1"


async def test_split_streamed_chat_keeps_the_clients_stream() -> None:
    p, d = PdFake(engine_id="P0"), PdFake(engine_id="D0", num_chunks=4)
    async with fake_backends(p, d):
        cfg = _pd_config(("p", "prefill", p), ("d", "decode", d))
        async with running_gateway(cfg) as gw:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],  # short: no both backend
                "max_completion_tokens": 9,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            status, headers, raw = await _post(gw, body, "/v1/chat/completions", "chat-7")
    assert status == 200
    assert headers["x-kiloserve-backend"] == "d"
    assert raw.count(b"data: ") == 6  # 4 chunks, usage, [DONE]
    (leg1,), (leg2,) = p.bodies, d.bodies
    assert leg1["max_tokens"] == 1 and leg1["max_completion_tokens"] == 1
    assert leg1["stream"] is False and "stream_options" not in leg1
    assert leg2["stream"] is True and leg2["max_completion_tokens"] == 9
    assert leg2["stream_options"] == {"include_usage": True}
    assert leg2["kv_transfer_params"]["remote_engine_id"] == "P0"
    assert p.headers[0]["x-request-id"] == d.headers[0]["x-request-id"] == "chat-7"


async def test_short_prompts_go_to_a_both_backend() -> None:
    p, d, b = PdFake(), PdFake(), PdFake()
    async with fake_backends(p, d, b):
        cfg = _pd_config(("p", "prefill", p), ("d", "decode", d), ("b", "both", b))
        async with running_gateway(cfg) as gw:
            for i in range(4):
                body = {"model": "m", "prompt": SHORT_PROMPT, "max_tokens": 3}
                status, headers, _ = await _post(gw, body, rid=f"s{i}")
                assert status == 200 and headers["x-kiloserve-backend"] == "b"
            colocated = 'kiloserve_gateway_disagg_requests_total{mode="colocated"}'
            assert await _metric(gw, colocated) == 4
    assert p.bodies == [] and d.bodies == []
    assert all("kv_transfer_params" not in x for x in b.bodies)


async def test_unsplit_traffic_avoids_pd_backends() -> None:
    p, d, b1, b2 = PdFake(), PdFake(), PdFake(), PdFake()
    async with fake_backends(p, d, b1, b2):
        cfg = _pd_config(
            ("p", "prefill", p), ("d", "decode", d), ("b1", "both", b1), ("b2", "both", b2),
            disagg={"enabled": False},
        )  # fmt: skip
        async with running_gateway(cfg) as gw:
            for i in range(6):  # round robin over the pool: only both backends take them
                body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 3}
                status, _, _ = await _post(gw, body, rid=f"u{i}")
                assert status == 200
    assert p.bodies == [] and d.bodies == []
    assert len(b1.bodies) + len(b2.bodies) == 6 and b1.bodies and b2.bodies


async def test_whole_requests_fail_over_to_decode_backends() -> None:
    p, d, b = PdFake(), PdFake(), PdFake(mode="500")
    async with fake_backends(p, d, b):
        cfg = _pd_config(("p", "prefill", p), ("d", "decode", d), ("b", "both", b))
        async with running_gateway(cfg) as gw:
            body = {"model": "m", "prompt": SHORT_PROMPT, "max_tokens": 3}
            status, headers, _ = await _post(gw, body)
    assert status == 200 and headers["x-kiloserve-backend"] == "d"
    assert len(b.bodies) == 1 and p.bodies == []
    assert "kv_transfer_params" not in d.bodies[0]


async def test_prefill_failure_moves_to_another_prefill() -> None:
    p_bad, p_ok, d = PdFake(mode="500"), PdFake(engine_id="P-ok"), PdFake()
    async with fake_backends(p_bad, p_ok, d):
        cfg = _pd_config(("p-bad", "prefill", p_bad), ("p-ok", "prefill", p_ok), ("d", "decode", d))
        async with running_gateway(cfg) as gw:
            for i in range(2):  # round robin puts each prefill first once
                body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 3}
                status, headers, _ = await _post(gw, body, rid=f"f{i}")
                assert status == 200 and headers["x-kiloserve-backend"] == "d"
            retries = 'kiloserve_gateway_retries_total{backend="p-bad",reason="prefill_http_500"}'
            num_retries = await _metric(gw, retries)
            assert await _metric(gw, 'kiloserve_gateway_disagg_requests_total{mode="split"}') == 2
    assert p_bad.bodies and num_retries == len(p_bad.bodies)  # the first try went there
    assert all(_is_prefill_leg(x) for x in p_bad.bodies)
    assert len(p_ok.bodies) == 2
    assert [x["kv_transfer_params"]["remote_engine_id"] for x in d.bodies] == ["P-ok", "P-ok"]


async def test_prefill_timeout_moves_on() -> None:
    p_hang, p_ok = PdFake(mode="hang"), PdFake(engine_id="P2")
    d = PdFake()
    async with fake_backends(p_hang, p_ok, d):
        cfg = _pd_config(
            ("p-hang", "prefill", p_hang), ("p-ok", "prefill", p_ok), ("d", "decode", d),
            disagg={"min_prompt_tokens": 64, "transfer_timeout_s": 0.3},
        )  # fmt: skip
        async with running_gateway(cfg) as gw:
            body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 3}
            status, headers, _ = await _post(gw, body)
            assert status == 200 and headers["x-kiloserve-backend"] == "d"
            rows = await admin_backends(gw)
            retries = "kiloserve_gateway_retries_total{"
            timeout = await _metric(gw, retries + 'backend="p-hang",reason="prefill_timeout"}')
            assert timeout == 1
    assert len(p_hang.bodies) == 1
    assert d.bodies[0]["kv_transfer_params"]["remote_engine_id"] == "P2"
    assert p_hang.num_aborted == 1  # the timed-out leg was closed: the engine aborts it
    assert rows["p-hang"]["in_flight"] == 0 and rows["p-ok"]["in_flight"] == 0


async def test_prefill_answer_without_params_sends_the_decode_leg_bare() -> None:
    """vLLM's ExampleConnector (KV through shared storage) answers the prefill leg with
    ``kv_transfer_params: null``: the decode leg still goes, without params (real vLLM:
    tests/integration/real/test_real_vllm_disagg.py)."""
    p_bare, d = PdFake(omit_params=True), PdFake()
    async with fake_backends(p_bare, d):
        cfg = _pd_config(("p-bare", "prefill", p_bare), ("d", "decode", d))
        async with running_gateway(cfg) as gw:
            body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 3}
            status, headers, _ = await _post(gw, body)
            split = 'kiloserve_gateway_disagg_requests_total{mode="split"}'
            assert await _metric(gw, split) == 1
    assert status == 200 and headers["x-kiloserve-backend"] == "d"
    assert len(p_bare.bodies) == 1 and p_bare.bodies[0]["max_tokens"] == 1
    (decode,) = d.bodies
    assert "kv_transfer_params" not in decode and decode["max_tokens"] == 3


async def test_all_prefill_down_runs_whole_on_decode() -> None:
    p, d = PdFake(mode="500"), PdFake()
    async with fake_backends(p, d):
        cfg = _pd_config(("p", "prefill", p), ("d", "decode", d))
        async with running_gateway(cfg) as gw:
            body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 3, "stream": True}
            status, headers, raw = await _post(gw, body)
            fallback = 'kiloserve_gateway_disagg_requests_total{mode="fallback"}'
            assert await _metric(gw, fallback) == 1
    assert status == 200 and headers["x-kiloserve-backend"] == "d"
    assert raw.endswith(b"data: [DONE]\n\n")
    (whole,) = d.bodies
    assert "kv_transfer_params" not in whole and whole["max_tokens"] == 3


async def test_decode_failure_moves_to_another_decode_with_the_same_params() -> None:
    p, d_bad, d_ok = PdFake(engine_id="P0"), PdFake(mode="500"), PdFake()
    async with fake_backends(p, d_bad, d_ok):
        cfg = _pd_config(("p", "prefill", p), ("d-bad", "decode", d_bad), ("d-ok", "decode", d_ok))
        async with running_gateway(cfg) as gw:
            body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 3}
            status, headers, _ = await _post(gw, body)
    assert status == 200 and headers["x-kiloserve-backend"] == "d-ok"
    assert len(p.bodies) == 1  # one prefill leg only
    assert d_bad.bodies[0]["kv_transfer_params"] == d_ok.bodies[0]["kv_transfer_params"]
    assert d_ok.bodies[0]["kv_transfer_params"]["remote_engine_id"] == "P0"


async def test_all_decode_down_runs_whole_elsewhere() -> None:
    p, d, b = PdFake(), PdFake(mode="500"), PdFake()
    async with fake_backends(p, d, b):
        cfg = _pd_config(("p", "prefill", p), ("d", "decode", d), ("b", "both", b))
        async with running_gateway(cfg) as gw:
            body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 3}
            status, headers, _ = await _post(gw, body)
            fallback = 'kiloserve_gateway_disagg_requests_total{mode="fallback"}'
            assert await _metric(gw, fallback) == 1
    assert status == 200 and headers["x-kiloserve-backend"] == "b"
    assert "kv_transfer_params" not in b.bodies[0]


async def test_prefill_client_error_is_relayed() -> None:
    p, d = PdFake(mode="400"), PdFake()
    async with fake_backends(p, d):
        cfg = _pd_config(("p", "prefill", p), ("d", "decode", d))
        async with running_gateway(cfg) as gw:
            body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 3}
            status, headers, raw = await _post(gw, body)
    assert status == 400 and headers["x-kiloserve-backend"] == "p"
    assert orjson.loads(raw)["error"]["message"] == "fake 400"
    assert d.bodies == []


async def test_prefill_leg_holds_the_prefill_backend_in_flight() -> None:
    p, d = PdFake(), PdFake()
    async with fake_backends(p, d):
        cfg = _pd_config(("p", "prefill", p), ("d", "decode", d))
        async with running_gateway(cfg) as gw:
            p.mode = "hang"  # the leg waits: a prefill still computing
            body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 3}
            task = asyncio.create_task(_post(gw, body))
            for _ in range(100):
                await asyncio.sleep(0.02)
                if p.num_active:
                    break
            rows = await admin_backends(gw)
            task.cancel()
    assert rows["p"]["in_flight"] == 1 and rows["d"]["in_flight"] == 0


async def test_client_gone_during_the_prefill_leg_frees_every_count() -> None:
    """A client that leaves while its prefill leg computes: the leg is closed (the
    engine aborts it), the prefill backend's in-flight count returns to 0, no decode
    leg is sent and the prefill backend is not counted as failing."""
    p, d = PdFake(mode="hang"), PdFake()
    async with fake_backends(p, d):
        cfg = _pd_config(("p", "prefill", p), ("d", "decode", d))
        async with running_gateway(cfg) as gw:
            body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 3}
            task = asyncio.create_task(_post(gw, body))
            for _ in range(100):
                await asyncio.sleep(0.02)
                if p.num_active:
                    break
            assert p.num_active == 1
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for _ in range(100):
                await asyncio.sleep(0.02)
                rows = await admin_backends(gw)
                if rows["p"]["in_flight"] == 0 and p.num_aborted:
                    break
            rows = await admin_backends(gw)
            retries = await _metric(gw, "kiloserve_gateway_retries_total{")
            p.mode = "ok"  # the backend is usable at once: not counted a failure
            status, headers, _ = await _post(gw, body, rid="req-2")
    assert rows["p"]["in_flight"] == 0 and rows["d"]["in_flight"] == 0
    assert p.num_aborted == 1 and retries == 0
    assert not any(b.get("kv_transfer_params") for b in d.bodies[:-1])  # no decode leg before
    assert status == 200 and headers["x-kiloserve-backend"] == "d"
    assert len(d.bodies) == 1 and d.bodies[0]["kv_transfer_params"]["remote_engine_id"]


async def test_decode_backend_is_chosen_when_the_prefill_leg_is_done() -> None:
    """Requests whose prefill legs overlap spread over the decode backends: each decode
    leg is ranked when its prefill answer is in, so it sees the decode legs sent before
    it in flight (ranked at arrival, every one of them would pick the same backend).
    The decode legs stream for 3 s, so they all overlap even when a busy box staggers
    the prefill answers (non-streamed, they ended at once: 2 of ~14 loaded runs saw a
    decode leg end before the next prefill answer, and the next leg chose its backend)."""
    p = PdFake(prefill_s=0.3)
    d1, d2 = PdFake(num_chunks=3, chunk_delay_s=1.0), PdFake(num_chunks=3, chunk_delay_s=1.0)
    async with fake_backends(p, d1, d2):
        cfg = _pd_config(("p", "prefill", p), ("d1", "decode", d1), ("d2", "decode", d2))
        async with running_gateway(cfg) as gw:
            body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 3, "stream": True}
            got = await asyncio.gather(*(_post(gw, body, rid=f"r{i}") for i in range(4)))
    assert [status for status, _, _ in got] == [200] * 4
    served = sorted(headers["x-kiloserve-backend"] for _, headers, _ in got)
    assert served == ["d1", "d1", "d2", "d2"]
    assert len(d1.bodies) == len(d2.bodies) == 2


async def test_admin_shows_roles_and_the_disagg_section() -> None:
    p, d = PdFake(), PdFake()
    async with fake_backends(p, d):
        cfg = _pd_config(("p", "prefill", p), ("d", "decode", d))
        async with running_gateway(cfg) as gw:
            rows = await admin_backends(gw)
            async with aiohttp.ClientSession() as s, s.get(gw + "/admin/config") as r:
                config = await r.json()
    assert rows["p"]["role"] == "prefill" and rows["d"]["role"] == "decode"
    assert config["disagg"] == {
        "enabled": True,
        "min_prompt_tokens": 64,
        "transfer_timeout_s": 5.0,
    }


async def _twin_metrics(url: str) -> dict[str, float]:
    """A twin's ``/metrics`` samples by name, summed over labels."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


@contextlib.asynccontextmanager
async def _pd_twins() -> AsyncIterator[list[TwinServer]]:
    """Three live twins, one per role, on 127.0.0.1 (the GPU steps modelled)."""
    async with contextlib.AsyncExitStack() as stack:
        servers = []
        for role in ("prefill", "decode", "both"):
            cfg = TwinConfig(
                gpu="H100-SXM", model="llama-3.1-8b", port=0, api_overhead_s=0.0, role=role
            )
            servers.append(
                await stack.enter_async_context(TwinServer(cfg, timer=FixedStepTimer(0.002)))
            )
        yield servers


async def test_live_twins_in_three_roles() -> None:
    async with _pd_twins() as (p, d, b):
        backends = [
            {"url": t.url, "name": name, "role": name}
            for name, t in (("prefill", p), ("decode", d), ("both", b))
        ]
        cfg = gateway_config(
            backends, policy={"name": "default"}, disagg={"min_prompt_tokens": 256}
        )
        async with running_gateway(cfg) as gw:
            body = {"model": TWIN_MODEL, "prompt": LONG_PROMPT * 3, "max_tokens": 6}
            status, headers, raw = await _post(gw, body, rid="live-1")
            assert status == 200, raw
            assert headers["x-kiloserve-backend"] == "decode"
            assert orjson.loads(raw)["usage"]["completion_tokens"] == 6
            chat = {
                "model": TWIN_MODEL,
                "messages": [{"role": "user", "content": LONG_PROMPT * 3}],
                "max_tokens": 4,
                "stream": True,
            }
            status, headers, raw = await _post(gw, chat, "/v1/chat/completions", "live-2")
            assert status == 200 and headers["x-kiloserve-backend"] == "decode"
            assert raw.rstrip().endswith(b"data: [DONE]")
            short = {"model": TWIN_MODEL, "prompt": SHORT_PROMPT, "max_tokens": 3}
            status, headers, _ = await _post(gw, short, rid="live-3")
            assert status == 200 and headers["x-kiloserve-backend"] == "both"
            split = 'kiloserve_gateway_disagg_requests_total{mode="split"}'
            assert await _metric(gw, split) == 2
        held = {}
        for _ in range(100):  # the decode twin releases the prefill's blocks after its pull
            held = await _twin_metrics(p.url)
            if held.get("kiloserve:kv_held_blocks") == 0:
                break
            await asyncio.sleep(0.02)
        decoded, whole = await _twin_metrics(d.url), await _twin_metrics(b.url)
    assert held.get("kiloserve:kv_held_blocks") == 0
    assert held["vllm:generation_tokens_total"] == 2  # two prefill legs, one token each
    assert decoded["vllm:nixl_xfer_time_seconds_count"] == 2
    assert decoded["vllm:nixl_bytes_transferred_sum"] > 0
    assert whole.get("vllm:nixl_xfer_time_seconds_count", 0) == 0


async def test_reload_changes_roles_and_the_rule_live(tmp_path: Path) -> None:
    p, d, b = PdFake(), PdFake(), PdFake()
    async with fake_backends(p, d, b):
        path = tmp_path / "gateway.yaml"

        def write(roles: tuple[str, str, str], min_prompt_tokens: int) -> None:
            cfg = _pd_config(("p", roles[0], p), ("d", roles[1], d), ("b", roles[2], b))
            data = cfg.model_dump(mode="json")
            data["disagg"]["min_prompt_tokens"] = min_prompt_tokens
            path.write_text(yaml.safe_dump(data))

        write(("prefill", "decode", "both"), 64)
        app = create_gateway_app(load_gateway_config(path))
        app[RELOAD_KEY].source = lambda: load_gateway_config(path)
        async with running_app(app) as gw:
            body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 3}
            assert (await _post(gw, body, rid="r1"))[1]["x-kiloserve-backend"] == "d"
            write(("prefill", "decode", "both"), 100_000)  # long prompts stay whole now
            async with aiohttp.ClientSession() as s, s.post(gw + "/admin/reload") as r:
                assert r.status == 200, await r.text()
            assert (await _post(gw, body, rid="r2"))[1]["x-kiloserve-backend"] == "b"
            write(("both", "both", "both"), 64)  # roles gone: plain routing again
            async with aiohttp.ClientSession() as s, s.post(gw + "/admin/reload") as r:
                assert r.status == 200, await r.text()
            rows = await admin_backends(gw)
    assert {row["role"] for row in rows.values()} == {"both"}
    assert len(p.bodies) == 1 and len(d.bodies) == 1 and len(b.bodies) == 1


async def test_split_under_admission_control() -> None:
    p, d, b = PdFake(engine_id="P0"), PdFake(), PdFake()
    async with fake_backends(p, d, b):
        admission = {"enabled": True, "tick_s": 0.01, "capacity": {}}
        cfg = _pd_config(
            ("p", "prefill", p), ("d", "decode", d), ("b", "both", b), admission=admission
        )
        async with running_gateway(cfg) as gw:
            body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 3, "stream": True}
            results = await asyncio.gather(*(_post(gw, body, rid=f"a{i}") for i in range(3)))
            short = {"model": "m", "prompt": SHORT_PROMPT, "max_tokens": 3}
            status, headers, _ = await _post(gw, short, rid="a-short")
            rows = await admin_backends(gw)
    assert [(s, h["x-kiloserve-backend"]) for s, h, _ in results] == [(200, "d")] * 3
    assert status == 200 and headers["x-kiloserve-backend"] == "b"
    assert len(p.bodies) == 3 and all(_is_prefill_leg(x) for x in p.bodies)
    assert all(x["kv_transfer_params"]["remote_engine_id"] == "P0" for x in d.bodies)
    assert all(row["in_flight"] == 0 for row in rows.values())
