"""Disaggregated prefill/decode (P/D): which requests split, and onto which pair.

Pure functions over ``BackendState`` (no I/O, no clock): the live gateway
(``gateway/disagg.py``) and the simulator (``sim/gateway.py``) call the same ones.

* Roles (``BackendConfig.role``, copied to ``BackendState.role``): ``prefill`` backends
  compute prompts and hold their KV for a remote decode, ``decode`` backends pull that
  KV and generate, ``both`` backends run whole requests (today's engines).
* Split rule (``should_split``): a request for a model is split when the model has a
  routable prefill backend and a routable decode backend, and either it has no routable
  ``both`` backend or the prompt has at least ``min_prompt_tokens`` tokens. Otherwise it
  runs whole (``colocated``) on a ``both`` backend. "Routable" is the policies' own
  candidate filter (healthy, not draining, positive effective and static weight).
* Unsplit order (``unsplit_order``): whole requests never go to prefill/decode-role
  backends except as failover: the policy's ranking is reordered, stably, to ``both``
  backends first, then ``decode`` backends (a decode engine can run a whole request:
  vLLM's can), then ``prefill`` backends.
* Prefill backend: the active policy restricted to role ``prefill``
  (``Router.decide(..., role="prefill")``: it sees queues and prefix caches).
* Decode backend (``rank_decode``): least KV-cache usage first (unknown or stale usage
  reads as a full cache, as in ``policies/signals.py``), then fewest in-flight
  requests, then configuration order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kiloserve.policies.base import BackendState

__all__ = [
    "ROLES",
    "DisaggConfig",
    "Role",
    "RolePools",
    "rank_decode",
    "role_pools",
    "should_split",
    "unsplit_order",
]

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
_UNSPLIT_RANK = {"both": 0, "decode": 1, "prefill": 2}


class DisaggConfig(BaseModel):
    """``disagg:`` in the gateway config (docs/gateway.md, "Disaggregated prefill/decode")."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    # prompts this long or longer are split even when the model has a ``both`` backend
    min_prompt_tokens: int = Field(default=1024, ge=0)
    # the prefill leg's time limit (prefill compute plus its answer), bounded by the
    # request's deadline; past it the next prefill backend is tried
    transfer_timeout_s: float = Field(default=60.0, gt=0.0)


@dataclass(frozen=True, slots=True)
class RolePools:
    """A model pool's routable backends by role, each in pool order."""

    prefill: tuple[BackendState, ...] = ()
    decode: tuple[BackendState, ...] = ()
    both: tuple[BackendState, ...] = ()

    @property
    def can_split(self) -> bool:
        """A routable prefill and a routable decode backend exist."""
        return bool(self.prefill) and bool(self.decode)


def _is_candidate(b: BackendState) -> bool:
    return b.healthy and not b.draining and b.effective_weight > 0.0 and b.weight > 0.0


def role_pools(pool: Iterable[BackendState]) -> RolePools:
    """Split ``pool`` (one model's backends) by role, keeping routable ones only."""
    by_role: dict[str, list[BackendState]] = {"prefill": [], "decode": [], "both": []}
    for b in pool:
        if _is_candidate(b):
            by_role.get(b.role, by_role["both"]).append(b)
    return RolePools(tuple(by_role["prefill"]), tuple(by_role["decode"]), tuple(by_role["both"]))


def should_split(pools: RolePools, input_tokens: int, cfg: DisaggConfig) -> bool:
    """True when the request runs as a prefill leg plus a decode leg (module docstring)."""
    if not cfg.enabled or not pools.can_split:
        return False
    return not pools.both or input_tokens >= cfg.min_prompt_tokens


def _kv_usage(b: BackendState) -> float:
    usage = b.kv_usage
    if b.scrape_stale or usage is None:
        return 1.0  # unknown reads as full, never as idle
    return min(max(usage, 0.0), 1.0)


def rank_decode(decode: Sequence[BackendState]) -> tuple[str, ...]:
    """Decode backends best first: least KV usage, then fewest in-flight, then order."""
    order = sorted(range(len(decode)), key=lambda i: (_kv_usage(decode[i]), decode[i].in_flight, i))
    return tuple(decode[i].backend_id for i in order)


def unsplit_order(ranked: Sequence[str], role_of: Callable[[str], str]) -> tuple[str, ...]:
    """``ranked`` reordered (stably) for a whole request: ``both``, ``decode``, ``prefill``."""
    return tuple(sorted(ranked, key=lambda b: _UNSPLIT_RANK.get(role_of(b), 0)))
