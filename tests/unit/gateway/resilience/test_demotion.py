"""Slow-node demotion and slow start with a fake clock."""

from __future__ import annotations

import pytest

from kiloserve.gateway.resilience.demotion import DemotionConfig, SlowNodeDemoter

POOLS = {"a": ("a", "b", "c"), "b": ("a", "b", "c"), "c": ("a", "b", "c")}


def _demoter(**kw: object) -> SlowNodeDemoter:
    cfg = DemotionConfig.model_validate({"min_num_samples": 3, "slow_start_s": 10.0, **kw})
    return SlowNodeDemoter(cfg)


def _feed(d: SlowNodeDemoter, now_s: float, tpot: dict[str, float], n: int = 5) -> None:
    for _ in range(n):
        for backend, ms in tpot.items():
            d.observe(backend, now_s, 100.0, ms)


def test_absolute_tpot_threshold_demotes_with_reason() -> None:
    d = _demoter(pool_factor=None)
    _feed(d, 0.0, {"a": 20.0, "b": 350.0})
    events = d.evaluate(0.0, POOLS)
    assert [(e.backend_id, e.reason) for e in events] == [("b", "tpot_abs")]
    assert events[0].value_ms == pytest.approx(350.0)
    assert d.weight_factor("b", 0.0) == pytest.approx(0.2)
    assert d.weight_factor("a", 0.0) == 1.0


def test_pool_factor_uses_median_of_the_others() -> None:
    d = _demoter(demoted_weight=0.1)
    _feed(d, 0.0, {"a": 20.0, "b": 22.0, "c": 80.0})  # 80 > 2.5 x 21
    events = d.evaluate(0.0, POOLS)
    assert [(e.backend_id, e.reason) for e in events] == [("c", "tpot_pool")]
    assert d.weight_factor("c", 0.0) == pytest.approx(0.1)


def test_two_backend_pool_still_finds_the_slow_one() -> None:
    d = _demoter()
    _feed(d, 0.0, {"a": 20.0, "b": 80.0})
    pools = {"a": ("a", "b"), "b": ("a", "b")}
    assert [e.backend_id for e in d.evaluate(0.0, pools)] == ["b"]


def test_ttft_threshold() -> None:
    d = _demoter(max_ttft_ms=500.0, pool_factor=None)
    for _ in range(5):
        d.observe("a", 0.0, 900.0, None)
    assert [e.reason for e in d.evaluate(0.0, POOLS)] == ["ttft_abs"]


def test_too_few_samples_never_demote() -> None:
    d = _demoter(pool_factor=None)
    _feed(d, 0.0, {"b": 900.0}, n=2)
    assert d.evaluate(0.0, POOLS) == []


def test_slow_start_ramps_back_and_relapse_demotes_again() -> None:
    d = _demoter(pool_factor=None, window_s=5.0)
    _feed(d, 0.0, {"b": 400.0})
    d.evaluate(0.0, POOLS)
    _feed(d, 6.0, {"b": 30.0})  # old samples leave the 5 s window
    events = d.evaluate(6.0, POOLS)
    assert [(e.backend_id, e.reason) for e in events] == [("b", "")]
    assert d.weight_factor("b", 6.0) == pytest.approx(0.2)
    assert d.weight_factor("b", 11.0) == pytest.approx(0.6)
    _feed(d, 12.0, {"b": 500.0}, n=20)
    assert [e.reason for e in d.evaluate(12.0, POOLS)] == ["tpot_abs"]
    assert d.weight_factor("b", 12.0) == pytest.approx(0.2)
    assert d.describe("b")["num_demotions_total"] == 2


def test_full_weight_after_slow_start() -> None:
    d = _demoter(pool_factor=None, window_s=5.0)
    _feed(d, 0.0, {"b": 400.0})
    d.evaluate(0.0, POOLS)
    _feed(d, 6.0, {"b": 30.0})
    d.evaluate(6.0, POOLS)
    assert d.weight_factor("b", 16.0) == 1.0
    assert d.describe("b")["demoted"] is False


def test_evidence_expiring_starts_recovery() -> None:
    d = _demoter(pool_factor=None, window_s=5.0)
    _feed(d, 0.0, {"b": 400.0})
    d.evaluate(0.0, POOLS)
    assert [e.reason for e in d.evaluate(10.0, POOLS)] == [""]


def test_disabled() -> None:
    d = _demoter(enabled=False)
    _feed(d, 0.0, {"b": 4000.0})
    assert d.evaluate(0.0, POOLS) == []
    assert d.weight_factor("b", 0.0) == 1.0


def test_at_most_half_a_pool_is_demoted() -> None:
    d = _demoter(pool_factor=None)
    _feed(d, 0.0, {"a": 400.0, "b": 400.0, "c": 20.0})
    events = d.evaluate(0.0, POOLS)
    assert len([e for e in events if e.reason]) == 1  # floor(3 x 50 %) = 1


def test_recovery_needs_a_margin_under_the_threshold() -> None:
    d = _demoter(pool_factor=None, window_s=5.0, recover_ratio=0.8)
    _feed(d, 0.0, {"b": 400.0})
    d.evaluate(0.0, POOLS)
    _feed(d, 6.0, {"b": 280.0})  # under 300 but not under 0.8 x 300
    assert d.evaluate(6.0, POOLS) == []
    assert d.weight_factor("b", 6.0) == pytest.approx(0.2)
    _feed(d, 12.0, {"b": 200.0})
    assert [e.reason for e in d.evaluate(12.0, POOLS)] == [""]
