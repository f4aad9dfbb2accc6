"""The discrete-event loop: a time-ordered queue of events (a heap of their times), each
returning its follow-ups (vidur's skeleton), plus the handlers that move requests
between gateway and backends.

Deterministic: no wall clock and no hash-order dependence enters the simulated
outcome; ties in time keep scheduling order (the simulator's own counter); the policy
RNG, the model draw and the workload are seeded. Arrivals are pulled from the
workload one at a time, so memory does not grow with the number of requests.
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush

from kiloserve.engine.core import StepResult
from kiloserve.errors import ConfigError, RequestError, some_of
from kiloserve.results.records import RequestRecord
from kiloserve.sim.backend import SimBackend
from kiloserve.sim.disagg import HOLD_TIMEOUT_S, SimDisagg
from kiloserve.sim.events import (
    Arrival,
    AttemptFailed,
    EngineAdd,
    Event,
    Failure,
    Fault,
    FirstToken,
    KvRelease,
    RequestDone,
    Scrape,
    StepDone,
)
from kiloserve.sim.faults import FaultEvent
from kiloserve.sim.gateway import ModelPicker, SimGateway
from kiloserve.sim.lora import SimLora
from kiloserve.sim.prompts import Prompt, PromptIds
from kiloserve.sim.request import DECODE_LEG, PREFILL_LEG, SimRequest
from kiloserve.sim.results import MetricsCollector, TimeSeries
from kiloserve.sim.sequence import SimSequence as EngineSequence
from kiloserve.workload import RequestSpec

__all__ = ["Simulator"]

CONNECT_ERROR = Failure(502, "connect_error: backend is down", is_retryable=True)
STREAM_CUT = Failure(502, "stream cut: backend died mid-response", is_retryable=False)
NO_BACKEND = "no eligible backend (503)"
PROGRESS_EVERY_EVENTS = 8192
# Net allocations of tracked objects between young-generation collections (default 700).
# The loop's live set stays about level (requests come and go) and it makes almost no
# cyclic garbage, so at 1 M a young collection runs only when the live set truly grows
# (or when cyclic garbage reaches ~1 M objects); at 100 k the churn alone triggered one
# every ~20 Mooncake requests, each walking every young prompt's 15 k-id list (16% of
# the loop's CPU at 1,024 GPUs).
GC_YOUNG_THRESHOLD = 1_000_000


@dataclass(slots=True)
class _Counts:
    num_arrived: int = 0
    num_done: int = 0
    num_events: int = 0
    last_arrival_s: float = 0.0
    last_busy_s: list[float] = field(default_factory=list)
    last_sample_s: float = 0.0


class Simulator:
    """One run: backends, gateway, workload and metrics, driven by ``run()``."""

    def __init__(
        self,
        backends: Sequence[SimBackend],
        gateway: SimGateway,
        specs: Iterator[RequestSpec],
        prompts: PromptIds,
        metrics: MetricsCollector,
        *,
        models: ModelPicker,
        network_delay_s: float,
        scrape_interval_s: float,
        faults: Sequence[FaultEvent] = (),
        series: TimeSeries | None = None,
        progress: Callable[[int], None] | None = None,
        lora: SimLora | None = None,
        disagg: SimDisagg | None = None,
    ) -> None:
        self.backends = backends
        self.disagg = disagg  # prefill/decode-role backends: split requests (sim.disagg)
        self.lora = lora  # LoRA adapters: which requests use one, where (sim.lora)
        self.gateway = gateway
        self.prompts = prompts
        self.metrics = metrics
        self.models = models
        self.delay_s = network_delay_s
        self.scrape_interval_s = scrape_interval_s
        self.series = series
        self.progress = progress
        self.now_s = 0.0
        self.cpu_s = 0.0  # the process's CPU seconds spent in the last run()
        self._specs = specs
        # Events by time: a heap of the distinct times; per time, its first event with its
        # push serial, and any later ones at the same time in push order. Heap sifts
        # compare floats only (a heap of (time, serial, event) tuples compared tuples:
        # two float comparisons each, most of a pop's cost in a 1,000-deep heap).
        self._times: list[float] = []
        self._first: dict[float, tuple[int, Event]] = {}
        self._more: dict[float, deque[tuple[int, Event]]] = {}  # ties (rare)
        # Events due exactly one network delay from now (token deliveries, completions,
        # failed attempts) are pushed in time order, so a FIFO holds them sorted; the
        # loop takes the smaller head of the two, the order one heap would give.
        self._delayed: deque[tuple[float, int, Event]] = deque()
        self._num_pushed = 0
        self._counts = _Counts(last_busy_s=[0.0] * len(backends))
        self._is_arriving = True
        # fused runs whose last step a scrape must see: (last step's start, index, run)
        self._due_runs: list[tuple[float, int, int]] = []
        self._by_id = {b.backend_id: b for b in backends}
        for fault in faults:
            if fault.backend not in self._by_id:
                valid = some_of(self._by_id)
                raise ConfigError(f"fault names unknown backend {fault.backend!r}; valid: {valid}")

        self._faults = list(faults)

    # -- the loop ------------------------------------------------------------------
    def push(self, event: Event) -> None:
        self._num_pushed += 1
        time_s = event.time_s
        if time_s == self.now_s + self.delay_s:  # >= the FIFO's last: now never goes back
            self._delayed.append((time_s, self._num_pushed, event))
            return
        if time_s in self._first:
            queued = self._more.get(time_s)
            if queued is None:
                queued = self._more[time_s] = deque()
            queued.append((self._num_pushed, event))
        else:
            self._first[time_s] = (self._num_pushed, event)
            heappush(self._times, time_s)

    def pop(self) -> Event | None:
        """The next event (earliest; ties in push order), with ``now_s`` moved to its
        time; None when nothing is left."""
        times, delayed = self._times, self._delayed
        if times:
            time_s = times[0]
            serial, event = self._first[time_s]
            # (time, push serial) heads: serials are unique, so events are never compared
            if delayed:
                head = delayed[0]
                head_s = head[0]
                if head_s < time_s or (head_s == time_s and head[1] < serial):
                    delayed.popleft()
                    self.now_s = head_s
                    return head[2]
            more = self._more
            queued = more.get(time_s) if more else None
            if queued is None:
                heappop(times)
                del self._first[time_s]
            else:  # the next event at this time moves up
                self._first[time_s] = queued.popleft()
                if not queued:
                    del more[time_s]
        elif delayed:
            time_s, _, event = delayed.popleft()
        else:
            return None
        self.now_s = time_s
        return event

    @property
    def num_queued(self) -> int:
        """Events waiting (both queues)."""
        ties = sum(len(q) for q in self._more.values())
        return len(self._delayed) + len(self._first) + ties

    def run(self) -> float:
        """Run to the end; returns the wall seconds it took.

        The loop allocates many short-lived objects and few cycles, so the cyclic
        garbage collector runs rarely meanwhile: objects alive at the start are frozen
        (never rescanned) and the young generation is collected every
        ``GC_YOUNG_THRESHOLD`` net allocations instead of 700; both are restored after.
        """
        thresholds = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *thresholds[1:])
        try:
            return self._run()
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()

    def _run(self) -> float:
        started, cpu_started = time.perf_counter(), time.process_time()
        self.push(Scrape(0.0))
        for fault in self._faults:
            self.push(Fault(fault))
        self._push_next_arrival()
        counts = self._counts
        # self.pop / self.push, not bound methods in locals: compiled, those would be
        # generic Python calls (docs/simulator.md, "Compiled build")
        while (event := self.pop()) is not None:
            for follow in event.handle(self):
                self.push(follow)
            counts.num_events += 1
            if self.progress is not None and counts.num_events % PROGRESS_EVERY_EVENTS == 0:
                self.progress(counts.num_done)
        if self.progress is not None:
            self.progress(counts.num_done)
        self.cpu_s = time.process_time() - cpu_started
        return time.perf_counter() - started

    @property
    def num_requests(self) -> int:
        return self._counts.num_arrived

    @property
    def num_events(self) -> int:
        return self._counts.num_events

    @property
    def last_arrival_s(self) -> float:
        return self._counts.last_arrival_s

    def _push_next_arrival(self) -> None:
        spec = next(self._specs, None)
        if spec is None:
            self._is_arriving = False
            return
        if spec.arrival_s is None:
            raise ConfigError(
                "the simulator replays open-loop workloads: give --rate or use a trace"
            )
        self.push(Arrival(max(spec.arrival_s, self.now_s), spec))

    # -- gateway side --------------------------------------------------------------
    def on_arrival(self, spec: RequestSpec, now_s: float) -> list[Event]:
        self._push_next_arrival()
        self._counts.num_arrived += 1
        self._counts.last_arrival_s = now_s
        prompt = self.prompts.prompt(spec)
        seq = _new_sequence(spec.request_id, prompt, spec.output_tokens, now_s)
        model = self.models.pick()
        if self.lora is not None:
            model = self.lora.model_for(model, spec.request_id, now_s)
        info = self.gateway.profile(spec, model, seq)
        request = SimRequest(spec, info, prompt, now_s, seq=seq)
        self.gateway.route(request, now_s)
        if request.leg == PREFILL_LEG:  # one token, its blocks held for the decode leg
            seq.seq_id, seq.max_tokens, seq.hold_on_finish = request.seq_id, 1, True
        if not request.ranked:
            self._record_failure(request, 503, NO_BACKEND, now_s)
            return []
        return self._dispatch(request, now_s)

    def _dispatch(self, request: SimRequest, now_s: float) -> list[Event]:
        backend_id = self.gateway.dispatch(request, now_s)
        self.metrics.add_routing(request.spec.request_id, backend_id)
        backend = self.backends[request.backend_index]
        if request.attempt > 0 or request.seq is None:
            request.seq = _leg_sequence(request, now_s)
        if not backend.is_alive:  # connection refused, answered after one round trip
            return [AttemptFailed(now_s + 2 * self.delay_s, request, CONNECT_ERROR)]
        add_s = now_s + self.delay_s + backend.model.api_overhead_s
        if request.leg == DECODE_LEG and self.disagg is not None:  # the engine pulls the KV
            transfer_s = self.disagg.transfer_s(backend.index, len(request.prompt.token_ids) - 1)
            self.metrics.add_kv_transfer(transfer_s)
            add_s += transfer_s
        return [EngineAdd(add_s, request)]

    def on_first_token(self, request: SimRequest, now_s: float) -> list[Event]:
        self.gateway.first_token(request, now_s)
        if request.leg == DECODE_LEG and self.disagg is not None:
            self.disagg.num_split += 1  # served by its decode leg (the live gateway's count)
        return []

    def on_request_done(
        self, request: SimRequest, failure: Failure | None, now_s: float
    ) -> list[Event]:
        if failure is None:
            self.gateway.complete(request, 200, now_s)
            if request.leg == PREFILL_LEG:
                return self._start_decode_leg(request, now_s)
            self._record_ok(request, now_s)
            return []
        self.gateway.complete(request, failure.status, now_s)
        is_first_sent = request.gateway_first_token_s is not None
        if failure.is_retryable and request.has_more_attempts and not is_first_sent:
            request.attempt += 1
            return self._dispatch(request, now_s)
        if request.leg and failure.is_retryable and not is_first_sent:
            return self._fallback(request, now_s)
        self._record_failure(request, failure.status, failure.error, now_s)
        return self._expire_hold(request, now_s)

    def _start_decode_leg(self, request: SimRequest, now_s: float) -> list[Event]:
        """The prefill leg's answer is in: send the decode leg (it pulls the KV)."""
        request.held = (request.backend_index, request.seq_id)
        request.seq = None
        self.gateway.route_decode(request, now_s)
        return self._dispatch(request, now_s)

    def _fallback(self, request: SimRequest, now_s: float) -> list[Event]:
        """Every prefill leg (or every decode leg) of a split request failed before its
        answer: the whole request, on the decode backends first after failed prefills,
        on any but the failed decode backends after failed decodes."""
        if self.disagg is not None:
            self.disagg.num_fallback += 1
        events = self._expire_hold(request, now_s)
        first: tuple[int, ...] = ()  # after failed prefills: the decode backends first
        skip: tuple[int, ...] = ()  # after failed decodes: not the failed ones
        if request.leg == PREFILL_LEG:
            first = request.decode_ranked
        else:
            skip = request.ranked
        request.seq = None
        self.gateway.route_fallback(request, now_s, first, skip)
        if not request.ranked:
            self._record_failure(request, 503, NO_BACKEND, now_s)
            return events
        return events + self._dispatch(request, now_s)

    def _expire_hold(self, request: SimRequest, now_s: float) -> list[Event]:
        """Held KV that no decode backend will release: freed at the hold timeout."""
        held, request.held = request.held, None
        if held is None:
            return []
        return [KvRelease(now_s + HOLD_TIMEOUT_S, held[0], held[1])]

    def _record_ok(self, request: SimRequest, now_s: float) -> None:
        first_s = request.gateway_first_token_s
        self._counts.num_done += 1
        metrics = self.metrics
        if not metrics.needs_records:  # the numbers alone (no RequestRecord per request)
            ttft_s = None if first_s is None else first_s - request.arrival_s
            metrics.add_ok_values(
                ttft_s, now_s - request.arrival_s, len(request.prompt.token_ids),
                request.spec.output_tokens, request.backend_index, now_s,
            )  # fmt: skip
            return
        record = self._record(request, now_s)
        record.ttft_s = None if first_s is None else first_s - request.arrival_s
        record.e2e_s = now_s - request.arrival_s
        record.output_tokens = request.spec.output_tokens
        record.queue_s = request.queue_s
        record.is_ok, record.status = True, 200
        metrics.add_ok(record, request.backend_index, now_s)

    def _record_failure(self, request: SimRequest, status: int, error: str, now_s: float) -> None:
        record = self._record(request, now_s)
        record.status, record.error = status, error
        index = request.backend_index if request.ranked else None
        self._counts.num_done += 1
        self.metrics.add_failed(record, index, now_s)

    def _record(self, request: SimRequest, now_s: float) -> RequestRecord:
        spec = request.spec
        backend_id = self.backends[request.backend_index].backend_id if request.ranked else None
        return RequestRecord(
            request_id=spec.request_id,
            scheduled_s=spec.arrival_s,
            start_s=request.arrival_s,
            input_tokens=len(request.prompt.token_ids),
            max_tokens=spec.output_tokens,
            backend=backend_id,
            session_id=spec.session_id,
            user=spec.user,
            prefix_group=spec.prefix_group,
        )

    # -- backend side --------------------------------------------------------------
    def on_engine_add(self, request: SimRequest, now_s: float) -> list[Event]:
        backend = self.backends[request.backend_index]
        core, seq = backend.core, request.seq
        if core is None or seq is None:
            return [AttemptFailed(now_s + self.delay_s, request, CONNECT_ERROR)]
        events = self._sync(backend, now_s)
        request.engine_add_s, request.queue_s = now_s, None
        if request.held is not None and request.leg == DECODE_LEG:
            held, request.held = request.held, None  # pulled: the decode twin releases it
            events.append(KvRelease(now_s + self.delay_s, held[0], held[1]))
        try:
            backend.add(request)
        except RequestError as exc:
            failure = Failure(exc.status, f"http {exc.status}: {exc.message}", False)
            return [*events, AttemptFailed(now_s + self.delay_s, request, failure)]
        if self.lora is not None:
            backend.pending_swap_s += self.lora.swap_cost_s(backend.index, request.info.model)
        if not backend.is_busy:
            events += self._start(backend, now_s)
        return events

    def _sync(self, backend: SimBackend, now_s: float) -> list[Event]:
        end_s = backend.sync(now_s)
        return [] if end_s is None else [StepDone(end_s, backend.index, backend.generation)]

    def _start(self, backend: SimBackend, now_s: float) -> list[Event]:
        end_s = backend.start(now_s)
        if end_s is None:
            return []
        if backend.last_step_start_s != math.inf:  # a fused run: a scrape may cut into it
            heappush(self._due_runs, (backend.last_step_start_s, backend.index, backend.run_serial))
        return [StepDone(end_s, backend.index, backend.generation)]

    def on_step_done(self, index: int, generation: int, now_s: float) -> list[Event]:
        backend = self.backends[index]
        if generation != backend.generation or not backend.is_busy:
            return []  # superseded (the run was cut short, or the backend died)
        result = backend.finish_step()
        events: list[Event] = []
        if result is not None:
            events = self._deliver(backend, result, now_s)
        return events + self._start(backend, now_s)

    def _deliver(self, backend: SimBackend, result: StepResult, now_s: float) -> list[Event]:
        events: list[Event] = []
        num_steps = result.num_steps
        requests = backend.requests
        arrive_s = now_s + self.delay_s
        gap_s = result.duration_s * backend.slowdown / max(1, num_steps)
        self.metrics.add_itl(backend.index, gap_s, result.num_decode_tokens)
        awaiting = backend.awaiting_first_token
        if num_steps == 1 and awaiting:  # fused runs only decode: no first tokens there
            for seq_id, request in list(awaiting.items()):
                if request.seq is not None and request.seq.num_output_tokens:
                    del awaiting[seq_id]
                    request.first_token_s = now_s
                    if request.leg != PREFILL_LEG:  # a prefill leg answers once, unstreamed
                        events.append(FirstToken(arrive_s, request))
        for seq in result.finished:
            done = requests.pop(seq.seq_id, None)
            if done is not None:
                events.append(RequestDone(arrive_s, done))
        return events

    def on_kv_release(self, index: int, seq_id: str, now_s: float) -> list[Event]:
        """The prefill backend frees a held prefill leg's blocks (waiting work may fit)."""
        backend = self.backends[index]
        if not backend.is_alive:
            return []
        events = self._sync(backend, now_s)
        if backend.release(seq_id):
            if self.disagg is not None:
                self.disagg.num_releases += 1
            if not backend.is_busy:
                events += self._start(backend, now_s)
        return events

    # -- periodic and scheduled ----------------------------------------------------
    def on_scrape(self, now_s: float) -> list[Event]:
        events: list[Event] = []
        due, backends = self._due_runs, self.backends
        # A scrape syncs a fused run only once its last step has started (the only step
        # of a run that changes running / waiting counts); before that it reads the
        # state at the run's start (KV usage lags by the blocks the run has grown since).
        indices: list[int] = []
        while due and due[0][0] <= now_s:
            _, index, serial = heappop(due)
            backend = backends[index]
            if backend.run_serial == serial and now_s >= backend.last_step_start_s:
                indices.append(index)
        for index in sorted(indices):  # index order, as a loop over every backend would
            backend = backends[index]
            end_s = backend.sync(now_s)
            if end_s is not None:
                events.append(StepDone(end_s, backend.index, backend.generation))
        self.gateway.scrape(now_s)
        self._sample(now_s)
        counts = self._counts
        if self._is_arriving or counts.num_done < counts.num_arrived:
            events.append(Scrape(now_s + self.scrape_interval_s))
        return events

    def _sample(self, now_s: float) -> None:
        series, counts = self.series, self._counts
        if series is None or now_s < series.next_s:
            return
        span_s = now_s - counts.last_sample_s
        busy = [b.busy_s_at(now_s) for b in self.backends]
        utilisation = [
            min(1.0, max(0.0, now - last) / span_s) if span_s > 0 else 0.0
            for now, last in zip(busy, counts.last_busy_s, strict=True)
        ]
        series.add(now_s, utilisation, [b.kv_usage for b in self.backends])
        counts.last_busy_s, counts.last_sample_s = busy, now_s

    def on_fault(self, fault: FaultEvent, now_s: float) -> list[Event]:
        backend = self._by_id[fault.backend]
        if fault.kind == "die":
            return self._kill(backend, now_s)
        events = self._sync(backend, now_s)
        if fault.kind == "slow":
            backend.slowdown = fault.factor
        else:
            if not backend.is_alive:
                self.gateway.num_dead -= 1
            backend.recover()
        return events

    def _kill(self, backend: SimBackend, now_s: float) -> list[Event]:
        if not backend.is_alive:
            return []
        backend.sync(now_s)  # steps already started count as modelled work
        self.gateway.num_dead += 1
        events: list[Event] = []
        arrive_s = now_s + self.delay_s
        for request in backend.die():
            if request.first_token_s is not None:
                events.append(RequestDone(arrive_s, request, STREAM_CUT))
            else:
                events.append(AttemptFailed(arrive_s, request, CONNECT_ERROR))
        return events


def _leg_sequence(request: SimRequest, now_s: float) -> EngineSequence:
    """The sequence of the request's current attempt: whole, a prefill leg (one token,
    blocks held for the decode backend) or a decode leg (all but the last prompt token
    arrive as KV)."""
    leg, prompt = request.leg, request.prompt
    if leg == PREFILL_LEG:
        seq = _new_sequence(request.seq_id, prompt, 1, now_s)
        seq.hold_on_finish = True
        return seq
    seq = _new_sequence(request.seq_id, prompt, request.spec.output_tokens, now_s)
    if leg == DECODE_LEG:
        seq.num_transferred_tokens = len(prompt.token_ids) - 1
    return seq


def _new_sequence(seq_id: str, prompt: Prompt, max_tokens: int, now_s: float) -> EngineSequence:
    return EngineSequence(
        seq_id,
        prompt.token_ids,
        max_tokens,
        arrival_s=now_s,
        unique_key=None if prompt.unique_from is None else prompt.unique_key,
        unique_from=prompt.unique_from or 0,
        run_keys=prompt.run_keys,
        run_tokens=prompt.run_tokens,
        private_from=prompt.private_from,
    )
