"""The live admission controller: per-pool queues, reservations and release.

A request asks ``admit``; when its pool's queue is empty and a backend has room
(``capacity.has_room`` with the gateway's own reservations) it goes at once to the
best backend with room in the router's decision (``Router.decide``, asked once, when
the request is placed: the proxy forwards along that same ranking, with the reserved
backend first and the rest after it as fallbacks). Otherwise it waits in the pool's
``PoolQueue`` until ``pump`` releases it: on every completion and every ``tick_s``
(a ticker task that also expires waiters past their deadline with a 503). With
memory-budget windows (``window_s`` > 0) every arrival waits for its window to close;
what does not fit then waits for the next window, not for the next completion. A
request's need is ``capacity.memory_need_kv_tokens`` (the seed's estimate unless
``capacity.kv_bytes_per_token`` names the model). A full
lane is a 429 with ``Retry-After``. ``done`` returns a request's reservation.

With ``--workers N`` (``share``: ``gateway/admission/shared_queue.py``) the workers
keep one order per pool: a worker leaves freed room to a sibling whose queue head
comes first (higher priority, or the same and older) for up to ``max_defer_s``, and
an arrival waits in the queue while a sibling has waiters of its priority or higher.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kiloserve.errors import QueueFullError, UnavailableError
from kiloserve.gateway.admission.capacity import (
    has_prefill_room,
    has_room,
    is_engine_caught_up,
    memory_need_kv_tokens,
)
from kiloserve.gateway.admission.queue import LANES, AdmissionConfig, PoolQueue, Waiter, lane_of
from kiloserve.gateway.admission.shared_queue import SharedQueues
from kiloserve.policies.base import RequestInfo
from kiloserve.routing.router import Router
from kiloserve.routing.table import BackendTable

__all__ = ["Admission", "AdmissionController", "AdmissionMetrics"]

_LANE_INDEX = {lane: i for i, lane in enumerate(LANES)}

logger = logging.getLogger(__name__)

WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(slots=True)
class Admission:
    """A granted request: where it goes and what it reserved there."""

    ranked: tuple[str, ...]  # what the proxy forwards along: backend_id first
    backend_id: str
    need_tokens: int
    waited_s: float = 0.0
    is_dispatched: bool = False
    cached_blocks: Mapping[str, int] | None = None  # the decision's (Decision.cached_blocks)


class AdmissionMetrics(Collector):
    """Queue depth per (model, lane), wait-time histogram per model, outcome counts."""

    def __init__(self, controller: AdmissionController) -> None:
        self._ctl = controller
        self.outcomes: dict[tuple[str, str], int] = {}
        self.waits: dict[str, list[int]] = {}
        self.wait_sums: dict[str, float] = {}

    def outcome(self, model: str, outcome: str) -> None:
        key = (model, outcome)
        self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def observe_wait(self, model: str, waited_s: float) -> None:
        counts = self.waits.setdefault(model, [0] * (len(WAIT_BUCKETS_S) + 1))
        i = next((i for i, b in enumerate(WAIT_BUCKETS_S) if waited_s <= b), len(WAIT_BUCKETS_S))
        counts[i] += 1
        self.wait_sums[model] = self.wait_sums.get(model, 0.0) + waited_s

    def collect(self) -> Iterator[Any]:
        prefix = "kiloserve_gateway_admission_"
        depth = GaugeMetricFamily(
            prefix + "queue_depth", "requests queued at the gateway", labels=["model", "lane"]
        )
        for model, q in self._ctl.queues.items():
            for lane in LANES:
                depth.add_metric([model, lane], q.depth(lane))
        yield depth
        out = CounterMetricFamily(
            prefix + "requests", "admission outcomes", labels=["model", "outcome"]
        )
        for (model, what), n in self.outcomes.items():
            out.add_metric([model, what], n)
        yield out
        deferrals = CounterMetricFamily(
            prefix + "deferrals",
            "pumps that left freed room to a sibling worker's earlier queue head",
        )
        deferrals.add_metric([], self._ctl.num_deferrals)
        yield deferrals
        hist = HistogramMetricFamily(
            prefix + "queue_wait_seconds", "time spent queued at the gateway", labels=["model"]
        )
        for model, counts in self.waits.items():
            cum, buckets = 0, []
            for bound, n in zip((*WAIT_BUCKETS_S, float("inf")), counts, strict=True):
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else str(bound), float(cum)))
            hist.add_metric([model], buckets, self.wait_sums[model])
        yield hist


class AdmissionController:
    """Admission for every model pool of one gateway app."""

    def __init__(self, cfg: AdmissionConfig, router: Router) -> None:
        self.cfg = cfg
        self.router = router
        self.table: BackendTable = router.table
        self.queues: dict[str, PoolQueue] = {}
        # grants, reservations and the granted-not-yet-sent part live on the backend's
        # state (BackendState.admitted_in_flight, reserved_tokens, undispatched_tokens),
        # so the workers of one gateway share them (routing/shared_load.py)
        self.metrics = AdmissionMetrics(self)
        self._infos: dict[int, RequestInfo] = {}
        # the sibling workers' queue heads (gateway/workers.py sets it); None: one process
        self.share: SharedQueues | None = None
        # how long a worker leaves freed room to a sibling's older head (then takes it)
        self.max_defer_s = max(5 * cfg.tick_s, 0.05)
        self._deferring: dict[str, tuple[int, float, float]] = {}  # model -> head, since
        self.num_deferrals = 0

    # -- capacity ------------------------------------------------------------------
    def _roomy(
        self, model: str, need_tokens: int, is_short: bool, input_tokens: int = 0
    ) -> set[str]:
        cap = self.cfg.capacity
        out: set[str] = set()
        self.table.sync()  # the other workers' grants (routing/shared_load.py)
        for bid in self.table.pool_ids(model):
            s = self.table.state(bid)
            if not s.is_routable:
                continue
            growth = int(s.outstanding_decode_tokens * cap.decode_growth_frac)
            pending = s.outstanding_prefill_tokens + growth + s.undispatched_tokens
            room = has_room(
                s, cap, need_tokens, s.reserved_tokens, s.admitted_in_flight, pending, is_short
            )
            queued = s.outstanding_prefill_tokens + s.undispatched_tokens
            if room.is_free and has_prefill_room(
                cap, queued, input_tokens, is_short, is_engine_caught_up(s)
            ):
                out.add(bid)
        return out

    def _place(self, info: RequestInfo, need_tokens: int) -> Admission | None:
        """Reserve the policy's best backend with room; None when none has room."""
        is_short = lane_of(info.input_tokens, self.cfg) == "short"
        roomy = self._roomy(info.model, need_tokens, is_short, info.input_tokens)
        if not roomy:
            return None
        decision = self.router.decide(info, time.monotonic())
        ranked = decision.ranked  # routable, in the pool
        ordered = [b for b in ranked if b in roomy]
        if not ordered:
            ordered = sorted(roomy)  # the policy ranked none of them (e.g. it filters)
        rest = [b for b in ranked if b not in roomy]
        bid = ordered[0]
        self.table.adjust_admission(
            bid, in_flight=1, reserved=need_tokens, undispatched=need_tokens
        )
        return Admission(
            tuple(ordered + rest), bid, need_tokens, cached_blocks=decision.cached_blocks
        )

    def dispatched(self, adm: Admission) -> None:
        """The proxy is sending it now: the backend's own counters take over."""
        if not adm.is_dispatched:
            adm.is_dispatched = True
            self.table.adjust_admission(adm.backend_id, undispatched=-adm.need_tokens)

    def done(self, adm: Admission) -> None:
        """The request ended: give back its reservation and release waiters."""
        self._unreserve(adm)
        self.pump(time.monotonic())

    def _unreserve(self, adm: Admission) -> None:
        self.dispatched(adm)
        self.table.adjust_admission(adm.backend_id, in_flight=-1, reserved=-adm.need_tokens)

    # -- queueing ------------------------------------------------------------------
    def _queue(self, model: str) -> PoolQueue:
        q = self.queues.get(model)
        if q is None:
            q = self.queues[model] = PoolQueue(self.cfg)
        return q

    async def admit(self, info: RequestInfo) -> Admission:
        """Wait for room; raises QueueFullError (429) or UnavailableError (503), both
        with ``Retry-After: admission.retry_after_s``."""
        kv_bytes_per_token = self.cfg.capacity.kv_bytes_per_token.get(info.model)
        need = memory_need_kv_tokens(
            info.input_tokens, info.predicted_output_tokens, kv_bytes_per_token
        )
        q = self._queue(info.model)
        now = time.monotonic()
        if (
            not len(q)
            and self.cfg.window_s <= 0
            and not (self.share and self.share.waiting(info.model, info.priority, now))
        ):
            adm = self._place(info, need)
            if adm is not None:
                self.metrics.outcome(info.model, "admitted")
                return adm
        return await self._wait(q, info, need, now)

    async def _wait(self, q: PoolQueue, info: RequestInfo, need: int, now: float) -> Admission:
        fut: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        w = Waiter(
            info.request_id, need, info.input_tokens, info.priority, info.tenant or "",
            now, now + self.cfg.max_queue_wait_s, q.window_end(now), ticket=fut,
        )  # fmt: skip
        share = self.share
        others = None if share is None else (
            lambda lane: share.in_lane(info.model, _LANE_INDEX[lane], now)
        )  # fmt: skip
        try:
            q.push(w, others)
        except QueueFullError as exc:
            self.metrics.outcome(info.model, "rejected_queue_full")
            raise QueueFullError(
                f"the gateway queue for `{info.model}` ({exc.lane} lane) is full; retry later",
                lane=exc.lane,
                retry_after_s=self.cfg.retry_after_s,
            ) from exc
        self._infos[id(w)] = info
        self.pump(now)
        try:
            return await fut
        finally:
            if q.remove(w):  # cancelled while queued (the client left)
                self.metrics.outcome(info.model, "cancelled")
                self._publish(info.model, q)
            self._infos.pop(id(w), None)

    def _head(self, q: PoolQueue) -> tuple[int, float] | None:
        """(the highest priority waiting, the oldest arrival at it), None when empty."""
        waiters = q.waiters()
        if not waiters:
            return None
        top = max(w.priority for w in waiters)
        return top, min(w.enqueued_s for w in waiters if w.priority == top)

    def _publish(self, model: str, q: PoolQueue) -> None:
        if self.share is not None:
            head = self._head(q)
            if head is None:
                self.share.publish(model, 0, 0, 0.0, (0, 0, 0))
            else:
                self.share.publish(model, len(q), *head, q.lane_counts())

    def _yields(self, model: str, q: PoolQueue, now_s: float) -> bool:
        """Whether this worker leaves the room (there is some) to a sibling's earlier
        head now; for at most ``max_defer_s`` from when the room was first left."""
        head = self._head(q) if self.share is not None else None
        if self.share is None or head is None or not self.share.outranked(model, *head, now_s):
            self._deferring.pop(model, None)
            return False
        since = self._deferring.get(model)
        if since is None or since[:2] != head:
            self._deferring[model] = (*head, now_s)
            since = self._deferring[model]
        if now_s - since[2] > self.max_defer_s:
            return False  # the sibling's head fits nowhere, it seems: take the room
        self.num_deferrals += 1
        return True

    def pump(self, now_s: float) -> None:
        """Release every waiter that may go now, in queue order; with windows
        (``window_s`` > 0) what did not fit waits for the next window (S2.2)."""
        for model, q in self.queues.items():
            self._expire(model, q, now_s)
            while len(q):
                smallest = q.min_need_tokens(now_s)
                if smallest is None or not self._roomy(model, smallest, is_short=True):
                    self._deferring.pop(model, None)  # no room: nothing to leave to anyone
                    break  # nothing eligible fits anywhere: skip the sort
                if self._yields(model, q, now_s) or not self._release_one(model, q, now_s):
                    break
            q.hold_leftovers(now_s)
            self._publish(model, q)

    def _release_one(self, model: str, q: PoolQueue, now_s: float) -> bool:
        placed: list[Admission] = []

        def fits(w: Waiter) -> bool:
            info = self._infos.get(id(w))
            adm = None if info is None else self._place(info, w.need_tokens)
            if adm is not None:
                placed.append(adm)
            return adm is not None

        w = q.pick(now_s, fits)
        if w is None:
            return False
        self._grant(model, w, placed[0], now_s)
        return True

    def _grant(self, model: str, w: Waiter, adm: Admission, now_s: float) -> None:
        adm.waited_s = now_s - w.enqueued_s
        self.metrics.observe_wait(model, adm.waited_s)
        self.metrics.outcome(model, "admitted")
        fut = w.ticket
        if isinstance(fut, asyncio.Future) and not fut.done():
            fut.set_result(adm)
        else:
            self._unreserve(adm)

    def _expire(self, model: str, q: PoolQueue, now_s: float) -> None:
        for w in q.expire(now_s):
            self.metrics.observe_wait(model, now_s - w.enqueued_s)
            self.metrics.outcome(model, "expired")
            fut = w.ticket
            if isinstance(fut, asyncio.Future) and not fut.done():
                fut.set_exception(
                    UnavailableError(
                        f"waited {now_s - w.enqueued_s:.1f} s at the gateway for `{model}` "
                        f"(admission.max_queue_wait_s={self.cfg.max_queue_wait_s}); retry later",
                        code="queue_timeout",
                        retry_after_s=self.cfg.retry_after_s,
                    )
                )

    async def run_ticker(self) -> None:
        """Expire and release on a timer (scrapes change room without a completion)."""
        while True:
            await asyncio.sleep(self.cfg.tick_s)
            self.pump(time.monotonic())
