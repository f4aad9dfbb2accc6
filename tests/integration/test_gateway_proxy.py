"""Gateway in front of fake backends: OpenAI SDK, stream relay, retries, pools, disconnects."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from openai import AsyncOpenAI
from test_gateway_fakes import FakeBackend, fake_backends, gateway_config, running_gateway

from conftest import free_port
from kiloserve.gateway.sse import SseRelay


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)


async def test_openai_sdk_non_stream_and_stream() -> None:
    async with fake_backends(FakeBackend(num_chunks=4)) as (fake,):
        cfg = gateway_config([{"url": fake.url, "name": "b0"}])
        async with running_gateway(cfg) as url, _client(url) as client:
            raw = await client.completions.with_raw_response.create(
                model="m", prompt="hello there", max_tokens=4, extra_body={"top_k": 3}
            )
            assert raw.headers["x-kiloserve-backend"] == "b0"
            assert raw.headers["x-request-id"]
            done = raw.parse()
            assert done.choices[0].text == "hello"
            assert done.usage is not None and done.usage.completion_tokens == 4
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            texts = [c.choices[0].text async for c in stream if c.choices]  # type: ignore[attr-defined]
    assert texts == ["t0", "t1", "t2", "t3"]
    # unknown body fields pass through untouched; streams ask upstream for usage
    assert fake.bodies[0]["top_k"] == 3
    assert fake.bodies[1]["stream_options"] == {"include_usage": True}


async def test_usage_chunk_hidden_unless_asked_and_request_id_kept() -> None:
    async with fake_backends(FakeBackend(num_chunks=2)) as (fake,):
        cfg = gateway_config([{"url": fake.url}])
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "x", "stream": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                hidden = await r.read()
                assert r.headers["x-request-id"]
                assert r.headers["x-kiloserve-backend"] == fake.url
            body["stream_options"] = {"include_usage": True}
            hdrs = {"x-request-id": "my-id-1"}
            async with s.post(url + "/v1/completions", json=body, headers=hdrs) as r:
                shown = await r.read()
                assert r.headers["x-request-id"] == "my-id-1"
    assert hidden == b'data: {"id":"x","choices":[{"index":0,"text":"t0"}],"usage":null}\n\n' + (
        b'data: {"id":"x","choices":[{"index":0,"text":"t1"}],"usage":null}\n\ndata: [DONE]\n\n'
    )
    assert b'"completion_tokens":2' in shown and shown.endswith(b"data: [DONE]\n\n")
    assert fake.headers[1]["x-request-id"] == "my-id-1"


async def test_round_robin_spreads_and_names_backends() -> None:
    async with fake_backends(FakeBackend(), FakeBackend()) as fakes:
        cfg = gateway_config([{"url": f.url, "name": f"b{i}"} for i, f in enumerate(fakes)])
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            seen = []
            for _ in range(4):
                async with s.post(url + "/v1/completions", json={"model": "m"}) as r:
                    assert r.status == 200
                    seen.append(r.headers["x-kiloserve-backend"])
    assert sorted(seen) == ["b0", "b0", "b1", "b1"]
    assert [len(f.bodies) for f in fakes] == [2, 2]


async def _post_many(url: str, n: int, stream: bool = False) -> list[tuple[int, str]]:
    out = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            body = {"model": "m", "prompt": "p", "stream": stream}
            async with s.post(url + "/v1/completions", json=body) as r:
                await r.read()
                out.append((r.status, r.headers.get("x-kiloserve-backend", "")))
    return out


async def _metric(url: str, prefix: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


async def test_retries_on_500_and_429_then_counts_them() -> None:
    fakes = (FakeBackend(mode="500"), FakeBackend(mode="429"), FakeBackend())
    async with fake_backends(*fakes):
        cfg = gateway_config([{"url": f.url, "name": f"b{i}"} for i, f in enumerate(fakes)])
        async with running_gateway(cfg) as url:
            results = await _post_many(url, 6, stream=True)
            assert results == [(200, "b2")] * 6
            retries = await _metric(url, "kiloserve_gateway_retries_total")
    assert retries >= 6  # every request that hit b0 or b1 first was retried


async def test_retry_on_refused_connection_and_hang() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with fake_backends(FakeBackend(mode="hang"), FakeBackend()) as (hang, good):
        backends = [{"url": dead, "name": "dead"}, {"url": hang.url, "name": "hang"}]
        backends.append({"url": good.url, "name": "good"})
        # a high failure threshold keeps the dead backend routable, so retries are exercised
        cfg = gateway_config(
            backends, first_byte_timeout_s=0.3, non_stream_timeout_s=0.3, max_scrape_failures=1000
        )
        async with running_gateway(cfg) as url:
            results = await _post_many(url, 3)
            for _ in range(50):  # the gateway closes the hung upstream request
                if hang.num_aborted:
                    break
                await asyncio.sleep(0.02)
    assert results == [(200, "good")] * 3
    assert hang.num_aborted >= 1


async def test_all_backends_fail_passes_last_error_and_4xx_passthrough() -> None:
    fakes = (FakeBackend(mode="500"), FakeBackend(mode="400"), FakeBackend())
    async with fake_backends(*fakes) as (f5, f4, ok):
        cfg = gateway_config([{"url": f5.url, "name": "five"}], retries=1)
        async with (
            running_gateway(cfg) as url,
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/completions", json={"model": "m"}) as r,
        ):
            assert r.status == 500
            assert (await r.json())["error"]["message"] == "fake 500"
        assert len(f5.bodies) == 1  # fallbacks are other backends: none here
        cfg = gateway_config([{"url": f4.url, "name": "four"}, {"url": ok.url, "name": "ok"}])
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            statuses = []
            for _ in range(2):
                async with s.post(url + "/v1/completions", json={"model": "m"}) as r:
                    statuses.append((r.status, r.headers["x-kiloserve-backend"]))
                    if r.status == 400:
                        assert await r.json() == {
                            "error": {"message": "fake 400", "type": "fake", "code": 1}
                        }
    assert sorted(statuses) == [(200, "ok"), (400, "four")]
    assert len(ok.bodies) == 1  # the 4xx was final, not retried on "ok"


async def test_model_pools_route_only_to_serving_backends() -> None:
    fakes = (FakeBackend(models=["a"]), FakeBackend(models=["b"]), FakeBackend(models=["a", "b"]))
    async with fake_backends(*fakes):
        backends = [{"url": f.url, "name": f"n{i}"} for i, f in enumerate(fakes)]
        backends[0]["models"] = ["a"]  # configured instead of discovered
        cfg = gateway_config(backends)
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            async with s.get(url + "/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["a", "b"]
            served: dict[str, set[str]] = {"a": set(), "b": set()}
            for model in ["a", "b"] * 4:
                async with s.post(url + "/v1/completions", json={"model": model}) as r:
                    served[model].add(r.headers["x-kiloserve-backend"])
    assert served == {"a": {"n0", "n2"}, "b": {"n1", "n2"}}


async def test_client_disconnect_closes_upstream_stream() -> None:
    async with fake_backends(FakeBackend(num_chunks=200, chunk_delay_s=0.02)) as (fake,):
        cfg = gateway_config([{"url": fake.url}])
        async with running_gateway(cfg) as url:
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "prompt": "p", "stream": True}
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.content.readany()
                    assert fake.num_active == 1
            for _ in range(100):
                if fake.num_aborted:
                    break
                await asyncio.sleep(0.02)
            assert fake.num_aborted == 1 and fake.num_active == 0 and fake.num_finished == 0
            assert await _metric(url, "kiloserve_gateway_in_flight") == 0


async def test_client_disconnect_while_waiting_closes_upstream() -> None:
    async with fake_backends(FakeBackend(mode="hang")) as (fake,):
        cfg = gateway_config([{"url": fake.url}])
        async with running_gateway(cfg) as url:
            async with aiohttp.ClientSession() as s:
                task = asyncio.create_task(s.post(url + "/v1/completions", json={"model": "m"}))
                for _ in range(100):
                    if fake.num_active:
                        break
                    await asyncio.sleep(0.01)
                task.cancel()
            for _ in range(100):
                if fake.num_aborted:
                    break
                await asyncio.sleep(0.02)
    assert fake.num_aborted == 1


async def test_stream_profile_reaches_upstream_unchanged_for_chat_parts() -> None:
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url}])
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "stream": True,
            "stream_options": {"include_usage": False, "continuous_usage_stats": False},
            "unknown": {"deep": [1, 2]},
        }
        async with (
            running_gateway(cfg) as url,
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/chat/completions", data=orjson.dumps(body)) as r,
        ):
            assert r.status == 200
            await r.read()
    sent = fake.bodies[0]
    assert sent["unknown"] == {"deep": [1, 2]}
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}


USAGE_EVENT = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":7}}'


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n"])
def test_sse_relay_frames_events_and_strips_usage(sep: bytes) -> None:
    events = [b'data: {"choices":[{"text":"a"}],"usage":null}', USAGE_EVENT, b"data: [DONE]"]
    stream = b"".join(e + sep for e in events)
    for strip in (True, False):
        relay = SseRelay(strip_usage=strip)
        out = [relay.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)]
        out.append(relay.flush())
        expected = stream if not strip else events[0] + sep + events[2] + sep
        assert b"".join(out) == expected
        assert relay.completion_tokens == 7 and relay.prompt_tokens == 3
        # every forwarded piece ends on an event boundary
        assert all(piece.endswith(sep) for piece in out if piece)


def test_sse_relay_passes_huge_unterminated_data_on() -> None:
    relay = SseRelay(strip_usage=True)
    blob = b"data: " + b"x" * (2 << 20)
    assert relay.feed(blob) == blob
    assert relay.feed(b"tail") == b"" and relay.flush() == b"tail"


async def test_stream_relay_with_crlf_backend() -> None:
    fake = FakeBackend(num_chunks=3, chunk_delay_s=0.01)
    async with fake_backends(fake):
        fake_app_stream = fake._stream

        async def crlf_stream(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(b'data: {"choices":[{"index":0,"text":"t%d"}]}\r\n\r\n' % i)
                await asyncio.sleep(0.01)
            await resp.write(USAGE_EVENT + b"\r\n\r\ndata: [DONE]\r\n\r\n")
            return resp

        fake._stream = crlf_stream  # type: ignore[method-assign]
        cfg = gateway_config([{"url": fake.url}])
        async with (
            running_gateway(cfg) as url,
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/completions", json={"model": "m", "stream": True}) as r,
        ):
            arrivals = []
            while chunk := await r.content.readany():
                arrivals.append(chunk)
        fake._stream = fake_app_stream  # type: ignore[method-assign]
    data = b"".join(arrivals)
    assert data.count(b"data: ") == 4 and b"usage" not in data
    assert len(arrivals) >= 3  # relayed as they came, not buffered to the end


async def test_client_disconnect_before_first_token_closes_upstream() -> None:
    # headers are sent at once, the first token never comes
    async with fake_backends(FakeBackend(num_chunks=1, chunk_delay_s=30.0)) as (fake,):
        cfg = gateway_config([{"url": fake.url}])
        async with running_gateway(cfg) as url:
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "prompt": "p", "stream": True}
                task = asyncio.create_task(s.post(url + "/v1/completions", json=body))
                for _ in range(100):
                    if fake.num_active:
                        break
                    await asyncio.sleep(0.01)
                task.cancel()
            for _ in range(100):
                if fake.num_aborted:
                    break
                await asyncio.sleep(0.02)
            assert fake.num_aborted == 1
            assert await _metric(url, "kiloserve_gateway_in_flight") == 0
