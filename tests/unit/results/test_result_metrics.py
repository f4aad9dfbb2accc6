"""Metric definitions (vllm bench serve conventions) on hand-built timestamp sequences."""

from __future__ import annotations

import math

import orjson
import pytest

from kiloserve.bench.stream import StreamState
from kiloserve.bench.sweep import find_knee, parse_sweep
from kiloserve.errors import ConfigError
from kiloserve.results.metrics import is_good, latency_stats, parse_slo, summarize, tenant_moves
from kiloserve.results.records import BenchResult, ClientStats, RequestRecord


def _chunk(text: str) -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"index": 0, "text": text}]}) + b"\n\n"


def _usage(n: int) -> bytes:
    return b"data: " + orjson.dumps({"choices": [], "usage": {"completion_tokens": n}}) + b"\n\n"


def _record(rid: str, ttft_s: float, itl_s: list[float], n_out: int, backend: str = "b0",
            ok: bool = True) -> RequestRecord:  # fmt: skip
    e2e = ttft_s + sum(itl_s)
    return RequestRecord(
        request_id=rid, scheduled_s=0.0, start_s=0.0, input_tokens=10, max_tokens=n_out,
        output_tokens=n_out, ttft_s=ttft_s, itl_s=itl_s, e2e_s=e2e, is_ok=ok, backend=backend,
        status=200 if ok else 500, error=None if ok else "HTTP 500: boom",
    )  # fmt: skip


def _result(records: list[RequestRecord], duration_s: float = 2.0) -> BenchResult:
    stats = ClientStats(lag_mean_ms=0.1, lag_p99_ms=0.5, lag_max_ms=1.0, cpu_util=0.1,
                        max_in_flight=2)  # fmt: skip
    return BenchResult(records, duration_s, 0.0, stats, {"url": "x"}, {"seed": 3}, "d")


def test_stream_state_timestamps_follow_vllm_conventions() -> None:
    state = StreamState(start_s=10.0, is_chat=False)
    state.feed(b": ping\n\n", 10.05)  # comments are not tokens
    state.feed(_chunk("a"), 10.1)  # TTFT = 0.1
    state.feed(_chunk("")[:-1], 10.2)  # empty text is not a token chunk, split event
    state.feed(b"\n" + _chunk("b"), 10.3)  # gap 0.2
    state.feed(_chunk("c") + _chunk("d"), 10.6)  # one read, two chunks: gaps 0.3 and 0.0
    state.feed(_usage(7) + b"data: [DONE]\n\n", 10.7)
    record = RequestRecord("r", 0.0, 0.0, 5, 7)
    state.finish(record)
    assert record.is_ok
    assert record.ttft_s == pytest.approx(0.1)
    assert record.itl_s == pytest.approx([0.2, 0.3, 0.0])
    assert record.num_chunks == 4
    assert record.output_tokens == 7  # from usage, not the chunk count
    assert record.e2e_s == pytest.approx(0.6)  # to the last token chunk, as vLLM
    assert record.tpot_s == pytest.approx(0.5 / 6)


def test_stream_state_chat_deltas_and_fallback_count() -> None:
    state = StreamState(start_s=0.0, is_chat=True)
    role = {"choices": [{"delta": {"role": "assistant"}}]}
    state.feed(b"data: " + orjson.dumps(role) + b"\n\n", 0.1)
    for i, t in enumerate((0.2, 0.25, 0.4)):
        event = {"choices": [{"delta": {"content": f"w{i}"}}]}
        state.feed(b"data: " + orjson.dumps(event) + b"\n\n", t)
    state.feed(b"data: [DONE]\n\n", 0.5)
    record = RequestRecord("r", None, 0.0, 5, 3)
    state.finish(record)
    assert record.ttft_s == pytest.approx(0.2)
    assert record.itl_s == pytest.approx([0.05, 0.15])
    assert record.output_tokens == 3  # no usage chunk: count content chunks


def test_stream_without_done_or_with_error_fails() -> None:
    cut = StreamState(0.0, is_chat=False)
    cut.feed(_chunk("a"), 0.1)
    record = RequestRecord("r", None, 0.0, 5, 3)
    cut.finish(record)
    assert not record.is_ok and record.error == "stream ended before [DONE]"
    bad = StreamState(0.0, is_chat=False)
    bad.feed(b'data: {"error": {"message": "overloaded"}}\n\n', 0.1)
    bad.finish(record)
    assert not record.is_ok and "overloaded" in (record.error or "")


def test_tpot_definition_and_single_token_requests() -> None:
    r = _record("a", 0.1, [0.02, 0.03, 0.04], 4)
    assert r.tpot_s == pytest.approx((0.19 - 0.1) / 3)
    assert _record("b", 0.1, [], 1).tpot_s is None  # TPOT needs > 1 output token


def test_latency_stats_percentiles_match_numpy_linear() -> None:
    stats = latency_stats([1.0, 2.0, 3.0, 4.0, 10.0])
    assert stats["mean"] == pytest.approx(4.0)
    assert stats["p50"] == pytest.approx(3.0)
    assert stats["p90"] == pytest.approx(7.6)  # 4 + 0.6 * (10 - 4)
    assert stats["p99"] == pytest.approx(9.76)
    assert stats["std"] == pytest.approx(math.sqrt(10.0))
    assert latency_stats([])["p95"] is None


def test_summarize_throughput_itl_and_failures() -> None:
    records = [
        _record("a", 0.1, [0.01, 0.01], 3, "b0"),
        _record("b", 0.3, [0.05], 2, "b1"),
        _record("c", 0.2, [], 1, "b1", ok=False),
    ]
    s = summarize(_result(records, duration_s=2.0))
    assert s["requests_ok"] == 2 and s["requests_failed"] == 1
    assert s["error_rate"] == pytest.approx(1 / 3)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_token_throughput"] == pytest.approx(2.5)
    ttft = s["ttft_ms"]
    assert isinstance(ttft, dict) and ttft["mean"] == pytest.approx(200.0)  # failed excluded
    itl = s["itl_ms"]
    assert isinstance(itl, dict) and itl["mean"] == pytest.approx((10 + 10 + 50) / 3)
    tpot = s["tpot_ms"]
    assert isinstance(tpot, dict) and tpot["p50"] == pytest.approx((10.0 + 50.0) / 2)
    assert "goodput" not in s
    assert s["schema_version"] == 1 and s["seed"] == 3


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = [
        _record("fast", 0.1, [0.01] * 9, 10),  # ttft 100 ms, tpot 10 ms, e2e 190 ms
        _record("slow_start", 0.6, [0.01] * 9, 10),  # ttft too high
        _record("slow_decode", 0.1, [0.08] * 9, 10),  # tpot too high
        _record("one_token", 0.2, [], 1),  # tpot counts as 0
        _record("failed", 0.1, [0.01], 2, ok=False),
    ]
    slo = parse_slo("ttft=500ms,tpot=50ms")
    assert [is_good(r, slo) for r in records] == [True, False, False, True, False]
    s = summarize(_result(records, duration_s=4.0), slo)
    assert s["goodput"] == pytest.approx(2 / 4.0)
    assert s["slo"] == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert s["slo_attainment"] == pytest.approx(2 / 5)


def test_per_backend_groups_and_p95_std() -> None:
    records = [_record(f"a{i}", 0.1, [0.01], 2, "b0") for i in range(5)]
    records += [_record(f"b{i}", 0.3, [0.01], 2, "b1") for i in range(5)]
    s = summarize(_result(records))
    per_backend = s["per_backend"]
    assert isinstance(per_backend, dict) and set(per_backend) == {"b0", "b1"}
    assert per_backend["b0"]["count"] == 5
    assert per_backend["b1"]["ttft_ms"]["p95"] == pytest.approx(300.0)
    # E2E P95s are 110 and 310 ms: population std-dev 100 ms
    assert s["p95_std_across_backends_ms"] == pytest.approx(100.0)
    assert s["ttft_p95_std_across_backends_ms"] == pytest.approx(100.0)


def test_parse_slo_units_and_errors() -> None:
    slo = parse_slo("ttft=0.5s, tpot=50, e2e=2000000us")
    assert (slo.ttft_ms, slo.tpot_ms, slo.e2e_ms) == (500.0, 50.0, 2000.0)
    for bad in ("ttft=fast", "latency=5ms", "ttft=5ms,ttft=6ms", ""):
        with pytest.raises(ConfigError):
            parse_slo(bad)


def test_client_stats_warns_when_loop_lags() -> None:
    calm = ClientStats(0.1, 1.0, 2.0, 0.3, 10)
    busy = ClientStats(10.0, 45.0, 80.0, 0.99, 10)
    assert calm.warning() is None
    assert "saturated" in (busy.warning() or "")


def test_dispatch_delay_only_for_open_loop() -> None:
    records = [_record("a", 0.1, [0.01], 2), _record("b", 0.1, [0.01], 2)]
    records[0].scheduled_s, records[0].start_s = 1.0, 1.002
    records[1].scheduled_s, records[1].start_s = 2.0, 2.3
    result = _result(records)
    result.config = {"arrival": {"mode": "open"}}
    s = summarize(result)
    delay = s["dispatch_delay_ms"]
    assert isinstance(delay, dict) and delay["p50"] == pytest.approx(151.0)
    assert "sent late" in str(s["dispatch_warning"])
    result.config = {"arrival": {"mode": "closed", "concurrency": 2}}
    assert "dispatch_delay_ms" not in summarize(result)


def _row(value: float, thr: float) -> dict[str, float]:
    return {"value": value, "output_token_throughput": thr, "tpot_p50_ms": 10.0 * value}


def test_knee_where_throughput_stops_growing() -> None:
    # seed 002's single-card sweep: 45 tok/s at 1, 110 at 4, then flat
    rows = [_row(1, 45.0), _row(2, 80.0), _row(4, 110.0), _row(8, 112.0), _row(16, 113.0)]
    knee = find_knee(rows)
    assert knee["value"] == 4 and knee["is_saturated"]
    assert knee["gain_per_doubling"][1] == pytest.approx(80 / 45 - 1)
    # doubling 4 -> 8 gains < 10%; two doublings 2 -> 8 are judged per doubling
    sparse = find_knee([_row(2, 80.0), _row(8, 96.0)])
    assert sparse["gain_per_doubling"][1] == pytest.approx((96 / 80) ** 0.5 - 1)
    assert sparse["value"] == 2 and sparse["is_saturated"]
    growing = find_knee([_row(1, 10.0), _row(2, 19.0), _row(4, 35.0)])
    assert growing["value"] == 4 and not growing["is_saturated"]


def test_parse_sweep() -> None:
    assert parse_sweep("concurrency=8,1,2,4") == ("concurrency", [1.0, 2.0, 4.0, 8.0])
    assert parse_sweep("rate=0.5,1") == ("rate", [0.5, 1.0])
    for bad in ("qps=1,2", "concurrency=1.5", "rate=", "rate=-1"):
        with pytest.raises(ConfigError):
            parse_sweep(bad)


def test_tenant_moves_count_requests_sent_where_their_tenant_never_was() -> None:
    def rec(t: float, group: str, backend: str) -> RequestRecord:
        return RequestRecord(
            request_id=f"{group}-{t}", scheduled_s=t, start_s=t, input_tokens=10, max_tokens=1,
            output_tokens=1, ttft_s=0.1, itl_s=[], e2e_s=0.1, is_ok=True, backend=backend,
            status=200, error=None, prefix_group=group,
        )  # fmt: skip

    # out of order on purpose: counted in the order they were scheduled
    records = [rec(3.0, "a", "b1"), rec(1.0, "a", "b0"), rec(2.0, "b", "b1"),
               rec(4.0, "a", "b0"), rec(5.0, "a", "b1"), rec(6.0, "b", "b0")]  # fmt: skip
    assert tenant_moves(records) == 2  # a: b0 -> b1 (t=3), b: b1 -> b0 (t=6)
