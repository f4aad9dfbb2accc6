"""One ``choose`` per request through the real gateway, with admission on and off.

Before the routing core (issue 13) a request with admission on was routed twice: the
admission controller asked the policy, then the front door asked it again and threw
the first ranking away.
"""

from __future__ import annotations

import asyncio
import collections
import random
from typing import Any

import aiohttp
import pytest
from test_gateway_fakes import FakeBackend, fake_backends, gateway_config, running_gateway

from kiloserve.policies.base import ClusterSnapshot, Decision, Outcome, RequestInfo
from kiloserve.policies.registry import create_policy


class CountingPolicy:
    """Round robin that counts ``choose`` calls and completions per request id."""

    def __init__(self) -> None:
        self.inner = create_policy("round_robin", {})
        self.name = "counting"
        self.num_choose: collections.Counter[str] = collections.Counter()
        self.num_complete: collections.Counter[str] = collections.Counter()

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        self.num_choose[request.request_id] += 1
        return self.inner.choose(request, snapshot, rng)

    def on_dispatch(self, request: RequestInfo, backend_id: str) -> None:
        self.inner.on_dispatch(request, backend_id)

    def on_complete(self, request: RequestInfo, backend_id: str, outcome: Outcome) -> None:
        self.num_complete[request.request_id] += 1
        self.inner.on_complete(request, backend_id, outcome)


async def _post(s: aiohttp.ClientSession, url: str, rid: str, stream: bool) -> int:
    body: dict[str, Any] = {"model": "m", "prompt": "hello", "max_tokens": 4, "stream": stream}
    headers = {"x-request-id": rid}
    async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
        await r.read()
        return r.status


@pytest.mark.parametrize("admission", [False, True], ids=["admission-off", "admission-on"])
async def test_one_choose_per_request(admission: bool) -> None:
    fakes = [FakeBackend(num_chunks=3, chunk_delay_s=0.02) for _ in range(2)]
    async with fake_backends(*fakes):
        backends = [{"url": f.url, "models": ["m"], "name": f"b{i}"} for i, f in enumerate(fakes)]
        # admission on: one request per backend at a time, so most requests queue at the
        # gateway and are placed (and routed) only when a completion frees room
        adm = {"enabled": True, "tick_s": 0.01, "capacity": {"max_in_flight_per_backend": 1}}
        extra: dict[str, Any] = {"admission": adm} if admission else {}
        cfg = gateway_config(backends, **extra)
        policy = CountingPolicy()
        async with running_gateway(cfg, policy=policy) as gw, aiohttp.ClientSession() as s:
            sequential = [await _post(s, gw, f"seq-{i}", stream=i % 2 == 0) for i in range(4)]
            concurrent = await asyncio.gather(
                *(_post(s, gw, f"par-{i}", stream=i % 2 == 0) for i in range(8))
            )
    assert sequential == [200] * 4 and list(concurrent) == [200] * 8
    ids = [f"seq-{i}" for i in range(4)] + [f"par-{i}" for i in range(8)]
    assert {rid: policy.num_choose[rid] for rid in ids} == dict.fromkeys(ids, 1)
    assert {rid: policy.num_complete[rid] for rid in ids} == dict.fromkeys(ids, 1)
