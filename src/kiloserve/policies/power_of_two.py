"""Power of two choices: sample two distinct candidates, send to the less loaded.

Algorithm: ``i = rng.randrange(n)``, ``j = rng.randrange(n - 1)`` shifted past ``i``
(two distinct uniform picks, always two rng draws when n >= 2). Compare by
``signals.load_rank`` (known request load per capacity weight first; stale or missing
scrapes count as saturated), then by outstanding tokens per capacity weight; a full
tie goes to the first sample. Ranked: winner, loser, then the other candidates in
snapshot order. With one candidate no rng is drawn. No thresholds.
"""

from __future__ import annotations

import random

from kiloserve.policies.base import BackendState, ClusterSnapshot, Decision, RequestInfo
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.signals import candidates, load_rank, token_load
from kiloserve.policies.stateless import StatelessHooks

__all__ = ["PowerOfTwoParams", "PowerOfTwoPolicy"]


class PowerOfTwoParams(PolicyParams):
    """Power of two takes no parameters."""


def _key(b: BackendState) -> tuple[float, float]:
    return (load_rank(b), token_load(b))


class PowerOfTwoPolicy(StatelessHooks):
    name = "power_of_two"
    reads_prefix_hashes = False  # (optional Policy attribute: see protocol.py)

    def __init__(self, params: PowerOfTwoParams | None = None) -> None:
        self.params = params or PowerOfTwoParams()

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        pool = candidates(request, snapshot)
        n = len(pool)
        if n == 0:
            return Decision(ranked=(), policy=self.name, reason="no eligible backend")
        if n == 1:
            return Decision(ranked=(pool[0].backend_id,), policy=self.name)
        i = rng.randrange(n)
        j = rng.randrange(n - 1)
        if j >= i:
            j += 1
        if _key(pool[j]) < _key(pool[i]):
            i, j = j, i
        first, second = pool[i].backend_id, pool[j].backend_id
        rest = [b.backend_id for k, b in enumerate(pool) if k != i and k != j]
        return Decision(ranked=(first, second, *rest), policy=self.name)
