"""``load_workload``: from a ``--workload`` string and a seed to a ``Workload``.

The result is fully determined by its arguments: iterate it twice, in two processes
or on two machines, and the specs (ids, arrival times, lengths, prompt bytes) match.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from pathlib import Path

from kiloserve.errors import ConfigError
from kiloserve.workload.arrivals import request_rate_arrivals, trace_arrivals
from kiloserve.workload.prompts import PromptBuilder
from kiloserve.workload.request import RequestSpec, Workload
from kiloserve.workload.sessions import parse_sessions, session_requests
from kiloserve.workload.spec import WorkloadSpec, check_keys, int_option, parse_workload_spec
from kiloserve.workload.synthetic import (
    LengthProfile,
    parse_mix,
    parse_synthetic,
    synthetic_requests,
)
from kiloserve.workload.traces import read_trace, trace_requests

__all__ = ["load_workload"]

ArrivalFactory = Callable[[], Iterator[float | None]]
SpecFactory = Callable[[Iterator[float | None], PromptBuilder], Iterator[RequestSpec]]


def load_workload(
    spec: str,
    *,
    seed: int = 0,
    num_requests: int | None = None,
    duration_s: float | None = None,
    rate: float | None = None,
    burstiness: float = 1.0,
    time_scale: float = 1.0,
    window: tuple[float, float] | None = None,
    traces_dir: str | Path | None = None,
    with_prompts: bool = True,
) -> Workload:
    """Build the workload named by ``spec`` (see ``kiloserve.workload.spec``).

    Synthetic kinds get arrival times from ``rate``/``burstiness`` (``rate=None``:
    closed loop, ``arrival_s=None``). Traces keep their timestamps, cut to ``window``,
    scaled by ``time_scale`` and rescaled to ``rate`` if given. The sequence stops at
    ``num_requests`` or at the first arrival at or after ``duration_s``.
    """
    _check_limits(num_requests, duration_s)
    parsed = parse_workload_spec(spec)
    params: dict[str, object] = {
        "spec": parsed.text,
        "rate": rate,
        "burstiness": burstiness,
        "duration_s": duration_s,
    }
    if parsed.is_trace:
        params |= {"time_scale": time_scale, "window": list(window) if window else None}
        return _trace_workload(
            parsed, seed, num_requests, duration_s, rate, time_scale, window, traces_dir,
            with_prompts, params,
        )  # fmt: skip
    if time_scale != 1.0 or window is not None:
        raise ConfigError("time_scale and window apply to trace workloads only")
    return _synthetic_workload(
        parsed, seed, num_requests, duration_s, rate, burstiness, with_prompts, params
    )


def _synthetic_workload(
    parsed: WorkloadSpec,
    seed: int,
    num_requests: int | None,
    duration_s: float | None,
    rate: float | None,
    burstiness: float,
    with_prompts: bool,
    params: dict[str, object],
) -> Workload:
    make_specs = _synthetic_factory(parsed, seed, with_prompts)

    def arrivals() -> Iterator[float | None]:
        return request_rate_arrivals(rate, burstiness, seed=seed)

    count = _count(arrivals, num_requests, duration_s, rate)

    def make_iter() -> Iterator[RequestSpec]:
        specs = make_specs(arrivals(), PromptBuilder())
        return _limit(specs, num_requests, duration_s)

    return Workload(parsed.text, seed, make_iter, count, params)


def _synthetic_factory(parsed: WorkloadSpec, seed: int, with_prompts: bool) -> SpecFactory:
    if parsed.kind == "sessions":
        config = parse_sessions(parsed.options)
        return lambda arr, b: session_requests(
            config, seed=seed, arrivals=arr, builder=b, with_prompts=with_prompts
        )
    if parsed.kind == "mix":
        weights = parse_mix(parsed.options)
        return lambda arr, b: synthetic_requests(
            weights, seed=seed, arrivals=arr, builder=b, with_prompts=with_prompts
        )
    profile, groups = parse_synthetic(parsed.options)
    table: dict[str, LengthProfile] = {"req": profile}
    return lambda arr, b: synthetic_requests(
        {"req": 1.0}, seed=seed, arrivals=arr, builder=b, groups=groups,
        profile_table=table, with_prompts=with_prompts,
    )  # fmt: skip


def _trace_workload(
    parsed: WorkloadSpec,
    seed: int,
    num_requests: int | None,
    duration_s: float | None,
    rate: float | None,
    time_scale: float,
    window: tuple[float, float] | None,
    traces_dir: str | Path | None,
    with_prompts: bool,
    params: dict[str, object],
) -> Workload:
    check_keys(parsed.kind, parsed.options, ("repeat",))
    repeat = _repeat_option(parsed.options)
    rows = read_trace(parsed.kind, traces_dir)
    times = [r.arrival_s for r in rows]
    indices, arrivals = trace_arrivals(times, window=window, time_scale=time_scale, rate=rate)
    period_s = 0.0
    if repeat > 1:
        period_s = _pass_period_s(arrivals, rate)
        if math.isinf(repeat) and duration_s is None and num_requests is None:
            raise ConfigError("repeat=inf needs num_requests or duration to end the replay")
    keep = _looped_count(arrivals, repeat, period_s, duration_s, num_requests)
    if keep == 0:
        raise ConfigError("the trace selection is empty (check window and duration)")
    kept = list[float | None](arrivals)
    params["repeat"] = None if math.isinf(repeat) else int(repeat)

    def make_iter() -> Iterator[RequestSpec]:
        builder = PromptBuilder()
        specs = trace_requests(
            parsed.kind, rows, indices, kept, seed=seed, builder=builder,
            with_prompts=with_prompts, repeat=repeat, period_s=period_s,
        )  # fmt: skip
        return itertools.islice(specs, keep)  # the cut by duration and count

    return Workload(parsed.text, seed, make_iter, keep, params)


def _repeat_option(options: dict[str, str]) -> float:
    text = options.get("repeat", "1")
    if text == "inf":
        return math.inf
    value = int_option(options, "repeat", 1)
    if value < 1:
        raise ConfigError(f"option 'repeat' must be >= 1 or inf, got {text!r}")
    return float(value)


def _pass_period_s(arrivals: list[float], rate: float | None) -> float:
    """One pass's length: its span plus one mean gap (the rate holds across passes)."""
    n, span_s = len(arrivals), arrivals[-1] - arrivals[0]
    if n > 1 and span_s > 0:
        return span_s * n / (n - 1)
    if rate is not None and not math.isinf(rate):
        return n / rate
    raise ConfigError("repeat needs a trace selection that spans time (or a finite rate)")


def _looped_count(
    arrivals: list[float], repeat: float, period_s: float, duration_s: float | None,
    num_requests: int | None,
) -> int:  # fmt: skip
    """How many requests ``repeat`` passes give before ``duration_s``/``num_requests``;
    arrivals are sorted, so a pass that crosses ``duration_s`` is the last one."""
    total, k = 0, 0
    while k < repeat:
        if num_requests is not None and total >= num_requests:
            return num_requests
        base_s = k * period_s
        if duration_s is not None and arrivals[-1] + base_s >= duration_s:
            return _cap(total + sum(1 for t in arrivals if t + base_s < duration_s), num_requests)
        total += len(arrivals)
        k += 1
    return _cap(total, num_requests)


def _cap(count: int, num_requests: int | None) -> int:
    return count if num_requests is None else min(count, num_requests)


def _limit(
    specs: Iterator[RequestSpec], num_requests: int | None, duration_s: float | None
) -> Iterator[RequestSpec]:
    if num_requests is not None:
        specs = itertools.islice(specs, num_requests)
    if duration_s is None:
        return specs
    limit_s = duration_s
    return itertools.takewhile(lambda s: s.arrival_s is None or s.arrival_s < limit_s, specs)


def _count(
    arrivals: ArrivalFactory, num_requests: int | None, duration_s: float | None,
    rate: float | None,
) -> int | None:  # fmt: skip
    if rate is None or duration_s is None:
        return num_requests  # closed loop with a duration: unbounded
    if math.isinf(rate) and num_requests is None:
        raise ConfigError("rate=inf needs num_requests (a duration cannot bound it)")
    times = itertools.islice(arrivals(), num_requests)
    return sum(1 for _ in itertools.takewhile(lambda t: t is not None and t < duration_s, times))


def _check_limits(num_requests: int | None, duration_s: float | None) -> None:
    if num_requests is not None and num_requests < 1:
        raise ConfigError(f"num_requests must be >= 1, got {num_requests}")
    if duration_s is not None and not duration_s > 0:
        raise ConfigError(f"duration_s must be > 0, got {duration_s}")
