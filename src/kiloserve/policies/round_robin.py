"""Round robin: the baseline that fails under mixed request sizes (S1.2).

Algorithm: a per-model cursor counts dispatches; the pick is
``candidates[cursor % len(candidates)]`` and the fallbacks follow in rotated
snapshot order. The cursor moves only in ``on_dispatch``. Ignores load and weights by
design (it is the baseline). No thresholds.
"""

from __future__ import annotations

import random

from kiloserve.policies.base import BackendState, ClusterSnapshot, Decision, Outcome, RequestInfo
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.signals import candidates

__all__ = ["RoundRobinParams", "RoundRobinPolicy"]


class RoundRobinParams(PolicyParams):
    """Round robin takes no parameters."""


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self, params: RoundRobinParams | None = None) -> None:
        self.params = params or RoundRobinParams()
        self._num_dispatched: dict[str, int] = {}
        # A snapshot's precomputed candidate tuple (the simulator keeps one per model
        # until health or weights change) and its ids: held, so never a recycled object.
        self._known_pool: tuple[BackendState, ...] | None = None
        self._known_ids: tuple[str, ...] = ()

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        ids = self._candidate_ids(request, snapshot)
        if not ids:
            return Decision(ranked=(), policy=self.name, reason="no eligible backend")
        start = self._num_dispatched.get(request.model, 0) % len(ids)
        return Decision(ranked=ids[start:] + ids[:start], policy=self.name)

    def _candidate_ids(self, request: RequestInfo, snapshot: ClusterSnapshot) -> tuple[str, ...]:
        known = snapshot.eligible_by_model
        pool = None if known is None else known.get(request.model)
        if pool is None:
            return tuple(b.backend_id for b in candidates(request, snapshot))
        if pool is not self._known_pool:
            self._known_pool, self._known_ids = pool, tuple(b.backend_id for b in pool)
        return self._known_ids

    def on_dispatch(self, request: RequestInfo, backend_id: str) -> None:
        self._num_dispatched[request.model] = self._num_dispatched.get(request.model, 0) + 1

    def on_complete(self, request: RequestInfo, backend_id: str, outcome: Outcome) -> None:
        return None
