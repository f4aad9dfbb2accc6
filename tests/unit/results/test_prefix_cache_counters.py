"""The bench's prefix-cache block: parsing engine and gateway pages, deltas across
engine restarts, missing pages, the gateway's gauges, and the summary key.

The probe tests serve pages from a real aiohttp server on 127.0.0.1 (no HTTP mocks).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kiloserve.bench import prefix_cache
from kiloserve.bench.prefix_cache import (
    CacheCounters,
    PrefixCacheProbe,
    parse_counters,
    prefix_cache_delta,
)
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.metrics import GatewayMetrics
from kiloserve.results.metrics import summarize
from kiloserve.results.records import BenchResult, ClientStats
from kiloserve.results.tables import summary_markdown
from kiloserve.routing.engine_metrics import EngineMetrics, parse_engine_metrics
from kiloserve.routing.table import BackendTable
from local_app import serve_app

DATA = Path(__file__).resolve().parents[2] / "data" / "metrics"


def _engine_page(queries: float, hits: float) -> str:
    return (
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries.\n"
        "# TYPE vllm:prefix_cache_queries_total counter\n"
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}\n'
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}\n'
    )


def _table(*names: str) -> BackendTable:
    backends = [{"url": f"http://{n}:8000", "name": n} for n in names]
    return BackendTable(parse_gateway_config({"backends": backends}))


# --- parsing ----------------------------------------------------------------------------


def test_engine_page_sums_series_and_prefers_the_current_names() -> None:
    got = parse_counters((DATA / "vllm.txt").read_text())
    assert got is not None and got.source == "engine"
    assert sum(got.queries.values()) == 2000.0 and sum(got.hits.values()) == 800.0
    legacy = _engine_page(10, 5).replace("vllm:prefix_cache", "vllm:gpu_prefix_cache")
    both = parse_counters(legacy + _engine_page(100, 40))
    assert both is not None and list(both.queries.values()) == [100.0]
    only_legacy = parse_counters(legacy)
    assert only_legacy is not None and list(only_legacy.hits.values()) == [5.0]


def test_missing_or_foreign_pages_give_none() -> None:
    assert parse_counters("") is None
    assert parse_counters("<html><body>404 Not Found</body></html>") is None
    assert parse_counters((DATA / "sglang.txt").read_text()) is None  # no counters
    assert prefix_cache_delta(None, CacheCounters("engine", {"": 1.0}, {"": 1.0})) is None
    assert prefix_cache_delta(CacheCounters("engine", {}, {}), None) is None


def test_malformed_lines_cost_only_themselves() -> None:
    text = (
        'vllm:prefix_cache_queries_total{engine="0" 12\n'  # broken labels
        'vllm:prefix_cache_queries_total{engine="1"} 100\n'
        'vllm:prefix_cache_hits_total{engine="1"} 30 1700000000000\n'
        'vllm:prefix_cache_hits_total{engine="2"} NaN\n'
        "vllm:prefix_cache_queries_total_not_it 5\n"
        "garbage\n"
    )
    got = parse_counters(text)
    assert got is not None
    assert got.queries == {"engine=1": 100.0} and got.hits == {"engine=1": 30.0}


def test_gateway_page_from_the_real_collector() -> None:
    table = _table("a", "b", "sg")
    table.record_scrape("a", parse_engine_metrics(_engine_page(1000, 250)), now_s=1.0)
    table.record_scrape("b", EngineMetrics("vllm", 0, 0, prefix_queries_tokens=40.0,
                                           prefix_hits_tokens=0.0), now_s=1.0)  # fmt: skip
    table.record_scrape("sg", parse_engine_metrics((DATA / "sglang.txt").read_text()), 1.0)
    # a failed scrape keeps the counters as last seen
    table.record_scrape_failure("a", 2.0, "timeout")
    page = GatewayMetrics(table).render().decode()
    assert 'kiloserve_gateway_backend_prefix_cache_queries_tokens{backend="a"} 1000.0' in page
    assert 'kiloserve_gateway_backend_prefix_cache_hits_tokens{backend="b"} 0.0' in page
    assert 'prefix_cache_queries_tokens{backend="sg"}' not in page  # SGLang: no counters
    got = parse_counters(page)
    assert got is not None and got.source == "gateway"
    assert got.queries == {"a": 1000.0, "b": 40.0} and got.hits == {"a": 250.0, "b": 0.0}
    assert set(got.scrape_age_s) == {"a", "b", "sg"}


# --- deltas -----------------------------------------------------------------------------


def test_delta_per_backend_with_a_restart_and_a_new_backend() -> None:
    before = CacheCounters("gateway", {"a": 1000.0, "b": 500.0}, {"a": 400.0, "b": 100.0})
    after = CacheCounters(
        "gateway",
        {"a": 1600.0, "b": 200.0, "c": 50.0},  # b restarted, c joined
        {"a": 700.0, "b": 150.0, "c": 10.0},
    )
    got = prefix_cache_delta(before, after)
    assert got == {
        "queries_tokens": 600 + 200 + 50,
        "hits_tokens": 300 + 150 + 10,
        "hit_rate": pytest.approx(460 / 850),
        "source": "gateway",
        "backends": 3,
    }


def test_delta_engine_counts_one_backend_and_no_queries_has_no_rate() -> None:
    page = parse_counters(_engine_page(300, 120))
    assert page is not None
    got = prefix_cache_delta(page, page, note="n")
    assert got == {"queries_tokens": 0, "hits_tokens": 0, "hit_rate": None,
                   "source": "engine", "backends": 1, "note": "n"}  # fmt: skip
    # hits going down alone also means a restart
    lower = CacheCounters("engine", {"k": 400.0}, {"k": 10.0})
    higher = CacheCounters("engine", {"k": 350.0}, {"k": 100.0})
    assert prefix_cache_delta(higher, lower) == {
        "queries_tokens": 400, "hits_tokens": 10, "hit_rate": 0.025,
        "source": "engine", "backends": 1,
    }  # fmt: skip


# --- the probe against a real server -----------------------------------------------------


@contextlib.asynccontextmanager
async def _serve(
    handler: Callable[[web.Request], Awaitable[web.Response]],
) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    async with serve_app(app) as url:
        yield url


def _gateway_page(queries: float, hits: float, age_s: float) -> str:
    return (
        f'kiloserve_gateway_backend_prefix_cache_queries_tokens{{backend="a"}} {queries}\n'
        f'kiloserve_gateway_backend_prefix_cache_hits_tokens{{backend="a"}} {hits}\n'
        f'kiloserve_gateway_scrape_age_seconds{{backend="a"}} {age_s}\n'
    )


async def test_probe_waits_for_a_gateway_scrape_after_the_run() -> None:
    pages = iter([_gateway_page(100, 10, 0.01)] + [_gateway_page(900, 410, 99.0)] * 2
                 + [_gateway_page(1100, 610, 0.0)] * 100)  # fmt: skip

    async def handler(_: web.Request) -> web.Response:
        return web.Response(text=next(pages))

    async with _serve(handler) as url, aiohttp.ClientSession() as session:
        probe = PrefixCacheProbe(session, url)
        await probe.start()
        got = await probe.finish(time.perf_counter())
    # the two pages with a scrape from before the end were skipped
    assert got == {"queries_tokens": 1000, "hits_tokens": 600, "hit_rate": 0.6,
                   "source": "gateway", "backends": 1}  # fmt: skip


async def test_probe_times_out_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache, "MAX_WAIT_S", 0.6)
    monkeypatch.setattr(prefix_cache, "POLL_INTERVAL_S", 0.05)
    pages = iter([_gateway_page(100, 10, 0.01)] + [_gateway_page(300, 110, 99.0)] * 100)

    async def handler(_: web.Request) -> web.Response:
        return web.Response(text=next(pages))

    async with _serve(handler) as url, aiohttp.ClientSession() as session:
        probe = PrefixCacheProbe(session, url + "/")
        await probe.start()
        got = await probe.finish(time.perf_counter())
    assert got is not None and got["queries_tokens"] == 200 and got["hits_tokens"] == 100
    assert "no gateway scrape after the run" in str(got["note"]) and "a" in str(got["note"])


async def test_probe_missing_pages_give_none() -> None:
    async def not_found(_: web.Request) -> web.Response:
        return web.Response(status=404, text="404: Not Found")

    async def unauthorized(_: web.Request) -> web.Response:
        return web.Response(status=401, text='{"error": "no key"}')

    for handler in (not_found, unauthorized):
        async with _serve(handler) as url, aiohttp.ClientSession() as session:
            probe = PrefixCacheProbe(session, url)
            await probe.start()
            assert await probe.finish(0.0) is None
    async with _serve(not_found) as url:
        pass  # nothing listens there any more: a connection error
    async with aiohttp.ClientSession() as session:
        probe = PrefixCacheProbe(session, url)
        assert await probe.read() is None


# --- the summary -------------------------------------------------------------------------


def test_summary_carries_the_block_and_the_markdown_shows_it() -> None:
    stats = ClientStats(0.1, 0.5, 1.0, 0.1, 1)
    result = BenchResult([], 1.0, 0.0, stats, {"url": "x"}, {"seed": 3}, "d")
    summary = summarize(result)
    assert "prefix_cache" in summary and summary["prefix_cache"] is None
    assert "prefix-cache" not in summary_markdown(summary)
    block: dict[str, object] = {"queries_tokens": 1000, "hits_tokens": 432, "hit_rate": 0.432,
                                "source": "gateway", "backends": 2}  # fmt: skip
    result.prefix_cache = block
    summary = summarize(result)
    assert summary["prefix_cache"] == block
    assert (
        "| prefix-cache hit rate (engine counters) | 43.2% (gateway, 2 backends; 432 of "
        "1000 tokens) |" in summary_markdown(summary)
    )
