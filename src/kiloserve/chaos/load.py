"""Steady closed-loop streaming load through the gateway, one record per request.

Each of ``concurrency`` workers sends streaming completions back to back and notes when
the request started, when its first byte arrived, how it ended and why. A stream that
ends with an SSE error event (the gateway's explicit "cut" signal) or without
``[DONE]`` is a failure; ``saw_error_event`` tells the two apart.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import aiohttp
import orjson

__all__ = ["LoadGenerator", "RequestResult"]

_WORDS = (
    "the", "quick", "engine", "routes", "tokens", "across", "a", "cluster", "of", "replicas",
    "under", "load",
)  # fmt: skip


@dataclass(slots=True)
class RequestResult:
    start_s: float
    end_s: float = 0.0
    first_byte_s: float | None = None
    status: int = 0
    is_ok: bool = False
    saw_error_event: bool = False
    reason: str = ""

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_byte_s is None else (self.first_byte_s - self.start_s) * 1000.0


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 120)))


class LoadGenerator:
    """``concurrency`` workers against ``url`` until ``stop()``; results in ``results``."""

    def __init__(
        self, url: str, model: str, concurrency: int, max_tokens: int = 32, seed: int = 0
    ) -> None:
        self.url = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.results: list[RequestResult] = []
        self._rng = random.Random(seed)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=120.0, sock_connect=5.0)
        connector = aiohttp.TCPConnector(limit=self.concurrency * 2)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.concurrency)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _worker(self) -> None:
        while not self._stop.is_set():
            result = RequestResult(start_s=time.monotonic())
            self.results.append(result)
            await self._one(result)
            result.end_s = time.monotonic()

    def _body(self) -> bytes:
        tokens = self._rng.randint(self.max_tokens // 2, self.max_tokens)
        return orjson.dumps({
            "model": self.model, "prompt": _prompt(self._rng), "max_tokens": tokens,
            "stream": True,
        })  # fmt: skip

    async def _one(self, result: RequestResult) -> None:
        assert self._session is not None
        headers = {"Content-Type": "application/json"}
        try:
            async with self._session.post(self.url, data=self._body(), headers=headers) as resp:
                result.status = resp.status
                if resp.status != 200:
                    await resp.read()
                    result.first_byte_s = None
                    result.reason = f"http_{resp.status}"
                    return
                await self._read_stream(resp, result)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            result.reason = f"connection:{type(exc).__name__}"

    @staticmethod
    async def _read_stream(resp: aiohttp.ClientResponse, result: RequestResult) -> None:
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            if result.first_byte_s is None:
                result.first_byte_s = time.monotonic()
            payload = line[6:].strip()
            if payload == b"[DONE]":
                result.is_ok = True
                return
            if payload.startswith(b'{"error"'):
                result.saw_error_event = True
                code = orjson.loads(payload)["error"].get("code")
                result.reason = f"error_event:{code}"
                return
        result.reason = "incomplete_stream"
