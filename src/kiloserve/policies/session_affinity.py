"""Session affinity: consistent hashing of the session onto a group, bounded loads (S1.6).

Algorithm:

* Groups are ``BackendState.group`` (a rack), or each backend alone when empty, so a
  failed GPU's peers in the same group take its sessions over.
* The ring holds every group of the model's whole pool (``num_vnodes`` = 64 points
  each); groups without a candidate right now are skipped while walking, which moves
  only their sessions (consistent hashing).
* Bounded loads (Mirrokni, Thorup, Zadimoghaddam; Google 2017) with
  ``load_factor`` c = 1.25: group capacity is
  ``ceil(c * (total_requests + 1) * group_weight / total_weight)`` where weight is the
  sum of ``weight * effective_weight`` and requests are ``signals.num_requests``.
  Walk clockwise from ``blake2b(session_key)``; take the first group whose
  ``requests + 1 <= capacity``. Such a group always exists since c > 1.
* Inside the group: least load (``signals.load_rank``; stale counts as saturated).
* No session key: least load over all candidates.

Ranked: the group's backends by least load, then every other candidate by least load.
"""

from __future__ import annotations

import math
import random

from pydantic import Field

from kiloserve.policies.base import BackendState, ClusterSnapshot, Decision, RequestInfo
from kiloserve.policies.hash_ring import RingCache, stable_hash64
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.ranking import ids, order_by
from kiloserve.policies.signals import candidates, load_ranks
from kiloserve.policies.stateless import StatelessHooks

__all__ = ["SessionAffinityParams", "SessionAffinityPolicy"]


class SessionAffinityParams(PolicyParams):
    load_factor: float = Field(default=1.25, gt=1.0)
    num_vnodes: int = Field(default=64, ge=1, le=4096)


class _Group:
    __slots__ = ("members", "num_requests", "weight")

    def __init__(self) -> None:
        self.members: set[int] = set()
        self.num_requests = 0
        self.weight = 0.0


def _groups(pool: list[BackendState]) -> dict[str, _Group]:
    """Ring name -> the group's candidate indices, request count and weight."""
    groups: dict[str, _Group] = {}
    for i, b in enumerate(pool):
        name = b.group or b.backend_id  # hash_ring.group_name, inlined (hot path)
        g = groups.get(name)
        if g is None:
            g = groups[name] = _Group()
        g.members.add(i)
        running, waiting = b.num_running, b.num_waiting
        if b.scrape_stale or running is None or waiting is None or b.in_flight > running + waiting:
            g.num_requests += b.in_flight
        else:
            g.num_requests += running + waiting
        g.weight += b.weight * b.effective_weight
    return groups


class SessionAffinityPolicy(StatelessHooks):
    name = "session_affinity"

    def __init__(self, params: SessionAffinityParams | None = None) -> None:
        self.params = params or SessionAffinityParams()
        self._rings = RingCache(self.params.num_vnodes)

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        pool = candidates(request, snapshot)
        if not pool:
            return Decision(ranked=(), policy=self.name, reason="no eligible backend")
        order = order_by(load_ranks(pool))
        if request.session_key is None:
            return Decision(ids(pool, order), self.name, reason="no session key")
        groups = _groups(pool)
        members = self._bounded_group(request.session_key, snapshot, request.model, groups).members
        head = [i for i in order if i in members]
        rest = [i for i in order if i not in members]
        return Decision(ranked=ids(pool, head + rest), policy=self.name, reason="session")

    def _bounded_group(
        self, session_key: str, snapshot: ClusterSnapshot, model: str, groups: dict[str, _Group]
    ) -> _Group:
        ring = self._rings.pool_ring(snapshot, model)
        total_requests = sum(g.num_requests for g in groups.values())
        total_weight = sum(g.weight for g in groups.values())
        scale = self.params.load_factor * (total_requests + 1) / total_weight
        first: _Group | None = None
        for name in ring.walk(stable_hash64(session_key)):
            g = groups.get(name)
            if g is None:
                continue
            if g.num_requests + 1 <= math.ceil(scale * g.weight):
                return g
            first = first or g
        return first if first is not None else next(iter(groups.values()))
