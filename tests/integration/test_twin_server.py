"""The engine twin's HTTP API, served for real on 127.0.0.1 (only the GPU is modelled)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import FixedStepTimer
from kiloserve.engine.faults import FaultSet
from kiloserve.engine.protocol import natural_output_tokens, output_text, render_chat
from kiloserve.engine.server import TwinServer
from kiloserve.engine.twin import TwinConfig
from kiloserve.errors import ConfigError
from kiloserve.tokens import count_tokens, tokenize

PROMPT = "the fast node runs all load for the team"


def _config(**kwargs: Any) -> TwinConfig:
    base: dict[str, Any] = {"gpu": "H100-SXM", "model": "llama-3.1-8b", "port": 0}
    base.update(kwargs)
    return TwinConfig(**base)


@pytest.fixture
async def twin() -> AsyncIterator[TwinServer]:
    async with TwinServer(_config(api_overhead_s=0.0)) as server:
        yield server


def _client(server: TwinServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


async def _metrics(url: str) -> dict[str, float]:
    """Samples of ``/metrics`` keyed by ``name{label=value,...}`` (labels sorted)."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def _key(name: str, **extra: str) -> str:
    """Sample key as ``_metrics`` builds it: the twin's labels plus ``extra``, sorted."""
    labels = {"engine": "0", "model_name": "Llama-3.1-8B", **extra}
    return name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


async def test_completion_non_stream_with_openai_client(twin: TwinServer) -> None:
    async with _client(twin) as client:
        out = await client.completions.create(model="Llama-3.1-8B", prompt=PROMPT, max_tokens=7)
    assert out.object == "text_completion"
    assert out.model == "Llama-3.1-8B"
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text == output_text(7)
    assert out.usage is not None
    assert out.usage.prompt_tokens == count_tokens(PROMPT)
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == count_tokens(PROMPT) + 7
    assert len(tokenize(out.choices[0].text)) == 7


async def test_chat_stream_with_usage(twin: TwinServer) -> None:
    messages: Any = [{"role": "user", "content": PROMPT}]
    async with _client(twin) as client:
        stream = await client.chat.completions.create(
            model="Llama-3.1-8B",
            messages=messages,
            max_completion_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == output_text(5)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.prompt_tokens == len(tokenize(render_chat(messages)))
    assert usage.completion_tokens == 5
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")


async def test_completion_stream_and_chat_non_stream(twin: TwinServer) -> None:
    async with _client(twin) as client:
        stream = await client.completions.create(
            model="Llama-3.1-8B", prompt=PROMPT, max_tokens=4, stream=True
        )
        texts = [c.choices[0].text async for c in stream]
        chat = await client.chat.completions.create(
            model="Llama-3.1-8B", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    assert "".join(texts) == output_text(4) and len(texts) == 4
    assert chat.choices[0].message.content == output_text(3)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens == 3


async def test_natural_length_without_max_tokens() -> None:
    config = _config(max_model_len=400, api_overhead_s=0.0, faults=FaultSet(slowdown=0.05))
    async with TwinServer(config) as server, _client(server) as client:
        natural = await client.completions.create(model="Llama-3.1-8B", prompt=PROMPT)
        capped = await client.completions.create(
            model="Llama-3.1-8B", prompt=PROMPT, extra_body={"ignore_eos": True}
        )
    expected = natural_output_tokens(tokenize(PROMPT))
    assert natural.usage is not None and natural.usage.completion_tokens == expected
    assert natural.choices[0].finish_reason == "stop"
    assert capped.usage is not None
    assert capped.usage.completion_tokens == 400 - count_tokens(PROMPT)
    assert capped.choices[0].finish_reason == "length"


async def test_info_endpoints(twin: TwinServer) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(twin.url + "/health") as resp:
            assert resp.status == 200 and await resp.read() == b""
        async with session.get(twin.url + "/v1/models") as resp:
            card = (await resp.json())["data"][0]
        assert card["id"] == "Llama-3.1-8B" and card["owned_by"] == "kiloserve"
        assert card["max_model_len"] == 131072
        async with session.get(twin.url + "/version") as resp:
            assert "version" in await resp.json()
        async with session.post(twin.url + "/tokenize", json={"prompt": PROMPT}) as resp:
            tok = await resp.json()
        assert tok == {"count": 9, "max_model_len": 131072, "tokens": tokenize(PROMPT)}
        messages = [{"role": "user", "content": PROMPT}]
        async with session.post(twin.url + "/tokenize", json={"messages": messages}) as resp:
            assert (await resp.json())["count"] == len(tokenize(render_chat(messages)))


async def test_served_name_and_case_insensitive_catalog() -> None:
    config = _config(model="LLAMA-3.1-8B", gpu="h100-sxm", served_model_name="my-llama")
    async with TwinServer(config) as server, _client(server) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["my-llama"]
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="Llama-3.1-8B", prompt="x", max_tokens=1)


async def test_metrics_follow_vllm_names(twin: TwinServer) -> None:
    async with _client(twin) as client:
        for _ in range(3):
            await client.completions.create(model="Llama-3.1-8B", prompt=PROMPT, max_tokens=6)
    m = await _metrics(twin.url)
    assert m[_key("vllm:prompt_tokens_total")] == 3 * count_tokens(PROMPT)
    assert m[_key("vllm:generation_tokens_total")] == 18
    assert m[_key("vllm:request_success_total", finished_reason="length")] == 3
    assert m[_key("vllm:request_success_total", finished_reason="abort")] == 0
    assert m[_key("vllm:time_to_first_token_seconds_count")] == 3
    assert m[_key("vllm:inter_token_latency_seconds_count")] == 15
    assert m[_key("vllm:e2e_request_latency_seconds_count")] == 3
    assert m[_key("vllm:time_to_first_token_seconds_bucket", le="2560.0")] == 3
    assert m[_key("vllm:request_queue_time_seconds_count")] == 3  # one per request, sequential
    assert m[_key("vllm:request_queue_time_seconds_bucket", le="0.3")] == 3  # none waited
    assert m[_key("vllm:num_requests_running")] == 0
    assert m[_key("vllm:kv_cache_usage_perc")] == 0
    # the same prompt three times: later requests hit the prefix cache
    assert m[_key("vllm:prefix_cache_queries_total")] > 0
    assert _key("vllm:num_preemptions_total") in m
    assert "kiloserve_twin_loop_lag_seconds{}" in m


async def _read_events(resp: aiohttp.ClientResponse, num_events: int) -> list[bytes]:
    events: list[bytes] = []
    buffer = b""
    while len(events) < num_events:
        buffer += await resp.content.readany()
        *done, buffer = buffer.split(b"\n\n")
        events.extend(done)
    return events


async def _wait_for(url: str, key: str, value: float, timeout_s: float = 3.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = await _metrics(url)
        if m.get(key) == value or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.05)


@pytest.fixture(params=[True, False], ids=["cancel-handler", "watcher-only"])
async def twin_any(request: pytest.FixtureRequest) -> AsyncIterator[TwinServer]:
    """A twin with and without aiohttp's handler cancellation on disconnect."""
    config = _config(api_overhead_s=0.0)
    async with TwinServer(config, handler_cancellation=request.param) as server:
        yield server


async def test_stream_disconnect_aborts_and_frees_blocks(twin_any: TwinServer) -> None:
    twin = twin_any
    body = {"prompt": PROMPT * 40, "max_tokens": 5000, "stream": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(twin.url + "/v1/completions", json=body)
        await _read_events(resp, 3)
        m = await _metrics(twin.url)
        assert m[_key("vllm:num_requests_running")] == 1
        assert m[_key("vllm:kv_cache_usage_perc")] > 0
        resp.close()  # drop the connection mid-stream
    abort_key = _key("vllm:request_success_total", finished_reason="abort")
    m = await _wait_for(twin.url, abort_key, 1)
    assert m[abort_key] == 1
    assert m[_key("vllm:num_requests_running")] == 0
    assert m[_key("vllm:kv_cache_usage_perc")] == 0
    assert m[_key("vllm:generation_tokens_total")] < 5000
    assert twin.twin.loop.num_active == 0


async def test_non_stream_disconnect_aborts(twin_any: TwinServer) -> None:
    twin = twin_any
    body = {"prompt": PROMPT, "max_tokens": 5000}
    async with aiohttp.ClientSession() as session:
        with pytest.raises(TimeoutError):
            timeout = aiohttp.ClientTimeout(total=0.3)
            await session.post(twin.url + "/v1/completions", json=body, timeout=timeout)
    abort_key = _key("vllm:request_success_total", finished_reason="abort")
    m = await _wait_for(twin.url, abort_key, 1)
    assert m[abort_key] == 1
    assert m[_key("vllm:num_requests_running")] == 0
    assert m[_key("vllm:kv_cache_usage_perc")] == 0
    assert twin.twin.loop.num_active == 0


BAD_INPUTS: list[tuple[str, bytes, int, str | None]] = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": 12}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "3"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "n": 129}', 400, "n"),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [1, 4294967296]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [[1], [2]]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
    ("/v1/completions", b'{"prompt": "x", "model": "gpt-4"}', 404, "model"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 200000}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', 400, "messages[0]"),
    ("/v1/chat/completions", b'{"model": "x"}', 400, "messages"),
    ("/tokenize", b'{"prompt": 5}', 400, "prompt"),
    ("/admin/faults", b'{"slowdwn": 2}', 400, None),
    ("/admin/faults", b'{"slowdown": 1e300}', 400, "slowdown"),
    ("/v1/nothing", b"{}", 404, None),
]


async def test_bad_inputs_are_4xx_json(twin: TwinServer) -> None:
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        for path, body, status, param in BAD_INPUTS:
            async with session.post(twin.url + path, data=body, headers=headers) as resp:
                assert resp.status == status, (path, body, await resp.text())
                error = (await resp.json())["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["param"] == param, (path, body, error)
        async with session.get(twin.url + "/v1/completions") as resp:
            assert resp.status == 405 and "error" in await resp.json()
        async with session.post(twin.url + "/v1/completions", json={"prompt": "x" * 600_000}) as r:
            assert r.status == 400  # longer than max_model_len
    async with _client(twin) as client:
        with pytest.raises(openai.NotFoundError) as info:
            await client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert info.value.status_code == 404
    assert isinstance(info.value.body, dict) and info.value.body["type"] == "NotFoundError"


async def _token_arrivals(url: str, body: dict[str, object]) -> list[float]:
    """Seconds from sending a streaming completion to each token event's arrival."""
    arrivals: list[float] = []
    async with aiohttp.ClientSession() as session:
        start_s = time.monotonic()
        async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
            buffer = b""
            async for data in resp.content.iter_any():
                now_s = time.monotonic() - start_s
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                arrivals += [now_s for e in events if e.startswith(b"data: {")]
    return arrivals


async def test_tokens_are_spaced_by_modelled_step_times() -> None:
    step_s = 0.04
    config = _config(api_overhead_s=0.0)
    async with TwinServer(config, timer=FixedStepTimer(step_s)) as server:
        arrivals = await _token_arrivals(server.url, {"prompt": PROMPT, "max_tokens": 8})
    assert len(arrivals) == 8
    # never early: token i leaves after its step (1 prefill + i decode steps) ends ...
    assert all(t >= (i + 1) * step_s * 0.9 for i, t in enumerate(arrivals)), arrivals
    # ... and not much later (loose: CI boxes are busy)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert step_s * 0.5 <= statistics.median(gaps) <= step_s * 2, gaps
    assert arrivals[-1] <= 8 * step_s + 0.5


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"twin at {url} never became healthy (exit {proc.poll()})")


def _engine_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kiloserve", "engine", *args]


def test_cli_process_serves_and_stops_on_sigterm(port: int) -> None:
    cmd = _engine_cmd("--gpu", "H100", "--model", "llama-3.1-8b", "--port", str(port))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert f"listening on http://127.0.0.1:{port}" in err.decode()
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)


def test_cli_port_zero_and_crash_fault() -> None:
    cmd = _engine_cmd("--gpu", "H100-SXM", "--model", "Llama-3.1-8B", "--port", "0")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert proc.stderr is not None
        line = b""
        deadline = time.monotonic() + 15
        while b"listening on " not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
        url = line.decode().rsplit("listening on ", 1)[1].strip()
        _wait_healthy(url, proc)
        req = urllib.request.Request(
            url + "/admin/faults",
            data=b'{"crash": true}',
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.status == 200
        assert proc.wait(timeout=10) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.communicate()


def test_cli_model_that_does_not_fit_exits_2() -> None:
    cmd = _engine_cmd("--gpu", "H100", "--model", "qwen2-72b", "--port", "0")
    done = subprocess.run(cmd, capture_output=True, timeout=30)
    assert done.returncode == 2
    assert b"does not fit" in done.stderr.lower() or b"--tp" in done.stderr


async def test_api_overhead_delays_first_token() -> None:
    config = _config(api_overhead_s=0.15)
    async with TwinServer(config, timer=FixedStepTimer(0.01)) as server:
        assert server.twin.loop.api_overhead_s == 0.15
        async with aiohttp.ClientSession() as session:
            start_s = time.monotonic()
            body = {"prompt": PROMPT, "max_tokens": 2}
            async with session.post(server.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
            elapsed_s = time.monotonic() - start_s
    assert 0.15 + 0.02 <= elapsed_s <= 0.5
    default = TwinServer(_config())  # the step-time model's figure (calibration.md)
    assert default.twin.loop.api_overhead_s == pytest.approx(0.015)


async def test_decode_gaps_follow_the_roofline_model() -> None:
    from kiloserve.catalog import get_gpu, get_model
    from kiloserve.engine.timing import StepTimeModel

    slowdown = 5.0  # ~40 ms steps: well above timer noise on a busy box
    config = _config(api_overhead_s=0.0, faults=FaultSet(slowdown=slowdown))
    timer = StepTimeModel(get_gpu("H100-SXM"), get_model("llama-3.1-8b"))
    expected_s = slowdown * timer.step_time_s([], [count_tokens(PROMPT) + 6])
    async with TwinServer(config) as server:
        arrivals = await _token_arrivals(server.url, {"prompt": PROMPT, "max_tokens": 12})
    assert len(arrivals) == 12
    decode_s = arrivals[-1] - arrivals[1]  # 10 decode steps
    assert 10 * expected_s * 0.9 <= decode_s <= 10 * expected_s * 1.5 + 0.2, decode_s


async def test_absolute_deadlines_absorb_oversleep() -> None:
    # Fake time: every sleep overshoots by 3 ms. 20 steps of 10 ms must still end at
    # 200 ms (+ one overshoot), not 20 x 13 ms as with relative sleeps.
    from kiloserve.engine.config import EngineConfig
    from kiloserve.engine.core import EngineCore
    from kiloserve.engine.faults import FaultInjector
    from kiloserve.engine.metrics import EngineStats, TwinMetrics
    from kiloserve.engine.twin import TwinLoop

    now = [0.0]

    async def late_sleep(delay_s: float) -> None:
        now[0] += delay_s + 0.003
        await asyncio.sleep(0)

    def stats() -> EngineStats:
        return EngineStats(0, 0, 0.0, 0, 0, 0)

    config = EngineConfig(
        num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256
    )
    core = EngineCore(config, FixedStepTimer(0.01))
    metrics = TwinMetrics("m", stats)
    loop = TwinLoop(
        core, metrics, FaultInjector(), stats_fn=stats, clock=lambda: now[0], sleep=late_sleep
    )
    loop.start()
    try:
        stream = await loop.submit(list(range(8)), 20, "length")
        token_times: list[float] = []
        while not stream.is_finished:
            await stream.wait_beyond(len(token_times))
            token_times += [stream.last_token_s or 0.0] * (
                stream.num_generated_tokens - len(token_times)
            )
    finally:
        await loop.stop()
    assert stream.finish_reason == "length" and len(token_times) == 20
    assert token_times == pytest.approx([0.01 * (i + 1) + 0.003 for i in range(20)])


async def test_busy_port_is_a_config_error() -> None:
    async with TwinServer(_config()) as first:
        port = int(first.url.rsplit(":", 1)[1])
        second = TwinServer(_config(port=port))
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            await second.start()


async def test_real_tokenizer_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "the": 1, "fast": 2, "node": 3}
    real = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    real.pre_tokenizer = Whitespace()  # type: ignore[assignment]
    path = tmp_path / "tokenizer.json"
    real.save(str(path))
    async with (
        TwinServer(_config(tokenizer_path=str(path))) as server,
        aiohttp.ClientSession() as session,
    ):
        body = {"prompt": "the fast node runs"}
        async with session.post(server.url + "/tokenize", json=body) as resp:
            assert (await resp.json())["tokens"] == [1, 2, 3, 0]
        body = {"prompt": "the fast node runs", "max_tokens": 2}
        async with session.post(server.url + "/v1/completions", json=body) as resp:
            assert (await resp.json())["usage"]["prompt_tokens"] == 4
    with pytest.raises(ConfigError, match="tokenizer"):
        TwinServer(_config(tokenizer_path=str(tmp_path / "missing.json")))


ODD_VALUES: list[object] = [None, True, -1, 0, 1.5, "x", "", [], {}, [None], [{}], 2**70, [2**70]]
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "stream"]
FIELDS += ["stream_options", "n", "model", "ignore_eos", "temperature"]
FIELDS += ["logprobs", "top_logprobs", "echo", "tools", "tool_choice", "response_format"]


async def test_no_odd_field_value_causes_a_5xx() -> None:
    bases: dict[str, dict[str, object]] = {
        "/v1/completions": {"prompt": "x", "max_tokens": 1},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    }
    config = _config(api_overhead_s=0.0, faults=FaultSet(slowdown=0.01))
    async with TwinServer(config) as twin, aiohttp.ClientSession() as session:
        for path, base in bases.items():
            for field in FIELDS:
                for value in ODD_VALUES:
                    body = {**base, field: value}
                    async with session.post(twin.url + path, json=body) as resp:
                        await resp.read()
                        assert resp.status < 500, (path, body, resp.status)
