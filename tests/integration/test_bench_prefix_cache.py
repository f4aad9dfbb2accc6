"""``run_bench``'s ``prefix_cache`` block against real engine twins on 127.0.0.1:
straight at a twin (its own ``vllm:prefix_cache_*_total`` counters) and through the
real gateway (its ``kiloserve_gateway_backend_prefix_cache_*_tokens`` gauges, waited
for until the gateway has scraped after the run). Repeated prompts that share a long
head must hit the twins' prefix caches, and the block must equal the twins' counters.
"""

from __future__ import annotations

from test_bench_twin import MODEL, _metric, gateway, twins

from kiloserve.bench.client import run_bench
from kiloserve.results.metrics import summarize
from kiloserve.tokens import filler_text
from kiloserve.workload import ClosedLoop, RequestSpec, Workload

HEAD_TOKENS = 256  # 16 blocks of 16 tokens
TAIL_TOKENS = 24
NUM_REQUESTS = 8
HEAD = filler_text(HEAD_TOKENS, seed=7)


def _shared_prefix_workload() -> Workload:
    specs = [
        RequestSpec(
            request_id=f"r{i}",
            arrival_s=None,
            input_tokens=HEAD_TOKENS + TAIL_TOKENS,
            output_tokens=3,
            prompt=HEAD + " " + filler_text(TAIL_TOKENS, seed=1000 + i),
        )
        for i in range(NUM_REQUESTS)
    ]
    return Workload("shared-prefix", 0, lambda: iter(specs), len(specs))


async def test_prefix_cache_straight_from_a_twin() -> None:
    async with twins(1) as (twin,):
        result = await run_bench(twin.url + "/v1", MODEL, _shared_prefix_workload(), ClosedLoop(1))
        queries = await _metric(twin.url, "vllm:prefix_cache_queries_total")
        hits = await _metric(twin.url, "vllm:prefix_cache_hits_total")
    assert all(r.is_ok for r in result.records), [r.error for r in result.records]
    block = summarize(result)["prefix_cache"]
    assert isinstance(block, dict)
    assert block["source"] == "engine" and block["backends"] == 1
    assert "note" not in block
    # a fresh twin: the run's delta is the whole counter
    assert (block["queries_tokens"], block["hits_tokens"]) == (queries, hits)
    assert block["hits_tokens"] >= (NUM_REQUESTS - 1) * HEAD_TOKENS
    assert isinstance(block["hit_rate"], float) and block["hit_rate"] > 0


async def test_prefix_cache_through_the_gateway() -> None:
    async with twins(2) as servers, gateway([t.url for t in servers]) as url:
        result = await run_bench(url, MODEL, _shared_prefix_workload(), ClosedLoop(1))
        queries = [await _metric(t.url, "vllm:prefix_cache_queries_total") for t in servers]
        hits = [await _metric(t.url, "vllm:prefix_cache_hits_total") for t in servers]
    assert all(r.is_ok for r in result.records), [r.error for r in result.records]
    assert {r.backend for r in result.records} == {"twin0", "twin1"}  # round robin
    block = summarize(result)["prefix_cache"]
    assert isinstance(block, dict)
    assert block["source"] == "gateway" and block["backends"] == 2
    assert "note" not in block  # the gateway scraped both twins after the run
    # the gateway's gauges, read after a scrape that followed the run, are the twins' own
    assert (block["queries_tokens"], block["hits_tokens"]) == (sum(queries), sum(hits))
    # each twin misses the head once
    assert block["hits_tokens"] >= (NUM_REQUESTS - 2) * HEAD_TOKENS
    assert isinstance(block["hit_rate"], float) and block["hit_rate"] > 0
