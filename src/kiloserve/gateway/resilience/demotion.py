"""Slow-node demotion and slow start (SPEC S3.2), pure: samples and time passed in.

Each backend keeps a rolling window of its recent TTFT and TPOT samples (at most
``max_num_samples``, none older than ``window_s``). ``evaluate`` compares the window's
median with

* absolute thresholds: ``max_tpot_ms`` (default 300 ms) and ``max_ttft_ms`` (off by
  default), and
* for TPOT only, the *other* backends of its pool (the ``pool_quantile``, 0.9, of their
  window medians; the others, so that one slow node in a pool of two still stands
  out): slow means above ``pool_factor`` (2.5) x that yardstick **and** at least
  ``min_excess_tpot_ms`` (10 ms) above it. The upper decile, not the median: under
  load a chunked long prefill stalls every decode scheduled beside it, so a healthy
  backend that just took long documents shows a window of stalled TPOTs well above
  the pool's median (1,024-GPU simulation, 90% load, chat + long documents: the
  median yardstick demoted 55 healthy H100 replicas in 24 s, the 0.9 quantile 11),
  while a failing GPU (5x slower) stands out of the whole spread. The margin is the
  floor: identical backends whose TPOTs are all near zero (a fake engine, a cached
  reply) differ by large ratios of nothing, and a zero median would make any sample
  "slow".

TTFT is not compared with the pool. A gateway-side TTFT is queueing plus prefill, and
the queue is what routing put there: on identical hardware the backend that got a burst
shows a TTFT several times its peers' and would be demoted for being popular. A slow
GPU slows every decode step, so TPOT shows it whatever the queue (batch size moves TPOT
far less than 2.5x). ``max_ttft_ms`` stays for an operator who wants a TTFT bound.

A slow backend is demoted to ``demoted_weight`` (default 0.2) of its weight instead of
being ejected, with a reason (``tpot_abs``, ``ttft_abs``, ``tpot_pool``); at most
``max_demoted_percent`` of a pool is demoted at once (at least one may be). When it is
clearly back under every threshold (``recover_ratio`` x each, hysteresis against
flapping; or its window has too few recent samples to tell) it ramps back linearly to
full weight over ``slow_start_s`` (slow start); a relapse during the ramp demotes it
again.
"""

from __future__ import annotations

import bisect
import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DemotionConfig", "DemotionEvent", "SlowNodeDemoter"]

logger = logging.getLogger(__name__)


class DemotionConfig(BaseModel):
    """``demotion:`` section of the gateway config."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    max_tpot_ms: float | None = Field(default=300.0, gt=0.0)
    max_ttft_ms: float | None = Field(default=None, gt=0.0)
    pool_factor: float | None = Field(default=2.5, gt=1.0)
    min_excess_tpot_ms: float = Field(default=10.0, ge=0.0)
    demoted_weight: float = Field(default=0.2, gt=0.0, le=1.0)
    window_s: float = Field(default=30.0, gt=0.0)
    max_num_samples: int = Field(default=16, ge=1)
    min_num_samples: int = Field(default=5, ge=1)
    # the yardstick: this quantile of the other backends' TPOT medians (0.5: their median)
    pool_quantile: float = Field(default=0.9, ge=0.0, le=1.0)
    slow_start_s: float = Field(default=30.0, ge=0.0)
    recover_ratio: float = Field(default=0.8, gt=0.0, le=1.0)
    max_demoted_percent: float = Field(default=50.0, ge=0.0, le=100.0)


@dataclass(frozen=True, slots=True)
class DemotionEvent:
    """A backend was demoted (``reason`` set) or started recovering (``reason`` empty)."""

    backend_id: str
    reason: str
    value_ms: float = 0.0
    threshold_ms: float = 0.0


@dataclass(slots=True)
class _Node:
    ttft_ms: deque[tuple[float, float]] = field(default_factory=deque)
    tpot_ms: deque[tuple[float, float]] = field(default_factory=deque)
    is_demoted: bool = False
    recovering_since_s: float | None = None
    reason: str = ""
    num_demotions_total: int = 0


def _push(window: deque[tuple[float, float]], now_s: float, value: float, max_n: int) -> None:
    window.append((now_s, value))
    while len(window) > max_n:
        window.popleft()


def _trim(window: deque[tuple[float, float]], oldest_s: float) -> None:
    while window and window[0][0] < oldest_s:
        window.popleft()


def _quantile(ranked: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values (0.5: ``statistics.median``)."""
    if q == 0.5:
        return statistics.median(ranked)
    return ranked[min(len(ranked) - 1, int(q * len(ranked)))]


class SlowNodeDemoter:
    """Rolling latency windows per backend and the weight factor each one gets."""

    def __init__(self, cfg: DemotionConfig) -> None:
        self.cfg = cfg
        self._nodes: dict[str, _Node] = {}
        # each backend's TPOT median, computed once per ``evaluate`` (else the pool
        # comparison takes a median per pair of backends: 65k per tick at 256)
        self._tpot_medians: dict[str, float | None] = {}
        self._pool_medians: dict[frozenset[str], list[float]] = {}  # sorted, per pool

    def _node(self, backend_id: str) -> _Node:
        node = self._nodes.get(backend_id)
        if node is None:
            node = self._nodes[backend_id] = _Node()
        return node

    def forget(self, backend_id: str) -> None:
        self._nodes.pop(backend_id, None)

    def observe(
        self, backend_id: str, now_s: float, ttft_ms: float | None, tpot_ms: float | None
    ) -> None:
        node, max_n = self._node(backend_id), self.cfg.max_num_samples
        if ttft_ms is not None:
            _push(node.ttft_ms, now_s, ttft_ms, max_n)
        if tpot_ms is not None:
            _push(node.tpot_ms, now_s, tpot_ms, max_n)

    def _median(self, window: deque[tuple[float, float]]) -> float | None:
        if len(window) < self.cfg.min_num_samples:
            return None
        return statistics.median(v for _, v in window)

    def _others(self, kind: str, backend_id: str, pool: Iterable[str]) -> float | None:
        if kind == "tpot_ms" and self._tpot_medians:
            return self._others_tpot(backend_id, frozenset(pool))
        values = []
        for other in pool:
            if other != backend_id and other in self._nodes:
                m = self._median(getattr(self._nodes[other], kind))
                if m is not None:
                    values.append(m)
        return _quantile(sorted(values), self.cfg.pool_quantile) if values else None

    def _others_tpot(self, backend_id: str, pool: frozenset[str]) -> float | None:
        """The others' median TPOT from the medians of this ``evaluate``: one sorted
        list per distinct pool, the backend's own median taken out by bisection."""
        ranked = self._pool_medians.get(pool)
        if ranked is None:
            medians = (self._tpot_medians.get(b) for b in pool)
            ranked = self._pool_medians[pool] = sorted(m for m in medians if m is not None)
        own = self._tpot_medians.get(backend_id) if backend_id in pool else None
        if own is not None:
            i = bisect.bisect_left(ranked, own)
            ranked = ranked[:i] + ranked[i + 1 :]
        return _quantile(ranked, self.cfg.pool_quantile) if ranked else None

    def _slow_reason(
        self, backend_id: str, pool: Iterable[str], scale: float
    ) -> DemotionEvent | None:
        """Why the backend is slow (thresholds x ``scale``), or None."""
        node, cfg = self._nodes[backend_id], self.cfg
        tpot = self._median(node.tpot_ms)
        if tpot is not None:
            if cfg.max_tpot_ms is not None and tpot > cfg.max_tpot_ms * scale:
                return DemotionEvent(backend_id, "tpot_abs", tpot, cfg.max_tpot_ms * scale)
            bound = self._pool_bound_ms(backend_id, pool)
            if bound is not None and tpot > bound * scale:
                return DemotionEvent(backend_id, "tpot_pool", tpot, bound * scale)
        ttft = self._median(node.ttft_ms)
        if ttft is not None and cfg.max_ttft_ms is not None and ttft > cfg.max_ttft_ms * scale:
            return DemotionEvent(backend_id, "ttft_abs", ttft, cfg.max_ttft_ms * scale)
        return None

    def _pool_bound_ms(self, backend_id: str, pool: Iterable[str]) -> float | None:
        """TPOT above which the backend is slow for its pool: ``pool_factor`` x the others'
        median and at least ``min_excess_tpot_ms`` over it; None without a yardstick."""
        factor = self.cfg.pool_factor
        others = self._others("tpot_ms", backend_id, pool) if factor else None
        if factor is None or others is None:
            return None
        return max(factor * others, others + self.cfg.min_excess_tpot_ms)

    def _may_demote(self, backend_id: str, pool: Iterable[str]) -> bool:
        ids = set(pool) | {backend_id}
        num_demoted = sum(
            1 for b in ids
            if b != backend_id and b in self._nodes and self._nodes[b].is_demoted
        )  # fmt: skip
        max_num = max(1, math.floor(len(ids) * self.cfg.max_demoted_percent / 100.0))
        return num_demoted + 1 <= max_num

    def evaluate(self, now_s: float, pools: Mapping[str, Iterable[str]]) -> list[DemotionEvent]:
        """Re-judge every backend (``pools``: backend id -> ids of its pool); returns changes."""
        events: list[DemotionEvent] = []
        if not self.cfg.enabled:
            return events
        oldest_s = now_s - self.cfg.window_s
        for node in self._nodes.values():
            _trim(node.ttft_ms, oldest_s)
            _trim(node.tpot_ms, oldest_s)
        self._tpot_medians = {b: self._median(n.tpot_ms) for b, n in self._nodes.items()}
        self._pool_medians = {}
        for backend_id, node in self._nodes.items():
            pool = pools.get(backend_id, ())
            if not node.is_demoted or node.recovering_since_s is not None:
                slow = self._slow_reason(backend_id, pool, 1.0)
                if slow is not None and (node.is_demoted or self._may_demote(backend_id, pool)):
                    node.is_demoted, node.recovering_since_s, node.reason = True, None, slow.reason
                    node.num_demotions_total += 1
                    events.append(slow)
            elif self._slow_reason(backend_id, pool, self.cfg.recover_ratio) is None:
                node.recovering_since_s = now_s  # hysteresis: clearly fast again
                events.append(DemotionEvent(backend_id, ""))
        self._tpot_medians, self._pool_medians = {}, {}  # samples change before the next
        return events

    def weight_factor(self, backend_id: str, now_s: float) -> float:
        """1.0 normally; ``demoted_weight`` when demoted; a linear ramp during slow start."""
        node = self._nodes.get(backend_id)
        if node is None or not node.is_demoted:
            return 1.0
        low = self.cfg.demoted_weight
        if node.recovering_since_s is None:
            return low
        ramp_s = self.cfg.slow_start_s
        done = 1.0 if ramp_s <= 0.0 else (now_s - node.recovering_since_s) / ramp_s
        if done >= 1.0:
            node.is_demoted, node.recovering_since_s, node.reason = False, None, ""
            return 1.0
        return low + (1.0 - low) * max(0.0, done)

    def describe(self, backend_id: str) -> dict[str, object]:
        node = self._nodes.get(backend_id) or _Node()
        return {
            "demoted": node.is_demoted,
            "demotion_reason": node.reason,
            "recovering": node.recovering_since_s is not None,
            "num_demotions_total": node.num_demotions_total,
        }

    def num_demotions_total(self, backend_id: str) -> int:
        node = self._nodes.get(backend_id)
        return node.num_demotions_total if node else 0
