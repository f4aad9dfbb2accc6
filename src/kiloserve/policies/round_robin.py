"""Round robin: the baseline that fails under mixed request sizes (S1.2).

Algorithm: a per-model cursor counts dispatches; the pick is
``candidates[cursor % len(candidates)]`` and the fallbacks follow in rotated
snapshot order. The cursor moves only in ``on_dispatch``. Ignores load and weights by
design (it is the baseline). No thresholds.

Disaggregated serving (``routing/disagg.py``): a split request's prefill leg is chosen
among the model's ``prefill`` backends, and both of its legs are dispatched, so the
model's cursor moves twice per request: with two prefill backends every prefill leg
went to the first. Prefill legs therefore rotate on a cursor of their own, moved only
by dispatches to prefill backends.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kiloserve.policies.base import BackendState, ClusterSnapshot, Decision, Outcome, RequestInfo
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.signals import candidates

__all__ = ["RoundRobinParams", "RoundRobinPolicy"]


class RoundRobinParams(PolicyParams):
    """Round robin takes no parameters."""


class RoundRobinPolicy:
    name = "round_robin"
    reads_prefix_hashes = False  # (optional Policy attribute: see protocol.py)

    def __init__(self, params: RoundRobinParams | None = None) -> None:
        self.params = params or RoundRobinParams()
        self._num_dispatched: dict[str, int] = {}
        # A snapshot's precomputed candidate tuple (the simulator keeps one per model
        # until health or weights change) and its ids: held, so never a recycled object.
        self._known_pool: tuple[BackendState, ...] | None = None
        self._known_ids: tuple[str, ...] = ()
        self._known_prefill = False
        self._prefill_ids: set[str] = set()  # backends seen with role "prefill"
        self._num_prefill: dict[str, int] = {}

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        ids, is_prefill = self._candidate_ids(request, snapshot)
        if not ids:
            return Decision(ranked=(), policy=self.name, reason="no eligible backend")
        cursors = self._num_prefill if is_prefill else self._num_dispatched
        start = cursors.get(request.model, 0) % len(ids)
        return Decision(ranked=ids[start:] + ids[:start], policy=self.name)

    def _candidate_ids(
        self, request: RequestInfo, snapshot: ClusterSnapshot
    ) -> tuple[tuple[str, ...], bool]:
        """The candidates' ids, and whether they are all prefill backends."""
        known = snapshot.eligible_by_model
        pool = None if known is None else known.get(request.model)
        if pool is None:
            got = candidates(request, snapshot)
            return tuple(b.backend_id for b in got), self._all_prefill(got)
        if pool is not self._known_pool:
            self._known_pool, self._known_ids = pool, tuple(b.backend_id for b in pool)
            self._known_prefill = self._all_prefill(pool)
        return self._known_ids, self._known_prefill

    def _all_prefill(self, pool: Sequence[BackendState]) -> bool:
        if not pool or any(b.role != "prefill" for b in pool):
            return False
        self._prefill_ids.update(b.backend_id for b in pool)
        return True

    def on_dispatch(self, request: RequestInfo, backend_id: str) -> None:
        self._num_dispatched[request.model] = self._num_dispatched.get(request.model, 0) + 1
        if backend_id in self._prefill_ids:
            self._num_prefill[request.model] = self._num_prefill.get(request.model, 0) + 1

    def on_complete(self, request: RequestInfo, backend_id: str, outcome: Outcome) -> None:
        return None
