"""The run's prefix-cache hit rate from the engines' own counters (``kiloserve bench``).

``run_bench`` reads the target's ``/metrics`` page before the first request and after
the last one, and reports the difference in tokens (as vLLM counts them:
``prefix_cache_hits / prefix_cache_queries``), summed over backends:

* ``source: "engine"``: the page has ``vllm:prefix_cache_queries_total`` (legacy
  ``vllm:gpu_prefix_cache_queries_total``): the bench points straight at a vLLM server
  or an engine twin; every series of the page (one per ``engine`` label) is one
  counter, and the page is one backend.
* ``source: "gateway"``: the page has ``kiloserve_gateway_backend_prefix_cache_*_tokens``
  (the engines' counters as the gateway last scraped them, one series per ``backend``).
  Those lag the engines by up to a scrape interval, so after the run the probe polls
  until every backend's ``kiloserve_gateway_scrape_age_seconds`` shows a scrape that
  happened after the last request ended (every 0.25 s, at most 10 s; on time-out the
  result carries what it has and a ``note``).

Per counter the delta is ``after - before``, or ``after`` alone when the counter went
down (the engine restarted) or was not there before (a backend that joined during
the run). A missing page (404, auth, connection error, not Prometheus text) or a page
with neither family gives ``None``: the bench never fails for it.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import aiohttp

from kiloserve.routing.engine_metrics import parse_samples

__all__ = [
    "ENGINE_HITS",
    "ENGINE_QUERIES",
    "GATEWAY_HITS",
    "GATEWAY_QUERIES",
    "SCRAPE_AGE",
    "CacheCounters",
    "PrefixCacheProbe",
    "parse_counters",
    "prefix_cache_delta",
]

# (current name, legacy name); the current one wins when a page has both
ENGINE_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
ENGINE_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
GATEWAY_QUERIES = "kiloserve_gateway_backend_prefix_cache_queries_tokens"
GATEWAY_HITS = "kiloserve_gateway_backend_prefix_cache_hits_tokens"
SCRAPE_AGE = "kiloserve_gateway_scrape_age_seconds"
_NAMES = (*ENGINE_QUERIES, *ENGINE_HITS, GATEWAY_QUERIES, GATEWAY_HITS, SCRAPE_AGE)

POLL_INTERVAL_S = 0.25
MAX_WAIT_S = 10.0
READ_TIMEOUT_S = 5.0

Labels = tuple[tuple[str, str], ...]
Samples = dict[str, dict[Labels, float]]  # metric name -> series labels -> value


@dataclass(frozen=True, slots=True)
class CacheCounters:
    """One reading of the prefix-cache counters, keyed by backend (gateway) or series
    (engine); ``scrape_age_s`` is the gateway's age of each backend's last scrape."""

    source: str  # "engine" | "gateway"
    queries: dict[str, float]
    hits: dict[str, float]
    scrape_age_s: dict[str, float] = field(default_factory=dict)


def _samples(text: str) -> Samples:
    """The series of the names we read (``routing.engine_metrics.parse_samples``: a
    line that cannot be read costs only itself); NaN values are skipped."""
    out: Samples = {}
    for name, labels, value in parse_samples(text):
        if name not in _NAMES or math.isnan(value):
            continue
        key = tuple(sorted(labels.items()))
        series = out.setdefault(name, {})
        series[key] = series.get(key, 0.0) + value
    return out


def _by_backend(series: dict[Labels, float]) -> dict[str, float]:
    """Series -> the value of their ``backend`` label (summed over any other labels)."""
    out: dict[str, float] = {}
    for labels, value in series.items():
        backend = dict(labels).get("backend", "")
        out[backend] = out.get(backend, 0.0) + value
    return out


def _by_series(series: dict[Labels, float]) -> dict[str, float]:
    """Series -> a readable key of all their labels (``engine=0,model_name=m``)."""
    return {",".join(f"{k}={v}" for k, v in labels): value for labels, value in series.items()}


def parse_counters(text: str) -> CacheCounters | None:
    """The prefix-cache counters of a ``/metrics`` page; None when it has neither
    the engine's nor the gateway's family."""
    samples = _samples(text)
    for queries_name, hits_name in zip(ENGINE_QUERIES, ENGINE_HITS, strict=True):
        if queries_name in samples:
            queries = _by_series(samples[queries_name])
            hits = _by_series(samples.get(hits_name, {}))
            return CacheCounters("engine", queries, {k: hits.get(k, 0.0) for k in queries})
    if GATEWAY_QUERIES in samples:
        queries = _by_backend(samples[GATEWAY_QUERIES])
        hits = _by_backend(samples.get(GATEWAY_HITS, {}))
        ages = _by_backend(samples.get(SCRAPE_AGE, {}))
        return CacheCounters("gateway", queries, {b: hits.get(b, 0.0) for b in queries}, ages)
    return None


def prefix_cache_delta(
    before: CacheCounters | None, after: CacheCounters | None, *, note: str | None = None
) -> dict[str, object] | None:
    """The run's ``prefix_cache`` block from the readings before and after it."""
    if before is None or after is None:
        return None
    same_source = before.source == after.source
    queries = hits = 0.0
    for key, q_after in after.queries.items():
        h_after = after.hits.get(key, 0.0)
        q_before = before.queries.get(key) if same_source else None
        h_before = before.hits.get(key) if same_source else None
        if q_before is None or h_before is None or q_after < q_before or h_after < h_before:
            queries, hits = queries + q_after, hits + h_after  # restarted, or new
        else:
            queries, hits = queries + q_after - q_before, hits + h_after - h_before
    out: dict[str, object] = {
        "queries_tokens": round(queries),
        "hits_tokens": round(hits),
        "hit_rate": min(1.0, hits / queries) if queries > 0 else None,
        "source": after.source,
        "backends": 1 if after.source == "engine" else len(after.queries),
    }
    if note is not None:
        out["note"] = note
    return out


class PrefixCacheProbe:
    """Reads ``base_url/metrics`` with the run's session; ``start`` before the first
    request, ``finish`` after the last one. Never raises for the server's answers."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self._session = session
        self._url = base_url.rstrip("/") + "/metrics"
        self._before: CacheCounters | None = None

    async def read(self) -> CacheCounters | None:
        """The counters on the page now; None when there is no usable page."""
        timeout = aiohttp.ClientTimeout(total=READ_TIMEOUT_S)
        headers = {"Accept": "text/plain"}
        try:
            async with self._session.get(self._url, headers=headers, timeout=timeout) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text(errors="replace")
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None
        return parse_counters(text)

    async def start(self) -> None:
        self._before = await self.read()

    async def finish(self, ended_s: float) -> dict[str, object] | None:
        """The run's block; ``ended_s`` is the ``time.perf_counter()`` when the last
        request ended (gateway counters must come from a scrape after it)."""
        if self._before is None:
            return None
        after, note = await self._read_after(ended_s)
        return prefix_cache_delta(self._before, after, note=note)

    async def _read_after(self, ended_s: float) -> tuple[CacheCounters | None, str | None]:
        deadline = time.perf_counter() + MAX_WAIT_S
        last: CacheCounters | None = None
        while True:
            sent_s = time.perf_counter()
            counters = await self.read()
            if counters is None:
                note = None if last is None else "metrics page lost while waiting for a scrape"
                return last, note
            if counters.source != "gateway":
                return counters, None
            last = counters
            # a backend's last scrape happened after the run ended when its age at
            # collection (no earlier than ``sent_s``) is below ``sent_s - ended_s``
            since_end_s = sent_s - ended_s
            behind = sorted(
                b for b in counters.queries
                if counters.scrape_age_s.get(b, math.inf) >= since_end_s
            )  # fmt: skip
            if not behind:
                return counters, None
            if time.perf_counter() + POLL_INTERVAL_S > deadline:
                return counters, (
                    f"no gateway scrape after the run within {MAX_WAIT_S:g} s for "
                    f"{', '.join(behind)}: their counts may miss the last requests"
                )
            await asyncio.sleep(POLL_INTERVAL_S)
