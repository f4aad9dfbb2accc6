"""Streaming metrics: ITL histogram, time-series bound, summary schema."""

from __future__ import annotations

import numpy as np
import pytest

from kiloserve.results.metrics import Slo, latency_stats
from kiloserve.results.records import RequestRecord
from kiloserve.sim.results import ItlHistogram, MetricsCollector, TimeSeries

BENCH_KEYS = {
    "schema_version", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "requests_ok",
    "requests_failed", "timeouts", "error_rate", "request_throughput",
    "output_token_throughput", "total_token_throughput", "input_tokens_total",
    "output_tokens_total", "duration_s", "per_backend", "p95_std_across_backends_ms",
    "ttft_p95_std_across_backends_ms", "errors",
}  # fmt: skip


def test_itl_histogram_matches_exact_percentiles_within_one_percent() -> None:
    rng = np.random.default_rng(0)
    gaps_s = rng.lognormal(np.log(0.02), 0.6, size=20_000)
    hist = ItlHistogram()
    for gap in gaps_s:
        hist.add(float(gap), 1)
    exact = latency_stats(gaps_s * 1000.0)
    got = hist.stats()
    for key in ("mean", "std", "p50", "p90", "p95", "p99"):
        assert got[key] == pytest.approx(exact[key], rel=0.01), key


def test_itl_weights_count_as_repeated_gaps() -> None:
    hist = ItlHistogram()
    hist.add(0.010, 9)
    hist.add(0.100, 1)
    stats = hist.stats()
    assert stats["p50"] == pytest.approx(10.0, rel=0.01)
    assert stats["p99"] == pytest.approx(100.0, rel=0.01)
    assert stats["mean"] == pytest.approx(19.0)


def test_time_series_stays_bounded_and_averages_pairs() -> None:
    series = TimeSeries(num_backends=2, interval_s=1.0, max_num_points=4)
    for t in range(1, 101):
        series.add(float(t), [t / 100.0, 0.5], [0.25, 0.75])
    assert len(series.times_s) < 8
    assert series.interval_s > 1.0
    assert all(row[1] == pytest.approx(0.5) for row in series.utilisation)
    data = series.to_dict(["a", "b"])
    assert list(data["utilisation"]) == ["a", "b"]  # type: ignore[call-overload]


def _record(rid: str, ttft_s: float, e2e_s: float, output_tokens: int) -> RequestRecord:
    return RequestRecord(rid, 0.0, 0.0, 100, output_tokens, output_tokens, ttft_s, [], e2e_s,
                         True, status=200)  # fmt: skip


def test_summary_has_the_bench_schema_and_per_backend_counts() -> None:
    metrics = MetricsCollector(["b0", "b1"], Slo(ttft_ms=150.0))
    metrics.add_ok(_record("r0", 0.1, 1.1, 11), 0, 1.1)
    metrics.add_ok(_record("r1", 0.2, 2.2, 21), 1, 2.2)
    failed = RequestRecord("r2", 0.0, 0.0, 100, 5, error="stream cut")
    metrics.add_failed(failed, 1, 2.5)
    metrics.add_failed(RequestRecord("r3", 0.0, 0.0, 100, 5, error="no backend"), None, 2.5)
    summary = metrics.summary(duration_s=2.5)
    assert set(summary) >= BENCH_KEYS
    assert summary["requests_ok"] == 2 and summary["requests_failed"] == 2
    assert summary["goodput"] == pytest.approx(1 / 2.5)
    assert summary["tpot_ms"]["p50"] == pytest.approx(100.0, rel=1e-4)  # type: ignore[index]
    per_backend = summary["per_backend"]
    assert {k: v["count"] for k, v in per_backend.items()} == {"b0": 1, "b1": 2, "unknown": 1}  # type: ignore[union-attr]
    assert summary["errors"] == {"stream cut": 1, "no backend": 1}
