"""The engine twin's real-time loop: the engine model, stepped on the wall clock.

One asyncio task per twin. While the engine core has work it repeats::

    result = core.step()                                # schedule + model one step
    deadline = step_start + result.duration_s * slowdown   # x thermal clock drop
    sleep until deadline                                # absolute: errors don't add up
    publish the step's KV events (if enabled)           # one batch, kvpublish
    hand each request its new tokens                    # wakes the HTTP handlers

``step_start`` is the previous step's deadline, so sleep jitter does not accumulate;
if the loop falls more than ``MAX_CATCHUP_S`` behind (CPU-bound) it re-anchors on the
clock instead of bursting to catch up. While behind it keeps stepping and yields to
the HTTP handlers every ``YIELD_EVERY_S`` of CPU, so each handler then writes the
tokens of several steps in one write. The lag is exported as
``kiloserve_twin_loop_lag_seconds`` and logged as a WARNING when it stays high
(``metrics.LagTracker``).

KV-cache events (``TwinConfig.kv_events_endpoint``): the block manager reports its
prefix-cache changes to a ``kvlog.KvEventLog``; after each step's sleep, when the
tokens go out, the loop drains it and publishes the events as one batch
(``kvpublish.KvEventPublisher``, vLLM's ZMQ format). With no endpoint neither module
(nor zmq) is imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kiloserve.catalog import get_gpu, get_model
from kiloserve.engine.core import EngineCore, StepTimer
from kiloserve.engine.faults import FaultInjector, FaultSet
from kiloserve.engine.kv_holds import DEFAULT_HOLD_TIMEOUT_S, KvHolds
from kiloserve.engine.lora import LoraModule, LoraRegistry
from kiloserve.engine.metrics import EngineStats, LagTracker, TwinMetrics, read_engine_stats
from kiloserve.engine.node_metrics import NodeModel
from kiloserve.engine.protocol import TokenizeFn, load_tokenizer
from kiloserve.engine.sequence import Sequence, SequenceStatus
from kiloserve.engine.setup import engine_config_for
from kiloserve.engine.twin_pd import TwinPd, check_pd_options, twin_pd_for
from kiloserve.errors import ConfigError

if TYPE_CHECKING:
    from kiloserve.engine.kvlog import KvEventLog
    from kiloserve.engine.kvpublish import KvEventPublisher

__all__ = [
    "DisconnectWatcher",
    "EngineCoreLike",
    "RequestStream",
    "Twin",
    "TwinConfig",
    "TwinLoop",
    "Watched",
    "build_twin",
]

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
MAX_CATCHUP_S = 0.25
YIELD_EVERY_S = 0.005
IDLE_POLL_S = 0.05


class StepResultLike(Protocol):
    @property
    def duration_s(self) -> float: ...
    @property
    def new_tokens(self) -> dict[str, int]: ...
    @property
    def finished(self) -> list[Sequence]: ...
    @property
    def started(self) -> list[Sequence]: ...


class EngineCoreLike(Protocol):
    """What the twin needs of ``kiloserve.engine.core.EngineCore``."""

    def add(self, seq: Sequence) -> None: ...
    def has_unfinished(self) -> bool: ...
    def step(self) -> StepResultLike: ...
    def abort(self, seq_id: str) -> object: ...
    def release(self, seq_id: str) -> object: ...


@dataclass(slots=True, eq=False)
class RequestStream:
    """One request's view of the engine: generated-token count and finish state."""

    seq_id: str
    num_prompt_tokens: int
    arrival_s: float
    is_notify_each_step: bool = True
    is_probe: bool = False  # a gateway health probe: left out of the metrics
    num_generated_tokens: int = 0
    finish_reason: str | None = None
    last_token_s: float | None = None
    kv_request_id: str | None = None  # a prefill leg's: held under this id when done
    _waiter: asyncio.Future[None] | None = field(default=None, repr=False)
    _seq: Sequence | None = field(default=None, repr=False)  # the engine's sequence

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_running(self) -> bool:
        """Scheduled and not finished (vLLM's running queue)."""
        return self._seq is not None and self._seq.status is SequenceStatus.RUNNING

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache served when the request was first scheduled
        (vLLM's ``num_cached_tokens``; 0 before then)."""
        return self._seq.num_cached_tokens if self._seq is not None else 0

    async def wait_beyond(self, num_seen_tokens: int) -> None:
        """Return once more than ``num_seen_tokens`` exist or the request finished."""
        if self.num_generated_tokens > num_seen_tokens or self.finish_reason is not None:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def notify(self) -> None:
        """Wake the handler waiting in ``wait_beyond`` (if any)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _NoMetrics:
    """Where a probe's metrics go: nowhere."""

    def on_scheduled(self, queue_s: float) -> None:
        return None

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        return None

    def on_tokens(self, num_tokens: int, itl_s: float | None) -> None:
        return None

    def on_finished(self, finished_reason: str, e2e_s: float) -> None:
        return None


_NO_METRICS = _NoMetrics()


class _HasTransport(Protocol):
    @property
    def transport(self) -> asyncio.BaseTransport | None: ...


@dataclass(slots=True, eq=False)
class Watched:
    """An in-flight HTTP request: its connection, a gone-event and its stream."""

    request: _HasTransport
    gone: asyncio.Event
    stream: RequestStream | None = None


class DisconnectWatcher:
    """Polls in-flight requests' connections; a vanished client aborts its request."""

    def __init__(self, loop: TwinLoop) -> None:
        self._loop = loop
        self._watched: dict[int, Watched] = {}  # by id() of the request

    def watch(self, request: _HasTransport) -> Watched:
        entry = Watched(request, asyncio.Event())
        self._watched[id(request)] = entry
        return entry

    def unwatch(self, request: _HasTransport) -> None:
        self._watched.pop(id(request), None)

    def check(self) -> None:
        for key, entry in list(self._watched.items()):
            transport = entry.request.transport
            if transport is None or transport.is_closing():
                del self._watched[key]
                self._gone(entry)

    def _gone(self, entry: Watched) -> None:
        entry.gone.set()
        if entry.stream is not None:
            self._loop.abort(entry.stream)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            self.check()


class TwinLoop:
    """Runs an engine core in real time and feeds the requests' token streams."""

    def __init__(
        self,
        core: EngineCoreLike,
        metrics: TwinMetrics,
        faults: FaultInjector,
        *,
        stats_fn: Callable[[], EngineStats],
        block_size: int = 16,
        api_overhead_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        kv_events: tuple[KvEventLog, KvEventPublisher] | None = None,
        holds: KvHolds | None = None,
    ) -> None:
        self._core = core
        self._metrics = metrics
        self._faults = faults
        self._stats_fn = stats_fn
        self._block_size = block_size
        self.api_overhead_s = api_overhead_s
        self._clock = clock
        self._sleep = sleep  # with ``clock``, replaceable so tests can fake time
        self._streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lag = LagTracker(metrics)
        self._num_requests = 0
        self._kv_events = kv_events  # the engine's event log and where its batches go
        self.holds = holds  # finished prefill legs keeping their KV (engine/kv_holds.py)
        if holds is not None:  # freed held KV may let a waiting request in: step now
            holds.on_freed = self._wake.set
        self.failure: BaseException | None = None  # set if the loop died
        self.pending_swap_s = 0.0  # LoRA loads (engine/lora.py) the next step pays for

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="twin-loop")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for stream in list(self._streams.values()):
            self.abort(stream)

    def stats(self) -> EngineStats:
        return self._stats_fn()

    @property
    def num_active(self) -> int:
        return len(self._streams)

    async def submit(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        stop_reason: str,
        *,
        is_notify_each_step: bool = True,
        is_probe: bool = False,
        hold_request_id: str | None = None,
        num_transferred_tokens: int = 0,
        transfer_s: float = 0.0,
    ) -> RequestStream:
        """Queue a request (after the modelled API overhead) and return its stream; a
        probe's (``is_probe``) tokens and finish are left out of the metrics.

        P/D legs: ``hold_request_id`` (a prefill leg) keeps the finished sequence's KV
        in ``holds`` under that id (``stream.kv_request_id`` has the id it got);
        ``num_transferred_tokens`` (a decode leg) is the prompt KV pulled from the
        prefill engine, which takes ``transfer_s`` first (the request has arrived:
        its TTFT includes the transfer, as vLLM's does)."""
        if self.failure is not None:
            raise RuntimeError("the engine twin loop has failed") from self.failure
        arrival_s = self._clock()
        self._num_requests += 1
        seq_id = f"seq-{self._num_requests}"
        stream = RequestStream(
            seq_id, len(prompt_token_ids), arrival_s, is_notify_each_step, is_probe
        )
        self._streams[seq_id] = stream
        seq = Sequence(
            seq_id,
            prompt_token_ids,
            max_tokens,
            arrival_s=arrival_s,
            stop_reason=stop_reason,
            block_size=self._block_size,
            num_transferred_tokens=num_transferred_tokens,
            hold_on_finish=hold_request_id is not None and self.holds is not None,
        )
        stream._seq = seq
        stream.kv_request_id = hold_request_id
        try:
            if self.api_overhead_s + transfer_s > 0:
                await asyncio.sleep(self.api_overhead_s + transfer_s)
            self._core.add(seq)
        except BaseException:  # invalid request, or the handler was cancelled
            self._streams.pop(seq_id, None)
            raise
        self._wake.set()
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Abort an unfinished request (client gone): frees its KV blocks at once."""
        if stream.is_finished:
            return
        if self._streams.pop(stream.seq_id, None) is not None:
            with contextlib.suppress(KeyError):
                self._core.abort(stream.seq_id)
        now_s = self._clock()
        stream.finish_reason = "abort"
        self._metrics_of(stream).on_finished("abort", now_s - stream.arrival_s)
        stream.notify()

    async def _run(self) -> None:
        try:
            await self._run_steps()
        except Exception as exc:  # a bug in the engine model: fail loudly, not silently
            logger.exception("engine twin loop failed; the twin now answers 500")
            self.failure = exc
            for stream in list(self._streams.values()):
                self.abort(stream)

    async def _run_steps(self) -> None:
        deadline_s: float | None = None
        last_yield_s = self._clock()
        while True:
            if not self._core.has_unfinished():
                deadline_s = None
                self._lag.update(0.0, self._clock())
                await self._wait_for_work(None)
                last_yield_s = self._clock()
                continue
            now_s = self._clock()
            is_on_time = deadline_s is not None and now_s - deadline_s < MAX_CATCHUP_S
            start_s = deadline_s if is_on_time and deadline_s is not None else now_s
            result = self._core.step()
            if result.duration_s <= 0 and not result.new_tokens and not result.finished:
                deadline_s = None
                await self._wait_for_work(IDLE_POLL_S)  # nothing schedulable yet
                continue
            self._note_started(result.started, start_s)
            swap_s, self.pending_swap_s = self.pending_swap_s, 0.0
            deadline_s = start_s + (result.duration_s + swap_s) * self._faults.slowdown
            self._faults.on_step(start_s, deadline_s)  # the thermal model's busy time
            delay_s = deadline_s - self._clock()
            if delay_s > 0:
                await self._sleep(delay_s)
                last_yield_s = self._clock()
            elif self._clock() - last_yield_s >= YIELD_EVERY_S:
                await asyncio.sleep(0)
                last_yield_s = self._clock()
            now_s = self._clock()
            self._lag.update(max(0.0, now_s - deadline_s), now_s)
            if self._kv_events is not None:
                self._publish_kv_events(self._kv_events)
            self._deliver(result, now_s)

    def _note_started(self, started: list[Sequence], start_s: float) -> None:
        """Queue time (arrival to first schedule) of the sequences leaving the queue."""
        for seq in started:
            stream = self._streams.get(seq.seq_id)
            if stream is not None:
                self._metrics_of(stream).on_scheduled(max(0.0, start_s - stream.arrival_s))

    @staticmethod
    def _publish_kv_events(kv_events: tuple[KvEventLog, KvEventPublisher]) -> None:
        """The step's KV-cache events as one batch (none: nothing is sent)."""
        log, publisher = kv_events
        events = log.drain()
        if events:
            publisher.publish(events)

    async def _wait_for_work(self, timeout_s: float | None) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout_s)

    def _metrics_of(self, stream: RequestStream) -> TwinMetrics | _NoMetrics:
        return _NO_METRICS if stream.is_probe else self._metrics

    def _deliver(self, result: StepResultLike, now_s: float) -> None:
        streams = self._streams
        for seq_id, num_new in result.new_tokens.items():
            stream = streams.get(seq_id)
            if stream is None or num_new <= 0:
                continue
            metrics = self._metrics_of(stream)
            if stream.last_token_s is None:
                metrics.on_first_token(now_s - stream.arrival_s, stream.num_prompt_tokens)
                metrics.on_tokens(num_new, None)
            else:
                metrics.on_tokens(num_new, now_s - stream.last_token_s)
            stream.last_token_s = now_s
            stream.num_generated_tokens += num_new
            if stream.is_notify_each_step:
                stream.notify()
        for seq in result.finished:
            stream = streams.pop(seq.seq_id, None)
            if stream is None:
                if seq.hold_on_finish:
                    self._core.release(seq.seq_id)  # nobody will hand its KV over
                continue
            reason = seq.finish_reason or seq.stop_reason
            if seq.hold_on_finish and self.holds is not None:
                request_id = stream.kv_request_id or seq.seq_id
                stream.kv_request_id = self.holds.hold(request_id, seq.seq_id, seq.block_table)
            stream.finish_reason = reason
            self._metrics_of(stream).on_finished(reason, now_s - stream.arrival_s)
            stream.notify()


@dataclass(frozen=True, slots=True)
class TwinConfig:
    """Everything ``kiloserve engine`` takes; ``None`` means vLLM's default for the GPU."""

    gpu: str
    model: str
    tp: int = 1
    quant: str = "bf16"
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.92
    tokenizer_path: str | None = None
    faults: FaultSet = field(default_factory=FaultSet)
    seed: int = 0
    api_overhead_s: float | None = None  # None: the step-time model's figure, if any
    num_gpu_blocks_override: int | None = None  # KV blocks (null block included), as vLLM
    kv_events_endpoint: str | None = None  # ZMQ PUB address the twin binds (None: off)
    kv_events_replay_endpoint: str | None = None  # ZMQ ROUTER address for replays
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details, as vLLM
    enable_lora: bool = False  # serve LoRA adapters (engine/lora.py)
    lora_modules: tuple[LoraModule, ...] = ()  # adapters served from the start
    max_loras: int = 1  # adapters resident in GPU slots (one batch), as vLLM
    max_cpu_loras: int | None = None  # adapters in the CPU cache (None: max_loras)
    allow_runtime_lora_updating: bool = False  # VLLM_ALLOW_RUNTIME_LORA_UPDATING
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP traces URL (None: off), as vLLM
    role: str = "both"  # P/D role: prefill | decode | both (engine/kv_params.py)
    kv_cpu_gib: float = 0.0  # CPU KV tier, GiB over all TP ranks (0: none)
    kv_remote_gib: float = 0.0  # remote KV tier, GiB (0: none)
    kv_link: str = "network"  # the link a decode leg pulls KV over: nvlink|network|pcie
    kv_hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S  # a prefill leg's KV is freed after


@dataclass(slots=True, eq=False)
class Twin:
    """One assembled twin: engine loop, metrics, faults and request-facing facts."""

    config: TwinConfig
    model_name: str
    max_model_len: int
    tokenize: TokenizeFn
    loop: TwinLoop
    metrics: TwinMetrics
    faults: FaultInjector
    created_s: int
    node: NodeModel  # the node page (GET /node/metrics): a dcgm-exporter stand-in
    kv_publisher: KvEventPublisher | None = None  # started and closed by the server
    lora: LoraRegistry | None = None  # with --enable-lora
    pd: TwinPd | None = None  # role, engine id, KV link, held prefills (twin_pd.py)


def build_twin(config: TwinConfig, timer: StepTimer | None = None) -> Twin:
    """Assemble a twin; raises ``CatalogError``, ``ConfigError`` or ``DoesNotFitError``.

    ``timer`` replaces the roofline ``StepTimeModel`` (tests use fixed step times).
    """
    gpu, model = get_gpu(config.gpu), get_model(config.model)
    check_pd_options(
        config.role, config.kv_link, config.kv_hold_timeout_s, config.kv_cpu_gib,
        config.kv_remote_gib,
    )  # fmt: skip
    engine_config, ledger = engine_config_for(
        gpu,
        model,
        config.tp,
        config.quant,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        num_gpu_blocks_override=config.num_gpu_blocks_override,
        kv_cpu_gib=config.kv_cpu_gib,
        kv_remote_gib=config.kv_remote_gib,
        role=config.role,
    )
    if timer is None:
        from kiloserve.engine.timing import StepTimeModel

        timer = StepTimeModel(gpu, model, config.tp, config.quant)
    core = EngineCore(engine_config, timer)
    name = config.served_model_name or model.name
    faults = FaultInjector(config.faults, config.seed)
    stats_fn = functools.partial(read_engine_stats, core)
    metrics = TwinMetrics(name, stats_fn, faults.thermal_reading)
    holds = KvHolds(core, config.kv_hold_timeout_s, lambda _held: metrics.kv.on_expired())
    pd = twin_pd_for(
        gpu, role=config.role, kv_link=config.kv_link, tp=config.tp, holds=holds,
        kv_bytes_per_token_per_gpu=ledger.kv_bytes_per_token_per_gpu,
    )  # fmt: skip
    metrics.kv.add_collector(core, holds, pd.role)
    if engine_config.has_kv_tiers:
        metrics.kv.add_tier_collector(core, config.tp)
    metrics.set_cache_config({
        "block_size": str(engine_config.block_size), "cache_dtype": "auto",
        "enable_prefix_caching": "True", "num_gpu_blocks": str(engine_config.num_blocks),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
    })  # fmt: skip
    overhead_s = config.api_overhead_s
    if overhead_s is None:
        overhead_s = float(getattr(timer, "per_request_api_overhead_s", 0.0))
    kv_events = _kv_events_for(config, core)
    loop = TwinLoop(
        core,
        metrics,
        faults,
        stats_fn=stats_fn,
        block_size=ledger.block_size,
        api_overhead_s=overhead_s,
        kv_events=kv_events,
        holds=holds,
    )
    tokenizer = load_tokenizer(config.tokenizer_path)
    created_s = int(time.time())
    publisher = kv_events[1] if kv_events is not None else None
    node = NodeModel(gpu, config.tp, ledger.kv_bytes_per_token_per_gpu, stats_fn, faults)
    return Twin(
        config, name, ledger.max_model_len, tokenizer, loop, metrics, faults, created_s, node,
        publisher, _lora_for(config, name), pd,
    )  # fmt: skip


def _lora_for(config: TwinConfig, name: str) -> LoraRegistry | None:
    if not config.enable_lora:
        if config.lora_modules:
            raise ConfigError("--lora-modules needs --enable-lora")
        return None
    cpu = config.max_cpu_loras if config.max_cpu_loras is not None else config.max_loras
    registry = LoraRegistry(name, config.max_loras, cpu)
    for module in config.lora_modules:
        registry.adapters[module.name] = module
    return registry


def _kv_events_for(
    config: TwinConfig, core: EngineCore
) -> tuple[KvEventLog, KvEventPublisher] | None:
    """The event log hooked into the block manager and its (unbound) publisher."""
    if config.kv_events_endpoint is None:
        if config.kv_events_replay_endpoint is not None:
            raise ConfigError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return None
    from kiloserve.engine.kvlog import KvEventLog
    from kiloserve.engine.kvpublish import KvEventPublisher

    log = KvEventLog(core.config.block_size)
    core.scheduler.block_manager.kv_sink = log
    publisher = KvEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint)
    return log, publisher
