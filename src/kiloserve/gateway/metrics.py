"""Prometheus metrics of one gateway app (S5.3), on a per-app ``CollectorRegistry``.

Counters and histograms are plain Python on the hot path and exported on collection;
per-backend gauges (in-flight, health, effective weight, staleness, scrape errors)
are read from the live backend table only when ``/metrics`` is scraped.

``kiloserve_gateway_backend_prefix_cache_queries_tokens{backend}`` and
``..._hits_tokens{backend}`` mirror the engine's own cumulative prefix-cache counters
(vLLM ``prefix_cache_queries_total`` / ``_hits_total``) as last scraped, only for
backends that report them. They are gauges, not counters: they copy another
process's counter, which starts again from 0 when the engine restarts.

Deployment records (S5.5) are info-style gauges equal to 1:
``kiloserve_gateway_info{version, config_hash}`` and one
``kiloserve_backend_info{backend, model, version, gpu, engine, engine_version,
model_root, max_model_len}`` per backend and model (models as discovered from the
backend or configured; ``version`` and ``gpu`` from its config; the engine's kind and
version, model root and context length as the engine reports them, gateway/inventory.py,
"" until collected).

KV-cache events (docs/kv-events.md), read from ``table.kv_cache`` at collection time:
per backend ``kiloserve_kv_events_total``, ``_kv_event_batches_total``,
``_kv_event_gaps_total``, ``_kv_event_resyncs_total`` (gaps the replay could not close,
and losses), ``_kv_event_restarts_total``, ``_kv_event_bad_messages_total`` and
``kiloserve_kv_index_mode{backend, mode}`` (1 for the current mode, 0 for the other);
``kiloserve_kv_index_blocks`` (distinct blocks in the exact index) and
``kiloserve_tokenizer_mode{model, mode}`` (from ``tokenizer_modes``, set by the app) and
``kiloserve_tokenizer_piece_cache{model}`` (1 while an exact tokenizer's piece cache is on;
0 when off: never on, or turned off by its runtime self-check; ``tokenizer_piece_cache``).
With a policy that keeps the approximate prefix index (``default``, ``scored``,
``prefix_affinity``): ``kiloserve_prefix_index_blocks`` and
``kiloserve_prefix_index_max_blocks`` (its cap; from ``prefix_index_fill``, set by the
app), so a soak can tell the index filling up to its cap from a leak (issue 15).

Disaggregated prefill/decode (``gateway/disagg.py``):
``kiloserve_gateway_disagg_requests_total{mode}`` (``split``, ``colocated``,
``fallback``) and the histogram ``kiloserve_gateway_disagg_prefill_seconds{backend}``
(a successful prefill leg's time, its backend's answer included).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kiloserve import __version__
from kiloserve.routing.table import BackendTable

__all__ = ["CONTENT_TYPE", "GatewayMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "kiloserve_gateway_"
LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5, 1.0, 2.5)


class _TableCollector(Collector):
    """Per-backend gauges read from the live table at collection time."""

    def __init__(self, table: BackendTable) -> None:
        self._table = table

    def collect(self) -> Iterator[Any]:
        now = time.monotonic()
        labels = ["backend"]
        fams = {
            "in_flight": GaugeMetricFamily(
                PREFIX + "in_flight", "requests in flight", labels=labels
            ),
            "healthy": GaugeMetricFamily(
                PREFIX + "backend_healthy", "1 if the backend is healthy", labels=labels
            ),
            "draining": GaugeMetricFamily(
                PREFIX + "backend_draining", "1 if the backend is draining", labels=labels
            ),
            "effective_weight": GaugeMetricFamily(
                PREFIX + "backend_effective_weight",
                "health factor on the weight (1: as configured)",
                labels=labels,
            ),
            "scrape_stale": GaugeMetricFamily(
                PREFIX + "scrape_stale", "1 if the engine metrics are stale", labels=labels
            ),
            "scrape_age_s": GaugeMetricFamily(
                PREFIX + "scrape_age_seconds", "age of the last good scrape", labels=labels
            ),
        }
        errors = CounterMetricFamily(
            PREFIX + "scrape_errors", "failed engine metric scrapes", labels=labels
        )
        queries = GaugeMetricFamily(
            PREFIX + "backend_prefix_cache_queries_tokens",
            "the engine's prefix-cache queries counter (tokens), as last scraped",
            labels=labels,
        )
        hits = GaugeMetricFamily(
            PREFIX + "backend_prefix_cache_hits_tokens",
            "the engine's prefix-cache hits counter (tokens), as last scraped",
            labels=labels,
        )
        for bid in self._table.backend_ids():
            rec = self._table.record(bid)
            s = rec.state
            fams["in_flight"].add_metric([bid], s.in_flight)
            fams["healthy"].add_metric([bid], 1.0 if s.healthy else 0.0)
            fams["draining"].add_metric([bid], 1.0 if s.draining else 0.0)
            fams["effective_weight"].add_metric([bid], s.effective_weight)
            fams["scrape_stale"].add_metric([bid], 1.0 if s.scrape_stale else 0.0)
            last = rec.last_scrape_ok_s
            fams["scrape_age_s"].add_metric([bid], float("inf") if last is None else now - last)
            errors.add_metric([bid], rec.num_scrape_errors_total)
            if rec.prefix_queries_tokens is not None and rec.prefix_hits_tokens is not None:
                queries.add_metric([bid], rec.prefix_queries_tokens)
                hits.add_metric([bid], rec.prefix_hits_tokens)
        yield from fams.values()
        yield errors
        yield queries
        yield hits


_INVENTORY_LABELS = ("engine", "engine_version", "model_root", "max_model_len")


def _inventory_labels(inventory: Mapping[str, Any], scraped_engine: str | None) -> list[str]:
    """engine, engine_version, model_root, max_model_len ("" when not known)."""
    max_len = inventory.get("max_model_len")
    return [
        str(inventory.get("engine") or scraped_engine or ""),
        str(inventory.get("engine_version", "")),
        str(inventory.get("model_root", "")),
        "" if max_len is None else str(max_len),
    ]


class _InfoCollector(Collector):
    """Deployment records: the gateway's version and config hash, each backend's model."""

    def __init__(self, table: BackendTable, version: str, config_hash: str) -> None:
        self._table = table
        self.labels = [version, config_hash]

    def collect(self) -> Iterator[Any]:
        gateway = GaugeMetricFamily(
            PREFIX + "info", "gateway version and config hash (always 1)",
            labels=["version", "config_hash"],
        )  # fmt: skip
        gateway.add_metric(self.labels, 1.0)
        backends = GaugeMetricFamily(
            "kiloserve_backend_info",
            "backend model, version, GPU, engine and its version (always 1)",
            labels=["backend", "model", "version", "gpu", *_INVENTORY_LABELS],
        )
        for bid in self._table.backend_ids():
            rec = self._table.record(bid)
            s = rec.state
            engine = _inventory_labels(rec.inventory, rec.engine)
            for model in sorted(s.models) or [""]:
                backends.add_metric([bid, model, s.version, s.gpu, *engine], 1.0)
        yield gateway
        yield backends


_KV_MODES = ("exact", "approximate")


class _KvCollector(Collector):
    """KV-event feeds, the exact index and the tokenizer modes, read at collection time."""

    def __init__(self, metrics: GatewayMetrics, table: BackendTable) -> None:
        self._m = metrics
        self._table = table

    def collect(self) -> Iterator[Any]:
        cache = self._table.kv_cache
        labels = ["backend"]
        counters = {
            "events": CounterMetricFamily(
                "kiloserve_kv_events", "KV-cache events applied to the exact index", labels=labels
            ),
            "batches": CounterMetricFamily(
                "kiloserve_kv_event_batches", "KV event batches applied", labels=labels
            ),
            "gaps": CounterMetricFamily(
                "kiloserve_kv_event_gaps", "KV event sequence gaps seen", labels=labels
            ),
            "resyncs": CounterMetricFamily(
                "kiloserve_kv_event_resyncs",
                "KV event gaps the replay could not close, and lost streams (entries dropped)",
                labels=labels,
            ),
            "restarts": CounterMetricFamily(
                "kiloserve_kv_event_restarts", "KV event publisher restarts seen", labels=labels
            ),
        }
        bad = CounterMetricFamily(
            "kiloserve_kv_event_bad_messages",
            "KV event messages that did not decode",
            labels=labels,
        )
        for feed in cache.feeds() if cache is not None else ():
            c, bid = feed.counters, [feed.backend_id]
            counters["events"].add_metric(bid, c.events)
            counters["batches"].add_metric(bid, c.batches)
            counters["gaps"].add_metric(bid, c.gaps)
            counters["resyncs"].add_metric(bid, c.resyncs + c.losses)
            counters["restarts"].add_metric(bid, c.restarts)
        for backend_id, num in self._m.kv_bad_messages.items():
            bad.add_metric([backend_id], num)
        yield from counters.values()
        yield bad
        yield from self._gauges()

    def _gauges(self) -> Iterator[Any]:
        cache = self._table.kv_cache
        mode = GaugeMetricFamily(
            "kiloserve_kv_index_mode", "1 for the backend's current prefix index mode",
            labels=["backend", "mode"],
        )  # fmt: skip
        for backend_id in self._table.backend_ids():
            current: str = cache.mode(backend_id) if cache is not None else "approximate"
            for name in _KV_MODES:
                mode.add_metric([backend_id, name], 1.0 if name == current else 0.0)
        blocks = GaugeMetricFamily(
            "kiloserve_kv_index_blocks", "distinct blocks in the exact (KV event) index"
        )
        blocks.add_metric([], cache.index.num_blocks if cache is not None else 0)
        tokenizer = GaugeMetricFamily(
            "kiloserve_tokenizer_mode",
            "1 for the model's token counting: exact (its tokenizer) or approximate",
            labels=["model", "mode"],
        )  # fmt: skip
        for model, tok_mode in sorted(self._m.tokenizer_modes().items()):
            for name in dict.fromkeys((*_KV_MODES, tok_mode)):
                tokenizer.add_metric([model, name], 1.0 if name == tok_mode else 0.0)
        pieces = GaugeMetricFamily(
            "kiloserve_tokenizer_piece_cache",
            "1 while the model's exact tokenizer caches prompt pieces, 0 when it is off",
            labels=["model"],
        )
        for model, state in sorted(self._m.tokenizer_piece_cache().items()):
            pieces.add_metric([model], 1.0 if state.get("state") == "on" else 0.0)
        yield from (mode, blocks, tokenizer, pieces)
        fill = self._m.prefix_index_fill()
        if fill is not None:
            num, cap = fill
            yield GaugeMetricFamily(
                "kiloserve_prefix_index_blocks",
                "blocks in the policy's approximate prefix index (what this gateway sent where)",
                value=num,
            )
            yield GaugeMetricFamily(
                "kiloserve_prefix_index_max_blocks",
                "the approximate prefix index's cap (policy param max_num_blocks)",
                value=cap,
            )


class _Histogram:
    """A cheap histogram (bucket counts + sum) for one label set."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out


class _HotPathCollector(Collector):
    """Exports the counters and histograms the hot path updates as plain Python."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Any]:
        m = self._m
        yield _counter("requests", "requests by model, backend and status",
                       ["model", "backend", "status"], m.requests)  # fmt: skip
        yield _counter("retries", "retries to a fallback backend, by failed backend and reason",
                       ["backend", "reason"], m.retries)  # fmt: skip
        yield _counter("migrations", "mid-stream failovers to another backend, by reason",
                       ["reason"], m.migrations)  # fmt: skip
        tokens = CounterMetricFamily(
            PREFIX + "migrated_tokens", "delivered tokens replayed as prompt by migrations"
        )
        tokens.add_metric([], m.migrated_tokens)
        yield tokens
        yield _counter("routing_decisions", "routing decisions by policy and chosen backend",
                       ["policy", "backend"], m.decisions)  # fmt: skip
        yield _histogram("ttft_seconds", "time to first token", m.ttft)
        yield _histogram("inter_token_seconds", "gap between relayed stream chunks", m.itl)
        yield _histogram("e2e_seconds", "end-to-end request latency", m.e2e)
        yield _counter("disagg_requests", "P/D requests by mode: split, colocated, fallback",
                       ["mode"], m.disagg_requests)  # fmt: skip
        yield _histogram("disagg_prefill_seconds", "prefill leg time of split requests",
                         m.prefill_leg)  # fmt: skip


def _counter(
    name: str, doc: str, labels: list[str], values: dict[tuple[str, ...], int]
) -> CounterMetricFamily:
    fam = CounterMetricFamily(PREFIX + name, doc, labels=labels)
    for key, value in values.items():
        fam.add_metric(list(key), value)
    return fam


def _histogram(name: str, doc: str, values: dict[str, _Histogram]) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(PREFIX + name, doc, labels=["backend"])
    for backend, h in values.items():
        fam.add_metric([backend], h.cumulative(), sum_value=h.total)
    return fam


class GatewayMetrics:
    """All gateway metrics; ``render()`` returns the exposition text.

    The hot path only bumps dict entries (no locks, no label lookups); the values are
    turned into Prometheus families when ``/metrics`` is read.
    """

    def __init__(self, table: BackendTable, *, config_hash: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests: dict[tuple[str, ...], int] = {}
        self.retries: dict[tuple[str, ...], int] = {}
        self.decisions: dict[tuple[str, ...], int] = {}
        self.migrations: dict[tuple[str, ...], int] = {}
        self.migrated_tokens = 0
        self.ttft: dict[str, _Histogram] = {}
        self.itl: dict[str, _Histogram] = {}
        self.e2e: dict[str, _Histogram] = {}
        self.disagg_requests: dict[tuple[str, ...], int] = {}
        self.prefill_leg: dict[str, _Histogram] = {}
        self.kv_bad_messages: dict[str, int] = {}
        # model -> "exact" | "approximate" (the app sets the profiler's)
        self.tokenizer_modes: Callable[[], Mapping[str, str]] = dict
        # model -> its exact tokenizer's piece cache state (ExactTokenizer.describe)
        self.tokenizer_piece_cache: Callable[[], Mapping[str, Mapping[str, Any]]] = dict
        # (blocks, cap) of the policy's approximate prefix index, None without one
        self.prefix_index_fill: Callable[[], tuple[int, int] | None] = lambda: None
        self.registry.register(_HotPathCollector(self))
        self.registry.register(_TableCollector(table))
        self._info = _InfoCollector(table, __version__, config_hash)
        self.registry.register(self._info)
        self.registry.register(_KvCollector(self, table))

    def set_config_hash(self, config_hash: str) -> None:
        """The ``config_hash`` label of ``kiloserve_gateway_info`` (after a reload)."""
        self._info.labels[1] = config_hash

    @staticmethod
    def _inc(counts: dict[tuple[str, ...], int], key: tuple[str, ...]) -> None:
        counts[key] = counts.get(key, 0) + 1

    @staticmethod
    def _hist(hists: dict[str, _Histogram], backend: str, bounds: tuple[float, ...]) -> _Histogram:
        h = hists.get(backend)
        if h is None:
            h = hists[backend] = _Histogram(bounds)
        return h

    def request_done(self, model: str, backend: str, status: int) -> None:
        self._inc(self.requests, (model, backend, str(status)))

    def observe_ttft(self, backend: str, seconds: float) -> None:
        self._hist(self.ttft, backend, LATENCY_BUCKETS_S).observe(seconds)

    def observe_itl(self, backend: str, seconds: float) -> None:
        self._hist(self.itl, backend, ITL_BUCKETS_S).observe(seconds)

    def observe_e2e(self, backend: str, seconds: float) -> None:
        self._hist(self.e2e, backend, LATENCY_BUCKETS_S).observe(seconds)

    def disagg(self, mode: str) -> None:
        """A request for a model with P/D backends: ``split``, ``colocated``, ``fallback``."""
        self._inc(self.disagg_requests, (mode,))

    def observe_prefill_leg(self, backend: str, seconds: float) -> None:
        self._hist(self.prefill_leg, backend, LATENCY_BUCKETS_S).observe(seconds)

    def retry(self, backend: str, reason: str) -> None:
        self._inc(self.retries, (backend, reason))

    def migration(self, reason: str, replayed_tokens: int) -> None:
        """A stream continued on another backend (``reason``: crash, error, stall)."""
        self._inc(self.migrations, (reason,))
        self.migrated_tokens += replayed_tokens

    def kv_bad_message(self, backend: str) -> int:
        """A KV event message from ``backend`` did not decode; the count so far."""
        num = self.kv_bad_messages[backend] = self.kv_bad_messages.get(backend, 0) + 1
        return num

    def decision(self, policy: str, backend: str) -> None:
        self._inc(self.decisions, (policy, backend))

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
