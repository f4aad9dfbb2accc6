"""Latency and throughput metrics with ``vllm bench serve`` definitions.

* TTFT: request start to the first non-empty chunk.
* TPOT: ``(E2E - TTFT) / (output_tokens - 1)``, only for requests with > 1 output token.
* ITL: every gap between consecutive non-empty chunks, pooled over all requests.
* E2E: request start to the last token chunk (vLLM's ``latency``; ``[DONE]`` follows
  at once), so TPOT is the mean gap between the first and the last token.
* request / output-token throughput: successful requests (their output tokens) per
  second of run time (first send to last completion).
* goodput: requests per second meeting *every* given SLO (a request with a single
  output token counts TPOT as 0, as vLLM does).

Successful requests enter every latency statistic; a request that hit the client's
per-request timeout also enters TTFT and E2E, at the time it waited (its first token's
time if that came, else the time until the timeout: a lower bound), so timeouts raise
the percentiles instead of vanishing from them. TPOT and ITL stay over successful
requests (a cut-off stream has no last token). Each latency is reported in ms as
mean / std / p50 / p90 / p95 / p99 (``numpy.percentile``, linear interpolation, as
vLLM). ``per_backend`` groups by the ``x-kiloserve-backend`` header (S5.3), and the
std-dev (population) of per-backend P95 measures routing imbalance (S1.2).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kiloserve.errors import ConfigError
from kiloserve.results.provenance import run_info
from kiloserve.results.records import BenchResult, RequestRecord

__all__ = [
    "LATENCY_KEYS",
    "PERCENTILES",
    "SCHEMA_VERSION",
    "SLO_UNIT_MS",
    "Slo",
    "is_good",
    "latency_stats",
    "p95_std_across",
    "parse_slo",
    "summarize",
    "tenant_moves",
]

SCHEMA_VERSION = 1
DISPATCH_WARN_P99_MS = 50.0
PERCENTILES = (50, 90, 95, 99)
LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
_SLO_PART = re.compile(r"^(ttft|tpot|e2e)=([0-9]*\.?[0-9]+)(us|ms|s)?$")
SLO_UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, None: 1.0}

LatencyStats = dict[str, float | None]


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives in ms; ``None`` means not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def is_empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None

    def to_dict(self) -> dict[str, float]:
        items = {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms}
        return {k: v for k, v in items.items() if v is not None}


def parse_slo(text: str) -> Slo:
    """Parse ``ttft=500ms,tpot=50ms,e2e=2s`` (units us, ms, s; bare numbers are ms)."""
    values: dict[str, float] = {}
    for part in "".join(text.split()).split(","):
        m = _SLO_PART.match(part)
        if m is None:
            raise ConfigError(f"bad SLO {part!r}; expected ttft|tpot|e2e=NUMBER[us|ms|s]")
        if m.group(1) in values:
            raise ConfigError(f"SLO {m.group(1)!r} given twice")
        values[m.group(1)] = float(m.group(2)) * SLO_UNIT_MS[m.group(3)]
    return Slo(values.get("ttft"), values.get("tpot"), values.get("e2e"))


def latency_stats(values_ms: Sequence[float] | np.ndarray) -> LatencyStats:
    """mean / std / p50 / p90 / p95 / p99 of ``values_ms`` (all None when empty)."""
    keys = ["mean", "std", *(f"p{p}" for p in PERCENTILES)]
    arr = np.asarray(values_ms, dtype=float)
    if arr.size == 0:
        return dict.fromkeys(keys)
    pct = np.percentile(arr, PERCENTILES)
    out: LatencyStats = {"mean": float(arr.mean()), "std": float(arr.std())}
    out |= {f"p{p}": float(v) for p, v in zip(PERCENTILES, pct, strict=True)}
    return out


def is_good(record: RequestRecord, slo: Slo) -> bool:
    """True when ``record`` succeeded and meets every SLO in ``slo``."""
    if not record.is_ok or record.ttft_s is None or record.e2e_s is None:
        return False
    tpot_ms = (record.tpot_s or 0.0) * 1000.0
    checks = (
        (slo.ttft_ms, record.ttft_s * 1000.0),
        (slo.tpot_ms, tpot_ms),
        (slo.e2e_ms, record.e2e_s * 1000.0),
    )
    return all(limit is None or value <= limit for limit, value in checks)


def latencies(records: Iterable[RequestRecord]) -> dict[str, LatencyStats]:
    """The four latency blocks: successful ``records``, timed-out ones in TTFT and E2E."""
    records = list(records)
    ok = [r for r in records if r.is_ok]
    timed_out = [r for r in records if r.is_timeout and r.e2e_s is not None]
    ttft = [r.ttft_s * 1000.0 for r in ok if r.ttft_s is not None]
    ttft += [_waited_for_first_token_s(r) * 1000.0 for r in timed_out]
    tpot = [t * 1000.0 for t in (r.tpot_s for r in ok) if t is not None]
    itl = [g * 1000.0 for r in ok for g in r.itl_s]
    e2e = [r.e2e_s * 1000.0 for r in ok + timed_out if r.e2e_s is not None]
    return {
        "ttft_ms": latency_stats(ttft),
        "tpot_ms": latency_stats(tpot),
        "itl_ms": latency_stats(itl),
        "e2e_ms": latency_stats(e2e),
    }


def _waited_for_first_token_s(record: RequestRecord) -> float:
    """A timed-out request's TTFT: its first token's, else the wait until the timeout."""
    if record.ttft_s is not None:
        return record.ttft_s
    return record.e2e_s if record.e2e_s is not None else 0.0


def summarize(
    result: BenchResult, slo: Slo | None = None, *, command: Sequence[str] | None = None
) -> dict[str, object]:
    """The ``summary.json`` dict (schema in docs/bench.md) for one run.

    ``command`` is the command line recorded for reproducibility (S5.5).
    """
    records = result.records
    ok = [r for r in records if r.is_ok]
    duration_s = max(result.duration_s, 1e-9)
    num_out = sum(r.output_tokens for r in ok)
    num_in = sum(r.input_tokens for r in ok)
    summary: dict[str, object] = {"schema_version": SCHEMA_VERSION, **latencies(records)}
    summary |= {
        "requests_ok": len(ok),
        "requests_failed": len(records) - len(ok),
        "timeouts": sum(1 for r in records if r.is_timeout),
        "error_rate": (len(records) - len(ok)) / len(records) if records else 0.0,
        "request_throughput": len(ok) / duration_s,
        "output_token_throughput": num_out / duration_s,
        "total_token_throughput": (num_in + num_out) / duration_s,
        "input_tokens_total": num_in,
        "output_tokens_total": num_out,
        "duration_s": result.duration_s,
    }
    if slo is not None and not slo.is_empty:
        num_good = sum(1 for r in records if is_good(r, slo))
        summary["goodput"] = num_good / duration_s
        summary["slo"] = slo.to_dict()
        summary["slo_attainment"] = num_good / len(records) if records else 0.0
    summary |= backend_breakdown(records)
    summary["errors"] = top_errors(records)
    summary["prefix_cache"] = result.prefix_cache
    slo_dict = slo.to_dict() if slo is not None else None
    summary |= run_info(result, slo_dict, command)
    summary |= dispatch_delay(result)
    return summary


def dispatch_delay(result: BenchResult) -> dict[str, object]:
    """Open loop only: how late requests were sent against their arrival times.

    A large delay means the client could not keep to the schedule (too slow, or a
    ``max_concurrency`` cap), so the offered load was lower than asked.
    """
    arrival = result.config.get("arrival")
    if not isinstance(arrival, dict) or arrival.get("mode") != "open":
        return {}
    delays_ms = [
        (r.start_s - r.scheduled_s) * 1000.0 for r in result.records if r.scheduled_s is not None
    ]
    stats = latency_stats(delays_ms)
    out: dict[str, object] = {"dispatch_delay_ms": stats}
    p99 = stats["p99"]
    if p99 is not None and p99 > DISPATCH_WARN_P99_MS:
        out["dispatch_warning"] = (
            f"requests were sent late (dispatch delay p99 {p99:.0f} ms): the offered load "
            "was lower than the arrival process asked for"
        )
    return out


def backend_breakdown(records: Sequence[RequestRecord]) -> dict[str, object]:
    """``per_backend`` blocks and the std-dev of per-backend P95 (E2E and TTFT)."""
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[r.backend or "unknown"].append(r)
    per_backend: dict[str, dict[str, object]] = {}
    for backend in sorted(groups):
        group = groups[backend]
        num_ok = sum(1 for r in group if r.is_ok)
        per_backend[backend] = {
            **latencies(group), "count": len(group), "requests_ok": num_ok,
            "requests_failed": len(group) - num_ok,
        }  # fmt: skip
    return {
        "per_backend": per_backend,
        "p95_std_across_backends_ms": p95_std_across(per_backend, "e2e_ms"),
        "ttft_p95_std_across_backends_ms": p95_std_across(per_backend, "ttft_ms"),
    }


def p95_std_across(per_backend: dict[str, dict[str, object]], key: str) -> float | None:
    """Population std-dev of the ``key`` P95 across backends (``unknown`` left out);
    None with fewer than two backends."""
    p95s = []
    for name, block in per_backend.items():
        stats = block[key]
        if name != "unknown" and isinstance(stats, dict) and stats.get("p95") is not None:
            p95s.append(float(stats["p95"]))
    return float(np.std(p95s)) if len(p95s) >= 2 else None


def top_errors(records: Iterable[RequestRecord], max_num_errors: int = 5) -> dict[str, int]:
    """The most frequent error messages and their counts."""
    counts = Counter(r.error or "unknown error" for r in records if not r.is_ok)
    return dict(counts.most_common(max_num_errors))


def tenant_moves(records: Iterable[RequestRecord]) -> int:
    """Requests of a prefix group (tenant) seen before, sent to a backend that never
    served it (each one a cold prefill an oracle of the engines' caches would not pay)."""
    served: dict[str | None, set[str | None]] = {}
    moves = 0
    for r in sorted(records, key=lambda r: r.scheduled_s or 0.0):
        backends = served.get(r.prefix_group)
        if backends is None:
            served[r.prefix_group] = {r.backend}
        elif r.backend not in backends:
            moves += 1
            backends.add(r.backend)
    return moves
