"""The "one backend 4x slower" scenario, closed loop, through the real Router, table
and policies in simulated time (deterministic; no wall clock).

Reported: nginx least-connections 153.5 req/s, ``least_request`` 153, ``default``
124-126, and 153 only when the backends exposed no ``/metrics``. The cause was the
scraped KV usage: engines reading 0.9-1.0 while healthy (prefix cache kept, the
busiest reading highest) were treated as saturated by the ``ttft`` scorer, which sent
work to the slow backend. Here four backends (b0 four times slower) serve 24 clients
that send the next request as soon as one ends; the scrape reports the true running /
waiting counts and a KV usage that reads high without any queue.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from kiloserve.gateway.config import parse_gateway_config
from kiloserve.policies import create_policy
from kiloserve.policies.base import RequestInfo
from kiloserve.routing.engine_metrics import EngineMetrics
from kiloserve.routing.router import Router
from kiloserve.routing.table import BackendTable

IDS = ("b0", "b1", "b2", "b3")
NUM_CLIENTS, NUM_SLOTS = 24, 8  # 6 requests per backend: no engine queues
PREFILL_S, TPOT_S, NUM_OUTPUT_TOKENS = 0.02, 0.005, 32
SCRAPE_INTERVAL_S, WARMUP_S, DURATION_S = 0.1, 5.0, 30.0
KvReading = Callable[["_Engine", random.Random], float]


@dataclass
class _Request:
    info: RequestInfo
    start_s: float
    is_stream: bool
    first_s: float | None = None


@dataclass
class _Engine:
    slowdown: float
    num_running: int = 0
    waiting: list[_Request] = field(default_factory=list)
    num_served: int = 0


def _kv_prefix_cache(e: _Engine, rng: random.Random) -> float:
    """Blocks kept as prefix cache count as used: the more served, the fuller."""
    return min(0.99, 0.6 + 0.002 * e.num_served)


def _kv_noisy_high(e: _Engine, rng: random.Random) -> float:
    return 0.9 + 0.09 * rng.random()


@dataclass
class _Run:
    throughput: float
    p99_s: float


_Event = tuple[float, int, str, tuple[str, _Request] | None]


class _ClosedLoop:
    """Clients, engines and one gateway ``Router``, in simulated time (a heap of events)."""

    def __init__(self, policy: str, kv: KvReading, stream_share: float) -> None:
        backends = [{"name": b, "url": f"http://127.0.0.1:{9001 + i}", "models": ["m"]}
                    for i, b in enumerate(IDS)]  # fmt: skip
        self.table = BackendTable(parse_gateway_config({"backends": backends}))
        self.router = Router(self.table, create_policy(policy), random.Random(0))
        self.engines = {b: _Engine(4.0 if b == "b0" else 1.0) for b in IDS}
        self.kv, self.stream_share, self.rng = kv, stream_share, random.Random(1)
        self.events: list[_Event] = []
        self.latencies_s: list[float] = []
        self.seq = 0

    def at(self, t: float, kind: str, data: tuple[str, _Request] | None = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    def send(self, t: float) -> None:
        info = RequestInfo(f"r{self.seq}", "m", 200, NUM_OUTPUT_TOKENS)
        b = self.router.decide(info, t).ranked[0]
        self.router.dispatch(b, info)
        req = _Request(info, t, is_stream=self.rng.random() < self.stream_share)
        if self.engines[b].num_running < NUM_SLOTS:
            self.serve(t, b, req)
        else:
            self.engines[b].waiting.append(req)

    def serve(self, t: float, b: str, req: _Request) -> None:
        e = self.engines[b]
        e.num_running += 1
        first_s = t + PREFILL_S * e.slowdown
        self.at(first_s, "first", (b, req))
        self.at(first_s + (NUM_OUTPUT_TOKENS - 1) * TPOT_S * e.slowdown, "end", (b, req))

    def scrape(self, t: float) -> None:
        for b, e in self.engines.items():
            m = EngineMetrics("vllm", e.num_running, len(e.waiting), self.kv(e, self.rng))
            self.table.record_scrape(b, m, t)
        self.at(t + SCRAPE_INTERVAL_S, "scrape")

    def first_token(self, t: float, b: str, req: _Request) -> None:
        req.first_s = t
        if req.is_stream:  # a non-streamed request's first token is not seen
            self.router.first_token(b, req.info, (t - req.start_s) * 1000.0)

    def end(self, t: float, b: str, req: _Request) -> None:
        e = self.engines[b]
        e.num_running -= 1
        e.num_served += 1
        self.router.complete(
            b, req.info, ok=True, status=200, started_s=req.start_s,
            first_token_s=req.first_s if req.is_stream else None, last_token_s=t,
            output_tokens=NUM_OUTPUT_TOKENS,
        )  # fmt: skip
        if t > WARMUP_S:
            self.latencies_s.append(t - req.start_s)
        if e.waiting:
            self.serve(t, b, e.waiting.pop(0))
        self.at(t, "send")  # the client sends its next request at once

    def run(self) -> _Run:
        for i in range(NUM_CLIENTS):
            self.at(0.001 * i, "send")
        self.at(0.0, "scrape")
        while self.events and self.events[0][0] <= DURATION_S:
            t, _, kind, data = heapq.heappop(self.events)
            if data is not None:
                (self.first_token if kind == "first" else self.end)(t, *data)
            else:
                (self.send if kind == "send" else self.scrape)(t)
        latencies_s = sorted(self.latencies_s)
        p99_s = latencies_s[int(0.99 * len(latencies_s))]
        return _Run(len(latencies_s) / (DURATION_S - WARMUP_S), p99_s)


def _run(policy: str, kv: KvReading, stream_share: float) -> _Run:
    return _ClosedLoop(policy, kv, stream_share).run()


@pytest.mark.parametrize("kv", [_kv_prefix_cache, _kv_noisy_high], ids=["prefix-cache", "noisy"])
@pytest.mark.parametrize("stream_share", [0.0, 0.5], ids=["non-streamed", "half-streamed"])
def test_default_keeps_up_with_least_request_when_kv_reads_high(
    kv: KvReading, stream_share: float
) -> None:
    least = _run("least_request", kv, stream_share)
    default = _run("default", kv, stream_share)
    assert default.throughput >= 0.9 * least.throughput
    assert default.p99_s <= 1.1 * least.p99_s
