"""Ring buffers behind the live dashboard (``gateway/dashboard.py``).

The gateway feeds a ``DashboardRecorder`` from two router listeners: every routing
decision (``note_decision``, from ``Router.decide``) and every finished attempt
(``note_outcome``, from ``Router.complete``: its TTFT and TPOT samples). Once a
second ``tick`` turns the trailing window of samples into one sparkline point per
backend (P50 and P95) and the gateway's request counters into request and error rates.

Pure and bounded: no clock reads (every method takes the time), no I/O, and every
buffer has a fixed maximum length, so memory stays flat however long the gateway runs.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from kiloserve.policies.base import Decision, Outcome, RequestInfo

__all__ = [
    "DashboardConfig",
    "DashboardRecorder",
    "DecisionRecord",
    "LatencySamples",
    "RateCounts",
    "percentile",
]


class DashboardConfig(BaseModel):
    """The ``dashboard:`` section of the gateway config (docs/dashboard.md)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    allow_remote: bool = False
    refresh_interval_ms: int = Field(default=1000, ge=100, le=1000)
    window_s: float = Field(default=10.0, gt=0.0)
    max_num_points: int = Field(default=60, ge=2, le=3600)
    max_num_decisions: int = Field(default=200, ge=1, le=100_000)
    max_num_samples: int = Field(default=512, ge=8, le=100_000)


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One routing decision as the dashboard lists it (no prompt, no headers)."""

    t_wall_s: float
    request_id: str
    model: str
    policy: str
    backend_id: str
    num_candidates: int
    reason: str


@dataclass(frozen=True, slots=True)
class RateCounts:
    """Cumulative request and error counts of one model (from the gateway counters)."""

    num_requests: int
    num_errors: int


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of an ascending, non-empty list."""
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[min(len(sorted_values), int(rank)) - 1]


class LatencySamples:
    """The most recent ``(time_s, value_ms)`` samples of one metric of one backend."""

    __slots__ = ("_samples",)

    def __init__(self, max_num_samples: int) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_num_samples)

    def add(self, now_s: float, value_ms: float) -> None:
        self._samples.append((now_s, value_ms))

    def p50_p95(self, now_s: float, window_s: float) -> tuple[float | None, float | None]:
        """P50 and P95 (ms, 2 decimals) of the samples taken in ``(now_s - window_s, now_s]``.

        Samples arrive in time order (completion order), so the scan stops at the
        first one older than the window."""
        start_s = now_s - window_s
        values = []
        for t, v in reversed(self._samples):  # newest first: stop at the window's start
            if t <= start_s:
                break
            if t <= now_s:
                values.append(v)
        if not values:
            return None, None
        values.sort()
        return round(percentile(values, 50.0), 2), round(percentile(values, 95.0), 2)


class _BackendSeries:
    """Sparkline history of one backend: P50/P95 of TTFT and TPOT, one point a tick."""

    __slots__ = ("tpot", "tpot_p50", "tpot_p95", "ttft", "ttft_p50", "ttft_p95")

    def __init__(self, max_num_samples: int, max_num_points: int) -> None:
        self.ttft = LatencySamples(max_num_samples)
        self.tpot = LatencySamples(max_num_samples)
        self.ttft_p50: deque[float | None] = deque(maxlen=max_num_points)
        self.ttft_p95: deque[float | None] = deque(maxlen=max_num_points)
        self.tpot_p50: deque[float | None] = deque(maxlen=max_num_points)
        self.tpot_p95: deque[float | None] = deque(maxlen=max_num_points)

    def tick(self, now_s: float, window_s: float) -> None:
        p50, p95 = self.ttft.p50_p95(now_s, window_s)
        self.ttft_p50.append(p50)
        self.ttft_p95.append(p95)
        p50, p95 = self.tpot.p50_p95(now_s, window_s)
        self.tpot_p50.append(p50)
        self.tpot_p95.append(p95)


class DashboardRecorder:
    """Recent decisions, latency samples and per-second history for one gateway."""

    def __init__(self, cfg: DashboardConfig) -> None:
        self.cfg = cfg
        self.decisions: deque[DecisionRecord] = deque(maxlen=cfg.max_num_decisions)
        self._backends: dict[str, _BackendSeries] = {}
        self.request_rate: deque[float] = deque(maxlen=cfg.max_num_points)
        self.error_rate: deque[float] = deque(maxlen=cfg.max_num_points)
        self.pool_rates: dict[str, tuple[float, float]] = {}
        self._last_tick_s: float | None = None
        self._last_counts: dict[str, RateCounts] = {}

    # -- hooks (hot path: appends only) ------------------------------------------------
    def note_decision(
        self, now_wall_s: float, info: RequestInfo, decision: Decision, ranked: tuple[str, ...]
    ) -> None:
        record = DecisionRecord(
            t_wall_s=now_wall_s,
            request_id=info.request_id,
            model=info.model,
            policy=decision.policy,
            backend_id=ranked[0],
            num_candidates=len(ranked),
            reason=decision.reason,
        )
        self.decisions.append(record)

    def note_outcome(self, backend_id: str, now_s: float, outcome: Outcome) -> None:
        series = self._series(backend_id)
        if outcome.ttft_ms is not None:
            series.ttft.add(now_s, outcome.ttft_ms)
        if outcome.tpot_ms is not None:
            series.tpot.add(now_s, outcome.tpot_ms)

    def _series(self, backend_id: str) -> _BackendSeries:
        series = self._backends.get(backend_id)
        if series is None:
            cfg = self.cfg
            series = _BackendSeries(cfg.max_num_samples, cfg.max_num_points)
            self._backends[backend_id] = series
        return series

    # -- once a second -----------------------------------------------------------------
    def tick(
        self, now_s: float, backend_ids: Iterable[str], counts: Mapping[str, RateCounts]
    ) -> None:
        """Append one sparkline point per backend and one request/error rate point."""
        for backend_id in backend_ids:
            self._series(backend_id).tick(now_s, self.cfg.window_s)
        last_s = self._last_tick_s
        if last_s is not None and now_s > last_s:
            self._note_rates(now_s - last_s, counts)
        self._last_tick_s = now_s
        self._last_counts = dict(counts)

    def _note_rates(self, elapsed_s: float, counts: Mapping[str, RateCounts]) -> None:
        total_req = total_err = 0.0
        rates: dict[str, tuple[float, float]] = {}
        for model, now in counts.items():
            before = self._last_counts.get(model, RateCounts(0, 0))
            req = max(0, now.num_requests - before.num_requests) / elapsed_s
            err = max(0, now.num_errors - before.num_errors) / elapsed_s
            rates[model] = (req, err)
            total_req += req
            total_err += err
        self.pool_rates = {m: (round(r, 3), round(e, 3)) for m, (r, e) in rates.items()}
        self.request_rate.append(round(total_req, 3))
        self.error_rate.append(round(total_err, 3))

    # -- views -------------------------------------------------------------------------
    def latency_view(self, backend_id: str) -> dict[str, list[float | None]]:
        """The sparkline series of one backend (empty lists before the first tick)."""
        series = self._backends.get(backend_id)
        if series is None:
            return {"ttft_p50": [], "ttft_p95": [], "tpot_p50": [], "tpot_p95": []}
        return {
            "ttft_p50": list(series.ttft_p50),
            "ttft_p95": list(series.ttft_p95),
            "tpot_p50": list(series.tpot_p50),
            "tpot_p95": list(series.tpot_p95),
        }

    def recent_decisions(self, max_num: int) -> list[DecisionRecord]:
        """The newest ``max_num`` decisions, newest first."""
        out: list[DecisionRecord] = []
        for record in reversed(self.decisions):
            if len(out) >= max_num:
                break
            out.append(record)
        return out

    def decision_shares(self) -> list[tuple[str, str, int]]:
        """``(policy, backend, count)`` over the whole decision buffer, most first."""
        counts = Counter((d.policy, d.backend_id) for d in self.decisions)
        return [(p, b, n) for (p, b), n in counts.most_common()]
