"""Engine metric parsing against captured-style /metrics pages of each engine."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kiloserve.gateway.config import parse_gateway_config
from kiloserve.routing.engine_metrics import EngineMetrics, parse_engine_metrics
from kiloserve.routing.table import BackendTable

DATA = Path(__file__).resolve().parents[2] / "data" / "metrics"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("vllm", EngineMetrics("vllm", 12, 3, 0.4375, 0.4, 3, None, 2000.0, 800.0)),
        ("vllm_legacy", EngineMetrics("vllm", 12, 4, 0.8125, 0.25, 9, None)),
        ("sglang", EngineMetrics("sglang", 21, 6, 0.61, 0.42, None, None)),
        ("llamacpp", EngineMetrics("llamacpp", 2, 1, 0.172, None, None, None)),
        ("tgi", EngineMetrics("tgi", 8, 3, None, None, None, None)),
    ],
)
def test_parse_captured_pages(name: str, expected: EngineMetrics) -> None:
    got = parse_engine_metrics((DATA / f"{name}.txt").read_text())
    assert got == expected


def test_parse_ignores_junk_nan_and_timestamps() -> None:
    text = "\n".join(
        [
            "garbage line without value",
            'vllm:num_requests_running{model_name="a b}c"} 4 1700000000000',
            "vllm:num_requests_waiting NaN",
            "vllm:kv_cache_usage_perc 1.7",
            "vllm:num_requests_running{} notanumber",
            "",
        ]
    )
    got = parse_engine_metrics(text)
    assert (got.num_running, got.num_waiting, got.kv_usage) == (4, None, 1.0)


def test_parse_dcgm_pcie_and_empty_page() -> None:
    text = 'DCGM_FI_PROF_PCIE_TX_BYTES{gpu="0"} 8e9\nDCGM_FI_PROF_PCIE_RX_BYTES{gpu="0"} 16e9\n'
    assert parse_engine_metrics(text).pcie_util == pytest.approx(0.5)
    assert parse_engine_metrics("") == EngineMetrics()


def test_parse_speed_on_a_large_page() -> None:
    page = (DATA / "vllm.txt").read_text()
    filler = "".join(f'other_metric_bucket{{le="{i}"}} {i}\n' for i in range(2000))
    text = filler + page
    started = time.perf_counter()
    for _ in range(10):
        parse_engine_metrics(text)
    per_page_ms = (time.perf_counter() - started) / 10 * 1000
    assert per_page_ms < 20, per_page_ms


def _table(**kw: object) -> BackendTable:
    cfg = parse_gateway_config({"backends": [{"url": "http://b0", "models": ["m"]}], **kw})
    return BackendTable(cfg)


def test_scrapes_drive_health_and_staleness() -> None:
    table = _table(max_scrape_failures=2, stale_after_s=1.0)
    state = table.state("http://b0")
    assert state.scrape_stale and state.healthy  # unknown until first scrape
    table.record_scrape("http://b0", EngineMetrics("vllm", 3, 1, 0.5), now_s=10.0)
    assert (state.num_running, state.kv_usage, state.scrape_stale) == (3, 0.5, False)
    table.refresh_staleness(now_s=10.5)
    assert not state.scrape_stale
    table.record_scrape_failure("http://b0", 10.6, "timeout")
    assert state.healthy  # one failure is not enough
    table.refresh_staleness(now_s=11.5)
    assert state.scrape_stale and state.num_running is None and state.kv_usage is None
    table.record_scrape_failure("http://b0", 11.6, "timeout")
    assert not state.healthy and not state.is_routable
    assert table.snapshot(12.0).pool("m") == (state,)
    table.record_scrape("http://b0", EngineMetrics("vllm", 0, 0, 0.0), now_s=12.0)
    assert state.healthy and state.is_routable and table.is_ready()


def test_metrics_page_missing_means_reachable_but_unknown() -> None:
    table = _table(max_scrape_failures=1)
    table.record_scrape_unavailable("http://b0", 1.0)
    state = table.state("http://b0")
    assert state.healthy and state.scrape_stale and state.num_running is None
