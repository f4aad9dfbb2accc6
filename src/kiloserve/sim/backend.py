"""One simulated backend: an ``EngineCore`` stepped in simulated time, like the twin.

The twin's loop, in simulated time: a step is scheduled (``core.step()`` commits its
state at once) and its tokens are delivered when its modelled duration (times the
slowdown) has passed; a request added meanwhile joins the next step.

Fast-forward, lazily: when the batch can only decode (``max_fast_forward_steps() = k``
>= 2), the backend plans a fused run of all k steps and commits nothing yet. Anything
that must see the engine mid-run (an arrival, a scrape, a fault) first calls ``sync``,
which commits exactly the steps that had *started* by then (``advance(j)``, j from
``fast_forward_steps_within``), so the state is the one k single steps would leave:
the arrival joins the step after the one in progress, as in the twin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiloserve.engine.config import EngineConfig
from kiloserve.engine.core import EngineCore, StepResult, StepTimer
from kiloserve.engine.transfer import KvLink
from kiloserve.sim.kvevents import SimKvEvents, SimKvSink
from kiloserve.sim.request import SimRequest
from kiloserve.sim.sequence import SimSequence

__all__ = ["BackendModel", "SimBackend"]


@dataclass(frozen=True, slots=True)
class BackendModel:
    """What every backend of one cluster line shares (configs and timers are stateless)."""

    engine_config: EngineConfig
    timer: StepTimer
    api_overhead_s: float
    kv_capacity_tokens: int
    base_slowdown: float = 1.0
    kv_link: KvLink | None = None  # the link a decode engine pulls KV over (sim.disagg)


class SimBackend:
    """A backend's engine, its in-flight requests and its busy time."""

    def __init__(
        self,
        index: int,
        backend_id: str,
        model: BackendModel,
        *,
        fast_forward: bool,
        changed: set[int] | None = None,
        kv_events: SimKvEvents | None = None,
    ) -> None:
        self.index = index
        self.backend_id = backend_id
        self.model = model
        self.is_fast_forward = fast_forward
        self.kv_events = kv_events  # set: the engine publishes KV events (sim.kvevents)
        self.kv_sink: SimKvSink | None = None
        self.core: EngineCore | None = self._new_core()
        self.slowdown = model.base_slowdown
        self.generation = 0  # bumped whenever a scheduled step end becomes stale
        self.requests: dict[str, SimRequest] = {}  # by seq id
        self.awaiting_first_token: dict[str, SimRequest] = {}  # subset of requests
        self.is_busy = False
        self.step_end_s = 0.0
        self.work_start_s = 0.0  # when the step (or fused run) in progress began
        self.busy_s = 0.0  # modelled work of finished steps (see ``busy_s_at``)
        self.num_steps = 0  # engine steps committed (started), fused ones included
        self.num_fused_steps = 0  # steps modelled inside fused runs
        self.state_version = 0  # bumped whenever the engine's state may have changed
        self.scraped_version = -1  # state_version at the last successful scrape
        # indices of backends whose state changed since the gateway's last scrape round
        # (shared by the cluster's backends; a private set when built alone)
        self.changed: set[int] = set() if changed is None else changed
        self.changed.add(index)
        self.run_serial = 0  # bumped for every planned fused run
        self._pending: StepResult | None = None
        self._run_start_s = 0.0
        self._num_run_steps = 0  # planned fused steps, not yet committed
        self.last_step_start_s = math.inf  # when the planned run's last step starts
        self.pending_swap_s = 0.0  # LoRA swaps the next step (or run) pays for (sim.lora)
        self._step_swap_s = 0.0  # the swap time inside the step in progress

    def _new_core(self) -> EngineCore:
        core = EngineCore(self.model.engine_config, self.model.timer)
        if self.kv_events is not None:
            self.kv_sink = self.kv_events.new_sink(self.backend_id)
            core.scheduler.block_manager.kv_sink = self.kv_sink
        return core

    def _touch(self) -> None:
        self.state_version += 1
        self.changed.add(self.index)

    @property
    def is_alive(self) -> bool:
        return self.core is not None

    @property
    def kv_usage(self) -> float:
        return 0.0 if self.core is None else self.core.kv_usage

    def add(self, request: SimRequest) -> None:
        """Queue the request's sequence (raises ``RequestError`` like the engine)."""
        core, seq = self.core, request.seq
        if core is None or seq is None:
            raise RuntimeError("add on a dead backend or without a sequence")  # a sim bug
        if core.scheduler.block_manager.tiers is not None and isinstance(seq, SimSequence):
            seq.keep_runs_shared()  # its own evicted runs must reach the tiers (sequence.py)
        core.add(seq)
        self._touch()
        self.requests[seq.seq_id] = request
        self.awaiting_first_token[seq.seq_id] = request

    def release(self, seq_id: str) -> bool:
        """Free the KV blocks a finished prefill leg held (False: none held, or dead)."""
        core = self.core
        if core is None or not core.release(seq_id):
            return False
        self._touch()
        return True

    # -- stepping --------------------------------------------------------------------
    def start(self, now_s: float) -> float | None:
        """Begin the next step (or fused run) if there is work; returns its end time."""
        core = self.core
        self.is_busy = False
        self.work_start_s = now_s
        if core is None or not core.has_unfinished():
            return None
        swap_s, self.pending_swap_s = self.pending_swap_s * self.slowdown, 0.0
        self._step_swap_s += swap_s
        now_s += swap_s  # the adapters load before the step computes
        if self.is_fast_forward:
            num_steps = core.max_fast_forward_steps()
            if num_steps >= 2:
                duration_s = core.fast_forward_time_s(num_steps)
                before_last_s = core.fast_forward_time_s(num_steps - 1)
                self._run_start_s, self._num_run_steps = now_s, num_steps
                self.run_serial += 1
                self.last_step_start_s = now_s + before_last_s * self.slowdown
                return self._busy_until(now_s + duration_s * self.slowdown)
        result = core.step()
        self._touch()
        if result.num_steps == 0:
            return None  # nothing schedulable (cannot happen with a valid queue)
        for seq in result.started:  # their engine queue time ends as the step starts
            request = self.requests[seq.seq_id]
            request.queue_s = now_s - request.engine_add_s
        self._pending = result
        self.num_steps += 1
        return self._busy_until(now_s + result.duration_s * self.slowdown)

    def _busy_until(self, end_s: float) -> float:
        self.is_busy = True
        self.step_end_s = end_s
        return end_s

    def finish_step(self) -> StepResult | None:
        """The result of the step (or run) ending now; commits a run not yet synced."""
        if self._num_run_steps:
            self._commit_run(self._num_run_steps)
        result, self._pending = self._pending, None
        self.busy_s += self._step_swap_s
        self._step_swap_s = 0.0
        if result is not None:
            self.busy_s += result.duration_s * self.slowdown
        return result

    def busy_s_at(self, now_s: float) -> float:
        """Busy time up to ``now_s``: finished steps plus the part of the one in progress
        (``busy_s`` alone grows only when a step ends, a fused run of seconds at once)."""
        if not self.is_busy:
            return self.busy_s
        return self.busy_s + max(0.0, min(now_s, self.step_end_s) - self.work_start_s)

    def sync(self, now_s: float) -> float | None:
        """Commit the fused steps started by ``now_s``; returns the new end if it moved."""
        num_planned = self._num_run_steps
        core = self.core
        if not num_planned or core is None:
            return None
        elapsed_s = (now_s - self._run_start_s) / self.slowdown
        num_steps = min(num_planned, core.fast_forward_steps_within(elapsed_s) + 1)
        result = self._commit_run(num_steps)
        if num_steps == num_planned:
            return None  # the scheduled end stays right
        self.generation += 1
        return self._busy_until(self._run_start_s + result.duration_s * self.slowdown)

    def _commit_run(self, num_steps: int) -> StepResult:
        core = self.core
        if core is None:
            raise RuntimeError("commit on a dead backend")  # a simulator bug, never input
        result = core.advance(num_steps)
        self.last_step_start_s = math.inf
        self._touch()
        self.num_steps += num_steps
        self.num_fused_steps += num_steps
        self._pending = result
        self._num_run_steps = 0
        return result

    # -- faults ----------------------------------------------------------------------
    def die(self) -> list[SimRequest]:
        """Drop the engine; returns the requests it held (the caller fails them)."""
        held = list(self.requests.values())
        self.core = None
        if self.kv_events is not None:
            self.kv_events.engine_lost(self.backend_id, self.kv_sink)
            self.kv_sink = None
        self.requests = {}
        self.awaiting_first_token = {}
        self._reset_work()
        return held

    def recover(self) -> None:
        """A fresh engine (empty cache) and the configured slowdown."""
        if self.core is None:
            self.core = self._new_core()
            self._touch()
        self.slowdown = self.model.base_slowdown

    def _reset_work(self) -> None:
        self._touch()
        self.generation += 1
        self.is_busy = False
        self._pending = None
        self._num_run_steps = 0
        self.last_step_start_s = math.inf
