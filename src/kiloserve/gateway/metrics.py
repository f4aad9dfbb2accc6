"""Prometheus metrics of one gateway app (S5.3), on a per-app ``CollectorRegistry``.

Counters and histograms are updated on the hot path (labelled children are cached);
per-backend gauges (in-flight, health, effective weight, staleness, scrape errors)
are read from the live backend table only when ``/metrics`` is scraped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kiloserve.gateway.backends import BackendTable

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
                PREFIX + "backend_effective_weight", "weight used for routing", labels=labels
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
        yield from fams.values()
        yield errors


class GatewayMetrics:
    """All gateway metrics; ``render()`` returns the exposition text."""

    def __init__(self, table: BackendTable) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self._requests = Counter(
            PREFIX + "requests", "requests by model, backend and status",
            ["model", "backend", "status"], registry=r,
        )  # fmt: skip
        self._ttft = Histogram(
            PREFIX + "ttft_seconds", "time to first token", ["backend"],
            buckets=LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._itl = Histogram(
            PREFIX + "inter_token_seconds", "gap between relayed stream chunks", ["backend"],
            buckets=ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._e2e = Histogram(
            PREFIX + "e2e_seconds", "end-to-end request latency", ["backend"],
            buckets=LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._retries = Counter(
            PREFIX + "retries", "retries to a fallback backend, by failed backend and reason",
            ["backend", "reason"], registry=r,
        )  # fmt: skip
        self._decisions = Counter(
            PREFIX + "routing_decisions", "routing decisions by policy and chosen backend",
            ["policy", "backend"], registry=r,
        )  # fmt: skip
        r.register(_TableCollector(table))
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric._name, *labels)
        child = self._children.get(key)
        if child is None:
            child = metric.labels(*labels)
            self._children[key] = child
        return child

    def request_done(self, model: str, backend: str, status: int) -> None:
        self._child(self._requests, model, backend, str(status)).inc()

    def observe_ttft(self, backend: str, seconds: float) -> None:
        self._child(self._ttft, backend).observe(seconds)

    def observe_itl(self, backend: str, seconds: float) -> None:
        self._child(self._itl, backend).observe(seconds)

    def observe_e2e(self, backend: str, seconds: float) -> None:
        self._child(self._e2e, backend).observe(seconds)

    def retry(self, backend: str, reason: str) -> None:
        self._child(self._retries, backend, reason).inc()

    def decision(self, policy: str, backend: str) -> None:
        self._child(self._decisions, policy, backend).inc()

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
