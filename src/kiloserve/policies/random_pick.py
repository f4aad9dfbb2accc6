"""Random (registry name ``random``): a uniform pick among the candidates.

Algorithm: ``rng.randrange(len(candidates))`` picks one backend; the fallbacks are the
other candidates in snapshot order. Ignores load and weights by design (a baseline).
No thresholds. All randomness comes from the ``rng`` argument.
"""

from __future__ import annotations

import random

from kiloserve.policies.base import ClusterSnapshot, Decision, RequestInfo
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.signals import candidates
from kiloserve.policies.stateless import StatelessHooks

__all__ = ["RandomParams", "RandomPolicy"]


class RandomParams(PolicyParams):
    """Random takes no parameters."""


class RandomPolicy(StatelessHooks):
    name = "random"
    reads_prefix_hashes = False  # (optional Policy attribute: see protocol.py)

    def __init__(self, params: RandomParams | None = None) -> None:
        self.params = params or RandomParams()

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        ids = [b.backend_id for b in candidates(request, snapshot)]
        if not ids:
            return Decision(ranked=(), policy=self.name, reason="no eligible backend")
        pick = rng.randrange(len(ids))
        return Decision(ranked=(ids[pick], *ids[:pick], *ids[pick + 1 :]), policy=self.name)
