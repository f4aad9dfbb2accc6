"""The simulated gateway: the live gateway's ``Router`` driven in simulated time.

Routing itself is not simulated: decisions, the pool and health filter, the hooks and
the TTFT/TPOT ``Outcome`` are the gateway's own code (``kiloserve.routing.router``
over a ``kiloserve.routing.table.BackendTable``, and the engines' KV events through
the gateway's ``KvEventCache``: ``sim.kvevents``). What is simulated here is only what
has no HTTP to come from: the request profile (what the bench client's completions
request profiles to: input tokens, ``max_tokens`` as the predicted output since the
client sends it, the ``user`` as session key and tenant, prefix hashes over the first
``max_prefix_tokens`` tokens), the times (simulated seconds), and the scrapes (the
simulated engines' state copied into the table every scrape interval).
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Mapping, Sequence

from kiloserve.errors import ConfigError
from kiloserve.gateway.config import GatewayConfig
from kiloserve.policies.base import BackendState, Policy, RequestInfo
from kiloserve.routing.disagg import Role, rank_decode, role_pools, should_split
from kiloserve.routing.router import Router
from kiloserve.routing.table import BackendRecord, BackendTable
from kiloserve.sim.backend import SimBackend
from kiloserve.sim.cluster import scrape_into
from kiloserve.sim.demotion import SimDemotion
from kiloserve.sim.disagg import SimDisagg
from kiloserve.sim.kvevents import SimKvEvents
from kiloserve.sim.request import DECODE_LEG, PREFILL_LEG, WHOLE, SimRequest
from kiloserve.sim.sequence import SimSequence
from kiloserve.workload import RequestSpec

__all__ = ["ModelPicker", "SimGateway"]


class ModelPicker:
    """Which served model each request asks for: one fixed model, or a draw weighted
    by each pool's number of GPUs (seeded, so every run draws the same sequence)."""

    def __init__(self, gpu_shares: dict[str, float], model: str | None, seed: int) -> None:
        if model is not None and model not in gpu_shares:
            valid = ", ".join(gpu_shares)
            raise ConfigError(f"no backend serves model {model!r}; served: {valid}")
        self._models = [model] if model is not None else list(gpu_shares)
        weights = [1.0] if model is not None else list(gpu_shares.values())
        total = sum(weights)
        self._cumulative = list(itertools.accumulate(w / total for w in weights))
        self._rng = random.Random(seed * 7919 + 17)

    def pick(self) -> str:
        if len(self._models) == 1:
            return self._models[0]
        index = bisect.bisect_right(self._cumulative, self._rng.random())
        return self._models[min(index, len(self._models) - 1)]


class SimGateway:
    """Gateway state for one simulation: backend table, policy and its RNG."""

    def __init__(
        self,
        cfg: GatewayConfig,
        policy: Policy,
        backends: Sequence[SimBackend],
        *,
        seed: int,
        kv_events: SimKvEvents | None = None,
        disagg: SimDisagg | None = None,
    ) -> None:
        self.cfg = cfg
        self.disagg = disagg  # the split counts of a cluster with P/D pools (sim.disagg)
        self.table = BackendTable(cfg)
        self.kv_events = kv_events  # the engines' KV events, delivered before each decision
        if kv_events is not None:
            self.table.kv_cache = kv_events.cache
        self.router = Router(self.table, policy, random.Random(seed), block_size=cfg.block_size)
        self.backends = backends
        self._index_of = {b.backend_id: b.index for b in backends}
        self._records = [self.table.record(b.backend_id) for b in backends]
        # the prompt's block hashes, for a policy that reads them (policies/protocol.py)
        reads = getattr(policy, "reads_prefix_hashes", True)
        self._num_prefix_blocks = cfg.max_prefix_tokens // cfg.block_size if reads else 0
        # each model's candidates; None after a scrape changed a backend's health (the
        # only way health changes here: no admin drains or probes are modelled; demotion
        # changes weights, which the candidates read live)
        self._candidates: dict[str, tuple[BackendState, ...]] | None = None
        self.num_dead = 0  # backends whose engine is down (kept by the simulator's faults)
        # the last decision's prefix matches (``route`` keeps them on the request, for
        # the per-attempt accounting of the tokens expected cached, as the proxy does)
        self.last_cached_blocks: Mapping[str, int] | None = None
        # the gateway's slow-node demotion (sim.demotion), on when the config has it on
        self.demotion = SimDemotion(cfg.demotion, self.table) if cfg.demotion.enabled else None
        # prefill/decode-role backends exist: requests may split (routing/disagg.py)
        self.has_roles = self.table.has_roles

    def pools_changed(self) -> None:
        """A backend's models changed (a LoRA adapter placed: sim.lora)."""
        self._candidates = None

    def profile(self, spec: RequestSpec, model: str, seq: SimSequence) -> RequestInfo:
        """The profile the gateway builds for the bench client's request for ``spec``."""
        return RequestInfo(
            request_id=spec.request_id,
            model=model,
            input_tokens=seq.num_prompt_tokens,
            predicted_output_tokens=spec.output_tokens,
            max_tokens=spec.output_tokens,
            session_key=spec.user,
            prefix_hashes=seq.prefix_hashes(self._num_prefix_blocks),
            tenant=spec.user,
        )

    def candidates(self, now_s: float) -> dict[str, tuple[BackendState, ...]]:
        """Each model's routable backends (rebuilt after a health change)."""
        if self._candidates is None:
            table = self.table
            snapshot = table.snapshot(now_s)
            self._candidates = {
                model: tuple(b for b in snapshot.pool(model) if b.is_routable and b.weight > 0.0)
                for model in table.served_models()
            }
        return self._candidates

    def decide(self, info: RequestInfo, now_s: float, role: Role | None = None) -> tuple[int, ...]:
        """Backend indices to try, best first (at most ``retries + 1``); ``role``: among
        that role's backends only (a split request's prefill leg)."""
        if self.kv_events is not None:
            self.kv_events.deliver()
        decision = self.router.decide(
            info,
            now_s,
            eligible_by_model=self.candidates(now_s),
            limit=self.cfg.retries + 1,  # the proxy tries at most retries + 1 backends
            role=role,
        )
        self.last_cached_blocks = decision.cached_blocks
        index_of = self._index_of
        return tuple([index_of[backend_id] for backend_id in decision.ranked])

    def route(self, request: SimRequest, now_s: float) -> None:
        """``decide`` for ``request``: its ranked backends and the decision's matches.

        With prefill/decode-role backends, as the live gateway (``gateway/disagg.py``,
        ``plan_split``): a request the split rule splits gets the policy's ranking of
        the prefill backends for its prefill leg (max_tokens 1) and, taken now, the
        decode backends' ``rank_decode`` order (a fallback's after failed prefill legs;
        ``route_decode`` ranks them again for the decode leg); one the rule keeps
        whole counts as ``colocated`` when its model has such backends.
        """
        info = request.info
        if self.has_roles:
            pools = role_pools(self.candidates(now_s).get(info.model, ()))
            if pools.prefill or pools.decode:
                if should_split(pools, info.input_tokens, self.cfg.disagg):
                    prefill_info = info.replaced(max_tokens=1, predicted_output_tokens=1)
                    ranked = self.decide(prefill_info, now_s, role="prefill")
                    if ranked:
                        request.leg, request.ranked = PREFILL_LEG, ranked
                        request.info = prefill_info
                        request.cached_blocks = self.last_cached_blocks
                        index_of = self._index_of
                        decode = rank_decode(pools.decode)
                        request.decode_ranked = tuple([index_of[b] for b in decode])
                        return
                if self.disagg is not None:
                    self.disagg.num_colocated += 1
        request.ranked = self.decide(info, now_s)
        request.cached_blocks = self.last_cached_blocks

    def route_decode(self, request: SimRequest, now_s: float) -> None:
        """A split request's decode leg, over the decode backends ranked now, when the
        prefill answer is in (at most ``retries + 1``; the arrival's ranking when none
        is routable), as the live gateway: decode legs sent meanwhile count. The
        transferred prompt (all but the last token) counts as cached there, in whole
        blocks, as the live gateway counts it."""
        request.attempt = 0
        request.leg = DECODE_LEG
        request.info = request.profile
        pools = role_pools(self.candidates(now_s).get(request.profile.model, ()))
        if pools.decode:
            index_of = self._index_of
            request.decode_ranked = tuple([index_of[b] for b in rank_decode(pools.decode)])
        request.ranked = request.decode_ranked[: self.cfg.retries + 1]
        num_blocks = max(0, request.profile.input_tokens - 1) // self.cfg.block_size
        backends = self.backends
        request.cached_blocks = {backends[i].backend_id: num_blocks for i in request.ranked}

    def route_fallback(
        self, request: SimRequest, now_s: float, first: tuple[int, ...], skip: tuple[int, ...]
    ) -> None:
        """A split request whose prefill legs (or decode legs) all failed: the whole
        request to ``first``, then the unsplit ranking, leaving out ``skip`` when that
        leaves any (the live gateway's ``fallback``)."""
        request.attempt = 0
        request.leg = WHOLE
        request.info = request.profile
        decided = self.decide(request.profile, now_s)
        request.cached_blocks = self.last_cached_blocks
        ordered = tuple(dict.fromkeys([i for i in (*first, *decided) if i not in skip]))
        request.ranked = (ordered or decided or first)[: self.cfg.retries + 1]

    def dispatch(self, request: SimRequest, now_s: float) -> str:
        backend_id = self.backends[request.backend_index].backend_id
        request.attempt_start_s = now_s
        request.first_token_s = None
        request.gateway_first_token_s = None
        request.info = self.router.attempt_info(request.info, request.cached_blocks, backend_id)
        self.router.dispatch(backend_id, request.info)
        return backend_id

    def first_token(self, request: SimRequest, now_s: float) -> None:
        request.gateway_first_token_s = now_s
        ttft_ms = (now_s - request.attempt_start_s) * 1000.0
        backend_id = self.backends[request.backend_index].backend_id
        self.router.first_token(backend_id, request.info, ttft_ms)
        if self.demotion is not None:
            self.demotion.on_first_token(backend_id, now_s, ttft_ms)

    def complete(self, request: SimRequest, status: int, now_s: float) -> None:
        """Account the end of the current attempt (``status`` 200: success)."""
        backend_id = self.backends[request.backend_index].backend_id
        outcome = self.router.complete(
            backend_id, request.info, ok=status == 200, status=status,
            started_s=request.attempt_start_s, first_token_s=request.gateway_first_token_s,
            last_token_s=now_s,
            output_tokens=(request.info.max_tokens or 0) if status == 200 else 0,
        )  # fmt: skip
        if outcome.ok and self.demotion is not None:
            self.demotion.on_complete(backend_id, now_s, outcome.tpot_ms)

    def scrape(self, now_s: float) -> None:
        """One scrape round over every backend, then the staleness rule.

        A live backend whose engine has not changed since its last good scrape would
        only have its scrape time moved. While every backend is alive and nothing can
        go stale between rounds, nothing reads that time, so only the backends that
        changed (``SimBackend.changed``) are visited; otherwise every one is.
        """
        table, backends = self.table, self.backends
        if self.demotion is not None:
            self.demotion.maybe_tick(now_s)
        changed = backends[0].changed if backends else set()
        if self.num_dead == 0 and self.cfg.stale_after_s >= self.cfg.scrape_interval_s:
            for index in sorted(changed):
                self._scrape_one(self._records[index], backends[index], now_s)
            changed.clear()
            return
        changed.clear()
        for backend, record in zip(backends, self._records, strict=True):
            self._scrape_one(record, backend, now_s)  # unchanged ones: only the time moves
        table.refresh_staleness(now_s)

    def _scrape_one(self, record: BackendRecord, backend: SimBackend, now_s: float) -> None:
        was_healthy = record.state.healthy
        scrape_into(self.table, record, backend, now_s)
        if record.state.healthy != was_healthy:
            self._candidates = None
