"""Shared pieces for policies that keep no state between requests."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kiloserve.policies.base import BackendState, ClusterSnapshot, Decision, Outcome, RequestInfo
from kiloserve.policies.ranking import rank_by_keys
from kiloserve.policies.signals import candidates

__all__ = ["SortedPolicy", "StatelessHooks"]


class StatelessHooks:
    """Mixin: ``on_dispatch`` and ``on_complete`` do nothing."""

    def on_dispatch(self, request: RequestInfo, backend_id: str) -> None:
        return None

    def on_complete(self, request: RequestInfo, backend_id: str, outcome: Outcome) -> None:
        return None


class SortedPolicy(StatelessHooks):
    """A stateless policy that ranks candidates by sort keys (smaller first), then by
    snapshot order; subclasses only say what the keys are."""

    name = "sorted"

    def sort_keys(
        self, request: RequestInfo, pool: list[BackendState]
    ) -> tuple[Sequence[float], Sequence[float]]:
        raise NotImplementedError

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        pool = candidates(request, snapshot)
        if not pool:
            return Decision(ranked=(), policy=self.name, reason="no eligible backend")
        primary, secondary = self.sort_keys(request, pool)
        return Decision(ranked=rank_by_keys(pool, primary, secondary), policy=self.name)
