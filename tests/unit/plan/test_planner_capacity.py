"""Percentile SLOs, the rate search and sweep-file input of the per-replica capacity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kiloserve.errors import ConfigError
from kiloserve.plan.capacity import (
    SloTarget,
    capacity_from_sweep,
    parse_percentile_slo,
    search_capacity,
    slo_violations,
)

SLO = parse_percentile_slo("ttft_p95=500ms,tpot_p95=50ms")


def test_parse_percentile_slo() -> None:
    slo = parse_percentile_slo("ttft_p95=0.8s, tpot_p99=50, e2e=2000us")
    assert slo.targets == (
        SloTarget("ttft", 95, 800.0),
        SloTarget("tpot", 99, 50.0),
        SloTarget("e2e", 95, 2.0),
    )
    assert slo.to_dict() == {"ttft_p95_ms": 800.0, "tpot_p99_ms": 50.0, "e2e_p95_ms": 2.0}
    assert str(parse_percentile_slo("ttft_p50=100ms")) == "ttft_p50=100ms"


@pytest.mark.parametrize(
    "text",
    ["ttft_p95", "ttft_p97=1s", "foo_p95=1s", "ttft_p95=1h", "ttft=1,ttft_p95=2", "tpot_p95=50"],
)
def test_parse_percentile_slo_errors(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_percentile_slo(text)


def _summary(ttft_p95: float, tpot_p95: float | None = 20.0, **extra: Any) -> dict[str, Any]:
    return {
        "ttft_ms": {"p50": ttft_p95 / 2, "p95": ttft_p95, "p99": ttft_p95 * 1.2},
        "tpot_ms": {"p50": tpot_p95, "p95": tpot_p95, "p99": tpot_p95},
        "e2e_ms": {"p50": 1000.0, "p95": 2000.0, "p99": 3000.0},
        "request_throughput": 1.0,
        "output_token_throughput": 100.0,
        "error_rate": 0.0,
        **extra,
    }


def test_slo_violations() -> None:
    assert slo_violations(_summary(400.0), SLO) == []
    assert slo_violations(_summary(600.0, 60.0), SLO) == [
        "ttft_p95 600 ms > 500 ms",
        "tpot_p95 60 ms > 50 ms",
    ]
    assert slo_violations(_summary(100.0, error_rate=0.02), SLO) == ["error rate 2.0%"]
    # Only single-token outputs: no TPOT to bound, the SLO still holds.
    assert slo_violations(_summary(100.0, None), SLO) == []


def queue_probe(capacity_rps: float, calls: list[float]) -> Any:
    """TTFT P95 of an M/M/1-like queue: 100 ms / (1 - rate / capacity)."""

    def probe(rate: float) -> dict[str, Any]:
        calls.append(rate)
        if rate >= capacity_rps:  # overloaded: the queue grows, throughput saturates
            return _summary(1e9, request_throughput=capacity_rps)
        return _summary(100.0 / (1.0 - rate / capacity_rps), request_throughput=rate)

    return probe


@pytest.mark.parametrize("initial", [0.05, 1.0, 7.9, 100.0])
def test_search_finds_the_slo_rate(initial: float) -> None:
    # TTFT P95 <= 500 ms  <=>  rate <= 0.8 x 10 = 8 req/s.
    calls: list[float] = []
    result = search_capacity(queue_probe(10.0, calls), SLO, initial, max_num_probes=20)
    assert 8.0 / 1.05 <= result.rate_rps <= 8.0
    assert result.is_bracketed
    assert len(result.points) == len(calls) <= 20
    best = result.best
    assert best is not None and best.rate_rps == result.rate_rps
    assert result.output_tokens_per_s == 100.0


def test_search_is_deterministic() -> None:
    first = search_capacity(queue_probe(10.0, []), SLO, 1.0)
    second = search_capacity(queue_probe(10.0, []), SLO, 1.0)
    assert first.to_dict() == second.to_dict()


def test_search_respects_max_num_probes() -> None:
    calls: list[float] = []
    result = search_capacity(queue_probe(1e6, calls), SLO, 1.0, max_num_probes=4)
    assert calls == [1.0, 2.0, 4.0, 8.0]
    assert result.rate_rps == 8.0
    assert not result.is_bracketed


def test_search_stops_at_the_latency_floor() -> None:
    # Even an idle replica takes 900 ms to the first token: halving cannot help.
    calls: list[float] = []

    def probe(rate: float) -> dict[str, Any]:
        calls.append(rate)
        return _summary(900.0 + rate, request_throughput=rate)

    result = search_capacity(probe, SLO, 4.0, max_num_probes=12)
    assert result.rate_rps == 0.0
    assert result.best is None
    assert len(calls) == 2
    assert result.points[-1].violations == ("ttft_p95 902 ms > 500 ms",)


def test_search_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        search_capacity(queue_probe(1.0, []), SLO, 0.0)
    with pytest.raises(ConfigError):
        search_capacity(queue_probe(1.0, []), SLO, 1.0, max_num_probes=1)


def _sweep_row(value: float, req_s: float, ttft_p95: float, tpot_p95: float) -> dict[str, float]:
    return {
        "value": value,
        "request_throughput": req_s,
        "output_token_throughput": req_s * 100,
        "tpot_p50_ms": tpot_p95 * 0.8,
        "tpot_p95_ms": tpot_p95,
        "ttft_p50_ms": ttft_p95 * 0.5,
        "ttft_p95_ms": ttft_p95,
        "e2e_p95_ms": 5000.0,
        "error_rate": 0.0,
    }


def write_sweep(path: Path, rows: list[dict[str, float]]) -> Path:
    data = {"schema_version": 1, "parameter": "concurrency", "model": "m", "points": rows}
    path.write_text(json.dumps(data))
    return path


def test_capacity_from_sweep(tmp_path: Path) -> None:
    rows = [
        _sweep_row(1, 0.4, 120.0, 22.0),
        _sweep_row(4, 1.3, 200.0, 35.0),
        _sweep_row(8, 1.9, 450.0, 48.0),
        _sweep_row(16, 2.0, 900.0, 70.0),
    ]
    path = write_sweep(tmp_path / "sweep.json", rows)
    result = capacity_from_sweep(path, SLO)
    assert result.rate_rps == 1.9
    assert result.output_tokens_per_s == 190.0
    assert result.source == f"sweep:{path}"
    assert result.is_bracketed
    assert [p.is_passing for p in result.points] == [True, True, True, False]


def test_capacity_from_sweep_nothing_passes(tmp_path: Path) -> None:
    path = write_sweep(tmp_path / "sweep.json", [_sweep_row(1, 0.4, 800.0, 22.0)])
    result = capacity_from_sweep(path, SLO)
    assert result.rate_rps == 0.0
    assert not result.is_bracketed


def test_capacity_from_sweep_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        capacity_from_sweep(tmp_path / "missing.json", SLO)
    (tmp_path / "bad.json").write_text('{"points": []}')
    with pytest.raises(ConfigError, match="no sweep points"):
        capacity_from_sweep(tmp_path / "bad.json", SLO)
    (tmp_path / "row.json").write_text('{"points": [{"value": 1}]}')
    with pytest.raises(ConfigError, match="bad sweep point"):
        capacity_from_sweep(tmp_path / "row.json", SLO)


def test_backlog_after_the_last_arrival_is_a_violation() -> None:
    # e2e P99 is 3 s; arrivals span 60 s, so up to 2 x 3 + 6 s of drain is fine.
    kept_up = _summary(100.0, probe_arrival_span_s=60.0, duration_s=71.5)
    assert slo_violations(kept_up, SLO) == []
    queued = _summary(100.0, probe_arrival_span_s=60.0, duration_s=75.0)
    assert slo_violations(queued, SLO) == [
        "backlog: 15.0 s to drain after the last arrival (> 12.0 s)"
    ]
    # Cluster runs, sweep rows and other summaries without a probe span are not judged
    # on it (the simulator's own arrival_span_s does not count).
    assert slo_violations(_summary(100.0, arrival_span_s=60.0, duration_s=500.0), SLO) == []


def test_initial_rate_guess_scales_with_work() -> None:
    from kiloserve.catalog import get_gpu, get_model
    from kiloserve.engine.timing import StepTimeModel
    from kiloserve.plan.capacity import initial_rate_guess

    timer = StepTimeModel(get_gpu("H100"), get_model("qwen2-72b"), 4)
    chat = initial_rate_guess(timer, 1000, 200)
    # 16 requests decoding together at ~30 ms per step, 200 steps each: ~2.5 req/s.
    assert 1.0 < chat < 5.0
    assert initial_rate_guess(timer, 1000, 400) < chat
    assert initial_rate_guess(timer, 8000, 200) < chat
    fast = StepTimeModel(get_gpu("H100"), get_model("qwen2-72b"), 8)
    assert initial_rate_guess(fast, 1000, 200) > chat


def test_search_stops_when_failures_do_not_fall_with_load() -> None:
    calls: list[float] = []

    def probe(rate: float) -> dict[str, Any]:
        calls.append(rate)
        return _summary(100.0, error_rate=1.0, request_throughput=0.0)

    result = search_capacity(probe, SLO, 4.0)
    assert result.rate_rps == 0.0
    assert calls == [4.0, 2.0]
    assert result.points[-1].violations == ("error rate 100.0%",)


def test_capacity_from_a_rate_sweep_uses_the_offered_rate(tmp_path: Path) -> None:
    rows = [_sweep_row(2.0, 1.8, 200.0, 30.0), _sweep_row(4.0, 3.5, 700.0, 45.0)]
    data = {"schema_version": 1, "parameter": "rate", "points": rows}
    (tmp_path / "sweep.json").write_text(json.dumps(data))
    result = capacity_from_sweep(tmp_path / "sweep.json", SLO)
    assert result.rate_rps == 2.0  # offered, not the drain-biased 1.8 measured
    assert result.output_tokens_per_s == pytest.approx(1.8 * 100 / 1.8 * 2.0)
