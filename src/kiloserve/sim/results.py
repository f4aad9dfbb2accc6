"""Streaming metrics of a simulation: compact per-request arrays, an ITL histogram and
downsampled per-backend time series, summarised in the bench ``summary.json`` schema.

Memory is bounded by design: a successful request costs 22 bytes (float32 TTFT, TPOT
and E2E in ms, uint32 input and output tokens, uint16 backend index), a failed one a
counter increment; full ``RequestRecord`` objects and the routing sequence are kept
only with ``keep_records``. ITL is pooled in a log histogram (0.5% bins), because a
fused run of k decode steps is recorded as k gaps of its mean step time (see
docs/simulator.md). Time series keep at most ``2 * max_num_points`` samples: when full,
neighbours are averaged and the sampling interval doubles.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kiloserve.results.metrics import (
    PERCENTILES,
    SCHEMA_VERSION,
    Slo,
    is_good,
    latency_stats,
    p95_std_across,
)
from kiloserve.results.records import RequestRecord

__all__ = ["ItlHistogram", "MetricsCollector", "TimeSeries", "itl_bin"]

LatencyStats = dict[str, float | None]

_ITL_MIN_S = 1e-6
_ITL_BINS_PER_DECADE = 460  # bin width ~0.5%
_ITL_NUM_BINS = _ITL_BINS_PER_DECADE * 10  # 1 us .. 10,000 s


def itl_bin(gap_s: float) -> int:
    """The histogram bin of a gap of ``gap_s`` seconds (> 0)."""
    index = int(math.log10(max(gap_s, _ITL_MIN_S) / _ITL_MIN_S) * _ITL_BINS_PER_DECADE)
    return min(index, _ITL_NUM_BINS - 1)


class ItlHistogram:
    """Weighted log histogram of inter-token gaps (seconds in, ms stats out)."""

    def __init__(self) -> None:
        self.counts: dict[int, float] = {}  # bin index -> weight (sparse: few bins used)
        self.total_weight = 0.0
        self.total_ms = 0.0
        self.total_sq_ms = 0.0

    def add(self, gap_s: float, weight: int) -> None:
        if weight > 0 and gap_s > 0:
            self.add_at(itl_bin(gap_s), gap_s * 1000.0, weight)

    def add_at(self, index: int, gap_ms: float, weight: int) -> None:
        """``add`` with the bin (``itl_bin``) already known; weight and gap > 0."""
        self.counts[index] = self.counts.get(index, 0.0) + weight
        self.total_weight += weight
        self.total_ms += gap_ms * weight
        self.total_sq_ms += gap_ms * gap_ms * weight

    def stats(self) -> LatencyStats:
        keys = ["mean", "std", *(f"p{p}" for p in PERCENTILES)]
        if self.total_weight <= 0:
            return dict.fromkeys(keys)
        mean = self.total_ms / self.total_weight
        var = max(0.0, self.total_sq_ms / self.total_weight - mean * mean)
        out: LatencyStats = {"mean": mean, "std": math.sqrt(var)}
        # Empty bins add 0.0 to a dense cumsum, so the first bin reaching a target is
        # the same over the used bins only (the answer is a used bin: targets are > 0).
        indices = sorted(self.counts)
        cumulative = np.cumsum(np.asarray([self.counts[i] for i in indices], dtype=np.float64))
        for p in PERCENTILES:
            pos = int(np.searchsorted(cumulative, self.total_weight * p / 100.0))
            index = indices[pos] if pos < len(indices) else _ITL_NUM_BINS - 1
            centre = (index + 0.5) / _ITL_BINS_PER_DECADE
            out[f"p{p}"] = _ITL_MIN_S * 10.0**centre * 1000.0
        return out


@dataclass(slots=True)
class TimeSeries:
    """Per-backend samples (utilisation and KV usage), halved in resolution when full."""

    num_backends: int
    interval_s: float
    max_num_points: int = 200
    times_s: list[float] = field(default_factory=list)
    utilisation: list[list[float]] = field(default_factory=list)
    kv_usage: list[list[float]] = field(default_factory=list)
    next_s: float = 0.0

    def add(self, now_s: float, utilisation: list[float], kv_usage: list[float]) -> None:
        self.times_s.append(now_s)
        self.utilisation.append(utilisation)
        self.kv_usage.append(kv_usage)
        self.next_s = now_s + self.interval_s
        if len(self.times_s) >= 2 * self.max_num_points:
            self._halve()

    def _halve(self) -> None:
        self.times_s = self.times_s[1::2]
        self.utilisation = [_mean_rows(a, b) for a, b in _pairs(self.utilisation)]
        self.kv_usage = [_mean_rows(a, b) for a, b in _pairs(self.kv_usage)]
        self.interval_s *= 2.0
        self.next_s = self.times_s[-1] + self.interval_s

    def to_dict(self, backend_ids: Sequence[str]) -> dict[str, object]:
        return {
            "interval_s": self.interval_s,
            "t_s": [round(t, 4) for t in self.times_s],
            "utilisation": _columns(backend_ids, self.utilisation),
            "kv_usage": _columns(backend_ids, self.kv_usage),
        }


def _columns(backend_ids: Sequence[str], rows: list[list[float]]) -> dict[str, list[float]]:
    """Per-backend columns of row-major samples, rounded for JSON."""
    if not rows:
        return {b: [] for b in backend_ids}
    columns = zip(*rows, strict=True)
    return {b: [round(v, 4) for v in col] for b, col in zip(backend_ids, columns, strict=True)}


def _pairs(rows: list[list[float]]) -> list[tuple[list[float], list[float]]]:
    return [(rows[i], rows[i + 1]) for i in range(0, len(rows) - 1, 2)]


def _mean_rows(a: list[float], b: list[float]) -> list[float]:
    return [(x + y) / 2.0 for x, y in zip(a, b, strict=True)]


class MetricsCollector:
    """Everything a simulation measures, one ``add_*`` call at a time."""

    def __init__(
        self, backend_ids: Sequence[str], slo: Slo | None = None, *, keep_records: bool = False
    ) -> None:
        self.backend_ids = list(backend_ids)
        self.slo = slo if slo is not None and not slo.is_empty else None
        self.keep_records = keep_records
        self.ttft_ms = array("f")
        self.tpot_ms = array("f")  # NaN for single-token requests
        self.e2e_ms = array("f")
        self.input_tokens = array("I")
        self.output_tokens = array("I")
        self.backend_index = array("H")
        self.num_failed_by_backend = [0] * len(self.backend_ids)
        self.num_failed_unrouted = 0
        self.errors: Counter[str] = Counter()
        self.num_good = 0
        self.itl = ItlHistogram()
        self.itl_by_backend = [ItlHistogram() for _ in self.backend_ids]
        self.records: list[RequestRecord] = []
        self.routing: list[tuple[str, str]] = []
        self.last_completion_s = 0.0
        # KV transfers of split requests (disaggregated prefill/decode), in ms; the
        # summary reports them when the cluster has P/D pools (``has_kv_transfers``)
        self.has_kv_transfers = False
        self.kv_transfer_ms = array("f")

    @property
    def num_ok(self) -> int:
        return len(self.e2e_ms)

    @property
    def num_failed(self) -> int:
        return sum(self.num_failed_by_backend) + self.num_failed_unrouted

    @property
    def needs_records(self) -> bool:
        """Whether ``add_ok`` needs a ``RequestRecord`` (kept, or judged by an SLO);
        otherwise ``add_ok_values`` takes the numbers alone."""
        return self.keep_records or self.slo is not None

    def add_ok(self, record: RequestRecord, backend_index: int, now_s: float) -> None:
        """A completed request (``ttft_s``, ``e2e_s`` and ``output_tokens`` are set)."""
        self.add_ok_values(
            record.ttft_s, record.e2e_s or 0.0, record.input_tokens, record.output_tokens,
            backend_index, now_s,
        )  # fmt: skip
        if self.slo is not None and is_good(record, self.slo):
            self.num_good += 1
        if self.keep_records:
            self.records.append(record)

    def add_ok_values(
        self,
        ttft_s: float | None,
        e2e_s: float,
        input_tokens: int,
        output_tokens: int,
        backend_index: int,
        now_s: float,
    ) -> None:
        """A completed request, without a record (``RequestRecord.tpot_s``'s rule)."""
        self.ttft_ms.append((ttft_s or 0.0) * 1000.0)
        self.e2e_ms.append(e2e_s * 1000.0)
        if output_tokens <= 1 or ttft_s is None:
            self.tpot_ms.append(math.nan)
        else:
            self.tpot_ms.append((e2e_s - ttft_s) / (output_tokens - 1) * 1000.0)
        self.input_tokens.append(input_tokens)
        self.output_tokens.append(output_tokens)
        self.backend_index.append(backend_index)
        self.last_completion_s = max(self.last_completion_s, now_s)

    def add_failed(self, record: RequestRecord, backend_index: int | None, now_s: float) -> None:
        """A failed request (``backend_index`` None: no backend was tried)."""
        if backend_index is None:
            self.num_failed_unrouted += 1
        else:
            self.num_failed_by_backend[backend_index] += 1
        self.errors[record.error or "unknown error"] += 1
        self._finish(record, now_s)

    def _finish(self, record: RequestRecord, now_s: float) -> None:
        self.last_completion_s = max(self.last_completion_s, now_s)
        if self.keep_records:
            self.records.append(record)

    def add_routing(self, request_id: str, backend_id: str) -> None:
        if self.keep_records:
            self.routing.append((request_id, backend_id))

    def add_kv_transfer(self, transfer_s: float) -> None:
        """One prefill -> decode KV transfer of ``transfer_s`` seconds."""
        self.kv_transfer_ms.append(transfer_s * 1000.0)

    def add_itl(self, backend_index: int, gap_s: float, weight: int) -> None:
        if weight <= 0 or gap_s <= 0:
            return
        index, gap_ms = itl_bin(gap_s), gap_s * 1000.0  # one bin lookup for both
        self.itl.add_at(index, gap_ms, weight)
        self.itl_by_backend[backend_index].add_at(index, gap_ms, weight)

    # -- summary -------------------------------------------------------------------
    def summary(self, duration_s: float) -> dict[str, object]:
        """The bench ``summary.json`` fields (latencies, totals, goodput, per backend)."""
        backend = np.frombuffer(self.backend_index, dtype=np.uint16)
        ok_mask = np.ones(backend.size, dtype=bool)
        out: dict[str, object] = {"schema_version": SCHEMA_VERSION}
        out |= self._latencies(ok_mask, self.itl)
        if self.has_kv_transfers:
            out["kv_transfer_ms"] = _stats(np.frombuffer(self.kv_transfer_ms, dtype=np.float32))
        num_ok, num_failed = self.num_ok, self.num_failed
        total = num_ok + num_failed
        duration_s = max(duration_s, 1e-9)
        num_in = int(np.frombuffer(self.input_tokens, dtype=np.uint32).sum(dtype=np.int64))
        num_out = int(np.frombuffer(self.output_tokens, dtype=np.uint32).sum(dtype=np.int64))
        out |= {
            "requests_ok": num_ok,
            "requests_failed": num_failed,
            "timeouts": 0,
            "error_rate": num_failed / total if total else 0.0,
            "request_throughput": num_ok / duration_s,
            "output_token_throughput": num_out / duration_s,
            "total_token_throughput": (num_in + num_out) / duration_s,
            "input_tokens_total": num_in,
            "output_tokens_total": num_out,
            "duration_s": duration_s,
        }
        if self.slo is not None:
            out["goodput"] = self.num_good / duration_s
            out["slo"] = self.slo.to_dict()
            out["slo_attainment"] = self.num_good / total if total else 0.0
        out |= self._per_backend(backend)
        out["errors"] = dict(self.errors.most_common(5))
        return out

    def _latencies(self, mask: np.ndarray, itl: ItlHistogram) -> dict[str, LatencyStats]:
        tpot = np.frombuffer(self.tpot_ms, dtype=np.float32)[mask]
        return {
            "ttft_ms": _stats(np.frombuffer(self.ttft_ms, dtype=np.float32)[mask]),
            "tpot_ms": _stats(tpot[~np.isnan(tpot)]),
            "itl_ms": itl.stats(),
            "e2e_ms": _stats(np.frombuffer(self.e2e_ms, dtype=np.float32)[mask]),
        }

    def _per_backend(self, backend: np.ndarray) -> dict[str, object]:
        counts = np.bincount(backend, minlength=len(self.backend_ids))
        per_backend: dict[str, dict[str, object]] = {}
        order = sorted(range(len(self.backend_ids)), key=lambda i: self.backend_ids[i])
        for i in order:
            num_ok, num_failed = int(counts[i]), self.num_failed_by_backend[i]
            if num_ok + num_failed == 0:
                continue
            block: dict[str, object] = dict(self._latencies(backend == i, self.itl_by_backend[i]))
            block |= {"count": num_ok + num_failed, "requests_ok": num_ok}
            block["requests_failed"] = num_failed
            per_backend[self.backend_ids[i]] = block
        if self.num_failed_unrouted:
            empty = np.zeros(backend.size, dtype=bool)
            block = dict(self._latencies(empty, ItlHistogram()))
            block |= {"count": self.num_failed_unrouted, "requests_ok": 0}
            block["requests_failed"] = self.num_failed_unrouted
            per_backend["unknown"] = block
        return {
            "per_backend": per_backend,
            "p95_std_across_backends_ms": p95_std_across(per_backend, "e2e_ms"),
            "ttft_p95_std_across_backends_ms": p95_std_across(per_backend, "ttft_ms"),
        }


def _stats(values: np.ndarray) -> LatencyStats:
    return latency_stats(values.astype(np.float64))
