"""Slow-node demotion in simulated time: the gateway's own ``SlowNodeDemoter``.

Wired as ``gateway/resilience/manager.py`` wires it live: a TTFT sample at each first
token, a TPOT sample at each successful completion, and a tick that re-judges every
backend against its pool (healthy peers serving the same models) and scales its
``effective_weight`` by the demoter's factor (``demoted_weight``, 0.2 by default,
then the slow-start ramp). The live gateway ticks every 0.1 s; here the tick runs at
the scrape rounds, at most every ``tick_s`` (``DEFAULT_TICK_S``, 1 s of simulated
time): the judgement is over 30 s windows. A tick costs O(backends): the pools are
rebuilt only when a backend's health or models changed, a window's median only after a
sample came in or aged out, and only demoted backends have their weight rescaled (the
others keep base x 1.0). On by default, as in the gateway
(``demotion.enabled``); a cluster YAML turns it off with
``gateway: {options: {demotion: {enabled: false}}}``.
"""

from __future__ import annotations

from kiloserve.gateway.resilience.demotion import DemotionConfig, SlowNodeDemoter
from kiloserve.policies.base import BackendState
from kiloserve.routing.table import BackendTable

__all__ = ["DEFAULT_TICK_S", "SimDemotion"]

DEFAULT_TICK_S = 1.0


class SimDemotion:
    """Feeds the demoter from simulated attempts and applies its weight factors."""

    def __init__(self, cfg: DemotionConfig, table: BackendTable, tick_s: float = DEFAULT_TICK_S):
        self.demoter = SlowNodeDemoter(cfg)
        self.table = table
        self.tick_s = tick_s
        self.next_tick_s = 0.0
        self.num_demotions: dict[str, int] = {}
        self._base_weight: dict[str, float] = {}
        self._scaled: set[str] = set()  # backends whose weight has a factor other than 1.0
        # the last tick's pools and what they were built from (ids, models, health)
        self._pools_key: tuple[list[str], list[frozenset[str]], list[bool]] | None = None
        self._pools: dict[str, frozenset[str]] = {}

    def on_first_token(self, backend_id: str, now_s: float, ttft_ms: float) -> None:
        self.demoter.observe(backend_id, now_s, ttft_ms, None)

    def on_complete(self, backend_id: str, now_s: float, tpot_ms: float | None) -> None:
        self.demoter.observe(backend_id, now_s, None, tpot_ms)

    def maybe_tick(self, now_s: float) -> None:
        if now_s >= self.next_tick_s:
            self.next_tick_s = now_s + self.tick_s
            self.tick(now_s)

    def tick(self, now_s: float) -> None:
        """Re-judge every backend against its healthy pool; apply the weight factors."""
        table = self.table
        ids = table.backend_ids()
        states = [table.state(b) for b in ids]
        key = (ids, [s.models for s in states], [s.healthy for s in states])
        if key != self._pools_key:  # else the pools are those of the last tick
            self._pools_key, self._pools = key, self._pools_for(ids, states)
        for event in self.demoter.evaluate(now_s, self._pools):
            if event.reason:
                self.num_demotions[event.backend_id] = (
                    self.num_demotions.get(event.backend_id, 0) + 1
                )
        # Only a demoted backend (or one demoted at the last tick, or a new one) has a
        # factor other than 1.0 or had one: the others keep base x 1.0 = base.
        demoted = self.demoter.demoted_ids()
        base_weight = self._base_weight
        for b, state in zip(ids, states, strict=True):
            if b in demoted or b in self._scaled or b not in base_weight:
                base = base_weight.setdefault(b, state.effective_weight)
                factor = self.demoter.weight_factor(b, now_s)
                state.effective_weight = base * factor
                if factor != 1.0:
                    self._scaled.add(b)
                else:
                    self._scaled.discard(b)

    def _pools_for(self, ids: list[str], states: list[BackendState]) -> dict[str, frozenset[str]]:
        """Each backend's pool: the healthy backends serving one of its models, and itself."""
        healthy = {b for b, s in zip(ids, states, strict=True) if s.healthy}
        by_models: dict[frozenset[str], frozenset[str]] = {}  # one pool per model set
        pools: dict[str, frozenset[str]] = {}
        for b, state in zip(ids, states, strict=True):
            models = state.models
            pool = by_models.get(models)
            if pool is None:
                pool = by_models[models] = self._pool_of(models) & healthy
            pools[b] = pool | {b} if b not in pool else pool
        return pools

    def _pool_of(self, models: frozenset[str]) -> frozenset[str]:
        ids: set[str] = set()
        for model in models:
            ids |= self.table.pool_ids(model)
        return frozenset(ids)
