"""The thermal-throttling fault (S3.7): the pure model, parsing, and the twin hooks."""

from __future__ import annotations

import argparse
import math

import pytest

from kiloserve.engine.cli import add_arguments, config_from_args
from kiloserve.engine.faults import FaultInjector, FaultSet, ThermalFault, ThermalModel
from kiloserve.engine.metrics import EngineStats, TwinMetrics
from kiloserve.errors import RequestError
from kiloserve.launch.config import parse_cluster_config
from kiloserve.launch.engines import twin_argv

FAST = ThermalFault(throttle_at_c=80.0, resume_at_c=70.0, factor=2.0, load_c=90.0,
                    ambient_c=40.0, time_constant_s=10.0)  # fmt: skip


def _load(model: ThermalModel, start_s: float, end_s: float, step_s: float = 0.1) -> float:
    """Back-to-back steps from ``start_s`` to ``end_s``; returns the end time."""
    t = start_s
    while t < end_s - 1e-9:
        model.busy(t, t + step_s)
        t += step_s
    return t


def test_starts_at_ambient_unthrottled() -> None:
    m = ThermalModel(FAST, now_s=0.0)
    assert m.temperature_c == 40.0
    assert not m.is_throttled
    assert m.clock_ratio == 1.0 and m.step_factor == 1.0


def test_heats_under_load_like_a_first_order_system() -> None:
    m = ThermalModel(FAST, now_s=0.0)
    _load(m, 0.0, 10.0)  # one time constant at full load
    expected = 90.0 + (40.0 - 90.0) * math.exp(-1.0)
    assert m.temperature_c == pytest.approx(expected, abs=1e-6)


def test_half_utilisation_heats_toward_the_midpoint() -> None:
    m = ThermalModel(FAST, now_s=0.0)
    t = 0.0
    for _ in range(2000):  # 0.1 s busy, 0.1 s idle: u = 0.5 for 400 s (40 tau)
        m.busy(t + 0.1, t + 0.2)
        t += 0.2
    assert m.temperature_c == pytest.approx(65.0, abs=0.2)
    assert not m.is_throttled  # 65 C < 80 C: half load never throttles this GPU


def test_throttles_past_the_threshold() -> None:
    m = ThermalModel(FAST, now_s=0.0)
    # 40 -> 80 C at full load: t = tau * ln(50 / 10) = 16.1 s
    _load(m, 0.0, 16.0)
    assert not m.is_throttled
    _load(m, 16.0, 16.5)
    assert m.is_throttled and m.temperature_c >= 80.0
    assert m.step_factor == 2.0 and m.clock_ratio == 0.5


def test_cools_when_idle_with_hysteresis() -> None:
    m = ThermalModel(FAST, now_s=0.0)
    end_s = _load(m, 0.0, 30.0)
    assert m.is_throttled
    # idle: 80 C is crossed first, but the clock comes back only under 70 C
    t_below_80 = end_s + 10.0 * math.log((m.temperature_c - 40.0) / 40.0)
    m.advance(t_below_80 + 0.5)
    assert m.temperature_c < 80.0
    assert m.is_throttled, "hysteresis: still throttled between resume_at_c and throttle_at_c"
    m.advance(t_below_80 + 10.0)
    assert m.temperature_c < 70.0
    assert not m.is_throttled and m.clock_ratio == 1.0
    m.advance(t_below_80 + 1000.0)
    assert m.temperature_c == pytest.approx(40.0, abs=1e-3)


def test_reheating_between_resume_and_threshold_does_not_throttle() -> None:
    m = ThermalModel(FAST, now_s=0.0, temperature_c=75.0)
    assert not m.is_throttled  # entered below the threshold
    m.busy(0.0, 0.1)
    assert 75.0 < m.temperature_c < 80.0 and not m.is_throttled


def test_busy_counts_the_gap_before_it_as_idle() -> None:
    a = ThermalModel(FAST, now_s=0.0, temperature_c=80.0)
    a.busy(5.0, 5.0)  # 5 s idle, zero busy
    b = ThermalModel(FAST, now_s=0.0, temperature_c=80.0)
    b.advance(5.0)
    assert a.temperature_c == pytest.approx(b.temperature_c)
    assert a.temperature_c == pytest.approx(40.0 + 40.0 * math.exp(-0.5))


def test_json_round_trip_and_defaults() -> None:
    fs = FaultSet.from_json({"thermal": {"throttle_at_c": 80, "factor": 3}})
    assert fs.thermal is not None
    assert fs.thermal.throttle_at_c == 80.0 and fs.thermal.factor == 3.0
    assert fs.thermal.resume_c == 75.0
    out = fs.to_json()
    assert out == {"thermal": {
        "throttle_at_c": 80.0, "resume_at_c": 75.0, "factor": 3.0, "ambient_c": 40.0,
        "load_c": 90.0, "time_constant_s": 60.0,
    }}  # fmt: skip
    assert FaultSet.from_json(out).to_json() == out
    assert FaultSet.from_json({"thermal": {}}).thermal == ThermalFault()
    assert FaultSet.from_json({"thermal": None}).thermal is None
    assert "thermal" not in FaultSet().to_json()


@pytest.mark.parametrize(
    "body",
    [
        {"thermal": True},
        {"thermal": {"fan": 1}},
        {"thermal": {"factor": "2"}},
        {"thermal": {"factor": 0.5}},
        {"thermal": {"throttle_at_c": 30}},  # under ambient
        {"thermal": {"resume_at_c": 90}},  # above the threshold
        {"thermal": {"time_constant_s": 0}},
        {"thermal": {"load_c": 10}},
        {"thermal": {"ambient_c": 500}},
        {"thermal": {"throttle_at_c": False}},
    ],
)
def test_bad_thermal_bodies_are_request_errors(body: dict[str, object]) -> None:
    with pytest.raises(RequestError):
        FaultSet.from_json(body)


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_injector_scales_steps_and_keeps_temperature_across_replace() -> None:
    clock = _Clock()
    inj = FaultInjector(FaultSet(slowdown=1.5, thermal=FAST), clock=clock)
    assert inj.slowdown == 1.5
    t = 0.0
    while t < 30.0:
        inj.on_step(t, t + 0.1)
        t += 0.1
    clock.now_s = t
    temp, ratio = inj.thermal_reading()
    assert temp is not None and temp > 80.0 and ratio == 0.5
    assert inj.slowdown == 3.0  # slowdown x thermal factor
    inj.replace(FaultSet(thermal=FAST))  # constants re-posted: still hot, still throttled
    assert inj.thermal is not None and inj.thermal.temperature_c == pytest.approx(temp)
    assert inj.slowdown == 2.0
    inj.replace(FaultSet())
    assert inj.slowdown == 1.0 and inj.thermal_reading() == (None, 1.0)


def test_metrics_expose_temperature_and_clock() -> None:
    stats = EngineStats(0, 0, 0.0, 0, 0, 0)
    clock = _Clock()
    inj = FaultInjector(clock=clock)
    metrics = TwinMetrics("m", lambda: stats, inj.thermal_reading)
    text = metrics.render().decode()
    assert "kiloserve_twin_gpu_clock_ratio 1.0" in text
    assert "kiloserve_twin_gpu_temperature_celsius" not in text
    inj.replace(FaultSet(thermal=FAST))
    text = metrics.render().decode()
    assert "kiloserve_twin_gpu_temperature_celsius 40.0" in text


def _engine_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--gpu", "H100", "--model", "llama-3.1-8b", "--port", "0", *extra])


def test_thermal_at_start_up_flag_and_cluster_yaml() -> None:
    args = _engine_args("--thermal", '{"throttle_at_c": 70, "factor": 3}')
    thermal = config_from_args(args).faults.thermal
    assert thermal is not None and (thermal.throttle_at_c, thermal.factor) == (70.0, 3.0)
    assert config_from_args(_engine_args()).faults.thermal is None
    with pytest.raises(SystemExit):  # argparse names the bad key
        _engine_args("--thermal", '{"throttle": 70}')
    cfg = parse_cluster_config(
        {
            "backends": [
                {
                    "name": "h",
                    "gpu": "H100",
                    "model": "llama-3.1-8b",
                    "faults": {"thermal": {"factor": 2}},
                }
            ]
        }
    )
    argv = twin_argv(cfg.expanded()[0], "127.0.0.1", 0)
    flag = argv.index("--thermal")
    again = config_from_args(_engine_args("--thermal", argv[flag + 1])).faults.thermal
    assert again is not None and again.factor == 2.0
