"""The demoter's cached medians and indexed pool quantiles decide exactly as the plain
rules do: a straightforward reference (every median recomputed with
``statistics.median``, every pool's others copied and sorted) is driven alongside
``SlowNodeDemoter`` through random samples, pools, configs and weight reads, and every
event and weight factor must match."""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Iterable, Mapping

import pytest

from kiloserve.gateway.resilience.demotion import DemotionConfig, SlowNodeDemoter


class _RefNode:
    def __init__(self) -> None:
        self.ttft: deque[tuple[float, float]] = deque()
        self.tpot: deque[tuple[float, float]] = deque()
        self.is_demoted = False
        self.recovering_since_s: float | None = None


class _Reference:
    """The rules of ``gateway/resilience/demotion.py`` written out naively."""

    def __init__(self, cfg: DemotionConfig) -> None:
        self.cfg = cfg
        self.nodes: dict[str, _RefNode] = {}

    def observe(self, b: str, now_s: float, ttft: float | None, tpot: float | None) -> None:
        node = self.nodes.setdefault(b, _RefNode())
        for window, value in ((node.ttft, ttft), (node.tpot, tpot)):
            if value is not None:
                window.append((now_s, value))
                while len(window) > self.cfg.max_num_samples:
                    window.popleft()

    def _median(self, window: deque[tuple[float, float]]) -> float | None:
        if len(window) < self.cfg.min_num_samples:
            return None
        return statistics.median(v for _, v in window)

    def _others(self, b: str, pool: Iterable[str]) -> float | None:
        values = [
            m
            for o in pool
            if o != b and o in self.nodes
            for m in [self._median(self.nodes[o].tpot)]
            if m is not None
        ]
        if not values:
            return None
        ranked, q = sorted(values), self.cfg.pool_quantile
        if q == 0.5:
            return statistics.median(ranked)
        return ranked[min(len(ranked) - 1, int(q * len(ranked)))]

    def _slow(self, b: str, pool: Iterable[str], scale: float) -> tuple[str, float] | None:
        cfg, node = self.cfg, self.nodes[b]
        tpot = self._median(node.tpot)
        if tpot is not None:
            if cfg.max_tpot_ms is not None and tpot > cfg.max_tpot_ms * scale:
                return ("tpot_abs", tpot)
            others = self._others(b, pool) if cfg.pool_factor else None
            if cfg.pool_factor and others is not None:
                bound = max(cfg.pool_factor * others, others + cfg.min_excess_tpot_ms)
                if tpot > bound * scale:
                    return ("tpot_pool", tpot)
        ttft = self._median(node.ttft)
        if ttft is not None and cfg.max_ttft_ms is not None and ttft > cfg.max_ttft_ms * scale:
            return ("ttft_abs", ttft)
        return None

    def evaluate(self, now_s: float, pools: Mapping[str, Iterable[str]]) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        oldest_s = now_s - self.cfg.window_s
        for node in self.nodes.values():
            for window in (node.ttft, node.tpot):
                while window and window[0][0] < oldest_s:
                    window.popleft()
        for b, node in self.nodes.items():
            pool = pools.get(b, ())
            if not node.is_demoted or node.recovering_since_s is not None:
                slow = self._slow(b, pool, 1.0)
                if slow is not None and (node.is_demoted or self._may_demote(b, pool)):
                    node.is_demoted, node.recovering_since_s = True, None
                    events.append((b, slow[0]))
            elif self._slow(b, pool, self.cfg.recover_ratio) is None:
                node.recovering_since_s = now_s
                events.append((b, ""))
        return events

    def _may_demote(self, b: str, pool: Iterable[str]) -> bool:
        ids = set(pool) | {b}
        num = sum(1 for o in ids if o != b and o in self.nodes and self.nodes[o].is_demoted)
        return num + 1 <= max(1, math.floor(len(ids) * self.cfg.max_demoted_percent / 100.0))

    def weight_factor(self, b: str, now_s: float) -> float:
        node = self.nodes.get(b)
        if node is None or not node.is_demoted:
            return 1.0
        low = self.cfg.demoted_weight
        if node.recovering_since_s is None:
            return low
        ramp_s = self.cfg.slow_start_s
        done = 1.0 if ramp_s <= 0.0 else (now_s - node.recovering_since_s) / ramp_s
        if done >= 1.0:
            node.is_demoted, node.recovering_since_s = False, None
            return 1.0
        return low + (1.0 - low) * max(0.0, done)


CONFIGS = [
    {},
    {"pool_quantile": 0.5, "min_num_samples": 2, "max_num_samples": 6},
    {"max_ttft_ms": 400.0, "pool_quantile": 0.0, "window_s": 5.0},
    {"pool_factor": None, "max_tpot_ms": 60.0, "slow_start_s": 0.0},
    {"max_tpot_ms": None, "min_excess_tpot_ms": 0.0, "max_demoted_percent": 30.0},
    {"pool_quantile": 1.0, "recover_ratio": 1.0, "min_num_samples": 1, "window_s": 2.0},
]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("options", CONFIGS)
def test_decisions_match_the_plain_rules(options: dict[str, object], seed: int) -> None:
    rng = random.Random(seed)
    cfg = DemotionConfig.model_validate(options)
    fast, ref = SlowNodeDemoter(cfg), _Reference(cfg)
    ids = [f"b{i}" for i in range(12)]
    speed = {b: rng.choice([1.0, 1.0, 1.0, 3.0, 8.0]) for b in ids}
    now_s, num_events = 0.0, 0
    for tick in range(300):
        now_s += rng.choice([0.1, 0.5, 1.0, 3.0])
        if tick % 40 == 0:  # slow nodes come and go
            speed = {b: rng.choice([1.0, 1.0, 1.0, 3.0, 8.0]) for b in ids}
        for _ in range(rng.randrange(0, 25)):
            b = rng.choice(ids)
            ttft = rng.choice([None, round(rng.uniform(50, 900), 1)])
            tpot = rng.choice([None, 20.0 * speed[b] + rng.choice([0.0, 0.5, 1.0, 7.0])])
            fast.observe(b, now_s, ttft, tpot)
            ref.observe(b, now_s, ttft, tpot)
        healthy = [b for b in ids if rng.random() > 0.1]
        groups = (set(healthy[::2]), set(healthy[1::2]))
        pools = {b: groups[i % 2] | {b} for i, b in enumerate(ids)}
        if tick % 7 == 0:
            pools["b3"] = set(ids)  # a pool that differs from its peers'
            pools.pop("b5")  # and a backend without one
        got = [(e.backend_id, e.reason) for e in fast.evaluate(now_s, pools)]
        assert got == ref.evaluate(now_s, pools), f"tick {tick}"
        num_events += len(got)
        for b in ids:  # weight reads end slow starts: same reads on both
            assert fast.weight_factor(b, now_s) == ref.weight_factor(b, now_s), (tick, b)
        assert fast.demoted_ids() == {b for b, n in ref.nodes.items() if n.is_demoted}
    assert num_events > 0  # the run demoted and recovered something


def test_a_new_config_recomputes_the_cached_medians() -> None:
    cfg = DemotionConfig.model_validate({"min_num_samples": 3, "pool_factor": None})
    d = SlowNodeDemoter(cfg)
    for _ in range(2):
        d.observe("a", 0.0, None, 900.0)
    assert d.evaluate(0.0, {"a": {"a"}}) == []  # two samples: too few to judge
    d.cfg = DemotionConfig.model_validate({"min_num_samples": 2, "pool_factor": None})
    assert [e.reason for e in d.evaluate(0.0, {"a": {"a"}})] == ["tpot_abs"]


def test_forget_drops_a_demoted_backend() -> None:
    d = SlowNodeDemoter(DemotionConfig.model_validate({"min_num_samples": 1}))
    d.observe("a", 0.0, None, 900.0)
    d.evaluate(0.0, {"a": {"a"}})
    assert d.demoted_ids() == {"a"}
    d.forget("a")
    assert d.demoted_ids() == frozenset()
    assert d.weight_factor("a", 0.0) == 1.0
