"""Round robin: the baseline that fails under mixed request sizes (S1.2).

Algorithm: a per-model cursor counts dispatches; the pick is
``candidates[cursor % len(candidates)]`` and the fallbacks follow in rotated
snapshot order. The cursor moves only in ``on_dispatch``. Ignores load and weights by
design (it is the baseline). No thresholds.
"""

from __future__ import annotations

import random

from kiloserve.policies.base import ClusterSnapshot, Decision, Outcome, RequestInfo
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

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        ids = [b.backend_id for b in candidates(request, snapshot)]
        if not ids:
            return Decision(ranked=(), policy=self.name, reason="no eligible backend")
        start = self._num_dispatched.get(request.model, 0) % len(ids)
        return Decision(ranked=tuple(ids[start:] + ids[:start]), policy=self.name)

    def on_dispatch(self, request: RequestInfo, backend_id: str) -> None:
        self._num_dispatched[request.model] = self._num_dispatched.get(request.model, 0) + 1

    def on_complete(self, request: RequestInfo, backend_id: str, outcome: Outcome) -> None:
        return None
