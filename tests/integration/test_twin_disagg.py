"""P/D legs between two live twins on 127.0.0.1: vLLM's ``kv_transfer_params`` protocol.

The GPU is modelled with fixed step times; the transfer time is the twin's own model
(``engine.transfer``), whose exact numbers part A's unit tests pin down. Here: the
two legs by hand, the hold and its release or timeout, the metrics, and the 400s.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import FixedStepTimer, free_port
from kiloserve.catalog import get_gpu
from kiloserve.engine.server import TwinServer
from kiloserve.engine.transfer import kv_transfer_time_s, link_for
from kiloserve.engine.twin import TwinConfig

STEP_S = 0.05
NUM_PROMPT = 32_000  # long enough that its transfer (~0.34 s over 12.5 GB/s) stands out
KV_BYTES_PER_TOKEN = 131_072  # Llama-3.1-8B, bf16, TP 1
PROMPT = [(i * 7919) % 50_000 + 1 for i in range(NUM_PROMPT)]
MODEL = "Llama-3.1-8B"
PREFILL_LEG = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip


def _config(role: str, **kwargs: Any) -> TwinConfig:
    base: dict[str, Any] = {"gpu": "L40S", "model": "llama-3.1-8b", "port": 0, "role": role}
    base.update(api_overhead_s=0.0, **kwargs)
    return TwinConfig(**base)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[TwinServer, TwinServer]]:
    timer = FixedStepTimer(STEP_S)
    async with (
        TwinServer(_config("prefill"), timer=timer) as prefill,
        TwinServer(_config("decode", kv_link="network"), timer=timer) as decode,
    ):
        yield prefill, decode


async def _metrics(url: str) -> dict[str, float]:
    """``/metrics`` samples keyed by name, summed over labels, and by ``name{label=value}``
    for the labels past the twin's own (``model_name``, ``engine``)."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            extra = sorted(
                (k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine")
            )
            if extra:
                labels = ",".join(f"{k}={v}" for k, v in extra)
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


async def _post(url: str, body: dict[str, Any], **headers: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=headers) as resp,
    ):
        return resp.status, await resp.json()


async def _eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def _prefill_leg(prefill: TwinServer, request_id: str, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_LEG}
    status, answer = await _post(
        prefill.url + "/v1/completions", {**body, **extra}, **{"X-Request-Id": request_id}
    )
    assert status == 200, answer
    params: dict[str, Any] = answer["kv_transfer_params"]
    return params


async def _held_blocks(server: TwinServer) -> float:
    return (await _metrics(server.url))["kiloserve:kv_held_blocks"]


def _transfer_s(num_tokens: int) -> float:
    return kv_transfer_time_s(num_tokens, KV_BYTES_PER_TOKEN, link_for(get_gpu("L40S"), "network"))


async def test_two_leg_flow_streams_after_the_modelled_transfer(
    pair: tuple[TwinServer, TwinServer],
) -> None:
    prefill, decode = pair
    params = await _prefill_leg(prefill, "req-1")
    host, port = prefill.url.removeprefix("http://").split(":")
    async with (
        aiohttp.ClientSession() as session,
        session.get(prefill.url + "/kv_transfer/info") as r,
    ):
        info = await r.json()
    assert info["role"] == "prefill"
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == info["engine_id"]
    assert (params["remote_host"], params["remote_port"]) == (host, int(port))
    assert params["remote_request_id"] == "req-1"
    assert params["num_tokens"] == NUM_PROMPT and params["tp_size"] == 1
    assert len(params["remote_block_ids"]) == NUM_PROMPT // 16
    # the prompt's blocks stay held on the prefill twin until the decode leg frees them
    assert await _held_blocks(prefill) == NUM_PROMPT // 16
    assert (await _metrics(prefill.url))["kiloserve:kv_held_requests"] == 1

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True,
            "kv_transfer_params": params}  # fmt: skip
    start_s = time.monotonic()
    chunks: list[bytes] = []
    first_s = None
    async with (
        aiohttp.ClientSession() as session,
        session.post(decode.url + "/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {") and first_s is None:
                first_s = time.monotonic() - start_s
            chunks.append(line)
    assert chunks[-2].strip() == b"data: [DONE]" or chunks[-1].strip() == b"data: [DONE]"
    assert sum(1 for c in chunks if c.startswith(b"data: {")) == 5
    transfer_s = _transfer_s(NUM_PROMPT - 1)
    # TTFT = the transfer + one step (1 token left to prefill) + jitter; had the leg
    # recomputed the prompt it would take the transfer + 16 steps (2048-token chunks)
    assert first_s is not None and transfer_s + STEP_S <= first_s < transfer_s + 10 * STEP_S

    async def released() -> bool:
        return await _held_blocks(prefill) == 0

    await _eventually(released)
    d = await _metrics(decode.url)
    assert d["vllm:nixl_xfer_time_seconds_count"] == 1
    assert d["vllm:nixl_xfer_time_seconds_sum"] == pytest.approx(transfer_s, rel=1e-9)
    assert d["vllm:nixl_bytes_transferred_sum"] == (NUM_PROMPT - 1) * KV_BYTES_PER_TOKEN
    assert d["vllm:nixl_num_failed_notifications_total"] == 0
    assert d["vllm:time_to_first_token_seconds_sum"] >= transfer_s  # vLLM's TTFT includes it
    p = await _metrics(prefill.url)
    assert p["kiloserve:kv_held_requests"] == 0
    assert p["vllm:nixl_num_kv_expired_reqs_total"] == 0


async def test_chat_legs_and_a_second_release_is_404(pair: tuple[TwinServer, TwinServer]) -> None:
    prefill, decode = pair
    messages = [{"role": "user", "content": "the fast node runs all load " * 40}]
    body = {"model": MODEL, "messages": messages, "max_completion_tokens": 1,
            "kv_transfer_params": PREFILL_LEG}  # fmt: skip
    status, answer = await _post(prefill.url + "/v1/chat/completions", body)
    assert status == 200
    params = answer["kv_transfer_params"]
    assert params["num_tokens"] == answer["usage"]["prompt_tokens"]
    assert params["remote_request_id"].startswith("kv-")  # no X-Request-Id: a fresh id
    decode_body = {"model": MODEL, "messages": messages, "max_tokens": 4,
                   "kv_transfer_params": params}  # fmt: skip
    status, out = await _post(decode.url + "/v1/chat/completions", decode_body)
    assert status == 200 and out["usage"]["completion_tokens"] == 4
    assert "kv_transfer_params" not in out

    async def released() -> bool:
        return await _held_blocks(prefill) == 0

    await _eventually(released)
    release = {"request_id": params["remote_request_id"],
               "remote_engine_id": params["remote_engine_id"]}  # fmt: skip
    status, err = await _post(prefill.url + "/kv_transfer/release", release)
    assert status == 404 and err["error"]["param"] == "request_id"


async def test_hold_timeout_frees_the_blocks() -> None:
    config = _config("prefill", kv_hold_timeout_s=0.4)
    async with TwinServer(config, timer=FixedStepTimer(0.01)) as prefill:
        params = await _prefill_leg(prefill, "lonely")
        assert await _held_blocks(prefill) == len(params["remote_block_ids"]) > 0

        async def expired() -> bool:
            return await _held_blocks(prefill) == 0

        await _eventually(expired)
        m = await _metrics(prefill.url)
        assert m["vllm:nixl_num_kv_expired_reqs_total"] == 1
        assert m["kiloserve:kv_held_requests"] == 0
        release = {"request_id": "lonely", "remote_engine_id": params["remote_engine_id"]}
        status, _ = await _post(prefill.url + "/kv_transfer/release", release)
        assert status == 404


async def test_an_unreachable_prefill_engine_is_a_failed_transfer_not_the_clients_error() -> None:
    async with TwinServer(_config("decode"), timer=FixedStepTimer(0.01)) as decode:
        params = {"do_remote_prefill": True, "do_remote_decode": False,
                  "remote_engine_id": "gone", "remote_block_ids": [1, 2],
                  "remote_host": "127.0.0.1", "remote_port": free_port(),
                  "remote_request_id": "r", "num_tokens": 40}  # fmt: skip
        body = {"prompt": PROMPT[:40], "max_tokens": 2, "kv_transfer_params": params}
        status, out = await _post(decode.url + "/v1/completions", body)
        assert status == 200 and out["usage"]["completion_tokens"] == 2
        m = await _metrics(decode.url)
        assert m["vllm:nixl_num_failed_transfers_total"] == 1
        assert m["vllm:nixl_xfer_time_seconds_count"] == 0  # recomputed, nothing pulled
        assert m["vllm:nixl_num_failed_notifications_total"] == 0  # no release to send


async def test_failed_release_is_counted_not_the_clients_error() -> None:
    """The hold expires during the modelled transfer (~0.34 s): the pull found it, the
    release does not."""
    timer = FixedStepTimer(0.01)
    async with (
        TwinServer(_config("prefill", kv_hold_timeout_s=0.2), timer=timer) as prefill,
        TwinServer(_config("decode", kv_link="network"), timer=timer) as decode,
    ):
        params = await _prefill_leg(prefill, "slow-pull")
        body = {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": params}
        status, out = await _post(decode.url + "/v1/completions", body)
        assert status == 200 and out["usage"]["completion_tokens"] == 2

        async def counted() -> bool:
            m = await _metrics(decode.url)
            return m["vllm:nixl_num_failed_notifications_total"] == 1

        await _eventually(counted)
        m = await _metrics(decode.url)
        assert m["vllm:nixl_xfer_time_seconds_count"] == 1
        assert m["vllm:nixl_num_failed_transfers_total"] == 0


async def _ttft_s(url: str, body: dict[str, Any]) -> float:
    """Seconds to the first streamed token of ``body`` (a completion) on ``url``."""
    start_s = time.monotonic()
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json={**body, "stream": True}) as resp,
    ):
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                return time.monotonic() - start_s
    raise AssertionError("no token streamed")


async def test_a_decode_leg_whose_hold_expired_recomputes_the_prompt() -> None:
    timer = FixedStepTimer(STEP_S)
    async with (
        TwinServer(_config("prefill", kv_hold_timeout_s=0.2), timer=timer) as prefill,
        TwinServer(_config("decode", kv_link="network"), timer=timer) as decode,
    ):
        params = await _prefill_leg(prefill, "late")

        async def expired() -> bool:
            return await _held_blocks(prefill) == 0

        await _eventually(expired)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "kv_transfer_params": params}
        first_s = await _ttft_s(decode.url, body)
        # recomputed: the whole prompt's 16 chunked-prefill steps (2048 tokens each), not
        # the transfer (~0.34 s) and one step
        assert first_s >= 16 * STEP_S
        d = await _metrics(decode.url)
        assert d["vllm:nixl_num_failed_transfers_total"] == 1
        assert d["vllm:nixl_xfer_time_seconds_count"] == 0
        assert d["vllm:nixl_bytes_transferred_count"] == 0
        assert d["vllm:nixl_num_failed_notifications_total"] == 0  # no release sent
        assert (await _metrics(prefill.url))["vllm:nixl_num_kv_expired_reqs_total"] == 1


async def test_a_second_decode_leg_for_a_released_hold_recomputes() -> None:
    """As a gateway's decode retry on another decode engine, after the first pulled."""
    timer = FixedStepTimer(STEP_S)
    async with (
        TwinServer(_config("prefill"), timer=timer) as prefill,
        TwinServer(_config("decode", kv_link="network"), timer=timer) as decode,
        TwinServer(_config("decode", kv_link="network"), timer=timer) as other,
    ):
        params = await _prefill_leg(prefill, "twice")
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "kv_transfer_params": params}
        first_s = await _ttft_s(decode.url, body)
        assert first_s < _transfer_s(NUM_PROMPT - 1) + 10 * STEP_S  # the KV arrived

        async def released() -> bool:
            return await _held_blocks(prefill) == 0

        await _eventually(released)
        second_s = await _ttft_s(other.url, body)  # the same params: KV already pulled
        assert second_s >= 16 * STEP_S  # recomputed (no prefix cache there)
        d, o = await _metrics(decode.url), await _metrics(other.url)
        assert d["vllm:nixl_xfer_time_seconds_count"] == 1
        assert d["vllm:nixl_num_failed_transfers_total"] == 0
        assert o["vllm:nixl_xfer_time_seconds_count"] == 0
        assert o["vllm:nixl_num_failed_transfers_total"] == 1


async def test_the_pull_route_checks_the_hold(pair: tuple[TwinServer, TwinServer]) -> None:
    prefill, _ = pair
    url = prefill.url + "/kv_transfer/pull"
    params = await _prefill_leg(prefill, "pulled")
    engine_id = params["remote_engine_id"]
    status, err = await _post(url, {"request_id": "pulled", "remote_engine_id": "other"})
    assert status == 404 and err["error"]["param"] == "remote_engine_id"
    status, out = await _post(url, {"request_id": "pulled", "remote_engine_id": engine_id})
    assert status == 200 and out["num_blocks"] == len(params["remote_block_ids"])
    assert await _held_blocks(prefill) == len(params["remote_block_ids"])  # still held
    status, err = await _post(url, {"request_id": "nope", "remote_engine_id": engine_id})
    assert status == 404 and err["error"]["param"] == "request_id"
    status, err = await _post(url, {"remote_engine_id": engine_id})
    assert status == 400 and err["error"]["param"] == "request_id"


async def test_plain_requests_run_on_every_role(pair: tuple[TwinServer, TwinServer]) -> None:
    for server in pair:
        body = {"prompt": "hello there", "max_tokens": 3, "kv_transfer_params": {
            "do_remote_decode": False, "do_remote_prefill": False}}  # fmt: skip
        status, out = await _post(server.url + "/v1/completions", body)
        assert status == 200 and out["usage"]["completion_tokens"] == 3
        assert "kv_transfer_params" not in out
        assert await _held_blocks(server) == 0


_GOOD = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1],
         "remote_host": "127.0.0.1", "remote_port": 9, "remote_request_id": "r"}  # fmt: skip


@pytest.mark.parametrize(
    ("role", "extra", "param"),
    [
        ("decode", {"kv_transfer_params": "yes"}, "kv_transfer_params"),
        ("decode", {"kv_transfer_params": {**_GOOD, "remote_host": None}},
         "kv_transfer_params.remote_host"),
        ("decode", {"kv_transfer_params": {**_GOOD, "remote_port": 0}},
         "kv_transfer_params.remote_port"),
        ("decode", {"kv_transfer_params": {**_GOOD, "remote_block_ids": ["a"]}},
         "kv_transfer_params.remote_block_ids"),
        ("decode", {"kv_transfer_params": {**_GOOD, "remote_request_id": 3}},
         "kv_transfer_params.remote_request_id"),
        ("decode", {"kv_transfer_params": {**_GOOD, "do_remote_decode": True}},
         "kv_transfer_params.do_remote_prefill"),
        ("decode", {"kv_transfer_params": {**_GOOD, "do_remote_prefill": "true"}},
         "kv_transfer_params.do_remote_prefill"),
        ("decode", {"kv_transfer_params": _GOOD, "n": 2}, "n"),
        ("decode", {"kv_transfer_params": PREFILL_LEG}, "kv_transfer_params.do_remote_decode"),
        ("prefill", {"kv_transfer_params": _GOOD}, "kv_transfer_params.do_remote_prefill"),
        ("prefill", {"kv_transfer_params": PREFILL_LEG, "stream": True}, "stream"),
    ],
)  # fmt: skip
async def test_bad_kv_transfer_params_are_400s_naming_the_field(
    pair: tuple[TwinServer, TwinServer], role: str, extra: dict[str, Any], param: str
) -> None:
    server = pair[0] if role == "prefill" else pair[1]
    status, err = await _post(server.url + "/v1/completions", {"prompt": "hi", **extra})
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["param"] == param
    assert await _held_blocks(server) == 0


async def test_release_route_checks_its_body(pair: tuple[TwinServer, TwinServer]) -> None:
    prefill, _ = pair
    url = prefill.url + "/kv_transfer/release"
    status, err = await _post(url, {"remote_engine_id": "x"})
    assert status == 400 and err["error"]["param"] == "request_id"
    params = await _prefill_leg(prefill, "held")
    status, err = await _post(url, {"request_id": "held", "remote_engine_id": "other"})
    assert status == 404 and err["error"]["param"] == "remote_engine_id"
    assert await _held_blocks(prefill) == len(params["remote_block_ids"])  # still held
    release = {"request_id": "held", "remote_engine_id": params["remote_engine_id"]}
    status, out = await _post(url, release)
    assert status == 200 and out["num_blocks"] == len(params["remote_block_ids"])
    assert await _held_blocks(prefill) == 0


async def test_decode_leg_cancelled_in_transfer_still_releases(
    pair: tuple[TwinServer, TwinServer],
) -> None:
    prefill, decode = pair
    params = await _prefill_leg(prefill, "cut")
    body = {"prompt": PROMPT, "max_tokens": 50, "kv_transfer_params": params}
    timeout = aiohttp.ClientTimeout(total=0.1)  # inside the ~0.34 s transfer
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with pytest.raises(TimeoutError):
            async with session.post(decode.url + "/v1/completions", json=body) as resp:
                await resp.read()

    async def released() -> bool:
        return await _held_blocks(prefill) == 0

    await _eventually(released)
    assert (await _metrics(decode.url))["vllm:nixl_xfer_time_seconds_count"] == 0


async def _complete(url: str, prompt: list[int]) -> None:
    status, out = await _post(url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert status == 200, out


TIER_A = [(i * 31) % 40_000 + 1 for i in range(640)]  # 40 blocks
TIER_B = [(i * 17) % 40_000 + 7 for i in range(960)]  # 60 blocks: evicts A from the GPU


@pytest.mark.parametrize(
    ("cpu_gib", "remote_gib", "tier"),
    [(1.0, 0.0, "cpu"), (8 / 512, 1.0, "remote")],  # 8 CPU blocks of 2 MiB: A goes on
)
async def test_tier_hits_move_on_a_repeated_prefix_after_eviction(
    cpu_gib: float, remote_gib: float, tier: str
) -> None:
    config = _config(
        "both", num_gpu_blocks_override=65, kv_cpu_gib=cpu_gib, kv_remote_gib=remote_gib
    )
    async with TwinServer(config, timer=FixedStepTimer(0.005)) as twin:
        await _complete(twin.url, TIER_A)
        await _complete(twin.url, TIER_B)
        m = await _metrics(twin.url)
        assert m["kiloserve:kv_tier_offloaded_blocks_total"] > 0
        assert m["vllm:external_prefix_cache_hits_total"] == 0
        await _complete(twin.url, TIER_A)
        m = await _metrics(twin.url)
    hits = m["vllm:external_prefix_cache_hits_total"]
    assert hits >= 16 * 30  # most of A's 40 blocks came back from a tier
    assert m["vllm:external_prefix_cache_queries_total"] >= hits
    assert m["kiloserve:kv_tier_loaded_bytes_total"] == hits // 16 * 16 * KV_BYTES_PER_TOKEN
    assert m["kiloserve:kv_tier_load_seconds_total"] > 0
    by_tier = {t: m[f"kiloserve:kv_tier_hit_tokens_total{{tier={t}}}"] for t in ("cpu", "remote")}
    assert by_tier["cpu"] + by_tier["remote"] == hits
    # CPU tier of 1 GiB: every hit is a CPU hit; of 8 blocks: the older blocks went on
    assert by_tier["remote"] == 0 if tier == "cpu" else by_tier["remote"] >= 16 * 20
    assert m[f"kiloserve:kv_tier_usage_perc{{tier={tier}}}"] > 0
    moved_in = m["vllm:kv_offload_total_bytes_total{transfer_type=CPU_to_GPU}"]
    assert moved_in == by_tier["cpu"] * KV_BYTES_PER_TOKEN  # vLLM's name: the CPU tier only


async def test_no_tier_metrics_without_tiers(pair: tuple[TwinServer, TwinServer]) -> None:
    m = await _metrics(pair[0].url)
    assert "vllm:external_prefix_cache_hits_total" not in m
    assert m["kiloserve:engine_role_info"] == 1


def _start_engine(procs: list[subprocess.Popen[bytes]], *args: str) -> str:
    """Start a ``kiloserve engine`` on port 0 (added to ``procs``); the URL it logged."""
    cmd = [sys.executable, "-m", "kiloserve", "engine", "--gpu", "L40S", "--model",
           "llama-3.1-8b", "--port", "0", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    procs.append(proc)
    assert proc.stderr is not None
    line = b""
    deadline = time.monotonic() + 20
    while b"listening on " not in line and time.monotonic() < deadline and proc.poll() is None:
        line = proc.stderr.readline()
    assert b"listening on " in line, f"engine exited {proc.poll()}"
    role = args[args.index("--role") + 1]
    assert f"role {role}".encode() in line
    return line.decode().rsplit("listening on ", 1)[1].strip()


async def test_two_engine_processes_run_both_legs() -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        prefill_url = _start_engine(procs, "--role", "prefill", "--kv-hold-timeout-s", "60")
        decode_url = _start_engine(procs, "--role", "decode", "--kv-link", "pcie")
        async with (
            aiohttp.ClientSession() as session,
            session.get(decode_url + "/kv_transfer/info") as resp,
        ):
            info = await resp.json()
        assert info["role"] == "decode" and info["kv_link"]["name"] == "pcie"
        body = {"prompt": PROMPT[:2000], "max_tokens": 1, "kv_transfer_params": PREFILL_LEG}
        status, answer = await _post(prefill_url + "/v1/completions", body)
        assert status == 200
        params = answer["kv_transfer_params"]
        assert len(params["remote_block_ids"]) == 2000 // 16
        decode_body = {"prompt": PROMPT[:2000], "max_tokens": 3, "kv_transfer_params": params}
        status, out = await _post(decode_url + "/v1/completions", decode_body)
        assert status == 200 and out["usage"]["completion_tokens"] == 3

        async def released() -> bool:
            return (await _metrics(prefill_url))["kiloserve:kv_held_blocks"] == 0

        await _eventually(released)
        d = await _metrics(decode_url)
        pcie = link_for(get_gpu("L40S"), "pcie")
        expected_s = kv_transfer_time_s(1999, KV_BYTES_PER_TOKEN, pcie)
        assert d["vllm:nixl_xfer_time_seconds_sum"] == pytest.approx(expected_s, rel=1e-9)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
    assert [proc.returncode for proc in procs] == [0, 0]
