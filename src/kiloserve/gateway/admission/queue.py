"""Gateway-side admission queues (S2.2-S2.4): pure logic, time passed in.

One ``PoolQueue`` per model pool holds the requests that found no backend with room.
It is bounded per lane (a full lane raises ``QueueFullError``, answered 429) and in
wait time (``expire`` hands back the requests past their deadline, answered 503).

Order of release, best first (``pick``):

* **priority** (larger is more urgent): ``strict`` serves the highest class first, with
  ageing (+1 class per ``ageing_s`` waited, up to the highest class waiting: with one
  class, ageing never reorders the lanes); ``weighted`` shares releases between
  classes in proportion to ``priority_weights`` (stride scheduling);
* **lane** (S2.3): short prompts (< ``short_max_tokens``) before medium before long
  (> ``long_min_tokens``); each lane has its own bound, so a burst of long requests
  can never fill the short lane, and a short request never waits behind a long one
  that does not fit;
* **tenant fair share**: within a lane, the tenant that has been served the fewest
  KV tokens (virtual time, weighted by ``tenant_weights``) goes first, so one tenant's
  burst cannot starve another;
* **memory-budget windows** (S2.2, ``window_s`` > 0): arrivals are held until their
  window closes, then released smallest memory need first while budget remains; what
  does not fit waits for the next window (``hold_leftovers``).

A request is released only if ``fits`` says some backend has room; a smaller one may
pass a larger one that does not fit, except that once a request has waited
``starvation_s`` only shorter prompts may pass it (so short requests are never stuck
behind a long one, and a starving request is passed by nothing at least its size;
under sustained overload a long request may still wait until ``max_queue_wait_s``
and be answered 503: overload falls on long requests, not short ones).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kiloserve.errors import QueueFullError
from kiloserve.gateway.admission.capacity import CapacityConfig

__all__ = [
    "LANES",
    "AdmissionConfig",
    "InputLimits",
    "PoolQueue",
    "Waiter",
    "lane_of",
]

Lane = Literal["short", "medium", "long"]
LANES: tuple[Lane, ...] = ("short", "medium", "long")
_LANE_RANK = {lane: i for i, lane in enumerate(LANES)}


class InputLimits(BaseModel):
    """Input limits (400 naming the limit when exceeded); body size is ``max_body_bytes``."""

    model_config = ConfigDict(extra="forbid")

    max_context_tokens: int | None = Field(default=None, ge=1)
    model_context_tokens: dict[str, int] = Field(default_factory=dict)
    max_output_tokens: int | None = Field(default=None, ge=1)


class AdmissionConfig(BaseModel):
    """The ``admission`` config section. ``enabled: false`` keeps today's behaviour."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    max_queue_len: int = Field(default=256, ge=0)
    max_queue_wait_s: float = Field(default=30.0, gt=0.0)
    retry_after_s: int = Field(default=1, ge=1)
    short_max_tokens: int = Field(default=128, ge=1)
    long_min_tokens: int = Field(default=1024, ge=1)
    window_s: float = Field(default=0.0, ge=0.0)
    priority_mode: Literal["strict", "weighted"] = "strict"
    priority_weights: dict[int, float] = Field(default_factory=dict)
    priority_header: str = "x-kiloserve-priority"
    ageing_s: float = Field(default=2.0, ge=0.0)
    starvation_s: float = Field(default=5.0, gt=0.0)
    tenant_weights: dict[str, float] = Field(default_factory=dict)
    tick_s: float = Field(default=0.01, gt=0.0)
    capacity: CapacityConfig = Field(default_factory=CapacityConfig)
    limits: InputLimits = Field(default_factory=InputLimits)


def lane_of(input_tokens: int, cfg: AdmissionConfig) -> Lane:
    if input_tokens < cfg.short_max_tokens:
        return "short"
    if input_tokens > cfg.long_min_tokens:
        return "long"
    return "medium"


@dataclass(slots=True, eq=False)
class Waiter:
    """One queued request. ``ticket`` is opaque to the queue (the async layer's future)."""

    request_id: str
    need_tokens: int
    input_tokens: int
    priority: int
    tenant: str
    enqueued_s: float
    deadline_s: float
    eligible_s: float
    lane: Lane = "medium"
    ticket: object = None
    backend_id: str | None = field(default=None)


class _Fairness:
    """Per-tenant virtual time (start-time fair queueing over KV tokens served)."""

    def __init__(self, weights: dict[str, float], max_num_tenants: int = 10_000) -> None:
        self._weights = weights
        self._vtime: dict[str, float] = {}
        self._vclock = 0.0
        self._max_num_tenants = max_num_tenants

    def vtime(self, tenant: str) -> float:
        return self._vtime.get(tenant, self._vclock)

    def on_arrival(self, tenant: str, is_first_queued: bool) -> None:
        """A tenant that (re)joins the queue starts at the clock: no banked credit."""
        if is_first_queued:
            self._vtime[tenant] = max(self._vtime.get(tenant, 0.0), self._vclock)
        if len(self._vtime) > self._max_num_tenants:
            clock = self._vclock
            self._vtime = {t: v for t, v in self._vtime.items() if v > clock}

    def on_release(self, tenant: str, need_tokens: int) -> None:
        start = self.vtime(tenant)
        self._vclock = max(self._vclock, start)
        self._vtime[tenant] = start + need_tokens / self._weights.get(tenant, 1.0)


class PoolQueue:
    """The bounded admission queue of one model pool."""

    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self._waiters: list[Waiter] = []
        self._num_by_lane: dict[Lane, int] = dict.fromkeys(LANES, 0)
        self._num_by_tenant: dict[str, int] = {}
        self._fair = _Fairness(cfg.tenant_weights)
        self._class_pass: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self._waiters)

    def depth(self, lane: Lane) -> int:
        return self._num_by_lane[lane]

    def waiters(self) -> list[Waiter]:
        return list(self._waiters)

    def window_end(self, now_s: float) -> float:
        """When a request arriving at ``now_s`` may first be released."""
        w = self.cfg.window_s
        return now_s if w <= 0.0 else (math.floor(now_s / w) + 1) * w

    def hold_leftovers(self, now_s: float) -> None:
        """Windows only: what was eligible at ``now_s`` and is still queued waits for
        the next window (not for the next completion or tick)."""
        if self.cfg.window_s <= 0.0:
            return
        next_s = self.window_end(now_s)
        for w in self._waiters:
            if w.eligible_s <= now_s:
                w.eligible_s = next_s

    def push(self, w: Waiter, others: Callable[[Lane], int] | None = None) -> None:
        """Queue ``w`` (its lane is set here); raises QueueFullError when the lane is full
        (``others``: how many wait in that lane elsewhere, the gateway's other workers)."""
        w.lane = lane_of(w.input_tokens, self.cfg)
        elsewhere = 0 if others is None else others(w.lane)
        if self._num_by_lane[w.lane] + elsewhere >= self.cfg.max_queue_len:
            raise QueueFullError(f"the {w.lane} lane is full", lane=w.lane)
        num_tenant = self._num_by_tenant.get(w.tenant, 0)
        self._fair.on_arrival(w.tenant, is_first_queued=num_tenant == 0)
        self._num_by_tenant[w.tenant] = num_tenant + 1
        self._num_by_lane[w.lane] += 1
        self._waiters.append(w)

    def lane_counts(self) -> tuple[int, ...]:
        """How many wait in each lane (``LANES`` order)."""
        return tuple(self._num_by_lane[lane] for lane in LANES)

    def remove(self, w: Waiter) -> bool:
        """Take ``w`` out (released, expired or its client left); False if not queued."""
        try:
            self._waiters.remove(w)
        except ValueError:
            return False
        self._num_by_lane[w.lane] -= 1
        left = self._num_by_tenant[w.tenant] - 1
        if left:
            self._num_by_tenant[w.tenant] = left
        else:
            del self._num_by_tenant[w.tenant]
        return True

    def expire(self, now_s: float) -> list[Waiter]:
        """Remove and return every waiter past its deadline."""
        late = [w for w in self._waiters if w.deadline_s <= now_s]
        for w in late:
            self.remove(w)
        return late

    def _class_weight(self, priority: int) -> float:
        return self.cfg.priority_weights.get(priority, float(max(1, priority + 1)))

    def _key(self, w: Waiter, now_s: float, top_priority: int) -> tuple[float, ...]:
        cfg = self.cfg
        waited_s = now_s - w.enqueued_s
        starving = 0.0 if waited_s >= cfg.starvation_s else 1.0
        if cfg.priority_mode == "weighted":
            cls = self._class_pass.get(w.priority, 0.0)
        else:
            boost = math.floor(waited_s / cfg.ageing_s) if cfg.ageing_s > 0 else 0
            cls = -float(w.priority + min(boost, top_priority - w.priority))
        order = float(w.need_tokens) if cfg.window_s > 0 else float(_LANE_RANK[w.lane])
        return (starving, cls, order, self._fair.vtime(w.tenant), w.enqueued_s)

    def min_need_tokens(self, now_s: float) -> int | None:
        """The smallest memory need among waiters eligible now (a cheap "anything fits?")."""
        return min((w.need_tokens for w in self._waiters if w.eligible_s <= now_s), default=None)

    def ordered(self, now_s: float) -> list[Waiter]:
        """Waiters eligible now, best first."""
        ready = [w for w in self._waiters if w.eligible_s <= now_s]
        top = max((w.priority for w in ready), default=0)
        ready.sort(key=lambda w: self._key(w, now_s, top))
        return ready

    def pick(self, now_s: float, fits: Callable[[Waiter], bool]) -> Waiter | None:
        """Remove and return the best eligible waiter that ``fits``; None if none may go.
        A starving waiter that does not fit lets only shorter prompts pass it."""
        limit_tokens = math.inf
        for w in self.ordered(now_s):
            if w.input_tokens < limit_tokens and fits(w):
                self._release(w)
                return w
            if now_s - w.enqueued_s >= self.cfg.starvation_s:
                limit_tokens = min(limit_tokens, w.input_tokens)
        return None

    def _release(self, w: Waiter) -> None:
        self.remove(w)
        self._fair.on_release(w.tenant, w.need_tokens)
        if self.cfg.priority_mode == "weighted":
            start = max(self._class_pass.get(w.priority, 0.0), self._min_pass())
            self._class_pass[w.priority] = start + 1.0 / self._class_weight(w.priority)

    def _min_pass(self) -> float:
        queued = {w.priority for w in self._waiters}
        passes = [self._class_pass.get(p, 0.0) for p in queued]
        return min(passes) if passes else 0.0
