"""Passive outlier detection / circuit breaker state machine with a fake clock."""

from __future__ import annotations

from kiloserve.gateway.resilience.outlier import BreakerState, OutlierConfig, OutlierDetector

POOL = ("a", "b", "c", "d")


def _detector(**kw: object) -> OutlierDetector:
    cfg = OutlierConfig.model_validate(
        {"consecutive_gateway_failures": 3, "base_ejection_time_s": 10.0, **kw}
    )
    return OutlierDetector(cfg)


def _fail(d: OutlierDetector, backend: str, now_s: float, n: int, status: int = 502) -> bool:
    return any([d.on_result(backend, status, now_s, POOL) for _ in range(n)])


def test_consecutive_failures_eject_and_success_resets() -> None:
    d = _detector()
    assert not _fail(d, "a", 0.0, 2)
    d.on_result("a", 200, 0.0, POOL)  # resets the run
    assert not _fail(d, "a", 0.0, 2)
    assert d.state("a") is BreakerState.CLOSED
    assert d.on_result("a", 503, 0.0, POOL)
    assert d.is_ejected("a")


def test_client_4xx_and_client_gone_never_count() -> None:
    d = _detector()
    for status in (400, 404, 413, 429, 499) * 5:
        d.on_result("a", status, 0.0, POOL)
    assert d.state("a") is BreakerState.CLOSED
    # 4xx is a success (resets), 499 is ignored (keeps the run)
    _fail(d, "a", 0.0, 2)
    d.on_result("a", 499, 0.0, POOL)
    assert d.on_result("a", 504, 0.0, POOL)


def test_ejection_time_grows_and_half_open_allows_one_trial() -> None:
    d = _detector(max_ejection_time_s=25.0)
    _fail(d, "a", 0.0, 3)
    assert d.tick(9.9) == []
    assert d.tick(10.0) == ["a"]
    assert d.state("a") is BreakerState.HALF_OPEN and d.is_ejected("a")
    assert d.try_trial("a")
    assert not d.try_trial("a")  # only one trial at a time
    assert d.on_result("a", 502, 10.5, POOL)  # trial failed: ejected again, 2 x 10 s
    assert d.tick(30.4) == []
    assert d.tick(30.5) == ["a"]
    assert d.try_trial("a")
    assert d.on_result("a", 502, 31.0, POOL)  # third ejection: 30 s capped at 25 s
    assert d.tick(55.9) == []
    assert d.tick(56.0) == ["a"]
    assert d.try_trial("a")
    assert not d.on_result("a", 200, 56.1, POOL)
    assert d.state("a") is BreakerState.CLOSED and not d.is_ejected("a")
    assert d.num_ejections_total("a") == 3


def test_multiplier_decays_while_healthy() -> None:
    d = _detector()
    _fail(d, "a", 0.0, 3)
    d.tick(10.0)
    d.try_trial("a")
    d.on_result("a", 200, 10.0, POOL)
    d.tick(20.0)  # one base time healthy: multiplier back to 0
    _fail(d, "a", 20.0, 3)
    assert d.tick(29.9) == []
    assert d.tick(30.0) == ["a"]  # 1 x base again, not 2 x


def test_max_ejection_percent_caps_a_pool() -> None:
    d = _detector(max_ejection_percent=50.0)
    assert _fail(d, "a", 0.0, 3)
    assert _fail(d, "b", 0.0, 3)
    assert not _fail(d, "c", 0.0, 10)  # 2 of 4 already out
    assert not d.is_ejected("c")


def test_at_least_one_backend_may_be_ejected() -> None:
    d = _detector(max_ejection_percent=10.0)
    assert _fail(d, "a", 0.0, 3)
    assert not _fail(d, "b", 0.0, 3)


def test_trial_released_when_client_leaves() -> None:
    d = _detector()
    _fail(d, "a", 0.0, 3)
    d.tick(10.0)
    assert d.try_trial("a")
    d.on_result("a", 499, 10.1, POOL)
    assert d.try_trial("a")


def test_disabled_never_ejects() -> None:
    d = _detector(enabled=False)
    assert not _fail(d, "a", 0.0, 50)


def test_passing_probe_closes_only_an_expired_ejection() -> None:
    d = _detector()
    _fail(d, "a", 0.0, 3)
    assert not d.on_probe_success("a", 5.0)  # still inside its ejection time
    assert d.state("a") is BreakerState.EJECTED
    d.tick(10.0)
    assert d.on_probe_success("a", 10.1)
    assert d.state("a") is BreakerState.CLOSED
