"""The slow-node demoter's windows and judgement (``demotion.py`` has the rules, the
config and the module documentation; this module holds the code that runs per sample and
per tick, kept free of pydantic so that the simulator's compiled build compiles it with
mypyc: ``kiloserve.sim.build.COMPILED_MODULES``). Live, the gateway runs it as plain
Python; results are the same either way.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiloserve.gateway.resilience.demotion import DemotionConfig

__all__ = ["DemotionEvent", "SlowNodeDemoter"]


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
    # the windows' medians as of the last change (None: too few samples); stale after a
    # sample comes in or goes out, recomputed by the next ``evaluate`` only then
    ttft_median: float | None = None
    tpot_median: float | None = None
    is_ttft_stale: bool = False
    is_tpot_stale: bool = False


def _push(window: deque[tuple[float, float]], now_s: float, value: float, max_n: int) -> None:
    window.append((now_s, value))
    while len(window) > max_n:
        window.popleft()


def _trim(window: deque[tuple[float, float]], oldest_s: float) -> bool:
    """Drops the samples older than ``oldest_s``; True when any went."""
    if not window or window[0][0] >= oldest_s:
        return False
    while window and window[0][0] < oldest_s:
        window.popleft()
    return True


class _Limits:
    """The config's thresholds as plain attributes, read once per ``evaluate``: the
    config is a pydantic model, whose every attribute read is a generic lookup."""

    def __init__(self, cfg: DemotionConfig) -> None:
        self.max_tpot_ms: float | None = cfg.max_tpot_ms
        self.max_ttft_ms: float | None = cfg.max_ttft_ms
        self.pool_factor: float | None = cfg.pool_factor
        self.min_excess_tpot_ms: float = cfg.min_excess_tpot_ms
        self.recover_ratio: float = cfg.recover_ratio
        self.pool_quantile: float = cfg.pool_quantile


def _median(window: deque[tuple[float, float]], min_num: int) -> float | None:
    """``statistics.median`` of the window's values (same arithmetic), None below
    ``min_num`` samples."""
    n = len(window)
    if n < min_num or n == 0:
        return None
    ranked = sorted([v for _, v in window])
    i = n // 2
    return ranked[i] if n % 2 else (ranked[i - 1] + ranked[i]) / 2


def _quantile(ranked: list[float], q: float, skip: int = -1) -> float:
    """The ``q`` quantile of sorted values (0.5: ``statistics.median``), the value at
    index ``skip`` left out (-1: none) without copying the list."""
    n = len(ranked) - (skip >= 0)
    if q == 0.5:
        i = n // 2
        upper = ranked[i + 1] if 0 <= skip <= i else ranked[i]
        if n % 2:
            return upper
        lower = ranked[i] if 0 <= skip <= i - 1 else ranked[i - 1]
        return (lower + upper) / 2
    j = min(n - 1, int(q * n))
    return ranked[j + 1] if 0 <= skip <= j else ranked[j]


class SlowNodeDemoter:
    """Rolling latency windows per backend and the weight factor each one gets.

    ``evaluate`` costs O(backends) per call, not a median per backend pair: a window's
    median is recomputed only after a sample came in or aged out, each distinct pool's
    medians are sorted once per call, and a backend's own median is left out of its
    pool's by index instead of by copying the list.
    """

    def __init__(self, cfg: DemotionConfig) -> None:
        self.cfg = cfg
        self._nodes: dict[str, _Node] = {}
        self._demoted: set[str] = set()  # ids whose node is_demoted, kept in step
        self._medians_cfg: DemotionConfig | None = None  # the cfg the cached medians used

    def _node(self, backend_id: str) -> _Node:
        node = self._nodes.get(backend_id)
        if node is None:
            node = self._nodes[backend_id] = _Node()
        return node

    def forget(self, backend_id: str) -> None:
        self._nodes.pop(backend_id, None)
        self._demoted.discard(backend_id)

    def observe(
        self, backend_id: str, now_s: float, ttft_ms: float | None, tpot_ms: float | None
    ) -> None:
        node, max_n = self._node(backend_id), self.cfg.max_num_samples
        if ttft_ms is not None:
            _push(node.ttft_ms, now_s, ttft_ms, max_n)
            node.is_ttft_stale = True
        if tpot_ms is not None:
            _push(node.tpot_ms, now_s, tpot_ms, max_n)
            node.is_tpot_stale = True

    def demoted_ids(self) -> frozenset[str]:
        """The backends demoted now (ramping back included): the only ones whose
        ``weight_factor`` is not 1.0."""
        return frozenset(self._demoted)

    def _refresh(self, now_s: float) -> dict[str, float | None]:
        """Trims every window to ``window_s``, brings the cached medians up to date and
        returns each backend's TPOT median."""
        cfg = self.cfg
        oldest_s, min_num = now_s - cfg.window_s, cfg.min_num_samples
        is_all_stale = self._medians_cfg is not cfg  # a new config: a new min_num_samples
        self._medians_cfg = cfg
        tpot_medians: dict[str, float | None] = {}
        for backend_id, node in self._nodes.items():
            ttft, tpot = node.ttft_ms, node.tpot_ms  # (the oldest sample is checked inline)
            if (ttft and ttft[0][0] < oldest_s and _trim(ttft, oldest_s)) or is_all_stale:
                node.is_ttft_stale = True
            if (tpot and tpot[0][0] < oldest_s and _trim(tpot, oldest_s)) or is_all_stale:
                node.is_tpot_stale = True
            if node.is_tpot_stale:
                node.tpot_median, node.is_tpot_stale = _median(tpot, min_num), False
            tpot_medians[backend_id] = node.tpot_median
        return tpot_medians

    def _ttft_median(self, node: _Node) -> float | None:
        if node.is_ttft_stale:
            node.ttft_median = _median(node.ttft_ms, self.cfg.min_num_samples)
            node.is_ttft_stale = False
        return node.ttft_median

    def _slow_reason(
        self, backend_id: str, node: _Node, others: float | None, scale: float, limits: _Limits
    ) -> DemotionEvent | None:
        """Why the backend is slow (thresholds x ``scale``; ``others``: the yardstick
        of its pool, the others' TPOT quantile), or None."""
        tpot = node.tpot_median
        if tpot is not None:
            if limits.max_tpot_ms is not None and tpot > limits.max_tpot_ms * scale:
                return DemotionEvent(backend_id, "tpot_abs", tpot, limits.max_tpot_ms * scale)
            factor = limits.pool_factor
            if factor and others is not None:
                # slow for its pool: over pool_factor x the others' TPOT and at least
                # min_excess_tpot_ms over it
                bound = max(factor * others, others + limits.min_excess_tpot_ms)
                if tpot > bound * scale:
                    return DemotionEvent(backend_id, "tpot_pool", tpot, bound * scale)
        if limits.max_ttft_ms is not None:
            ttft = self._ttft_median(node)
            if ttft is not None and ttft > limits.max_ttft_ms * scale:
                return DemotionEvent(backend_id, "ttft_abs", ttft, limits.max_ttft_ms * scale)
        return None

    def _may_demote(self, backend_id: str, pool: frozenset[str]) -> bool:
        num_ids = len(pool) + (backend_id not in pool)
        demoted = self._demoted
        num_demoted = len(demoted & pool) - (backend_id in pool and backend_id in demoted)
        max_num = max(1, math.floor(num_ids * self.cfg.max_demoted_percent / 100.0))
        return num_demoted + 1 <= max_num

    def evaluate(self, now_s: float, pools: Mapping[str, Iterable[str]]) -> list[DemotionEvent]:
        """Re-judge every backend (``pools``: backend id -> ids of its pool); returns changes."""
        events: list[DemotionEvent] = []
        if not self.cfg.enabled:
            return events
        tpot_medians = self._refresh(now_s)
        limits = _Limits(self.cfg)
        quantile, pool_factor = limits.pool_quantile, limits.pool_factor
        has_ttft = limits.max_ttft_ms is not None
        ranked_by_pool: dict[frozenset[str], list[float]] = {}  # sorted medians per pool
        for backend_id, node in self._nodes.items():
            if not node.is_demoted and node.tpot_median is None and not has_ttft:
                continue  # too few samples to judge it by
            given = pools.get(backend_id)  # (a frozenset is used as it is, not copied:
            # compiled, frozenset() of one copies it, then hashes and compares the copy)
            pool = given if isinstance(given, frozenset) else frozenset(given or ())
            others = None  # the yardstick, needed only when the backend has a TPOT median
            if node.tpot_median is not None and pool_factor:
                ranked = ranked_by_pool.get(pool)
                if ranked is None:
                    medians = [tpot_medians.get(b) for b in pool]
                    ranked = ranked_by_pool[pool] = sorted([m for m in medians if m is not None])
                own = node.tpot_median if backend_id in pool else None
                skip = -1 if own is None else bisect_left(ranked, own)
                if len(ranked) > (skip >= 0):
                    others = _quantile(ranked, quantile, skip)
            if not node.is_demoted or node.recovering_since_s is not None:
                slow = self._slow_reason(backend_id, node, others, 1.0, limits)
                if slow is not None and (node.is_demoted or self._may_demote(backend_id, pool)):
                    node.is_demoted, node.recovering_since_s, node.reason = True, None, slow.reason
                    node.num_demotions_total += 1
                    self._demoted.add(backend_id)
                    events.append(slow)
            elif self._slow_reason(backend_id, node, others, limits.recover_ratio, limits) is None:
                node.recovering_since_s = now_s  # hysteresis: clearly fast again
                events.append(DemotionEvent(backend_id, ""))
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
            self._demoted.discard(backend_id)
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
