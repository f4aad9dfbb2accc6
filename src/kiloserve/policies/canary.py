"""Canary: a configured share of traffic to new versions, the rest to stable (S1.9).

Algorithm: ``splits`` maps ``BackendState.version`` to a traffic share, e.g.
``{"v2": 0.05}``; shares are in [0, 1] and sum to at most 1. Backends whose version is
not in ``splits`` are *stable*. A draw ``u`` in [0, 1) walks the splits in version-name
order: the first version whose cumulative share exceeds ``u`` is the target, else
stable. ``u`` is ``rng.random()``, or, with ``sticky_sessions`` (default on) and a
session key, ``blake2b(session_key) / 2**64`` so one user stays on one version.
If the target version has no candidate the request goes to stable; if stable has
none, to any candidate. Within the target: least load (``signals.load_rank``).
Ranked: the target's backends by least load, then the rest by least load.
Ramping to 100% is a config change (``{"v2": 1.0}``).
"""

from __future__ import annotations

import random

from pydantic import Field, field_validator

from kiloserve.policies.base import BackendState, ClusterSnapshot, Decision, RequestInfo
from kiloserve.policies.hash_ring import stable_hash64
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.ranking import ids, order_by
from kiloserve.policies.signals import candidates, load_ranks
from kiloserve.policies.stateless import StatelessHooks

__all__ = ["CanaryParams", "CanaryPolicy"]


class CanaryParams(PolicyParams):
    splits: dict[str, float] = Field(default_factory=dict)
    sticky_sessions: bool = True

    @field_validator("splits")
    @classmethod
    def _shares_valid(cls, splits: dict[str, float]) -> dict[str, float]:
        for version, share in splits.items():
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"share of version {version!r} must be in [0, 1], got {share}")
        if sum(splits.values()) > 1.0 + 1e-9:
            raise ValueError(f"shares sum to {sum(splits.values())} > 1")
        return splits


class CanaryPolicy(StatelessHooks):
    name = "canary"

    def __init__(self, params: CanaryParams | None = None) -> None:
        self.params = params or CanaryParams()
        self._splits = tuple(sorted(self.params.splits.items()))

    def _target_version(self, request: RequestInfo, rng: random.Random) -> str | None:
        if not self._splits:
            return None
        if self.params.sticky_sessions and request.session_key is not None:
            u = stable_hash64(request.session_key) / 2.0**64
        else:
            u = rng.random()
        cumulative = 0.0
        for version, share in self._splits:
            cumulative += share
            if u < cumulative:
                return version
        return None

    def _members(self, pool: list[BackendState], version: str | None) -> tuple[str, set[int]]:
        """(reason, indices of the backends that take the request)."""
        if version is not None:
            members = {i for i, b in enumerate(pool) if b.version == version}
            if members:
                return "canary " + version, members
        split_versions = self.params.splits
        stable = {i for i, b in enumerate(pool) if b.version not in split_versions}
        if stable:
            return "stable", stable
        return "no stable backend", set(range(len(pool)))

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        pool = candidates(request, snapshot)
        if not pool:
            return Decision(ranked=(), policy=self.name, reason="no eligible backend")
        reason, members = self._members(pool, self._target_version(request, rng))
        order = order_by(load_ranks(pool))
        head = [i for i in order if i in members]
        rest = [i for i in order if i not in members]
        return Decision(ranked=ids(pool, head + rest), policy=self.name, reason=reason)
