"""Arrival processes: Poisson/gamma (vLLM semantics), constant, trace timing."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from kiloserve.errors import ConfigError
from kiloserve.workload.arrivals import constant_arrivals, request_rate_arrivals, trace_arrivals


def _take(it: object, n: int) -> list[float]:
    return [float(t) for t in itertools.islice(it, n)]  # type: ignore[call-overload]


def test_poisson_mean_rate_and_determinism() -> None:
    times = _take(request_rate_arrivals(20.0, 1.0, seed=1), 4001)
    assert times[0] == 0.0
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # CV 1: exponential
    assert times == _take(request_rate_arrivals(20.0, 1.0, seed=1), 4001)
    assert times != _take(request_rate_arrivals(20.0, 1.0, seed=2), 4001)


def test_burstiness_changes_variability_not_rate() -> None:
    bursty = np.diff(_take(request_rate_arrivals(10.0, 0.25, seed=0), 4001))
    smooth = np.diff(_take(request_rate_arrivals(10.0, 4.0, seed=0), 4001))
    assert bursty.mean() == pytest.approx(0.1, rel=0.1)
    assert smooth.mean() == pytest.approx(0.1, rel=0.05)
    # gamma CV = 1 / sqrt(shape)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)
    assert smooth.std() / smooth.mean() == pytest.approx(0.5, rel=0.1)


def test_constant_infinite_and_closed_loop() -> None:
    assert _take(constant_arrivals(4.0), 3) == [0.0, 0.25, 0.5]
    assert _take(request_rate_arrivals(4.0, math.inf), 3) == [0.0, 0.25, 0.5]
    assert _take(request_rate_arrivals(math.inf), 3) == [0.0, 0.0, 0.0]
    assert list(itertools.islice(request_rate_arrivals(None), 2)) == [None, None]
    with pytest.raises(ConfigError):
        next(request_rate_arrivals(0.0))
    with pytest.raises(ConfigError):
        next(request_rate_arrivals(1.0, 0.0))


def test_trace_window_time_scale_and_rate() -> None:
    times = [0.0, 1.0, 2.0, 3.0, 5.0, 9.0]
    idx, out = trace_arrivals(times, window=(1.0, 5.0))
    assert idx == [1, 2, 3] and out == [0.0, 1.0, 2.0]
    _, scaled = trace_arrivals(times, time_scale=0.5)
    assert scaled == [0.0, 0.5, 1.0, 1.5, 2.5, 4.5]
    _, rated = trace_arrivals(times, rate=1.0)  # 6 requests over 5 gaps -> span 5 s
    assert rated[-1] == pytest.approx(5.0)
    assert rated[4] / rated[-1] == pytest.approx(5.0 / 9.0)  # shape kept
    with pytest.raises(ConfigError, match="no trace requests"):
        trace_arrivals(times, window=(20.0, 30.0))
    with pytest.raises(ConfigError):
        trace_arrivals(times, time_scale=0.0)
