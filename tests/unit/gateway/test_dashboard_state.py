"""Dashboard ring buffers and health explanations (pure logic, time passed in)."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from kiloserve.errors import ConfigError
from kiloserve.gateway.app import create_gateway_app
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.dashboard import health_of
from kiloserve.gateway.dashboard_state import (
    DashboardConfig,
    DashboardRecorder,
    LatencySamples,
    RateCounts,
    percentile,
)
from kiloserve.policies.base import Decision, Outcome, RequestInfo
from kiloserve.routing.table import BackendTable


def _info(i: int) -> RequestInfo:
    return RequestInfo(request_id=f"r{i}", model="m", input_tokens=10, predicted_output_tokens=5)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 95) == 95.0
    assert percentile([7.0], 95) == 7.0
    assert percentile([1.0, 2.0], 50) == 1.0 and percentile([1.0, 2.0], 95) == 2.0


def test_samples_outside_the_window_are_ignored() -> None:
    samples = LatencySamples(max_num_samples=100)
    samples.add(0.0, 1000.0)  # old
    for i in range(10):
        samples.add(10.0 + i * 0.1, float(i + 1))
    p50, p95 = samples.p50_p95(now_s=11.0, window_s=5.0)
    assert (p50, p95) == (5.0, 10.0)
    assert samples.p50_p95(now_s=30.0, window_s=5.0) == (None, None)


def test_buffers_are_bounded() -> None:
    cfg = DashboardConfig(max_num_points=5, max_num_decisions=3, max_num_samples=8)
    rec = DashboardRecorder(cfg)
    for i in range(50):
        rec.note_decision(float(i), _info(i), Decision(("a", "b"), "p", reason="x"), ("a", "b"))
        rec.note_outcome("a", float(i), Outcome(True, ttft_ms=float(i), tpot_ms=1.0))
        rec.tick(float(i), ["a", "b"], {"m": RateCounts(i, 0)})
    assert [d.request_id for d in rec.recent_decisions(10)] == ["r49", "r48", "r47"]
    view = rec.latency_view("a")
    assert len(view["ttft_p50"]) == 5 and len(rec.request_rate) == 5
    assert rec.latency_view("b")["ttft_p50"] == [None] * 5  # ticked, never sampled
    assert rec.latency_view("never-seen") == {
        "ttft_p50": [], "ttft_p95": [], "tpot_p50": [], "tpot_p95": [],
    }  # fmt: skip


def test_ticks_turn_samples_into_sparkline_points() -> None:
    rec = DashboardRecorder(DashboardConfig(window_s=10.0))
    rec.tick(0.0, ["a"], {})
    for i in range(20):
        rec.note_outcome("a", 0.5 + i * 0.01, Outcome(True, ttft_ms=100.0 + i, tpot_ms=None))
    rec.note_outcome("a", 0.9, Outcome(False, status=502))  # no first token: no sample
    rec.tick(1.0, ["a"], {})
    view = rec.latency_view("a")
    assert view["ttft_p50"] == [None, 109.0] and view["ttft_p95"] == [None, 118.0]
    assert view["tpot_p50"] == [None, None]


def test_rates_come_from_counter_deltas_per_model() -> None:
    rec = DashboardRecorder(DashboardConfig())
    rec.tick(0.0, [], {"m": RateCounts(100, 10)})  # baseline: no point yet
    assert list(rec.request_rate) == []
    rec.tick(2.0, [], {"m": RateCounts(120, 14), "n": RateCounts(6, 0)})
    assert list(rec.request_rate) == [13.0] and list(rec.error_rate) == [2.0]
    assert rec.pool_rates == {"m": (10.0, 2.0), "n": (3.0, 0.0)}


def test_decision_shares_count_policy_and_backend() -> None:
    rec = DashboardRecorder(DashboardConfig())
    for i, (policy, backend) in enumerate([("p", "a"), ("p", "b"), ("p", "a"), ("q", "a")]):
        rec.note_decision(0.0, _info(i), Decision((backend,), policy), (backend,))
    assert rec.decision_shares() == [("p", "a", 2), ("p", "b", 1), ("q", "a", 1)]


def _table() -> BackendTable:
    cfg = parse_gateway_config({"backends": [{"url": "http://127.0.0.1:1", "name": "x"}]})
    return BackendTable(cfg)


def test_health_explains_each_state() -> None:
    table = _table()
    rec = table.record("x")
    assert health_of(rec, 0.0)[0] == "stale"  # never scraped: load unknown
    rec.state.scrape_stale = False
    assert health_of(rec, 0.0)[0] == "healthy"
    demoted = {"demoted": True, "demotion_reason": "tpot_pool"}
    state, why = health_of(rec, 0.0, demoted)
    assert state == "demoted" and "TPOT" in why
    assert health_of(rec, 0.0, {**demoted, "recovering": True})[0] == "recovering"
    table.set_draining("x", True)
    assert health_of(rec, 0.0)[0] == "draining"
    table.set_veto("x", "ejected", True)
    state, why = health_of(rec, 0.0, {"ejected_for_s": 4.5, "last_ejection_reason": "5xx"})
    assert state == "ejected" and "4.5 s" in why and "5xx" in why
    table.set_veto("x", "ejected", False)
    table.set_veto("x", "probe", True)
    assert health_of(rec, 0.0) == ("down", "active health probes fail")


def test_dashboard_config_is_strict_and_bounded() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'dashboard\.refresh_ms'"):
        parse_gateway_config({"dashboard": {"refresh_ms": 100}})
    with pytest.raises(ConfigError, match="refresh_interval_ms"):
        parse_gateway_config({"dashboard": {"refresh_interval_ms": 5000}})
    cfg = parse_gateway_config({})
    assert cfg.dashboard.enabled and not cfg.dashboard.allow_remote


async def _status_from(remote: str, allow_remote: bool) -> int:
    data = {"backends": [{"url": "http://127.0.0.1:1", "name": "x", "models": ["m"]}]}
    cfg = parse_gateway_config({**data, "dashboard": {"allow_remote": allow_remote}})
    app = create_gateway_app(cfg)
    request = make_mocked_request("GET", "/dashboard/state", app=app).clone(remote=remote)
    match = await app.router.resolve(request)
    response = await match.handler(request)
    return response.status


@pytest.mark.parametrize(
    ("remote", "allow_remote", "status"),
    [("127.0.0.1", False, 200), ("::1", False, 200), ("10.0.0.9", False, 403),
     ("10.0.0.9", True, 200)],
)  # fmt: skip
async def test_dashboard_is_loopback_only_unless_allowed(
    remote: str, allow_remote: bool, status: int
) -> None:
    assert await _status_from(remote, allow_remote) == status
