"""The twin's Prometheus metrics, named and labelled as vLLM's (``model_name``, ``engine``).

Everything lives in a per-twin ``CollectorRegistry`` (never the global one). Gauges and
counters that the engine core already tracks (running / waiting requests, KV usage,
prefix-cache queries and hits, preemptions) are read from a stats callback at scrape
time; request-level counters and histograms are updated by the twin as tokens flow.
Bucket boundaries are vLLM's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiloserve.engine.kv_metrics import KvMetrics

__all__ = [
    "E2E_BUCKETS_S",
    "ITL_BUCKETS_S",
    "TTFT_BUCKETS_S",
    "EngineStats",
    "LagTracker",
    "TwinMetrics",
    "read_engine_stats",
]

TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort")
LAG_WARN_S = 0.05
LAG_WARN_AFTER_S = 2.0
LAG_WARN_EVERY_S = 30.0

logger = logging.getLogger(__name__)
_LABELS = ("model_name", "engine")


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine core's counters at one instant."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    num_preemptions_total: int


class StatsSource(Protocol):
    """What ``EngineCore`` exposes for metrics."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def prefix_cache_queries_tokens(self) -> int: ...
    @property
    def prefix_cache_hits_tokens(self) -> int: ...
    @property
    def num_preemptions_total(self) -> int: ...


def read_engine_stats(core: StatsSource) -> EngineStats:
    """Snapshot an engine core's stats."""
    return EngineStats(
        num_running=core.num_running,
        num_waiting=core.num_waiting,
        kv_usage=core.kv_usage,
        prefix_cache_queries_tokens=core.prefix_cache_queries_tokens,
        prefix_cache_hits_tokens=core.prefix_cache_hits_tokens,
        num_preemptions_total=core.num_preemptions_total,
    )


class _EngineStatsCollector(Collector):
    """Reads ``EngineStats`` at scrape time and exposes them under vLLM's names."""

    def __init__(self, stats_fn: Callable[[], EngineStats], labels: list[str]) -> None:
        self._stats_fn = stats_fn
        self._labels = labels

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=list(_LABELS))
        family.add_metric(self._labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=list(_LABELS))
        family.add_metric(self._labels, value)
        return family

    def collect(self) -> Iterator[Metric]:
        s = self._stats_fn()
        yield self._gauge("vllm:num_requests_running", "Requests in the batch.", s.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting.", s.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100%).", s.kv_usage)
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix-cache queries, in tokens.",
            s.prefix_cache_queries_tokens,
        )
        yield self._counter(
            "vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", s.prefix_cache_hits_tokens
        )
        yield self._counter(
            "vllm:num_preemptions", "Cumulative preemptions.", s.num_preemptions_total
        )


ThermalReading = Callable[[], tuple[float | None, float]]


class _ThermalCollector(Collector):
    """The thermal fault's modelled GPU temperature and clock, read at scrape time.

    The clock ratio is always exported (1 without the fault); the temperature only
    while a thermal fault is set (otherwise nothing models it)."""

    def __init__(self, reading_fn: ThermalReading) -> None:
        self._reading_fn = reading_fn

    def collect(self) -> Iterator[Metric]:
        temperature_c, clock_ratio = self._reading_fn()
        if temperature_c is not None:
            yield GaugeMetricFamily(
                "kiloserve_twin_gpu_temperature_celsius",
                "Modelled GPU temperature (thermal fault; absent when not set).",
                value=temperature_c,
            )
        yield GaugeMetricFamily(
            "kiloserve_twin_gpu_clock_ratio",
            "Modelled GPU clock as a share of full speed (< 1 while thermally throttled).",
            value=clock_ratio,
        )


class TwinMetrics:
    """All metrics of one twin, in its own registry."""

    def __init__(
        self,
        model_name: str,
        stats_fn: Callable[[], EngineStats],
        thermal_fn: ThermalReading | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = [model_name, "0"]
        self.registry.register(_EngineStatsCollector(stats_fn, labels))
        if thermal_fn is not None:
            self.registry.register(_ThermalCollector(thermal_fn))
        reg = self.registry
        self._prompt = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed.", _LABELS, registry=reg
        ).labels(*labels)
        self._generation = Counter(
            "vllm:generation_tokens", "Generation tokens processed.", _LABELS, registry=reg
        ).labels(*labels)
        success = Counter(
            "vllm:request_success",
            "Finished requests by reason.",
            (*_LABELS, "finished_reason"),
            registry=reg,
        )
        self._success = {r: success.labels(*labels, r) for r in FINISHED_REASONS}
        self._ttft = self._histogram("vllm:time_to_first_token_seconds", TTFT_BUCKETS_S, labels)
        self._itl = self._histogram("vllm:inter_token_latency_seconds", ITL_BUCKETS_S, labels)
        self._e2e = self._histogram("vllm:e2e_request_latency_seconds", E2E_BUCKETS_S, labels)
        self._queue = self._histogram("vllm:request_queue_time_seconds", E2E_BUCKETS_S, labels)
        self._lag = Gauge(
            "kiloserve_twin_loop_lag_seconds",
            "How far the real-time loop runs behind the modelled step deadlines.",
            registry=reg,
        )
        self.kv = KvMetrics(reg, labels)  # P/D transfers and held KV (kv_metrics.py)

    def set_cache_config(self, config: dict[str, str]) -> None:
        """vLLM's ``vllm:cache_config_info`` (its cache config as labels, value 1), which
        a gateway's inventory reads (``gateway/inventory.py``)."""
        info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            sorted(config), registry=self.registry,
        )  # fmt: skip
        info.labels(**config).set(1)

    def _histogram(self, name: str, buckets: tuple[float, ...], labels: list[str]) -> Histogram:
        doc = f"Histogram of {name.removeprefix('vllm:').replace('_', ' ')}."
        family = Histogram(name, doc, _LABELS, buckets=buckets, registry=self.registry)
        return family.labels(*labels)

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self._ttft.observe(ttft_s)
        self._prompt.inc(num_prompt_tokens)

    def on_scheduled(self, queue_s: float) -> None:
        """A request left the waiting queue after ``queue_s`` (vLLM's queue time)."""
        self._queue.observe(queue_s)

    def on_tokens(self, num_tokens: int, itl_s: float | None) -> None:
        """``num_tokens`` generated in one step; ``itl_s`` is the gap since the previous one."""
        self._generation.inc(num_tokens)
        if itl_s is not None:
            self._itl.observe(itl_s)

    def on_finished(self, finished_reason: str, e2e_s: float) -> None:
        self._success[finished_reason].inc()
        if finished_reason != "abort":
            self._e2e.observe(e2e_s)

    def set_loop_lag(self, lag_s: float) -> None:
        self._lag.set(lag_s)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class LagTracker:
    """Exports the loop lag and warns (rate-limited) when it stays high."""

    def __init__(self, metrics: TwinMetrics) -> None:
        self._metrics = metrics
        self._high_since_s: float | None = None
        self._last_warn_s = -LAG_WARN_EVERY_S

    def update(self, lag_s: float, now_s: float) -> None:
        self._metrics.set_loop_lag(lag_s)
        if lag_s < LAG_WARN_S:
            self._high_since_s = None
            return
        if self._high_since_s is None:
            self._high_since_s = now_s
        sustained = now_s - self._high_since_s >= LAG_WARN_AFTER_S
        if sustained and now_s - self._last_warn_s >= LAG_WARN_EVERY_S:
            self._last_warn_s = now_s
            logger.warning(
                "engine twin loop lags %.0f ms behind modelled step times (for %.1f s): "
                "the host CPU is the bottleneck, latencies are inflated",
                lag_s * 1e3,
                now_s - self._high_since_s,
            )
