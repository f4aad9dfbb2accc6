"""Weighted round robin on live weights (S1.5, seeds 002 / 004): nginx's smooth WRR.

Algorithm (nginx ``ngx_http_upstream_get_peer``, deterministic, no ``rng``): every
candidate with weight ``w_i > 0`` keeps a current weight ``c_i`` (starts at 0). A pick
is ``argmax(c_i + w_i)`` (ties: snapshot order); the dispatch then does
``c_i += w_i`` for every such candidate and ``c_picked -= sum(w)``. Over any window
where the weights hold, backend i gets ``w_i / sum(w)`` of the requests, spread out
(weights 5, 1, 1 give a a b a c a a, not a a a a a b c).

Weights (``weights``):

* ``seed`` (default): the S1.4 dynamic weight of ``seed_weighted.seed_weights``:
  ``free_kv * (1 - pcie_util) * exp(-latency_decay_per_ms (0.05) * (latency_ms -
  min_latency_ms)) * weight * effective_weight`` (``latency_metric`` tpot), so the
  rotation follows free KV, PCIe headroom and latency deterministically;
* ``static``: ``weight * effective_weight`` (configured weight times health weight),
  the static weighted round robin of seed 000's A/B baseline.

Weights are recomputed every ``refresh_s`` (0.2, the seed's 200 ms) of snapshot time
and at once when the candidate set changes (``live_weights.LiveWeights``). Current
weights carry over a refresh (as nginx keeps them when an effective weight moves); a
backend leaving the weighted set (gone, or W = 0) forgets its current weight.

Choose is pure: the step happens in ``on_dispatch`` with the backend actually sent
to (a retry to a fallback moves that backend's current weight). A dispatch to a
backend with W = 0 moves nothing. Ranked fallbacks: the positive-weight candidates by
descending ``c + w``, then the W = 0 ones by least load. Every W = 0: least load
(``signals.load_rank``), reason "all weights zero".
"""

from __future__ import annotations

import random
from typing import Literal

from kiloserve.policies.base import BackendState, ClusterSnapshot, Decision, Outcome, RequestInfo
from kiloserve.policies.live_weights import LiveWeights
from kiloserve.policies.ranking import least_load_order, rank_by_keys
from kiloserve.policies.seed_weighted import SeedWeightedParams, seed_weights
from kiloserve.policies.signals import candidates, capacity_weight

__all__ = ["WeightedRoundRobinParams", "WeightedRoundRobinPolicy"]


class WeightedRoundRobinParams(SeedWeightedParams):
    """``seed_weighted``'s parameters (used when ``weights: seed``) plus the source."""

    weights: Literal["seed", "static"] = "seed"


class WeightedRoundRobinPolicy:
    name = "weighted_round_robin"
    reads_prefix_hashes = False  # (optional Policy attribute: see protocol.py)

    def __init__(self, params: WeightedRoundRobinParams | None = None) -> None:
        self.params = params or WeightedRoundRobinParams()
        self.weights = LiveWeights(self._weigh, self.params.refresh_s)
        self._current: dict[str, dict[str, float]] = {}  # model -> backend id -> c
        self._live: dict[str, dict[str, float]] = {}  # model -> id -> w > 0 (last choose)

    def _weigh(self, pool: list[BackendState]) -> list[float]:
        if self.params.weights == "static":
            return [capacity_weight(b) for b in pool]
        return seed_weights(pool, self.params)

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        pool = candidates(request, snapshot)
        if not pool:
            return Decision(ranked=(), policy=self.name, reason="no eligible backend")
        weights = self.weights.get(request.model, pool, snapshot.now_s)
        live = {b.backend_id: w for b, w in zip(pool, weights, strict=True) if w > 0.0}
        self._live[request.model] = live  # memo of the weights the dispatch steps with
        if not live:
            ranked = least_load_order(pool)
            return Decision(ranked=ranked, policy=self.name, reason="all weights zero")
        current = self._current.get(request.model, {})
        weighted = [b for b in pool if b.backend_id in live]
        keys = [-(current.get(b.backend_id, 0.0) + live[b.backend_id]) for b in weighted]
        rest = least_load_order([b for b in pool if b.backend_id not in live])
        return Decision(ranked=rank_by_keys(weighted, keys) + rest, policy=self.name)

    def on_dispatch(self, request: RequestInfo, backend_id: str) -> None:
        live = self._live.get(request.model)
        if not live or backend_id not in live:
            return
        old = self._current.get(request.model, {})
        current = {bid: old.get(bid, 0.0) + w for bid, w in live.items()}
        current[backend_id] -= sum(live.values())
        self._current[request.model] = current

    def on_complete(self, request: RequestInfo, backend_id: str, outcome: Outcome) -> None:
        return None
