"""Rate limits shared through a real ``redis-server`` (started here on 127.0.0.1)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator

import aiohttp
import pytest
from test_gateway_fakes import FakeBackend, fake_backends, gateway_config, running_gateway

from conftest import free_port
from kiloserve.gateway.admission.auth import hash_key
from kiloserve.gateway.admission.ratelimit import Quota
from kiloserve.launch.engines import reserved_port

REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server not installed")
redis_asyncio = pytest.importorskip("redis.asyncio")


@pytest.fixture
def redis_url() -> Iterator[str]:
    # outside the ephemeral range: a bind(0) port can go to another socket first
    port = reserved_port("127.0.0.1")
    argv = [
        str(REDIS),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_port(port)
        _assert_our_redis(port, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _assert_our_redis(port: int, proc: subprocess.Popen[bytes]) -> None:
    """What listens is the redis-server started here (it answers PING, and it runs)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as s:
        s.sendall(b"PING\r\n")
        assert s.recv(64).startswith(b"+PONG"), f"not a Redis on {port}"
    assert proc.poll() is None, f"redis-server exited ({proc.returncode}): port {port} taken"


def _wait_for_port(port: int, timeout_s: float = 10.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise AssertionError(f"redis-server did not listen on {port}")


async def test_two_gateways_share_one_limit(redis_url: str) -> None:
    keys = [{"name": "k", "key_sha256": hash_key("sk-k"), "max_requests_per_min": 3}]
    fake = FakeBackend()
    async with fake_backends(fake):
        cfg = gateway_config(
            [{"url": fake.url, "models": ["m"]}],
            auth={"keys": keys},
            rate_limit={"redis_url": redis_url},
        )
        async with (
            running_gateway(cfg) as gw1,
            running_gateway(cfg) as gw2,
            aiohttp.ClientSession() as s,
        ):
            statuses = []
            for gw in (gw1, gw2, gw1, gw2, gw1):
                body = {"model": "m", "prompt": "hi"}
                headers = {"Authorization": "Bearer sk-k"}
                async with s.post(gw + "/v1/completions", json=body, headers=headers) as r:
                    statuses.append(r.status)
                    retry_after = r.headers.get("Retry-After")
    assert statuses == [200, 200, 200, 429, 429]
    assert retry_after == "20"
    assert len(fake.bodies) == 3


async def test_redis_token_bucket_reconciles(redis_url: str) -> None:
    from kiloserve.gateway.admission.ratelimit import RedisLimiter

    a, b = RedisLimiter(redis_url), RedisLimiter(redis_url)
    q = Quota("tenant-zeta", max_requests_per_min=None, max_tokens_per_min=1000)
    try:
        assert await a.acquire(q, 900, 0.0) == 0.0
        assert await b.acquire(q, 200, 0.0) > 0.0  # shared: only ~100 left
        await a.reconcile(q, 500, 0.0)  # 500 of the 900 were not used
        assert await b.acquire(q, 200, 0.0) == 0.0
        client = redis_asyncio.Redis.from_url(redis_url)
        try:
            names = [k.decode() for k in await client.keys("*")]
        finally:
            await client.aclose()
        assert names and all("tenant-zeta" not in n for n in names)  # key names are hashed
    finally:
        await a.close()
        await b.close()


async def test_a_dead_redis_fails_open() -> None:
    keys = [{"name": "k", "key_sha256": hash_key("sk-k"), "max_requests_per_min": 1}]
    fake = FakeBackend()
    async with fake_backends(fake):
        dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
        cfg = gateway_config(
            [{"url": fake.url, "models": ["m"]}],
            auth={"keys": keys},
            rate_limit={"redis_url": dead},
        )
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            headers = {"Authorization": "Bearer sk-k"}
            body = {"model": "m", "prompt": "hi"}
            async with s.post(gw + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200


async def test_a_redis_that_never_answers_fails_open_within_its_timeout() -> None:
    """A store that accepts the connection and then says nothing (a hung Redis, or
    something else on its port): the request goes through after the client's socket
    timeout instead of waiting for ever (it waited until the test's timeout before)."""
    import asyncio

    done = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)  # the command, never answered
        await done.wait()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    keys = [{"name": "k", "key_sha256": hash_key("sk-k"), "max_requests_per_min": 1}]
    fake = FakeBackend()
    try:
        async with fake_backends(fake):
            cfg = gateway_config(
                [{"url": fake.url, "models": ["m"]}],
                auth={"keys": keys},
                rate_limit={"redis_url": f"redis://127.0.0.1:{port}/0"},
            )
            async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
                headers = {"Authorization": "Bearer sk-k"}
                body = {"model": "m", "prompt": "hi"}
                post = s.post(gw + "/v1/completions", json=body, headers=headers)
                async with asyncio.timeout(20), post as r:
                    assert r.status == 200
    finally:
        done.set()
        await asyncio.sleep(0.1)  # the handler closes its side
        server.close()
        await server.wait_closed()
