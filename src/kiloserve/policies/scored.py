"""Scored: filter -> weighted scorers -> picker (llm-d style), composed from YAML.

Algorithm: candidates are ``signals.candidates``. Each configured scorer
(``scorers.SCORERS``: queue, tokens, kv, prefix, latency, session, weight, ttft) gives every
candidate a score in [0, 1]; the total is ``sum(weight_k * score_k) / sum(weight_k)``,
so it is in [0, 1] too. Pickers:

* ``max``: highest total; equal top totals are broken with one ``rng`` draw (at idle
  every backend ties: snapshot order would send every request to the first one).
  Ranked by descending total.
* ``weighted_random``: probability proportional to the total (one ``rng.random()``);
  all totals 0 falls back to least load. Fallbacks by descending total.

Example: ``{"scorers": {"queue": 1.0, "kv": 1.0, "prefix": 2.0, "latency": 0.5},
"picker": "max"}``. Scorer weights must be >= 0 with at least one > 0; zero-weight
scorers are not run. Cached prefixes come from the engines' own KV events for the
backends whose event stream is in order (exact), else from a ``PrefixIndex`` of what
this gateway sent where, updated in ``on_dispatch`` (same bounds as
``prefix_affinity``: 174,000 blocks, 8 holders per block, 1024 blocks per request);
prefix scoring stops below ``min_prompt_tokens`` (512). The session scorer hashes the
session key onto the pool's groups (``num_vnodes`` 64) without load bounds: the load
scorers bound it.

Sticky until saturated (``sticky``, on by default; llm-d's precise prefix routing):
when some candidate holds at least ``sticky_min_tokens`` (256) of the prompt, the
request goes to the deepest holder (several: the best total among them) unless that
backend is saturated: its engine queues ``sticky_max_waiting`` (4) requests or more,
its KV cache is ``sticky_max_kv_usage`` (0.8) full, its predicted time to first token
(the ``ttft`` scorer's, cached blocks credited) is over ``sticky_ttft_slack`` (1.25)
times the best candidate's, or its request load (``signals`` rules; unknown scraped
load counts as its in-flight requests) exceeds the pool's least by more than
``sticky_abs_load`` (2 per unit of capacity weight) and by the factor
``sticky_rel_load`` (1.5), and the pool's mean by more than ``sticky_abs_load``.
Then the scores decide.
A prefix hit saves the whole cached prefill, which no load score weighs; the guard
keeps one hot prefix from piling onto one backend. Docs: docs/policies.md.
"""

from __future__ import annotations

import bisect
import random
from itertools import accumulate
from typing import Literal, cast

from pydantic import Field, field_validator

from kiloserve.policies.base import BackendState, ClusterSnapshot, Decision, Outcome, RequestInfo
from kiloserve.policies.defaults import DEFAULT_PICKER, DEFAULT_SCORER_WEIGHTS
from kiloserve.policies.hash_ring import RingCache, group_name, stable_hash64
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.prefix_index import DEFAULT_MAX_NUM_BLOCKS, PrefixIndex, cached_depths
from kiloserve.policies.ranking import least_load_order, rank_by_keys
from kiloserve.policies.scorers import SCORERS, ScorerName, ScoringContext
from kiloserve.policies.signals import UNKNOWN_LOAD_OFFSET, candidates, load_ranks

__all__ = ["ScoredParams", "ScoredPolicy"]


def _default_scorers() -> dict[ScorerName, float]:
    return {cast(ScorerName, k): w for k, w in DEFAULT_SCORER_WEIGHTS.items()}


class ScoredParams(PolicyParams):
    scorers: dict[ScorerName, float] = Field(default_factory=_default_scorers)
    picker: Literal["max", "weighted_random"] = DEFAULT_PICKER
    latency_metric: Literal["ttft", "tpot"] = "ttft"
    min_prompt_tokens: int = Field(default=512, ge=0)
    max_num_blocks: int = Field(default=DEFAULT_MAX_NUM_BLOCKS, ge=1)
    max_num_holders_per_block: int = Field(default=8, ge=1)
    max_num_blocks_per_request: int = Field(default=1024, ge=1)
    num_vnodes: int = Field(default=64, ge=1, le=4096)
    block_size: int = Field(default=16, ge=1)
    include_scores: bool = False
    sticky: bool = True
    sticky_min_tokens: int = Field(default=256, ge=1)
    sticky_max_waiting: int = Field(default=4, ge=1)
    sticky_abs_load: float = Field(default=2.0, ge=0.0)
    sticky_rel_load: float = Field(default=1.5, ge=1.0)
    sticky_ttft_slack: float = Field(default=1.25, ge=1.0)
    sticky_max_kv_usage: float = Field(default=0.8, ge=0.0, le=1.0)

    @field_validator("scorers")
    @classmethod
    def _weights_valid(cls, scorers: dict[str, float]) -> dict[str, float]:
        for scorer, weight in scorers.items():
            if weight < 0.0:
                raise ValueError(f"weight of scorer {scorer!r} must be >= 0, got {weight}")
        if not any(w > 0.0 for w in scorers.values()):
            raise ValueError("at least one scorer needs a positive weight")
        return scorers


class ScoredPolicy:
    def __init__(self, params: ScoredParams | None = None, name: str = "scored") -> None:
        self.name = name
        self.params = p = params or ScoredParams()
        active = {k: w for k, w in p.scorers.items() if w > 0.0}
        self._scorers = tuple((SCORERS[k], w) for k, w in active.items())
        self._total_weight = sum(active.values())
        self.index: PrefixIndex | None = None
        if "prefix" in active or "ttft" in active:
            self.index = PrefixIndex(p.max_num_blocks, p.max_num_holders_per_block)
        self._rings = RingCache(p.num_vnodes) if "session" in active else None
        self.reads_prefix_hashes = self.index is not None  # (Policy's optional attribute)

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        pool = candidates(request, snapshot)
        if not pool:
            return Decision(ranked=(), policy=self.name, reason="no eligible backend")
        ctx = self._context(request, snapshot, pool)
        totals = self.totals(ctx)
        scores = None
        if self.params.include_scores:
            scores = {b.backend_id: t for b, t in zip(pool, totals, strict=True)}
        by_total = rank_by_keys(pool, [-t for t in totals])
        sticky = self._sticky_target(ctx, totals) if self.params.sticky else None
        if sticky is not None:
            first = pool[sticky].backend_id
            ranked = (first, *[bid for bid in by_total if bid != first])
            decision = Decision(ranked, self.name, "prefix", scores)
        elif self.params.picker == "max":
            decision = self._max(pool, totals, by_total, rng, scores)
        else:
            decision = self._weighted_random(pool, totals, by_total, rng, scores)
        if ctx.num_prefix_blocks:
            return decision.replaced(cached_blocks=ctx.prefix_depths)
        return decision

    def _max(
        self,
        pool: list[BackendState],
        totals: list[float],
        by_total: tuple[str, ...],
        rng: random.Random,
        scores: dict[str, float] | None,
    ) -> Decision:
        """Highest total first; equal top totals broken by one ``rng`` draw."""
        top = max(totals)
        tied = [i for i, t in enumerate(totals) if t == top]
        if len(tied) == 1:
            return Decision(ranked=by_total, policy=self.name, scores=scores)
        first = pool[tied[rng.randrange(len(tied))]].backend_id
        ranked = (first, *[bid for bid in by_total if bid != first])
        return Decision(ranked=ranked, policy=self.name, reason="tie", scores=scores)

    def _sticky_target(self, ctx: ScoringContext, totals: list[float]) -> int | None:
        """Index of the deepest prefix holder if it is not saturated (see module doc)."""
        depths = ctx.prefix_depths
        if not depths:
            return None
        p, pool = self.params, ctx.pool
        best_depth = max(depths.get(b.backend_id, 0) for b in pool)
        if best_depth * p.block_size < p.sticky_min_tokens:
            return None
        warm = [i for i, b in enumerate(pool) if depths.get(b.backend_id, 0) == best_depth]
        target = max(warm, key=totals.__getitem__)  # ties: snapshot order
        b = pool[target]
        if not b.scrape_stale:
            waiting, usage = b.num_waiting, b.kv_usage
            if waiting is not None and waiting >= p.sticky_max_waiting:
                return None
            if usage is not None and usage >= p.sticky_max_kv_usage:
                return None
        # best predicted TTFT / the target's (the scorer reads an unknown scrape as
        # saturated, so without metrics only the in-flight load below guards)
        if not b.scrape_stale and b.kv_usage is not None:
            ttft = SCORERS["ttft"](ctx)[target]
            if ttft * p.sticky_ttft_slack < 1.0:
                return None
        loads = [
            x - UNKNOWN_LOAD_OFFSET if x >= UNKNOWN_LOAD_OFFSET else x for x in load_ranks(pool)
        ]
        load, least = loads[target], min(loads)
        # and over its share (the mean): a holder running a few more requests than the
        # pool's average is not saturated, even while one backend happens to be idle
        if (
            load - least > p.sticky_abs_load
            and load > least * p.sticky_rel_load
            and load - sum(loads) / len(loads) > p.sticky_abs_load
        ):
            return None
        return target

    def totals(self, ctx: ScoringContext) -> list[float]:
        """Weighted mean score of every candidate in ``ctx.pool``."""
        columns = [(weight, scorer(ctx)) for scorer, weight in self._scorers]
        norm = self._total_weight
        if len(columns) == 4:  # the default's four scorers in one pass, same float order
            (w0, s0), (w1, s1), (w2, s2), (w3, s3) = columns
            return [
                (0.0 + w0 * a + w1 * b + w2 * c + w3 * d) / norm
                for a, b, c, d in zip(s0, s1, s2, s3, strict=True)
            ]
        totals = [0.0] * len(ctx.pool)
        for weight, scores in columns:
            totals = [t + weight * s for t, s in zip(totals, scores, strict=True)]
        return [t / norm for t in totals]

    def _weighted_random(
        self,
        pool: list[BackendState],
        totals: list[float],
        by_total: tuple[str, ...],
        rng: random.Random,
        scores: dict[str, float] | None,
    ) -> Decision:
        cumulative = list(accumulate(totals))
        if cumulative[-1] <= 0.0:
            return Decision(least_load_order(pool), self.name, "all scores zero", scores)
        index = bisect.bisect_right(cumulative, rng.random() * cumulative[-1])
        if index >= len(pool):
            index = bisect.bisect_left(cumulative, cumulative[-1])
        first = pool[index].backend_id
        ranked = (first, *[bid for bid in by_total if bid != first])
        return Decision(ranked=ranked, policy=self.name, scores=scores)

    def _context(
        self, request: RequestInfo, snapshot: ClusterSnapshot, pool: list[BackendState]
    ) -> ScoringContext:
        p = self.params
        ctx = ScoringContext(
            request=request, pool=pool, latency_metric=p.latency_metric, block_size=p.block_size
        )
        hashes = request.prefix_hashes[: p.max_num_blocks_per_request]
        if self.index is not None and hashes and request.input_tokens >= p.min_prompt_tokens:
            ctx.prefix_depths = cached_depths(self.index, snapshot, hashes, request.input_tokens)
            ctx.num_prefix_blocks = len(hashes)
        if self._rings is not None and request.session_key is not None:
            ctx.session_group = self._session_group(request, snapshot, pool)
        return ctx

    def _session_group(
        self, request: RequestInfo, snapshot: ClusterSnapshot, pool: list[BackendState]
    ) -> str | None:
        if self._rings is None or request.session_key is None:
            return None
        ring = self._rings.pool_ring(snapshot, request.model)
        live = {group_name(b) for b in pool}
        for name in ring.walk(stable_hash64(request.session_key)):
            if name in live:
                return name
        return None

    def on_dispatch(self, request: RequestInfo, backend_id: str) -> None:
        hashes = request.prefix_hashes[: self.params.max_num_blocks_per_request]
        if self.index is not None and hashes:
            self.index.insert(hashes, backend_id)

    def on_complete(self, request: RequestInfo, backend_id: str, outcome: Outcome) -> None:
        return None
