"""The routing contract shared by the live gateway and the simulator.

A policy is a pure function of ``(request, snapshot, rng)`` returning a ranked
``Decision``: no I/O, no clock, no global random. Policies that need memory (round
robin's cursor, prefix affinity's index) keep it on the policy object and update it
only in the ``on_dispatch`` / ``on_complete`` hooks, never while choosing.

The gateway builds ``ClusterSnapshot`` from scraped engine metrics plus its own live
counters; the simulator builds the same object from simulated engines.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Final

from kiloserve.policies.protocol import Policy  # pure module: see its docstring
from kiloserve.values import Value

if TYPE_CHECKING:
    from kiloserve.kvevents.feed import KvEventCache

__all__ = [
    "BackendState",
    "ClusterSnapshot",
    "Decision",
    "Outcome",
    "Policy",
    "RequestInfo",
    "eligible",
]


class RequestInfo(Value):
    """The request profile (S1.1) a policy sees."""

    _FIELDS: ClassVar[tuple[str, ...]] = (
        "request_id",
        "model",
        "input_tokens",
        "predicted_output_tokens",
        "max_tokens",
        "session_key",
        "prefix_hashes",
        "priority",
        "tenant",
        "cached_tokens",
    )
    __slots__ = _FIELDS

    def __init__(
        self,
        request_id: str,
        model: str,
        input_tokens: int,
        predicted_output_tokens: int,
        max_tokens: int | None = None,
        session_key: str | None = None,
        prefix_hashes: tuple[int, ...] = (),
        priority: int = 0,
        tenant: str | None = None,
        cached_tokens: int = 0,
    ) -> None:
        self.request_id: Final = request_id
        self.model: Final = model
        self.input_tokens: Final = input_tokens
        self.predicted_output_tokens: Final = predicted_output_tokens
        self.max_tokens: Final = max_tokens
        self.session_key: Final = session_key
        self.prefix_hashes: Final = prefix_hashes
        self.priority: Final = priority
        self.tenant: Final = tenant
        # prompt tokens expected cached on the backend of one attempt (the decision's
        # ``cached_blocks``): set per attempt by the caller; 0 while deciding
        self.cached_tokens: Final = cached_tokens

    def with_admission(self, priority: int, tenant: str | None) -> RequestInfo:
        """A copy with the admission layer's priority and tenant."""
        return self.replaced(priority=priority, tenant=tenant)


@dataclass(slots=True)
class BackendState:
    """Everything known about one backend at snapshot time. ``None`` means unknown."""

    # static, from config or discovery
    backend_id: str
    url: str = ""
    models: frozenset[str] = frozenset()
    gpu: str = ""
    group: str = ""
    version: str = ""
    cost_per_hour: float = 0.0
    weight: float = 1.0
    kv_capacity_tokens: int | None = None
    role: str = "both"  # prefill | decode | both: disaggregated serving (routing/disagg.py)
    max_num_seqs: int | None = None
    # effective prefill TFLOPS of the replica (GPU type's dense BF16 TFLOPS x prefill
    # MFU x TP, from the catalog: routing/table.py); None when the GPU is not in the
    # catalog. The ``ttft`` scorer's prior for a young backend's prefill speed.
    prefill_capability: float | None = None
    # health (fault-tolerance layer)
    healthy: bool = True
    draining: bool = False
    effective_weight: float = 1.0
    # scraped from the engine's /metrics; stale scrapes are marked, never read as idle
    num_running: int | None = None
    num_waiting: int | None = None
    kv_usage: float | None = None
    prefix_hit_rate: float | None = None
    pcie_util: float | None = None
    scrape_stale: bool = False
    # gateway-local live counters, updated at dispatch and completion
    in_flight: int = 0
    outstanding_prefill_tokens: int = 0
    outstanding_decode_tokens: int = 0
    ewma_ttft_ms: float | None = None
    ewma_tpot_ms: float | None = None
    ewma_prefill_work_tokens: float | None = None
    num_ttft_samples: int = 0  # first tokens seen (the learned speed needs a few)
    consecutive_errors: int = 0
    # the live admission controller's grants here (gateway/admission/controller.py):
    # requests granted and not done, the KV tokens they reserved, and the part of it
    # not yet sent (the engine's own counters do not show it yet)
    admitted_in_flight: int = 0
    reserved_tokens: int = 0
    undispatched_tokens: int = 0

    @property
    def is_routable(self) -> bool:
        return self.healthy and not self.draining and self.effective_weight > 0.0

    @property
    def outstanding_tokens(self) -> int:
        return self.outstanding_prefill_tokens + self.outstanding_decode_tokens


@dataclass(slots=True)
class ClusterSnapshot:
    """A read-only view of the cluster for one decision. Policies must not mutate it."""

    now_s: float
    backends: tuple[BackendState, ...]
    _by_model: dict[str, tuple[BackendState, ...]] = field(default_factory=dict, repr=False)
    # Optional: each model's candidates (``signals.candidates``: eligible, static weight
    # > 0), precomputed by a caller that sees every change of the health fields and
    # weights (the simulator's gateway); None: filtered per decision.
    eligible_by_model: dict[str, tuple[BackendState, ...]] | None = field(default=None, repr=False)
    # The engines' own prefix caches, from their KV events (exact for the backends in
    # ``kv_cache.exact_backends``); None when no backend publishes events.
    kv_cache: KvEventCache | None = field(default=None, repr=False)

    def pool(self, model: str) -> tuple[BackendState, ...]:
        """Every backend serving ``model`` (healthy or not), in snapshot order."""
        hit = self._by_model.get(model)
        if hit is None:
            hit = tuple(b for b in self.backends if model in b.models)
            self._by_model[model] = hit
        return hit

    def get(self, backend_id: str) -> BackendState | None:
        for b in self.backends:
            if b.backend_id == backend_id:
                return b
        return None


class Decision(Value):
    """Ranked backend ids, best first: ``ranked[0]`` is the pick, the rest fallbacks.

    An empty ``ranked`` means no backend can take the request (the gateway answers 503).
    ``cached_blocks``: for prefix-aware policies, the leading prompt blocks each backend
    was found to hold (absent: none); the gateway reports the chosen one's.
    """

    _FIELDS: ClassVar[tuple[str, ...]] = ("ranked", "policy", "reason", "scores", "cached_blocks")
    __slots__ = _FIELDS

    def __init__(
        self,
        ranked: tuple[str, ...],
        policy: str,
        reason: str = "",
        scores: Mapping[str, float] | None = None,
        cached_blocks: Mapping[str, int] | None = None,
    ) -> None:
        self.ranked: Final = ranked
        self.policy: Final = policy
        self.reason: Final = reason
        self.scores: Final = scores
        self.cached_blocks: Final = cached_blocks

    def __hash__(self) -> int:  # scores may be a dict: hash the ranking alone
        return hash((self.ranked, self.policy, self.reason))

    @property
    def backend_id(self) -> str | None:
        return self.ranked[0] if self.ranked else None

    def with_ranked(self, ranked: tuple[str, ...]) -> Decision:
        """``replaced(ranked=ranked)`` without the generic path (field names, ``getattr``,
        keyword arguments: ~11,000 instructions a call in the compiled simulator; the
        router makes one per decision). Constructor parameters follow ``_FIELDS``."""
        return type(self)(ranked, self.policy, self.reason, self.scores, self.cached_blocks)


class Outcome(Value):
    """What happened to a dispatched request, for ``on_complete`` hooks."""

    _FIELDS: ClassVar[tuple[str, ...]] = ("ok", "status", "ttft_ms", "tpot_ms", "output_tokens")
    __slots__ = _FIELDS

    def __init__(
        self,
        ok: bool,
        status: int = 200,
        ttft_ms: float | None = None,
        tpot_ms: float | None = None,
        output_tokens: int = 0,
    ) -> None:
        self.ok: Final = ok
        self.status: Final = status
        self.ttft_ms: Final = ttft_ms
        self.tpot_ms: Final = tpot_ms
        self.output_tokens: Final = output_tokens


def eligible(request: RequestInfo, snapshot: ClusterSnapshot) -> list[BackendState]:
    """The one shared filter: backends serving the request's model that are healthy,
    not draining and carry a positive effective weight, in snapshot order."""
    return [b for b in snapshot.pool(request.model) if b.is_routable]


def rank_rest(first: Iterable[str], pool: Iterable[BackendState]) -> tuple[str, ...]:
    """``first`` followed by every other backend of ``pool`` in pool order (fallbacks)."""
    head = list(first)
    seen = set(head)
    return tuple(head + [b.backend_id for b in pool if b.backend_id not in seen])
