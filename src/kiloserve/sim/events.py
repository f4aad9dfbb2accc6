"""The simulator's events: each one handles itself and returns its follow-up events.

Ordering: the heap orders by ``(time_s, insertion number)``; the insertion number is
the simulator's own counter (no class-level ids), so equal times keep the order in
which they were scheduled and every run of the same inputs replays identically.

Flow of one request (d = network delay, o = the engine's API overhead)::

    Arrival(t)            gateway: profile, policy.choose, dispatch to ranked[0]
    EngineAdd(t + d + o)  backend: engine.add (dead backend: AttemptFailed(+d))
    StepDone(...)         backend: deliver tokens -> FirstToken(+d), Done(+d)
    FirstToken / Done     gateway: counters, EWMAs, policy hooks, metrics
    AttemptFailed         gateway: retry on the next ranked backend, or fail

A split request (disaggregated prefill/decode) runs a prefill leg and a decode leg,
each through EngineAdd .. RequestDone, and frees the prefill backend's held KV blocks
with a ``KvRelease`` (see ``sim.disagg``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiloserve.sim.faults import FaultEvent
from kiloserve.sim.request import SimRequest
from kiloserve.workload import RequestSpec

if TYPE_CHECKING:
    from kiloserve.sim.simulator import Simulator

__all__ = [
    "Arrival",
    "AttemptFailed",
    "EngineAdd",
    "Event",
    "Failure",
    "Fault",
    "FirstToken",
    "KvRelease",
    "RequestDone",
    "Scrape",
    "StepDone",
]


class Event:
    """Base: something that happens at ``time_s`` and may cause more events."""

    __slots__ = ("time_s",)

    def __init__(self, time_s: float) -> None:
        self.time_s = time_s

    def handle(self, sim: Simulator) -> list[Event]:
        raise NotImplementedError


class Arrival(Event):
    __slots__ = ("spec",)

    def __init__(self, time_s: float, spec: RequestSpec) -> None:
        self.time_s = time_s  # Event.__init__, inlined (one call less per event)
        self.spec = spec

    def handle(self, sim: Simulator) -> list[Event]:
        return sim.on_arrival(self.spec, self.time_s)


class EngineAdd(Event):
    __slots__ = ("request",)

    def __init__(self, time_s: float, request: SimRequest) -> None:
        self.time_s = time_s
        self.request = request

    def handle(self, sim: Simulator) -> list[Event]:
        return sim.on_engine_add(self.request, self.time_s)


class StepDone(Event):
    __slots__ = ("backend_index", "generation")

    def __init__(self, time_s: float, backend_index: int, generation: int) -> None:
        self.time_s = time_s
        self.backend_index = backend_index
        self.generation = generation

    def handle(self, sim: Simulator) -> list[Event]:
        return sim.on_step_done(self.backend_index, self.generation, self.time_s)


class FirstToken(Event):
    __slots__ = ("request",)

    def __init__(self, time_s: float, request: SimRequest) -> None:
        self.time_s = time_s
        self.request = request

    def handle(self, sim: Simulator) -> list[Event]:
        return sim.on_first_token(self.request, self.time_s)


@dataclass(frozen=True, slots=True)
class Failure:
    status: int
    error: str
    is_retryable: bool


class RequestDone(Event):
    """The gateway sees the end of an attempt's stream (``failure`` None: success)."""

    __slots__ = ("failure", "request")

    def __init__(self, time_s: float, request: SimRequest, failure: Failure | None = None):
        self.time_s = time_s
        self.request = request
        self.failure = failure

    def handle(self, sim: Simulator) -> list[Event]:
        return sim.on_request_done(self.request, self.failure, self.time_s)


class AttemptFailed(RequestDone):
    """An attempt failed before its first byte (retryable or not)."""

    __slots__ = ()


class KvRelease(Event):
    """A prefill backend frees the KV blocks a finished prefill leg held."""

    __slots__ = ("backend_index", "seq_id")

    def __init__(self, time_s: float, backend_index: int, seq_id: str) -> None:
        self.time_s = time_s
        self.backend_index = backend_index
        self.seq_id = seq_id

    def handle(self, sim: Simulator) -> list[Event]:
        return sim.on_kv_release(self.backend_index, self.seq_id, self.time_s)


class Scrape(Event):
    __slots__ = ()

    def handle(self, sim: Simulator) -> list[Event]:
        return sim.on_scrape(self.time_s)


class Fault(Event):
    __slots__ = ("fault",)

    def __init__(self, fault: FaultEvent) -> None:
        super().__init__(fault.time_s)
        self.fault = fault

    def handle(self, sim: Simulator) -> list[Event]:
        return sim.on_fault(self.fault, self.time_s)
