"""Per-replica capacity at an SLO: a rate search on one simulated backend, or a sweep file.

The SLO is a set of percentile objectives, ``ttft_p95=800ms,tpot_p95=50ms``: a run
meets it when every named percentile of the bench summary is at or under its limit,
no request failed and (for simulated probes) no backlog outlived the arrivals. The
SLO must bound TTFT or E2E: open-loop overload shows up as queueing (TTFT grows
without bound) while TPOT stays capped by ``max_num_seqs``. The probes themselves
(simulations of one backend) are built in ``kiloserve.plan.pareto``.

Rate search (``search_capacity``): probe the first guess; double it while the SLO
holds (or halve it while it does not) until a passing and a failing rate bracket the
answer, then bisect geometrically until the bracket is within ``rel_tolerance``
(5%) or ``max_num_probes`` (12) are spent. The answer is the highest passing rate;
each probe is one deterministic simulation (same workload seed at every rate), so
the search is repeatable.

Sweep file (``capacity_from_sweep``): the ``sweep.json`` of ``kiloserve bench
--sweep`` measured on a real backend; the capacity is the request rate of the
highest point that meets the SLO (no extrapolation).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiloserve.errors import ConfigError
from kiloserve.results.metrics import SLO_UNIT_MS, Slo

__all__ = [
    "DEFAULT_MAX_NUM_PROBES",
    "DEFAULT_REL_TOLERANCE",
    "PROBE_SPAN_KEY",
    "CapacityResult",
    "PercentileSlo",
    "Probe",
    "ProbePoint",
    "SloTarget",
    "capacity_from_sweep",
    "initial_rate_guess",
    "parse_percentile_slo",
    "search_capacity",
    "slo_ratio",
    "slo_violations",
]

DEFAULT_MAX_NUM_PROBES = 12
DEFAULT_REL_TOLERANCE = 0.05
MIN_RATE_RPS = 1e-4
FLOOR_IMPROVEMENT = 0.05
DRAIN_SLACK = 0.1  # a queue growing 10% of the arrival span is overload
PROBE_SPAN_KEY = "probe_arrival_span_s"  # set by rate-search probes (plan.pareto)
KEEP_UP_FRACTION = 0.9  # achieved / offered rate above which latency is not queueing
SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
SLO_PERCENTILES = (50, 90, 95, 99)
_SLO_PART = re.compile(r"^(ttft|tpot|itl|e2e)(?:_p(\d+))?=([0-9]*\.?[0-9]+)(us|ms|s)?$")

Probe = Callable[[float], Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class SloTarget:
    """``metric`` (ttft/tpot/itl/e2e) at percentile ``percentile`` must be <= ``limit_ms``."""

    metric: str
    percentile: int
    limit_ms: float

    @property
    def key(self) -> str:
        return f"{self.metric}_p{self.percentile}"

    def __str__(self) -> str:
        return f"{self.key}={self.limit_ms:g}ms"


@dataclass(frozen=True, slots=True)
class PercentileSlo:
    """A set of percentile objectives (see the module docstring)."""

    targets: tuple[SloTarget, ...]

    def __str__(self) -> str:
        return ",".join(str(t) for t in self.targets)

    def to_dict(self) -> dict[str, float]:
        return {f"{t.key}_ms": t.limit_ms for t in self.targets}

    def per_request_slo(self) -> Slo:
        """The same limits applied to each request (for the bench's SLO attainment)."""
        limits = {t.metric: t.limit_ms for t in self.targets if t.metric != "itl"}
        return Slo(limits.get("ttft"), limits.get("tpot"), limits.get("e2e"))


def parse_percentile_slo(text: str) -> PercentileSlo:
    """Parse ``ttft_p95=800ms,tpot_p95=50ms`` (units us/ms/s, bare numbers ms, a
    metric without ``_pNN`` means P95)."""
    targets: dict[str, SloTarget] = {}
    for part in "".join(text.split()).split(","):
        m = _SLO_PART.match(part)
        if m is None:
            raise ConfigError(
                f"bad SLO {part!r}; expected METRIC[_pNN]=NUMBER[us|ms|s] with METRIC in "
                f"{'/'.join(SLO_METRICS)}, e.g. ttft_p95=800ms,tpot_p95=50ms"
            )
        percentile = int(m.group(2) or 95)
        if percentile not in SLO_PERCENTILES:
            raise ConfigError(f"SLO percentile must be one of {SLO_PERCENTILES}, got {part!r}")
        target = SloTarget(m.group(1), percentile, float(m.group(3)) * SLO_UNIT_MS[m.group(4)])
        if target.key in targets:
            raise ConfigError(f"SLO {target.key!r} given twice")
        targets[target.key] = target
    if not any(t.metric in ("ttft", "e2e") for t in targets.values()):
        raise ConfigError(
            "the SLO must bound ttft or e2e (e.g. ttft_p95=800ms): overload shows as "
            "queueing in TTFT, which a TPOT-only objective cannot see"
        )
    return PercentileSlo(tuple(targets.values()))


def slo_violations(summary: Mapping[str, Any], slo: PercentileSlo) -> list[str]:
    """Why a bench summary misses ``slo`` (empty when it meets it)."""
    out: list[str] = []
    error_rate = float(summary.get("error_rate", 0.0))
    if error_rate > 0:
        out.append(f"error rate {error_rate:.1%}")
    for target in slo.targets:
        value = (summary.get(f"{target.metric}_ms") or {}).get(f"p{target.percentile}")
        if value is None and target.metric == "tpot":
            continue  # single-token outputs only: no TPOT to bound
        if value is None or not math.isfinite(float(value)):
            out.append(f"{target.key} unknown")
        elif float(value) > target.limit_ms:
            out.append(f"{target.key} {float(value):.0f} ms > {target.limit_ms:g} ms")
    backlog = _backlog_violation(summary)
    return out if backlog is None else [*out, backlog]


def _backlog_violation(summary: Mapping[str, Any]) -> str | None:
    """A queue that outlives the arrivals: the last completion comes later than twice
    the E2E P99 plus ``DRAIN_SLACK`` of the arrival span after the last arrival. Only
    for rate-search probes (``probe_arrival_span_s``); cluster runs are judged on their
    percentiles alone (their longest request can outlast 2 x P99 by chance)."""
    span_s = summary.get(PROBE_SPAN_KEY)
    e2e_p99_ms = (summary.get("e2e_ms") or {}).get("p99")
    if span_s is None or e2e_p99_ms is None or "duration_s" not in summary:
        return None
    drain_s = float(summary["duration_s"]) - float(span_s)
    allowed_s = 2.0 * float(e2e_p99_ms) / 1000.0 + DRAIN_SLACK * float(span_s)
    if drain_s <= allowed_s:
        return None
    return f"backlog: {drain_s:.1f} s to drain after the last arrival (> {allowed_s:.1f} s)"


def slo_ratio(summary: Mapping[str, Any], slo: PercentileSlo) -> float:
    """Worst ``measured / limit`` over the targets (> 1 misses; inf when unknown)."""
    worst = 0.0
    for target in slo.targets:
        value = (summary.get(f"{target.metric}_ms") or {}).get(f"p{target.percentile}")
        if value is None:
            worst = max(worst, 0.0 if target.metric == "tpot" else math.inf)
        else:
            worst = max(worst, float(value) / target.limit_ms)
    return worst


@dataclass(frozen=True, slots=True)
class ProbePoint:
    """One probed rate and what it gave."""

    rate_rps: float
    request_throughput: float
    output_token_throughput: float
    percentiles_ms: dict[str, float | None]
    violations: tuple[str, ...]
    slo_ratio: float = 0.0  # worst measured / limit over the SLO targets
    error_rate: float = 0.0

    @property
    def is_passing(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        return {
            "rate_rps": self.rate_rps,
            "request_throughput": self.request_throughput,
            "output_token_throughput": self.output_token_throughput,
            **self.percentiles_ms,
            "slo_ratio": self.slo_ratio,
            "error_rate": self.error_rate,
            "is_passing": self.is_passing,
            "violations": list(self.violations),
        }


def probe_point(rate_rps: float, summary: Mapping[str, Any], slo: PercentileSlo) -> ProbePoint:
    """Digest one bench summary into a ``ProbePoint``."""
    percentiles: dict[str, float | None] = {}
    for metric in ("ttft", "tpot", "e2e"):
        stats = summary.get(f"{metric}_ms") or {}
        for p in (50, 95, 99):
            value = stats.get(f"p{p}")
            percentiles[f"{metric}_p{p}_ms"] = None if value is None else float(value)
    return ProbePoint(
        rate_rps=rate_rps,
        request_throughput=float(summary.get("request_throughput", 0.0)),
        output_token_throughput=float(summary.get("output_token_throughput", 0.0)),
        percentiles_ms=percentiles,
        violations=tuple(slo_violations(summary, slo)),
        slo_ratio=slo_ratio(summary, slo),
        error_rate=float(summary.get("error_rate", 0.0)),
    )


@dataclass(slots=True)
class CapacityResult:
    """Highest rate (requests/s) one backend sustains within the SLO, and its evidence.

    ``output_tokens_per_s`` is the output-token rate at that request rate;
    ``source`` is ``"simulated"`` or ``"sweep:<path>"``; ``is_bracketed`` is False
    when the search ran out of probes before finding a failing (or passing) rate.
    """

    rate_rps: float
    output_tokens_per_s: float
    source: str
    is_bracketed: bool
    points: list[ProbePoint] = field(default_factory=list)

    @property
    def best(self) -> ProbePoint | None:
        passing = [p for p in self.points if p.is_passing]
        return max(passing, key=lambda p: p.rate_rps) if passing else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rate_rps": self.rate_rps,
            "output_tokens_per_s": self.output_tokens_per_s,
            "source": self.source,
            "is_bracketed": self.is_bracketed,
            "probes": [p.to_dict() for p in self.points],
        }


def search_capacity(
    probe: Probe,
    slo: PercentileSlo,
    initial_rps: float,
    *,
    max_num_probes: int = DEFAULT_MAX_NUM_PROBES,
    rel_tolerance: float = DEFAULT_REL_TOLERANCE,
) -> CapacityResult:
    """Bracket, then bisect, the highest rate whose simulated run meets ``slo``."""
    if not initial_rps > 0 or max_num_probes < 2 or not rel_tolerance > 0:
        raise ConfigError("rate search needs initial_rps > 0, max_num_probes >= 2, tolerance > 0")
    points: list[ProbePoint] = []

    def passes(rate: float) -> bool:
        points.append(probe_point(rate, probe(rate), slo))
        return points[-1].is_passing

    low, high = _bracket(passes, initial_rps, max_num_probes, points)
    while low is not None and high is not None and len(points) < max_num_probes:
        if high / low <= 1.0 + rel_tolerance:
            break
        mid = math.sqrt(low * high)
        low, high = (mid, high) if passes(mid) else (low, mid)
    return _result(points, low is not None and high is not None, "simulated")


def _bracket(
    passes: Callable[[float], bool],
    initial_rps: float,
    max_num_probes: int,
    points: list[ProbePoint],
) -> tuple[float | None, float | None]:
    """(highest passing, lowest failing) rate found by doubling or halving.

    Halving stops early when it no longer helps: when the replica kept up with the
    offered rate (no queue build-up) and the worst SLO ratio improved by less than
    ``FLOOR_IMPROVEMENT`` (5%), it misses the SLO even unloaded; when requests fail
    as often at half the rate, the failures are not load.
    """
    low: float | None = None
    high: float | None = None
    rate = initial_rps
    for _ in range(max_num_probes):
        if passes(rate):
            low = rate
            if high is not None:
                break
            rate *= 2.0
            continue
        high = rate
        if low is not None or rate / 2.0 < MIN_RATE_RPS or _is_at_floor(points):
            break
        rate /= 2.0
    return low, high


def _is_at_floor(points: list[ProbePoint]) -> bool:
    if len(points) < 2 or points[-2].is_passing:
        return False
    last, prev = points[-1], points[-2]
    if last.error_rate > 0 and last.error_rate >= prev.error_rate:
        return True  # failures that do not fall with the load (e.g. requests too long)
    is_keeping_up = last.request_throughput >= KEEP_UP_FRACTION * last.rate_rps
    return is_keeping_up and last.slo_ratio > prev.slo_ratio * (1.0 - FLOOR_IMPROVEMENT)


def _result(points: list[ProbePoint], is_bracketed: bool, source: str) -> CapacityResult:
    passing = [p for p in points if p.is_passing]
    if not passing:
        return CapacityResult(0.0, 0.0, source, is_bracketed, points)
    best = max(passing, key=lambda p: p.rate_rps)
    return CapacityResult(best.rate_rps, _tokens_at_rate(best), source, is_bracketed, points)


def _tokens_at_rate(point: ProbePoint) -> float:
    """Output tokens/s at the probe's rate: tokens per request x rate (a finite run's
    measured throughput is biased low by the drain after its last arrival)."""
    if point.request_throughput <= 0:
        return 0.0
    return point.output_token_throughput / point.request_throughput * point.rate_rps


def capacity_from_sweep(path: str | Path, slo: PercentileSlo) -> CapacityResult:
    """Capacity from a ``kiloserve bench --sweep`` ``sweep.json`` (module docstring).

    A concurrency sweep's point counts at its measured request throughput; a rate
    sweep's at its offered rate (the measured one is biased low by the drain)."""
    data = _read_sweep(Path(path))
    is_rate_sweep = data.get("parameter") == "rate"
    points: list[ProbePoint] = []
    for row in data["points"]:
        summary = _summary_from_row(row)
        rate = float(row["value"]) if is_rate_sweep else summary["request_throughput"]
        points.append(probe_point(rate, summary, slo))
    passing = [p for p in points if p.is_passing]
    is_bracketed = bool(passing) and len(passing) < len(points)
    return _result(points, is_bracketed, f"sweep:{path}")


def _read_sweep(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read sweep file {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise ConfigError(f"{path} is not a sweep.json (no 'points' list)")
    if not data["points"]:
        raise ConfigError(f"{path} has no sweep points")
    return data


def _summary_from_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A sweep row as a bench-summary-shaped dict (only the fields a sweep keeps)."""

    def stat(key: str) -> float | None:
        value = row.get(key)
        return None if value is None or not math.isfinite(float(value)) else float(value)

    try:
        float(row["value"])
        summary: dict[str, Any] = {
            "request_throughput": float(row["request_throughput"]),
            "output_token_throughput": float(row["output_token_throughput"]),
            "error_rate": float(row.get("error_rate", 0.0)),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"bad sweep point {dict(row)!r}: {exc}") from exc
    for metric in ("ttft", "tpot", "e2e"):
        summary[f"{metric}_ms"] = {p: stat(f"{metric}_{p}_ms") for p in ("p50", "p95")}
    return summary


def initial_rate_guess(
    timer: Any, mean_input_tokens: float, mean_output_tokens: float, batch_size: int = 16
) -> float:
    """A first rate (requests/s) to probe: ``batch_size`` requests decoding at once,
    each costing its prefill plus ``mean_output_tokens`` decode steps of that batch."""
    context = int(mean_input_tokens + mean_output_tokens / 2) + 1
    step_s = float(timer.step_time_s([], [context] * batch_size))
    prefill_s = float(timer.step_time_s([(max(1, int(mean_input_tokens)), 0)], []))
    busy_s = max(1, int(mean_output_tokens)) * step_s + batch_size * prefill_s
    return max(MIN_RATE_RPS, batch_size / busy_s)
