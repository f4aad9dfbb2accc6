"""Arrival processes: when each request is sent.

Open loop (arrival times fixed in advance, independent of how fast the server is):

* ``request_rate_arrivals(rate, burstiness)``: ``vllm bench serve`` semantics. The
  first request is at 0; gaps are gamma-distributed with shape ``burstiness`` and
  scale ``1 / (rate * burstiness)`` (mean gap ``1/rate``). ``burstiness == 1`` is a
  Poisson process, < 1 is burstier, > 1 is smoother, ``inf`` is a constant rate.
  ``rate == inf`` sends everything at time 0.
* ``constant_arrivals(rate)``: exactly ``1/rate`` apart.
* ``trace_arrivals(times, ...)``: a trace's own timestamps, cut to a ``[start, end)``
  window (trace seconds), shifted to start at 0, multiplied by ``time_scale`` and, if
  ``rate`` is given, rescaled so the mean rate is ``rate`` requests/s.

Closed loop: ``rate is None`` gives ``None`` arrival times; the client keeps
``ClosedLoop.concurrency`` requests in flight.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kiloserve.errors import ConfigError

__all__ = [
    "ArrivalMode",
    "ClosedLoop",
    "OpenLoop",
    "constant_arrivals",
    "request_rate_arrivals",
    "trace_arrivals",
]

STREAM_ARRIVALS = 2


@dataclass(frozen=True, slots=True)
class OpenLoop:
    """Send each request at its ``arrival_s``; optionally cap requests in flight."""

    max_concurrency: int | None = None


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """Keep ``concurrency`` requests in flight, ignoring arrival times."""

    concurrency: int


ArrivalMode = OpenLoop | ClosedLoop


def request_rate_arrivals(
    rate: float | None, burstiness: float = 1.0, *, seed: int = 0
) -> Iterator[float | None]:
    """Endless arrival times in seconds (see module docstring); ``None`` when closed loop."""
    if rate is None:
        while True:
            yield None
    _check_rate(rate)
    if not burstiness > 0:
        raise ConfigError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        while True:
            yield 0.0
    if math.isinf(burstiness):
        yield from constant_arrivals(rate)
        return
    rng = np.random.default_rng([seed, STREAM_ARRIVALS])
    t = 0.0
    scale = 1.0 / (rate * burstiness)
    while True:
        # Gaps in blocks: numpy fills an array with the very values (same order, same
        # bits) that one scalar ``rng.gamma`` call each would give, at a fraction of
        # the calls (tests/unit/workload/test_synthetic_batched.py).
        for gap in rng.gamma(burstiness, scale, size=4096).tolist():
            yield t
            t += gap


def constant_arrivals(rate: float) -> Iterator[float]:
    """Arrivals exactly ``1 / rate`` seconds apart, starting at 0."""
    _check_rate(rate)
    i = 0
    while True:
        yield i / rate
        i += 1


def trace_arrivals(
    times_s: Sequence[float],
    *,
    window: tuple[float, float] | None = None,
    time_scale: float = 1.0,
    rate: float | None = None,
) -> tuple[list[int], list[float]]:
    """Indices of the trace rows kept and their new arrival times (see docstring)."""
    if not time_scale > 0:
        raise ConfigError(f"time_scale must be > 0, got {time_scale}")
    start, end = window if window is not None else (-math.inf, math.inf)
    if not start < end:
        raise ConfigError(f"time window [{start}, {end}) is empty")
    indices = [i for i, t in enumerate(times_s) if start <= t < end]
    if not indices:
        raise ConfigError(f"no trace requests in the window [{start}, {end})")
    t0 = times_s[indices[0]]
    times = [(times_s[i] - t0) * time_scale for i in indices]
    if rate is not None:
        _check_rate(rate)
        times = _rescale_to_rate(times, rate)
    return indices, times


def _rescale_to_rate(times: list[float], rate: float) -> list[float]:
    if math.isinf(rate):
        return [0.0 for _ in times]
    span_s = times[-1] - times[0]
    if len(times) < 2 or span_s <= 0:
        return [i / rate for i in range(len(times))]
    factor = (len(times) - 1) / rate / span_s
    return [t * factor for t in times]


def _check_rate(rate: float) -> None:
    if not rate > 0:
        raise ConfigError(f"request rate must be > 0 requests/s, got {rate}")
